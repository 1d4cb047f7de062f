"""TurboQuant-MSE tiers turbo4 / turbo3 / turbo2 (Zandieh et al., arXiv 2504.19874, Algorithm 1).

Per token and KV head (spec/FORMAT.md 6.3):
    y = H diag(s) x / sqrt(D)          random-sign Walsh–Hadamard rotation (`mx.hadamard_transform`)
    idx_j = #{k : y_j / |y| > t_k}     t = midpoints of the b-bit Lloyd–Max codebook C for head_dim D
    norm = |y| ("raw") or |y| / |C[idx]| ("corrected"), stored as fp16
    x_hat = diag(s) H (norm * C[idx]) / sqrt(D)
Signs s (per layer, side and KV head), codebook values, norm kind and bit order are stored in the
(layer, side) params. Attention runs in the rotated space: q is rotated once, scores are
norm * <q_rot, C[idx]>, and the p.V output is rotated back once (reference sections 1, 5.6, 6).
"""

import mlx.core as mx
import numpy as np

from ..errors import CorruptCartridgeError, InputError
from . import bitpack, layout, score_aware
from .base import Component, TierCodec
from .codebook import lloyd_max, thresholds

ROTATION = "hadamard_signs"
PACKING = "lsb_first"
NORM_KINDS = ("raw", "corrected")
DEFAULT_NORM = {"k": "corrected", "v": "corrected"}  # chosen by measurement: docs/tiers.md
BLOCK_ELEMENTS = 1 << 22  # decoded floats per block of pages in scores / weighted_values (16 MiB)
_PREPARED = {}  # id(params) -> (params, signs, codebook): header params as arrays, made once


def sign_seed(layer, side):
    """The seed of the signs of (layer, side): 2 * layer + (0 for K, 1 for V)."""
    return 2 * layer + (0 if side == "k" else 1)


def make_signs(seed, n_kv_heads, head_dim):
    """±1 signs (n_kv_heads, head_dim): 1 - 2 * numpy.random.default_rng(seed).integers(0, 2, shape)."""
    bits = np.random.default_rng(seed).integers(0, 2, size=(n_kv_heads, head_dim))
    return (1 - 2 * bits).astype(np.int8)


def _prepared(params):
    hit = _PREPARED.get(id(params))
    if hit is None or hit[0] is not params:
        if len(_PREPARED) > 4096:
            _PREPARED.clear()
        signs = mx.array(np.asarray(params["signs"], dtype=np.float32))[:, None, :]  # (n_kv, 1, D)
        hit = (params, signs, mx.array(np.asarray(params["codebook"], dtype=np.float32)))
        _PREPARED[id(params)] = hit
    return hit[1], hit[2]


def rotate(x, signs):
    """y = H diag(s) x / sqrt(D) along the last axis; signs broadcast (n_kv, 1, D) against x."""
    return mx.hadamard_transform(x * signs)


def unrotate(y, signs):
    """x = diag(s) H y / sqrt(D): the inverse of `rotate` (H is symmetric and H H = D I)."""
    return mx.hadamard_transform(y) * signs


class Basis:
    """TurboQuant's rotated basis (`TierCodec.decode_stored`): signs (n_kv, 1, D), one set per KV head."""

    def __init__(self, signs):
        self.signs = signs

    def rotate(self, x):
        return rotate(x.astype(mx.float32), self.signs)

    def unrotate(self, y):
        return unrotate(y.astype(mx.float32), self.signs)


class TurboGrid:
    """TurboQuant's grid for `score_aware.feedback_round`: one group of head_dim coordinates per token whose
    scale is the token's rotated norm |y|, each code the codebook value nearest to y_j / |y| as `encode` picks."""

    def __init__(self, params, head_dim):
        self.group, self.codebook = head_dim, np.asarray(params["codebook"], dtype=np.float32)
        self.thresholds = thresholds(params["codebook"])

    def start(self, block):
        """block (n_kv, T, D) float32 (the rotated tokens) -> their norms (n_kv, T) float32."""
        return np.linalg.norm(block, axis=-1)

    def nearest(self, column, norm, i):
        idx = np.searchsorted(self.thresholds, column / np.where(norm > 0, norm, 1), side="left")  # #{t < u}
        return norm * self.codebook[idx], idx


