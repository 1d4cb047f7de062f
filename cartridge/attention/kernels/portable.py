"""Portable attention with MLX ops (CPU, Metal, CUDA): batched over pages, merged by log-sum-exp.

Reference: flash-decoding (Dao et al., 2023) split-K with the online-softmax merge; see
shared/reference/kv-quant-algorithms.md section 5.1. Scores and p.V come from the tier codec, which
reads its stored page layout (`TierCodec.scores` / `weighted_values`).
"""

import os
import platform
import threading
from dataclasses import replace

import mlx.core as mx


CPU_SPLIT_PAGES = 8  # on CPU, a prefix of at least this many pages is split over streams
# MLX streams belong to the thread that made them (MLX >= 0.32: a stream used from another thread raises
# "There is no Stream(cpu, N) in current thread"), so each thread makes its own extra CPU streams
_LOCAL = threading.local()
LOG2_E = 1.4426950408889634
# MLX's CPU exp is a polynomial evaluated with std::fma, which an x86 build without FMA code emulates in
# software: 15 ns an element on the 2-core x86 machine of docs/performance.md, 6 ns for 2^x by std::pow,
# with the same error against float64 (9.5e-7 relative, 106,496 scores, measured)
_POW2_EXP = platform.machine().lower() in ("x86_64", "amd64")


def _exp(x):
    """exp(x), float32, exp(-inf) = 0: 2^(x log2 e) on an x86 CPU, else `mx.exp`."""
    if _POW2_EXP and mx.default_device() == mx.cpu:
        return mx.power(2.0, x * LOG2_E)
    return mx.exp(x)


def _cpu_streams():
    """The current CPU stream (where the caller's ops run: mlx-lm's generation stream inside its loops), then
    this thread's extra CPU streams (one thread each), made on its first split."""
    extra = getattr(_LOCAL, "streams", None)
    if extra is None:
        n = max(1, min(os.cpu_count() or 1, 4))
        extra = _LOCAL.streams = [mx.new_stream(mx.cpu) for _ in range(n - 1)]
    return [mx.default_stream(mx.cpu), *extra]


def prefix_partial(q, prefix, n_tokens):
    """Attention partial of queries over the first `n_tokens` tokens of the prefix pages.

    On CPU, MLX runs each op on one thread (its quantized matmul is scalar code there), so a prefix of
    `CPU_SPLIT_PAGES` pages or more is cut into one run of pages per CPU stream (a thread each) and the
    partials are combined by log-sum-exp: the same result up to float rounding, on every core.

    Args:
        q (mx.array): (n_kv_heads, R, head_dim) float32, pre-scaled; R = GQA group * query length.
        prefix (LayerPrefix): codecs, page components and parameters of K and V.
        n_tokens (int): valid prefix tokens; the last page's padding beyond it is masked out.

    Returns:
        tuple: o (n_kv_heads, R, head_dim), m (n_kv_heads, R), l (n_kv_heads, R), all float32.
    """
    n_pages = next(iter(prefix.k_parts.values())).shape[0]
    dense = prefix.k_codec.dense_pages and prefix.v_codec.dense_pages  # BLAS uses every core already
    if not dense and mx.default_device() == mx.cpu and n_pages >= CPU_SPLIT_PAGES and len(_cpu_streams()) > 1:
        return _split_partial(q, prefix, n_tokens, n_pages)
    return _partial(q, prefix, n_tokens)


def _split_partial(q, prefix, n_tokens, n_pages):
    """`prefix_partial` of each run of pages on its own CPU stream, combined."""
    streams = _cpu_streams()
    cuts = [n_pages * i // len(streams) for i in range(len(streams) + 1)]
    page = next(iter(prefix.k_parts.values())).shape[2]
    parts = []
    for st, a, b in zip(streams, cuts, cuts[1:]):
        with mx.stream(st):
            sub = replace(prefix, k_parts={k: x[a:b] for k, x in prefix.k_parts.items()},
                          v_parts={k: x[a:b] for k, x in prefix.v_parts.items()},
                          n_tokens=min(n_tokens - a * page, (b - a) * page))
            parts.append(_partial(q, sub, sub.n_tokens))
    return combine(parts)


def combine(parts):
    """Partials (o, m, l) of disjoint key sets as one partial (o, m, l) (unnormalized, like each part)."""
    m = parts[0][1]
    for _, mi, _ in parts[1:]:
        m = mx.maximum(m, mi)
    o = l = 0
    for oi, mi, li in parts:
        a = mx.exp(mi - m)
        o, l = o + oi * a[..., None], l + li * a
    return o, m, l


def _partial(q, prefix, n_tokens):
    s = prefix.k_codec.scores(q, prefix.k_parts, prefix.k_params)  # (n_pages, n_kv, R, P)
    n_pages, _, _, page = s.shape
    protected = getattr(prefix, "protected", None)  # their fp16 copies are attended as another part
    lo, hi = (0, n_tokens) if protected is None else protected.page_range(n_tokens)
    if lo or n_pages * page != hi:
        pos = mx.arange(n_pages * page).reshape(n_pages, 1, 1, page)
        s = mx.where((pos >= lo) & (pos < hi), s, -mx.inf)
    m = s.max(axis=(0, 3))  # (n_kv, R)
    p = _exp(s - m[None, :, :, None])
    return prefix.v_codec.weighted_values(p, prefix.v_parts, prefix.v_params), m, p.sum(axis=(0, 3))


def _exp_shifted(s, m):
    """exp(s - m) with m (n_kv, R) broadcast over the last axis; a row whose every score is -inf
    (m = -inf: its mask hides every key of this part) gives zeros, not exp(-inf + inf) = NaN, so it
    contributes nothing to `merge` (its l is 0 and its m, -inf, weighs it by exp(-inf) = 0)."""
    return _exp(s - mx.where(m == -mx.inf, 0.0, m)[..., None])


def tail_partial(q, k, v, keep):
    """Attention partial of queries over dense tail keys/values.

    Args:
        q (mx.array): (n_kv_heads, R, head_dim) float32, pre-scaled.
        k, v (mx.array): (n_kv_heads, T, head_dim) tail keys and values, any float dtype.
        keep (mx.array): bool, broadcastable to (n_kv_heads, R, T); False masks a key out. A row may
            keep no key of this part (a causal row before this chunk): its partial is (0, -inf, 0).

    Returns:
        tuple: (o, m, l) as in `prefix_partial`.
    """
    s = q @ k.astype(mx.float32).swapaxes(-1, -2)  # (n_kv, R, T)
    s = mx.where(keep, s, -mx.inf)
    m = s.max(axis=-1)
    p = _exp_shifted(s, m)
    return p @ v.astype(mx.float32), m, p.sum(axis=-1)


def merge(parts):
    """Combine partials (o, m, l) of disjoint key sets into the normalized attention output.

    Every row must see at least one key in some part (its own position in the tail), so the
    merged m is finite and a part with m = -inf for that row is weighted by exp(-inf) = 0.

    Returns:
        mx.array: (n_kv_heads, R, head_dim) float32.
    """
    m = parts[0][1]
    for _, mi, _ in parts[1:]:
        m = mx.maximum(m, mi)
    num = den = 0
    for o, mi, li in parts:
        a = mx.exp(mi - m)
        num = num + o * a[..., None]
        den = den + li * a
    return num / den[..., None]
