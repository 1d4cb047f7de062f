"""CartridgeCache speaks mlx-lm's cache protocol: same logits and tokens as a fresh prefill.

Two comparisons, kept apart as mlx's test_qmm keeps kernel error apart from quantization error:
- against a dense mlx-lm KVCache holding the *decoded* prefix (isolates the attention path: tight);
- against a fresh full prefill of document + question (includes fp16 storage rounding: looser).
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers.dense_caches import _decoded_kv_cache, _logits
from mlx_lm.models.cache import KVCache

from cartridge.attention.caches import CartridgeCache
from cartridge.errors import CartridgeError
from cartridge.models.prompt import full_prompt_tokens

DOC = ("The warranty on the Model 7 kettle lasts 24 months from the date of purchase. "
       "Claims are sent to Kettle Co, 12 Harbour Road. ") * 12


@pytest.fixture(scope="module")
def cart(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("c") / "doc.cart"
    cartridge.build(DOC, path, model=tiny, page_size=64, prefill_step=100)
    return cartridge.load(path, model=tiny)


def test_attention_matches_dense_cache_of_decoded_pages(cart):
    q = cart.question_prompt("How long does the warranty last?")
    got = _logits(cart.model, q, cart.prompt_cache())
    want = _logits(cart.model, q, _decoded_kv_cache(cart))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_logits_close_to_fresh_prefill(cart, tiny):
    q = "Where are claims sent?"
    got = _logits(cart.model, cart.question_prompt(q), cart.prompt_cache())[-1]
    full = full_prompt_tokens(tiny.tokenizer, DOC, q)
    want = _logits(tiny.model, full, None)[-1]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-2, atol=2e-2)


def test_generate_same_tokens_as_decoded_dense_cache(cart):
    prompt = cart.question_prompt("Where are claims sent?")
    args = dict(max_tokens=12, prefill_step_size=3)  # prefill in steps of 3: multi-token queries + tail chunks
    a = [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, prompt, prompt_cache=cart.prompt_cache(), **args)]
    b = [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, prompt, prompt_cache=_decoded_kv_cache(cart), **args)]
    assert a == b
    assert len(a) == 12


def test_prompt_caches_are_independent_and_prefix_is_not_mutated(cart):
    before = [np.array(p.k_parts["values"]).copy() for p in cart.prefixes]
    c1, c2 = cart.prompt_cache(), cart.prompt_cache()
    _logits(cart.model, cart.question_prompt("First question?"), c1)
    assert c1[0].offset == cart.prefixes[0].n_tokens + len(cart.question_prompt("First question?"))
    assert c2[0].offset == cart.prefixes[0].n_tokens
    for p, b in zip(cart.prefixes, before):
        np.testing.assert_array_equal(np.array(p.k_parts["values"]), b)


def test_tail_grows_in_fixed_chunks_and_trims():
    from cartridge.attention.prefix import LayerPrefix
    from cartridge.tiers import get_tier

    fp16 = get_tier("fp16")
    parts = {"values": mx.zeros((1, 2, 4, 8), dtype=mx.float16)}
    c = CartridgeCache(LayerPrefix(fp16, parts, fp16, parts, 3), chunk_size=5)
    for n in (3, 4, 1):
        c.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
    assert [k.shape for k in c.state[0]] == [(1, 2, 5, 8), (1, 2, 5, 8)]
    assert c.offset == 3 + 8
    assert c.trim(20) == 8
    assert c.offset == 3
    assert c.make_mask(1) is None
    assert c.make_mask(4) == "causal"


def test_batch_and_state_restore_are_refused(cart):
    c = cart.prompt_cache()[0]
    with pytest.raises(CartridgeError, match="batch size 2"):
        c.update_and_fetch(mx.zeros((2, 2, 1, 16)), mx.zeros((2, 2, 1, 16)))
    with pytest.raises(CartridgeError):
        c.state = ([], [])


def test_save_prompt_cache_fails_at_once_pointing_at_save_and_export(cart, tmp_path):
    from mlx_lm.models.cache import save_prompt_cache

    cache = cart.prompt_cache()
    mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("Where?"), prompt_cache=cache, max_tokens=3)
    with pytest.raises(ValueError, match=r"not serializable: .*cart\.save\(path, cache\).*`cartridge export`") as e:
        save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []  # no file that nothing can read


def test_trim_prompt_cache_trims_the_tail_as_a_kv_cache_and_never_the_prefix(cart):
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    n = cart.prefixes[0].n_tokens
    first, second = cart.question_prompt("Where are claims sent?"), cart.tokenizer.encode(" And who pays?")
    cache = cart.prompt_cache()
    _logits(cart.model, first + second, cache)
    assert can_trim_prompt_cache(cache)
    assert trim_prompt_cache(cache, len(second)) == len(second)  # as a KVCache: the count trimmed
    assert [c.offset for c in cache] == [n + len(first)] * len(cache)
    again = _logits(cart.model, second, cache)
    fresh = cart.prompt_cache()
    _logits(cart.model, first, fresh)
    np.testing.assert_allclose(np.array(again), np.array(_logits(cart.model, second, fresh)), rtol=1e-5, atol=1e-5)
    assert trim_prompt_cache(cache, 10**6) == len(first) + len(second)  # the whole tail, no prefix token
    assert [c.offset for c in cache] == [n] * len(cache)
    assert trim_prompt_cache(cache, 5) == 0
    kv = KVCache()  # mlx-lm's own KVCache of the same tokens: the same counts while tokens are left after the prefix
    kv.update_and_fetch(mx.zeros((1, 2, n + 7, 16)), mx.zeros((1, 2, n + 7, 16)))
    assert kv.trim(7) == 7 and kv.offset == n


def test_a_dense_layers_cache_trims_its_tail_only_and_never_writes_the_shared_prefix():
    from mlx_lm.models.cache import save_prompt_cache, trim_prompt_cache

    from cartridge.attention.caches import PrefixKVCache
    from cartridge.attention.layers import DenseLayer
    from cartridge.attention.pages import make_prefix
    from cartridge.tiers import get_tier

    fp16 = get_tier("fp16")
    k = mx.random.normal((2, 9, 16)).astype(mx.float16)
    layer = DenseLayer(make_prefix(fp16, k, fp16, k, page_size=4), mx.float32)
    before = np.array(layer.keys)
    c = layer.cache()
    assert isinstance(c, PrefixKVCache) and isinstance(c, KVCache)
    c.update_and_fetch(mx.ones((1, 2, 3, 16)), mx.ones((1, 2, 3, 16)))
    assert trim_prompt_cache([c], 100) == 3 and c.offset == 9
    c.update_and_fetch(mx.full((1, 2, 2, 16), 7.0), mx.full((1, 2, 2, 16), 7.0))
    assert trim_prompt_cache([c], 100) == 2 and c.offset == 9
    c.update_and_fetch(mx.full((1, 2, 1, 16), 5.0), mx.full((1, 2, 1, 16), 5.0))
    np.testing.assert_array_equal(np.array(layer.keys), before)
    np.testing.assert_array_equal(np.array(c.keys[0, :, 9]), np.full((2, 16), 5.0))
    with pytest.raises(ValueError, match="cart.save"):
        save_prompt_cache("/nonexistent/never.safetensors", [c])
