"""Rotated tiers: a block-Hadamard rotation with random signs before quantization (spec/FORMAT.md 6.4).

`x_rot = R x` with `R = blockdiag(H_b, ..., H_b) @ diag(s)`: s in {-1, +1}^head_dim from the seed, H_b the
normalized Sylvester Hadamard matrix of a power-of-two block b. R is orthogonal, so attention can stay in
the rotated basis: scores are (R q).(R k) = q.k (the query is rotated once per step), and p.V computed on
rotated values is rotated back once (R^T o). The rotation spreads outlier channels over a block, so the
per-group scale of a 4-bit code is set by a typical value, not by the outlier (QuaRot, Ashkboos et al. 2024;
llama.cpp's rotated KV cache; shared/reference/kv-quant-algorithms.md section 6.2).

A rotated tier is its own tier name (`mlx4g32+rot`), so a reader that does not know it refuses the
cartridge instead of reading rotated codes as plain ones (llama.cpp#28498).
"""

import hashlib
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..errors import CorruptCartridgeError, InputError
from . import score_aware
from .base import TierCodec

KIND = "block_hadamard_signs"
MAX_BLOCK = 4096
SEED_BASE = 0x5EED  # seeds are SEED_BASE + 2 * layer + (side == "v"): distinct per (layer, side), reproducible


def default_block(head_dim):
    """The largest power of two dividing head_dim (at most MAX_BLOCK): the whole head for 64 or 128."""
    return min(head_dim & -head_dim, MAX_BLOCK)


def sign_bits(seed, n):
    """n signs (+1/-1, float32) from `seed`: bit i of SHA-256(seed as u64 LE || counter as u32 LE) blocks,
    counter 0, 1, ...; bit i of the stream is byte i // 8, bit i % 8 (LSB first); a set bit means -1."""
    stream = b"".join(hashlib.sha256(seed.to_bytes(8, "little") + c.to_bytes(4, "little")).digest()
                      for c in range(-(-n // 256)))
    bits = np.unpackbits(np.frombuffer(stream, dtype=np.uint8), bitorder="little")[:n]
    return (1.0 - 2.0 * bits).astype(np.float32)


def hadamard(b):
    """The normalized Sylvester Hadamard matrix (b, b) float64, b a power of two: H = H^T, H @ H = I."""
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(b)


@lru_cache(maxsize=64)
def _operands(seed, block, head_dim):
    """(H (block, block) float32, signs (head_dim,) float32) as mx arrays, made once per rotation."""
    return mx.array(hadamard(block).astype(np.float32)), mx.array(sign_bits(seed, head_dim))


def rotate(x, rot):
    """R x along the last axis: x (..., head_dim) -> float32 (..., head_dim).

    Args:
        x (mx.array): any float dtype. rot (dict): {"block": b, "seed": s} from the tier's params.
    """
    *lead, d = x.shape
    h, s = _operands(rot["seed"], rot["block"], d)
    # (..., D) -> (..., D / b, b): each block multiplied by the symmetric H
    y = (x.astype(mx.float32) * s).reshape(*lead, d // rot["block"], rot["block"]) @ h
    return y.reshape(*lead, d)


def unrotate(y, rot):
    """R^T y along the last axis: the inverse of `rotate` (R is orthogonal)."""
    *lead, d = y.shape
    h, s = _operands(rot["seed"], rot["block"], d)
    # (..., D) -> (..., D / b, b) -> (..., D)
    return (y.astype(mx.float32).reshape(*lead, d // rot["block"], rot["block"]) @ h).reshape(*lead, d) * s


class Basis:
    """The rotated basis of a +rot side (`TierCodec.decode_stored`): the same rotation for every KV head."""

    def __init__(self, rot):
        self.rot = rot

    def rotate(self, x):
        return rotate(x, self.rot)

    def unrotate(self, y):
        return unrotate(y, self.rot)


def rotation_params(head_dim, layer, side, block=None):
    """The rotation record of one (layer, side): {"kind", "block", "seed"} (stored in the tier's params)."""
    return {"kind": KIND, "block": block or default_block(head_dim), "seed": SEED_BASE + 2 * layer + (side == "v")}


def check_rotation(rot, head_dim, where):
    """Refuse a stored rotation record this reader cannot apply.

    Raises:
        CorruptCartridgeError: naming the field, the value found and the value allowed.
    """
    if not isinstance(rot, dict) or rot.get("kind") != KIND:
        raise CorruptCartridgeError(f"tier {where}: params.rotation is {str(rot)[:80]!r}; expected kind {KIND!r}")
    b, seed = rot.get("block"), rot.get("seed")
    if isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1) or head_dim % b or b > MAX_BLOCK:
        raise CorruptCartridgeError(
            f"tier {where}: params.rotation.block is {b!r}; expected a power of two dividing head_dim {head_dim}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise CorruptCartridgeError(f"tier {where}: params.rotation.seed is {seed!r}; expected an integer 0..2^63-1")


class RotatedCodec(TierCodec):
    """`base` applied to R x: same components and bytes; decode, scores and p.V in the original basis.

    Args:
        base (TierCodec): the tier whose codes hold the rotated K or V.
    """

    def __init__(self, base):
        self.base = base
        self.name = f"{base.name}+rot"
        self.codec_version = base.codec_version
        self.formula = base.formula

    def components(self, head_dim):
        return self.base.components(head_dim)

    def check(self, n_kv_heads, head_dim):
        self.base.check(n_kv_heads, head_dim)
        if default_block(head_dim) < 2:
            raise InputError(f"tier {self.name}: head_dim {head_dim} has no power-of-two block to rotate")

    def make_params(self, x, layer, side, transform=None):
        rot = rotation_params(x.shape[-1], layer, side)
        # the base's statistics (nvfp4's amax) over R x, a block of tokens at a time: R acts on each token alone
        params = {**self.base.make_params(x, layer, side, lambda b: rotate(b, rot)), "rotation": rot}
        return score_aware.bind(params, x, layer, side)

    def check_params(self, params, n_kv_heads, head_dim):
        check_rotation(params.get("rotation"), head_dim, self.name)
        self.base.check_params(params, n_kv_heads, head_dim)

    def encode(self, x, params):
        rot = params["rotation"]  # a score-aware weight goes into the rotated basis with the values: R H R^T
        return self.base.encode(rotate(x, rot), score_aware.rotated_weight(params, lambda m: rotate(m, rot)))

    def decode(self, parts, params):
        return unrotate(self.base.decode(parts, params), params["rotation"])

    def decode_stored(self, parts, params):
        return self.base.decode(parts, params), self.stored_basis(params)

    def stored_basis(self, params):
        return Basis(params["rotation"])

    def scores(self, q, parts, params):
        return self.base.scores(rotate(q, params["rotation"]), parts, params)  # (R q).(R k) = q.k

    def weighted_values(self, p, parts, params):
        return unrotate(self.base.weighted_values(p, parts, params), params["rotation"])
