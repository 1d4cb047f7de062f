"""`cartridge.import_prompt_cache`: a file of mlx_lm.cache_prompt becomes a cartridge that answers as mlx-lm does
through that file; token ids from --document or the file's own record; the K/V checked against the model at both
ends; every bad input refused in one line with nothing written."""

from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers.tiny_models import make_tiny
from helpers.samples import SAMPLE, sample_questions
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache, make_prompt_cache
from helpers.promptfiles import cache_prompt, generate_module, mlx_generate, prefill_file, save_model_dir

from cartridge.errors import InputError, ModelMismatchError, OutputExistsError
from cartridge.format.reader import open_cartridge
from cartridge.promptcache.importer import cache_prompt_tokens, opening_tokens
from cartridge.promptcache.kvcheck import CHECK_TOKENS

DOC = ("The lease runs from March 1, 2024 to February 28, 2026. The tenant pays 1,450 euros each month, due on "
       "the fifth day. Pets are allowed with a deposit of 300 euros. ") * 3
QUESTION = "When is the rent due?"


@pytest.fixture(scope="module")
def pfile(tiny_dir, tmp_path_factory):
    return cache_prompt(tiny_dir, tmp_path_factory.mktemp("pc") / "doc.safetensors", DOC)


@pytest.fixture(scope="module")
def imported(pfile, tmp_path_factory):
    return cartridge.import_prompt_cache(pfile, tmp_path_factory.mktemp("imp") / "doc.cart", document=DOC)


@pytest.fixture(scope="module")
def wide(smol_tokenizer, tmp_path_factory):
    """A tiny model of head_dim 32 (the group of the affine tiers and of mlx-lm's quantized cache) and its folder."""
    lm = make_tiny(smol_tokenizer, seed=0, head_dim=32)
    return lm, save_model_dir(lm, tmp_path_factory.mktemp("wide") / "model", head_dim=32)


def _fp16(caches):
    """mlx-lm caches with K/V rounded to float16 and back: what the fp16 tier holds of float32 K/V."""
    out = []
    for c in caches:
        k = KVCache()
        k.keys, k.values = (x[..., :c.offset, :].astype(mx.float16).astype(x.dtype) for x in (c.keys, c.values))
        k.offset = c.offset
        out.append(k)
    return out


def test_answers_equal_mlx_lm_through_the_original_file(pfile, imported, monkeypatch):
    cart = cartridge.load(imported.path)
    text, fed = mlx_generate(pfile, QUESTION, "--max-tokens", "12", monkeypatch=monkeypatch)
    assert cart.question_prompt(QUESTION) == fed  # the question right after the document, as mlx-lm feeds it
    answer = mlx_lm.generate(cart.model, cart.tokenizer, fed, prompt_cache=cart.prompt_cache(), max_tokens=12)
    assert answer == text and len(cart.tokenizer.encode(answer)) >= 6
    got = cart.model(mx.array([fed]), cache=cart.prompt_cache())
    want = cart.model(mx.array([fed]), cache=_fp16(load_prompt_cache(str(pfile))))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_records_mlx_lm_prompt_layout_and_the_file(imported, tiny, tiny_dir):
    info, _ = open_cartridge(imported.path)
    assert info.tokens.tolist() == cache_prompt_tokens(tiny.tokenizer, DOC)
    assert (info.prompt_mode, info.separator, info.system) == ("chat_template", "", None)
    assert info.source["name"] == "doc.safetensors" and info.source["bytes"] == len(DOC.encode())
    assert (imported.tokens_from, imported.checked_tokens) == ("document", opening_tokens(tiny.tokenizer) + 2 * CHECK_TOKENS)
    assert imported.model == info.model_ref == str(Path(tiny_dir).resolve())  # the file's metadata names it


def test_a_file_without_token_ids_needs_the_document(pfile, tmp_path):
    with pytest.raises(InputError, match="holds no token ids .*pass --document"):
        cartridge.import_prompt_cache(pfile, tmp_path / "x.cart")
    assert not (tmp_path / "x.cart").exists()


