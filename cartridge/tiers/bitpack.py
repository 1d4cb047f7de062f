"""b-bit codes packed as an LSB-first bitstream in little-endian uint32 words (spec/FORMAT.md 6.3).

Coordinate j's b bits occupy stream bits [j*b, j*b + b): bit i of the stream is bit i % 32 of word
i // 32. With b = 3 a code may straddle two words. Every 32 coordinates fill exactly b words, so the
stream is handled in chunks of 32 coordinates (shape (..., D/32, 32) <-> (..., D/32, b)).
"""

import mlx.core as mx
import numpy as np

CHUNK = 32  # coordinates per b words


def _layout(bits):
    """Per coordinate j of a chunk: first word, shift in it, and whether it spills into the next word."""
    start = np.arange(CHUNK) * bits
    word, shift = start // 32, start % 32
    spill = shift + bits > 32
    return word, shift, spill


def check_width(n, bits):
    """True when n codes of `bits` bits fill whole uint32 words (n*bits % 32 == 0 and n % 32 == 0)."""
    return n % CHUNK == 0 and 1 <= bits <= 8


def pack(codes, bits):
    """Pack codes (..., n) of values < 2^bits into words (..., n*bits/32) uint32.

    Args:
        codes (mx.array): unsigned integer codes, last axis a multiple of 32.
        bits (int): bits per code, 1..8.

    Returns:
        mx.array: uint32 (..., n * bits / 32).
    """
    *lead, n = codes.shape
    c = codes.astype(mx.uint32).reshape(*lead, n // CHUNK, CHUNK)  # (..., chunks, 32)
    word, shift, spill = _layout(bits)
    lo = mx.left_shift(c, mx.array(shift, dtype=mx.uint32))  # bits beyond 32 are dropped: they spill
    hi = mx.right_shift(c, mx.array(np.where(spill, 32 - shift, 0), dtype=mx.uint32))
    words = []
    for k in range(bits):
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
    w = words.reshape(*lead, n // CHUNK, bits)  # (..., chunks, bits)
    word, shift, spill = _layout(bits)
    lo = mx.right_shift(mx.take(w, mx.array(word), axis=-1), mx.array(shift, dtype=mx.uint32))
    nxt = mx.take(w, mx.array(np.minimum(word + 1, bits - 1)), axis=-1)
    hi = mx.left_shift(nxt, mx.array(np.where(spill, 32 - shift, 0), dtype=mx.uint32))
    hi = mx.where(mx.array(spill), hi, mx.zeros_like(hi))
    codes = mx.bitwise_and(mx.bitwise_or(lo, hi), mx.array((1 << bits) - 1, dtype=mx.uint32))
    return codes.reshape(*lead, n)  # (..., n)
