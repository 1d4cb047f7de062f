"""Calibration of models with sliding-window layers (issue 47 item 4, calibration version 4): every layer the
cartridge stores is measured, a window layer on the tokens its window stores (spec/FORMAT.md 4.7)."""

import json

import mlx.core as mx
import pytest
from helpers import ROOT
from helpers.family_models import WINDOW, make_model
from mlx_lm.models.base import create_causal_mask

import cartridge
from cartridge.storage.kinds import KINDS, kv_layer_plan
from cartridge.write.prefill import prefill_holding
from cartridge.calibrate import CalibrationTarget, forwards, measure, search, sequence
from cartridge.calibrate.attention_error import AttentionError
from cartridge.cli.report import calibration_lines
from cartridge.errors import CalibrationUnsupportedError, InputError
from cartridge.format import keys as K
from cartridge.models.prompt import prefix_tokens, prompt_mode
from cartridge.tiers import TIERS

DOC = ("The lease runs from March 1, 2024 to February 28, 2026. The tenant pays 1,450 euros each month, due on the "
       "fifth day. Pets are allowed with a deposit of 300 euros. The landlord repairs the heating. ") * 3
LAYERS, PATTERN = 6, 6  # gemma3's pattern: layers 0-4 slide over WINDOW tokens, layer 5 attends to all


@pytest.fixture(scope="module")
def gemma3(smol_tokenizer):
    return make_model("gemma3_text", smol_tokenizer, num_hidden_layers=LAYERS, sliding_window_pattern=PATTERN)


@pytest.fixture(scope="module")
def measured(gemma3):
    """The measurement of DOC as a build makes it: prefilled in two parts, the window layers held at the split."""
    mode = prompt_mode(gemma3.tokenizer)
    tokens = prefix_tokens(gemma3.tokenizer, DOC, mode)
    caches, held = prefill_holding(gemma3.model, tokens)
    return tokens, caches, measure.measure(gemma3.model, gemma3.tokenizer, mode, caches, tokens, held=held)


def test_a_model_of_window_layers_gets_a_measured_schema_and_inspect_says_which_layers(gemma3, tmp_path):
    import warnings

    import jsonschema
    from click.testing import CliRunner

    from cartridge.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no CalibrationFallbackWarning: measured, not the fixed recipe
        r = cartridge.build(DOC, tmp_path / "b.cart", model=gemma3, reserve=0, page_size=32, preset="balanced")
    c = r.calibration
    info, _ = cartridge.open_cartridge(r.path)
    assert [m.kind for m in info.layers] == ["window"] * 5 + ["attention"]
    assert (c["calibration_version"], c["measured_layers"], c["window_layers"]) == (4, LAYERS, [0, 1, 2, 3, 4])
    per_layer = 2 * TIERS["fp16"].bytes_per_token(2, 32)  # K + V of one layer, kv heads 2, head_dim 32
    assert (c["fp16_bytes_per_token"], c["fp16_window_bytes_per_token"]) == (per_layer, 5 * per_layer)
    assert c["bytes_per_token"] <= per_layer // 3 and c["window_bytes_per_token"] <= 5 * per_layer // 3
    assert c["bytes_per_token"] == r.bytes_per_token == info.bytes_per_token()
    window_bytes = sum(TIERS[row[s]].bytes_per_token(2, 32) for row in info.tiers[:5] for s in "kv")
    assert c["window_bytes_per_token"] == window_bytes and info.tiers == r.schema
    assert {"int8", "int6", "mlx4g32"} <= set(c["candidates"])  # plain tiers are measured beside rotated ones
    schema = json.loads((ROOT / "spec" / "header.schema.json").read_text())
    jsonschema.validate(json.loads(info.records[K.CALIBRATION]), schema["properties"][K.CALIBRATION])
    out = CliRunner().invoke(main.cli, ["inspect", r.path]).output
    assert ("measured      all 6 layers: 5 sliding-window (0-4) on the tokens their window stores, "
            "1 full-attention (5)\n") in out
    ratio = c["fp16_window_bytes_per_token"] / c["window_bytes_per_token"]
    assert f"sliding-window layers {c['window_bytes_per_token']:,} bytes per stored token ({ratio:.2f}x)" in out


