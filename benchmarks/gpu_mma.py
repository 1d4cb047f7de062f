"""The fused decode path on the GPU machine, in one run: every variant of the tensor-core kernel
(single launch or two, pipeline depth, blocks) checked against float64, then decode-step attention timed
against dense fp16 SDPA and mlx-lm's quantized attention (32 q / 8 kv heads; calls chained as the layers
of a decode step are), the host cost per layer of a decode step, and
end-to-end decode against a dense fp16 cache.       python3 benchmarks/gpu_mma.py OUT_DIR
"""

import json
import sys
import time

import mlx.core as mx
import numpy as np

from cartridge.attention.cache import CartridgeCache
from cartridge.attention.kernels import cuda
from cartridge.eval import bench

sys.path.insert(0, "benchmarks")
from gpu_check import check, decode_cache, prefix  # noqa: E402

BASE = {"SINGLE_LAUNCH": True, "MMA_TARGET_BLOCKS": cuda.MMA_TARGET_BLOCKS, "MMA_STAGES": cuda.MMA_STAGES}
VARIANTS = {
    "single": {},
    "two-launch": {"SINGLE_LAUNCH": False},
    "single-s4": {"MMA_STAGES": 4},
}


def use(name):
    for key, value in {**BASE, **VARIANTS.get(name, {})}.items():
        setattr(cuda, key, value)


def correctness(rng):
    # (n_q, n_kv, D, N, P, T, L): odd lengths, page boundaries, GQA 1/3/4/8, R <= 4 and the fallbacks
    shapes = [(4, 4, 64, 1, 16, 1, 1), (4, 4, 64, 17, 16, 3, 1), (12, 4, 64, 257, 256, 7, 1),
              (8, 2, 128, 3001, 256, 1, 1), (32, 8, 128, 5003, 256, 1, 1), (32, 8, 64, 4097, 64, 300, 1),
              (2, 2, 128, 1001, 64, 300, 2), (2, 2, 64, 999, 32, 5, 4), (1, 1, 128, 70001, 256, 1, 1),
              (32, 4, 128, 3001, 256, 1, 1)]
    rows, worst = [], 0.0
    use("single")
    for shape in shapes:
        for dtype in (mx.float16, mx.float32):
            err, finite = check("mlx4g32", shape, dtype, rng)
            rows.append({"variant": "single", "shape": shape, "dtype": str(dtype), "rel_err": err, "finite": finite})
            worst = max(worst, err if finite else 1.0)
            if not (err < 1e-3 and finite):
                print("FAIL", shape, dtype, f"{err:.2e}", flush=True)
    print(f"correctness: {len(rows)} checks, worst relative error {worst:.2e}", flush=True)
    return rows


def host_cost():
    """Microseconds per layer of one decode step's cache update + attention, 16 layers built then
    evaluated together on a 1,024-token prefix (device time small): what a decode step pays per layer
    on the host. Baseline: mlx-lm's KVCache + mx.fast attention; also the graph building alone."""
    from mlx_lm.models.cache import KVCache

    n_q, n_kv, D, N = 32, 8, 64, 1024
    k, v = (mx.random.normal((n_kv, N, D)).astype(mx.float16) for _ in range(2))
    q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
    new = q[:, :n_kv]
    mx.eval(k, v, q, new)
    out = {}

    def measure(label, layer):
        mx.eval([layer(i) for i in range(16)])
        t = time.perf_counter()
        for _ in range(20):
            [layer(i) for i in range(16)]
        out[f"{label}_build_us"] = round((time.perf_counter() - t) / 320 * 1e6, 2)
        t = time.perf_counter()
        for _ in range(20):
            mx.eval([layer(i) for i in range(16)])
        out[f"{label}_step_us"] = round((time.perf_counter() - t) / 320 * 1e6, 2)

    for name in ("single", "two-launch"):
        use(name)
        caches = [CartridgeCache(prefix("mlx4g32", k, v, 256)) for _ in range(16)]

        def layer(i):
            caches[i].update_and_fetch(new, new)
            if caches[i].tail_len > 40:
                caches[i].trim(caches[i].tail_len - 1)
            return caches[i].attention(q, D ** -0.5)

        measure(name, layer)
    use("single")
    dense = []
    for _ in range(16):
        c = KVCache()
        c.update_and_fetch(k[None], v[None])
        dense.append(c)
    mx.eval([c.state for c in dense])

    def dense_layer(i):
        keys, values = dense[i].update_and_fetch(new, new)
        if dense[i].offset > N + 40:
            dense[i].trim(dense[i].offset - N - 1)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5)

    measure("kvcache_sdpa", dense_layer)
    print(json.dumps(out), flush=True)
    return out


def timing():
    bw = bench.copy_bandwidth(1 << 30)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    n_q, n_kv = 32, 8
    rows = []
    for D, N in [(128, 32768), (128, 131072), (64, 32768), (64, 65536)]:
        k, v = (mx.random.normal((n_kv, N, D)).astype(mx.float16) for _ in range(2))
        q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
        mx.eval(k, v, q)
        row = {"D": D, "N": N, "sdpa_us": round(bench.timeit(lambda x: mx.fast.scaled_dot_product_attention(
            x, k[None], v[None], scale=D ** -0.5), 50, chain=q) * 1e6, 1)}
        if N == 131072:
            row["mlx_lm_quantized_us"] = round(bench._mlx_lm_quantized(q, k[None], v[None], N, 20)["us"], 1)
        cache = decode_cache("mlx4g32", k, v, q)
        pre = cache.prefix
        row["bytes"] = pre.nbytes
        for name in VARIANTS:
            use(name)
            row[f"{name}_us"] = round(bench.timeit(lambda x: cache.attention(x, D ** -0.5), 50, chain=q) * 1e6, 1)
        use("single")
        best = min(row[f"{name}_us"] for name in VARIANTS)
        row["best_vs_dense"] = round(best / row["sdpa_us"], 3)
        row["best_TBps"] = round(pre.nbytes / best / 1e6, 3)
        row["best_of_copy_bw"] = round(pre.nbytes / (best * 1e-6) / bw, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del k, v, pre, cache
        mx.clear_cache()
    return {"copy_bytes_per_s": bw, "rows": rows}


def end_to_end():
    """Decode tokens/s of a Llama-3.2-1B-shaped model (random fp16 weights, head_dim 64): dense fp16
    KVCache vs an mlx4g32 cartridge through the fused kernel, best of 3 rounds of 32 tokens each."""
    model = bench.random_model("llama3.2-1b")
    bench.POLICIES = ["fused"]
    rows = []
    for n in (32768, 65536):
        for row in bench.end_to_end(model, n, ["mlx4g32"], mx.float16):
            rows.append(row)
            print(json.dumps(row)[:300], flush=True)
    return rows


def main(out):
    print(mx.device_info(), flush=True)
    result = {"device": mx.device_info(), "mlx": mx.__version__}
    for part, run in (("correctness", lambda: correctness(np.random.default_rng(0))), ("host", host_cost),
                      ("timing", timing), ("end_to_end", end_to_end)):
        result[part] = run()
        json.dump(result, open(f"{out}/gpu_mma.json", "w"), indent=1, default=str)  # what is done so far


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
