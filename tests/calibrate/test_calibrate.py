"""Schemas chosen by measurement at build (`cartridge.calibrate`, spec/FORMAT.md 4.7, issue 33)."""

import pytest
from helpers.tiny_models import make_tiny

import cartridge
from cartridge.calibrate import PRESET_RATIOS, CalibrationTarget, parse_ratio, search
from cartridge.errors import InputError
from cartridge.format import keys as K
from cartridge.tiers import TIERS

DOC = ("The warranty on the Model 7 kettle lasts 24 months from the date of purchase. Descale it monthly "
       "with white vinegar; never immerse the base in water. The filter is dishwasher safe. ") * 3
SHAPES = {"k": (2, 64), "v": (2, 64)}  # the tiny model: kv_dim 128


@pytest.fixture(scope="module")
def tiny64(smol_tokenizer):
    return make_tiny(smol_tokenizer, seed=0, head_dim=64)


def _kl(values):
    """A (layer, side, tier) -> KL table: values[(layer, side)] = {tier: kl}, fp16 at 0."""
    return {(l, s, t): kl for (l, s), row in values.items() for t, kl in {"fp16": 0.0, **row}.items()}


def test_search_spends_the_budget_where_the_measured_damage_is():
    # layer 0 K is 10x as sensitive as anything else: within one int8 side's bytes it gets the upgrade
    kl = _kl({(0, "k"): {"int8+rot": 0.01, "turbo2": 1.0}, (0, "v"): {"int8+rot": 0.001, "turbo2": 0.1},
              (1, "k"): {"int8+rot": 0.001, "turbo2": 0.1}, (1, "v"): {"int8+rot": 0.001, "turbo2": 0.1}})
    b8, b2 = (TIERS[t].bytes_per_token(2, 64) for t in ("int8+rot", "turbo2"))  # 144, 36
    c = search.choose(kl, 2, SHAPES, max_bytes_per_token=b8 + 3 * b2)
    assert c.schema == [{"layer": 0, "k": "int8+rot", "v": "turbo2"}, {"layer": 1, "k": "turbo2", "v": "turbo2"}]
    assert (c.bytes_per_token, c.predicted_kl) == (b8 + 3 * b2, pytest.approx(0.01 + 0.3))
    least = search.choose(kl, 2, SHAPES, max_kl=0.05)  # the smallest schema under the bound: all int8+rot
    assert least.schema == [{"layer": i, "k": "int8+rot", "v": "int8+rot"} for i in range(2)]
    assert search.choose(kl, 2, SHAPES, max_kl=0.0).schema == [{"layer": i, "k": "fp16", "v": "fp16"} for i in range(2)]
    with pytest.raises(InputError, match="budget 100 bytes/token is below the cheapest measured schema .144"):
        search.choose(kl, 2, SHAPES, max_bytes_per_token=100)


def test_budgets_and_ratios():
    assert PRESET_RATIOS == {"safe": 2.0, "balanced": 3.0, "compact": 4.5}
    assert CalibrationTarget(preset="balanced").check().bounds([23040, 0]) == [7680, 0]
    assert CalibrationTarget(target_ratio=4.5).check().bounds([23040, 0]) == [5120, 0]
    assert (parse_ratio("3x"), parse_ratio(" 4.5X "), parse_ratio("2")) == (3.0, 4.5, 2.0)
    with pytest.raises(InputError, match="target ratio 'three' is not a number"):
        parse_ratio("three")
    with pytest.raises(InputError, match="give one of preset, target_ratio"):
        CalibrationTarget(target_ratio=3.0, max_kl=0.1).check()
    with pytest.raises(InputError, match="target ratio 0.5 is out of range"):
        CalibrationTarget(target_ratio=0.5).check()


def test_a_calibrated_build_stores_the_chosen_schema_its_bytes_and_measured_kl(tiny64, tmp_path):
    seen = []
    r = cartridge.build(DOC, tmp_path / "b.cart", model=tiny64, reserve=0, page_size=64, preset="balanced",
                        calibration_progress=lambda d, t: seen.append((d, t)))
    info, _ = cartridge.open_cartridge(r.path)
    rec = r.calibration
    assert info.format_version == "1.11" and seen[0] == (0, 2) and seen[-1] == (2, 2)
    assert rec["target"] == {"preset": "balanced"} and rec["fp16_bytes_per_token"] == 2 * 2 * 256
    assert rec["bytes_per_token"] <= 1024 // 3 and rec["bytes_per_token"] == r.bytes_per_token
    assert info.tiers == r.schema and rec["measured_kl"] >= 0 and 0 <= rec["top1_agreement"] <= 1
    import json
    assert json.loads(info.records[K.CALIBRATION]) == rec


