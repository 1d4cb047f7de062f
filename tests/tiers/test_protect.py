"""Protected tokens (`cartridge.tiers.protect`, spec/FORMAT.md 4.5.4), kivi4 (6.5) and presets: the stored
fp16 copies are the model's K/V, attention over compressed pages + copies equals dense attention over
the decoded pages with those positions replaced, on the portable and dequantize-once paths."""

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny_models import make_tiny
from helpers.dense_caches import dense_reference

import cartridge
from cartridge.attention.backends import device
from cartridge.write.prefill import prefill
from cartridge.errors import FieldError, InputError
from cartridge.format.container import read_index, read_manifest
from cartridge.format.header import LayerInfo
from cartridge.tiers import TIERS, presets, protect

DOC = ("The warranty on the Model 7 kettle lasts 24 months from the date of purchase. "
       "Claims are sent to Kettle Co, 12 Harbour Road. ") * 8


@pytest.fixture(scope="module")
def tiny64(smol_tokenizer):
    return make_tiny(smol_tokenizer, seed=0, head_dim=64)


def test_protected_copies_are_the_models_kv_in_fp16(tiny64, tmp_path):
    r = cartridge.build(DOC, tmp_path / "p.cart", model=tiny64, reserve=0, tier="mlx4g32+rot", protect_first=3,
                        protect_last=5, page_size=64)
    info, _ = cartridge.open_cartridge(r.path)
    assert (info.format_version, info.protect_first, info.protect_last) == ("1.11", 3, 5)
    caches = prefill(tiny64.model, info.tokens.tolist())
    for layer, c in enumerate(caches):
        for side, x in (("k", c.keys), ("v", c.values)):
            x = np.array(x[0, :, : r.tokens].astype(mx.float16))  # (n_kv, T, D)
            want = np.concatenate([x[:, :3], x[:, -5:]], axis=1)
            np.testing.assert_array_equal(info.protected[(layer, side)], want)
    records = read_index(r.path, read_manifest(r.path))
    assert json.loads(records["cache.protect_first"]) == 3 and len(records["layer.0.k.protected"]) == 2 * 2 * 8 * 64
    fp16 = 2 * 2 * 2 * 2 * 64
    assert r.bytes_per_token == 2 * 2 * 80 + round(8 * fp16 / r.tokens) == info.bytes_per_token()  # kv_dim 128


def _load(path, model, policy):
    """The cartridge under `policy`; "question-prefill": every multi-token call takes the path that decodes the
    layer's pages for the call (kernels/dense.py, the fused layer's path for many query rows), on any backend."""
    if policy != "question-prefill":
        return cartridge.load(path, model=model, attention=policy)
    from cartridge.attention.kernels import cuda_inputs
    from cartridge.attention.kernels.cuda_tuning import TUNING

    cart = cartridge.load(path, model=model, attention="portable")
    every_call = replace(TUNING, dense_min_rows={}, dense_min_rows_other=1, decoded_min_rows=1)
    cart.prefixes = [replace(p, backend=cuda_inputs.lay_out(p, every_call)) for p in cart.prefixes]
    return cart


