"""Proof on real input: the default model (SmolLM2-135M-Instruct) and the sample document.

For 5 sample questions, 50 greedy tokens generated from the loaded fp16 cartridge equal, token for
token, what mlx-lm generates from the full prompt (document + question) with no cartridge.
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx_lm
import pytest
from helpers.samples import SAMPLE, sample_questions

from cartridge.models.prompt import full_prompt_tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sample_cart(real_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("real") / "lgpl.cart"
    r = cartridge.build(SAMPLE.read_text(), path, model=real_model)
    assert r.tokens >= 1500
    return cartridge.load(path, model=real_model)


def _greedy(model, tokenizer, prompt, **kw):
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=50, **kw)]


@pytest.mark.parametrize("row", sample_questions(5), ids=lambda r: f"q{r['id']}")
def test_cartridge_answers_token_for_token_like_full_prefill(sample_cart, real_model, row):
    q = row["question"]
    got = _greedy(sample_cart.model, sample_cart.tokenizer, sample_cart.question_prompt(q),
                  prompt_cache=sample_cart.prompt_cache())
    full = full_prompt_tokens(real_model.tokenizer, SAMPLE.read_text(), q)
    want = _greedy(real_model.model, real_model.tokenizer, full)
    assert got == want
    assert len(got) > 0


def test_sample_prefix_is_what_the_chat_template_renders(sample_cart, real_model):
    text = real_model.tokenizer.decode(sample_cart.tokens)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith(SAMPLE.read_text().rstrip())


def _stream(model, tokenizer, prompt, n, **kw):
    out = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n, **kw))
    return [r.token for r in out], "".join(r.text for r in out)


SHORT = SAMPLE.read_text()[:1800]  # about 400 tokens: each turn's fresh prefill stays cheap


def test_eight_turn_chat_answers_like_a_fresh_prefill_of_the_conversation(real_model, tmp_path):
    """Issue 15: each turn of a chat on one cache (it crosses tail chunks) gives the greedy tokens of a fresh
    mlx-lm prefill of document + the whole conversation rendered by the chat template. The document is the
    sample's first 1,800 characters: what is tested is the cache across turns, and each turn's reference is
    a prefill of the whole conversation."""
    short = cartridge.load(cartridge.build(SHORT, tmp_path / "short.cart", model=real_model).path, model=real_model)
    cache, messages = short.prompt_cache(), []
    for row in sample_questions(8):
        messages.append({"role": "user", "content": row["question"]})
        got, text = _stream(short.model, short.tokenizer, short.chat_prompt(messages, cache), 16, prompt_cache=cache)
        turns = [dict(m) for m in messages]
        turns[0]["content"] = SHORT.rstrip() + "\n\n" + turns[0]["content"]
        full = real_model.tokenizer.encode(
            real_model.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
        want, _ = _stream(real_model.model, real_model.tokenizer, full, 16)
        assert got == want, f"turn {len(messages) // 2 + 1}"
        messages.append({"role": "assistant", "content": text})
    assert cache[0].offset - len(short.tokens) > 256


def test_question_longer_than_a_tail_chunk_answers_like_a_fresh_prefill(sample_cart, real_model):
    """Issue 15: a pasted question of more than 256 tokens used to give NaN attention and <|endoftext|>."""
    text = SAMPLE.read_text()
    q = "Summarize this passage: " + text[2000:3400]
    prompt = sample_cart.question_prompt(q)
    assert len(prompt) > 257
    got = _greedy(sample_cart.model, sample_cart.tokenizer, prompt, prompt_cache=sample_cart.prompt_cache())
    want = _greedy(real_model.model, real_model.tokenizer, full_prompt_tokens(real_model.tokenizer, text, q))
    assert got == want
