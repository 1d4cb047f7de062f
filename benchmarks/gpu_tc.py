"""Tensor-core pass 1 for every tier (`flash_pass1_tc`), on the GPU machine, in one run: the fused decode step of
each tier beside MLX's dense fp16 SDPA (32 q / 8 kv heads, head_dim 128, chained steps as `cartridge bench`), a
bare streaming read of each tier's prefix bytes (`gpu_floor.py`'s kernel, three launch shapes that were fastest
there), and multi-token queries (32 and 256 query tokens over the prefix) against MLX's dense attention.
                                 python3 benchmarks/gpu_tc.py OUT_DIR [contexts] [tiers]
"""

import json
import sys
import time

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx

from cartridge.attention.pages import make_prefix
from cartridge.eval import bench
from cartridge.tiers import TIERS

sys.path.insert(0, "benchmarks")
from gpu_floor import READ_SRC  # noqa: E402

TIERS_ALL = "fp16,bf16,int8,fp8,mlx4g32,mxfp4,nvfp4,turbo4,turbo3,turbo2"
SHAPES = ((4, 512, 1056), (4, 512, 2112), (8, 512, 528))  # (loads in flight, threads, blocks)


def bare_read(q, nbytes):
    buf = mx.zeros((nbytes // 4,), dtype=mx.uint32)
    nv = mx.array([nbytes // 16], dtype=mx.int64)
    mx.eval(buf, nv)
    best = None
    for unroll, threads, blocks in SHAPES:
        kernel = mx.fast.cuda_kernel(name=f"tc_floor_read_u{unroll}", input_names=["buf", "n_vec", "q"],
                                     output_names=["out", "sink"], source=f"constexpr int U = {unroll};\n" + READ_SRC)

        def step(x):
            return kernel(inputs=[buf, nv, x], grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
                          output_shapes=[x.shape, (blocks,)], output_dtypes=[x.dtype, mx.uint32])[0]
        us = bench.timeit(step, 10, chain=q) * 1e6
        best = us if best is None else min(best, us)
    del buf
    mx.clear_cache()
    return best


def question(k, v, n_q, L):
    """A question of L tokens over the prefix K, V (n_kv, N, D): its queries (1, n_q, L, D) and K/V (1, n_kv, L, D,
    one array for both), and the dense fp16 K and V (1, n_kv, N + L, D) of prefix + question, evaluated."""
    n_kv, _, D = k.shape
    q = mx.random.normal((1, n_q, L, D)).astype(mx.float16)
    nk = mx.random.normal((1, n_kv, L, D)).astype(mx.float16)
    dk = mx.concatenate([k[None].astype(mx.float16), nk], axis=2)
    dv = mx.concatenate([v[None].astype(mx.float16), nk], axis=2)
    mx.eval(q, nk, dk, dv)
    return q, nk, dk, dv


def multi_token(n_tokens, tiers, Ls=(32, 256)):
    """Attention of L query tokens (causal among themselves) over the prefix: fused per tier and MLX dense fp16."""
    n_q, n_kv, D = 32, 8, 128
    k, v = bench._kv(n_kv, n_tokens, D, seed=n_tokens)
    rows = []
    for L in Ls:
        q, nk, dk, dv = question(k, v, n_q, L)
        us = bench.timeit(lambda x: mx.fast.scaled_dot_product_attention(x, dk, dv, scale=D ** -0.5, mask="causal"),
                          5, chain=q) * 1e6
        rows.append({"L": L, "context": n_tokens, "tier": "dense fp16", "policy": "mlx-sdpa", "us": us})
        print(json.dumps(rows[-1]), flush=True)
        del dk, dv
        for tier in tiers:
            codec = TIERS[tier]
            prefix = make_prefix(codec, k, codec, v, bench.PAGE_SIZE)
            row = {"L": L, "context": n_tokens, "tier": tier, "policy": "fused", "us": None, "error": None}
            try:
                cache = bench._layer_cache(prefix, "fused", mx.float16, D)
                cache.update_and_fetch(nk, nk)
                mx.eval(cache.state)
                row["us"] = bench.timeit(lambda x: cache.attention(x, D ** -0.5, "causal"), 5, chain=q) * 1e6
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            del prefix
            mx.clear_cache()
    return rows


def main(out, contexts="32768,131072", tiers=TIERS_ALL, multi="fp16,int8,mlx4g32,turbo4"):
    tiers = tiers.split(",")
    result = {"env": bench.environment(), "attention": [], "reads": {}, "multi": []}
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
    mx.eval(q)
    bench.POLICIES = ["fused"]
    t = time.time()
    for ctx in map(int, contexts.split(",")):
        rows = bench.attention_step((32, 8, 128), ctx, tiers)
        result["attention"] += rows
        dense = next(r["us"] for r in rows if r["policy"] == "mlx-sdpa")
        for r in rows:
            if r["kind"] == "cartridge" and r["us"]:
                key = (r["prefix_bytes"] // 4096) * 4096
                if key not in result["reads"]:
                    result["reads"][key] = bare_read(q, key)
                r["read_us"] = result["reads"][key]
                r["x_dense"] = r["us"] / dense
                r["x_read"] = r["us"] / r["read_us"]
            print(json.dumps({k: r[k] for k in r if k != "error" or r[k]}), flush=True)
        print(f"[{time.time() - t:.0f}s]", flush=True)
        json.dump(result, open(f"{out}/h200-tc.json", "w"), indent=1, default=str)
    if multi:
        for ctx in (32768, 131072):
            result["multi"] += multi_token(ctx, multi.split(","))
            json.dump(result, open(f"{out}/h200-tc.json", "w"), indent=1, default=str)
    print("\ncontext tier us x_dense x_read")
    for r in result["attention"]:
        if r["kind"] == "cartridge":
            print(r["context"], r["tier"], round(r["us"] or -1, 1), round(r.get("x_dense", -1), 3),
                  round(r.get("x_read", -1), 3), r.get("error") or "")
    for r in result["multi"]:
        print("multi", r["context"], r["L"], r["tier"], round(r["us"] or -1, 1), r.get("error") or "")


if __name__ == "__main__":
    main(*sys.argv[1:])