@pytest.mark.parametrize("policy", ["portable", "dequantize-once", "question-prefill", "fused"])
@pytest.mark.parametrize("options", [
    {"tier": "mlx4g32", "protect_first": 4, "protect_last": 32},
    {"tier": "mlx4g32+rot", "protect_first": 0, "protect_last": 7},
    {"tier": "turbo3", "protect_first": 70, "protect_last": 0},  # N beyond the first page
    {"k_tier": "kivi4", "v_tier": "nvfp4+rot", "protect_first": 2, "protect_last": 2},
    {"preset": "balanced"}, {"preset": "compact"}, {"preset": "safe"},
])
def test_attention_equals_dense_attention_over_decoded_and_protected(tiny64, tmp_path, options, policy):
    if policy == "fused" and device() != "cuda":
        pytest.skip("the fused kernels need the CUDA backend (run with DEVICE=gpu on an NVIDIA GPU)")
    r = cartridge.build(DOC, tmp_path / "a.cart", model=tiny64, reserve=0, page_size=64, **options)
    cart = _load(r.path, tiny64, policy)
    q = cart.question_prompt("How long does the warranty last?")
    cache = cart.prompt_cache()
    got = cart.model(mx.array(q)[None], cache=cache)[0]
    want = cart.model(mx.array(q)[None], cache=dense_reference(cartridge.load(r.path, model=tiny64,
                                                                              attention="portable")))[0]
    # on a GPU both sides' float32 matmuls run at reduced precision (measured on an H200: 3.3e-3 between the
    # portable path and its reference, benchmarks/results/h200-kernel-tests-protect.log)
    tol = 1e-4 if device() == "cpu" else 2e-2
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=tol, atol=tol)
    step = cart.model(mx.array([int(mx.argmax(got[-1]))])[None], cache=cache)  # one decode step after
    assert np.isfinite(np.array(step)).all()


def test_protection_is_clamped_to_leave_one_token_in_the_pages(tiny64, tmp_path):
    r = cartridge.build("Short.", tmp_path / "s.cart", model=tiny64, tier="mlx4g32", protect_first=5000,
                        protect_last=9, page_size=64)
    info, _ = cartridge.open_cartridge(r.path)
    assert (info.protect_first, info.protect_last) == (r.tokens - 1, 0)


@pytest.mark.parametrize("first, last", [(-1, 0), (0, 1.5), (True, 0), (0, 70000)])
def test_bad_protect_counts_are_refused_before_prefill(tiny64, tmp_path, first, last):
    with pytest.raises(InputError, match="protect_"):
        cartridge.build(DOC, tmp_path / "b.cart", model=tiny64, reserve=0, protect_first=first, protect_last=last)
    assert not (tmp_path / "b.cart").exists()


def test_reader_refuses_a_protected_record_of_the_wrong_length():
    attention = LayerInfo("attention", (1, 4), (1, 4), 0, 10)
    records = {"cache.protect_first": b"2", "cache.protect_last": b"1", "layer.0.k.protected": bytes(12)}
    with pytest.raises(FieldError, match="'layer.0.k.protected': 12 bytes, expected 24"):
        protect.read(records, [attention], 10)
    with pytest.raises(FieldError, match="is 10; allowed 0..9"):
        protect.read({"cache.protect_first": b"10"}, [attention], 10)
    assert protect.read({}, [attention] * 3, 10) == (0, 0, {})


def test_only_layers_that_store_every_token_hold_protected_copies():
    """A window layer (its last `window` tokens only) has no protected record; a dense layer's copies
    follow its own shapes (format 1.5, spec 4.5.4)."""
    window = LayerInfo("window", (1, 4), (1, 4), 6, 4)
    dense = LayerInfo("dense", (1, 8), (2, 4), 0, 10)
    records = {"cache.protect_first": b"1", "cache.protect_last": b"0",
               "layer.1.k.protected": bytes(16), "layer.1.v.protected": bytes(16)}
    first, last, arrays = protect.read(records, [window, dense], 10)
    assert (first, last, sorted(arrays)) == (1, 0, [(1, "k"), (1, "v")])
    assert (arrays[(1, "k")].shape, arrays[(1, "v")].shape) == ((1, 1, 8), (2, 1, 4))


