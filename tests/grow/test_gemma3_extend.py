"""extend() and compose on Gemma 3 270M (issue 47 item 2).

A 900-token passage of the sample split at a paragraph break after about 300 tokens: the first part's cartridge
(its windows not yet full) extended by the rest holds the token ids of a one-shot build of the passage, its window
layers store the last 512 tokens as the one-shot build's do, and its fp16 answers are token for token the one-shot
build's and a fresh mlx-lm prefill's of the whole prompt. Composing cartridges of a model with sliding-window
layers is refused in one line (the later document's window would hold keys at the wrong positions).
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import numpy as np
import pytest
from helpers.samples import SAMPLE
from helpers.fresh_prefill import document_of, greedy

from cartridge.errors import InputError
from cartridge.models.prompt import full_prompt_tokens

pytestmark = pytest.mark.slow

QUESTIONS = ["Who publishes revised versions of the license?", "What is a Combined Work?"]
FULL_LAYERS = (5, 11, 17)


@pytest.fixture(scope="module")
def parts(gemma_model):
    """(the first part, the rest, the passage): the passage is 900 tokens, the first part about 300."""
    passage = document_of(gemma_model.tokenizer, SAMPLE.read_text(), 900)
    paragraphs = passage.split("\n\n")
    count = [len(gemma_model.tokenizer.encode("\n\n".join(paragraphs[:k]))) for k in range(1, len(paragraphs))]
    k = 1 + min(range(len(count)), key=lambda i: abs(count[i] - 300))
    old, new = "\n\n".join(paragraphs[:k]), "\n\n".join(paragraphs[k:])
    assert old + "\n\n" + new == passage
    return old, new, passage


@pytest.fixture(scope="module")
def pair(gemma_model, parts, tmp_path_factory):
    """(extended cartridge, one-shot cartridge, ExtendResult), loaded."""
    old, new, passage = parts
    d = tmp_path_factory.mktemp("gemma-extend")
    cartridge.build(old, d / "part.cart", model=gemma_model)
    ext = cartridge.extend(d / "part.cart", new, output=d / "ext.cart", model=gemma_model)
    one = cartridge.build(passage, d / "one.cart", model=gemma_model)
    return cartridge.load(ext.path, model=gemma_model), cartridge.load(one.path, model=gemma_model), ext


def test_extended_passage_has_the_one_shot_tokens_and_windows(pair):
    ext, one, r = pair
    assert ext.tokens == one.tokens and len(ext.tokens) == 900
    assert r.reused_tokens < 512 < r.tokens and r.new_tokens > 512  # the stored windows were not yet full
    assert [(m.kind, m.start, m.count) for m in ext.info.layers] == [
        (m.kind, m.start, m.count) for m in one.info.layers]
    assert [m.count for m in ext.info.layers] == [900 if i in FULL_LAYERS else 512 for i in range(18)]
    for i, (a, b) in enumerate(zip(ext.prefixes, one.prefixes)):
        if i not in FULL_LAYERS:  # within fp16 rounding (an ulp at |K| ~ 50): the new tokens attended over fp16 K/V
            np.testing.assert_allclose(np.array(a.keys), np.array(b.keys), rtol=2e-3, atol=2e-2, err_msg=f"layer {i}")


@pytest.mark.parametrize("question", QUESTIONS)
def test_extended_passage_answers_like_one_shot_and_a_fresh_prefill(pair, gemma_model, parts, question):
    ext, one, _ = pair
    got = greedy(ext.model, ext.tokenizer, ext.question_prompt(question), 30, ext.prompt_cache())
    assert got == greedy(one.model, one.tokenizer, one.question_prompt(question), 30, one.prompt_cache())
    full = full_prompt_tokens(gemma_model.tokenizer, parts[2], question)
    assert got == greedy(gemma_model.model, gemma_model.tokenizer, full, 30) and len(got) == 30


def test_compose_of_window_layers_is_refused_in_one_line(pair, gemma_model):
    ext, one, _ = pair
    with pytest.raises(InputError) as e:
        cartridge.load([one.path, ext.path], model=gemma_model)
    assert str(e.value) == "layer 0 is a window layer; compose takes attention layers only"
