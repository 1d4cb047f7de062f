"""extend() of a model with sliding-window layers (issue 47: gemma3): a window layer continues from its stored
window in mlx-lm's RotatingKVCache and stores its new last `window` tokens, as a one-shot build of the joined
text stores them; the full-attention layers are extended as before (stored pages copied, new tokens encoded).

A tiny random-weight gemma3_text (tests/family_models.py: window 16 on layers 0 and 2, full attention on 1 and
3), so the stored window, the seam and the new text are each longer than a window.
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers.family_models import WINDOW, make_model

from cartridge.grow.extend import EXTEND_SEPARATOR

OLD = "Section 1. The lessee may terminate the agreement with 30 days of written notice. " * 3 + "The end."
NEW = "Section 2. Rent is due on the first day of each month, payable to the lessor by bank transfer."
PAGE = 16
QUESTIONS = ("When is rent due?", "How much notice does the lessee give?")
# float32 on the CPU; a GPU rounds its matmuls more (TF32), which an fp16 K/V then shows as a few ulps
KV_TOL, LOGIT_TOL = (4e-3, 2e-3) if mx.default_device() == mx.cpu else (2e-2, 1e-2)


@pytest.fixture(scope="module")
def gemma3(smol_tokenizer):
    return make_model("gemma3_text", smol_tokenizer)


@pytest.fixture(scope="module", params=["auto", "portable"])
def carts(request, gemma3, tmp_path_factory):
    """(old cartridge path, ExtendResult with attention=param, one-shot BuildResult of the joined text), fp16."""
    d = tmp_path_factory.mktemp("extend-windows")
    cartridge.build(OLD, d / "old.cart", model=gemma3, page_size=PAGE)
    ext = cartridge.extend(d / "old.cart", NEW, output=d / "ext.cart", model=gemma3, attention=request.param)
    one = cartridge.build(OLD + EXTEND_SEPARATOR + NEW, d / "one.cart", model=gemma3, page_size=PAGE)
    return d / "old.cart", ext, one


def test_extended_windows_are_the_one_shot_build_s(carts):
    old, ext, one = carts
    io, ie, i1 = (cartridge.open_cartridge(p)[0] for p in (old, ext.path, one.path))
    assert ie.tokens.tolist() == i1.tokens.tolist() and ext.new_tokens > WINDOW and ext.reused_tokens == len(io.tokens)
    assert [(m.kind, m.window, m.start, m.count) for m in ie.layers] == [
        (m.kind, m.window, m.start, m.count) for m in i1.layers]
    assert [m.kind for m in ie.layers] == ["window", "attention"] * 2 and ie.layers[0].count == WINDOW
    assert ie.layers[0].start > len(io.tokens)  # the stored window was left behind entirely
    assert cartridge.verify_cartridge(ext.path).ok


def test_extended_window_k_v_are_the_one_shot_build_s(carts, gemma3):
    """The window's K/V equal the one-shot build's within fp16 rounding (the new tokens attended over the stored,
    fp16-rounded, prefix and were prefilled in other chunks)."""
    _, ext, one = carts
    e, o = (cartridge.load(p, model=gemma3, attention="portable") for p in (ext.path, one.path))
    for i in (0, 2):
        for a, b in ((e.prefixes[i].keys, o.prefixes[i].keys), (e.prefixes[i].values, o.prefixes[i].values)):
            assert a.shape == b.shape == (1, 2, WINDOW, 32)
            np.testing.assert_allclose(np.array(a), np.array(b), atol=KV_TOL, err_msg=f"layer {i}")


def _last_logits(cart, question):
    logits = cart.model(mx.array(cart.question_prompt(question))[None], cache=cart.prompt_cache())
    return np.array(logits[0, -1].astype(mx.float32))


def _greedy(cart, question, n=12):
    return [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(question),
                                                    max_tokens=n, prompt_cache=cart.prompt_cache())]


def test_extended_window_model_answers_like_the_one_shot_build(carts, gemma3):
    _, ext, one = carts
    e, o = (cartridge.load(p, model=gemma3) for p in (ext.path, one.path))
    for q in QUESTIONS:
        np.testing.assert_allclose(_last_logits(e, q), _last_logits(o, q), atol=LOGIT_TOL)
        assert _greedy(e, q) == _greedy(o, q)


def test_a_seam_that_moves_prefills_the_window_s_last_tokens_again(gemma3, tmp_path):
    """The joined text merges the stored document's last word with the new text's first: those stored tokens
    are cut from the window and prefilled again (`extend._window_cache`), as a one-shot build has them."""
    cartridge.build(OLD + " The lessee", tmp_path / "old.cart", model=gemma3, page_size=PAGE)
    ext = cartridge.extend(tmp_path / "old.cart", "s pay rent monthly. " * 4, output=tmp_path / "ext.cart",
                           model=gemma3, separator="")
    one = cartridge.build(OLD + " The lessee" + "s pay rent monthly. " * 4, tmp_path / "one.cart", model=gemma3,
                          page_size=PAGE)
    n_old = len(cartridge.open_cartridge(tmp_path / "old.cart")[0].tokens)
    assert ext.reused_tokens < n_old  # the seam moved
    e, o = (cartridge.load(p, model=gemma3) for p in (ext.path, one.path))
    assert e.tokens == o.tokens
    for i in (0, 2):
        np.testing.assert_allclose(np.array(e.prefixes[i].keys), np.array(o.prefixes[i].keys), atol=KV_TOL)
    np.testing.assert_allclose(_last_logits(e, QUESTIONS[0]), _last_logits(o, QUESTIONS[0]), atol=LOGIT_TOL)
