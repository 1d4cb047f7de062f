"""The Metal backend: the decode kernels of `cartridge.attention.kernels.metal` on Apple silicon.

They are compile-checked on Linux and verified against the portable path only on Apple hardware, so the
entry `needs_proof`: `auto` takes it for a (tier pair, head_dim) only once it has matched there
(`cartridge.attention.backends.proof`). The kernel module is imported lazily; if it is missing or fails to
import, the backend is unavailable.
"""

import importlib

import mlx.core as mx

from ...tiers.layout import layout_of
from .base import AttentionBackend, on_gpu

MODULE = "cartridge.attention.kernels.metal"


def kernels():
    """The kernel module, or None where it is absent or does not import."""
    try:
        return importlib.import_module(MODULE)
    except ImportError:
        return None


class Metal(AttentionBackend):
    """MLX's Metal device. Contract of the kernel module: `available()`, `supported(prefix, head_dim, mode)`,
    `lay_out(prefix)` (the layer's record) and `attend(record, prefix, queries, tail, scale, sinks, scratch)`
    (-> output or None), as `AttentionBackend.build` and `attend`."""

    name = "metal"
    device = "metal"
    policy = "fused"
    default_policy = "portable"  # unmeasured: MLX ops until a table or a proof says otherwise
    needs_proof = True

    def is_current(self):
        return on_gpu() and mx.metal.is_available()

    def available(self):
        module = kernels() if self.is_current() else None
        return module is not None and bool(module.available())

    def reads(self, codecs):
        return all(layout_of(c) is not None for c in codecs)

    def supports(self, prefix, head_dim, mode):
        module = kernels()
        return module is not None and bool(module.supported(prefix, head_dim, mode))

    def build(self, prefix):
        return kernels().lay_out(prefix)

    def attend(self, record, prefix, queries, tail, scale, sinks, scratch):
        return kernels().attend(record, prefix, queries, tail, scale, sinks, scratch)


METAL = Metal()
