"""Cartridge.save: a conversation (questions and answers fed on a loaded cartridge) written as a new
cartridge resumes in another process token for token as it does in the process that held it."""

import json
import subprocess
import sys
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers import HELPERS
from helpers.tiny_models import TINY_CONFIG, make_tiny
from mlx.utils import tree_flatten

from cartridge.errors import InputError

DOC = "Section 1. The lessee may terminate the agreement with 30 days of written notice. " * 3 + "The end."
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fp16_model(smol_tokenizer, tmp_path_factory):
    """A float16 tiny model saved as an mlx-lm folder (fp16 K/V: the fp16 tier stores them exactly)."""
    path = tmp_path_factory.mktemp("tiny16")
    model = make_tiny(smol_tokenizer, seed=3).model
    model.set_dtype(mx.float16)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    smol_tokenizer._tokenizer.save_pretrained(str(path))
    return cartridge.load_model(str(path))


def _generate(cart, ids, cache, n=8):
    return [(r.token, r.logprobs[r.token].item()) for r in
            mlx_lm.stream_generate(cart.model, cart.tokenizer, ids, max_tokens=n, prompt_cache=cache)]


@pytest.fixture(scope="module")
def conversation(fp16_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("conv")
    cartridge.build(DOC, d / "doc.cart", model=fp16_model, page_size=16)
    cart = cartridge.load(d / "doc.cart", model=fp16_model)
    cache = cart.prompt_cache()
    prompt = cart.question_prompt("How much notice?")
    answer = [t for t, _ in _generate(cart, prompt, cache)]
    saved = cart.save(d / "chat.cart", cache, tokens=prompt + answer)
    return d, cart, cache, prompt + answer, saved


def test_conversation_cartridge_holds_document_and_turns(conversation):
    d, cart, _, turns, saved = conversation
    info = cartridge.open_cartridge(saved.path)[0]
    assert info.tokens.tolist() == cart.tokens + turns
    assert info.document_tokens == len(cart.tokens) and saved.new_tokens == len(turns)
    assert [(p["kind"], p["start"], p["end"]) for p in info.parts] == [
        ("build", 0, len(cart.tokens)), ("conversation", len(cart.tokens), len(info.tokens))]
    assert cartridge.verify_cartridge(saved.path).ok


def test_inspect_shows_the_conversation_after_the_document(conversation):
    from cartridge.cli.report import inspect_dict, inspect_table

    d, cart, _, turns, saved = conversation
    info = cartridge.open_cartridge(saved.path)[0]
    n, total = len(cart.tokens), len(cart.tokens) + len(turns)
    assert inspect_dict(info, saved.path)["document_tokens"] == n
    assert f"conversation  tokens {n}..{total} after the document's {n:,} " in inspect_table(inspect_dict(info, saved.path))
    bare = cartridge.open_cartridge(d / "doc.cart")[0]
    assert "conversation" not in inspect_table(inspect_dict(bare, d / "doc.cart"))


def test_resumed_in_another_process_is_token_identical(conversation, fp16_model):
    d, cart, cache, _, saved = conversation
    follow = fp16_model.tokenizer.encode("\nAnd the rent?", add_special_tokens=False)
    here = _generate(cart, follow, cache)
    run = subprocess.run([sys.executable, str(HELPERS / "resume_worker.py"), saved.path, "8",
                          *map(str, follow)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    there = json.loads(run.stdout)
    assert there["prefix"] == len(cartridge.open_cartridge(saved.path)[0].tokens)
    assert there["tokens"] == [t for t, _ in here]
    np.testing.assert_allclose(there["logprobs"], [p for _, p in here], atol=1e-3)


def test_save_feeds_tokens_the_cache_has_not_seen(fp16_model, tmp_path):
    cartridge.build(DOC, tmp_path / "doc.cart", model=fp16_model, page_size=16)
    cart = cartridge.load(tmp_path / "doc.cart", model=fp16_model)
    cache = cart.prompt_cache()
    prompt = cart.question_prompt("Who?")
    cart.model(mx.array(prompt[:-3])[None], cache=cache)  # the last 3 not fed yet
    r = cart.save(tmp_path / "c.cart", cache, tokens=prompt)
    assert cache[0].tail_len == len(prompt) and r.tokens == len(cart.tokens) + len(prompt)
    whole = cart.prompt_cache()
    cart.model(mx.array(prompt)[None], cache=whole)
    for a, b in zip(cache, whole):  # one chunk or two: the same K up to float rounding (OpenBLAS blocks by M)
        np.testing.assert_allclose(np.array(a.tail_kv()[0]), np.array(b.tail_kv()[0]), rtol=1e-5, atol=1e-6)


def test_save_refuses_wrong_cache_or_tokens(fp16_model, tmp_path):
    cartridge.build(DOC, tmp_path / "doc.cart", model=fp16_model, page_size=16)
    cart = cartridge.load(tmp_path / "doc.cart", model=fp16_model)
    other = cartridge.load(tmp_path / "doc.cart", model=fp16_model)
    cache = cart.prompt_cache()
    prompt = cart.question_prompt("Who?")
    cart.model(mx.array(prompt)[None], cache=cache)
    with pytest.raises(InputError, match="not made by this cartridge"):
        other.save(tmp_path / "c.cart", cache, tokens=prompt)
    with pytest.raises(InputError, match=f"tokens gives 2 ids; the cache holds {len(prompt)}"):
        cart.save(tmp_path / "c.cart", cache, tokens=prompt[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.cart"]


def test_conversation_cartridge_cannot_be_extended(conversation, fp16_model):
    d, _, _, _, saved = conversation
    with pytest.raises(InputError, match="holds a conversation after its document"):
        cartridge.extend(saved.path, "More text.", output=d / "x.cart", model=fp16_model)


def test_next_question_after_a_saved_conversation_is_a_new_user_turn(fp16_model, tmp_path):
    """Saved conversation + question_prompt(q2) == the chat template's tokens of the two user turns and
    the answer between them (the answer closed by its end-of-turn token, as generation stops)."""
    from cartridge.models.prompt import SEPARATOR, encode_text

    tok = fp16_model.tokenizer
    cartridge.build(DOC, tmp_path / "doc.cart", model=fp16_model)
    cart = cartridge.load(tmp_path / "doc.cart", model=fp16_model)
    q1, a1, q2 = "How much notice?", "Thirty days of written notice.", "And the rent?"
    turns = cart.question_prompt(q1) + tok.encode(a1, add_special_tokens=False) + [tok.eos_token_id]
    saved = cart.save(tmp_path / "chat.cart", cart.prompt_cache(), tokens=turns)
    conv = cartridge.load(saved.path, model=fp16_model)
    messages = [{"role": "user", "content": DOC.rstrip() + SEPARATOR + q1}, {"role": "assistant", "content": a1},
                {"role": "user", "content": q2}]
    want = encode_text(tok, tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), True)
    assert conv.tokens + conv.question_prompt(q2) == want
    assert cart.question_prompt(q2) != conv.question_prompt(q2)
