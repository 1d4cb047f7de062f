"""The cache of one layer in calibration's batched walk (`measure.wavefront`).

Rows 0 .. R-2 of the walk attend over the same fp16 prefix and row R-1 over its replacement, each row also
over its own evaluation tokens. mlx-lm's attention would take R copies of the prefix and run R x n_heads
small products; here the shared rows' queries are stacked into one product per KV head, and the own-token
part is merged in the same softmax. `route` sends a `PrefillCache`'s attention to its `attention` method.
"""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..attention.prefill import PrefillCache


class SharedPrefixCache(PrefillCache):
    """One layer of the walk: a shared prefix (k, v), the last row's replacement (k2, v2).

    Args:
        k, v, k2, v2 (mx.array): (1, n_kv_heads, S, head_dim) each.
    """

    def __init__(self, k, v, k2, v2):
        KVCache.__init__(self)  # not PrefillCache's: nothing to decode
        self.prefix, self.replaced = (k, v), (k2, v2)
        self.offset = self.prefix_tokens = k.shape[2]

    def update_and_fetch(self, keys, values):
        """Keep the rows' own K/V, (R, n_kv_heads, E, head_dim); the prefix is attended in `attention`."""
        self.offset += keys.shape[2]
        return keys, values

    def attention(self, queries, keys, values, scale, mask, fallback=None):
        """Causal attention of queries (R, n_heads, E, head_dim) over the prefix of their row and their own
        keys/values (R, n_kv_heads, E, head_dim): (R, n_heads, E, head_dim) in the queries' dtype."""
        r, h, e, d = queries.shape
        n_kv, s = keys.shape[1], self.offset - e
        q = (queries.astype(mx.float32) * scale).reshape(r, n_kv, h // n_kv * e, d)  # (R, n_kv, g * E, D)
        (k, v), (k2, v2) = ((a[0].astype(mx.float32) for a in pair) for pair in (self.prefix, self.replaced))
        rows = q.shape[2]
        shared = q[:-1].transpose(1, 0, 2, 3).reshape(n_kv, (r - 1) * rows, d)  # (n_kv, (R-1) g E, D)
        pre = mx.concatenate([(shared @ k.swapaxes(-1, -2)).reshape(n_kv, r - 1, rows, s).transpose(1, 0, 2, 3),
                              (q[-1] @ k2.swapaxes(-1, -2))[None]])  # (R, n_kv, g E, S)
        own = q @ keys.astype(mx.float32).swapaxes(-1, -2)  # (R, n_kv, g E, E)
        position = mx.arange(rows) % e  # query row g_i * E + i is at position i
        own = mx.where(mx.arange(e)[None] <= position[:, None], own, -mx.inf)
        top = mx.maximum(pre.max(axis=-1, keepdims=True), own.max(axis=-1, keepdims=True))
        p_pre, p_own = mx.exp(pre - top), mx.exp(own - top)
        z = p_pre.sum(axis=-1, keepdims=True) + p_own.sum(axis=-1, keepdims=True)
        shared_out = (p_pre[:-1].transpose(1, 0, 2, 3).reshape(n_kv, (r - 1) * rows, s) @ v)
        out_pre = mx.concatenate([shared_out.reshape(n_kv, r - 1, rows, d).transpose(1, 0, 2, 3),
                                  (p_pre[-1] @ v2)[None]])  # (R, n_kv, g E, D)
        out = (out_pre + p_own @ values.astype(mx.float32)) / z
        return out.reshape(r, h, e, d).astype(queries.dtype)  # (R, n_kv, g, E, D) -> (R, n_heads, E, D)
