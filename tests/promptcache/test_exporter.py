"""`cartridge.export_prompt_cache`: a cartridge as the file mlx_lm.generate --prompt-cache-file loads, with the
mlx-lm cache class of every layer that a fresh prefill makes, answering as the cartridge does; and back again."""

import errno
import gc
import json
import warnings

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers.cartfiles import write as write_synthetic
from helpers.tiny_models import make_tiny
from helpers.family_models import make_model
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache
from helpers.promptfiles import mlx_generate, save_model_dir

from cartridge.errors import InputError, ModelMismatchError, OutputExistsError, WriteError
from cartridge.promptcache.exporter import MlxLoadWarning
from cartridge.format import keys as K
from cartridge.format.reader import open_cartridge
from cartridge.models.families import leaves
from cartridge.promptcache import promptfile
from cartridge.promptcache.promptfile import read_prompt_file

DOC = ("The ferry to Inishmore leaves Rossaveal at 10:30 and returns at 17:00 daily in summer. Tickets cost 30 "
       "euros return; bicycles travel free. ") * 3
QUESTION = "When does the ferry return?"


@pytest.fixture(scope="module")
def wide(smol_tokenizer, tmp_path_factory):
    """A tiny model of head_dim 32 (the affine tiers' group), its folder, and an fp16 and an mlx4g32 cartridge."""
    lm = make_tiny(smol_tokenizer, seed=3, head_dim=32)
    folder = save_model_dir(lm, tmp_path_factory.mktemp("wide") / "model", head_dim=32)
    out = tmp_path_factory.mktemp("carts")
    carts = {tier: cartridge.build(DOC, out / f"{tier}.cart", model=str(folder), tier=tier, page_size=64).path
             for tier in ("fp16", "mlx4g32", "mlx4g32+rot")}
    return lm, folder, carts


def _answer(model, tokenizer, prompt, cache):
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, prompt_cache=cache, max_tokens=12)]


def test_fp16_export_answers_as_the_cartridge(wide, tmp_path, monkeypatch):
    lm, folder, carts = wide
    r = cartridge.export_prompt_cache(carts["fp16"], tmp_path / "doc.safetensors")
    assert (r.classes, r.model, r.group_size) == ({"KVCache": 2}, str(folder.resolve()), None)
    caches, meta = load_prompt_cache(r.path, return_metadata=True)
    cart = cartridge.load(carts["fp16"])
    for c, p in zip(caches, cart.prefixes):  # the fp16 pages as they are
        pages = p.k_parts["values"]  # (n_pages, n_kv, P, D)
        want = pages.transpose(1, 0, 2, 3).reshape(1, pages.shape[1], -1, pages.shape[-1])[:, :, :c.offset]
        assert c.keys.dtype == mx.float16 and c.offset == len(cart.tokens)
        np.testing.assert_array_equal(np.array(c.keys), np.array(want))
    record = json.loads(meta["cartridge"])
    assert (record["tokens"], record["separator"], meta["tokenizer_config"]) == (cart.tokens, "\n\n", "{}")
    prompt = cart.question_prompt(QUESTION)
    ours = _answer(cart.model, cart.tokenizer, prompt, cart.prompt_cache())
    assert _answer(cart.model, cart.tokenizer, prompt, load_prompt_cache(r.path)) == ours and len(ours) == 12
    text, fed = mlx_generate(r.path, QUESTION, "--max-tokens", "12", monkeypatch=monkeypatch)  # mlx-lm's own CLI
    assert fed == cart.tokenizer.encode(QUESTION + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert text == mlx_lm.generate(cart.model, cart.tokenizer, fed, prompt_cache=cart.prompt_cache(), max_tokens=12)


def test_mlx4g32_exports_mlx_lms_quantized_cache_as_stored(wide, tmp_path, monkeypatch):
    lm, folder, carts = wide
    r = cartridge.export_prompt_cache(carts["mlx4g32"], tmp_path / "q.safetensors")
    assert (r.classes, r.group_size) == ({"QuantizedKVCache": 2}, 32)
    cart = cartridge.load(carts["mlx4g32"], attention="portable")
    info, data = open_cartridge(carts["mlx4g32"])
    for c, p in zip(load_prompt_cache(r.path), cart.prefixes):
        assert (c.bits, c.group_size) == (4, 32)
        got = mx.dequantize(*c.keys, group_size=32, bits=4)[0]  # (n_kv, T, D), float16 scales: float16 values
        want = p.k_codec.decode(p.k_parts, p.k_params)
        want = want.transpose(1, 0, 2, 3).reshape(got.shape[0], -1, got.shape[-1])[:, :c.offset]
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), rtol=1e-3, atol=1e-3)
    text, fed = mlx_generate(r.path, QUESTION, "--max-tokens", "12", "--kv-group-size", "32", monkeypatch=monkeypatch)
    assert text == mlx_lm.generate(cart.model, cart.tokenizer, fed, prompt_cache=cart.prompt_cache(), max_tokens=12)
    with pytest.raises(ValueError, match="--kv-group-size does not match"):  # mlx-lm's default group is 64
        mlx_generate(r.path, QUESTION, "--max-tokens", "4", monkeypatch=monkeypatch)


