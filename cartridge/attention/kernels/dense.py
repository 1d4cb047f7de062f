"""A question's prefill over the prefix by MLX's own attention: the layer's pages decoded for this call only.

The fused decode kernels (`cuda.py`) give each block a few query rows and stream the whole prefix for them,
so their time grows with the rows: 256 question tokens x a GQA group of 4 is 1,024 rows per KV head, and
there the kernel took 5-8x MLX's dense attention on an H200 (benchmarks/results/h200-tc.log, 131,072
tokens). For that many rows the prefix is decoded to the queries' dtype, laid out as one sequence, joined to
the tail and handed to `mx.fast.scaled_dot_product_attention` (tensor cores, one pass over K/V for all rows).
The decoded copy is a temporary of this call (one layer's K/V at a time); decode steps never take this path.
"""

import mlx.core as mx

from ..layers import decode_prefix


def prefill_attention(prefix, cache, queries, scale, sinks=None):
    """Attention of the last L tail tokens over prefix + tail, causal among the tail, by MLX's SDPA.

    Args:
        prefix (LayerPrefix): the layer's stored pages.
        cache (CartridgeCache): its tail (`tail_kv`) holds the L query tokens' K/V at its end.
        queries (mx.array): (1, n_q_heads, L, head_dim). scale (float): softmax scale.
        sinks (mx.array | None): (n_q_heads,) sink logits (gpt-oss), or None.

    Returns:
        mx.array: (1, n_q_heads, L, head_dim) in the queries' dtype.
    """
    dt = queries.dtype
    k, v = decode_prefix(prefix, dt)  # (1, n_kv_heads, n_tokens, head_dim), lazy
    tk, tv = cache.tail_kv()
    k = mx.concatenate([k, tk[None].astype(dt)], axis=2)
    v = mx.concatenate([v, tv[None].astype(dt)], axis=2)
    # "causal" with fewer queries than keys lines the queries up with the last keys: every prefix token visible
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask="causal", sinks=sinks)