def test_a_document_of_another_token_count_is_refused(pfile, tmp_path):
    with pytest.raises(InputError, match=r"the document is \d+ tokens .* holds \d+"):
        cartridge.import_prompt_cache(pfile, tmp_path / "x.cart", document=DOC + " One more sentence.")
    assert not (tmp_path / "x.cart").exists()


@pytest.mark.parametrize("old,new,at", [("The lease runs", "The house runs", "0"), ("300 euros. ", "400 euros. ", "1")])
def test_another_text_of_the_same_token_count_is_refused(pfile, tiny, tmp_path, old, new, at):
    i = DOC.index(old) if at == "0" else DOC.rindex(old)
    other = DOC[:i] + new + DOC[i + len(old):]
    assert len(cache_prompt_tokens(tiny.tokenizer, other)) == len(cache_prompt_tokens(tiny.tokenizer, DOC))
    with pytest.raises(ModelMismatchError, match="are not what model .* computes .*another text"):
        cartridge.import_prompt_cache(pfile, tmp_path / "x.cart", document=other)
    assert not (tmp_path / "x.cart").exists()


def test_a_prompt_cache_of_another_model_is_refused(pfile, smol_tokenizer, tmp_path):
    same_shape = save_model_dir(make_tiny(smol_tokenizer, seed=1), tmp_path / "seed1")
    with pytest.raises(ModelMismatchError, match=r"layer 0 [KV] differs by \d+.*another model"):
        cartridge.import_prompt_cache(pfile, tmp_path / "x.cart", model=same_shape, document=DOC)
    wider = save_model_dir(make_tiny(smol_tokenizer, seed=0, head_dim=32), tmp_path / "wide", head_dim=32)
    with pytest.raises(ModelMismatchError, match="layer 0 holds K of 2 kv heads x 16; .* 2 x 32: a prompt cache of "
                                                 "another model"):
        cartridge.import_prompt_cache(pfile, tmp_path / "x.cart", model=wider, document=DOC)
    assert not (tmp_path / "x.cart").exists()


def test_a_quantized_file_imports_its_dequantized_values(wide, tmp_path):
    lm, folder = wide
    path = cache_prompt(folder, tmp_path / "q.safetensors", DOC, "--kv-bits", "4", "--kv-group-size", "32",
                        "--quantized-kv-start", "0")
    caches = load_prompt_cache(str(path))
    assert {type(c).__name__ for c in caches} == {"QuantizedKVCache"}
    r = cartridge.import_prompt_cache(path, tmp_path / "q.cart", document=DOC)
    assert r.checked_tokens == opening_tokens(lm.tokenizer) + 2 * CHECK_TOKENS
    cart = cartridge.load(r.path)
    for c, prefix in zip(caches, cart.prefixes):
        want = mx.dequantize(*c.keys, group_size=32, bits=4)[0, :, :c.offset]
        got = prefix.k_codec.decode(prefix.k_parts, prefix.k_params)  # (n_pages, n_kv, P, D)
        got = got.transpose(1, 0, 2, 3).reshape(want.shape[0], -1, want.shape[-1])[:, :c.offset]
        np.testing.assert_array_equal(np.array(got), np.array(want.astype(mx.float16)))


def test_a_rotating_cache_imports_only_while_it_holds_every_token(tiny, tiny_dir, tmp_path):
    tokens = cache_prompt_tokens(tiny.tokenizer, DOC)
    n = len(tokens)
    for size, fits in ((n + 10, True), (64, False)):  # cache_prompt --max-kv-size for a model without make_cache
        caches = [RotatingKVCache(max_size=size, keep=4) for _ in tiny.model.layers]
        path = prefill_file(tiny, tmp_path / f"r{size}.safetensors", tokens, caches, tiny_dir)
        if fits:
            r = cartridge.import_prompt_cache(path, tmp_path / "r.cart", document=DOC)
            assert open_cartridge(r.path)[0].layers[0].kind == "attention" and r.checked_tokens > 0
            continue
        with pytest.raises(InputError, match=rf"layer 0 is a RotatingKVCache\(max_size=64\) that kept 64 of {n} "
                                             r"tokens \(mlx_lm.cache_prompt --max-kv-size\)"):
            cartridge.import_prompt_cache(path, tmp_path / "cut.cart", document=DOC)