@pytest.mark.parametrize("tier,quantized", [("mlx4g32+rot", True), ("mlx4g32", False)])
def test_other_tiers_and_dequantize_export_decoded_kv(wide, tmp_path, tier, quantized):
    _, _, carts = wide
    r = cartridge.export_prompt_cache(carts[tier], tmp_path / "d.safetensors", quantized=quantized)
    assert r.classes == {"KVCache": 2}
    cart = cartridge.load(carts[tier], attention="portable")
    prompt = cart.question_prompt(QUESTION)
    got = cart.model(mx.array([prompt]), cache=load_prompt_cache(r.path))
    want = cart.model(mx.array([prompt]), cache=cart.prompt_cache())
    # decoded values written as float16 (the cartridge attends over them in float32): logits within that rounding
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("family", ["gemma3_text", "falcon_h1", "gemma2"])
@pytest.mark.filterwarnings("ignore::cartridge.promptcache.exporter.MlxLoadWarning")  # an in-memory model: no folder
def test_every_layer_kind_exports_as_a_fresh_prefill_makes_it_and_imports_back(family, smol_tokenizer, tmp_path):
    lm = make_model(family, smol_tokenizer)
    path = cartridge.build(DOC, tmp_path / "f.cart", model=lm, page_size=32).path
    r = cartridge.export_prompt_cache(path, tmp_path / "f.safetensors")
    caches = load_prompt_cache(r.path)
    fresh = make_prompt_cache(lm.model)
    assert [type(c).__name__ for c in leaves(caches)] == [type(c).__name__ for c in leaves(fresh)]
    cart = cartridge.load(path, model=lm, attention="portable")
    prompt = cart.question_prompt(QUESTION)
    got = cart.model(mx.array([prompt]), cache=caches)[0, -1]
    want = cart.model(mx.array([prompt]), cache=cart.prompt_cache())[0, -1]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-4, atol=2e-4)
    back = cartridge.import_prompt_cache(r.path, tmp_path / "back.cart", model=lm)  # token ids from the record
    a, b = open_cartridge(path)[0], open_cartridge(back.path)[0]
    assert (b.tokens.tolist(), b.separator, [m.kind for m in b.layers]) == (a.tokens.tolist(), a.separator,
                                                                            [m.kind for m in a.layers])
    assert back.tokens_from == "record" and back.checked_tokens > 0