def test_window_layers_are_measured_on_the_tokens_their_window_stores(gemma3, measured):
    from mlx_lm.models.cache import make_prompt_cache

    tokens, caches, sens = measured
    probe, split = sens.probe, sens.probe.split
    assert split < len(tokens) and probe.windows == [WINDOW] * 5 + [None]
    fresh = make_prompt_cache(gemma3.model)  # mlx-lm alone on the tokens before the split: what a cartridge stores
    gemma3.model(mx.array(tokens[:split], dtype=mx.uint32)[None], cache=fresh)
    for j, cache in enumerate(fresh):
        kind = KINDS["window" if probe.windows[j] else "attention"]
        for got, want in zip(probe.kv[j], kind.stored_kv(cache, split)):
            assert got.shape[2] == (min(split, WINDOW) if probe.windows[j] else split)
            assert mx.allclose(got[0], measure.fp16_rounded(want), atol=1e-3).item()
    with pytest.raises(CalibrationUnsupportedError, match="window no longer holds the tokens"):
        sequence.prefix_kv(caches, split)  # the caches went on past the split: their windows moved
    whole = make_prompt_cache(gemma3.model)  # one forward of every token: mlx-lm's windows keep all of them
    gemma3.model(mx.array(tokens, dtype=mx.uint32)[None], cache=whole)
    kv, windows = sequence.prefix_kv(whole, split)
    assert windows == probe.windows
    for got, want in zip(kv, probe.kv):
        assert all(mx.allclose(measure.fp16_rounded(x), y, atol=1e-3).item() for x, y in zip(got, want))


def test_the_walk_measures_a_window_layer_as_the_models_own_forward_over_its_replaced_window(gemma3, measured):
    _, _, sens = measured
    probe = sens.probe
    for j in (0, 4, 5):  # window layers and the full-attention layer
        kv = list(probe.kv)
        kv[j] = tuple(measure.round_trip(measure.REFERENCE_TIER, x, j, s) for x, s in zip(kv[j], "kv"))
        caches = [sequence.filled_cache(k, v, w, probe.split) for (k, v), w in zip(kv, probe.windows)]
        logits = gemma3.model(probe.ids, cache=caches)[0].astype(mx.float32)  # mlx-lm's own masks and caches
        one = measure.kl_mean(probe.logprobs, logits)
        assert sens.measured[j] == pytest.approx(one, rel=2e-2) and one > 0  # the walk's LM head: see test_calibrate
    for side in "kv":  # no query sees a window layer's oldest stored key: its replacement changes nothing
        k, v = probe.kv[0]
        x = k if side == "k" else v
        moved = mx.concatenate([x[:, :, :1] + 1.0, x[:, :, 1:]], axis=2)
        error = AttentionError(probe.queries[0], k, v, None, WINDOW)
        assert error(side, moved)[0].item() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("window", [None, 5, 40])
def test_the_walk_cache_attends_like_mlx_within_the_window(window):
    from cartridge.attention.caches import SharedPrefixCache

    mx.random.seed(5)
    rows, n_kv, g, s, e, d, position = 3, 2, 3, 37, 9, 16, 100  # the window's last 37 tokens of 100
    k, v, k2, v2 = (mx.random.normal((1, n_kv, s, d)) for _ in range(4))
    q = mx.random.normal((rows, n_kv * g, e, d))
    own_k, own_v = (mx.random.normal((rows, n_kv, e, d)) for _ in range(2))
    cache = SharedPrefixCache(k, v, k2, v2, 1, position, window)
    keys, values = cache.update_and_fetch(own_k, own_v)
    got = cache.attention(q, keys, values, 0.3, "causal")
    assert cache.offset == position + e and cache.scale == 0.3
    mask = create_causal_mask(e, s, window_size=window)  # (E, S + E): the stored keys, then E's own
    for r in range(rows):
        pk, pv = (k2, v2) if r == rows - 1 else (k, v)
        want = mx.fast.scaled_dot_product_attention(q[r:r + 1], mx.concatenate([pk, own_k[r:r + 1]], axis=2),
                                                    mx.concatenate([pv, own_v[r:r + 1]], axis=2), scale=0.3, mask=mask)
        assert mx.allclose(got[r:r + 1], want, atol=1e-5).item()


