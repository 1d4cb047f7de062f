"""Every attention path on Gemma 3 270M (issue 47 item 3): head_dim 256, 4 query heads over one KV head, 15
sliding-window layers (mlx-lm's RotatingKVCache, loaded from their stored window) beside the 3 full-attention
layers that attend over the cartridge's pages.

An fp16 and an mlx4g32 cartridge of a 600-token document (the windows full, moving during the answer). On each
path the decode loop's greedy tokens are the portable path's (MLX ops over the stored pages) and each step's
log-probabilities within TOL of it; the portable fp16 answer is a fresh mlx-lm prefill's:
- "dequantize-once": the pages decoded to dense once at load;
- "cpu": the CPU backend's question prefill over the pages decoded for the call (`kernels.cpu.QuestionPrefill`):
  what "auto" takes where its default memory budget leaves a side stored (the mlx4g32 cartridge's last layer),
  and attached by hand to every full-attention layer's stored pages;
- "metal-emulated": the Metal decode kernels, run on this CPU by tests/helpers/metal_emulator.py, reached the way a Mac
  reaches them: the registry's Metal entry is the device, "fused" lays out `MetalInputs` for the pages, the
  model's attention call goes through the route to the host code and the emulated kernels (4 decode steps);
- "fused" on a CUDA device (DEVICE=gpu, skipped elsewhere): the CUDA kernels, or the contiguous buffer for fp16.

The model is the real one where its package is installed; "random" is a random-weight gemma3_text of the same
attention shapes (window, pattern, heads, head_dim 256, RoPE bases, query scale), for a machine without the
package (the GPU machine): random weights leave near ties, so there only the steps whose top two
log-probabilities are apart by more than 4 x TOL must pick the portable path's token.
"""

from dataclasses import replace

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from helpers.samples import SAMPLE
from helpers.family_models import make_model
from helpers.fresh_prefill import decode_loop, document_of, greedy
from helpers import metal_source
from helpers.metal_emulator import emulate_metal_device

from cartridge.attention.backends import proof
from cartridge.attention.kernels import cpu
from cartridge.attention.prefix import LayerPrefix
from cartridge.attention.backends import device
from cartridge.models.prompt import full_prompt_tokens

pytestmark = pytest.mark.slow

DOC_TOKENS = 600
QUESTION = "Who publishes revised versions of the license?"
STEPS = 8  # decode steps a path is compared on (the emulated Metal kernels: METAL_STEPS)
METAL_STEPS = 4
TOL = 1e-3 if mx.default_device() == mx.cpu else 2e-2  # float32 on the CPU; the GPU rounds more (TF32, fp16 K/V)
FULL_LAYERS = (5, 11, 17)
RANDOM = "tiny-gemma3_text"  # the random model's LoadedModel.ref (family_models.make_model)
GEMMA3_270M_ATTENTION = {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
                         "head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6,
                         "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
                         "max_position_embeddings": 32768}


@pytest.fixture(scope="module", params=["real", "random"])
def lm(request, smol_tokenizer):
    if request.param == "real":
        return request.getfixturevalue("gemma_model")
    return make_model("gemma3_text", smol_tokenizer, seed=3, **GEMMA3_270M_ATTENTION)


@pytest.fixture(scope="module", params=["fp16", "mlx4g32"])
def built(request, lm, tmp_path_factory):
    """(path of the cartridge in that tier, the document)."""
    document = document_of(lm.tokenizer, SAMPLE.read_text(), DOC_TOKENS)
    path = tmp_path_factory.mktemp("paths") / f"{request.param}.cart"
    r = cartridge.build(document, path, model=lm, tier=request.param)
    assert r.tokens >= DOC_TOKENS  # (the random model's tokenizer has a chat template: its opening comes first)
    return path, document


_PORTABLE = {}


def _portable(lm, path):
    """The portable path's (tokens, log-probabilities) over STEPS steps, computed once per cartridge."""
    if path not in _PORTABLE:
        cart = cartridge.load(path, model=lm, attention="portable")
        assert all(p.backend is None for p in cart.prefixes if isinstance(p, LayerPrefix))
        _PORTABLE[path] = decode_loop(cart, cart.question_prompt(QUESTION), STEPS)
    return _PORTABLE[path]


