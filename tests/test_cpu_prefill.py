"""extend's dense prefill: `kernels.cpu.attention` against a float64 reference (odd lengths, GQA 1/3/4/8,
causal and not, one query, the whole block), and a `PrefillCache` over a decoded prefix gives what
mlx-lm's own prefill of all the tokens gives (the same tokens with a cache as without)."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cartridge.attention import route
from cartridge.attention.kernels import cpu
from cartridge.attention.pages import make_prefix
from cartridge.attention.prefill import PrefillCache
from cartridge.tiers import TIERS

# (n_q_heads, n_kv_heads, query tokens L, keys S, head_dim, v head_dim)
SHAPES = [
    (4, 4, 1, 1, 64, 64),       # GQA 1, one key
    (9, 3, 258, 1001, 64, 64),  # GQA 3 (SmolLM2), odd lengths
    (8, 2, 7, 7, 128, 128),     # GQA 4, the block is the whole sequence
    (16, 2, 33, 300, 128, 64),  # GQA 8, V narrower than K
    (8, 1, 1, 257, 64, 64),     # GQA 8, one KV head, one query (a decode step)
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpu_attention_matches_float64(shape, causal):
    n_q, n_kv, L, S, d, dv = shape
    key = mx.random.key(sum(shape))
    kq, kk, kv = mx.random.split(key, 3)
    q = mx.random.normal((1, n_q, L, d), key=kq) * 2
    k, v = mx.random.normal((1, n_kv, S, d), key=kk) * 2, mx.random.normal((1, n_kv, S, dv), key=kv)
    with mx.stream(mx.cpu):
        got = cpu.attention(q, k, v, d ** -0.5, causal)
    ref = cpu.reference(q, k, v, d ** -0.5, causal)
    assert got.shape == (1, n_q, L, dv) and got.dtype == mx.float32
    assert np.abs(np.array(got) - ref).max() <= 1e-5 * np.abs(ref).max()


def test_cpu_attention_keeps_the_queries_dtype():
    q = mx.random.normal((1, 4, 3, 64), key=mx.random.key(0)).astype(mx.float16)
    k = mx.random.normal((1, 2, 9, 64), key=mx.random.key(1)).astype(mx.float16)
    with mx.stream(mx.cpu):
        got = cpu.attention(q, k, k, 0.125)
    assert got.dtype == mx.float16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), cpu.reference(q, k, k, 0.125), atol=2e-3)


def _feed(model, ids, caches):
    route.install()
    return model(mx.array(ids)[None], cache=caches)[0]  # (len(ids), vocab) logits


def test_prefill_cache_feeds_like_mlx_lm_kvcache(tiny, monkeypatch):
    """A PrefillCache over fp16 pages, the last 3 stored tokens dropped (a seam), fed the rest: the
    logits and new K/V of mlx-lm's own KVCache holding the same (fp16-rounded) prefix, through the CPU kernel."""
    model, ids, n, keep = tiny.model, list(range(5, 46)), 29, 26
    first = make_prompt_cache(model)
    _feed(model, ids[:n], first)
    prefixes = [make_prefix(TIERS["fp16"], c.keys[0, :, :n], TIERS["fp16"], c.values[0, :, :n], page_size=16)
                for c in first]
    ref = make_prompt_cache(model)
    for c, p in zip(ref, prefixes):  # the rounded prefix, as mlx-lm's cache holds a prefill
        k, v = (x.astype(mx.float32).transpose(1, 0, 2, 3).reshape(1, x.shape[1], -1, x.shape[-1])[:, :, :keep]
                for x in (p.k_parts["values"], p.v_parts["values"]))  # (n_pages, n_kv, P, D) -> (1, n_kv, T, D)
        c.update_and_fetch(k, v)
    want = _feed(model, ids[keep:], ref)
    calls = []
    attention = cpu.attention
    monkeypatch.setattr(cpu, "attention", lambda *a, **k: calls.append(a[0].shape) or attention(*a, **k))
    caches = [PrefillCache(p, keep, mx.float32) for p in prefixes]
    got = _feed(model, ids[keep:], caches)
    on_cpu = mx.default_device() == mx.cpu  # elsewhere mlx-lm's own attention runs
    assert len(calls) == (len(caches) if on_cpu else 0) and all(c[2] == len(ids) - keep for c in calls)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)
    for c, r in zip(caches, ref):
        assert c.offset == len(ids)
        for x, y in zip(c.tail_kv(), (r.keys, r.values)):
            assert x.shape == (y.shape[1], len(ids) - keep, y.shape[3])
            np.testing.assert_allclose(np.array(x), np.array(y[0, :, keep:len(ids)]), atol=1e-5)


def test_prefill_cache_with_nothing_fed_has_no_tail():
    k = mx.random.normal((2, 20, 16), key=mx.random.key(3))
    c = PrefillCache(make_prefix(TIERS["fp16"], k, TIERS["fp16"], k, page_size=16), 20, mx.float32)
    assert c.offset == 20 and c.tail_kv() == (None, None)