@pytest.mark.parametrize("side", ["k", "v"])
def test_a_window_layers_attention_error_is_that_of_the_queries_that_see_its_keys(side):
    mx.random.seed(3)
    h, n_kv, e, s, d, window = 6, 2, 12, 20, 16, 8
    q, k, v = mx.random.normal((h, e, d)), mx.random.normal((1, n_kv, s, d)), mx.random.normal((1, n_kv, s, d))
    x2 = (k if side == "k" else v) + 0.1 * mx.random.normal(k.shape)
    visible = create_causal_mask(e, s, window_size=window)[:, :s]  # (E, S): the prefix part of mlx-lm's mask
    seen = window - 1  # query i sees a stored key only when i < window - 1

    def out(keys, values):  # (n_heads, E', D) over the stored keys alone, GQA groups of 3 heads per KV head
        kk, vv = (mx.repeat(x, h // n_kv, axis=1) for x in (keys, values))
        return mx.fast.scaled_dot_product_attention(q[None, :, :seen], kk, vv, scale=0.25, mask=visible[:seen])[0]

    o, o2 = out(k, v), out(*((x2, v) if side == "k" else (k, x2)))
    want = (((o2 - o) ** 2).sum() / (o ** 2).sum()).item()
    assert AttentionError(q, k, v, 0.25, window)(side, x2)[0].item() == pytest.approx(want, rel=1e-4)


def test_a_byte_budget_bounds_each_part_and_a_kl_bound_takes_the_least_stored_bytes():
    shapes = {"k": (2, 64), "v": (2, 64)}
    b8, b4, b2 = (TIERS[t].bytes_per_token(2, 64) for t in ("int8", "mlx4g32", "turbo2"))  # 144, 80, 36
    kl = {(layer, s, t): x for layer in (0, 1) for s in "kv"
          for t, x in {"fp16": 0.0, "int8": 0.001, "mlx4g32": 0.01, "turbo2": 0.1}.items()}
    parts = ([0], [1])  # layer 0 stores every token, layer 1 a window
    full, window = search.choose_parts(kl, parts, shapes, bounds=[2 * b4, 2 * b2])
    assert (full.schema, window.schema) == ([{"layer": 0, "k": "mlx4g32", "v": "mlx4g32"}],
                                            [{"layer": 1, "k": "turbo2", "v": "turbo2"}])
    with pytest.raises(InputError, match=f"budget 10 bytes/token of the sliding-window layers is "
                                                          f"below the cheapest measured schema .{2 * b2}"):
        search.choose_parts(kl, parts, shapes, bounds=[2 * b4, 10])
    # the window layer's bytes are stored 10 times, the other layer's 1,000 times: the KL bound goes to the full
    # layer's cheaper tiers (int8 + mlx4g32: 0.011 nats) and the window layer stays fp16
    full, window = search.choose_parts(kl, parts, shapes, max_kl=0.0115, tokens=(1000, 10))
    assert {full.schema[0]["k"], full.schema[0]["v"]} == {"int8", "mlx4g32"}
    assert window.schema == [{"layer": 1, "k": "fp16", "v": "fp16"}]
    full, window = search.choose_parts(kl, parts, shapes, max_kl=0.0115, tokens=(10, 1000))  # the other way round
    assert full.schema == [{"layer": 0, "k": "fp16", "v": "fp16"}] and window.bytes_per_token == b8 + b4
    assert CalibrationTarget(preset="balanced").check().bounds([3072, 15360]) == [1024, 5120]
    assert CalibrationTarget(max_bytes_per_token=1000).check().bounds([3072, 15360]) == [1000, 5000]  # the same share
    assert CalibrationTarget(max_bytes_per_token=1000).check().bounds([0, 15360]) == [0, 1000]  # only window layers
    assert CalibrationTarget(max_kl=0.1).check().bounds([3072, 15360]) is None


def test_a_record_written_before_version_4_still_loads_and_inspect_says_all_layers_were_full_attention(
        tiny, tmp_path):
    from click.testing import CliRunner

    from cartridge.write.encode import kv_caches, write_layers
    from cartridge.write.prefill import prefill
    from cartridge.cli import main
    from cartridge.tiers import schema_for

    old = {"target": {"preset": "balanced"}, "bytes_per_token": 320, "fp16_bytes_per_token": 1024,
           "predicted_kl": 0.01, "measured_kl": 0.012, "top1_agreement": 0.9, "eval_tokens": 58,
           "measured_layers": 2, "calibration_version": 3}
    mode = prompt_mode(tiny.tokenizer)
    tokens = prefix_tokens(tiny.tokenizer, DOC, mode)
    caches = prefill(tiny.model, tokens)
    plans = [kv_layer_plan("attention", c) for c in caches]
    path = write_layers(tmp_path / "old.cart", tiny, tokens, kv_caches((c.keys, c.values) for c in caches),
                        schema_for(2), plans, 64, mode, source={K.CALIBRATION: old})
    cart = cartridge.load(path, model=tiny)
    assert json.loads(cart.info.records[K.CALIBRATION]) == old
    out = CliRunner().invoke(main.cli, ["inspect", str(path)]).output
    assert "measured      all 2 layers (full attention; calibration version 3)\n" in out
    assert "calibrated    --preset balanced: 320 bytes/token (3.20x smaller than fp16), predicted KL" in out
    v1 = {k: x for k, x in old.items() if k not in ("measured_layers", "calibration_version")}
    assert calibration_lines(v1, 30)[1] == "measured      all 30 layers (full attention; calibration version 1)"


def test_a_budget_below_the_window_layers_cheapest_schema_is_refused_before_the_prefill():
    from cartridge.storage.kinds import LayerPlan
    from cartridge.calibrate import check_reachable

    plans = [LayerPlan("window", (2, 64), (2, 64), window=WINDOW)] * 2  # window layers only
    least = 2 * 2 * TIERS["turbo2"].bytes_per_token(2, 64)
    with pytest.raises(InputError, match=f"budget 32 bytes/token of the sliding-window layers is below the "
                                         f"cheapest measured schema .{least} bytes/token"):
        check_reachable(CalibrationTarget(target_ratio=32.0), plans)  # fp16: 1,024 bytes/token, 32 asked
    check_reachable(CalibrationTarget(target_ratio=4.5), plans)  # within reach: no error


def test_eval_of_a_base_model_without_a_chat_template_asks_plain_questions_and_measures_its_presets(
        smol_tokenizer, tmp_path):
    import copy

    from cartridge.eval.evaluate import EvalConfig, evaluate
    from cartridge.eval.spec import parse_tiers
    from cartridge.models.prompt import PLAIN

    tok = copy.deepcopy(smol_tokenizer)
    tok._tokenizer.chat_template = None  # a base model: "Question: ...\nAnswer:" after the document (spec 5.4)
    lm = make_model("gemma3_text", tok, num_hidden_layers=LAYERS, sliding_window_pattern=PATTERN)
    assert prompt_mode(lm.tokenizer) == PLAIN
    config = EvalConfig(max_tokens=4, fresh=False, heldout="The deposit is returned within a month.",
                        work_dir=tmp_path, page_size=32)
    report = evaluate(DOC, [{"id": 1, "question": "How much is the rent?"}], model=lm, config=config,
                      specs=parse_tiers("int8+rot,preset=balanced,mlx4g32"))
    rows = {r["label"]: r for r in report["rows"]}
    assert list(rows) == ["fp16", "int8+rot", "preset=balanced", "mlx4g32"]
    balanced = cartridge.open_cartridge(rows["preset=balanced"]["qa_cartridge"]["path"])[0]
    assert balanced.prompt_mode == PLAIN and rows["preset=balanced"]["build_kl"] >= 0  # measured, not the recipe
    assert json.loads(balanced.records[K.CALIBRATION])["window_layers"] == [0, 1, 2, 3, 4]
    assert rows["mlx4g32"]["build_kl"] is None and rows["mlx4g32"]["compression"] == pytest.approx(3.2)
    assert all(len(r["answers"]) == 1 and r["answers"][0]["tokens"] for r in rows.values())


def test_a_family_the_walk_cannot_run_is_measured_by_its_own_forwards(smol_tokenizer, tmp_path):
    lm = make_model("gpt_oss", smol_tokenizer)  # attention sinks and sliding windows
    r = cartridge.build(DOC, tmp_path / "b.cart", model=lm, reserve=0, page_size=32, preset="balanced",
                        k_encoder="nearest", k_scale=False)  # the KL recomputed below round-trips by nearest rounding
    c = r.calibration
    assert (c["method"], c["window_layers"], c["forwards"]) == ("forwards", [0, 2], 8 + 2 * 4 + 1)
    assert calibration_lines(c)[1] == ("measured      all 4 layers: 2 sliding-window (0, 2) on the tokens their window "
                                       "stores, 2 full-attention (1, 3); by the model's own forward per layer-side")
    # the recorded KL of the chosen schema is that of the model's own forward over the replaced K/V
    mode = prompt_mode(lm.tokenizer)
    tokens = prefix_tokens(lm.tokenizer, DOC, mode)
    caches, held = prefill_holding(lm.model, tokens)
    sens = forwards.measure(lm.model, lm.tokenizer, mode, caches, tokens, measure.CANDIDATES, held=held)
    probe = sens.probe
    kv = [tuple(measure.round_trip(row[s], x, row["layer"], s) if row[s] != "fp16" else x
                for s, x in zip("kv", pair)) for row, pair in zip(r.schema, probe.kv)]
    logits = sequence.own_logits(lm.model, probe.ids, kv, probe.windows, probe.split)
    assert c["measured_kl"] == pytest.approx(measure.kl_mean(probe.logprobs, logits), rel=1e-3, abs=1e-6)
    for j in range(4):  # each side's measured KL, shared between the tiers by their reconstruction error
        ref = sens.kl[(j, "k", measure.REFERENCE_TIER)]
        errors = sens.attn_err
        assert sens.kl[(j, "k", "turbo2")] == pytest.approx(
            ref * errors[(j, "k", "turbo2")] / errors[(j, "k", measure.REFERENCE_TIER)], rel=1e-6)
