"""The attention backends: one list (`REGISTRY`), queried by `cartridge.attention.policy` and `auto_table`.

An entry is an `AttentionBackend` (base.py): a device ("cpu", "cuda", "metal": where MLX runs, and `auto`'s
choice there without a measurement) or a kernel entry serving one attention policy ("portable", "dense" for
"dequantize-once", a device's "fused" kernel). A new backend is one module here and one line in `REGISTRY`;
one that has never run where it ships says `needs_proof` and is gated by `proof`.
"""

from .base import MODES, AttentionBackend
from .cpu import CPU
from .cuda import CUDA
from .dense import DENSE
from .metal import METAL
from .portable import PORTABLE

REGISTRY = [PORTABLE, DENSE, CPU, CUDA, METAL]
ORDER = ("fused", "portable", "dequantize-once")  # policies, as `allowed` lists them


def devices():
    """{device name: the policy `auto` takes there without a measurement}, from the device entries."""
    return {b.name: b.default_policy for b in REGISTRY if b.default_policy is not None}


def device():
    """The name of the device MLX runs on now (the first device entry that `is_current`; "cpu" if none)."""
    return next((b.name for b in REGISTRY if b.default_policy is not None and b.is_current()), CPU.name)


def kernel(dev):
    """The available fused-kernel entry of device `dev`, or None."""
    return next((b for b in REGISTRY if b.policy == "fused" and b.device == dev and b.available()), None)


def get(name):
    """The entry named `name`, or None."""
    return next((b for b in REGISTRY if b.name == name), None)


def policies(has_kernel):
    """The concrete policies in `ORDER`: every device's portable and dense paths, "fused" with `has_kernel`."""
    return tuple(p for p in ORDER if has_kernel or p != "fused")


__all__ = ["MODES", "ORDER", "REGISTRY", "AttentionBackend", "devices", "device", "get", "kernel", "policies"]
