"""kivi4: 4-bit affine K with per-channel groups along tokens (KIVI, Liu et al. 2024; spec/FORMAT.md 6.5).

K has a few outlier channels whose magnitude is stable across tokens; grouping along head_dim (mlx4g32)
lets one outlier set the scale of 31 typical values, while grouping one channel over G = 32 tokens gives
each channel its own scale. A stored prefix knows all its tokens at build time, so it can afford the
token-axis groups that a growing cache cannot.

Layout (per KV head): codes as mlx4g32 (one token's head_dim codes packed LSB first, 8 per uint32);
scales and biases (fp16) of token group g (tokens g*G .. g*G+G-1) are its head_dim per-channel values
spread over the group's G token rows, head_dim / G per row, in channel order. So every component is a
per-token width and pages hold whole groups: the page size must be a multiple of G. Scale and bias are
chosen as mlx4g32's (bias = group minimum rounded down to fp16, scale rounded up: no clipping).
"""

import mlx.core as mx
import numpy as np

from ..errors import InputError
from . import bitpack, layout, score_aware
from .affine import f16_toward
from .base import Component, FixedParamsCodec

TOKEN_GROUP = 32


class KiviGrid:
    """kivi4's grid for `score_aware.feedback_round`: one channel (column) at a time, its scale and bias per
    token group chosen from the column by `Kivi4Codec.encode`'s rule, each code the nearest level."""

    group = 1

    def __init__(self, token_group, levels):
        self.token_group, self.levels = token_group, levels

    def start(self, block):
        """block (n_kv, T, 1) -> (scale, bias) float16 (n_kv, T / G) and both as float32 (n_kv, T)."""
        n, t, _ = block.shape
        col = mx.array(block).reshape(n, t // self.token_group, self.token_group)
        bias = f16_toward(col.min(axis=-1), up=False)
        scale = f16_toward((col.max(axis=-1) - bias.astype(mx.float32)) / self.levels, up=True)
        spread = [np.repeat(np.array(a.astype(mx.float32)), self.token_group, axis=1) for a in (scale, bias)]
        return scale, bias, *spread

    def nearest(self, column, state, i):
        _, _, s, b = state
        q = np.round((column - b) / np.where(s > 0, s, 1))
        q = np.where(s > 0, np.clip(q, 0, self.levels), 0)
        return q * s + b, q


class Kivi4Codec(FixedParamsCodec):
    """kivi4: 4-bit codes, fp16 scale and bias per (channel, 32 tokens): kv_dim/2 + kv_dim/8 bytes."""

    name = "kivi4"
    kernel_layout = layout.KernelLayout(layout.KIVI4, 0, layout.AFFINE)
    formula = "kv_dim/2 + kv_dim/8"
    bits = 4
    token_group = TOKEN_GROUP

    def fixed_params(self):
        return {"mode": "affine_per_channel", "bits": self.bits, "token_group": self.token_group,
                "scale_rule": "fp16_bias_down_scale_up", "packing": "lsb_first"}

    def components(self, head_dim):
        per_row = head_dim // self.token_group
        return [Component("codes", "uint32", head_dim * self.bits // 32), Component("scales", "float16", per_row),
                Component("biases", "float16", per_row)]

    def check(self, n_kv_heads, head_dim):
        if head_dim % self.token_group or head_dim * self.bits % 32:
            raise InputError(f"tier {self.name}: head_dim {head_dim} is not a multiple of {self.token_group}")

    def check_page_size(self, page_size):
        """Raise InputError unless pages hold whole token groups."""
        if page_size % self.token_group:
            raise InputError(f"tier {self.name}: page size {page_size} is not a multiple of its token group "
                             f"{self.token_group}")

    def encode(self, x, params):
        n, t, d = x.shape
        g, levels = self.token_group, (1 << self.bits) - 1
        if t % g:
            raise InputError(f"tier {self.name}: {t} tokens are not whole groups of {g}")
        weight = score_aware.weight_of(params)
        if weight is not None:  # codes chosen for the score error (score_aware), one channel at a time
            codes, _, states = score_aware.feedback_round(np.array(x.astype(mx.float32)), weight, KiviGrid(g, levels))
            scale, bias = (mx.stack([s[i] for s in states], axis=-1) for i in (0, 1))  # (n_kv, groups, D)
            return {"codes": bitpack.pack(mx.array(codes), self.bits), "scales": scale.reshape(n, t, d // g),
                    "biases": bias.reshape(n, t, d // g)}
        xg = x.astype(mx.float32).reshape(n, t // g, g, d)  # (n_kv, groups, G, D)
        bias = f16_toward(xg.min(axis=2), up=False)  # (n_kv, groups, D)
        scale = f16_toward((xg.max(axis=2) - bias.astype(mx.float32)) / levels, up=True)
        s, b = scale.astype(mx.float32)[:, :, None, :], bias.astype(mx.float32)[:, :, None, :]
        q = mx.round((xg - b) / mx.where(s > 0, s, 1))
        q = mx.where(s > 0, mx.clip(q, 0, levels), 0).astype(mx.uint32).reshape(n, t, d)
        # (n_kv, groups, D) -> (n_kv, T, D / G): a group's channel values over its G token rows
        return {"codes": bitpack.pack(q, self.bits), "scales": scale.reshape(n, t, d // g),
                "biases": bias.reshape(n, t, d // g)}

    def decode(self, parts, params):
        codes = parts["codes"]
        *lead, t, w = codes.shape
        d, g = w * 32 // self.bits, self.token_group
        # the codes as exact floats: mlx4g32's packing, so mx.dequantize with unit scales (half the time of an
        # unpack through MLX ops on the CPU, the same values)
        ones = mx.ones((*lead, t, d // 32), dtype=mx.float32)
        q = mx.dequantize(codes, ones, mx.zeros_like(ones), group_size=32, bits=self.bits, dtype=mx.float32)
        q = q.reshape(*lead, t // g, g, d)
        # (..., T, D / G) -> (..., T / G, 1, D): per-channel scale and bias of each token group
        s = parts["scales"].astype(mx.float32).reshape(*lead, t // g, 1, d)
        b = parts["biases"].astype(mx.float32).reshape(*lead, t // g, 1, d)
        return (q * s + b).reshape(*lead, t, d)
