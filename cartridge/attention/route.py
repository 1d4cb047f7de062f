"""Route mlx-lm's attention to `CartridgeCache.attention` when the layer's cache is a cartridge.

mlx-lm model files call `scaled_dot_product_attention(queries, keys, values, cache=..., scale=...,
mask=...)`, bound at their import by `from .base import scaled_dot_product_attention`. `install()`
rebinds `mlx_lm.models.base.scaled_dot_product_attention` itself, so a family module imported later
binds the routed function, and the name in every model module already imported. The routed function
calls the original for every other cache, so models run unchanged.
"""

import sys
from contextlib import contextmanager

from mlx_lm.models import base

from .caches import CartridgeCache, PrefillCache

# `__wrapped__` guards a re-import of this module after install(): the original stays mlx-lm's.
_ORIGINAL = getattr(base.scaled_dot_product_attention, "__wrapped__", base.scaled_dot_product_attention)
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


scaled_dot_product_attention.__wrapped__ = _ORIGINAL


def install():
    """Route mlx-lm's attention through `scaled_dot_product_attention` (idempotent, any import order).

    Rebinds the name in `mlx_lm.models.base`, where model modules imported from now on take it, and in
    every module already imported that bound mlx-lm's original at its import: mlx-lm's families and a
    model file of one's own (`from mlx_lm.models.base import scaled_dot_product_attention`) alike.
    Once `base` holds the routed function no module can bind the original any more, so a later call
    returns at once (the scan of `sys.modules` took 1.5 ms on the 2-core CPU).
    """
    if base.scaled_dot_product_attention is scaled_dot_product_attention:
        return
    base.scaled_dot_product_attention = scaled_dot_product_attention
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)  # the dict, not getattr: no lazy module __getattr__ runs
        if isinstance(names, dict) and names.get("scaled_dot_product_attention") is _ORIGINAL:
            module.scaled_dot_product_attention = scaled_dot_product_attention


@contextmanager
def watching(seen):
    """Call seen(queries, keys, values, cache, mask) on every routed attention call inside the block."""
    _WATCHERS.append(seen)
    try:
        yield
    finally:
        _WATCHERS.remove(seen)
