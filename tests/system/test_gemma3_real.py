"""Gemma 3 270M from its PyPI packages ("gemma3-270m", issue 47): a Q4_K_M GGUF of a sliding-window model with a
SentencePiece vocabulary and no chat template.

`make test` keeps one build and one answer (the loader, the window layers and a base model's plain prompt on
every run); the perplexity comparison with llama.cpp's own reader is slow.
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import math

import mlx.core as mx
import mlx_lm
import pytest
from helpers.samples import SAMPLE, sample_questions
from mlx.utils import tree_flatten

from cartridge.models.gguf_packages import gemma3_270m_path
from cartridge.models.prompt import PLAIN, full_prompt_tokens

DOC = SAMPLE.read_text()[:3000]  # about 700 tokens: past the 512-token window of 15 of its 18 layers
PPL_TOKENS = 1000


def _greedy(model, tokenizer, prompt, n=16, **kw):
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n, **kw)]


def test_fp16_cartridge_answers_token_for_token_like_a_fresh_prefill(gemma_model, tmp_path):
    r = cartridge.build(DOC, tmp_path / "gemma.cart", model=gemma_model)
    cart = cartridge.load(r.path, model=gemma_model)
    assert r.tokens > 600 and cart.info.prompt_mode == PLAIN and cart.tokens[0] == gemma_model.tokenizer.bos_token_id
    kinds = [layer.kind for layer in cart.info.layers]
    assert kinds == ["window"] * 5 + ["attention"] + ["window"] * 5 + ["attention"] + ["window"] * 5 + ["attention"]
    q = sample_questions(1)[0]["question"]
    got = _greedy(cart.model, cart.tokenizer, cart.question_prompt(q), prompt_cache=cart.prompt_cache())
    want = _greedy(gemma_model.model, gemma_model.tokenizer, full_prompt_tokens(gemma_model.tokenizer, DOC, q))
    assert got == want and len(got) > 0


@pytest.fixture(scope="module")
def sample_cart(gemma_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "lgpl.cart"
    return cartridge.load(cartridge.build(SAMPLE.read_text(), path, model=gemma_model).path, model=gemma_model)


@pytest.mark.slow
@pytest.mark.parametrize("row", sample_questions(3), ids=lambda r: f"q{r['id']}")
def test_sample_cartridge_answers_token_for_token_like_a_fresh_prefill(sample_cart, gemma_model, row):
    """The whole sample (1,646 tokens: three times the window): 30 greedy tokens as mlx-lm's from the full prompt."""
    q = row["question"]
    got = _greedy(sample_cart.model, sample_cart.tokenizer, sample_cart.question_prompt(q), n=30,
                  prompt_cache=sample_cart.prompt_cache())
    full = full_prompt_tokens(gemma_model.tokenizer, SAMPLE.read_text(), q)
    assert got == _greedy(gemma_model.model, gemma_model.tokenizer, full, n=30) and len(got) > 0


def _perplexity(model, ids):
    x = mx.array(ids)[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return math.exp(-mx.take_along_axis(logp, x[:, 1:, None], axis=-1).mean().item())


def _reference_model(args):
    """The same weights read by llama.cpp's `gguf.GGUFReader` and dequantized to float32 by its package, named
    by its `get_tensor_name_map`, norms stored as 1 + w put back to w (convert_hf_to_gguf.py's Gemma3Model)."""
    import gguf
    from mlx_lm.models import gemma3_text

    reader = gguf.GGUFReader(str(gemma3_270m_path()))
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, args.num_hidden_layers)
    model = gemma3_text.Model(args)
    model.sanitize({})  # no lm_head.weight: tied embeddings
    weights = []
    for name, _ in tree_flatten(model.parameters()):
        t = tensors[names.get_name(name, try_suffixes=(".weight",))]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        weights.append((name, mx.array(w - 1.0 if name.endswith("norm.weight") else w)))
    model.load_weights(weights, strict=True)
    return model


@pytest.mark.slow
def test_perplexity_is_that_of_the_file_read_by_llama_cpp_s_own_reader(gemma_model):
    """Issue 47: within 1% of the same weights dequantized to float32 by the gguf package; a convention left
    undone (norms as 1 + w, RoPE order, tokenizer) gives perplexities in the thousands or millions."""
    ids = gemma_model.tokenizer.encode(SAMPLE.read_text())[:PPL_TOKENS]
    got = _perplexity(gemma_model.model, ids)
    want = _perplexity(_reference_model(gemma_model.model.args), ids)
    assert abs(got - want) <= 0.01 * want
    assert got < 15  # 11.6 measured on the sample's first 1,000 tokens

