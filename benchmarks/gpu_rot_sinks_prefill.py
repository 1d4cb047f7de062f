"""One H200 run for issues 17-19: the fused +rot tiers against their unrotated tiers (decode step), sinks on
the fused path, and where a question's prefill should leave the fused kernel for MLX's SDPA over the pages
decoded for the call (`kernels/dense.py`, `cuda.DENSE_MIN_ROWS`), by query rows. Shape 32 q / 8 kv heads,
head_dim 128, chained steps as `cartridge bench`.
                                 python3 benchmarks/gpu_rot_sinks_prefill.py OUT_DIR [prefill-only CONTEXT]
"""

import json
import sys
import time

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx

from cartridge.attention.kernels import cuda
from cartridge.attention.pages import make_prefix
from cartridge.eval import bench
from cartridge.tiers import TIERS

SHAPE = (32, 8, 128)
ROT_TIERS = ["int8", "int8+rot", "mlx4g32", "mlx4g32+rot", "mxfp4", "mxfp4+rot", "nvfp4", "nvfp4+rot", "kivi4"]
PREFILL_TIERS = ["fp16", "int8", "mlx4g32", "turbo4", "mlx4g32+rot", "nvfp4"]
QUERY_TOKENS = (16, 32, 64, 128, 256)
if len(sys.argv) > 2:  # the 131,072-token follow-up: the crossover rows only
    PREFILL_TIERS, QUERY_TOKENS = ["fp16", "int8", "mlx4g32", "turbo4", "mlx4g32+rot"], (64, 128, 256)


def prefill_rows(ctx, save=lambda what: None):
    n_q, n_kv, D = SHAPE
    k, v = bench._kv(n_kv, ctx, D, seed=ctx)
    rows = []
    for L in QUERY_TOKENS:
        rows += [r for r in bench.multi_token_step(SHAPE, ctx, [], L) if r["kind"] == "baseline"]
        print(json.dumps(rows[-1]), flush=True)
    for tier in PREFILL_TIERS:
        codec = TIERS[tier]
        prefix = make_prefix(codec, k, codec, v, bench.PAGE_SIZE)
        for L in QUERY_TOKENS:
            q = mx.random.normal((1, n_q, L, D)).astype(mx.float16)
            nk = mx.random.normal((1, n_kv, L, D)).astype(mx.float16)
            cache = bench._layer_cache(prefix, "fused", mx.float16, D)
            cache.update_and_fetch(nk, nk)
            mx.eval(q, cache.state)
            for path, rows_from in (("kernel", 1 << 30), ("dense-sdpa", 1)):
                cuda.DENSE_MIN_ROWS, cuda.DENSE_MIN_ROWS_OTHER = {}, rows_from
                us = bench.timeit(lambda x: cache.attention(x, D ** -0.5, "causal"), 5, chain=q) * 1e6
                rows.append({"context": ctx, "tier": tier, "query_tokens": L, "query_rows": n_q // n_kv * L,
                             "path": path, "us": us})
                print(json.dumps(rows[-1]), flush=True)
        del prefix
        mx.clear_cache()
        save(rows)
    return rows


def sinks_rows(ctx):
    n_q, n_kv, D = SHAPE
    k, v = bench._kv(n_kv, ctx, D, seed=ctx)
    q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
    sinks = mx.random.normal((n_q,)).astype(mx.float16)
    rows = []
    for tier in ("fp16", "mlx4g32", "mlx4g32+rot"):
        codec = TIERS[tier]
        prefix = make_prefix(codec, k, codec, v, bench.PAGE_SIZE)
        for policy in ("fused", "portable"):
            cache = bench._layer_cache(prefix, policy, mx.float16, D)
            cache.update_and_fetch(q[:, :n_kv], q[:, :n_kv])
            mx.eval(cache.state)
            for s in (None, sinks):
                us = bench.timeit(lambda x: cache.attention(x, D ** -0.5, None, s), 10, chain=q) * 1e6
                rows.append({"context": ctx, "tier": tier, "policy": policy, "sinks": s is not None, "us": us})
                print(json.dumps(rows[-1]), flush=True)
        del prefix
        mx.clear_cache()
    return rows


def main(out, only=None, ctx=None):
    cuda.ROTATED_FUSED = cuda.SINKS_FUSED = True  # what the GPU tests of this run check
    result = {"env": bench.environment(), "decode": [], "prefill": [], "sinks": []}
    t = time.time()
    if only == "prefill-only":
        def part(rows):
            result["prefill"] = rows
            json.dump(result, open(f"{out}/h200-prefill-{ctx}.json", "w"), indent=1, default=str)
            print(f"[{time.time() - t:.0f}s]", flush=True)
        prefill_rows(int(ctx), part)
        return

    def save(what):
        json.dump(result, open(f"{out}/h200-rot-sinks-prefill.json", "w"), indent=1, default=str)
        print(f"[{time.time() - t:.0f}s] {what}", flush=True)
    bench.POLICIES = ["fused", "dequantize-once"]
    for ctx in (32768, 131072):
        result["decode"] += bench.attention_step(SHAPE, ctx, ROT_TIERS, repeats=10)
        save(f"decode {ctx}")
    result["sinks"] += sinks_rows(131072)
    save("sinks")
    for ctx in (32768, 131072):
        result["prefill"] += prefill_rows(ctx)
        save(f"prefill {ctx}")
    dense = {r["context"]: r["us"] for r in result["decode"] if r["policy"] == "mlx-sdpa"}
    print("\ndecode: context tier policy us x_dense")
    for r in result["decode"]:
        if r["kind"] == "cartridge" and r["us"]:
            print(r["context"], r["tier"], r["policy"], round(r["us"], 1), round(r["us"] / dense[r["context"]], 3))
    base = {(r["context"], r["query_tokens"]): r["us"] for r in result["prefill"] if r.get("policy") == "mlx-sdpa"}
    print("\nprefill: context L tier path us x_dense")
    for r in result["prefill"]:
        if "path" in r:
            print(r["context"], r["query_tokens"], r["tier"], r["path"], round(r["us"], 1),
                  round(r["us"] / base[(r["context"], r["query_tokens"])], 3))


if __name__ == "__main__":
    main(*sys.argv[1:])
