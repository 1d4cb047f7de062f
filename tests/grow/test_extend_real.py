"""extend() on real input: the default model (SmolLM2-135M-Instruct), the sample document split in two
at a paragraph break. The first half extended by the second holds the token ids of a one-shot build of
the whole sample, and answers 5 sample questions token for token like it (50 greedy tokens, fp16)."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx_lm
import pytest
from helpers.samples import SAMPLE, sample_questions


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(real_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("extend-real")
    text = SAMPLE.read_text()
    paragraphs = text.rstrip().split("\n\n")
    half = len(paragraphs) // 2
    old, new = "\n\n".join(paragraphs[:half]), "\n\n".join(paragraphs[half:])
    assert old + "\n\n" + new == text.rstrip()
    cartridge.build(old, d / "half.cart", model=real_model)
    ext = cartridge.extend(d / "half.cart", new, output=d / "ext.cart", model=real_model)
    one = cartridge.build(text, d / "one.cart", model=real_model)
    return (cartridge.load(ext.path, model=real_model), cartridge.load(one.path, model=real_model), ext)


def _greedy(cart, q):
    return [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(q),
                                                    max_tokens=50, prompt_cache=cart.prompt_cache())]


def test_extended_sample_has_the_one_shot_tokens(pair):
    ext, one, r = pair
    assert ext.tokens == one.tokens
    assert r.reused_tokens == r.tokens - r.new_tokens and r.new_tokens > 500


@pytest.mark.parametrize("row", sample_questions(5), ids=lambda r: f"q{r['id']}")
def test_extended_sample_answers_like_one_shot(pair, row):
    ext, one, _ = pair
    got = _greedy(ext, row["question"])
    assert got == _greedy(one, row["question"])
    assert len(got) > 0
