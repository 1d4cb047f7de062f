"""Tensor-core pass 1 (mlx4g32 pages) on the GPU machine: correctness against float64 with it on and
off, then decode-step attention timing against dense fp16 SDPA and the CUDA-core kernel.
    python3 benchmarks/gpu_mma.py OUT_DIR
"""

import json
import sys
import time

import mlx.core as mx
import numpy as np

from cartridge.cache import CartridgeCache
from cartridge.kernels import cuda

sys.path.insert(0, "benchmarks")
from gpu_check import check, prefix  # noqa: E402


def correctness(rng):
    # (n_q, n_kv, D, N, P, T, L): odd lengths, page boundaries, GQA 1/3/4 and a GQA-8 fallback, R <= 4
    shapes = [(4, 4, 64, 1, 16, 1, 1), (4, 4, 64, 17, 16, 3, 1), (12, 4, 64, 257, 256, 7, 1),
              (8, 2, 128, 3001, 256, 1, 1), (32, 8, 128, 5003, 256, 1, 1), (32, 8, 64, 4097, 64, 300, 1),
              (2, 2, 128, 1001, 64, 300, 2), (2, 2, 64, 999, 32, 5, 4), (1, 1, 128, 70001, 256, 1, 1),
              (32, 4, 128, 3001, 256, 1, 1)]
    rows, worst = [], 0.0
    for tc in (True, False):
        cuda.TENSOR_CORES = tc
        for shape in shapes:
            err, finite = check("mlx4g32", shape, mx.float16, rng)
            rows.append({"tensor_cores": tc, "shape": shape, "rel_err": err, "finite": finite})
            worst = max(worst, err if finite else 1.0)
            print(("ok  " if err < 1e-3 and finite else "FAIL"), tc, shape, f"{err:.2e}", flush=True)
    cuda.TENSOR_CORES = True
    print(f"correctness: worst {worst:.2e}", flush=True)
    return rows


def timing():
    from cartridge.bench import copy_bandwidth, timeit

    bw = copy_bandwidth(1 << 30)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    n_q, n_kv = 32, 8
    out = []
    for D, N in [(128, 8192), (128, 32768), (128, 65536), (128, 131072), (64, 32768), (64, 65536)]:
        k, v = (mx.random.normal((n_kv, N, D)).astype(mx.float16) for _ in range(2))
        q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
        mx.eval(k, v, q)
        row = {"D": D, "N": N, "sdpa_us": round(timeit(lambda: mx.fast.scaled_dot_product_attention(
            q, k[None], v[None], scale=D ** -0.5)) * 1e6, 1)}
        pre = prefix("mlx4g32", k, v, 256)
        row["bytes"] = pre.nbytes
        cache = CartridgeCache(pre)
        cache.update_and_fetch(q[:, :n_kv], q[:, :n_kv])
        mx.eval(cache.state)
        cuda.TENSOR_CORES = False
        row["cudacore_us"] = round(timeit(lambda: cache.attention(q, D ** -0.5)) * 1e6, 1)
        cuda.TENSOR_CORES = True
        for blocks in (264, 528):
            for stages in (3, 4):
                cuda.MMA_TARGET_BLOCKS, cuda.MMA_STAGES = blocks, stages
                t = timeit(lambda: cache.attention(q, D ** -0.5))
                row[f"mma_b{blocks}s{stages}_us"] = round(t * 1e6, 1)
        cuda.MMA_TARGET_BLOCKS, cuda.MMA_STAGES = 528, 3
        t0 = time.perf_counter()
        for _ in range(200):
            cache.attention(q, D ** -0.5)
        row["build_graph_us"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
        t0 = time.perf_counter()
        for _ in range(200):
            mx.fast.scaled_dot_product_attention(q, k[None], v[None], scale=D ** -0.5)
        row["sdpa_build_graph_us"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
        best = min(val for key, val in row.items() if key.startswith("mma_"))
        row["mma_best_TBps"] = round(pre.nbytes / best / 1e6, 3)
        out.append(row)
        print(json.dumps(row), flush=True)
        del k, v, pre, cache
        mx.clear_cache()
    return {"copy_bytes_per_s": bw, "rows": out}


def main(out):
    print(mx.device_info(), flush=True)
    print("tensor cores:", cuda.has_tensor_cores(), flush=True)
    rows = correctness(np.random.default_rng(0))
    t = timing()
    json.dump({"device": mx.device_info(), "correctness": rows, "timing": t},
              open(f"{out}/gpu_mma.json", "w"), indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