def _check(lm, path, cart, n=STEPS):
    want_tokens, want = (x[:n] for x in _portable(lm, path))
    _, got = decode_loop(cart, cart.question_prompt(QUESTION), n, want_tokens)
    assert np.abs(got - want).max() < TOL
    top2 = np.sort(want, axis=-1)[:, -2:]
    decided = np.ones(n, bool) if lm.ref != RANDOM else top2[:, 1] - top2[:, 0] > 4 * TOL
    assert [int(t) for t in np.argmax(got, axis=-1)[decided]] == [t for t, d in zip(want_tokens, decided) if d]
    assert decided.sum() >= n // 2


def test_portable_fp16_answers_like_a_fresh_prefill(lm, built):
    path, document = built
    if lm.ref == RANDOM or not path.name.startswith("fp16"):
        pytest.skip("the real model's fp16 cartridge answers as a fresh prefill; the others are compared to it")
    tokens, _ = _portable(lm, path)
    assert tokens == greedy(lm.model, lm.tokenizer, full_prompt_tokens(lm.tokenizer, document, QUESTION), STEPS)


def test_dequantize_once_answers_like_the_portable_path(lm, built):
    path, _ = built
    cart = cartridge.load(path, model=lm, attention="dequantize-once")
    assert cart.attention == "dequantize-once"
    _check(lm, path, cart)


def test_cpu_question_prefill_answers_like_the_portable_path(lm, built):
    """Under "auto" and on every full-attention layer (attached by hand to the stored pages)."""
    if device() != "cpu":
        pytest.skip("the question prefill over decoded pages is the CPU backend's")
    path, _ = built
    auto = cartridge.load(path, model=lm)
    kernels = [type(p.backend).__name__ for p in auto.prefixes if isinstance(p, LayerPrefix)]
    # fp16: decoded whole, no prefill over pages; mlx4g32: the default memory budget (stored x 1.25 + one layer,
    # the window layers' float32 K/V held among the stored) leaves the last layer's V stored, read by the CPU's prefill
    assert kernels == (["NoneType"] * 3 if path.name.startswith("fp16") else ["NoneType"] * 2 + ["QuestionPrefill"])
    _check(lm, path, auto)
    by_hand = cartridge.load(path, model=lm, attention="portable")
    by_hand.prefixes = [replace(p, backend=cpu.QuestionPrefill()) if isinstance(p, LayerPrefix) else p
                        for p in by_hand.prefixes]
    _check(lm, path, by_hand)


@pytest.mark.skipif(metal_source.compiler() is None, reason="no C++ compiler (g++, clang++ or c++)")
def test_emulated_metal_kernels_answer_like_the_portable_path(lm, built, monkeypatch):
    path, _ = built
    calls = emulate_metal_device(monkeypatch)
    monkeypatch.setattr(proof, "_warned", set())  # it warns once a process
    with pytest.warns(proof.KernelProofWarning, match="was never checked on this machine"):
        cart = cartridge.load(path, model=lm, attention="fused")
    assert cart.attention == "fused"
    paged = [p for p in cart.prefixes if isinstance(p, LayerPrefix)]
    assert [type(p.backend).__name__ for p in paged] == ["MetalInputs"] * len(FULL_LAYERS)
    _check(lm, path, cart, METAL_STEPS)
    # pass 1 and the finish on each full-attention layer at each decode step after the question's prefill
    assert len(calls) == 2 * len(FULL_LAYERS) * (METAL_STEPS - 1)


def test_cuda_fused_answers_like_the_portable_path(lm, built):
    if device() != "cuda":
        pytest.skip("the fused kernels need the CUDA backend (run with DEVICE=gpu on an NVIDIA GPU)")
    path, _ = built
    cart = cartridge.load(path, model=lm, attention="fused")
    assert all(p.backend is not None for p in cart.prefixes if isinstance(p, LayerPrefix))
    _check(lm, path, cart)
