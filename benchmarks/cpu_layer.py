"""CPU time of one layer's prefix part of a decode step, per way of holding its pages (issue 18, item 3).

The memory benchmark's case: 6,450 prefix tokens in pages of 256, 8 KV heads x head_dim 128, GQA 2 (2
query rows per KV head). Each row is `cartridge.attention.kernels.portable.prefix_partial` (scores, the
masked softmax numerators, p.V) over pages held one way; the `scores` rows are the q.K^T part alone. One
thread (run with OPENBLAS_NUM_THREADS=1; the split over CPU streams is off), CPU time of the process per
call (median of rounds x repeats): on a shared machine the wall time mostly measures the other jobs.

    OPENBLAS_NUM_THREADS=1 python benchmarks/cpu_layer.py [--json benchmarks/results/cpu-layer.json]
"""

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import cartridge  # noqa: F401  (before mlx: loads OpenBLAS)
import mlx.core as mx

from cartridge.attention import policy, unpacked
from cartridge.attention.kernels import portable
from cartridge.attention.pages import make_prefix
from cartridge.tiers import TIERS

N_KV, HEAD_DIM, TOKENS, PAGE, ROWS = 8, 128, 6450, 256, 2
ROOT = Path(__file__).resolve().parent.parent


def cases():
    """{name: callable} of the ways to hold one layer, evaluated once before timing."""
    mx.random.seed(0)
    k, v = mx.random.normal((N_KV, TOKENS, HEAD_DIM)), mx.random.normal((N_KV, TOKENS, HEAD_DIM))
    q = mx.random.normal((N_KV, ROWS, HEAD_DIM)) * HEAD_DIM ** -0.5
    out = {}
    fp16 = make_prefix(TIERS["fp16"], k, TIERS["fp16"], v, PAGE)
    for name, dtype in (("float32", mx.float32), ("float16", mx.float16), ("bfloat16", mx.bfloat16)):
        dense = policy.dequantize(fp16, dtype)
        mx.eval(dense.k_parts, dense.v_parts)
        out[f"dense {name} pages"] = lambda p=dense: portable.prefix_partial(q, p, TOKENS)
        out[f"dense {name} pages: scores"] = lambda p=dense: p.k_codec.scores(q, p.k_parts, None)
    for tier in ("int8", "mlx4g32", "mxfp4"):
        c = TIERS[tier]
        stored = make_prefix(c, k, c, v, PAGE)
        mx.eval(stored.k_parts, stored.v_parts)
        out[f"{tier} stored pages"] = lambda p=stored: portable.prefix_partial(q, p, TOKENS)
        out[f"{tier} stored pages: scores"] = lambda p=stored: p.k_codec.scores(q, p.k_parts, p.k_params)
        out[f"{tier} stored pages: p.V"] = lambda p=stored: p.v_codec.weighted_values(
            mx.ones((p.k_parts["codes"].shape[0], N_KV, ROWS, PAGE)), p.v_parts, p.v_params)
        if unpacked.can_unpack(c):
            u = replace(stored, k_codec=unpacked.UnpackedCodec(c), k_parts=unpacked.unpack(c, stored.k_parts))
            mx.eval(u.k_parts)
            out[f"{tier} K unpacked, V stored"] = lambda p=u: portable.prefix_partial(q, p, TOKENS)
            out[f"{tier} K unpacked: scores"] = lambda p=u: p.k_codec.scores(q, p.k_parts, p.k_params)
            out[f"{tier} K unpacked: float32 cast of the codes"] = lambda p=u: p.k_parts["codes"].astype(mx.float32)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "cpu-layer.json"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    portable.CPU_SPLIT_PAGES = 1 << 30
    todo = cases()
    times = {name: [] for name in todo}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):  # rounds interleave the cases: a burst of load spreads over all of them
        for name, f in todo.items():
            mx.eval(f())
            for _ in range(args.repeats):
                t = time.process_time()
                mx.eval(f())
                times[name].append(time.process_time() - t)
    load.append(os.getloadavg()[0])
    rows = []
    for name, ts in times.items():
        ts.sort()
        rows.append({"case": name, "cpu_ms_median": 1e3 * ts[len(ts) // 2], "cpu_ms_best": 1e3 * ts[0]})
        print(f"{name:<44} {rows[-1]['cpu_ms_median']:7.2f} ms CPU (best {rows[-1]['cpu_ms_best']:.2f})")
    result = {"shape": {"tokens": TOKENS, "page_size": PAGE, "n_kv_heads": N_KV, "head_dim": HEAD_DIM,
                        "query_rows": ROWS}, "threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
              "machine": f"{platform.machine()} ({os.cpu_count()} cores, shared)", "load_average": load,
              "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
