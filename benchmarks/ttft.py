"""Measure the sample end to end: build tokens/s, cartridge bytes, load time, and TTFT with the
cartridge against a full prefill of document + question (mlx-lm, no cartridge).

    python benchmarks/ttft.py [--questions 5] [--tier fp16] [--json out/ttft.json]

With `--presets exact,safe`, it instead compares cartridges of those presets (fixed recipes, or with
`--calibrate` the schemas a default build measures on the document) in one run, questions interleaved:
TTFT broken down into load, the question's prefill over the prefix and the first decode step, each
preset's TTFT over the first one's, and decode tokens/s (issue 33 item 4: safe's first token on the CPU).

    python benchmarks/ttft.py --presets exact,safe --questions 10 --json benchmarks/results/cpu-ttft-safe.json
"""

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm

from cartridge.models.prompt import full_prompt_tokens

ROOT = Path(__file__).resolve().parent.parent


def ttft(model, tokenizer, prompt, **kw):
    """Seconds from the call to the first generated token, and decode tokens/s over the next 31."""
    t0 = time.perf_counter()
    first, n = None, 0
    for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=32, **kw):
        if first is None:
            first = time.perf_counter()
        n = r.generation_tokens
    end = time.perf_counter()
    return first - t0, (n - 1) / (end - first) if n > 1 else float("nan")


def stages(path, lm, question):
    """One question on a freshly loaded cartridge: seconds of the load, of the question's prefill (to its
    first token's logits), of the first decode step, and decode tokens/s (`ttft`'s) on the same load."""
    clock = [(time.perf_counter(), time.process_time())]
    cart = cartridge.load(path, model=lm)
    clock.append((time.perf_counter(), time.process_time()))
    cache = cart.prompt_cache()
    ids = cart.question_prompt(question)
    y = mx.argmax(cart.model(mx.array(ids)[None], cache=cache)[0, -1])
    mx.eval(y)
    clock.append((time.perf_counter(), time.process_time()))
    mx.eval(cart.model(y.reshape(1, 1), cache=cache))
    clock.append((time.perf_counter(), time.process_time()))
    _, rate = ttft(cart.model, cart.tokenizer, ids, prompt_cache=cart.prompt_cache())
    out = {"question_tokens": len(ids), "decode_tps": rate, "attention": cart.attention}
    for name, (a, b) in zip(("load", "prefill", "first_decode", "ttft"), [*zip(clock, clock[1:]), (clock[0], clock[3])]):
        # wall seconds, and the process's CPU seconds (every thread): on a shared machine the steadier of the two
        out[f"{name}_s"], out[f"{name}_cpu_s"] = b[0] - a[0], b[1] - a[1]
    return out


def compare(args, doc, rows, lm):
    presets = args.presets.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        built = {p: cartridge.build(doc, Path(tmp) / f"{p}.cart", model=lm, preset=p,
                                   calibrate=args.calibrate)
                 for p in presets}
        stages(built[presets[0]].path, lm, rows[0]["question"])  # warm-up: the model's first forward passes
        runs = {p: [] for p in presets}
        for row in rows[: args.questions]:
            for p in presets:
                runs[p].append({"id": row["id"], **stages(built[p].path, lm, row["question"])})
    keys = ("load_s", "prefill_s", "first_decode_s", "ttft_s", "load_cpu_s", "prefill_cpu_s", "first_decode_cpu_s",
            "ttft_cpu_s", "decode_tps")
    out = {"machine": machine(), "device": str(mx.default_device()), "mlx": mx.__version__,
           "tokens": built[presets[0]].tokens, "calibrated": args.calibrate, "presets": {}}
    for p in presets:
        med = {k: statistics.median(r[k] for r in runs[p]) for k in keys}
        out["presets"][p] = {"bytes_per_token": built[p].bytes_per_token, "cartridge_bytes": built[p].bytes,
                             "schema": built[p].schema,
                             "attention": runs[p][0]["attention"], **{f"median_{k}": v for k, v in med.items()},
                             "questions": runs[p]}
        for k in ("ttft_s", "ttft_cpu_s"):
            first = statistics.median(r[k] for r in runs[presets[0]])
            out["presets"][p][k.replace("_s", "_over_first")] = med[k] / first
    print(f"{out['tokens']} prefix tokens, {args.questions} questions, medians, wall s (CPU s of the process):")
    print(f"{'preset':8} {'B/token':>8} {'load':>13} {'prefill':>13} {'decode 1':>13} {'TTFT':>13} {'x first':>11} "
          f"{'decode tok/s':>12}")
    for p, r in out["presets"].items():
        cells = [f"{r[f'median_{k}_s']:.3f} ({r[f'median_{k}_cpu_s']:.3f})" for k in ("load", "prefill", "first_decode",
                                                                                      "ttft")]
        print(f"{p:8} {r['bytes_per_token']:8,} " + " ".join(f"{c:>13}" for c in cells)
              + f" {r['ttft_over_first']:4.2f} ({r['ttft_cpu_over_first']:.2f}) {r['median_decode_tps']:12.1f}")
    return out


