"""Group-quantized tiers that MLX's quantized matmul reads directly (affine, mxfp8, mxfp4, nvfp4).

Every such tier stores `codes` (uint32, elements packed LSB first as `mx.quantize` packs them) and
per-group `scales` (and, for affine, `biases`) along head_dim. Attention over pages never decodes the
prefix: scores are `mx.quantized_matmul(q, codes, transpose=True)` batched over pages, and p.V is
`mx.quantized_matmul(p, codes, transpose=False)` summed over pages (the layout of mlx-lm's
`quantized_scaled_dot_product_attention`, shared/reference/kv-quant-algorithms.md section 5.4).
"""

import mlx.core as mx

from ..errors import InputError
from .base import Component, FixedParamsCodec


class GroupQuantCodec(FixedParamsCodec):
    """Base of the tiers quantized in groups along head_dim; subclasses set the class attributes.

    Attributes:
        mode (str): MLX quantization mode ("affine", "mxfp8", "mxfp4", "nvfp4").
        bits (int): bits per element. group_size (int): elements per scale.
        scale_dtype (str): "float16" (affine) or "uint8" (E8M0 / E4M3 bytes).
        has_biases (bool): affine tiers also store a per-group bias.
        scale_rule (str): how the writer chose scales (spec/FORMAT.md 6.2), recorded in params.
    """

    mode = "affine"
    bits = 4
    group_size = 32
    scale_dtype = "float16"
    has_biases = True

    def components(self, head_dim):
        groups = head_dim // self.group_size
        comps = [Component("codes", "uint32", head_dim * self.bits // 32), Component("scales", self.scale_dtype, groups)]
        if self.has_biases:
            comps.append(Component("biases", self.scale_dtype, groups))
        return comps

    def check(self, n_kv_heads, head_dim):
        if head_dim % self.group_size:
            raise InputError(
                f"tier {self.name}: head_dim {head_dim} is not a multiple of the group size {self.group_size}"
            )

    scale_rule = ""

    def fixed_params(self):
        return {"mode": self.mode, "bits": self.bits, "group_size": self.group_size, "scale_rule": self.scale_rule,
                "packing": "lsb_first"}

    def post_scale(self, params):
        """A factor every dequantized value is multiplied by (nvfp4's global scale), or None."""
        return None

    def _qargs(self, parts):
        return parts["codes"], parts["scales"], parts.get("biases") if self.has_biases else None

    def quantize_kwargs(self):
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def scaled(self, y, params):
        """y multiplied by `post_scale(params)` where the tier has one (nvfp4), else y unchanged."""
        s = self.post_scale(params)
        return y if s is None else y * s

    def decode(self, parts, params):
        codes, scales, biases = self._qargs(parts)
        if self.has_biases:  # float32 arithmetic: scale * q + bias
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        return self.scaled(mx.dequantize(codes, scales, biases, dtype=mx.float32, **self.quantize_kwargs()), params)

    def scores(self, q, parts, params):
        # q (n_kv, R, D) -> (1, n_kv, R, D), broadcast against pages (n_pages, n_kv, P, D*bits/32)
        s = mx.quantized_matmul(q[None], *self._qargs(parts), transpose=True, **self.quantize_kwargs())
        return self.scaled(s, params)  # (n_pages, n_kv, R, P)

    def weighted_values(self, p, parts, params):
        # p (n_pages, n_kv, R, P) @ V (n_pages, n_kv, P, D) -> (n_pages, n_kv, R, D), summed over pages
        o = mx.quantized_matmul(p, *self._qargs(parts), transpose=False, **self.quantize_kwargs()).sum(axis=0)
        return self.scaled(o, params)
