"""Decode steps of every fused tier with both code lookups, and a question's prefill by kernel or decoded pages.

On the GPU machine, one run (32 q / 8 kv heads, head_dim 128, chained steps as `cartridge bench`):
1. decode step (one query token) per tier at each context, `fused`, beside MLX's dense fp16 SDPA and a bare
   streaming read of the tier's own bytes (gpu_tc.bare_read); the tiers that look codes up (mxfp4, nvfp4,
   TurboQuant, their +rot forms) once with the shared-memory code-pair table and once with the table in
   registers (`cuda.REGISTER_LOOKUP`). The faster lookup per kernel tier at the largest context goes to
   OUT/lookup.json ({"register_lookup": [kernel tier ids]}), which `--bench` runs then use.
2. a question of L tokens (L x 4 query rows per KV head) over the prefix: the fused kernel (row blocks of 8
   streaming the prefix) against the pages decoded for the call and MLX's SDPA (`kernels/dense.py`), beside
   MLX's dense SDPA over the same prefix + question.

    python3 benchmarks/gpu_lookup_prefill.py OUT [--contexts 32768,131072] [--tiers ...] [--prefill-tiers ...]
        [--no-decode] [--json NAME]
"""

import argparse
import json
import time

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx

from cartridge.attention.kernels import cuda
from cartridge.eval import bench
from cartridge.tiers import get_tier
from cartridge.tiers.layout import layout_of

import gpu_tc  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

TIERS = ("fp16,int8,int8+rot,int6,int6+rot,mlx4g32,mlx4g32+rot,kivi4,fp8,mxfp4,mxfp4+rot,nvfp4,nvfp4+rot,"
         "turbo4,turbo3,turbo2")
PREFILL_TIERS = "fp16,int8,mlx4g32,mlx4g32+rot,turbo4,kivi4"
LOOKUP_IDS = frozenset((cuda.MXFP4, cuda.NVFP4, cuda.TURBO))
SHAPE = (32, 8, 128)


def decode_rows(ctx, tiers, result, out):
    n_q, n_kv, D = SHAPE
    k, v = bench._kv(n_kv, ctx, D, seed=ctx)
    q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
    new_k = mx.random.normal((1, n_kv, 1, D)).astype(mx.float16)
    dk, dv = k[None].astype(mx.float16), v[None].astype(mx.float16)
    mx.eval(q, new_k, dk, dv)
    dense = bench.timeit(lambda x: mx.fast.scaled_dot_product_attention(x, dk, dv, scale=D ** -0.5), 20,
                         chain=q) * 1e6
    result["decode"].append({"context": ctx, "tier": "dense fp16", "lookup": None, "us": dense})
    del dk, dv
    for tier in tiers:
        prefix, error = bench._tier_prefix(tier, k, v)
        if prefix is None:
            result["decode"].append({"context": ctx, "tier": tier, "error": error})
            continue
        key = prefix.nbytes // 4096 * 4096
        if key not in result["reads"]:
            result["reads"][key] = gpu_tc.bare_read(q, key)
        spec = cuda.tier_spec(prefix.k_codec, prefix.k_parts)
        for lookup in ("smem", "regs") if spec and spec[0] in LOOKUP_IDS else ("smem",):
            cuda.REGISTER_LOOKUP = LOOKUP_IDS if lookup == "regs" else frozenset()
            us, _, error = bench._time_policy(prefix, "fused", mx.float16, q, new_k, 20)
            row = {"context": ctx, "tier": tier, "lookup": lookup, "us": us, "error": error,
                   "prefix_bytes": prefix.nbytes, "read_us": result["reads"][key],
                   "x_dense": us / dense if us else None, "x_read": us / result["reads"][key] if us else None}
            result["decode"].append(row)
            print(json.dumps(row), flush=True)
        cuda.REGISTER_LOOKUP = frozenset()
        del prefix
        mx.clear_cache()
    json.dump(result, open(out, "w"), indent=1, default=str)


