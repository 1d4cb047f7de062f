"""The queries' second moment per layer and KV head, gathered while the build prefills the document (issue 49).

Score-aware encoding (`cartridge.tiers.score_aware`) chooses K's codes for the score error q . (k - k_hat), whose
expected square is (k - k_hat)^T E[q q^T] (k - k_hat). A question's queries are not known at build, but they come
from the same layers over the same document: the document's own queries, every position of the prefill, stand in
for them (post-RoPE, as K is stored). A GQA KV head is read by its group of query heads, whose queries are pooled.
Only the (head_dim x head_dim) sums are kept, never the queries.
"""

import mlx.core as mx
import numpy as np

from ..attention import route
from ..tiers import key_scale


class QueryMoments:
    """Sums of q q^T per (cache, KV head) over every query a routed attention call sees; a `route.watching`
    callback. The caches are told apart by identity while they fill, and named by layer at the end (`weights`).

    Example:
        >>> moments = QueryMoments()  # doctest: +SKIP
        >>> with route.watching(moments):
        ...     caches = prefill(model, tokens)
        >>> moments.weights(caches)[(0, "k")].shape  # (n_kv_heads, head_dim, head_dim)
    """

    def __init__(self):
        self.sums, self.counts, self.caches = {}, {}, {}

    def __call__(self, queries, keys, values, cache, mask):
        """Add one attention call's queries (B, n_heads, L, head_dim); keys (B, n_kv_heads, S, head_dim)."""
        if keys is None or queries.shape[-1] != keys.shape[-1]:
            return
        layer = id(cache)
        self.caches[layer] = cache  # held, so that no other object takes its id while the prefill runs
        b, h, n, d = queries.shape
        n_kv = keys.shape[1]
        # query head i reads KV head i // (h / n_kv) (mlx-lm's GQA): (B, h, L, D) -> (n_kv, B * h / n_kv * L, D)
        q = queries.astype(mx.float32).reshape(b, n_kv, h // n_kv * n, d).swapaxes(0, 1).reshape(n_kv, -1, d)
        total = q.swapaxes(-1, -2) @ q  # (n_kv, D, D)
        self.sums[layer] = total if layer not in self.sums else self.sums[layer] + total
        mx.eval(self.sums[layer])  # a chunk at a time: the sum must not hold the chunk's graph
        self.counts[layer] = self.counts.get(layer, 0) + q.shape[1]

    def weights(self, caches):
        """(layer, "k") -> (n_kv_heads, head_dim, head_dim) float64 numpy E[q q^T], for `score_aware.weighting`.

        Args:
            caches (list): the prefill's mlx-lm caches, one per layer in order; queries read against any other
                cache (one inside a `CacheList`) are left out.
        """
        return {(layer, "k"): np.array(self.sums[id(c)]).astype(np.float64) / self.counts[id(c)]
                for layer, c in enumerate(caches) if id(c) in self.sums and self.caches[id(c)] is c}


def key_scales(weights, caches, kinds):
    """layer -> (n_kv_heads, head_dim) float32 per-channel K scale (`cartridge.tiers.key_scale.choose`) of every
    "attention" layer whose queries were seen.

    Args:
        weights (dict): `QueryMoments.weights`. caches (list): the prefill's mlx-lm caches, one per layer.
        kinds (list[str]): each layer's kind (`LayerPlan.kind`): only "attention" layers are scaled.
    """
    out = {}
    for layer, (cache, kind) in enumerate(zip(caches, kinds)):
        h = weights.get((layer, "k"))
        if kind == "attention" and h is not None:
            keys = cache.state[0][0]  # (n_kv_heads, T, head_dim)
            out[layer] = key_scale.choose(h, np.array(keys.astype(mx.float32)))
    return out


def collecting():
    """(moments, context manager): a new `QueryMoments` and the `route.watching` that feeds it."""
    route.install()
    moments = QueryMoments()
    return moments, route.watching(moments)