def test_budget_options_are_refused_with_tiers_or_without_calibration(tiny64, tmp_path):
    with pytest.raises(InputError, match="a budget chooses the tiers; it cannot be combined with tier"):
        cartridge.build(DOC, tmp_path / "x.cart", model=tiny64, budget=CalibrationTarget(target_ratio=3.0), tier="int8")
    with pytest.raises(InputError, match="needs calibration; drop --no-calibrate"):
        cartridge.build(DOC, tmp_path / "x.cart", model=tiny64, budget=CalibrationTarget(max_kl=0.1), calibrate=False)
    with pytest.raises(InputError, match="cannot be combined with tier"):
        cartridge.build(DOC, tmp_path / "x.cart", model=tiny64, preset="compact", tier="int8")
    assert not (tmp_path / "x.cart").exists()


def test_cli_build_with_a_target_ratio_and_inspect_show_the_measured_choice(tiny64, tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from cartridge.cli import main

    monkeypatch.setattr(main, "model_ref", lambda m: None)
    real = cartridge.build
    monkeypatch.setattr(cartridge, "build", lambda *a, **kw: real(*a, **{**kw, "model": tiny64}))
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    out = tmp_path / "r.cart"
    r = CliRunner().invoke(main.cli, ["build", str(doc), "-o", str(out), "--target-ratio", "4x", "--reserve", "0",
                                      "--page-size", "64"])
    assert r.exit_code == 0, r.output
    assert "calibrated in " in r.output and "smaller than fp16, predicted KL" in r.output
    # the prefill bar is finished (drawn for the last time) before calibration's line and bar
    stderr = r.stderr
    line = stderr.index("calibrating: measuring each layer's K/V tiers on the document (--no-calibrate skips it)\n")
    assert stderr.rindex("prefill: 100%") < line < stderr.index("calibrate:   0%") < stderr.rindex("calibrate: 100%")
    c = json.loads(CliRunner().invoke(main.cli, ["inspect", str(out), "--json"]).output)["calibration"]
    assert c["target"] == {"target_ratio": 4.0} and c["bytes_per_token"] <= 1024 // 4
    positions = (f"over {c['eval_tokens']} positions (the document's last tokens, the probe question and its "
                 f"answer)")
    assert f"top-1 agreement {c['top1_agreement']:.0%} {positions}" in r.output
    r = CliRunner().invoke(main.cli, ["inspect", str(out)])
    assert "calibrated    --target-ratio 4x: " in r.output and positions in r.output
    r = CliRunner().invoke(main.cli, ["build", str(doc), "-o", str(tmp_path / "n.cart"), "--max-kl", "0.1",
                                      "--no-calibrate"])
    assert isinstance(r.exception, InputError)  # entry.py prints it as one error: line
    assert str(r.exception) == "--max-kl needs calibration; drop --no-calibrate"


def test_a_calibration_target_is_shown_as_the_build_options_that_ask_for_it():
    from cartridge.cli.report import agreement, budget_flags

    assert budget_flags({"target_ratio": 3.0}) == "--target-ratio 3x"
    assert budget_flags({"target_ratio": 4.5}) == "--target-ratio 4.5x"
    assert budget_flags({"preset": "safe"}) == "--preset safe"
    assert budget_flags({"max_bytes_per_token": 300}) == "--max-bytes-per-token 300"
    assert budget_flags({"max_kl": 0.05}) == "--max-kl 0.05"
    c = {"top1_agreement": 0.9, "eval_tokens": 49, "probe": ["a?", "b?"]}
    assert agreement(c) == ("top-1 agreement 90% over 49 positions (the document's last tokens, the probe "
                            "questions and their answers)")


def test_eval_table_shows_the_build_kl_of_a_measured_row():
    from cartridge.cli.eval_report import COLUMNS, row_cells

    row = {"label": "preset=balanced", "kind": "cartridge", "bytes_per_token": 7680, "compression": 3.0,
           "build_kl": 0.01234, "perplexity": 5.0, "perplexity_change": 0.001,
           "vs_fp16": {"first_token": 19, "exact": 10, "n": 20, "bleu": 0.8, "divergence": 30.0}}
    cells = dict(zip(COLUMNS, row_cells(row)))
    assert (cells["build KL"], cells["compression"], cells["first token"]) == ("0.0123", "3.00x", "19/20")
    assert dict(zip(COLUMNS, row_cells({**row, "build_kl": None})))["build KL"] == "-"
    assert (cells["needles"], cells["needles vs fp16"]) == ("-", "-")
    needles = {"found": 2, "n": 3, "recall": 2 / 3, "by_depth": {"0.5": {"found": 2, "n": 3}}}
    lost = {**row, "needles": needles, "vs_fp16": {**row["vs_fp16"], "needles": {"same": 2, "lost": 1, "gained": 0,
                                                                                  "n": 3}}}
    assert dict(zip(COLUMNS, row_cells(lost)))["needles vs fp16"] == "-1 +0"
    same = {**lost, "vs_fp16": {**row["vs_fp16"], "needles": {"same": 3, "lost": 0, "gained": 0, "n": 3}}}
    assert dict(zip(COLUMNS, row_cells(same)))["needles vs fp16"] == "same"


def test_heavy_hitters_are_the_leading_tokens_of_large_attention_mass():
    import mlx.core as mx

    from cartridge.calibrate.measure import heavy_hitters

    t = 100
    mass = [0.5, 0.001, 0.2] + [0.3 / 97] * 97  # a sink at 0, another at 2; the rest below 8x uniform
    n, share = heavy_hitters(mx.array(mass))
    assert (n, share) == (3, pytest.approx(0.701, abs=1e-6))
    assert heavy_hitters(mx.full((t,), 1 / t)) == (0, 0.0)


@pytest.mark.parametrize("group", [1, 2])
def test_the_batched_walk_measures_what_one_forward_per_replaced_group_of_layers_measures(tiny64, group, monkeypatch):
    from cartridge.write.prefill import prefill
    from cartridge.calibrate import measure
    from cartridge.models.prompt import prefix_tokens, prompt_mode

    monkeypatch.setattr(measure, "WALK_GROUP", group)
    mode = prompt_mode(tiny64.tokenizer)
    tokens = prefix_tokens(tiny64.tokenizer, DOC, mode)
    caches = prefill(tiny64.model, tokens)
    sens = measure.measure(tiny64.model, tiny64.tokenizer, mode, caches, tokens)
    probe = sens.probe
    assert sens.eval_tokens == probe.ids.shape[1] == probe.logprobs.shape[0]
    assert set(sens.cpu_stages) == set(sens.stages) == {"answer", "walk", "protected"}
    assert min(sens.cpu_stages.values()) >= 0 and sens.cpu_stages["walk"] > 0  # process CPU s of each stage
    for first in range(0, len(caches), group):
        layers = range(first, min(first + group, len(caches)))
        kv = list(probe.kv)
        for j in layers:
            kv[j] = tuple(measure.round_trip(measure.REFERENCE_TIER, x, j, s) for x, s in zip(kv[j], "kv"))
        one = measure.kl_mean(probe.logprobs, measure.run_from(tiny64.model, probe.embedded, kv))
        # float32 sums of a batch of rows vs 1; the walk's LM head takes 1,024 columns of 49,152 per position (head.py):
        # on this random tiny model within 1% on one 2-core AMD EPYC, 1.08% on another (layer 0, group 1, 2026-12-06)
        assert sum(sens.measured[j] for j in layers) == pytest.approx(one, rel=2e-2)
        for j in layers:
            share = sum(sens.kl[(j, s, measure.REFERENCE_TIER)] for s in "kv")  # the layer's KL, split in K and V
            assert share == pytest.approx(sens.measured[j], rel=1e-6, abs=1e-9) and sens.measured[j] > 0


FALLBACK = {  # family -> why calibration declines it (the fixed recipe is built instead)
    "qwen3_next": "this model has ArraysCache caches",  # linear-attention state
}
MEASURED = {  # family -> how: the batched walk, or the model's own forwards where the walk cannot run
    "qwen3": "walk", "gemma": "walk",  # gemma: a scaled embedding
    "gemma3_text": "walk", "gemma3": "walk",  # sliding windows; gemma3 wraps gemma3_text
    "gpt_oss": "forwards",  # attention sinks, which the walk's attention does not add
    "gpt2": "forwards",  # no .model.layers
}


@pytest.mark.parametrize("family", [*MEASURED, *FALLBACK])
def test_a_preset_build_never_fails_because_of_calibration(family, smol_tokenizer, tmp_path):
    import warnings

    from helpers.family_models import make_model

    from cartridge.calibrate import CalibrationFallbackWarning
    from cartridge.tiers import presets

    lm = make_model(family, smol_tokenizer)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = cartridge.build(DOC, tmp_path / "b.cart", model=lm, reserve=0, page_size=32, preset="balanced")
    fallbacks = [str(w.message) for w in seen if w.category is CalibrationFallbackWarning]
    info, _ = cartridge.open_cartridge(r.path)
    if family not in FALLBACK:
        assert fallbacks == [] and r.calibration["measured_layers"] == 4 and K.CALIBRATION in info.records
        assert r.calibration["method"] == MEASURED[family]
        assert r.calibration["bytes_per_token"] <= r.calibration["fp16_bytes_per_token"] // 3
        return
    recipe = presets.resolve("balanced")
    assert len(fallbacks) == 1 and FALLBACK[family] in fallbacks[0]
    assert fallbacks[0].endswith("preset balanced is built with its fixed recipe (K mlx4g32+rot, V mlx4g32+rot), "
                                 "not measured")
    assert r.calibration is None and K.CALIBRATION not in info.records  # absent = not measured (spec 4.7)
    kv_rows = [row for row in info.tiers if row["k"] not in (None, "fp16")]  # None: a recurrent-state layer
    assert kv_rows and all((row["k"], row["v"]) == (recipe["k_tier"], recipe["v_tier"]) for row in kv_rows)


def test_a_ratio_budget_for_a_model_calibration_cannot_measure_is_refused_before_the_prefill(smol_tokenizer, tmp_path):
    from helpers.family_models import make_model

    from cartridge.errors import CalibrationUnsupportedError

    lm = make_model("qwen3_next", smol_tokenizer)
    with pytest.raises(CalibrationUnsupportedError, match="ArraysCache caches; build with --preset, a tier or --schema"):
        cartridge.build(DOC, tmp_path / "x.cart", model=lm, reserve=0, budget=CalibrationTarget(target_ratio=3.0),
                        progress=lambda d, t: pytest.fail("prefilled"))
    assert not (tmp_path / "x.cart").exists()


@pytest.mark.parametrize("side", ["k", "v"])
def test_the_protected_attention_error_equals_the_error_with_the_leading_tokens_put_back(side):
    import mlx.core as mx

    from cartridge.calibrate.measure import AttentionError

    mx.random.seed(3)
    q, k, v = mx.random.normal((6, 5, 16)), mx.random.normal((1, 2, 40, 16)), mx.random.normal((1, 2, 40, 16))
    ref = k if side == "k" else v
    x2 = ref + 0.1 * mx.random.normal(ref.shape)
    error = AttentionError(q, k, v)
    err, pieces = error(side, x2)
    for first in (0, 1, 7):
        kept = mx.concatenate([ref[:, :, :first], x2[:, :, first:]], axis=2)
        assert error.protected(side, pieces, first).item() == pytest.approx(error(side, kept)[0].item(), rel=1e-4)
    assert error(side, ref)[0].item() == pytest.approx(0.0, abs=1e-10) and err.item() > 1e-4


@pytest.mark.parametrize("replaced_rows", [1, 2])
def test_the_walk_cache_attends_like_mlx_over_each_rows_prefix_and_own_tokens(replaced_rows):
    import mlx.core as mx

    from cartridge.attention.caches import SharedPrefixCache

    mx.random.seed(5)
    rows, n_kv, g, s, e, d = 3, 2, 3, 37, 9, 16  # GQA 3, odd prefix and own lengths
    k, v, k2, v2 = (mx.random.normal((1, n_kv, s, d)) for _ in range(4))
    q, own_k, own_v = mx.random.normal((rows, n_kv * g, e, d)), *(mx.random.normal((rows, n_kv, e, d)) for _ in range(2))
    cache = SharedPrefixCache(k, v, k2, v2, replaced_rows)
    keys, values = cache.update_and_fetch(own_k, own_v)
    got = cache.attention(q, keys, values, d ** -0.5, "causal")
    assert cache.offset == s + e and got.shape == (rows, n_kv * g, e, d)
    for r in range(rows):
        pk, pv = (k2, v2) if r >= rows - replaced_rows else (k, v)
        want = mx.fast.scaled_dot_product_attention(q[r:r + 1], mx.concatenate([pk, own_k[r:r + 1]], axis=2),
                                                    mx.concatenate([pv, own_v[r:r + 1]], axis=2),
                                                    scale=d ** -0.5, mask="causal")
        assert mx.allclose(got[r:r + 1], want, atol=1e-5).item()


def test_heavy_hitters_are_not_protected_by_default_so_preset_cartridges_extend_and_compose():
    from types import SimpleNamespace

    from cartridge import calibrate

    shapes = {"k": (2, 64), "v": (2, 64)}
    tiers = ("fp16", "int8", "mlx4g32")
    kl = {(0, s, t): {"fp16": 0.0, "int8": 0.01, "mlx4g32": 0.1}[t] for s in "kv" for t in tiers}
    sens = SimpleNamespace(kl=kl, protect_first=1, kl_protected={key: x / 10 for key, x in kl.items()})
    bound = calibrate.TIERS["fp16"].bytes_per_token(2, 64)  # half of fp16's K+V bytes/token of the one layer
    parts, bounds, tokens = ([0], []), [bound, 0], (4096, 0)  # one layer that stores every token
    first, (plain, _) = calibrate._best(sens, parts, shapes, bounds, None, tokens)
    assert first == 0 and not calibrate.PROTECT_HEAVY_HITTERS
    first, (kept, _) = calibrate._best(sens, parts, shapes, bounds, None, tokens, protect_heavy_hitters=True)
    assert first == 1 and kept.predicted_kl < plain.predicted_kl  # measured, and it would win: off by choice


def test_a_budget_below_every_schema_is_refused_before_the_prefill(tiny64, tmp_path, monkeypatch):
    import importlib

    build_mod = importlib.import_module("cartridge.write.build")  # (the package's `build` attribute is the function)
    monkeypatch.setattr(build_mod, "prefill", lambda *a, **k: pytest.fail("prefilled before refusing the budget"))
    with pytest.raises(InputError, match="budget 1 bytes/token is below the cheapest measured schema"):
        cartridge.build(DOC, tmp_path / "x.cart", model=tiny64, budget=CalibrationTarget(max_bytes_per_token=1))
    with pytest.raises(InputError, match="budget 16 bytes/token is below the cheapest measured schema"):
        cartridge.build(DOC, tmp_path / "x.cart", model=tiny64, budget=CalibrationTarget(target_ratio=64.0))
    assert not (tmp_path / "x.cart").exists()


def test_the_evaluation_sequence_asks_every_probe_as_a_follow_up_turn(tiny64, monkeypatch):
    from cartridge.write.prefill import prefill
    from cartridge.calibrate import sequence
    from cartridge.models.prompt import (
        followup_tokens,
        prefix_tokens,
        prompt_mode,
        question_tokens,
    )

    tok, mode = tiny64.tokenizer, prompt_mode(tiny64.tokenizer)
    tokens = prefix_tokens(tok, DOC, mode)
    caches = prefill(tiny64.model, tokens)
    split = sequence.split_of(tokens)
    kv = [(c.keys[..., :split, :], c.values[..., :split, :]) for c in caches]
    probes = ("What is it about?", "Which numbers does it mention?")
    ids, logprobs = sequence.eval_sequence(tiny64.model, tok, mode, kv, tokens, split, 3, probes)
    first = tokens[split:] + question_tokens(tok, probes[0], mode)
    assert ids[:len(first)] == first
    # 3 greedy tokens a probe: the first two fed alone, the third with the next turn; the last one never fed
    rest = ids[len(first) + 2:]
    second = followup_tokens(tok, probes[1], mode, last_token=rest[0])
    assert rest[1:] == second + rest[-2:] and len(rest) == 1 + len(second) + 2
    assert logprobs.shape == (len(ids), tiny64.model.args.vocab_size)
    monkeypatch.setattr(sequence, "SCORE_DOCUMENT", False)
    assert sequence.scored(len(ids), len(tokens) - split) == len(tokens) - split


def test_the_evaluation_sequence_takes_the_documents_last_tokens_at_most_half_of_it():
    from cartridge.calibrate.sequence import split_of

    assert [split_of(list(range(n))) for n in (1, 2, 40, 64, 65, 299)] == [1, 1, 20, 32, 33, 267]
    assert [split_of(list(range(n)), 8) for n in (10, 299)] == [5, 291]


def test_shifted_exp_is_exp_of_the_scores_minus_their_common_row_max_with_masked_entries_zero():
    import mlx.core as mx
    import numpy as np

    from cartridge.attention.caches.shared_prefix import shifted_exp

    mx.random.seed(7)
    a, b = 10 * mx.random.normal((2, 3, 5)), 10 * mx.random.normal((2, 3, 4))  # float32: rel. error ~|s| eps
    b = mx.where(mx.arange(4) > 1, b, -mx.inf)  # masked entries
    want_a, want_b = (np.asarray(x, dtype=np.float64) for x in (a, b))
    top = np.maximum(want_a.max(-1, keepdims=True), want_b.max(-1, keepdims=True))
    (ea, eb), (za, zb) = shifted_exp(a, b)
    assert np.allclose(np.asarray(ea), np.exp(want_a - top), rtol=1e-5, atol=0)
    assert np.allclose(np.asarray(eb), np.exp(want_b - top), rtol=1e-5, atol=0)
    assert (np.asarray(eb)[..., :2] == 0).all() and np.asarray(ea).max() <= 1.0
    assert np.allclose(np.asarray(za) + np.asarray(zb), np.exp(want_a - top).sum(-1, keepdims=True)
                       + np.exp(want_b - top).sum(-1, keepdims=True), rtol=1e-5)


def test_kl_rows_is_the_mean_kl_of_each_row_against_the_reference():
    import mlx.core as mx
    import numpy as np

    from cartridge.calibrate import head

    mx.random.seed(8)
    ref_logits, logits = 3 * mx.random.normal((4, 50)), 3 * mx.random.normal((3, 4, 50))
    ref = head.log_softmax(ref_logits)
    r, q = np.asarray(ref_logits, dtype=np.float64), np.asarray(logits, dtype=np.float64)
    r, q = (x - np.log(np.exp(x).sum(-1, keepdims=True)) for x in (r, q))
    want = (np.exp(r) * (r - q)).sum(-1).mean(-1)  # (3,)
    assert np.allclose(np.asarray(ref), r, atol=1e-5)
    assert np.allclose(np.asarray(head.kl_rows(ref, logits)), want, rtol=1e-4)
    assert head.kl_rows(ref, ref_logits[None]).item() == pytest.approx(0.0, abs=1e-6)
    masked = mx.concatenate([ref_logits[:, :45], mx.full((4, 5), -mx.inf)], axis=1)  # ids a model never emits
    got = head.kl_rows(head.log_softmax(masked), mx.concatenate([logits[:, :, :45], mx.full((3, 4, 5), -mx.inf)], 2))
    r, q = (x[..., :45] - np.log(np.exp(x[..., :45]).sum(-1, keepdims=True)) for x in (r, q))  # the first 45 ids
    assert np.allclose(np.asarray(got), (np.exp(r) * (r - q)).sum(-1).mean(-1), rtol=1e-4)  # finite: they add 0


def test_the_walks_lm_head_kl_from_the_top_tokens_and_tail_samples_is_the_full_logits_kl(tiny64):
    import mlx.core as mx
    import numpy as np

    from cartridge.calibrate import head

    mx.random.seed(3)
    h0 = 4 * mx.random.normal((1, 12, 64))
    h = mx.concatenate([h0, h0 + 0.3 * mx.random.normal((3, 12, 64)) * mx.array([0.1, 1.0, 3.0])[:, None, None]])
    ref, full = head.walk_kl(tiny64.model, h, 2, head_tokens=10**9)  # every row's full logits
    ref2, approx = head.walk_kl(tiny64.model, h, 2)  # HEAD_TOKENS and TAIL_SAMPLES of a 49,152 vocabulary
    assert np.array_equal(np.asarray(ref), np.asarray(ref2)) and ref.shape == (12, tiny64.model.args.vocab_size)
    assert full[0] < full[1] < full[2] and full[0] > 1e-6
    assert np.allclose(approx, full, rtol=0.03), (approx, full)  # 1-2.4% on this flat distribution
    _, no_tail = head.walk_kl(tiny64.model, h, 2, tail_samples=0)
    assert all(t < a for t, a in zip(no_tail, approx))  # the tail's second-order term, left out, is >= 0
