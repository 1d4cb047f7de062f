"""Random attention cases over a frozen prefix (pages of one tier) plus a dense tail, and the float64 reference the
attention kernels are checked against (tests/attention/test_kernels.py, test_metal_kernels.py, test_cpu_prefill.py).

The reference decodes the stored pages with the tier's own `decode`, so only the attention arithmetic is compared:
kernel error apart from tier fidelity, like mlx's test_qmm.
"""

import zlib
from dataclasses import replace

import mlx.core as mx
import numpy as np

from cartridge.attention.caches import CartridgeCache
from cartridge.attention.pages import make_prefix
from cartridge.tiers import TIERS, protect

# relative error (max abs error / max abs reference), float32 accumulation, by the queries' dtype: with fp16
# queries the tensor-core passes also round probabilities and values to fp16 (mlx4g32+rot, GQA 4, 5 query tokens:
# 1.05e-3 on an H200, benchmarks/results/h200-kernel-tests-protect.log)
TOL = 1e-3
TOL_FP16 = 2e-3
# bf16 queries: the tail and the output are bf16 too, and rounding the output alone is up to 2^-9 of each value
# (the prefill kernel: 2.34e-3 and 2.72e-3 on an H200, benchmarks/results/h200-s5-kernel-tests.log)
TOL_BF16 = 5e-3


def reference(q, k, v, tail_k, tail_v, scale, sinks=None):
    """float64 attention: q (n_q, L, D) over prefix k/v (n_kv, N, D) then tail (n_kv, T, D), causal tail;
    `sinks` (n_q,): one more logit per head with no value (gpt-oss)."""
    n_q, L, D = q.shape
    n_kv, N, _ = k.shape
    T = tail_k.shape[1]
    g = n_q // n_kv
    keys = np.concatenate([k, tail_k], axis=1).astype(np.float64)
    vals = np.concatenate([v, tail_v], axis=1).astype(np.float64)
    out = np.zeros((n_q, L, D))
    for h in range(n_q):
        s = q[h].astype(np.float64) @ keys[h // g].T * scale  # (L, N + T)
        for i in range(L):
            s[i, N + T - L + i + 1:] = -np.inf
        top = s.max(axis=1, keepdims=True) if sinks is None else np.maximum(s.max(axis=1, keepdims=True), sinks[h])
        p = np.exp(s - top)
        den = p.sum(axis=1, keepdims=True) + (0 if sinks is None else np.exp(sinks[h] - top))
        out[h] = (p / den) @ vals[h // g]
    return out


def _seed(*key):
    """A seed fixed by the case (Python's hash of a string changes with every process)."""
    return zlib.crc32(repr(key).encode())


def _case(tier, shape, seed):
    n_q, n_kv, D, N, P, T, L = shape
    rng = np.random.default_rng(seed)
    k, v = (mx.array(rng.standard_normal((n_kv, N, D)).astype(np.float32)) for _ in range(2))
    codec = TIERS[tier]
    codec.check(n_kv, D)
    prefix = make_prefix(codec, k, codec, v, P)
    tail_k, tail_v = (rng.standard_normal((1, n_kv, T, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, n_q, L, D)).astype(np.float32)
    return prefix, q, tail_k, tail_v


def _cache(prefix, tail_k, tail_v, dtype):
    """A cache over `prefix` holding the tail, its unused tail slots poisoned with NaN."""
    cache = CartridgeCache(prefix, chunk_size=256)
    T = tail_k.shape[2]
    cache.update_and_fetch(mx.array(tail_k).astype(dtype), mx.array(tail_v).astype(dtype))
    for chunks in (cache._k_chunks, cache._v_chunks):
        last = len(chunks) - 1
        used = T - last * cache.chunk_size
        chunks[last][..., used:, :] = mx.nan
    return cache


def with_protected(prefix, first, last, D, seed=4):
    """`prefix` (head_dim `D`) with random fp16 copies of its first `first` and last `last` tokens (format 1.5)."""
    n_kv = prefix.n_kv_heads
    rng = np.random.default_rng(seed)
    kept = [mx.array(rng.standard_normal((n_kv, first + last, D)).astype(np.float16)) for _ in range(2)]
    return replace(prefix, protected=protect.Protected(first, last, *kept))


def protected_reference(prefix, q, tk, tv):
    """float64 attention over the decoded pages with the protected positions set to their copies, then the tail."""
    sides = [np.array(protect.overwrite_in_place(c.decode(p, pr), prefix.protected, side, prefix.n_tokens))
             for c, p, pr, side in ((prefix.k_codec, prefix.k_parts, prefix.k_params, "k"),
                                    (prefix.v_codec, prefix.v_parts, prefix.v_params, "v"))]
    n_pages, n_kv, P, D = sides[0].shape
    # (n_pages, n_kv, P, D) -> (n_kv, N, D)
    k, v = (x.transpose(1, 0, 2, 3).reshape(n_kv, n_pages * P, x.shape[-1])[:, :prefix.n_tokens] for x in sides)
    return reference(q[0], k, v, tk[0], tv[0], D ** -0.5)


def _check(prefix, q, tail_k, tail_v, got, label, sinks=None, tol=TOL):
    k = np.array(prefix.k_codec.decode(prefix.k_parts, prefix.k_params))  # (n_pages, n_kv, P, D)
    v = np.array(prefix.v_codec.decode(prefix.v_parts, prefix.v_params))
    n_pages, n_kv, P, D = k.shape
    # (n_pages, n_kv, P, D) -> (n_kv, N, D)
    k = k.transpose(1, 0, 2, 3).reshape(n_kv, n_pages * P, D)[:, : prefix.n_tokens]
    v = v.transpose(1, 0, 2, 3).reshape(n_kv, n_pages * P, D)[:, : prefix.n_tokens]
    want = reference(q[0], k, v, tail_k[0], tail_v[0], D ** -0.5, sinks)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.isfinite(got).all(), label
    assert err < tol, f"{label}: relative error {err:.2e}"
