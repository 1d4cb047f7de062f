"""A question's prefill over the prefix by MLX's own attention: the layer's pages decoded for this call only.

The fused decode kernels (`cuda.py`) give each block a few query rows and stream the whole prefix for them,
so their time grows with the rows (256 question tokens x a GQA group of 4 is 1,024 rows per KV head; where the
paths cross over: docs/performance.md "Questions"). For many rows the prefix is decoded to the queries' dtype as
one sequence with the tail after it and handed to `mx.fast.scaled_dot_product_attention` (tensor cores, one pass
over K/V for all rows). The decoded copy is a temporary of this call (one layer's K/V at a time); decode steps
never take this path.

What it costs beyond MLX's own attention is one write of the layer's K/V in the queries' dtype: the pages are
decoded already laid out as (n_kv_heads, tokens, head_dim) with room for the tail (the stored components are
transposed and padded, which moves compressed bytes only), the tail and any protected tokens are written
into that buffer in place, and rotated tiers (+rot, TurboQuant) stay in the basis they were stored in: the
queries are rotated into it and the output rotated back (`TierCodec.decode_stored`), rather than every stored
token rotated back.
"""

import mlx.core as mx


def _laid(a, extra):
    """A stored component (n_pages, n_kv, P, W) as (n_kv, n_pages + extra, P, W), the extra pages zero."""
    a = a.transpose(1, 0, 2, 3)  # (n_kv, n_pages, P, W)
    if not extra:
        return a
    return mx.concatenate([a, mx.zeros((a.shape[0], extra, *a.shape[2:]), dtype=a.dtype)], axis=1)


def _sequence(prefix, side, dtype, tail, n, decoded=None):
    """One side as (1, n_kv, n, D) in `dtype` and in its stored basis: prefix tokens, then `tail` (n_kv, T, D).
    `decoded`, where given, is the stored tokens already decoded into a (1, n_kv, n, D) array (by a kernel; None:
    MLX ops decode them).

    Returns:
        tuple: (array, basis or None) as `TierCodec.decode_stored`.
    """
    codec, parts, params = ((prefix.k_codec, prefix.k_parts, prefix.k_params) if side == "k"
                            else (prefix.v_codec, prefix.v_parts, prefix.v_params))
    n_pages, n_kv, page, _ = next(iter(parts.values())).shape
    x = decoded
    if x is not None:
        basis = codec.stored_basis(params)
    else:
        extra = max(0, -(-n // page) - n_pages)  # pages of room for the tail
        x, basis = codec.decode_stored({name: _laid(a, extra) for name, a in parts.items()}, params)
        # (n_kv, pages, P, D) -> (1, n_kv, pages * P, D): free when decoding made a new array, one copy otherwise
        x = x.astype(dtype).reshape(1, n_kv, -1, x.shape[-1])

    def put(values):  # an original-basis (n_kv, T, D) array in this side's basis and dtype
        return (values if basis is None else basis.rotate(values)).astype(dtype)

    t = prefix.n_tokens
    if prefix.protected is not None:  # format 1.5: the first and last tokens from their fp16 copies
        kept = prefix.protected.k if side == "k" else prefix.protected.v
        lo, hi = prefix.protected.page_range(t)
        if lo:
            x[:, :, :lo] = put(kept[:, :lo])
        if hi < t:
            x[:, :, hi:t] = put(kept[:, lo:])
    x[:, :, t:n] = put(tail)
    return x[:, :, :n], basis


def per_kv_head(fn, x, n_kv):
    """fn over (1, n_q, L, D) queries or outputs grouped by KV head as (n_kv, group x L, D)."""
    _, n_q, L, D = x.shape
    # (1, n_q, L, D) -> (n_kv, n_q / n_kv * L, D): q head h belongs to KV head h // group
    return fn(x.reshape(n_kv, n_q // n_kv * L, D)).reshape(1, n_q, L, D)


def _sdpa(queries, keys, values, scale, sinks):
    # "causal" with fewer queries than keys lines the queries up with the last keys: every prefix token visible
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal", sinks=sinks)


def prefill_attention(prefix, tail, queries, scale, sinks=None, attend=_sdpa, decoded=None):
    """Attention of the last L tail tokens over prefix + tail, causal among the tail, by MLX's SDPA.

    Args:
        prefix (LayerPrefix): the layer's stored pages.
        tail (state.Tail): the cache's dense tail; it holds the L query tokens' K/V at its end.
        queries (mx.array): (1, n_q_heads, L, head_dim). scale (float): softmax scale.
        sinks (mx.array | None): (n_q_heads,) sink logits (gpt-oss), or None.
        attend (callable): attend(queries, keys, values, scale, sinks) over the (1, n_kv, S, D) sequences,
            causal with the L queries on the last L keys. Default: MLX's SDPA (`kernels.cpu.question_prefill`
            passes its own).
        decoded (list | None): per side (K, V), its stored tokens already decoded as (1, n_kv, n, head_dim) of the
            queries' dtype, n = prefix + tail tokens, with room for the tail (`kernels.cuda` passes `cuda_decode`'s),
            or None for a side MLX ops decode here. Default: None (both).

    Returns:
        mx.array: (1, n_q_heads, L, head_dim) in the queries' dtype.
    """
    dt = queries.dtype
    tk, tv = tail.kv()  # (n_kv, T, D)
    n_kv, n = tk.shape[0], prefix.n_tokens + tk.shape[1]
    dk, dv = decoded or (None, None)
    k, k_basis = _sequence(prefix, "k", dt, tk, n, dk)
    v, v_basis = _sequence(prefix, "v", dt, tv, n, dv)
    if k_basis is not None:
        queries = per_kv_head(k_basis.rotate, queries, n_kv).astype(dt)
    out = attend(queries, k, v, scale, sinks)
    return out if v_basis is None else per_kv_head(v_basis.unrotate, out, n_kv).astype(dt)