def machine():
    return f"{platform.machine()} {platform.processor() or platform.platform()}"


def against_full_prefill(args, doc, rows, lm):
    with tempfile.TemporaryDirectory() as tmp:
        built = cartridge.build(doc, Path(tmp) / "s.cart", model=lm, tier=args.tier)
        t0 = time.perf_counter()
        cart = cartridge.load(built.path, model=lm)
        load_s = time.perf_counter() - t0
        res = []
        for row in rows[: args.questions]:
            q = row["question"]
            c_ttft, c_rate = ttft(cart.model, cart.tokenizer, cart.question_prompt(q), prompt_cache=cart.prompt_cache())
            f_ttft, f_rate = ttft(lm.model, lm.tokenizer, full_prompt_tokens(lm.tokenizer, doc, q))
            res.append({"id": row["id"], "cartridge_ttft_s": c_ttft, "full_prefill_ttft_s": f_ttft,
                        "cartridge_decode_tps": c_rate, "full_decode_tps": f_rate})
    out = {
        "machine": machine(),
        "device": str(mx.default_device()), "mlx": mx.__version__, "tier": args.tier,
        "tokens": built.tokens, "build_seconds": built.seconds, "prefill_tokens_per_s": built.tokens_per_second,
        "cartridge_bytes": built.bytes, "bytes_per_token": built.bytes_per_token, "load_seconds": load_s,
        "median_ttft_cartridge_s": statistics.median(r["cartridge_ttft_s"] for r in res),
        "median_ttft_full_prefill_s": statistics.median(r["full_prefill_ttft_s"] for r in res),
        "median_decode_tps_cartridge": statistics.median(r["cartridge_decode_tps"] for r in res),
        "median_decode_tps_full": statistics.median(r["full_decode_tps"] for r in res),
        "questions": res,
    }
    print(f"{out['tokens']} tokens, build {out['build_seconds']:.1f} s ({out['prefill_tokens_per_s']:.0f} tokens/s), "
          f"{out['cartridge_bytes']:,} bytes ({out['bytes_per_token']:,} B/token), load {load_s:.2f} s")
    print(f"TTFT median: cartridge {out['median_ttft_cartridge_s']:.3f} s, full prefill "
          f"{out['median_ttft_full_prefill_s']:.3f} s ({out['median_ttft_full_prefill_s'] / out['median_ttft_cartridge_s']:.1f}x)")
    print(f"decode median: cartridge {out['median_decode_tps_cartridge']:.1f} tokens/s, dense cache "
          f"{out['median_decode_tps_full']:.1f} tokens/s")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--tier", default="fp16")
    ap.add_argument("--presets", default=None, help="comma-separated presets to compare (e.g. exact,safe)")
    ap.add_argument("--calibrate", action="store_true", help="with --presets: calibrated schemas, as a default build")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    doc = (ROOT / "samples" / "lgpl-3.0.txt").read_text()
    rows = [json.loads(x) for x in (ROOT / "samples" / "lgpl-3.0.questions.jsonl").read_text().splitlines()]
    lm = cartridge.load_model()
    out = compare(args, doc, rows, lm) if args.presets else against_full_prefill(args, doc, rows, lm)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
