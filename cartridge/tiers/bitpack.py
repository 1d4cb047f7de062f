"""b-bit codes packed as an LSB-first bitstream in little-endian uint32 words (spec/FORMAT.md 6.3).

Code j's b bits occupy stream bits [j*b, j*b + b): bit i of the stream is bit i % 32 of word i // 32.
With b = 3 (or 12) a code may straddle two words. Every `chunk(b)` codes fill exactly
`chunk(b) * b / 32` words (32 codes in 3 words for b = 3), so the stream is handled in such chunks.
"""

from math import gcd

import mlx.core as mx
import numpy as np

CHUNK = 32  # codes per chunk for odd b: the most any b needs


def chunk(bits):
    """Codes per whole number of words: 32 / gcd(32, bits)."""
    return 32 // gcd(32, bits)


def _layout(bits):
    """Per code j of a chunk: first word, shift in it, and whether it spills into the next word."""
    start = np.arange(chunk(bits)) * bits
    word, shift = start // 32, start % 32
    spill = shift + bits > 32
    return word, shift, spill


def pack(codes, bits):
    """Pack codes (..., n) of values < 2^bits into words (..., n*bits/32) uint32.

    Args:
        codes (mx.array): unsigned integer codes, last axis a multiple of `chunk(bits)`.
        bits (int): bits per code, 1..24.

    Returns:
        mx.array: uint32 (..., n * bits / 32).
    """
    *lead, n = codes.shape
    c = codes.astype(mx.uint32).reshape(*lead, n // chunk(bits), chunk(bits))  # (..., chunks, codes per chunk)
    word, shift, spill = _layout(bits)
    lo = mx.left_shift(c, mx.array(shift, dtype=mx.uint32))  # bits beyond 32 are dropped: they spill
    hi = mx.right_shift(c, mx.array(np.where(spill, 32 - shift, 0), dtype=mx.uint32))
    words = []
    for k in range(chunk(bits) * bits // 32):
        own = mx.array(np.flatnonzero(word == k))
        # codes' bit ranges are disjoint, so a sum of their shifted values is their OR
        w = mx.sum(mx.take(lo, own, axis=-1), axis=-1)
        spilled = np.flatnonzero(spill & (word == k - 1))
        if spilled.size:
            w = w + mx.sum(mx.take(hi, mx.array(spilled), axis=-1), axis=-1)
        words.append(w.astype(mx.uint32))
    return mx.stack(words, axis=-1).reshape(*lead, n * bits // 32)  # (..., chunks * bits)


def unpack(words, bits, n):
    """Inverse of `pack`: words (..., n*bits/32) uint32 -> codes (..., n) uint32."""
    *lead, _ = words.shape
    per = chunk(bits) * bits // 32
    w = words.reshape(*lead, n // chunk(bits), per)  # (..., chunks, words per chunk)
    word, shift, spill = _layout(bits)
    lo = mx.right_shift(mx.take(w, mx.array(word), axis=-1), mx.array(shift, dtype=mx.uint32))
    nxt = mx.take(w, mx.array(np.minimum(word + 1, per - 1)), axis=-1)
    hi = mx.left_shift(nxt, mx.array(np.where(spill, 32 - shift, 0), dtype=mx.uint32))
    hi = mx.where(mx.array(spill), hi, mx.zeros_like(hi))
    codes = mx.bitwise_and(mx.bitwise_or(lo, hi), mx.array((1 << bits) - 1, dtype=mx.uint32))
    return codes.reshape(*lead, n)  # (..., n)


def lookup(words, bits, n, codebook):
    """codebook[code] for every code of `unpack(words, bits, n)`, through a table of code groups.

    Codes are looked up several at a time (k codes = one byte for b in 1, 2, 4, 8; 4 codes = 12 bits for
    b = 3): one gather per group from a (2^(k*b), k) table instead of an unpack and a gather per code.

    Args:
        words (mx.array): uint32 (..., n*bits/32). bits (int): 1..8. n (int): codes per row.
        codebook (np.ndarray): the 2^bits values, float32.

    Returns:
        mx.array: float32 (..., n).
    """
    *lead, _ = words.shape
    k = 8 // bits if 8 % bits == 0 else max(1, 12 // bits)
    table = _group_table(tuple(np.asarray(codebook, dtype=np.float32).tolist()), bits, k)
    groups = words.view(mx.uint8) if k * bits == 8 else unpack(words, k * bits, n // k)  # (..., n/k)
    return mx.take(table, groups, axis=0).reshape(*lead, n)  # (..., n/k, k) -> (..., n)


_TABLES = {}


def _group_table(codebook, bits, k):
    """(2^(k*bits), k) float32: row g holds codebook[(g >> (i*bits)) & mask] for i < k."""
    key = (codebook, bits, k)
    if key not in _TABLES:
        g = np.arange(1 << (k * bits))[:, None] >> (np.arange(k) * bits)
        _TABLES[key] = mx.array(np.asarray(codebook, dtype=np.float32)[g & ((1 << bits) - 1)])
    return _TABLES[key]
