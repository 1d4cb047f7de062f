"""Dense attention of a block of queries on CPU, with the softmax in numpy (extend's prefill, and a question's
prefill over a cartridge's pages: `question_prefill`).

MLX 0.32's CPU exp is scalar code: 17 ns per float32 element on the shared 2-core AMD EPYC (AVX2)
these numbers come from, against 2.2 ns for numpy's SIMD exp (CPU seconds, 10M elements). In the
prefill of 258 tokens over 4,377 (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64), the softmax
took 170 of the 220 ms per layer of `mx.fast.scaled_dot_product_attention`. Here the two matmuls stay
in MLX (OpenBLAS) and the softmax runs in numpy, in place in the scores' buffer: 138 ms.

Reference first (`reference`, float64 numpy), then the fast path (`attention`); tests/attention/test_kernels.py
checks one against the other.
"""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np

from . import dense


def _scores(queries, keys, scale):
    """(1, n_q, L, D) queries and (1, n_kv, S, D) keys -> (n_kv, group * L, S) float32 scores."""
    _, n_q, L, D = queries.shape
    n_kv = keys.shape[1]
    # (1, n_q, L, D) -> (n_kv, group * L, D): query head h = kv * group + g, row g * L + i
    q = (queries.astype(mx.float32) * scale).reshape(n_kv, (n_q // n_kv) * L, D)
    return q @ keys[0].astype(mx.float32).swapaxes(-1, -2)


def _softmax_in_place(a, L, causal):
    """Masked, unnormalized softmax of float32 scores `a` (n_kv, group * L, S) in place.

    Query row g * L + i sits at position S - L + i; with `causal` it sees keys 0 .. S - L + i.

    Returns:
        np.ndarray: (n_kv, group * L, 1) float32, the row sums of exp(s - max).
    """
    n_kv, R, S = a.shape
    if causal and L > 1:
        rows, cols = np.triu_indices(L, 1)  # query i, key S - L + j with j > i
        a.reshape(n_kv, R // L, L, S)[:, :, rows, cols + (S - L)] = -np.inf
    np.subtract(a, a.max(axis=-1, keepdims=True), out=a)  # every row keeps its own key: max is finite
    np.exp(a, out=a)
    return a.sum(axis=-1, keepdims=True)


def attention(queries, keys, values, scale, causal=True):
    """softmax(q k^T * scale, causal mask) v of one sequence, grouped-query aware.

    Args:
        queries (mx.array): (1, n_q_heads, L, head_dim), the last L positions of the S keys.
        keys (mx.array): (1, n_kv_heads, S, head_dim); n_q_heads a multiple of n_kv_heads.
        values (mx.array): (1, n_kv_heads, S, v_head_dim).
        scale (float): softmax scale. causal (bool): query i sees keys 0 .. S - L + i (mlx-lm's
            "causal" mask); False: every key (mask None). Default: True.

    Returns:
        mx.array: (1, n_q_heads, L, v_head_dim) in the queries' dtype; float32 arithmetic.
    """
    _, n_q, L, _ = queries.shape
    s = _scores(queries, keys, scale)
    mx.eval(s)
    # a view of s's own buffer (MLX documents writes through it as changes of s): no copy either way
    sums = _softmax_in_place(np.asarray(s), L, causal)
    o = (s @ values[0].astype(mx.float32)) / mx.array(sums)  # (n_kv, group * L, Dv)
    # (n_kv, group * L, Dv) -> (1, n_q, L, Dv)
    return o.reshape(1, n_q, L, -1).astype(queries.dtype)


def reference(queries, keys, values, scale, causal=True):
    """`attention` in float64 numpy, one query head at a time (tests)."""
    q, k, v = (np.asarray(x.astype(mx.float32), dtype=np.float64)[0] for x in (queries, keys, values))
    n_q, L, _ = q.shape
    S, group = k.shape[1], n_q // k.shape[0]
    out = np.empty((n_q, L, v.shape[-1]))
    for h in range(n_q):
        s = q[h] @ k[h // group].T * scale  # (L, S)
        if causal:
            s[np.arange(S)[None, :] > np.arange(S - L, S)[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[h] = p @ v[h // group] / p.sum(axis=-1, keepdims=True)
    return out[None]


# query rows per KV head (GQA group x question tokens) from which a call decodes the layer's pages for itself:
# below it (a decode step: a GQA group of rows) the portable path over the stored pages is cheaper than a
# decode of every page (docs/performance.md "CPU: a question's prefill over compressed pages")
PREFILL_MIN_ROWS = 16


def _causal(queries, keys, values, scale, sinks):
    return attention(queries, keys, values, scale, causal=True)


@dataclass(frozen=True)
class QuestionPrefill:
    """The CPU backend's record of a layer whose question prefill it reads (`LayerPrefix.backend`): nothing beyond
    the pages; `question_prefill` attends."""

    name: ClassVar[str] = "cpu"


def question_prefill(prefix, queries, tail, scale, sinks=None):
    """A question's prefill over one layer's pages on the CPU: the pages decoded for this call only (rotated sides
    stay in their stored basis: `kernels.dense.prefill_attention`), then `attention` (BLAS matmuls, the softmax in
    numpy). The call evaluates its output, so the decoded K/V of one layer are freed before the next layer's are
    made: a forward pass holds one layer's float32 K/V beyond the stored pages, never the whole prefix.

    Args:
        prefix (LayerPrefix): the layer's pages as placed (stored, unpacked or dense sides).
        queries (mx.array): (1, n_q_heads, L, head_dim). tail (state.Tail): the cache's tail, the queries' K/V last.
        scale (float): softmax scale. sinks (mx.array | None): (n_q_heads,) sink logits, or None.

    Returns:
        mx.array | None: (1, n_q_heads, L, head_dim) in the queries' dtype, or None (the portable path) for fewer
        than `PREFILL_MIN_ROWS` rows per KV head, or with sinks (`attention` has none).
    """
    _, n_q, L, _ = queries.shape
    if sinks is not None or n_q // prefix.n_kv_heads * L < PREFILL_MIN_ROWS:
        return None
    out = dense.prefill_attention(prefix, tail, queries, scale, None, _causal)
    mx.eval(out)
    return out
