"""Proof on real input: the default model (SmolLM2-135M-Instruct) and the sample document.

For 5 sample questions, 50 greedy tokens generated from the loaded fp16 cartridge equal, token for
token, what mlx-lm generates from the full prompt (document + question) with no cartridge.
"""

import mlx_lm
import pytest
from conftest import SAMPLE, sample_questions

import cartridge
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