def test_kivi4_groups_run_along_tokens_with_at_most_half_a_step_error():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 64, 64)).astype(np.float32) * np.linspace(0.1, 20, 64)  # per-channel ranges
    codec = TIERS["kivi4"]
    params = codec.make_params(None, 0, "k")
    parts = codec.encode(mx.array(x), params)
    assert parts["scales"].shape == (2, 64, 2) and parts["codes"].shape == (2, 64, 8)
    # channel c of token group g: scale on row g*32 + c // 2, column c % 2
    scales = np.array(parts["scales"]).astype(np.float32).reshape(2, 2, 64)  # (n_kv, groups, D)
    err = np.abs(np.array(codec.decode(parts, params)) - x).reshape(2, 2, 32, 64)
    assert (err <= scales[:, :, None, :] / 2 * (1 + 1e-5) + 1e-6).all()
    lo = x.reshape(2, 2, 32, 64).min(axis=2)
    assert (np.array(parts["biases"]).astype(np.float32).reshape(2, 2, 64) <= lo).all()
    kivi = np.abs(err).mean()
    g = TIERS["mlx4g32"]
    assert kivi < np.abs(np.array(g.decode(g.encode(mx.array(x), {}), {})) - x).mean()


def test_kivi4_refuses_pages_of_partial_token_groups(tiny64, tmp_path):
    with pytest.raises(InputError, match="page size 48 is not a multiple of its token group 32"):
        cartridge.build(DOC, tmp_path / "k.cart", model=tiny64, reserve=0, k_tier="kivi4", page_size=48)


def test_presets_resolve_to_a_stored_schema_and_exclude_tier_options(tiny64, tmp_path):
    r = cartridge.build(DOC, tmp_path / "c.cart", model=tiny64, reserve=0, preset="compact", page_size=64,
                        calibrate=False)
    info, _ = cartridge.open_cartridge(r.path)
    want = presets.resolve("compact")
    assert info.tiers == [{"layer": i, "k": want["k_tier"], "v": want["v_tier"]} for i in range(2)]
    assert (info.protect_first, info.protect_last) == (want["protect_first"], want["protect_last"])
    with pytest.raises(InputError, match="cannot be combined with tier, protect_last"):
        cartridge.build(DOC, tmp_path / "d.cart", model=tiny64, reserve=0, preset="safe", tier="int8", protect_last=3)
    with pytest.raises(InputError, match="unknown preset 'tiny'"):
        cartridge.build(DOC, tmp_path / "d.cart", model=tiny64, reserve=0, preset="tiny")


def test_extend_refuses_a_protected_cartridge_in_one_line(tiny64, tmp_path):
    """Extend would move the last M positions away from their fp16 copies (spec 4.5.4): refused, nothing written."""
    r = cartridge.build(DOC, tmp_path / "p.cart", model=tiny64, reserve=0, tier="mlx4g32", protect_first=2,
                        protect_last=3, page_size=64)
    with pytest.raises(InputError, match="keeps 2 first and 3 last tokens in fp16; extend takes cartridges without"):
        cartridge.extend(r.path, "More text.", tmp_path / "e.cart", model=tiny64)
    assert not (tmp_path / "e.cart").exists()


def test_safe_preset_is_int8_rot_k_int6_rot_v_in_a_valid_1_6_header(tiny64, tmp_path):
    import json

    import jsonschema
    from helpers import ROOT

    from cartridge.format import keys as K
    from cartridge.format.container import read_index, read_manifest

    r = cartridge.build(DOC, tmp_path / "s.cart", model=tiny64, reserve=0, page_size=64, preset="safe",
                        calibrate=False)
    info, _ = cartridge.open_cartridge(r.path)
    assert info.format_version == "1.11" and {(t["k"], t["v"]) for t in info.tiers} == {("int8+rot", "int6+rot")}
    assert r.bytes_per_token == info.bytes_per_token() == 2 * (128 + 16 + 96 + 16)  # 2 layers, kv_dim 128
    records = read_index(r.path, read_manifest(r.path))
    header = {k: json.loads(v) for k, v in records.items()
              if k != K.TOKENS_IDS and not k.endswith((".pages", ".head_sums", ".protected"))}
    jsonschema.validate(header, json.loads((ROOT / "spec" / "header.schema.json").read_text()))
