"""Protected tokens: the first N and last M prefix tokens of every (layer, side) also kept in fp16.

The first tokens draw a large share of attention in every layer (attention sinks, Xiao et al. 2024) and
the last ones sit nearest the question, so their quantization error costs the most. The compressed pages
still hold every token (so the page layout is unchanged and a reader of format 1.4 still reads a valid,
less precise cache); the fp16 copies are stored in the index beside them (`layer.{i}.{side}.protected`,
spec/FORMAT.md 4.5.4, format 1.5), for the layers that store every token ("attention", "dense"). Attention reads the compressed pages directly with the protected positions masked
out, attends the fp16 copies as one more part, and merges the parts by log-sum-exp; the
dequantize-once path instead overwrites the protected positions of its dense pages.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import FieldError, InputError
from ..format import keys as K

MAX_PROTECT = 1 << 16


@dataclass(frozen=True)
class Protected:
    """The fp16 copies of one layer's protected tokens.

    Attributes:
        first, last (int): N first and M last prefix tokens.
        k, v (mx.array): (n_kv_heads, N + M, head_dim) float16: tokens 0..N-1, then T-M..T-1.
    """

    first: int
    last: int
    k: object
    v: object

    def page_range(self, n_tokens):
        """(lo, hi): the page positions attention reads from the compressed pages."""
        return self.first, n_tokens - self.last


def overwrite_in_place(pages, protected, side, n_tokens):
    """Dense pages (n_pages, n_kv_heads, P, D), a buffer the caller owns, with the protected positions set to their
    fp16 copies: their slices are updated in place (MLX reuses the buffer of an array nothing else refers to), one
    update per page they span."""
    kept = (protected.k if side == "k" else protected.v).astype(pages.dtype)
    lo, hi = protected.page_range(n_tokens)
    page = pages.shape[2]
    for start, end, first in ((0, lo, 0), (hi, n_tokens, lo)):  # token range, and where its copies start in kept
        t = start
        while t < end:
            p, r = divmod(t, page)
            n = min(end - t, page - r)
            pages[p, :, r:r + n] = kept[:, first + t - start:first + t - start + n]  # (n_kv, n, D)
            t += n
    return pages


def check_counts(first, last):
    """Refuse counts that are not integers in 0..65536.

    Raises:
        InputError: naming the option and the value.
    """
    for name, n in (("protect_first", first), ("protect_last", last)):
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_PROTECT:
            raise InputError(f"{name} is {n!r}; it must be an integer 0..{MAX_PROTECT}")


def clamp(first, last, n_tokens):
    """(N, M) that leave at least one token in the pages: a short prefix protects what it can."""
    first = min(first, n_tokens - 1)
    return first, max(0, min(last, n_tokens - 1 - first))


def take(x, first, last):
    """x (n_kv_heads, T, head_dim) -> (n_kv_heads, N + M, head_dim) float16 as little-endian bytes."""
    t = x.shape[1]
    kept = mx.concatenate([x[:, :first], x[:, t - last:]], axis=1).astype(mx.float16)
    return np.array(kept).astype("<f2").tobytes()


def bytes_per_token(first, last, n_tokens, shapes):
    """The fp16 copies' bytes spread over the prefix's tokens (rounded to the nearest byte).

    Args:
        first, last (int): protected tokens. n_tokens (int): prefix tokens.
        shapes (list[tuple]): (n_kv_heads, head_dim) of every protected (layer, side).
    """
    return round((first + last) * sum(2 * h * d for h, d in shapes) / n_tokens) if first + last else 0


def header_keys(first, last):
    """The header records of the protection (always written from format 1.5 on)."""
    return {K.PROTECT_FIRST: first, K.PROTECT_LAST: last}


def read(records, layers, n_tokens):
    """(N, M, {(layer, side): np.ndarray (n_kv, N + M, head_dim) float16}) from the index records.

    Args:
        records (dict[str, bytes]): the index. layers (list[LayerInfo]): each layer's kind and shapes
            (`stores_every_token`: the kinds that hold copies).
        n_tokens (int): prefix tokens.

    Absent keys (before format 1.5) mean no protection; only "attention" and "dense" layers hold copies.

    Raises:
        FieldError: a bad count, or a record of the wrong length.
    """
    first, last = (_count(records, key) for key in (K.PROTECT_FIRST, K.PROTECT_LAST))
    if first + last and first + last >= n_tokens:
        raise FieldError(f"{K.PROTECT_FIRST} + {K.PROTECT_LAST} is {first + last}; allowed 0..{n_tokens - 1}")
    arrays = {}
    for layer, info in enumerate(layers if first + last else ()):
        if not info.stores_every_token:
            continue
        for side in ("k", "v"):
            n_kv, head_dim = info.shape(side)
            key, want = K.layer_protected(layer, side), n_kv * (first + last) * head_dim * 2
            raw = records.get(key)
            if raw is None or len(raw) != want:
                raise FieldError(f"index key {key!r}: {0 if raw is None else len(raw)} bytes, expected {want}")
            arrays[(layer, side)] = np.frombuffer(raw, dtype="<f2").reshape(n_kv, first + last, head_dim)
    return first, last, arrays


def _count(records, key):
    raw = records.get(key)
    if raw is None:
        return 0
    try:
        n = int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise FieldError(f"index key {key!r} is {raw[:40]!r}; expected an integer") from None
    if not 0 <= n <= MAX_PROTECT:
        raise FieldError(f"index key {key!r} is {n}; allowed 0..{MAX_PROTECT}")
    return n


def layer_protected(info, layer):
    """The `Protected` of one layer of a parsed cartridge, or None if it protects nothing."""
    if (layer, "k") not in info.protected:
        return None
    k, v = (mx.array(info.protected[(layer, side)]) for side in ("k", "v"))
    return Protected(info.protect_first, info.protect_last, k, v)

