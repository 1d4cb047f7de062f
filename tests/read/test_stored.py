"""A model's fingerprint is computed once per loaded model (`models.loader.model_fingerprint`), the
stored layers come back as stored (`cartridge.stored`), and a decode left to the first forward pass
gives the same logits as one done at load."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from cartridge.errors import ModelMismatchError
from cartridge.models import loader
from cartridge.read.stored import model_dtype
from helpers.tiny_models import make_tiny

DOC = ("The warranty on the Model 7 kettle lasts 24 months from the date of purchase. "
       "Claims are sent to Kettle Co, 12 Harbour Road. ") * 6


@pytest.fixture(scope="module")
def cart_path(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("stored") / "doc.cart"
    cartridge.build(DOC, path, model=tiny, page_size=64)
    return path


@pytest.fixture
def count(monkeypatch):
    calls = []
    compute = loader.fingerprint

    def counted(model, tokenizer):
        calls.append(id(model))
        return compute(model, tokenizer)

    monkeypatch.setattr(loader, "fingerprint", counted)
    return calls


def test_two_loads_with_one_model_compute_one_fingerprint(cart_path, smol_tokenizer, count):
    fresh = make_tiny(smol_tokenizer, seed=0)  # the same weights as `tiny`, nothing remembered on it
    for _ in range(2):
        cartridge.load(cart_path, model=fresh.model, tokenizer=fresh.tokenizer, verify="header")
    assert len(count) == 1


def test_a_model_from_load_model_needs_none(cart_path, tiny_dir, count):
    lm = cartridge.load_model(str(tiny_dir))
    assert len(count) == 1  # load_model's own, of the stored weights
    cartridge.load(cart_path, model=lm)
    cartridge.load(cart_path, model=lm.model, tokenizer=lm.tokenizer)
    assert len(count) == 1


def test_replaced_weights_are_fingerprinted_again(cart_path, smol_tokenizer, count):
    fresh = make_tiny(smol_tokenizer, seed=0)
    model, tok = fresh.model, fresh.tokenizer
    cartridge.load(cart_path, model=model, tokenizer=tok)
    original = model.layers[0].mlp.up_proj.weight
    model.layers[0].mlp.up_proj.weight = original + 1.0  # a new array object: the remembered one no longer holds
    with pytest.raises(ModelMismatchError, match="differs in weights"):
        cartridge.load(cart_path, model=model, tokenizer=tok)
    model.layers[0].mlp.up_proj.weight = original
    cartridge.load(cart_path, model=model, tokenizer=tok)  # the arrays changed again: computed again
    assert len(count) == 3


def test_model_fingerprint_equals_fingerprint(tiny):
    assert loader.model_fingerprint(tiny.model, tiny.tokenizer) == loader.fingerprint(tiny.model, tiny.tokenizer)
    assert loader.model_fingerprint(tiny.model, tiny.tokenizer)["id"] == tiny.fingerprint["id"]


def test_parameter_arrays_and_model_dtype_follow_the_parameters(tiny):
    from mlx.utils import tree_flatten

    assert [id(w) for w in loader.parameter_arrays(tiny.model)] == [id(w) for _, w in tree_flatten(tiny.model.parameters())]
    assert model_dtype(tiny.model) == mx.float32


def test_decode_left_to_the_first_forward_pass_gives_the_same_logits(cart_path, tiny):
    """No budget: the decode is lazy (`decode_pages(lazy=True)`); a budget that fits everything: each side
    decoded and evaluated at load. The same dense pages, the same logits, bit for bit."""
    lazy = cartridge.load(cart_path, model=tiny, attention="dequantize-once")
    eager = cartridge.load(cart_path, model=tiny, attention="dequantize-once", max_memory=1 << 30)
    assert (lazy.attention, eager.attention) == ("dequantize-once", "dequantize-once")
    q = lazy.question_prompt("How long does the warranty last?")
    out = [np.array(tiny.model(mx.array(q)[None], cache=c.prompt_cache())[0]) for c in (lazy, eager)]
    assert np.array_equal(out[0], out[1])
    for a, b in zip(lazy.prefixes, eager.prefixes):
        assert np.array_equal(np.array(a.k_parts["values"]), np.array(b.k_parts["values"]))
