"""Block floating-point tiers, encoded by MLX's `mx.quantize` modes (spec/FORMAT.md 6.2).

- fp8: mode "mxfp8", E4M3 elements (one byte each, 4 per uint32), one E8M0 scale per 32.
- mxfp4: E2M1 elements (nibbles, 8 per uint32), one E8M0 scale per 32.
- nvfp4: E2M1 elements, one E4M3 scale per 16, and a per-(layer, side) float32 global scale (the
  tensor's absolute maximum), stored in params; decode multiplies by global_scale / (448 * 6).
Formats: OCP MX v1.0 and NVIDIA NVFP4; MLX's scale rule in shared/reference/kv-quant-algorithms.md 4.2.
"""

import mlx.core as mx
import numpy as np

from ..errors import CorruptCartridgeError
from . import bitpack, layout, score_aware
from .base import token_blocks
from .quantized import GroupQuantCodec

NVFP4_RANGE = 448.0 * 6.0  # E4M3 max * E2M1 max: MLX's nvfp4 global scale divisor


def abs_max(x, transform=None):
    """max |transform(x)| over every element of (n_kv_heads, T, head_dim), as a Python float, taken a block of
    tokens at a time (`token_blocks`) so that only one block's float32 copy is in memory: the maximum of the
    blocks' maxima is the whole side's, exactly (a NaN propagates as in one `mx.max`).

    Args:
        x (mx.array): any float dtype. transform (callable | None): per-token map applied to each block first.
    """
    maxima = []
    for block in token_blocks(x):
        y = block if transform is None else transform(block)
        maxima.append(mx.abs(y.astype(mx.float32)).max())
        mx.eval(maxima[-1])
    return float(mx.stack(maxima).max())


class MxGrid:
    """The grid of one MX / NV group for `score_aware.feedback_round`: the scale `mx.quantize` chooses for the
    group's values, each code the one of the 2^bits whose decoded value is nearest."""

    def __init__(self, codec, params):
        self.codec, self.params, self.group = codec, params, codec.group_size
        n_codes = 1 << codec.bits
        self.reps = -(-n_codes // self.group)  # groups of one scale that hold every code once
        every = np.arange(self.reps * self.group) % n_codes
        self.words = bitpack.pack(mx.array(every[None], dtype=mx.uint32), codec.bits)  # (1, W)

    def start(self, block):
        """block (n_kv, T, group) float32 -> (scales uint8 (n_kv, T), every code's value (n_kv, T, 2^bits))."""
        n, t, _ = block.shape
        _, scales = mx.quantize(mx.array(block), mode=self.codec.mode, **self.codec._global(self.params))
        rows = mx.repeat(scales.reshape(n * t, 1), self.reps, axis=1)  # one scale for every code's group
        words = mx.broadcast_to(self.words, (n * t, self.words.shape[1]))
        values = self.codec.scaled(mx.dequantize(words, rows, dtype=mx.float32, **self.codec.quantize_kwargs()), self.params)
        table = np.array(values)[:, :1 << self.codec.bits].reshape(n, t, -1)
        return scales.reshape(n, t), np.where(np.isnan(table), np.inf, table)  # fp8's NaN codes are never chosen

    def nearest(self, column, state, i):
        table = state[1]
        code = np.abs(table - column[..., None]).argmin(axis=-1)
        return np.take_along_axis(table, code[..., None], axis=-1)[..., 0], code


class MxCodec(GroupQuantCodec):
    """A tier encoded with `mx.quantize(mode=self.mode)` from float32."""

    scale_dtype = "uint8"
    has_biases = False
    scale_rule = "e8m0_ceil"

    def encode(self, x, params):
        weight = score_aware.weight_of(params)
        if weight is not None:  # the codes chosen for the score error (score_aware), the scales as mx.quantize's
            codes, _, states = score_aware.feedback_round(np.array(x.astype(mx.float32)), weight, MxGrid(self, params))
            return {"codes": bitpack.pack(mx.array(codes), self.bits), "scales": mx.stack([s[0] for s in states], -1)}
        codes, scales = mx.quantize(x.astype(mx.float32), mode=self.mode, **self._global(params))
        return {"codes": codes, "scales": scales}

    def _global(self, params):
        return {}


class Fp8Codec(MxCodec):
    """fp8: MX FP8 (E4M3 elements, E8M0 scale per 32): kv_dim + kv_dim/32 bytes."""

    name = "fp8"
    kernel_layout = layout.KernelLayout(layout.MXFP8, 0, ("codes", "scales"))
    formula = "kv_dim + kv_dim/32"
    mode = "mxfp8"
    bits = 8
    group_size = 32


class Mxfp4Codec(MxCodec):
    """mxfp4: MX FP4 (E2M1 elements, E8M0 scale per 32): kv_dim/2 + kv_dim/32 bytes."""

    name = "mxfp4"
    kernel_layout = layout.KernelLayout(layout.MXFP4, 0, ("codes", "scales"))
    formula = "kv_dim/2 + kv_dim/32"
    mode = "mxfp4"
    bits = 4
    group_size = 32


class Nvfp4Codec(MxCodec):
    """nvfp4: NV FP4 (E2M1 elements, E4M3 scale per 16, float32 global scale): kv_dim/2 + kv_dim/16 bytes."""

    name = "nvfp4"
    kernel_layout = layout.KernelLayout(layout.NVFP4, 0, ("codes", "scales"))
    formula = "kv_dim/2 + kv_dim/16"
    mode = "nvfp4"
    bits = 4
    group_size = 16
    scale_rule = "e4m3_nearest_global_amax"

    def make_params(self, x, layer, side, transform=None):
        amax = abs_max(x, transform)
        # an all-zero tensor has no scale to find; 1.0 keeps every block scale finite (zero codes)
        params = {**super().make_params(x, layer, side), "global_scale": amax if amax > 0 else 1.0}
        return score_aware.bind(params, x, layer, side)

    def check_params(self, params, n_kv_heads, head_dim):
        super().check_params(params, n_kv_heads, head_dim)
        g = params.get("global_scale")
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g < float("inf"):
            raise CorruptCartridgeError(f"tier nvfp4: params.global_scale is {g!r}; expected a positive finite number")

    def _global(self, params):
        return {"global_scale": mx.array(params["global_scale"], dtype=mx.float32)}

    def post_scale(self, params):
        return mx.array(params["global_scale"], dtype=mx.float32) / NVFP4_RANGE
