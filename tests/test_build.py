"""build(): options are checked before any prefill; what it writes is what inspect and load report."""

import pytest
from conftest import make_tiny

import cartridge
from cartridge.errors import InputError, OutputExistsError

DOC = "Section 1. The lessee may terminate the agreement with 30 days of written notice. " * 6


def test_build_writes_expected_geometry(tiny, tmp_path):
    r = cartridge.build(DOC, tmp_path / "d.cart", model=tiny, page_size=32)
    info, _ = cartridge.open_cartridge(r.path)
    assert info.n_layers == 2 and info.n_kv_heads == 2 and info.head_dim == 16
    assert info.n_pages == -(-r.tokens // 32)
    assert len(info.tokens) == r.tokens
    assert r.bytes_per_token == 2 * 2 * 32 * 2  # layers * sides * kv_dim * 2 bytes
    assert info.bytes_per_token() == r.bytes_per_token
    assert info.fingerprint == tiny.fingerprint
    assert info.source_dtype == "float32"


def test_bf16_tier_round_trips(tiny, tmp_path):
    r = cartridge.build(DOC, tmp_path / "b.cart", model=tiny, tier="bf16")
    cart = cartridge.load(r.path, model=tiny, attention="portable")
    assert cart.info.tiers[0] == {"layer": 0, "k": "bf16", "v": "bf16"}
    assert str(cart._prefixes[0].k_parts["values"].dtype) == "mlx.core.bfloat16"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"tier": "int3"}, InputError, "unknown tier 'int3'"),
    ({"page_size": 0}, InputError, "page size 0"),
    ({"prefill_step": 0}, InputError, "prefill step 0"),
])
def test_bad_options_refused(tiny, tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        cartridge.build(DOC, tmp_path / "x.cart", model=tiny, **kwargs)
    assert not (tmp_path / "x.cart").exists()


def test_corpus_longer_than_context_refused(tiny, tmp_path):
    with pytest.raises(InputError, match="the model's context is 512 tokens"):
        cartridge.build(DOC * 10, tmp_path / "x.cart", model=tiny)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_refused_before_prefill(tiny, tmp_path):
    out = tmp_path / "d.cart"
    cartridge.build(DOC, out, model=tiny)
    calls = []
    with pytest.raises(OutputExistsError):
        cartridge.build(DOC, out, model=tiny, progress=lambda *a: calls.append(a))
    assert calls == []
    r = cartridge.build(DOC + " More.", out, model=tiny, force=True)
    assert len(cartridge.open_cartridge(out)[0].tokens) == r.tokens


def test_wrong_model_refused(smol_tokenizer, tiny, tmp_path):
    from cartridge.errors import ModelMismatchError

    r = cartridge.build(DOC, tmp_path / "d.cart", model=tiny)
    other = make_tiny(smol_tokenizer, seed=1)  # same shape, different weights
    with pytest.raises(ModelMismatchError, match="differing: weights"):
        cartridge.load(r.path, model=other)
    wider = make_tiny(smol_tokenizer, seed=0, intermediate_size=96)
    with pytest.raises(ModelMismatchError, match="config"):
        cartridge.load(r.path, model=wider)


def _fresh_tokenizer():
    import mlx.core as mx

    from cartridge.models.gguf import tokenizer_from_metadata
    from cartridge.models.loader import default_gguf_path

    _, meta = mx.load(str(default_gguf_path()), return_metadata=True)
    return tokenizer_from_metadata(meta)


@pytest.mark.parametrize("change, part", [("tokenizer", "tokenizer"), ("chat template", "chat_template")])
def test_same_weights_other_tokenizer_or_template_refused(tiny, tmp_path, change, part):
    from cartridge.errors import ModelMismatchError
    from cartridge.models.loader import fingerprint

    r = cartridge.build(DOC, tmp_path / "d.cart", model=tiny)
    tok = _fresh_tokenizer()
    if change == "tokenizer":
        tok._tokenizer.add_tokens(["<extra_token_x>"])  # one more vocabulary entry
    else:
        tok._tokenizer.chat_template = tok._tokenizer.chat_template.replace("You are a helpful", "You are a terse")
    fp = fingerprint(tiny.model, tok)
    with pytest.raises(ModelMismatchError) as e:
        cartridge.load(r.path, model=tiny.model, tokenizer=tok)
    msg = str(e.value)
    assert f"model fingerprint {fp['id']} differs from the cartridge's {tiny.fingerprint['id']}" in msg
    assert f"differing: {part} (cartridge {tiny.fingerprint[part]}, model {fp[part]})" in msg
    assert msg.count("(cartridge ") == 1  # only that part differs: weights and config are the same
