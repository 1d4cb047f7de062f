"""The unquantized tiers: fp16 and bf16 (2 * kv_dim bytes per token per layer-side)."""

import mlx.core as mx

from . import layout
from .base import Component, TierCodec


class Float16Codec(TierCodec):
    """IEEE half precision, round to nearest even from the model's K/V dtype."""

    name = "fp16"
    kernel_layout = layout.KernelLayout(layout.FP16, 0, layout.VALUES)
    dtype = "float16"
    formula = "2 * kv_dim"

    def components(self, head_dim):
        return [Component("values", self.dtype, head_dim)]

    def encode(self, x, params):
        return {"values": x.astype(getattr(mx, self.dtype))}

    def decode(self, parts, params):
        return parts["values"].astype(mx.float32)

    def decode_stored(self, parts, params):
        return parts["values"], None  # as stored: no float32 copy

    def scores(self, q, parts, params):
        return q @ parts["values"].swapaxes(-1, -2)  # (n_pages, n_kv, R, P), promoted to float32

    def weighted_values(self, p, parts, params):
        return (p @ parts["values"]).sum(axis=0)  # (n_kv, R, D)


class BFloat16Codec(Float16Codec):
    """bfloat16 (8 exponent bits, 7 mantissa bits), round to nearest even."""

    name = "bf16"
    kernel_layout = layout.KernelLayout(layout.BF16, 0, layout.VALUES)
    dtype = "bfloat16"
