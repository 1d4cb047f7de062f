"""Every text family of the installed mlx-lm (issue 17): passes the matrix against a fresh mlx-lm
prefill (tests/helpers/family_models.py) or is refused before any prefill with one line. The families named in
the issue run by default; the rest are marked `families` (`make test-families`: `make test` leaves them out
to stay under 15 minutes). docs/models.json (written by
scripts/family_table.py from the same checks) must agree with what each family does now.
"""

import importlib
import json
import shutil

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from helpers import ROOT
from helpers.family_models import DOC, PAGE, WINDOW, _check, check_family, families, make_model
from mlx_lm.models.cache import ArraysCache, CacheList, QuantizedKVCache

import cartridge
from cartridge.storage import kinds
from cartridge.cli.report import inspect_dict, inspect_table, layer_rows
from cartridge.attention.caches import CartridgeCache
from cartridge.attention.pages import make_prefix
from cartridge.errors import InputError
from cartridge.format.reader import open_cartridge, verify_cartridge
from cartridge.models.families import plan_layers
from cartridge.models.loader import LoadedModel, fingerprint
from cartridge.tiers import get_tier

FAST = {"llama", "qwen3", "qwen3_moe", "qwen3_next", "gemma2", "gemma3_text", "gpt_oss", "deepseek_v3", "lfm2",
        "mamba2", "falcon_h1", "minimax_m3_vl"}  # minimax_m3_vl: a CacheList of one cache
build_module = importlib.import_module("cartridge.write.build")
RECORDED = {r["family"]: r for r in json.loads((ROOT / "docs" / "models.json").read_text())["families"]}


def _params():
    """Named families run by default; a family recorded as failing or unchecked is a strict xfail, so
    fixing it (or a tiny config for it) fails the run until docs/models.json is regenerated."""
    out = []
    for n in families():
        marks = [] if n in FAST else [pytest.mark.families]
        status = RECORDED.get(n, {}).get("status")
        if status in ("FAIL", "no tiny model"):
            marks.append(pytest.mark.xfail(strict=True, reason=f"{status}: {RECORDED[n]['detail'][:100]}"))
        out.append(pytest.param(n, marks=marks))
    return out


@pytest.mark.parametrize("name", _params())
def test_family_passes_or_is_refused_in_one_line(name, smol_tokenizer, tmp_path):
    row = check_family(name, smol_tokenizer, tmp_path)
    assert row["status"] in ("pass", "refused"), row
    if row["status"] == "refused":
        assert "\n" not in row["detail"] and row["detail"].startswith(f"model family {name}"), row
    assert RECORDED.get(name, {}).get("status") == row["status"], "docs/models.json is stale: run scripts/family_table.py"


def test_every_installed_family_is_in_the_table():
    assert sorted(RECORDED) == families()


