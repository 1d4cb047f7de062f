"""build(): options are checked before any prefill; what it writes is what inspect and load report."""

import shutil
import warnings

import pytest
from helpers.tiny_models import make_tiny

import cartridge
from cartridge.write.options import PageSizeWarning, fit_page_size
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
    assert str(cart.prefixes[0].k_parts["values"].dtype) == "mlx.core.bfloat16"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"tier": "int3"}, InputError, "unknown tier 'int3'"),
    ({"tier": "safe"}, InputError, r"unknown tier 'safe' \(safe is a preset: --preset safe"),
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
    with pytest.raises(ModelMismatchError) as e:
        cartridge.load(r.path, model=other)
    assert str(e.value) == (
        f"cartridge {r.path} was built with model tiny-seed0 (fingerprint {tiny.fingerprint['id'][:12]}); this "
        f"model tiny-seed1 (fingerprint {other.fingerprint['id'][:12]}) differs in weights: answer with "
        f"--model tiny-seed0 (Python: model='tiny-seed0'), or rebuild the cartridge with this model")
    wider = make_tiny(smol_tokenizer, seed=0, intermediate_size=96)
    with pytest.raises(ModelMismatchError, match="differs in config, weights: answer with --model tiny-seed0"):
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
    assert f"(fingerprint {tiny.fingerprint['id'][:12]}); this model (fingerprint {fp['id'][:12]})" in msg
    assert f" differs in {part}: answer with --model tiny-seed0" in msg  # weights and config are the same
    assert "\n" not in msg and len(msg) - len(r.path) < 250


def test_load_takes_a_model_reference(tiny_dir, tmp_path):
    lm = cartridge.load_model(str(tiny_dir))
    r = cartridge.build(DOC, tmp_path / "d.cart", model=lm)
    cart = cartridge.load(r.path, model=str(tiny_dir), attention="portable")
    assert cart.info.fingerprint["id"] == lm.fingerprint["id"]


@pytest.mark.slow
def test_model_folder_without_tokenizer_files_is_refused_in_one_line(tiny_dir, smol_tokenizer, tmp_path):
    """Without tokenizer files transformers raises for a llama folder, and gives an empty tokenizer for a
    qwen3 one (which would fail later, in the probe, as if the model were at fault): one line each."""
    import json

    import mlx.core as mx
    from helpers.family_models import make_model, tiny_config
    from mlx.utils import tree_flatten

    from cartridge.errors import ModelLoadError
    from cartridge.models.loader import load_model

    llama, qwen3 = tmp_path / "llama", tmp_path / "qwen3"
    llama.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_dir / name, llama / name)
    qwen3.mkdir()
    (qwen3 / "config.json").write_text(json.dumps(tiny_config("qwen3", len(smol_tokenizer.vocab))))
    weights = make_model("qwen3", smol_tokenizer).model.parameters()
    mx.save_safetensors(str(qwen3 / "model.safetensors"), dict(tree_flatten(weights)))
    with pytest.raises(ModelLoadError, match="tokenizer") as e:
        load_model(str(llama))
    assert "\n" not in str(e.value)
    with pytest.raises(ModelLoadError, match="encodes no tokens: its folder needs the model's tokenizer files"):
        load_model(str(qwen3))


def test_load_takes_default(real_model, tmp_path):
    r = cartridge.build("A short note about leases.", tmp_path / "d.cart", model=real_model)
    assert cartridge.load(r.path, model="default").info.model_ref == "default"


def test_progress_starts_at_token_zero(tiny, tmp_path):
    calls = []
    r = cartridge.build(DOC, tmp_path / "d.cart", model=tiny, prefill_step=32,
                        progress=lambda done, total: calls.append((done, total)))
    assert calls[0] == (0, r.tokens)
    assert [d for d, _ in calls[1:]] == [min(s + 32, r.tokens) for s in range(0, r.tokens, 32)]


def test_source_document_recorded(tiny, tmp_path):
    import hashlib

    text = "\n  \n  Lease of 12 Elm St  \n" + DOC
    r = cartridge.build(text, tmp_path / "d.cart", model=tiny, source_name="/some/folder/lease.txt")
    info, _ = cartridge.open_cartridge(r.path)
    assert info.source == {"name": "lease.txt", "bytes": len(text.encode()),
                           "sha256": hashlib.sha256(text.encode()).hexdigest(), "first_line": "Lease of 12 Elm St"}
    assert info.format_version == "1.11"


def test_context_reserve_warns_with_tokens_left(tiny, tmp_path):
    from cartridge.write.options import ContextWarning

    with pytest.warns(ContextWarning) as w:
        r = cartridge.build(DOC * 4, tmp_path / "d.cart", model=tiny)  # tiny context: 512 tokens
    left = 512 - r.tokens
    assert 0 < left < 256 and r.context_left == left
    assert str(w[0].message) == (f"the document is {r.tokens:,} tokens of the model's 512-token context: only "
                                 f"{left} are left for each question and its answer (reserve 256)")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cartridge.build(DOC * 4, tmp_path / "e.cart", model=tiny, reserve=left)  # exactly enough: no warning
    with pytest.raises(InputError, match="reserve is -1"):
        cartridge.build(DOC, tmp_path / "f.cart", model=tiny, reserve=-1)


def test_disk_space_checked_before_prefill(tiny, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from cartridge.write.encode import cartridge_bytes
    from cartridge.errors import WriteError

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    called = []
    with pytest.raises(WriteError) as e:
        cartridge.build(DOC, tmp_path / "d.cart", model=tiny, progress=lambda *a: called.append(a))
    assert not called and not (tmp_path / "d.cart").exists()
    schema = [{"layer": i, "k": "fp16", "v": "fp16"} for i in range(2)]
    from cartridge.models.prompt import prefix_tokens, prompt_mode

    tokens = prefix_tokens(tiny.tokenizer, DOC, prompt_mode(tiny.tokenizer))
    need = cartridge_bytes(schema, 2, 16, len(tokens), 256)
    assert str(e.value) == f"cartridge {tmp_path / 'd.cart'} needs about {need:,} bytes; only 1,000 are free in {tmp_path}"
    monkeypatch.undo()
    r = cartridge.build(DOC, tmp_path / "d.cart", model=tiny)
    assert r.bytes <= need  # the estimate covers what was written


@pytest.mark.parametrize("asked, n_tokens, written", [(65536, 100, 256), (65536, 257, 512), (65536, 1024, 1024),
                                                      (300, 100, 256), (256, 100, 256), (64, 10, 64),
                                                      (1000, 999, 1000), (4096, 5000, 4096)])
def test_fit_page_size(asked, n_tokens, written):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fit_page_size(asked, n_tokens) == written
    assert [type(w.message) for w in caught] == ([PageSizeWarning] if written != asked else [])