def test_a_saved_conversation_exports_and_imports_back_as_a_conversation(wide, tmp_path):
    _, _, carts = wide
    cart = cartridge.load(carts["fp16"])
    cache, prompt = cart.prompt_cache(), cart.question_prompt(QUESTION)
    cart.save(tmp_path / "chat.cart", cache, tokens=prompt + _answer(cart.model, cart.tokenizer, prompt, cache))
    r = cartridge.export_prompt_cache(tmp_path / "chat.cart", tmp_path / "chat.safetensors")
    back = cartridge.import_prompt_cache(r.path, tmp_path / "back.cart")  # the model its metadata names
    a, b = open_cartridge(tmp_path / "chat.cart")[0], open_cartridge(back.path)[0]
    assert (b.tokens.tolist(), b.document_tokens) == (a.tokens.tolist(), a.document_tokens) == (a.tokens.tolist(),
                                                                                                len(cart.tokens))
    assert [(p["kind"], p["start"], p["end"]) for p in b.parts] == [("build", 0, len(cart.tokens)),
                                                                   ("conversation", len(cart.tokens), len(b.tokens))]
    follow_up = cartridge.load(back.path).question_prompt("And the price?")
    assert follow_up == cartridge.load(tmp_path / "chat.cart").question_prompt("And the price?")


def test_export_checks_model_and_output_and_writes_nothing_on_error(wide, smol_tokenizer, tmp_path):
    _, _, carts = wide
    other = save_model_dir(make_tiny(smol_tokenizer, seed=9, head_dim=32), tmp_path / "other", head_dim=32)
    out = tmp_path / "x.safetensors"
    with pytest.raises(ModelMismatchError, match="differs in weights"):
        cartridge.export_prompt_cache(carts["fp16"], out, model=str(other))
    with pytest.raises(InputError, match=r"must end in \.safetensors"):
        cartridge.export_prompt_cache(carts["fp16"], tmp_path / "x.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]
    out.write_bytes(b"mine")
    with pytest.raises(OutputExistsError, match="pass --force"):
        cartridge.export_prompt_cache(carts["fp16"], out)
    assert out.read_bytes() == b"mine"
    cartridge.export_prompt_cache(carts["fp16"], out, force=True)
    assert read_prompt_file(out).tokens == len(open_cartridge(carts["fp16"])[0].tokens)


@pytest.mark.parametrize("ref, says", [
    ("default", "a GGUF model, which mlx_lm.generate cannot load"),
    ("gemma3-270m", "a GGUF model, which mlx_lm.generate cannot load"),
    ("/nowhere/model", "neither an mlx-lm model folder nor a Hugging Face repo id"),
])
def test_a_model_mlx_lm_cannot_load_warns(tmp_path, ref, says):
    path = write_synthetic(tmp_path / "s.cart", extra={K.MODEL_REF: ref})
    with pytest.warns(MlxLoadWarning, match=f"the file names model {ref}, {says}"):
        r = cartridge.export_prompt_cache(path, tmp_path / "s.safetensors")
    assert r.model == ref and r.classes == {"KVCache": 2}


@pytest.mark.parametrize("ref", ["org/model", "folder"])
def test_a_repo_id_or_an_mlx_lm_folder_exports_without_a_warning(wide, tmp_path, ref):
    ref = str(wide[1]) if ref == "folder" else ref
    path = write_synthetic(tmp_path / "s.cart", extra={K.MODEL_REF: ref})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = cartridge.export_prompt_cache(path, tmp_path / "s.safetensors")
        gc.collect()  # a file left open warns (ResourceWarning) when it is collected
    assert r.model == ref and [str(w.message) for w in seen] == []


def test_a_full_disk_names_the_file_and_leaves_nothing(wide, tmp_path, monkeypatch):
    _, _, carts = wide

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(promptfile, "save_prompt_cache", full)
    out = tmp_path / "x.safetensors"
    with pytest.raises(WriteError) as e:
        cartridge.export_prompt_cache(carts["fp16"], out)
    assert str(e.value) == f"cannot write {out}: No space left on device"
    assert list(tmp_path.iterdir()) == []
