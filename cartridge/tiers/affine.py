"""Affine tiers: int8, int6 and mlx4g32 (MLX's affine quantized layout, group 32 along head_dim).

Decode is MLX's affine rule, `x = scale * q + bias` with q in 0 .. 2^bits - 1 and fp16 scale and bias
per group of 32. The encoder is ours (spec/FORMAT.md 6.2): the scale and bias are rounded to fp16
*before* the codes are chosen, so each code is the nearest level of the grid a reader will see
(`mx.quantize` picks codes against the unrounded float32 scale). The bias is the group minimum rounded
down to fp16 and the scale is rounded up, so the grid covers [min, max] and no value is clipped:
|x_hat - x| <= scale / 2 up to float32 rounding.

On the CPU the decode unpacks the codes to bytes with shifts and masks (`byte_codes`) and applies the
scale and bias with elementwise MLX ops, instead of `mx.dequantize`, which MLX 0.32.4 runs there as scalar
code: one int6 side of 1,629 tokens x 3 KV heads x 64 took 24 ms by `mx.dequantize` and 1.9 ms so, int8 3.6
against 0.5 ms (the 2-core x86 machine of docs/performance.md; the values are the same, float32 scale * q + bias).
"""

import mlx.core as mx
import numpy as np

from . import bitpack, layout, score_aware
from .quantized import GroupQuantCodec


def f16_toward(x, up):
    """Round float32 to float16 toward +inf (`up`) or -inf (not `up`): the rounding of the affine tiers'
    scale and bias (kivi's too), so that the stored float16 range still covers the group.

    Args:
        x (mx.array): float32, any shape. up (bool): the direction.

    Returns:
        mx.array: float16, x's shape; the nearest float16 on that side of x (x itself where exact).
    """
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
    bias = f16_toward(lo, up=False)
    scale = f16_toward((hi - bias.astype(mx.float32)) / levels, up=True)
    s, b = scale.astype(mx.float32)[..., None], bias.astype(mx.float32)[..., None]
    q = mx.round((g - b) / mx.where(s > 0, s, 1))
    q = mx.where(s > 0, mx.clip(q, 0, levels), 0).astype(mx.uint32).reshape(*lead, d)
    return {"codes": bitpack.pack(q, bits), "scales": scale, "biases": bias}


class AffineGrid:
    """The affine grid of one group for `score_aware.feedback_round`: scale and bias chosen from the group's
    values by `affine_encode`'s rule, each code the nearest level of that fp16 grid."""

    def __init__(self, bits, group_size):
        self.levels, self.group = (1 << bits) - 1, group_size

    def start(self, block):
        """block (n_kv, T, group) float32 -> (scale, bias) float16 mx arrays (n_kv, T)."""
        g = mx.array(block)
        bias = f16_toward(g.min(axis=-1), up=False)
        scale = f16_toward((g.max(axis=-1) - bias.astype(mx.float32)) / self.levels, up=True)
        return scale, bias, np.array(scale.astype(mx.float32)), np.array(bias.astype(mx.float32))

    def nearest(self, column, state, i):
        """column (n_kv, T) float32 -> (scale * code + bias float32, code), each (n_kv, T)."""
        _, _, s, b = state
        q = np.round((column - b) / np.where(s > 0, s, 1))
        q = np.where(s > 0, np.clip(q, 0, self.levels), 0)
        return q * s + b, q


def affine_encode_weighted(x, weight, bits, group_size=32):
    """`affine_encode`'s components with the codes chosen for the score error under `weight` (`score_aware`).

    Args:
        x (mx.array): (n_kv, T, D) any float dtype. weight (np.ndarray): (n_kv, D, D) the queries' second moment.
        bits (int): 4, 6 or 8. group_size (int): elements per scale and bias. Default: 32.

    Returns:
        dict: as `affine_encode`.
    """
    codes, _, states = score_aware.feedback_round(np.array(x.astype(mx.float32)), weight, AffineGrid(bits, group_size))
    return {"codes": bitpack.pack(mx.array(codes), bits), "scales": mx.stack([s[0] for s in states], axis=-1),
            "biases": mx.stack([s[1] for s in states], axis=-1)}


def byte_codes(words, bits):
    """The codes of LSB-first packed words as one uint8 each.

    Args:
        words (mx.array): uint32 (..., D * bits / 32), as `affine_encode` packs them. bits (int): 4, 6 or 8.

    Returns:
        mx.array: uint8 (..., D); for 8 bits a view of the stored bytes (no copy).
    """
    b = words.view(mx.uint8)  # little-endian: byte i holds the lowest-numbered codes first
    if bits == 8:
        return b
    if bits == 4:
        # (..., D/2) -> (..., D/2, 2) -> (..., D): the low nibble is the earlier code
        return mx.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
    # 6 bits: every 3 bytes hold 4 codes; (..., 3D/4) -> (..., D/4, 3) -> one 24-bit word -> (..., D/4, 4)
    u = b.reshape(*b.shape[:-1], -1, 3).astype(mx.uint32)
    w = u[..., 0] | (u[..., 1] << 8) | (u[..., 2] << 16)
    codes = (w[..., None] >> mx.array([0, 6, 12, 18], dtype=mx.uint32)) & 63
    return codes.astype(mx.uint8).reshape(*b.shape[:-1], -1)


def affine_values(codes, scales, biases, group_size):
    """float32 scale * code + bias per group: codes uint8 (..., D), scales and biases (..., D / group_size)."""
    *lead, d = codes.shape
    # (..., D) -> (..., groups, group_size)
    g = codes.reshape(*lead, d // group_size, group_size).astype(mx.float32)
    return (g * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]).reshape(*lead, d)


class AffineCodec(GroupQuantCodec):
    """Affine group-32 tiers; `bits` set by the subclass."""

    mode = "affine"
    group_size = 32
    scale_dtype = "float16"
    has_biases = True
    scale_rule = "fp16_bias_down_scale_up"

    def encode(self, x, params):
        weight = score_aware.weight_of(params)
        if weight is not None:
            return affine_encode_weighted(x, weight, self.bits, self.group_size)
        return affine_encode(x, self.bits, self.group_size)

    def decode(self, parts, params):
        if mx.default_device() != mx.cpu:
            return super().decode(parts, params)
        codes = byte_codes(parts["codes"], self.bits)
        return affine_values(codes, parts["scales"], parts["biases"], self.group_size)


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
