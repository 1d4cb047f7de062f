"""Decode-step CPU time of the memory benchmark's case per attention policy, in interleaved rounds
(issue 18, item 3: `auto` under its memory budget against `dequantize-once`).

The case of benchmarks/memory.py (its cartridges under --work, made by it): a tiny random-weight llama,
8 layers, 8 KV heads x head_dim 128, a 6,450-token prefix. A child process loads one tier under every
policy, then in each round prefills the question into a fresh cache of each and times `--steps` greedy
decode steps (model call + argmax, evaluated), and the same with an empty mlx-lm cache (the model's
own cost, "no-prefix"). Reported: the median over rounds and steps of the process's CPU time per step,
and of the wall time. One thread by default (OPENBLAS_NUM_THREADS=1, the portable path's split over
CPU streams off): the CPU time is then the work of a step, which a shared machine disturbs least.
`--compare DIR` alternates child processes with the `cartridge` package of another checkout.

    python benchmarks/cpu_decode.py [--tiers int8,mlx4g32,mxfp4] [--compare DIR] [--repeat 3]
                                    [--json benchmarks/results/cpu-decode.json]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Who may copy the library, and under which conditions?"


def child(work, tier, policies, rounds, steps, one_thread):
    """{policy: [(wall_s, cpu_s) per step]} for one tier, policies measured in interleaved rounds."""
    import cartridge
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    if one_thread:
        from cartridge.attention.kernels import portable

        portable.CPU_SPLIT_PAGES = 1 << 30
    lm = cartridge.load_model(str(work / "model"))
    carts = {p: cartridge.load(work / f"{tier}.cart", model=lm, attention=p) for p in policies}
    makers = {p: c.prompt_cache for p, c in carts.items()}
    makers["no-prefix"] = lambda: make_prompt_cache(lm.model)
    prompt = mx.array(carts[policies[0]].question_prompt(QUESTION))[None]
    out = {p: [] for p in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            cache = make()
            tok = mx.argmax(lm.model(prompt, cache=cache)[:, -1], axis=-1)
            mx.eval(tok)
            for _ in range(steps):
                t, c = time.perf_counter(), time.process_time()
                tok = mx.argmax(lm.model(tok[:, None], cache=cache)[:, -1], axis=-1)
                mx.eval(tok)
                out[name].append((time.perf_counter() - t, time.process_time() - c))
    plans = {p: {"policy": c.attention, "resident_bytes": c.plan["memory"]["resident_bytes"]}
             for p, c in carts.items()}
    return {"steps": out, "plans": plans}


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiers", default="int8,mlx4g32,mxfp4")
    ap.add_argument("--policies", default="dequantize-once,auto,portable")
    ap.add_argument("--work", default="/tmp/cart-mem")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3, help="child processes per (code, tier), alternated")
    ap.add_argument("--threads", choices=["one", "default"], default="one")
    ap.add_argument("--compare", help="another checkout whose cartridge package is measured alternately")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "cpu-decode.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # tier, code label
    args = ap.parse_args()
    work, policies, one = Path(args.work), args.policies.split(","), args.threads == "one"
    if args.child:
        print(json.dumps(child(work, args.child[0], policies, args.rounds, args.steps, one)))
        return
    roots = {"this": ROOT, **({"compare": Path(args.compare).resolve()} if args.compare else {})}
    found, plans, loads = {}, {}, []
    for _ in range(args.repeat):
        for tier in args.tiers.split(","):
            for label, root in roots.items():
                env = {**os.environ, "PYTHONPATH": str(root), **({"OPENBLAS_NUM_THREADS": "1"} if one else {})}
                loads.append(os.getloadavg()[0])
                cmd = [sys.executable, __file__, "--child", tier, label, "--work", str(work),
                       "--policies", args.policies, "--rounds", str(args.rounds), "--steps", str(args.steps),
                       "--threads", args.threads]
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode:
                    sys.exit(f"{tier} ({label}): failed\n{done.stderr[-2000:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                for policy, steps in got["steps"].items():
                    found.setdefault((label, tier, policy), []).extend(steps)
                plans.update({(label, tier, p): v for p, v in got["plans"].items()})
    rows = []
    for (label, tier, policy), steps in found.items():
        row = {"code": label, "tier": tier, "asked": policy, **plans.get((label, tier, policy), {}),
               "cpu_ms_per_step": 1e3 * _median([c for _, c in steps]),
               "wall_ms_per_step": 1e3 * _median([w for w, _ in steps]), "steps": len(steps)}
        rows.append(row)
        print(f"{label:<8} {tier:<8} {policy:<16} -> {row.get('policy', '-'):<22} "
              f"{row['cpu_ms_per_step']:7.1f} ms CPU, {row['wall_ms_per_step']:7.1f} ms wall per step "
              f"({len(steps)} steps)")
    import platform

    import cartridge  # noqa: F401  (before mlx)
    import mlx.core as mx

    Path(args.json).write_text(json.dumps({
        "threads": args.threads, "compare": args.compare,
        "machine": f"{platform.machine()} ({os.cpu_count()} cores, shared)",
        "load_average": [min(loads), max(loads)], "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d"),
        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
