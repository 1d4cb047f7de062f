"""Route mlx-lm's attention to `CartridgeCache.attention` when the layer's cache is a cartridge.

mlx-lm model files call `scaled_dot_product_attention(queries, keys, values, cache=..., scale=...,
mask=...)` imported from `mlx_lm.models.base`. `install()` rebinds that name in every loaded mlx-lm
model module to `scaled_dot_product_attention` below, which calls the original for every other cache,
so models run unchanged.
"""

import sys
from contextlib import contextmanager

from mlx_lm.models import base

from .cache import CartridgeCache
from .prefill import PrefillCache

_ORIGINAL = base.scaled_dot_product_attention
_WATCHERS = []  # callables seen(queries, keys, values, cache, mask): `cartridge.models.families` probes


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention signature; a CartridgeCache attends over its prefix pages and tail, a
    PrefillCache (extend) through `PrefillCache.attention`.

    Args:
        queries (mx.array): (B, n_q_heads, L, head_dim).
        keys, values: what the cache's `update_and_fetch` returned.
        cache: the layer's cache. scale (float): softmax scale. mask: None, "causal" or an array.
        sinks (mx.array | None): (n_q_heads,) attention sink logits (gpt-oss), one more logit per head.

    Returns:
        mx.array: (B, n_q_heads, L, head_dim).
    """
    for seen in _WATCHERS:
        seen(queries, keys, values, cache, mask)
    if isinstance(cache, CartridgeCache):
        return cache.attention(queries, scale, mask, sinks)
    if isinstance(cache, PrefillCache) and sinks is None:
        return cache.attention(queries, keys, values, scale, mask, _ORIGINAL)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install():
    """Rebind the attention function in every imported mlx-lm model module (idempotent)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL:
            module.scaled_dot_product_attention = scaled_dot_product_attention


@contextmanager
def watching(seen):
    """Call seen(queries, keys, values, cache, mask) on every routed attention call inside the block."""
    _WATCHERS.append(seen)
    try:
        yield
    finally:
        _WATCHERS.remove(seen)