def fitted_norms(y, codewords, weight):
    """Per token the norm n minimising (y - n c)^T H (y - n c): n = c^T H y / c^T H c.

    Args:
        y (np.ndarray): (n_kv, T, D) rotated tokens. codewords (np.ndarray): (n_kv, T, D) C[idx].
        weight (np.ndarray): (n_kv, D, D) H in the rotated basis.

    Returns:
        np.ndarray: (n_kv, T, 1) float32.
    """
    hc = np.einsum("nde,nte->ntd", weight, codewords)  # H c per token
    den = (hc * codewords).sum(-1, keepdims=True)
    return ((hc * y).sum(-1, keepdims=True) / np.where(den > 0, den, 1)).astype(np.float32)


class TurboCodec(TierCodec):
    """TurboQuant-MSE with `bits` bits per rotated coordinate; subclasses set `name` and `bits`."""

    bits = 4

    def components(self, head_dim):
        return [Component("codes", "uint32", head_dim * self.bits // 32), Component("norms", "float16", 1)]

    def check(self, n_kv_heads, head_dim):
        if head_dim & (head_dim - 1) or head_dim < bitpack.CHUNK:
            raise InputError(
                f"tier {self.name}: head_dim {head_dim} is not a power of two >= 32; the Walsh–Hadamard "
                f"rotation and the 32-coordinate packing need one"
            )

    def make_params(self, x, layer, side, transform=None):
        n_kv, _, head_dim = x.shape
        seed = sign_seed(layer, side)
        return score_aware.bind({
            "rotation": ROTATION, "seed": seed, "signs": make_signs(seed, n_kv, head_dim).tolist(),
            "bits": self.bits, "codebook": list(lloyd_max(head_dim, self.bits)), "norm": DEFAULT_NORM[side],
            "packing": PACKING,
        }, x, layer, side)

    def check_params(self, params, n_kv_heads, head_dim):
        fixed = {"rotation": ROTATION, "bits": self.bits, "packing": PACKING}
        for key, value in fixed.items():
            if params.get(key) != value:
                raise CorruptCartridgeError(f"tier {self.name}: params.{key} is {params.get(key)!r}; expected {value!r}")
        if params.get("norm") not in NORM_KINDS:
            raise CorruptCartridgeError(f"tier {self.name}: params.norm is {params.get('norm')!r}; expected one of {NORM_KINDS}")
        c = np.asarray(params.get("codebook"), dtype=object)
        if c.shape != (1 << self.bits,) or not all(isinstance(v, (int, float)) and np.isfinite(v) for v in c) \
                or not np.all(np.diff(c.astype(np.float64)) > 0):
            raise CorruptCartridgeError(
                f"tier {self.name}: params.codebook must be {1 << self.bits} increasing finite numbers")
        s = np.asarray(params.get("signs"), dtype=object)
        if s.shape != (n_kv_heads, head_dim) or not all(v in (1, -1) and not isinstance(v, bool) for v in s.flat):
            raise CorruptCartridgeError(
                f"tier {self.name}: params.signs must be {n_kv_heads} x {head_dim} values of +1/-1; "
                f"found shape {s.shape}")

    def encode(self, x, params):
        signs, codebook = _prepared(params)
        y = rotate(x.astype(mx.float32), signs)  # (n_kv, T, D)
        if score_aware.weight_of(params) is not None:
            return self._encode_weighted(y, score_aware.rotated_weight(params, lambda m: rotate(m, signs)))
        norm = mx.linalg.norm(y, axis=-1, keepdims=True)  # (n_kv, T, 1)
        u = y / mx.where(norm > 0, norm, 1)
        idx = mx.zeros(u.shape, dtype=mx.uint32)
        for t in thresholds(params["codebook"]):
            idx = idx + (u > float(t)).astype(mx.uint32)
        if params["norm"] == "corrected":
            norm = norm / mx.linalg.norm(mx.take(codebook, idx), axis=-1, keepdims=True)
        return {"codes": bitpack.pack(idx, self.bits), "norms": norm.astype(mx.float16)}

    def _encode_weighted(self, y, params):
        """Codes chosen for the score error under the rotated weight (`score_aware`), norms fitted to them."""
        y, weight = np.array(y), score_aware.weight_of(params)
        idx, _, _ = score_aware.feedback_round(y, weight, TurboGrid(params, y.shape[-1]))
        norms = fitted_norms(y, np.asarray(params["codebook"], dtype=np.float32)[idx], weight)
        return {"codes": bitpack.pack(mx.array(idx), self.bits), "norms": mx.array(norms).astype(mx.float16)}

    def _codewords(self, codes, params):
        """C[idx] for (..., W) codes: (..., D) float32 unit-scale codewords in the rotated basis."""
        return bitpack.lookup(codes, self.bits, codes.shape[-1] * 32 // self.bits, params["codebook"])

    def decode(self, parts, params):
        signs, _ = _prepared(params)
        return unrotate(self._codewords(parts["codes"], params) * parts["norms"].astype(mx.float32), signs)

    def decode_stored(self, parts, params):
        return self._codewords(parts["codes"], params) * parts["norms"].astype(mx.float32), self.stored_basis(params)

    def stored_basis(self, params):
        return Basis(_prepared(params)[0])

    def _blocks(self, parts):
        """Slices of pages whose decoded size stays under BLOCK_ELEMENTS floats."""
        n_pages, n_kv, page, width = parts["codes"].shape
        per_page = n_kv * page * width * 32 // self.bits
        step = max(1, BLOCK_ELEMENTS // per_page)
        return [slice(i, min(i + step, n_pages)) for i in range(0, n_pages, step)]

    def scores(self, q, parts, params):
        signs, _ = _prepared(params)
        q_rot = rotate(q, signs)[None]  # (1, n_kv, R, D): (Rq).(Rk) = q.k
        out = []
        for b in self._blocks(parts):
            k = self._codewords(parts["codes"][b], params)  # (nb, n_kv, P, D)
            norms = parts["norms"][b].astype(mx.float32).swapaxes(-1, -2)  # (nb, n_kv, 1, P)
            out.append((q_rot @ k.swapaxes(-1, -2)) * norms)  # (nb, n_kv, R, P)
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)

    def weighted_values(self, p, parts, params):
        signs, _ = _prepared(params)
        o = 0
        for b in self._blocks(parts):
            norms = parts["norms"][b].astype(mx.float32).swapaxes(-1, -2)  # (nb, n_kv, 1, P)
            o = o + ((p[b] * norms) @ self._codewords(parts["codes"][b], params)).sum(axis=0)  # (n_kv, R, D)
        return unrotate(o, signs)


class Turbo4Codec(TurboCodec):
    """turbo4: 4 bits per coordinate: kv_dim/2 + 2 * n_kv_heads bytes per token per layer-side."""

    name = "turbo4"
    kernel_layout = layout.KernelLayout(layout.TURBO, 4, ("codes", "norms"))
    bits = 4
    formula = "kv_dim/2 + 2 * H"


class Turbo3Codec(TurboCodec):
    """turbo3: 3 bits per coordinate (codes may straddle words): 3 * kv_dim/8 + 2 * n_kv_heads bytes."""

    name = "turbo3"
    kernel_layout = layout.KernelLayout(layout.TURBO, 3, ("codes", "norms"))
    bits = 3
    formula = "3 * kv_dim/8 + 2 * H"


class Turbo2Codec(TurboCodec):
    """turbo2: 2 bits per coordinate: kv_dim/4 + 2 * n_kv_heads bytes."""

    name = "turbo2"
    kernel_layout = layout.KernelLayout(layout.TURBO, 2, ("codes", "norms"))
    bits = 2
    formula = "kv_dim/4 + 2 * H"
