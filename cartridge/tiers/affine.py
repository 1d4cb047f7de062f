"""Affine tiers: int8, int6 and mlx4g32 (MLX's affine quantized layout, group 32 along head_dim).

Decode is MLX's affine rule, `x = scale * q + bias` with q in 0 .. 2^bits - 1 and fp16 scale and bias
per group of 32. The encoder is ours (spec/FORMAT.md 6.2): the scale and bias are rounded to fp16
*before* the codes are chosen, so each code is the nearest level of the grid a reader will see
(`mx.quantize` picks codes against the unrounded float32 scale). The bias is the group minimum rounded
down to fp16 and the scale is rounded up, so the grid covers [min, max] and no value is clipped:
|x_hat - x| <= scale / 2 up to float32 rounding.
"""

import mlx.core as mx

from . import bitpack, layout
from .quantized import GroupQuantCodec


def _f16_toward(x, up):
    """Round float32 x to float16 toward +inf (up) or -inf (not up); returns float16."""
    h = x.astype(mx.float16)
    hf = h.astype(mx.float32)
    bits = h.view(mx.uint16).astype(mx.int32)
    negative = bits >= 0x8000
    if up:  # one ulp up: away from 0 for positives, toward 0 for negatives (-0 -> +smallest)
        miss = hf < x
        step = mx.where(negative, mx.where(bits == 0x8000, 1, bits - 1), bits + 1)
    else:  # one ulp down: +0 -> -smallest subnormal (0x8001)
        miss = hf > x
        step = mx.where(negative, bits + 1, mx.where(bits == 0, 0x8001, bits - 1))
    return mx.where(miss, step, bits).astype(mx.uint16).view(mx.float16)


def affine_encode(x, bits, group_size=32):
    """Affine-quantize x along its last axis with fp16 scales and biases chosen before the codes.

    Args:
        x (mx.array): (..., D) any float dtype; D a multiple of `group_size`.
        bits (int): 4, 6 or 8. group_size (int): elements per scale and bias. Default: 32.

    Returns:
        dict: "codes" uint32 (..., D*bits/32), "scales" and "biases" float16 (..., D/group_size).
    """
    *lead, d = x.shape
    levels = (1 << bits) - 1
    g = x.astype(mx.float32).reshape(*lead, d // group_size, group_size)  # (..., groups, 32)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    bias = _f16_toward(lo, up=False)
    scale = _f16_toward((hi - bias.astype(mx.float32)) / levels, up=True)
    s, b = scale.astype(mx.float32)[..., None], bias.astype(mx.float32)[..., None]
    q = mx.round((g - b) / mx.where(s > 0, s, 1))
    q = mx.where(s > 0, mx.clip(q, 0, levels), 0).astype(mx.uint32).reshape(*lead, d)
    return {"codes": bitpack.pack(q, bits), "scales": scale, "biases": bias}


class AffineCodec(GroupQuantCodec):
    """Affine group-32 tiers; `bits` set by the subclass."""

    mode = "affine"
    group_size = 32
    scale_dtype = "float16"
    has_biases = True
    scale_rule = "fp16_bias_down_scale_up"

    def encode(self, x, params):
        return affine_encode(x, self.bits, self.group_size)


class Int8Codec(AffineCodec):
    """int8: 8-bit affine, group 32: kv_dim + kv_dim/8 bytes per token per layer-side."""

    name = "int8"
    kernel_layout = layout.KernelLayout(layout.AFF8, 0, layout.AFFINE)
    bits = 8
    formula = "kv_dim + kv_dim/8"


class Int6Codec(AffineCodec):
    """int6: 6-bit affine, group 32: 3 * kv_dim/4 + kv_dim/8 bytes per token per layer-side."""

    name = "int6"
    kernel_layout = layout.KernelLayout(layout.AFF6, 0, layout.AFFINE)
    bits = 6
    formula = "3 * kv_dim/4 + kv_dim/8"


class Mlx4G32Codec(AffineCodec):
    """mlx4g32: 4-bit affine, group 32 (MLX's quantized-cache layout): kv_dim/2 + kv_dim/8 bytes."""

    name = "mlx4g32"
    kernel_layout = layout.KernelLayout(layout.AFF4, 0, layout.AFFINE)
    bits = 4
    formula = "kv_dim/2 + kv_dim/8"
