"""extend's dense prefill: `kernels.cpu.attention` against a float64 reference (odd lengths, GQA 1/3/4/8,
causal and not, one query, the whole block), and a `PrefillCache` over a decoded prefix gives what
mlx-lm's own prefill of all the tokens gives (the same tokens with a cache as without)."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cartridge.attention import budget, route
from cartridge.attention.caches import PrefillCache
from cartridge.attention.kernels import cpu
from cartridge.attention.pages import make_prefix
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


@pytest.mark.parametrize("tier", ["fp16", "int8+rot", "int6+rot", "mlx4g32"])
@pytest.mark.parametrize("protected", [False, True], ids=["plain", "protected"])
def test_question_prefill_over_pages_matches_float64(tier, protected):
    """A question's prefill over a layer's pages decoded for the call (`cpu.question_prefill`), stored and K
    unpacked: odd prefix length, tail over two chunks, GQA 4, with and without protected tokens."""
    from helpers.kernel_cases import _cache, _case, _check, protected_reference, with_protected

    from cartridge.attention import unpacked
    from cartridge.attention.prefix import LayerPrefix

    shape = (8, 2, 64, 1001, 64, 300, 37)
    prefix, q, tk, tv = _case(tier, shape, seed=11)
    if protected:
        prefix = with_protected(prefix, 3, 5, shape[2])
    layers = [prefix]
    if unpacked.can_unpack(prefix.k_codec):
        k_parts = unpacked.unpack(prefix.k_codec, prefix.k_parts)
        layers.append(LayerPrefix(unpacked.UnpackedCodec(prefix.k_codec), k_parts, prefix.v_codec, prefix.v_parts,
                                  prefix.n_tokens, prefix.k_params, prefix.v_params, None, prefix.protected))
    want = protected_reference(prefix, q, tk, tv) if protected else None
    for layer in layers:
        with mx.stream(mx.cpu):
            out = cpu.question_prefill(layer, mx.array(q), _cache(layer, tk, tv, mx.float32).tail(), shape[2] ** -0.5)
        got = np.array(out)[0]
        if protected:
            assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), layer.k_codec.name
        else:
            _check(prefix, q, tk, tv, got, f"cpu question prefill {tier} {layer.k_codec.name}")


def test_question_prefill_leaves_decode_steps_and_sinks_to_the_portable_path():
    from helpers.kernel_cases import _cache, _case

    prefix, q, tk, tv = _case("int8+rot", (8, 2, 64, 300, 64, 9, 1), seed=2)
    rows = cpu.PREFILL_MIN_ROWS // 4  # GQA 4: fewer rows per KV head than the threshold
    tail = _cache(prefix, tk, tv, mx.float32).tail()
    assert cpu.question_prefill(prefix, mx.zeros((1, 8, rows - 1, 64)), tail, 0.125) is None
    assert cpu.question_prefill(prefix, mx.zeros((1, 8, rows, 64)), tail, 0.125, sinks=mx.zeros((8,))) is None
    assert cpu.question_prefill(prefix, mx.zeros((1, 8, rows, 64)), tail, 0.125).shape == (1, 8, rows, 64)


@pytest.mark.parametrize("options", [
    {"k_tier": "int8+rot", "v_tier": "int6+rot"},
    {"k_tier": "int8+rot", "v_tier": "int6+rot", "protect_first": 4, "protect_last": 9},  # protected tokens
], ids=["safe", "safe-protected"])
def test_auto_question_prefill_gives_the_portable_logits(options, tmp_path, smol_tokenizer, monkeypatch):
    """`auto` on the CPU (default memory budget: K unpacked, the question's prefill over pages decoded per
    call) against the portable path over the stored pages: the question's logits (L > 1) and a decode step's."""
    from helpers.tiny_models import make_tiny
    from helpers.dense_caches import DOC

    from cartridge.attention.kernels import dense
    from cartridge.attention.policy import plan_from_header

    if mx.default_device() != mx.cpu:
        pytest.skip("the question prefill over decoded pages is the CPU's")
    lm = make_tiny(smol_tokenizer, seed=0, head_dim=64)
    r = cartridge.build(DOC, tmp_path / "a.cart", model=lm, page_size=64, reserve=0, **options)
    fast = cartridge.load(r.path, model=lm)
    ref = cartridge.load(r.path, model=lm, attention="portable", verify="header")
    assert all(isinstance(p.backend, cpu.QuestionPrefill) for p in fast.prefixes)
    said = "a question's prefill decodes each layer's pages for the call"
    assert said in fast.plan["reason"] and said in plan_from_header(fast.info, mx.float32)["reason"]  # inspect's too
    assert all(p.backend is None for p in ref.prefixes)
    fp16 = cartridge.load(cartridge.build(DOC, tmp_path / "b.cart", model=lm, page_size=64, reserve=0).path, model=lm)
    assert all(p.backend is None for p in fp16.prefixes)  # float32 pages: the portable path is as fast
    assert said not in fp16.plan["reason"] and said not in plan_from_header(fp16.info, mx.float32)["reason"]
    stored = ref.plan["memory"]["stored_bytes"]  # a budget with no room for one layer decoded per call: portable
    with pytest.warns(budget.MemoryBudgetWarning):
        tight = cartridge.load(r.path, model=lm, max_memory=stored - 1, verify="header")
    assert all(p.backend is None for p in tight.prefixes)
    calls = []
    real = dense.prefill_attention
    monkeypatch.setattr(dense, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    ids = fast.question_prompt("How long does the warranty last?")
    logits = []
    for cart in (fast, ref):
        cache = cart.prompt_cache()
        first = _feed(cart.model, ids, cache)
        logits.append((first, _feed(cart.model, [int(mx.argmax(first[-1]))], cache)))
    assert len(calls) == len(fast.prefixes)  # the question's prefill only: decode steps stay portable
    for got, want in zip(*logits):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
