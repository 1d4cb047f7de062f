"""K or V of one layer as page-major component arrays: encoded as the container stores them, and decoded back
to dense pages a few pages at a time."""

import mlx.core as mx

from ..tiers import protect
from .prefix import LayerPrefix

# dense elements decoded at a time (4 MiB of float32), and the bytes a chunk's float32 decode holds per element,
# its output included: mx.dequantize of a whole 27 MB mxfp4 side peaked at 62 MB on the CPU (2.3 x 4 bytes an
# element); decoded 4 pages at a time into the 27 MB buffer, at 36.8 MB (mx.get_peak_memory, 2026-12-02)
DECODE_CHUNK = 1 << 20
DECODE_BYTES = 10
# K/V elements encoded at a time (whole pages: 2 pages of 8 KV heads x 256 x 128). One encode of a whole side
# holds every temporary of its graph at once: turbo4 of 131,072 tokens x 8 KV heads x 128 peaked at 13.0 GB,
# 48.5x the side's 268 MB of fp16 (mx.get_peak_memory, CPU, 2026-12-05; docs/performance.md "Encode memory")
ENCODE_CHUNK = 1 << 19


def encode_pages(codec, x, params, page_size):
    """Encode (n_kv_heads, T, head_dim) and lay it out in pages, a block of whole pages at a time: each block is
    encoded, evaluated and written into the output before the next, so the encode holds the input, the output
    and one block's temporaries (ENCODE_CHUNK) whatever T. Every codec encodes each token (or kivi4's group of
    32 tokens, which pages hold whole) on its own, so the blocks give the parts one encode of the whole side
    gives, bit for bit (tests/attention/test_pages.py). A side of one block is returned unevaluated, as one encode.

    Args:
        codec (TierCodec): the tier. x (mx.array): K or V, any float dtype.
        params (dict): the tier's (layer, side) parameters (`codec.make_params`).
        page_size (int): tokens per page; the last page is zero-padded (spec/FORMAT.md 3.1).

    Returns:
        dict[str, mx.array]: component -> (n_pages, n_kv_heads, page_size, width), row-contiguous.
    """
    n_kv, T, d = x.shape
    n_pages = -(-T // page_size)
    step = max(1, ENCODE_CHUNK // (n_kv * page_size * d))  # pages per block
    if n_pages <= step:
        return _encode_block(codec, x, params, page_size)
    out = {}
    for a in range(0, n_pages, step):
        b = min(a + step, n_pages)
        parts = _encode_block(codec, x[:, a * page_size:b * page_size], params, page_size)
        for name, part in parts.items():
            if name not in out:  # the first block tells each component's width and dtype
                out[name] = mx.zeros((n_pages, *part.shape[1:]), dtype=part.dtype)
            out[name][a:b] = part
        mx.eval(list(out.values()))
    return out


def _encode_block(codec, x, params, page_size):
    """x (n_kv, T, D) zero-padded to whole pages and encoded: component -> (n_pages, n_kv, P, W), lazy."""
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


def decode_pages(codec, parts, params, dtype, protected=None, side="k", n_tokens=0, lazy=False):
    """Dense pages of one side, decoded a chunk of pages at a time into one buffer (updated in place), so the
    decode holds the dense pages and one chunk's temporaries rather than a float32 copy of the whole side.
    With `lazy`, the whole side's decode as one unevaluated graph instead: MLX runs it where the pages are
    first read (the first forward pass) and keeps the result, so a load decodes nothing.

    Args:
        codec (TierCodec): the side's tier. parts (dict[str, mx.array]): its components (n_pages, n_kv, P, W).
        params (dict): the tier's parameters. dtype (mx.Dtype): of the dense pages.
        protected (Protected | None): fp16 copies of protected tokens, written over their positions. Default: None.
        side (str): "k" or "v" (which copies). n_tokens (int): the prefix's tokens (where the last ones are).
        lazy (bool): return the decode unevaluated (no chunking: its peak is the whole side's). Default: False.

    Returns:
        mx.array: (n_pages, n_kv, P, head_dim) of `dtype`, evaluated unless `lazy`.
    """
    if lazy:
        out = codec.decode(dict(parts), params).astype(dtype)
        return out if protected is None else protect.overwrite_in_place(out, protected, side, n_tokens)
    n_pages, n_kv, page, _ = next(iter(parts.values())).shape
    out = None
    a, step = 0, 1
    while a < n_pages:
        x = codec.decode({name: arr[a:a + step] for name, arr in parts.items()}, params).astype(dtype)
        if out is None:  # the first page tells head_dim: the buffer and the chunk size follow
            out = x if n_pages == 1 else mx.zeros((n_pages, *x.shape[1:]), dtype=dtype)
            step = max(1, DECODE_CHUNK // (n_kv * page * x.shape[-1]))
        if n_pages > 1:
            out[a:a + x.shape[0]] = x
        mx.eval(out)
        a += x.shape[0]
    if protected is not None:
        protect.overwrite_in_place(out, protected, side, n_tokens)
        mx.eval(out)
    return out


def decode_prefix(prefix, dtype):
    """K and V of a `LayerPrefix` decoded to (1, n_kv_heads, n_tokens, head_dim) arrays of `dtype`, with
    protected tokens (if any) from their fp16 copies: each side decoded a chunk of pages at a time
    (`decode_pages`), then laid out as one sequence (the caller evaluates that copy). K stored scaled (format
    1.11) is multiplied back by its scale: these are the model's own K, for mlx-lm's attention."""
    out = []
    for side, codec, parts, params in (("k", prefix.k_codec, prefix.k_parts, prefix.k_params),
                                       ("v", prefix.v_codec, prefix.v_parts, prefix.v_params)):
        x = decode_pages(codec, parts, params, dtype, prefix.protected, side, prefix.n_tokens)
        n_pages, n_kv, page, d = x.shape
        # (n_pages, n_kv, P, D) -> (1, n_kv, n_pages * P, D), then the valid tokens
        x = x.transpose(1, 0, 2, 3).reshape(1, n_kv, n_pages * page, d)[:, :, :prefix.n_tokens]
        if side == "k" and prefix.key_scale is not None:
            x = (x * prefix.key_scale[None, :, None, :]).astype(dtype)
        out.append(x)
    return out
