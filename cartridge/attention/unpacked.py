"""Affine K pages with one byte per code: the CPU's faster way to read a side that stays compressed.

On the CPU, MLX's quantized matmul against transposed weights (the scores q . K^T over affine pages)
is scalar code, which costs about 1 ns per multiply-add on x86, where MLX builds no SIMD into it. Its
non-transposed form (p . V) is fast, so V sides keep their stored pages. A K side unpacked to one uint8
per element (int8: a view of the stored codes, no copy; 4-bit: twice their bytes) is read with BLAS
instead. Each step casts the codes to float32 (a transient of 4 bytes per element), takes the dot
product of every group of `group_size` elements with one matmul against block-diagonal queries, and
applies the affine parameters per group:

    q . k_t = sum_g scale_tg * (q_g . c_tg) + bias_tg * sum(q_g)

This is q . (scale * c + bias) summed in another order (float32 rounding, no other difference).
Measured on a loaded 2-core x86 machine, one layer of 6,450 tokens, 8 KV heads x 128, CPU time: scores
9.5 ms against 13.6 ms for the quantized matmul and 6.9 ms over float32 pages (docs/performance.md
"Memory on CPU").
"""

import mlx.core as mx

from ..tiers.affine import AffineCodec, affine_values, byte_codes
from ..tiers.base import TierCodec
from ..tiers.rotation import Basis, RotatedCodec, rotate, unrotate

BITS = (4, 8)  # code widths `unpack` reads


def _affine(codec):
    """The affine codec under `codec` (itself, or the base of a rotated tier), or None."""
    base = codec.base if isinstance(codec, RotatedCodec) else codec
    return base if isinstance(base, AffineCodec) and base.bits in BITS else None


def can_unpack(codec):
    """True for the tiers `unpack` reads: affine 4- or 8-bit codes (int8, mlx4g32 and their +rot forms)."""
    return _affine(codec) is not None


def sizes(codec, shape):
    """(bytes held once unpacked, bytes of the unpacking's temporaries, bytes a decode step casts).

    Args:
        codec (TierCodec): a tier `can_unpack` accepts. shape (tuple): (n_pages, n_kv_heads, P, head_dim).
    """
    elements = shape[0] * shape[1] * shape[2] * shape[3]
    groups = elements // _affine(codec).group_size
    temporaries = elements if _affine(codec).bits == 4 else 0  # the low and high nibbles, half a byte each
    return elements + 2 * groups * 4, temporaries, elements * 4


class UnpackedCodec(TierCodec):
    """Pages of an affine tier as uint8 codes with float32 scales and biases (`unpack` makes them).

    Parts: "codes" uint8 (n_pages, n_kv_heads, P, head_dim); "scales", "biases" float32
    (n_pages, n_kv_heads, P, groups), groups = head_dim / group_size.

    Args:
        codec (TierCodec): the stored tier (its parameters, e.g. a rotation, still apply).
    """

    name = "unpacked"

    def __init__(self, codec):
        self.stored = codec
        self.group_size = _affine(codec).group_size
        self.rotated = isinstance(codec, RotatedCodec)

    def _values(self, parts):
        """float32 (n_pages, n_kv_heads, P, head_dim): scale * code + bias (in the rotated basis of a +rot tier)."""
        return affine_values(parts["codes"], parts["scales"], parts["biases"], self.group_size)

    def decode(self, parts, params):
        """float32 (n_pages, n_kv_heads, P, head_dim), the stored tier's values."""
        x = self._values(parts)
        return unrotate(x, params["rotation"]) if self.rotated else x

    def decode_stored(self, parts, params):
        """The values in the stored basis and that basis (`TierCodec.decode_stored`): a +rot side stays rotated."""
        return self._values(parts), self.stored_basis(params)

    def stored_basis(self, params):
        """The +rot rotation for a rotated stored tier, else None (`TierCodec.stored_basis`)."""
        return Basis(params["rotation"]) if self.rotated else None

    def scores(self, q, parts, params):
        """q . K^T: (n_kv_heads, R, head_dim) float32 -> (n_pages, n_kv_heads, R, P) float32 (a transposed view).

        Up to `group_size` query rows (a decode step), by block-diagonal queries; more (a prefill), over
        values decoded for this call, whose float32 K is smaller than the per-group dot products.
        """
        if self.rotated:
            q = rotate(q, params["rotation"])  # (R q) . (R k) = q . k
        n_kv, r, d = q.shape
        gs = self.group_size
        if r > gs:
            return (self._values(parts) @ q.swapaxes(-1, -2)[None]).swapaxes(-1, -2)
        groups = d // gs
        block = (mx.arange(d)[None, :] // gs == mx.arange(groups)[:, None]).astype(q.dtype)  # (groups, D)
        # (n_kv, groups, R, D) -> (n_kv, groups * R, D): row g * R + i holds query i on group g only
        qb = (block[None, :, None, :] * q[:, None, :, :]).reshape(n_kv, groups * r, d)
        # codes @ qb^T, the orientation OpenBLAS takes fastest: (n_pages, n_kv, P, D) @ (1, n_kv, D, groups * R)
        dots = parts["codes"].astype(mx.float32) @ qb.swapaxes(-1, -2)[None]
        n, _, page, _ = dots.shape
        dots = dots.reshape(n, n_kv, page, groups, r)
        q_sums = q.reshape(n_kv, r, groups, gs).sum(-1).swapaxes(-1, -2)  # (n_kv, groups, R)
        # sum_g scale * dots + (bias_g . q_sums_g): (n_pages, n_kv, P, R)
        s = (dots * parts["scales"][..., None]).sum(axis=3) + parts["biases"] @ q_sums[None]
        return s.swapaxes(-1, -2)


def unpack(codec, parts):
    """Stored affine pages as `UnpackedCodec` parts.

    Args:
        codec (TierCodec): a tier `can_unpack` accepts.
        parts (dict[str, mx.array]): "codes" uint32 (n_pages, n_kv_heads, P, head_dim * bits / 32), packed
            least significant bits first; "scales", "biases" float16 (n_pages, n_kv_heads, P, groups).

    Returns:
        dict[str, mx.array]: the parts `UnpackedCodec` reads (lazy: the caller evaluates them).
    """
    b = byte_codes(parts["codes"], _affine(codec).bits)
    return {"codes": b, "scales": parts["scales"].astype(mx.float32), "biases": parts["biases"].astype(mx.float32)}
