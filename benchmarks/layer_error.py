"""Per-layer K/V error and attention-output error of each tier against fp16 (issue 19 item 5).

For a document: prefill it once (the model's own K/V, rounded to fp16 as the fp16 cartridge stores them),
record the queries the model computes for each question's tokens on top of it (post-RoPE, every layer),
then for each configuration encode and decode every (layer, side) through its tier's pages, with the
protected first/last tokens (if any) put back in fp16, exactly as a cartridge stores them. Per layer:

- K mean abs error and relative error (Frobenius ||K' - K|| / ||K||), the same for V;
- attention-output relative error over the prefix: softmax(q K^T * scale) V against the same with
  K', V', for every recorded question query (GQA: each KV head serves its query-head group),
  ||o' - o|| / ||o|| over all query rows.

    python benchmarks/layer_error.py DOC.txt QUESTIONS.jsonl [DOC2 Q2 ...] --json out.json [--only LABEL,...]

Tables and plot in docs/evaluation.md: drawn by benchmarks/issue19_report.py --layers (removed; at a876215).

Cheap (no generation): one prefill, one forward per question, then numpy/mlx arithmetic per config.

With --calibration (issue 33), for each document instead: the cost of the calibration at build against the
prefill, and the measured KL of each budget's choice (safe 2x, balanced 3x, compact 4.5x) beside the fixed
recipe's tiers on every layer (`benchmarks/results/calibration.json`):

    python benchmarks/layer_error.py --calibration DOC.txt [DOC2 ...] --json benchmarks/results/calibration.json

With --cost, where the time of calibration goes against the prefill (issue 33 item 1's cost target), in one
process per run: the prefill, then for each variant of the evaluation sequence (its document tail and answer
lengths, `cartridge.calibrate.sequence`) one `measure` (its stages), the search and `verify` of each budget
preset, in wall and process CPU seconds. Every chosen schema is also measured on the first variant's
evaluation sequence (the reference, version 3's by default) and the reference's choice on each variant's, so
the choices compare on the same positions both ways; the layer-sides whose tier differs from the reference's
choice are counted. The reference walk's parts are then timed apart (each synced on its own): the 12
candidate round trips of every layer, the attention errors, the blocks over the growing rows, the LM head's KL
(`benchmarks/results/calibration-cost.json`):

    python benchmarks/layer_error.py --cost DOC.txt [DOC2 ...] --json OUT.json [--variant v3=32:8 --variant b=8:4]
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import cartridge  # noqa: F401  (before mlx: loads OpenBLAS)
import mlx.core as mx
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from cartridge.attention import route
from cartridge.attention.pages import encode_pages
from cartridge.write.prefill import prefill
from cartridge.calibrate import PRESET_RATIOS, CalibrationTarget, head, search, sequence
from cartridge.calibrate import measure as calibration
from cartridge.attention.caches import SharedPrefixCache
from cartridge.eval.dataset import load_questions
from cartridge.models.loader import load_model
from cartridge.models.prompt import prefix_tokens, prompt_mode, question_tokens
from cartridge.tiers import TIERS, presets

PAGE = 256
CONFIGS = {  # label -> (k_tier, v_tier, protect_first, protect_last)
    "bf16": ("bf16", "bf16", 0, 0), "int8": ("int8", "int8", 0, 0), "int8+rot": ("int8+rot", "int8+rot", 0, 0),
    "fp8": ("fp8", "fp8", 0, 0), "int6": ("int6", "int6", 0, 0), "int6+rot": ("int6+rot", "int6+rot", 0, 0),
    "mlx4g32": ("mlx4g32", "mlx4g32", 0, 0), "mlx4g32+rot": ("mlx4g32+rot", "mlx4g32+rot", 0, 0),
    "mlx4g32:pf4:pl28": ("mlx4g32", "mlx4g32", 4, 28),
    "mlx4g32+rot:pf4:pl28": ("mlx4g32+rot", "mlx4g32+rot", 4, 28),
    "k=kivi4:v=mlx4g32": ("kivi4", "mlx4g32", 0, 0), "k=kivi4:v=mlx4g32+rot": ("kivi4", "mlx4g32+rot", 0, 0),
    "mxfp4": ("mxfp4", "mxfp4", 0, 0), "mxfp4+rot": ("mxfp4+rot", "mxfp4+rot", 0, 0),
    "nvfp4": ("nvfp4", "nvfp4", 0, 0), "nvfp4+rot": ("nvfp4+rot", "nvfp4+rot", 0, 0),
    "turbo4": ("turbo4", "turbo4", 0, 0), "turbo3": ("turbo3", "turbo3", 0, 0), "turbo2": ("turbo2", "turbo2", 0, 0),
    "k=mxfp4+rot:v=turbo2": ("mxfp4+rot", "turbo2", 0, 0),
}
for _name in ("safe", "balanced", "compact"):
    _p = presets.resolve(_name)
    CONFIGS[f"preset={_name}"] = (_p["k_tier"], _p["v_tier"], _p["protect_first"], _p["protect_last"])


def record_queries(model, caches, prompts):
    """Per layer, the post-RoPE queries (n_heads, rows, D) float32 of every prompt's tokens after the prefix."""
    seen, real = [], llama.scaled_dot_product_attention

    def spy(queries, keys, values, cache, scale, mask, **kw):
        seen.append(queries[0].astype(mx.float32))  # (n_heads, L, D)
        return real(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    llama.scaled_dot_product_attention = spy
    try:
        per_layer = [[] for _ in caches]
        for ids in prompts:
            seen.clear()
            fresh = []
            for c in caches:
                k = KVCache()
                k.update_and_fetch(c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
                fresh.append(k)
            mx.eval(model(mx.array(ids)[None], cache=fresh))
            for layer, q in enumerate(seen):
                per_layer[layer].append(q)
        return [mx.concatenate(qs, axis=1) for qs in per_layer]
    finally:
        llama.scaled_dot_product_attention = real


def round_trip(name, x, layer, side, first, last):
    """x (n_kv, T, D) float32 -> its tier's decoded pages (n_kv, T, D), protected tokens back in fp16."""
    codec = TIERS[name]
    params = codec.make_params(x, layer, side)
    pages = codec.decode(encode_pages(codec, x, params, PAGE), params)  # (n_pages, n_kv, P, D)
    n_pages, n_kv, p, d = pages.shape
    # (n_pages, n_kv, P, D) -> (n_kv, T, D)
    y = pages.transpose(1, 0, 2, 3).reshape(n_kv, n_pages * p, d)[:, : x.shape[1]]
    t = x.shape[1]
    if first + last:
        kept = x.astype(mx.float16).astype(mx.float32)
        y = mx.concatenate([kept[:, :first], y[:, first: t - last], kept[:, t - last:]], axis=1)
    return y


def attend(q, k, v):
    """q (H, R, D), k/v (n_kv, T, D) -> (H, R, D) softmax attention in float32 (GQA by head groups)."""
    h, r, d = q.shape
    n_kv = k.shape[0]
    # (H, R, D) -> (n_kv, H / n_kv * R, D): each KV head's query group
    qg = q.reshape(n_kv, h // n_kv * r, d) * d ** -0.5
    p = mx.softmax(qg @ k.transpose(0, 2, 1), axis=-1)
    return (p @ v).reshape(h, r, d)


def rel(a, b):
    return (mx.sqrt(((a - b) ** 2).sum()) / mx.sqrt((b ** 2).sum())).item()


def measure(kv, queries, config):
    """Per-layer error dict lists for one config."""
    k_tier, v_tier, first, last = config
    rows = []
    for layer, ((k, v), q) in enumerate(zip(kv, queries)):
        k2 = round_trip(k_tier, k, layer, "k", first, last)
        v2 = round_trip(v_tier, v, layer, "v", first, last)
        o, o2 = attend(q, k, v), attend(q, k2, v2)
        rows.append({"k_mean_abs": mx.abs(k2 - k).mean().item(), "k_rel": rel(k2, k),
                     "v_mean_abs": mx.abs(v2 - v).mean().item(), "v_rel": rel(v2, v), "attn_rel": rel(o2, o)})
    return rows


def run(doc_path, questions_path, n_questions, lm):
    text = Path(doc_path).read_text()
    mode = prompt_mode(lm.tokenizer)
    tokens = prefix_tokens(lm.tokenizer, text, mode)
    caches = prefill(lm.model, tokens)
    # the fp16 cartridge's K/V: (n_kv, T, D) rounded to fp16, computed in float32
    kv = [tuple(x[0, :, : len(tokens)].astype(mx.float16).astype(mx.float32) for x in (c.keys, c.values))
          for c in caches]
    questions = load_questions(questions_path)[:n_questions]
    prompts = [question_tokens(lm.tokenizer, q["question"], mode) for q in questions]
    queries = record_queries(lm.model, caches, prompts)
    out = {"document": str(doc_path), "tokens": len(tokens), "questions": len(prompts),
           "query_rows": queries[0].shape[1], "configs": {}}
    for label, config in CONFIGS.items():
        t0 = time.perf_counter()
        layers = measure(kv, queries, config)
        means = {key: float(np.mean([r[key] for r in layers])) for key in layers[0]}
        out["configs"][label] = {"k_tier": config[0], "v_tier": config[1], "protect_first": config[2],
                                 "protect_last": config[3], "mean": means, "layers": layers}
        print(f"{Path(doc_path).name:24} {label:24} K rel {means['k_rel']:.4f}  V rel {means['v_rel']:.4f}  "
              f"attn rel {means['attn_rel']:.4f}  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return out


UNIFORM = {name: (presets.PRESETS[name]["k_tier"], presets.PRESETS[name]["v_tier"]) for name in PRESET_RATIOS}


def calibration_run(path, lm):
    """--calibration: one prefill, one `cartridge.calibrate.measure`, then each budget's chosen schema (bytes,
    predicted KL, KL and top-1 measured with every replacement together) beside the fixed recipe on every layer."""
    mode = prompt_mode(lm.tokenizer)
    tokens = prefix_tokens(lm.tokenizer, Path(path).read_text(), mode)
    t0 = time.perf_counter()
    caches = prefill(lm.model, tokens)
    t1 = time.perf_counter()
    sens = calibration.measure(lm.model, lm.tokenizer, mode, caches, tokens)
    k, v = caches[0].keys, caches[0].values
    shapes = {"k": (k.shape[1], k.shape[3]), "v": (v.shape[1], v.shape[3])}
    fp16 = len(caches) * 2 * 2 * k.shape[1] * k.shape[3]
    out = {"document": str(path), "tokens": len(tokens), "prefill_s": round(t1 - t0, 2),
           "calibrate_s": round(sens.seconds, 2), "calibrate_stages_s": sens.stages,
           "calibrate_over_prefill": round(sens.seconds / (t1 - t0), 3), "eval_tokens": sens.eval_tokens,
           "forwards": sens.forwards, "heavy_hitters": sens.protect_first,
           "budgets": {}}
    for name in PRESET_RATIOS:
        choice = search.choose(sens.kl, len(caches), shapes, CalibrationTarget(preset=name).bounds([fp16, 0])[0])
        kl, agree = calibration.verify(lm.model, sens.probe, choice.schema)
        ku, vu = UNIFORM[name]
        uniform = [{"layer": i, "k": ku, "v": vu} for i in range(len(caches))]
        ukl, uagree = calibration.verify(lm.model, sens.probe, uniform)
        out["budgets"][name] = {
            "ratio": round(fp16 / choice.bytes_per_token, 3), "bytes_per_token": choice.bytes_per_token,
            "predicted_kl": choice.predicted_kl, "measured_kl": kl, "top1": agree, "schema": choice.schema,
            "uniform": {"k": ku, "v": vu, "ratio": round(fp16 / search.schema_bytes(uniform, shapes), 3),
                        "measured_kl": ukl, "top1": uagree}}
        print(f"{Path(path).name:22} {name:8} {fp16 / choice.bytes_per_token:.2f}x predicted KL "
              f"{choice.predicted_kl:.4f} measured {kl:.4f} top-1 {agree:.0%} | uniform {ku}/{vu} KL {ukl:.4f} "
              f"top-1 {uagree:.0%}", flush=True)
    print(f"{Path(path).name:22} prefill {t1 - t0:.1f} s, calibrate {sens.seconds:.1f} s "
          f"({sens.seconds / (t1 - t0):.2f}x; {sens.stages})", flush=True)
    return out


class Clock:
    """Wall and process CPU seconds since the last `lap`."""

    def __init__(self):
        self.t = (time.perf_counter(), time.process_time())

    def lap(self):
        now = (time.perf_counter(), time.process_time())
        out, self.t = {"wall": round(now[0] - self.t[0], 3), "cpu": round(now[1] - self.t[1], 3)}, now
        return out


def parse_variant(text):
    """'name=SLICE:ANSWER' -> (name, slice tokens, answer tokens)."""
    name, _, spec = text.partition("=")
    slice_tokens, _, answer = spec.partition(":")
    return name, int(slice_tokens), int(answer)


def measured(lm, mode, caches, tokens, slice_tokens, answer_tokens):
    """One `measure` with the evaluation sequence's lengths set: (Sensitivity, {"wall", "cpu"})."""
    saved = sequence.SLICE_TOKENS, sequence.ANSWER_TOKENS
    sequence.SLICE_TOKENS, sequence.ANSWER_TOKENS = slice_tokens, answer_tokens
    try:
        clock = Clock()
        sens = calibration.measure(lm.model, lm.tokenizer, mode, caches, tokens)
        return sens, clock.lap()
    finally:
        sequence.SLICE_TOKENS, sequence.ANSWER_TOKENS = saved


def components(model, probe):
    """The reference walk's parts timed apart (each synced): round trips, attention errors, blocks, LM head."""
    clock, trips, out = Clock(), [], {}
    for j, (k, v) in enumerate(probe.kv):
        t = {(s, n): calibration.round_trip(n, x, j, s) for s, x in (("k", k), ("v", v))
             for n in calibration.CANDIDATES}
        mx.eval(t)
        trips.append(t)
    out["round_trips"] = clock.lap()
    for j, (k, v) in enumerate(probe.kv):
        error = calibration.AttentionError(probe.queries[j], k, v)
        mx.eval({key: error(key[0], x2)[0] for key, x2 in trips[j].items()})
    out["attention_errors"] = clock.lap()
    h, ref = probe.embedded, calibration.REFERENCE_TIER
    route.install()
    for j, block in enumerate(model.model.layers):
        k, v = probe.kv[j]
        h = mx.concatenate([h, h[:1]])  # (rows + 1, E, hidden)
        h = block(h, "causal", cache=SharedPrefixCache(k, v, trips[j][("k", ref)], trips[j][("v", ref)]))
        mx.eval(h)
    out["blocks"] = clock.lap()
    mx.eval(head.walk_kl(model, h, probe.start)[0])
    out["lm_head_kl"] = clock.lap()
    return out


def budgets(lm, sens, reference, n_layers, shapes, fp16, reference_budgets=None):
    """Each budget's choice: bytes, predicted KL, measured KL on this variant's and the reference's sequence,
    and the reference's choice (`reference_budgets`, None for the reference itself) on this variant's sequence:
    each choice is the best for the sequence it was measured on, so the two cross measurements tell a worse
    choice from the noise of a sequence of ~30-60 positions."""
    out = {}
    for name in PRESET_RATIOS:
        clock = Clock()
        choice = search.choose(sens.kl, n_layers, shapes, CalibrationTarget(preset=name).bounds([fp16, 0])[0])
        kl, agree = calibration.verify(lm.model, sens.probe, choice.schema)
        cost = clock.lap()
        ref_kl, ref_agree = calibration.verify(lm.model, reference.probe, choice.schema)
        out[name] = {"bytes_per_token": choice.bytes_per_token, "predicted_kl": choice.predicted_kl,
                     "measured_kl": kl, "top1": agree, "measured_kl_on_reference": ref_kl,
                     "top1_on_reference": ref_agree, "search_verify": cost, "schema": choice.schema}
        if reference_budgets is not None:
            theirs = reference_budgets[name]["schema"]
            out[name]["reference_choice_measured_kl"] = calibration.verify(lm.model, sens.probe, theirs)[0]
    return out


def differing(schema, reference):
    """Layer-sides whose tier differs between two schemas."""
    return sum(a[s] != b[s] for a, b in zip(schema, reference) for s in "kv")


def document_run(path, lm, variants):
    """--cost on one document: the prefill, each variant (`measured`, `budgets`), the reference walk's parts."""
    mode = prompt_mode(lm.tokenizer)
    tokens = prefix_tokens(lm.tokenizer, Path(path).read_text(), mode)
    clock = Clock()
    caches = prefill(lm.model, tokens)
    out = {"document": str(path), "tokens": len(tokens), "prefill": clock.lap(), "load_average_before": os.getloadavg(),
           "variants": {}}
    k = caches[0].keys
    shapes = {"k": (k.shape[1], k.shape[3]), "v": (caches[0].values.shape[1], caches[0].values.shape[3])}
    fp16 = len(caches) * 2 * (k.shape[1] * k.shape[3] + shapes["v"][0] * shapes["v"][1])
    reference = None
    for name, slice_tokens, answer_tokens in variants:
        sens, cost = measured(lm, mode, caches, tokens, slice_tokens, answer_tokens)
        first = out["variants"][variants[0][0]]["budgets"] if out["variants"] else None
        reference = reference or sens
        chosen = budgets(lm, sens, reference, len(caches), shapes, fp16, first)
        build = {key: round(cost[key] + chosen["balanced"]["search_verify"][key], 3) for key in cost}  # one verify
        row = {"slice_tokens": slice_tokens, "answer_tokens": answer_tokens, "eval_tokens": sens.eval_tokens,
               "measure": cost, "stages_wall": sens.stages, "stages_cpu": sens.cpu_stages, "calibration": build,
               "over_prefill": {key: round(build[key] / out["prefill"][key], 3) for key in build},
               "budgets": chosen}
        for b in PRESET_RATIOS:
            chosen[b]["layer_sides_differing"] = differing(chosen[b]["schema"], (first or chosen)[b]["schema"])
        out["variants"][name] = row
        kls = " ".join(f"{b} {chosen[b]['measured_kl_on_reference']:.5f} ({chosen[b]['layer_sides_differing']}; "
                       f"own E {chosen[b]['measured_kl']:.5f} vs reference's choice "
                       f"{chosen[b].get('reference_choice_measured_kl', chosen[b]['measured_kl']):.5f})"
                       for b in PRESET_RATIOS)
        print(f"{Path(path).name:22} {len(tokens):5} tok {name:6} E {sens.eval_tokens:3}: prefill "
              f"{out['prefill']['wall']:.1f} s wall / {out['prefill']['cpu']:.1f} cpu, calibration "
              f"{build['wall']:.1f} / {build['cpu']:.1f} ({row['over_prefill']['wall']:.2f}x / {row['over_prefill']['cpu']:.2f}x) "
              f"stages {sens.stages} | KL on the reference's E (layer-sides differing; on this E: this choice vs "
              f"the reference's): {kls}", flush=True)
    out["reference_walk_components"] = components(lm.model, reference.probe)
    print(f"{Path(path).name:22} reference walk parts: {out['reference_walk_components']}", flush=True)
    out["load_average_after"] = os.getloadavg()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pairs", nargs="+", help="DOC.txt QUESTIONS.jsonl [DOC2 Q2 ...]; with --calibration: DOC.txt ...")
    ap.add_argument("--json", required=True)
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma-separated config labels (default: all)")
    ap.add_argument("--calibration", action="store_true",
                    help="measure the calibration at build (issue 33) on each document instead")
    ap.add_argument("--cost", action="store_true",
                    help="where the calibration's time goes against the prefill, per evaluation-sequence variant")
    ap.add_argument("--variant", action="append", type=parse_variant,
                    help="with --cost: NAME=SLICE:ANSWER, the first the reference (default: v3=32:8 and b=8:4)")
    args = ap.parse_args()
    if args.cost:
        variants, lm, results = args.variant or [("v3", 32, 8), ("b", 8, 4)], load_model("default"), []
        for path in args.pairs:  # written after each document: a long run keeps what it measured
            results.append(document_run(path, lm, variants))
            Path(args.json).write_text(json.dumps({"model": "default (SmolLM2-135M-Instruct)", "machine":
                                                   f"{platform.machine()} CPU, {os.cpu_count()} cores, "
                                                   f"{platform.node()}", "results": results}, indent=1))
        return
    if args.calibration:
        lm, results = load_model("default"), []
        for d in args.pairs:  # written after each document: a long run keeps what it measured
            results.append(calibration_run(d, lm))
            Path(args.json).write_text(json.dumps({"model": "default (SmolLM2-135M-Instruct)", "machine":
                                                   f"{platform.machine()} CPU, {platform.node()}",
                                                   "results": results}, indent=1))
        return
    if len(args.pairs) % 2:
        ap.error("give documents and question files in pairs")
    if args.only:
        for label in set(CONFIGS) - set(args.only.split(",")):
            del CONFIGS[label]
    lm = load_model("default")
    results = [run(d, q, args.questions, lm) for d, q in zip(args.pairs[::2], args.pairs[1::2])]
    Path(args.json).write_text(json.dumps({"model": "default (SmolLM2-135M-Instruct)", "page_size": PAGE,
                                           "results": results}, indent=1))


if __name__ == "__main__":
    main()
