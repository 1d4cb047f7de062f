"""One layer's prefix of random K/V encoded by a tier into pages, and float64 attention over the decoded pages:
the portable path's reference (tests/attention/test_tier_attention.py, test_unpacked.py).
"""

import mlx.core as mx
import numpy as np

from cartridge.attention.prefix import LayerPrefix
from cartridge.tiers import TIERS

# (tokens, page size): one token; a page - 1, exactly one page, a page + 1; several pages, odd tail
SHAPES = [(1, 16), (15, 16), (16, 16), (17, 16), (75, 32)]
N_KV, HEAD_DIM = 2, 64


def pages_of(codec, x, params, page_size):
    """Encode x (n_kv, T, D), zero-padded to whole pages, into {component: (n_pages, n_kv, P, W)}."""
    n_kv, t, d = x.shape
    pad = -t % page_size
    x = mx.pad(x, [(0, 0), (0, pad), (0, 0)])
    n_pages = x.shape[1] // page_size
    parts = codec.encode(x, params)
    # (n_kv, n_pages * P, W) -> (n_pages, n_kv, P, W)
    return {k: v.reshape(n_kv, n_pages, page_size, -1).transpose(1, 0, 2, 3) for k, v in parts.items()}


def reference(q, k_pages, v_pages, n_tokens):
    """float64 softmax(q k^T) v over the first n_tokens decoded tokens: (n_kv, R, D)."""
    def flat(p):  # (n_pages, n_kv, P, D) -> (n_kv, n_pages * P, D)
        p = np.array(p).astype(np.float64)
        return p.transpose(1, 0, 2, 3).reshape(p.shape[1], -1, p.shape[-1])[:, :n_tokens]
    k, v = flat(k_pages), flat(v_pages)
    s = np.array(q).astype(np.float64) @ k.swapaxes(-1, -2)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def layer(name, n_tokens, page_size, seed):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((N_KV, n_tokens, HEAD_DIM)).astype(np.float32) * 1.5)
    v = mx.array(rng.standard_normal((N_KV, n_tokens, HEAD_DIM)).astype(np.float32))
    codec = TIERS[name]
    kp, vp = codec.make_params(k, 1, "k"), codec.make_params(v, 1, "v")
    kparts, vparts = pages_of(codec, k, kp, page_size), pages_of(codec, v, vp, page_size)
    return LayerPrefix(codec, kparts, codec, vparts, n_tokens, kp, vp)
