"""Calibration at build (issue 33): cost against the prefill, and the measured KL of each budget's choice.

For each document: one prefill, one `cartridge.calibrate.measure`, then for each budget (safe 2x,
balanced 3x, compact 4.5x) the chosen schema, its bytes/token, its predicted KL and its KL / top-1
agreement measured with all replacements together on the evaluation sequence; beside each, the uniform
schema of about the same bytes (the fixed recipe's tiers on every layer, without protected tokens), measured
the same way.

    python benchmarks/calibration.py DOC.txt [DOC2 ...] --json benchmarks/results/calibration.json
"""

import argparse
import json
import platform
import time
from pathlib import Path

import cartridge  # noqa: F401  (before mlx: loads OpenBLAS)
from cartridge.build import prefill
from cartridge.calibrate import BUDGETS, Budget, measure, search
from cartridge.models.loader import load_model
from cartridge.models.prompt import prefix_tokens, prompt_mode
from cartridge.tiers import presets

UNIFORM = {name: (presets.PRESETS[name]["k_tier"], presets.PRESETS[name]["v_tier"]) for name in BUDGETS}


def run(path, lm):
    mode = prompt_mode(lm.tokenizer)
    tokens = prefix_tokens(lm.tokenizer, Path(path).read_text(), mode)
    t0 = time.perf_counter()
    caches = prefill(lm.model, tokens)
    t1 = time.perf_counter()
    sens = measure.measure(lm.model, lm.tokenizer, mode, caches, tokens)
    k, v = caches[0].keys, caches[0].values
    shapes = {"k": (k.shape[1], k.shape[3]), "v": (v.shape[1], v.shape[3])}
    fp16 = len(caches) * 2 * 2 * k.shape[1] * k.shape[3]
    out = {"document": str(path), "tokens": len(tokens), "prefill_s": round(t1 - t0, 2),
           "calibrate_s": round(sens.seconds, 2), "eval_tokens": sens.eval_tokens, "forwards": sens.forwards,
           "budgets": {}}
    for name in BUDGETS:
        choice = search.choose(sens.kl, len(caches), shapes, Budget(preset=name).bytes_bound(fp16))
        kl, agree = measure.verify(lm.model, sens.probe, choice.schema)
        ku, vu = UNIFORM[name]
        uniform = [{"layer": i, "k": ku, "v": vu} for i in range(len(caches))]
        ukl, uagree = measure.verify(lm.model, sens.probe, uniform)
        out["budgets"][name] = {
            "ratio": round(fp16 / choice.bytes_per_token, 3), "bytes_per_token": choice.bytes_per_token,
            "predicted_kl": choice.predicted_kl, "measured_kl": kl, "top1": agree, "schema": choice.schema,
            "uniform": {"k": ku, "v": vu, "ratio": round(fp16 / search.schema_bytes(uniform, shapes), 3),
                        "measured_kl": ukl, "top1": uagree}}
        print(f"{Path(path).name:22} {name:8} {fp16 / choice.bytes_per_token:.2f}x predicted KL "
              f"{choice.predicted_kl:.4f} measured {kl:.4f} top-1 {agree:.0%} | uniform {ku}/{vu} KL {ukl:.4f} "
              f"top-1 {uagree:.0%}", flush=True)
    print(f"{Path(path).name:22} prefill {t1 - t0:.1f} s, calibrate {sens.seconds:.1f} s", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("docs", nargs="+")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    lm = load_model("default")
    results = []
    for d in args.docs:
        results.append(run(d, lm))
        Path(args.json).write_text(json.dumps({"model": "default (SmolLM2-135M-Instruct)", "machine":
                                               f"{platform.machine()} CPU, {platform.node()}", "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
