"""Every tier on the real default model (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64).

Stated bounds: per layer and side, relative RMSE of the decoded K/V of the first 576 prefix tokens
(18 whole groups of kivi4's 32 tokens) of the sample against the model's float32 K/V. Measured worst layers (docs/tiers.md) are below these.
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers.samples import SAMPLE, sample_questions

from cartridge.write.prefill import prefill
from cartridge.models.prompt import prefix_tokens, prompt_mode
from cartridge.tiers import TIERS

pytestmark = pytest.mark.slow

REAL_BOUNDS = {"fp16": 3e-4, "bf16": 2.5e-3, "int8": 8e-3, "mlx4g32": 0.13, "fp8": 0.03, "mxfp4": 0.21,
               "nvfp4": 0.11, "turbo4": 0.10, "turbo3": 0.19, "turbo2": 0.36,
               "kivi4": 0.10, "int8+rot": 6e-3, "mlx4g32+rot": 0.10, "mxfp4+rot": 0.15, "nvfp4+rot": 0.11,
               "int6": 0.033, "int6+rot": 0.025}
N_TOKENS = 576


@pytest.fixture(scope="module")
def real_kv(real_model):
    tokens = prefix_tokens(real_model.tokenizer, SAMPLE.read_text(), prompt_mode(real_model.tokenizer))[:N_TOKENS]
    caches = prefill(real_model.model, tokens)
    return [(c.keys[0, :, :N_TOKENS], c.values[0, :, :N_TOKENS]) for c in caches]


@pytest.mark.parametrize("name", list(TIERS))
def test_real_kv_round_trip_within_bound(real_kv, name):
    codec = TIERS[name]
    worst = 0.0
    for layer, pair in enumerate(real_kv):
        for side, x in zip("kv", pair):
            params = codec.make_params(x, layer, side)
            d = np.array(codec.decode(codec.encode(x, params), params))
            x = np.array(x)
            worst = max(worst, float(np.sqrt(((d - x) ** 2).sum() / (x ** 2).sum())))
    assert worst < REAL_BOUNDS[name]


SHORT = SAMPLE.read_text()[:3000]  # ~700 tokens: quick to prefill for each tier


@pytest.fixture(scope="module")
def fp16_answer(real_model, tmp_path_factory):
    r = cartridge.build(SHORT, tmp_path_factory.mktemp("r") / "fp16.cart", model=real_model)
    return _answer(cartridge.load(r.path, model=real_model))


def _answer(cart, n=12):
    q = sample_questions(1)[0]["question"]
    return [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(q),
                                                       max_tokens=n, prompt_cache=cart.prompt_cache())]


@pytest.mark.parametrize("kwargs", [{"tier": t} for t in TIERS if t != "fp16"]
                         + [{"tier": "mlx4g32", "boundary_protect": 2}], ids=lambda k: "-".join(map(str, k.values())))
def test_every_tier_builds_loads_and_answers_on_the_real_model(real_model, tmp_path, fp16_answer, kwargs):
    r = cartridge.build(SHORT, tmp_path / "t.cart", model=real_model, **kwargs)
    cart = cartridge.load(r.path, model=real_model)
    tiers = {row["v"] for row in cart.info.tiers[2:-2]}
    assert tiers == {kwargs["tier"]}
    got = _answer(cart)
    assert len(got) == 12
    if kwargs["tier"] in ("bf16", "int8", "fp8"):  # the near-lossless tiers answer like fp16 (measured)
        assert got == fp16_answer
    mx.clear_cache()
