"""How chained attention is timed on the GPU machine: a short chain evaluated at once (host encoding, then
device time) against the steady-state cost of one more call in a long chain (`bench.timeit`), for a
trivial custom kernel (host encoding alone), dense fp16 SDPA, mlx-lm's quantized attention and the fused
mlx4g32 kernel and its launch variants (32 q / 8 kv heads, head_dim 128, fp16); with "sweep", the fused
kernel alone over context lengths, also with pass 1's copies alone and its math alone (`cuda.MMA_DIAG`),
to separate a fixed cost per call from the streaming rate; with "blocks", the fused step over pass-1
block counts (`cuda.MMA_TARGET_BLOCKS`).
                                           python3 benchmarks/gpu_timing.py OUT_DIR [sweep|blocks|stages]
Results: results/h200-gpu-timing.json (the first form, before the integer-score kernel),
results/h200-sweep-*.json (earlier forms of the sweep: fp16-scores and int8-scores timed 16K-256K at
528 and 264 or 660 blocks with DIAG 0-2; l2-prefetch compiled the copies with cp.async's L2::256B hint,
since removed as slower; warps-stages-finish is this form), results/h200-blocks-sweep.json,
results/h200-stages-sweep.json.
"""

import json
import sys
import time

import mlx.core as mx
import numpy as np

from cartridge.attention.kernels import cuda
from cartridge.eval import bench

sys.path.insert(0, "benchmarks")
from gpu_check import check, decode_cache  # noqa: E402


def random_kv(n_kv, N, D):
    """K and V (n_kv, N, D) float16, standard normal."""
    return [mx.random.normal((n_kv, N, D)).astype(mx.float16) for _ in range(2)]

VARIANTS = {"single": {}, "two-launch": {"SINGLE_LAUNCH": False}, "stages4": {"MMA_STAGES": 4},
            "blocks1056": {"MMA_TARGET_BLOCKS": 1056}, "blocks264": {"MMA_TARGET_BLOCKS": 264}}
BASE = {"SINGLE_LAUNCH": True, "MMA_TARGET_BLOCKS": cuda.MMA_TARGET_BLOCKS, "MMA_STAGES": cuda.MMA_STAGES}


def use(name):
    for key, value in {**BASE, **VARIANTS[name]}.items():
        setattr(cuda, key, value)