def test_refused_family_leaves_nothing_and_never_prefills(smol_tokenizer, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(build_module, "prefill", lambda *a, **k: calls.append(a))
    lm = make_model("falcon_h1", smol_tokenizer)
    n = lm.model.args.num_hidden_layers  # a cache kind a cartridge cannot store, inside the model's CacheLists
    monkeypatch.setattr(lm.model, "make_cache", lambda: [CacheList(ArraysCache(2), QuantizedKVCache()) for _ in range(n)])
    with pytest.raises(InputError, match="^model family falcon_h1 uses QuantizedKVCache caches inside CacheLists; "
                                         "a cartridge stores KVCache, RotatingKVCache"):
        cartridge.build(DOC, tmp_path / "x.cart", model=lm)
    assert calls == [] and list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def baichuan(smol_tokenizer):
    """baichuan_m1 with random convolution weights: its own init (zeros) makes K = V = 0 and leaves the
    convolution state of its CacheLists unused."""
    lm = make_model("baichuan_m1", smol_tokenizer)
    mx.random.seed(3)
    for layer in lm.model.model.layers:
        attn = layer.self_attn
        attn.conv_k, attn.conv_v = mx.random.normal(attn.conv_k.shape), mx.random.normal(attn.conv_v.shape)
    return LoadedModel(lm.model, smol_tokenizer, "tiny-baichuan_m1", fingerprint(lm.model, smol_tokenizer))


def test_list_layers_store_each_cache_as_its_kind(baichuan, tmp_path):
    """CacheList(ArraysCache, RotatingKVCache | KVCache) per layer: state, window and page-attended caches."""
    row = _check(baichuan, {"family": "baichuan_m1", "status": "FAIL", "detail": "", "kinds": ""}, tmp_path)
    assert row["status"] == "pass", row
    path = tmp_path / "fp16.cart"
    info, _ = open_cartridge(path)
    assert info.format_version == "1.11" and {m.kind for m in info.layers} == {"list"}
    assert [[u.kind for u in m.parts] for m in info.layers] == [["state", "window"], ["state", "attention"]] * 2
    assert verify_cartridge(path).ok
    header = {k: json.loads(v) for k, v in info.records.items() if k != "tokens.ids" and not k.endswith((".pages", ".head_sums"))}
    jsonschema.validate(header, json.loads((ROOT / "spec" / "header.schema.json").read_text()))
    rows = layer_rows(info)
    assert [c["kind"] for c in rows[1]["caches"]] == ["state", "attention"] and rows[0]["caches"][1]["tokens"] == WINDOW
    assert "caches: state recurrent state" in inspect_table(inspect_dict(info, path))


def test_each_prompt_cache_gets_its_own_list_of_caches(baichuan, tmp_path):
    cart = cartridge.load(cartridge.build(DOC, tmp_path / "b.cart", model=baichuan).path, model=baichuan)
    q = mx.array([cart.question_prompt("Is a pet allowed?")])
    first = cart.prompt_cache()
    assert all(isinstance(c, CacheList) for c in first)
    want = baichuan.model(q, cache=cart.prompt_cache())
    for n in (WINDOW + 1, 1, 1, 1):  # steps write the window in place and replace the convolution state
        baichuan.model(q[:, :n], cache=first)
    np.testing.assert_array_equal(np.array(baichuan.model(q, cache=cart.prompt_cache())), np.array(want))
    cart.reset(first)
    np.testing.assert_array_equal(np.array(baichuan.model(q, cache=first)), np.array(want))


def test_header_and_pages_disagreeing_is_refused_at_build(smol_tokenizer, tmp_path, monkeypatch):
    lm = make_model("qwen3", smol_tokenizer)
    real = kinds.write_kv
    monkeypatch.setattr(kinds, "write_kv", lambda writer, path, plan, kv, *rest:
                        real(writer, path, plan, tuple(x[:, :, :16] for x in kv), *rest))
    with pytest.raises(InputError, match=r"^layer 0 k: the cache holds \(2, \d+, 16\); the header would say \(2, \d+, 32\)"):
        cartridge.build(DOC, tmp_path / "x.cart", model=lm)
    assert list(tmp_path.iterdir()) == []


def test_a_layer_whose_kv_another_layer_attends_over_is_dense(smol_tokenizer):
    """gemma4's last layers attend over the K/V of the last earlier layer of their type: that layer is
    "dense" (its cache hands out the whole K/V); the other full-attention layer stays on its pages."""
    lm = make_model("gemma4_text", smol_tokenizer, num_hidden_layers=6,
                    layer_types=["sliding_attention", "full_attention"] * 3)
    kinds = [p.kind for p in plan_layers(lm.model, smol_tokenizer.encode(DOC))]
    assert kinds == ["window", "attention", "window", "dense"]


@pytest.fixture(scope="module")
def gemma3(smol_tokenizer):
    return make_model("gemma3_text", smol_tokenizer)


def test_window_layer_bytes_grow_with_the_window_not_the_document(gemma3, tmp_path):
    short = cartridge.build(DOC, tmp_path / "s.cart", model=gemma3, page_size=PAGE)
    long = cartridge.build(DOC * 3, tmp_path / "l.cart", model=gemma3, page_size=PAGE)
    (a, _), (b, _) = open_cartridge(short.path), open_cartridge(long.path)
    kinds = [m.kind for m in a.layers]
    assert kinds == ["window", "attention"] * 2
    for i, kind in enumerate(kinds):
        held = [(m.start, m.count) for m in (a.layers[i], b.layers[i])]
        size = [sum(e.page_bytes * e.shape[0] for e in info.extents[(i, "k")]) for info in (a, b)]
        if kind == "window":
            assert held == [(short.tokens - WINDOW, WINDOW), (long.tokens - WINDOW, WINDOW)]
            assert size[0] == size[1] == 2 * PAGE * 32 * 2  # one page: 2 heads x 32 tokens x 32 fp16
        else:
            assert held == [(0, short.tokens), (0, long.tokens)] and size[1] > 2 * size[0]


def test_each_prompt_cache_gets_its_own_window_and_state(smol_tokenizer, tmp_path):
    for name in ("gemma3_text", "lfm2"):
        lm = make_model(name, smol_tokenizer)
        cart = cartridge.load(cartridge.build(DOC, tmp_path / f"{name}.cart", model=lm).path, model=lm)
        q = mx.array([cart.question_prompt("Is a pet allowed?")])
        first = cart.prompt_cache()
        want = lm.model(q, cache=cart.prompt_cache())
        for n in (WINDOW + 1, 1, 1, 1):  # generation mutates the first cache: a one-token step writes
            lm.model(q[:, :n], cache=first)    # into the rotating window in place; the state is replaced
        np.testing.assert_array_equal(np.array(lm.model(q, cache=cart.prompt_cache())), np.array(want))
        shutil.rmtree(tmp_path / f"{name}.cart")


@pytest.mark.parametrize("n_q, n_kv, L", [(4, 2, 1), (6, 2, 3), (8, 8, 5)])
def test_sinks_are_one_more_logit_per_head(n_q, n_kv, L):
    """Prefix pages + dense tail with sinks equal mlx's fused attention with sinks over the whole K/V."""
    mx.random.seed(n_q + L)
    T, D = 37, 32
    k, v = mx.random.normal((n_kv, T, D)), mx.random.normal((n_kv, T, D))
    tail_k, tail_v = mx.random.normal((1, n_kv, L, D)), mx.random.normal((1, n_kv, L, D))
    q, sinks = mx.random.normal((1, n_q, L, D)), mx.random.normal((n_q,)) * 3
    fp16 = get_tier("fp16")
    cache = CartridgeCache(make_prefix(fp16, k, fp16, v, page_size=16))
    cache.update_and_fetch(tail_k, tail_v)
    got = cache.attention(q, D ** -0.5, "causal" if L > 1 else None, sinks)
    keys = mx.concatenate([k.astype(mx.float16).astype(mx.float32)[None], tail_k], axis=2)
    values = mx.concatenate([v.astype(mx.float16).astype(mx.float32)[None], tail_v], axis=2)
    mask = mx.arange(T + L)[None] <= mx.arange(T, T + L)[:, None]
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5, mask=mask, sinks=sinks)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    without = cache.attention(q, D ** -0.5, "causal" if L > 1 else None)
    assert not np.allclose(np.array(without), np.array(got), atol=1e-3)  # the sinks did something
