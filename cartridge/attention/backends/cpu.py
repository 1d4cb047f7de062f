"""The CPU device: portable and dense paths only (K codes unpacked to bytes under a budget:
`cartridge.attention.unpacked`; extend's prefill: `cartridge.attention.kernels.cpu`)."""

import mlx.core as mx

from .base import AttentionBackend


class Cpu(AttentionBackend):
    """MLX's CPU device; no fused kernel. Where unmeasured, `auto` decodes once: BLAS matmuls over dense pages
    are several times faster than MLX's scalar CPU dequantization (docs/performance.md "Memory on CPU")."""

    name = "cpu"
    device = "cpu"
    default_policy = "dequantize-once"

    def is_current(self):
        return mx.default_device() == mx.cpu

    def available(self):
        return self.is_current()

    def supports(self, prefix, head_dim, mode):
        return False


CPU = Cpu()
