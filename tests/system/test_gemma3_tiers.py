"""Every registered tier builds, loads and answers on Gemma 3 270M (issue 47 item 2): head_dim 256, one KV head,
15 window layers stored in the tier beside 3 full-attention layers. A 600-token document (each window full: its
last 512 tokens stored). Each cartridge records its tier for every layer, loads (attention "auto": on the CPU the
compressed tiers under the default memory budget) and gives a first answer token with finite log-probabilities;
the fp16 one is a fresh mlx-lm prefill's. Fidelity of the other tiers is measured by `cartridge eval`, not here.
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest
from helpers.samples import SAMPLE
from helpers.fresh_prefill import document_of, greedy

from cartridge.models.prompt import full_prompt_tokens
from cartridge.tiers import TIERS

pytestmark = pytest.mark.slow

QUESTION = "Who publishes revised versions of the license?"


@pytest.fixture(scope="module")
def document(gemma_model):
    return document_of(gemma_model.tokenizer, SAMPLE.read_text(), 600)


@pytest.mark.parametrize("tier", list(TIERS))
def test_every_tier_builds_loads_and_answers(gemma_model, document, tier, tmp_path):
    r = cartridge.build(document, tmp_path / "t.cart", model=gemma_model, tier=tier)
    cart = cartridge.load(r.path, model=gemma_model)
    assert [(row["k"], row["v"]) for row in cart.info.tiers] == [(tier, tier)] * 18
    assert [layer.count for layer in cart.info.layers] == [600 if i in (5, 11, 17) else 512 for i in range(18)]
    (first,) = mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(QUESTION), max_tokens=1,
                                      prompt_cache=cart.prompt_cache())
    assert mx.all(mx.isfinite(first.logprobs)).item()
    if tier == "fp16":
        full = full_prompt_tokens(gemma_model.tokenizer, document, QUESTION)
        assert [first.token] == greedy(gemma_model.model, gemma_model.tokenizer, full, 1)
    mx.clear_cache()