def test_tiers_and_presets_of_build(wide, tmp_path):
    pfile = cache_prompt(wide[1], tmp_path / "w.safetensors", DOC)
    r = cartridge.import_prompt_cache(pfile, tmp_path / "q4.cart", document=DOC, tier="mlx4g32", boundary_protect=1)
    assert r.schema == [{"layer": 0, "k": "fp16", "v": "fp16"}, {"layer": 1, "k": "fp16", "v": "fp16"}]
    r = cartridge.import_prompt_cache(pfile, tmp_path / "q4a.cart", document=DOC, tier="mlx4g32")
    assert r.bytes_per_token == 2 * 2 * (2 * 32 // 2 + 2 * 32 // 8)  # layers x sides x (kv_dim/2 + kv_dim/8)
    r = cartridge.import_prompt_cache(pfile, tmp_path / "q4b.cart", document=DOC, k_tier="mlx4g32", v_tier="int8")
    assert {(row["k"], row["v"]) for row in r.schema} == {("mlx4g32", "int8")}
    r = cartridge.import_prompt_cache(pfile, tmp_path / "p.cart", document=DOC, preset="compact", calibrate=False)
    assert open_cartridge(r.path)[0].records["cartridge.preset"] == b'"compact"'


def test_a_budget_preset_is_measured_on_the_imported_kv_as_build_measures_its_prefill(wide, tmp_path):
    lm, _ = wide
    path = prefill_file(lm, tmp_path / "w.safetensors", cache_prompt_tokens(lm.tokenizer, DOC),
                        make_prompt_cache(lm.model), "tiny")
    r = cartridge.import_prompt_cache(path, tmp_path / "i.cart", model=lm, document=DOC, preset="balanced")
    b = cartridge.build(DOC, tmp_path / "b.cart", model=lm, preset="balanced")  # the same tokens prefilled here
    assert r.schema == b.schema and r.schema != [{"layer": i, "k": "fp16", "v": "fp16"} for i in range(2)]
    # mlx-lm's prefill (all tokens but the last, then the last) rounds a little differently from build's chunks
    assert r.calibration["measured_kl"] == pytest.approx(b.calibration["measured_kl"], rel=0.05)


@pytest.mark.slow
def test_real_model_answers_as_mlx_lm_through_the_original_file(real_model, tmp_path, monkeypatch):
    text = SAMPLE.read_text()
    tokens = cache_prompt_tokens(real_model.tokenizer, text)
    path = prefill_file(real_model, tmp_path / "lgpl.safetensors", tokens, make_prompt_cache(real_model.model),
                        "default")  # what mlx_lm.cache_prompt writes (it cannot load the GGUF itself)
    r = cartridge.import_prompt_cache(path, tmp_path / "lgpl.cart", model=real_model, document=text)
    cart = cartridge.load(r.path, model=real_model)
    monkeypatch.setattr(generate_module, "load", lambda *a, **k: (real_model.model, real_model.tokenizer, {}))
    for row in sample_questions(3):
        answer, fed = mlx_generate(path, row["question"], "--max-tokens", "40", monkeypatch=monkeypatch)
        assert cart.question_prompt(row["question"]) == fed
        assert mlx_lm.generate(cart.model, cart.tokenizer, fed, prompt_cache=cart.prompt_cache(), max_tokens=40) == answer


def test_an_existing_output_is_kept(pfile, imported):
    before = sorted((p.name, p.stat().st_mtime_ns) for p in Path(imported.path).iterdir())
    with pytest.raises(OutputExistsError):
        cartridge.import_prompt_cache(pfile, imported.path, document=DOC)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in Path(imported.path).iterdir()) == before
