"""Dense mlx-lm caches holding what a loaded cartridge's pages decode to (the reference a cartridge cache must
attend like: tests/attention/test_cache.py, test_tier_attention.py, test_unpacked.py; tests/tiers/test_protect.py),
and the document those tests build.
"""

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

DOC = ("The warranty on the Model 7 kettle lasts 24 months from the date of purchase. "
       "Claims are sent to Kettle Co, 12 Harbour Road. ") * 8


def _decoded_kv_cache(cart):
    """Dense mlx-lm caches holding exactly what the cartridge pages decode to."""
    caches = []
    for prefix in cart.prefixes:
        c = KVCache()
        for side, codec, parts, params in (("k", prefix.k_codec, prefix.k_parts, prefix.k_params),
                                           ("v", prefix.v_codec, prefix.v_parts, prefix.v_params)):
            x = codec.decode(parts, params)  # (n_pages, n_kv, P, D)
            x = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[None, :, : prefix.n_tokens]
            setattr(c, "keys" if side == "k" else "values", x)
        c.offset = prefix.n_tokens
        caches.append(c)
    return caches


def _logits(model, tokens, cache):
    return model(mx.array(tokens)[None], cache=cache)[0]


def dense_reference(cart):
    """mlx-lm caches of the decoded pages with the protected positions set to the stored fp16 copies (K stored
    scaled multiplied back by its scale)."""
    info, caches = cart.info, []
    n, first, last = len(info.tokens), info.protect_first, info.protect_last
    for layer, prefix in enumerate(cart.prefixes):
        c = KVCache()
        for side, codec, parts, params in (("k", prefix.k_codec, prefix.k_parts, prefix.k_params),
                                           ("v", prefix.v_codec, prefix.v_parts, prefix.v_params)):
            x = np.array(codec.decode(parts, params))  # (n_pages, n_kv, P, D)
            x = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[:, :n].copy()  # (n_kv, T, D)
            if first or last:  # (a preset may protect nothing)
                kept = info.protected[(layer, side)].astype(np.float32)
                x[:, :first], x[:, n - last:] = kept[:, :first], kept[:, first:]
            if side == "k" and prefix.key_scale is not None:  # stored as K / s (format 1.11): the model's K
                x = x * np.array(prefix.key_scale)[:, None, :]
            setattr(c, "keys" if side == "k" else "values", mx.array(x)[None])
        c.offset = n
        caches.append(c)
    return caches