def prefill_rows(ctx, tiers, Ls, result, out):
    n_q, n_kv, D = SHAPE
    k, v = bench._kv(n_kv, ctx, D, seed=ctx)
    saved = cuda.DENSE_MIN_ROWS, cuda.DENSE_MIN_ROWS_OTHER
    for L in Ls:
        q, nk, dk, dv = gpu_tc.question(k, v, n_q, L)
        dense = bench.timeit(lambda x: mx.fast.scaled_dot_product_attention(x, dk, dv, scale=D ** -0.5,
                                                                             mask="causal"), 5, inner=5, chain=q) * 1e6
        base = {"context": ctx, "L": L, "rows": n_q // n_kv * L}
        result["prefill"].append({**base, "tier": "dense fp16", "path": "mlx-sdpa", "us": dense})
        print(json.dumps(result["prefill"][-1]), flush=True)
        del dk, dv
        for tier in tiers:
            prefix, error = bench._tier_prefix(tier, k, v)
            if prefix is None:
                continue
            for path, (table, other) in (("kernel", ({}, 1 << 30)), ("decoded", ({}, 1))):
                cuda.DENSE_MIN_ROWS, cuda.DENSE_MIN_ROWS_OTHER = table, other
                row, cache = {**base, "tier": tier, "path": path, "us": None, "error": None}, None
                try:
                    cache = bench._layer_cache(prefix, "fused", mx.float16, D)
                    cache.update_and_fetch(nk, nk)
                    mx.eval(cache.state)
                    row["us"] = bench.timeit(lambda x: cache.attention(x, D ** -0.5, "causal"), 5, warmup=1, inner=5,
                                             chain=q) * 1e6
                    row["x_dense"] = row["us"] / dense
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"
                result["prefill"].append(row)
                print(json.dumps(row), flush=True)
                del cache
                mx.clear_cache()
            del prefix
        cuda.DENSE_MIN_ROWS, cuda.DENSE_MIN_ROWS_OTHER = saved
        json.dump(result, open(out, "w"), indent=1, default=str)


def choose(result):
    """Kernel tier ids whose register lookup was faster than the shared-memory table at the largest context
    (summed over the tiers of that kernel tier)."""
    ctx = max(r["context"] for r in result["decode"])
    totals = {}
    for r in result["decode"]:
        if r["context"] == ctx and r.get("lookup") and r.get("us"):
            tid = layout_of(get_tier(r["tier"])).tier_id
            if tid in LOOKUP_IDS:
                totals.setdefault(tid, {}).setdefault(r["lookup"], 0.0)
                totals[tid][r["lookup"]] += r["us"]
    return sorted(t for t, v in totals.items() if v.get("regs", 1e30) < v.get("smem", 1e30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--tiers", default=TIERS)
    ap.add_argument("--prefill-tiers", default=PREFILL_TIERS)
    ap.add_argument("--prefill-tokens", default="32,64,128,256")
    ap.add_argument("--no-decode", action="store_true", help="only the prefill rows")
    ap.add_argument("--json", default="h200-lookup-prefill.json", help="file name under OUT")
    args = ap.parse_args()
    path = f"{args.out}/{args.json}"
    result = {"env": bench.environment(), "decode": [], "reads": {}, "prefill": []}
    t = time.time()
    for ctx in map(int, args.contexts.split(",")) if not args.no_decode else ():
        decode_rows(ctx, args.tiers.split(","), result, path)
        print(f"[decode {ctx}: {time.time() - t:.0f}s]", flush=True)
    if result["decode"]:
        result["register_lookup"] = choose(result)
        json.dump({"register_lookup": result["register_lookup"]}, open(f"{args.out}/lookup.json", "w"))
    if args.prefill_tiers:
        for ctx in map(int, args.contexts.split(",")):
            prefill_rows(ctx, args.prefill_tiers.split(","), [int(x) for x in args.prefill_tokens.split(",")],
                         result, path)
            print(f"[prefill {ctx}: {time.time() - t:.0f}s]", flush=True)
    print("\ncontext tier lookup us x_dense x_read")
    for r in result["decode"]:
        if r.get("us"):
            print(r["context"], r["tier"], r.get("lookup"), round(r["us"], 1), round(r.get("x_dense") or 1, 3),
                  round(r.get("x_read") or 0, 3))
    print("register lookups:", result.get("register_lookup"))
    for r in result["prefill"]:
        print("prefill", r["context"], r["rows"], r["tier"], r["path"], round(r["us"] or -1, 1),
              round(r.get("x_dense") or 1, 3), r.get("error") or "")


if __name__ == "__main__":
    main()
