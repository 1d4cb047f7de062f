"""Route mlx-lm's attention to `CartridgeCache.attention` when the layer's cache is a cartridge.

mlx-lm model files call `scaled_dot_product_attention(queries, keys, values, cache=..., scale=...,
mask=...)` imported from `mlx_lm.models.base`. `install()` rebinds that name in every loaded mlx-lm
model module to `scaled_dot_product_attention` below, which calls the original for every other cache,
so models run unchanged.
"""

import sys

from mlx_lm.models import base

from ..errors import CartridgeError
from .cache import CartridgeCache

_ORIGINAL = base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention signature; a CartridgeCache attends over its prefix pages and tail.

    Args:
        queries (mx.array): (B, n_q_heads, L, head_dim).
        keys, values: what the cache's `update_and_fetch` returned.
        cache: the layer's cache. scale (float): softmax scale. mask: None, "causal" or an array.
        sinks: attention sinks (not supported with a cartridge).

    Returns:
        mx.array: (B, n_q_heads, L, head_dim).
    """
    if isinstance(cache, CartridgeCache):
        if sinks is not None:
            raise CartridgeError("attention sinks are not supported over a cartridge prefix")
        return cache.attention(queries, scale, mask)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install():
    """Rebind the attention function in every imported mlx-lm model module (idempotent)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL:
            module.scaled_dot_product_attention = scaled_dot_product_attention