def short_chain(fn, x, n=10, repeats=20):
    """The earlier method: a chain of n calls evaluated at once, seconds per call (median)."""
    times = []
    for i in range(repeats + 3):
        y = x
        for _ in range(n):
            y = fn(y)
        t = time.perf_counter()
        mx.eval(y)
        if i >= 3:
            times.append((time.perf_counter() - t) / n)
    return sorted(times)[len(times) // 2]


def both(fn, x, repeats=20, inner=None):
    return {"short_chain_us": round(short_chain(fn, x) * 1e6, 1),
            "steady_us": round(bench.timeit(fn, repeats, inner=inner, chain=x) * 1e6, 1)}


def sweep(out):
    result = {"device": mx.device_info(), "mlx": mx.__version__, "rows": []}
    rng = np.random.default_rng(1)
    for warps in (4, 8):  # the 8-warp block is checked against float64 before it is timed
        cuda.MMA_WARPS, cuda.MMA_TARGET_BLOCKS = warps, 528 * 4 // warps
        for shape in [(32, 8, 128, 5003, 256, 1, 1), (8, 2, 64, 3001, 256, 1, 1), (4, 4, 128, 70001, 256, 7, 1)]:
            try:
                err, finite = check("mlx4g32", shape, mx.float16, rng)
            except Exception as e:  # e.g. more shared memory than a block may have
                print("check", warps, shape, "failed:", e, flush=True)
                break
            result.setdefault("checks", []).append({"warps": warps, "shape": shape, "rel_err": err, "finite": finite})
            print("check", warps, shape, f"{err:.2e}", finite, flush=True)
    cuda.MMA_WARPS, cuda.MMA_TARGET_BLOCKS = 4, BASE["MMA_TARGET_BLOCKS"]
    result["copy_bytes_per_s"] = bench.copy_bandwidth(1 << 30)
    print(f"copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    n_q, n_kv, D = 32, 8, 128
    q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
    for N in (32768, 131072, 262144):
        cache = decode_cache("mlx4g32", *random_kv(n_kv, N, D), q)
        row = {"N": N, "bytes": cache.prefix.nbytes}
        for warps, stages in ((4, 3), (4, 4), (8, 3)):
            for diag in ((0, 1, 2, 3) if (warps, stages) == (4, 3) else (0,)):
                use("single")
                cuda.MMA_WARPS, cuda.MMA_STAGES, cuda.MMA_DIAG = warps, stages, diag
                cuda.MMA_TARGET_BLOCKS = 528 * 4 // warps
                try:
                    us = round(bench.timeit(lambda x: cache.attention(x, D ** -0.5), 10, chain=q) * 1e6, 1)
                except Exception as e:
                    us = str(e)[:200]
                row[f"w{warps}s{stages}_d{diag}_us"] = us
        cuda.MMA_WARPS = 4
        cuda.MMA_DIAG = 0
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        json.dump(result, open(f"{out}/gpu_sweep.json", "w"), indent=1, default=str)
        del cache
        mx.clear_cache()


def blocks(out):
    n_q, n_kv, D = 32, 8, 128
    q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
    result = {"device": mx.device_info(), "mlx": mx.__version__, "rows": []}
    for N, counts in ((32768, (132, 198, 264, 528)), (65536, (132, 198, 264, 528)),
                      (131072, (132, 198, 264, 330, 396, 462, 528, 594))):
        cache = decode_cache("mlx4g32", *random_kv(n_kv, N, D), q)
        for _ in range(2):
            row = {"N": N}
            for b in counts:
                cuda.MMA_TARGET_BLOCKS = b
                row[b] = round(bench.timeit(lambda x: cache.attention(x, D ** -0.5), 10, chain=q) * 1e6, 1)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        del cache
        mx.clear_cache()
    json.dump(result, open(f"{out}/gpu_blocks.json", "w"), indent=1, default=str)


def stages(out):
    """Pipeline depth at fewer blocks per SM: bytes in flight per SM without more warps competing."""
    rng = np.random.default_rng(2)
    result = {"device": mx.device_info(), "mlx": mx.__version__, "checks": [], "rows": []}
    for st in (5, 8):
        cuda.MMA_STAGES = st
        for shape in [(32, 8, 128, 5003, 256, 1, 1), (4, 4, 64, 70001, 256, 7, 1)]:
            try:
                err, finite = check("mlx4g32", shape, mx.float16, rng)
            except Exception as e:
                err, finite = str(e)[:200], False
            result["checks"].append({"stages": st, "shape": shape, "rel_err": err, "finite": finite})
            print("check", st, shape, err, finite, flush=True)
    n_q, n_kv, D = 32, 8, 128
    q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
    for N in (32768, 131072):
        cache = decode_cache("mlx4g32", *random_kv(n_kv, N, D), q)
        for _ in range(2):
            row = {"N": N}
            for b, st in ((264, 3), (264, 4), (264, 5), (264, 6), (264, 8), (396, 3), (396, 5), (528, 3)):
                cuda.MMA_TARGET_BLOCKS, cuda.MMA_STAGES = b, st
                try:
                    us = round(bench.timeit(lambda x: cache.attention(x, D ** -0.5), 10, chain=q) * 1e6, 1)
                except Exception as e:
                    us = str(e)[:120]
                row[f"b{b}_s{st}"] = us
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            json.dump(result, open(f"{out}/gpu_stages.json", "w"), indent=1, default=str)
        del cache
        mx.clear_cache()
    cuda.MMA_TARGET_BLOCKS, cuda.MMA_STAGES = BASE["MMA_TARGET_BLOCKS"], BASE["MMA_STAGES"]


def main(out):
    result = {"device": mx.device_info(), "mlx": mx.__version__}

    def save():
        json.dump(result, open(f"{out}/gpu_timing.json", "w"), indent=1, default=str)

    bw = bench.copy_bandwidth(1 << 30)
    result["copy_bytes_per_s"] = bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    n_q, n_kv, D = 32, 8, 128
    q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
    mx.eval(q)
    null = mx.fast.cuda_kernel(name="null_copy", input_names=["x"], output_names=["y"],
                               source="const int i = threadIdx.x + blockIdx.x * blockDim.x;\n"
                                      "if (i < 4096) y[i] = x[i];  // the (1, 32, 1, 128) queries\n")
    result["null_kernel"] = both(lambda x: null(inputs=[x], grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
                                                output_shapes=[x.shape], output_dtypes=[x.dtype])[0], q)
    print("null", result["null_kernel"], flush=True)
    save()
    result["rows"] = []
    for N in (32768, 131072):
        k, v = (mx.random.normal((n_kv, N, D)).astype(mx.float16) for _ in range(2))
        mx.eval(k, v)
        row = {"N": N, "dense_bytes": 2 * k.nbytes}
        row["sdpa"] = both(lambda x: mx.fast.scaled_dot_product_attention(x, k[None], v[None], scale=D ** -0.5), q)
        print(N, "sdpa", row["sdpa"], flush=True)
        if N == 131072:
            row["mlx_lm"] = bench._mlx_lm_quantized(q, k[None], v[None], N, 10)
            print(N, "mlx-lm", row["mlx_lm"], flush=True)
        cache = decode_cache("mlx4g32", k, v, q)
        row["bytes"] = cache.prefix.nbytes
        for name in VARIANTS:
            use(name)
            row[name] = both(lambda x: cache.attention(x, D ** -0.5), q)
            row[name]["TBps"] = round(cache.prefix.nbytes / row[name]["steady_us"] / 1e6, 3)
            print(N, name, row[name], flush=True)
        use("single")
        result["rows"].append(row)
        save()
        del k, v, cache
        mx.clear_cache()


if __name__ == "__main__":
    if sys.argv[2:] == ["sweep"]:
        sweep(sys.argv[1])
    elif sys.argv[2:] == ["blocks"]:
        blocks(sys.argv[1])
    elif sys.argv[2:] == ["stages"]:
        stages(sys.argv[1])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else ".")
