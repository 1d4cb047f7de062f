"""Encode K or V of one layer into page-major component arrays, as the container stores them."""

import mlx.core as mx

from .cache import LayerPrefix


def encode_pages(codec, x, params, page_size):
    """Encode (n_kv_heads, T, head_dim) and lay it out in pages.

    Args:
        codec (TierCodec): the tier. x (mx.array): K or V, any float dtype.
        params (dict): the tier's (layer, side) parameters (`codec.make_params`).
        page_size (int): tokens per page; the last page is zero-padded (spec/FORMAT.md 3.1).

    Returns:
        dict[str, mx.array]: component -> (n_pages, n_kv_heads, page_size, width), row-contiguous.
    """
    n_kv, T, _ = x.shape
    pad = -T % page_size
    if pad:
        x = mx.pad(x, [(0, 0), (0, pad), (0, 0)])
    n_pages = (T + pad) // page_size
    out = {}
    for name, part in codec.encode(x, params).items():
        # (n_kv, n_pages * P, W) -> (n_pages, n_kv, P, W)
        paged = part.reshape(n_kv, n_pages, page_size, part.shape[-1]).transpose(1, 0, 2, 3)
        out[name] = mx.contiguous(paged)
    return out


def make_prefix(k_codec, k, v_codec, v, page_size, layer=0):
    """A LayerPrefix of K and V (n_kv_heads, T, head_dim) encoded with the given tiers (tests, bench)."""
    k_params = k_codec.make_params(k, layer, "k")
    v_params = v_codec.make_params(v, layer, "v")
    return LayerPrefix(k_codec, encode_pages(k_codec, k, k_params, page_size),
                       v_codec, encode_pages(v_codec, v, v_params, page_size), k.shape[1], k_params, v_params)
