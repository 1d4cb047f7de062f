"""Conversations on one cache (issue 15): `chat_prompt` keeps the cache equal to a fresh prefill of the
whole rendered conversation, `question_prompt` refuses a cache that already holds turns, `reset` empties
it. The reference is an mlx-lm KVCache holding the decoded prefix pages, fed the whole conversation."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from cartridge.errors import InputError
from cartridge.models.prompt import full_prompt_tokens

DOC = "The shipping manager of Harbour Freight is Dana Whitfield; invoices go to Leo Marsh. " * 8
QUESTIONS = ["Who is the shipping manager?", "And who gets the invoices?", "Spell the first name.",
             "Thanks. Anything else?", "Who?", "Say it again."]
# logits against the mlx-lm reference: float32 on the CPU; the GPU's float32 matmuls round more (TF32)
TOL = 2e-4 if mx.default_device() == mx.cpu else 1e-2


@pytest.fixture(scope="module")
def cart(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "doc.cart"
    cartridge.build(DOC, path, model=tiny, page_size=64)
    return cartridge.load(path, model=tiny, attention="portable")


def _decoded(cart):
    caches = []
    for p in cart.prefixes:
        k = p.k_codec.decode(p.k_parts, p.k_params)
        v = p.v_codec.decode(p.v_parts, p.v_params)
        # (n_pages, n_kv, P, D) -> (1, n_kv, tokens, D)
        k, v = (x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[None, :, : p.n_tokens] for x in (k, v))
        c = KVCache()
        c.update_and_fetch(k.astype(mx.float32), v.astype(mx.float32))
        caches.append(c)
    return caches


def _conversation_text(tokenizer, messages):
    turns = [dict(m) for m in messages]
    turns[0]["content"] = DOC.rstrip() + "\n\n" + turns[0]["content"]
    return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)


def test_multi_turn_chat_equals_fresh_prefill_of_the_conversation(cart, tiny):
    cache, messages = cart.prompt_cache(), []
    for turn, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": q})
        prompt = cart.chat_prompt(messages, cache)
        full = tiny.tokenizer.encode(_conversation_text(tiny.tokenizer, messages))
        assert cart.tokens + cache.tokens == full  # what the cache will hold: the fresh rendering's tokens
        assert cache[0].offset + len(prompt) == len(full)
        got = cart.model(mx.array(prompt)[None], cache=cache)[0, -1]
        want = cart.model(mx.array(full[len(cart.tokens):])[None], cache=_decoded(cart))[0, -1]
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=TOL, atol=TOL)
        # greedy answer of a few tokens, generated into the same cache
        answer = [int(mx.argmax(got))]
        for _ in range(5):
            answer.append(int(mx.argmax(cart.model(mx.array(answer[-1:])[None], cache=cache)[0, -1])))
        messages.append({"role": "assistant", "content": tiny.tokenizer.decode(answer)})
    assert cache[0].offset > len(cart.tokens) + 60


def test_first_chat_turn_is_the_question_prompt(cart):
    q = "Who is the shipping manager?"
    assert cart.chat_prompt([{"role": "user", "content": q}]) == cart.question_prompt(q)
    assert cart.tokens + cart.question_prompt(q) == full_prompt_tokens(cart.tokenizer, DOC, q)


def test_question_prompt_refuses_a_cache_with_turns_and_reset_empties_it(cart):
    cache = cart.prompt_cache()
    q = cart.question_prompt("Who is the shipping manager?", cache)
    mlx_lm.generate(cart.model, cart.tokenizer, q, prompt_cache=cache, max_tokens=3)
    with pytest.raises(InputError, match="already holds .* tokens after the document; call cart.reset"):
        cart.question_prompt("And the invoices?", cache)
    cart.reset(cache)
    assert cache[0].offset == len(cart.tokens) and cache.tokens == []
    again = cart.model(mx.array(cart.question_prompt("Who is the shipping manager?", cache))[None], cache=cache)
    fresh = cart.model(mx.array(q)[None], cache=cart.prompt_cache())
    np.testing.assert_array_equal(np.array(again), np.array(fresh))


@pytest.mark.parametrize("messages,error", [
    ([], "non-empty list"),
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "q"}], "first message .* user"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "last message must be a user"),
    ([{"role": "robot", "content": "q"}], "role is one of"),
    ([{"role": "user", "content": "  "}], "content is empty"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}], "system message before"),
])
def test_bad_conversations_are_refused(cart, messages, error):
    with pytest.raises(InputError, match=error):
        cart.chat_prompt(messages)


def test_chat_prompt_needs_a_cache_of_this_cartridge(cart):
    with pytest.raises(InputError, match="prompt_cache"):
        cart.chat_prompt([{"role": "user", "content": "q"}], [KVCache()])


@pytest.fixture(scope="module")
def system_cart(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "system.cart"
    cartridge.build(DOC, path, model=tiny, page_size=64, system="Answer in one word.")
    return cartridge.load(path, model=tiny, attention="portable")


def test_system_message_recorded_at_build_is_the_prefix_and_answers_under_it(system_cart, tiny):
    assert system_cart.info.system == "Answer in one word."
    q = "Who is the shipping manager?"
    want = full_prompt_tokens(tiny.tokenizer, DOC, q, system="Answer in one word.")
    assert want == tiny.tokenizer.encode(tiny.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": DOC.rstrip() + "\n\n" + q}],
        add_generation_prompt=True, tokenize=False))
    assert system_cart.tokens + system_cart.question_prompt(q) == want
    user = [{"role": "user", "content": q}]
    with_system = [{"role": "system", "content": "Answer in one word."}, *user]
    # a conversation without a system message is answered under the cartridge's; sending it is the same
    assert system_cart.tokens + system_cart.chat_prompt(user) == want
    assert system_cart.chat_prompt(with_system) == system_cart.chat_prompt(user)
    with pytest.raises(InputError, match="prefilled with the system message 'Answer in one word.'"):
        system_cart.chat_prompt([{"role": "system", "content": "Be verbose."}, *user])


def test_system_message_refused_before_load_when_blank(tiny, tmp_path):
    with pytest.raises(InputError, match="^the system message is empty"):
        cartridge.build(DOC, tmp_path / "x.cart", model="/nonexistent-model-dir", system="  ")
    assert list(tmp_path.iterdir()) == []
