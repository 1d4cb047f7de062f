"""Conversations on each real model (issue 47 item 2): SmolLM2-135M-Instruct (chat template) and Gemma 3 270M (a
base model: plain "Question: ... Answer:" turns; 15 sliding-window layers of 512 tokens).

- Turns on ONE cache under mlx-lm's own loops (`generate_step`, `stream_generate`; on the tiny model:
  tests/test_generate_loop.py): each step's greedy token is a fresh mlx-lm prefill's of the document and the
  whole token stream, and its log-probabilities those of the same prefill over the document's fp16 K/V. The
  document is 480 tokens and the turns go past 512: gemma3's windows move during them.
- A conversation through `Cartridge.chat_prompt` (gemma3's window caches cannot trim back: each turn starts again
  from the stored window): each turn's answer is a fresh prefill's of the document and the rendered conversation.
- `cartridge serve` in this process (its engine and app, the model already loaded): a cartridge named by the
  request answers as `question_prompt` does, and a base-model prompt that starts with the document is answered
  from the cartridge's pages as a fresh prefill of it.

Each check runs first on mlx-lm's own caches filled with the document (the harness), then on the cartridge's.
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from helpers.samples import SAMPLE
from helpers.fresh_prefill import document_of, greedy, mlx_cache, run_turns, teacher_forced

from cartridge.models.prompt import (PLAIN, encode_text, find_stop, full_prompt_tokens, prompt_mode, prompt_pieces,
                                     stop_strings)

pytestmark = pytest.mark.slow

DOC_TOKENS = 480
QUESTIONS = ["Who publishes revised versions of the license?",
             "If I convey a combined work that uses the Library, which notices, copies of the license and source "
             "code must I give to the people who receive it, and in which form?",
             "What is a Combined Work?"]
NEW = 12  # greedy tokens a turn
TOL = 2e-3  # |log-probability| against the reference over the same K/V (float32, another order of summation)


@pytest.fixture(scope="module")
def doc_cart(any_real_model, tmp_path_factory):
    """(the document: the sample's first 480 tokens' text, its fp16 cartridge loaded)."""
    tok = any_real_model.tokenizer
    opening = 0 if prompt_mode(tok) == PLAIN else 40  # about the chat template's tokens before the document
    text = document_of(tok, SAMPLE.read_text(), DOC_TOKENS - opening)
    r = cartridge.build(text, tmp_path_factory.mktemp("turns") / "doc.cart", model=any_real_model)
    return text, cartridge.load(r.path, model=any_real_model)


def _turns(tokenizer):
    return [(encode_text(tokenizer, "\n\nQuestion: " + q + "\nAnswer:", False), NEW) for q in QUESTIONS]


_REFERENCES = {}


def _reference(lm, doc, stream, rows, stored):
    """Log-probabilities after stream[i] for i in rows, teacher-forced over mlx-lm's caches of a fresh prefill of
    `doc` (K/V rounded to `stored` if given), computed once per case."""
    key = (lm.ref, tuple(doc), tuple(stream), stored)
    if key not in _REFERENCES:
        _REFERENCES[key] = teacher_forced(lm.model, mlx_cache(lm.model, doc, stored), stream, rows)
    return _REFERENCES[key]


@pytest.mark.parametrize("loop", ["generate_step", "stream_generate"])
@pytest.mark.parametrize("source", ["mlx-lm-cache", "cartridge"])
def test_turns_on_one_cache_match_a_fresh_prefill(doc_cart, any_real_model, source, loop):
    _, cart = doc_cart
    lm, doc = any_real_model, cart.tokens
    cache = mlx_cache(lm.model, doc) if source == "mlx-lm-cache" else cart.prompt_cache()
    stream, yielded = run_turns(lm.model, cache, _turns(lm.tokenizer), (loop, lm.tokenizer))
    assert len(doc) < 512 < len(doc) + len(stream) and len(yielded) == len(QUESTIONS) * NEW
    rows = sorted(yielded)
    fresh = _reference(lm, doc, stream, rows, None)
    assert [stream[i + 1] for i in rows] == [int(np.argmax(row)) for row in fresh]
    same_kv = fresh if source == "mlx-lm-cache" else _reference(lm, doc, stream, rows, mx.float16)
    worst = max(float(np.abs(yielded[i] - want).max()) for i, want in zip(rows, same_kv))
    assert worst < TOL


def _rendered(tokenizer, document, messages):
    """Tokens of a fresh prompt of the document and the conversation: the chat template over the turns, the
    document joined to the first; without a template the plain "Question: ...\\nAnswer: ..." turns."""
    if prompt_mode(tokenizer) == PLAIN:
        text = document
        for m in messages:
            text += f"\n\nQuestion: {m['content']}\nAnswer:" if m["role"] == "user" else f" {m['content']}"
        return encode_text(tokenizer, text, True)
    turns = [dict(m) for m in messages]
    turns[0]["content"] = document + "\n\n" + turns[0]["content"]
    return tokenizer.encode(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))


def test_chat_prompt_turns_answer_like_a_fresh_prefill_of_the_conversation(doc_cart, any_real_model):
    document, cart = doc_cart
    lm, cache, messages = any_real_model, cart.prompt_cache(), []
    stops = stop_strings(cart.info.prompt_mode)
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        prompt = cart.chat_prompt(messages, cache)
        got = greedy(cart.model, cart.tokenizer, prompt, 16, cache)
        want = greedy(lm.model, lm.tokenizer, _rendered(lm.tokenizer, document, messages), 16)
        assert got == want, f"turn {len(messages) // 2 + 1}"
        text = cart.tokenizer.decode(got)
        answer = text[:find_stop(text, stops)[0]].strip()
        messages.append({"role": "assistant", "content": answer or "I do not know."})
    assert cache[0].offset > 512


def _server(cart, lm):
    """A TestClient of `cartridge serve`'s app over the folder holding `cart`, answering with `lm`."""
    from starlette.testclient import TestClient

    from cartridge.serve.app import make_app
    from cartridge.serve.engine import Engine
    from cartridge.serve.pool import Pool, find_cartridges

    engine = Engine(lambda: Pool(find_cartridges([cart.path.parent]), lm))
    return TestClient(make_app(engine)), engine


def test_serve_answers_from_the_cartridge_as_a_fresh_prefill(doc_cart, any_real_model):
    document, cart = doc_cart
    lm, question = any_real_model, QUESTIONS[0]
    head, middle, tail = prompt_pieces(lm.tokenizer, cart.info.prompt_mode, cart.info.separator)
    full = full_prompt_tokens(lm.tokenizer, document, question)
    want = greedy(lm.model, lm.tokenizer, full, 16)
    client, engine = _server(cart, lm)
    try:
        named = client.post("/v1/chat/completions", json={
            "model": cart.path.stem, "messages": [{"role": "user", "content": question}], "max_tokens": 16,
            "temperature": 0, "return_token_ids": True}).json()
        pasted = client.post("/v1/completions", json={
            "model": "default_model", "prompt": head + document + middle + question + tail, "max_tokens": 16,
            "temperature": 0, "return_token_ids": True}).json()
    finally:
        engine.close(wait=True)
    for r in (named, pasted):
        ids, finish = r["choices"][0]["token_ids"], r["choices"][0]["finish_reason"]
        assert ids == want[:len(ids)] and len(ids) > 0
        assert len(ids) == 16 or (finish == "stop" and cart.info.prompt_mode == PLAIN)
    assert pasted["usage"]["prompt_tokens_details"]["cached_tokens"] == len(cart.tokens)
    assert pasted["usage"]["prompt_tokens"] == len(full)
