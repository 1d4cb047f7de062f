"""Early check of the fused CUDA kernels on layouts made with mx.quantize (int8/mlx4g32 affine g32,
mxfp8) and dense fp16/bf16/fp32, against float64; then a small timing table. Run on the GPU machine:
    python3 benchmarks/gpu_check.py OUT_DIR
"""

import json
import sys

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from cartridge.attention.cache import CartridgeCache, LayerPrefix
from cartridge.attention.kernels import cuda
from cartridge.eval import bench


class Stub:
    def __init__(self, name, mode=None, bits=None):
        self.name, self.mode, self.bits = name, mode, bits

    def encode(self, x):
        if self.mode is None:
            return {"values": x}
        out = mx.quantize(x, group_size=32, bits=self.bits, mode=self.mode)
        names = ("codes", "scales", "biases")
        return dict(zip(names, out))

    def decode(self, parts, params):
        if self.mode is None:
            return parts["values"].astype(mx.float32)
        return mx.dequantize(parts["codes"], parts["scales"], parts.get("biases"), group_size=32,
                             bits=self.bits, mode=self.mode).astype(mx.float32)


STUBS = {"fp16": (Stub("fp16"), mx.float16), "bf16": (Stub("bf16"), mx.bfloat16),
         "f32": (Stub("dequantized"), mx.float32), "int8": (Stub("int8", "affine", 8), mx.float16),
         "mlx4g32": (Stub("mlx4g32", "affine", 4), mx.float16), "fp8": (Stub("fp8", "mxfp8", 8), mx.float32)}


def pages(stub, dtype, x, P):
    n_kv, N, D = x.shape
    pad = -N % P
    x = mx.pad(x, [(0, 0), (0, pad), (0, 0)]).astype(dtype)
    n_pages = (N + pad) // P
    return {k: mx.contiguous(v.reshape(n_kv, n_pages, P, v.shape[-1]).transpose(1, 0, 2, 3))
            for k, v in stub.encode(x).items()}


def prefix(name, k, v, P):
    stub, dtype = STUBS[name]
    kp, vp = pages(stub, dtype, k, P), pages(stub, dtype, v, P)
    p = LayerPrefix(stub, kp, stub, vp, k.shape[1])
    return LayerPrefix(stub, kp, stub, vp, k.shape[1], {}, {}, cuda.FusedAttention(p))


def decode_cache(name, k, v, q, P=256):
    """A CartridgeCache over `name` pages of k, v (n_kv, N, D) with one tail token (the first n_kv query
    heads of q), evaluated: one layer at its first decode step."""
    n_kv = k.shape[0]
    cache = CartridgeCache(prefix(name, k, v, P))
    cache.update_and_fetch(q[:, :n_kv], q[:, :n_kv])
    mx.eval(cache.state)
    return cache


def session_start(**lists):
    """A result dict (device, MLX version, copy bandwidth in bytes/s, printed, and `lists`) and a query
    (1, 32, 1, 128) float16, standard normal: the start of the profiling scripts."""
    result = {"device": mx.device_info(), "mlx": mx.__version__, **lists}
    result["copy_bytes_per_s"] = bench.copy_bandwidth(1 << 30)
    print(f"copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
    mx.eval(q)
    return result, q


def reference(q, k, v, tk, tv, scale):
    n_q, L, D = q.shape
    n_kv, N, _ = k.shape
    T = tk.shape[1]
    g = n_q // n_kv
    keys = np.concatenate([k, tk], 1).astype(np.float64)
    vals = np.concatenate([v, tv], 1).astype(np.float64)
    out = np.zeros((n_q, L, D))
    for h in range(n_q):
        s = q[h].astype(np.float64) @ keys[h // g].T * scale
        for i in range(L):
            s[i, N + T - L + i + 1:] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        out[h] = p / p.sum(1, keepdims=True) @ vals[h // g]
    return out


def check(name, shape, dtype, rng):
    n_q, n_kv, D, N, P, T, L = shape
    k, v = (mx.array(rng.standard_normal((n_kv, N, D)).astype(np.float32)) for _ in range(2))
    pre = prefix(name, k, v, P)
    tk, tv = (rng.standard_normal((1, n_kv, T, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, n_q, L, D)).astype(np.float32)
    cache = CartridgeCache(pre)
    cache.update_and_fetch(mx.array(tk).astype(dtype), mx.array(tv).astype(dtype))
    for ch in (cache._k_chunks, cache._v_chunks):
        used = T - (len(ch) - 1) * 256
        ch[-1][..., used:, :] = mx.nan
    cuda.POISON = float("nan")
    got = np.array(cache.attention(mx.array(q).astype(dtype), D ** -0.5, "causal").astype(mx.float32))[0]
    cuda.POISON = None
    stub = pre.k_codec
    kd = np.array(stub.decode(pre.k_parts, {})).transpose(1, 0, 2, 3).reshape(n_kv, -1, D)[:, :N]
    vd = np.array(stub.decode(pre.v_parts, {})).transpose(1, 0, 2, 3).reshape(n_kv, -1, D)[:, :N]
    r = lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32))
    want = reference(r(q)[0], kd, vd, r(tk)[0], r(tv)[0], D ** -0.5)
    return float(np.abs(got - want).max() / np.abs(want).max()), bool(np.isfinite(got).all())


def main(out):
    rng = np.random.default_rng(0)
    shapes = [(4, 4, 64, 1, 16, 1, 1), (9, 3, 64, 257, 256, 7, 7), (8, 2, 128, 3001, 256, 1, 1),
              (16, 2, 128, 1001, 64, 300, 2), (32, 8, 64, 5000, 256, 1, 1)]
    results, worst = [], 0.0
    for name in STUBS:
        for shape in shapes:
            for dtype in (mx.float16,):
                try:
                    err, finite = check(name, shape, dtype, rng)
                except Exception as e:
                    results.append({"tier": name, "shape": shape, "dtype": str(dtype), "error": repr(e)[:300]})
                    print("ERROR", name, shape, dtype, repr(e)[:300], flush=True)
                    continue
                worst = max(worst, err if finite else 1.0)
                results.append({"tier": name, "shape": shape, "dtype": str(dtype), "rel_err": err, "finite": finite})
                if err > 1e-3 or not finite:
                    print("FAIL", name, shape, dtype, err, finite, flush=True)
    print(f"correctness: {len(results)} cases, worst relative error {worst:.2e}", flush=True)
    timings = timing()
    json.dump({"correctness": results, "timing": timings}, open(f"{out}/gpu_check.json", "w"), indent=1)


def timing():
    from cartridge.eval.bench import copy_bandwidth, timeit

    bw = copy_bandwidth(1 << 30)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    n_q, n_kv, D = 32, 8, 128
    rows = []
    variants = [(8, 8, 396), (8, 4, 528), (16, 4, 396), (8, 8, 264), (8, 8, 792)]
    for N in (8192, 32768, 131072):
        k, v = (mx.random.normal((n_kv, N, D)).astype(mx.float16) for _ in range(2))
        q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
        dk, dv = k[None], v[None]
        mx.eval(k, v, q)
        t_sdpa = timeit(lambda: mx.fast.scaled_dot_product_attention(q, dk, dv, scale=D ** -0.5))
        row = {"N": N, "sdpa_us": round(t_sdpa * 1e6, 1)}
        for name in ("fp16", "mlx4g32", "int8", "fp8"):
            for epl, unr, blocks in (variants if name in ("fp16", "mlx4g32") else variants[:1]):
                cuda.DECODE_EPL, cuda.UNROLL, cuda.TARGET_BLOCKS = epl, unr, blocks
                cache = decode_cache(name, k, v, q)
                t = timeit(lambda: cache.attention(q, D ** -0.5))
                key = f"{name}_e{epl}u{unr}b{blocks}"
                row[key + "_us"] = round(t * 1e6, 1)
                row[key + "_TBps"] = round(cache.prefix.nbytes / t / 1e12, 3)
                del cache
        cuda.DECODE_EPL, cuda.UNROLL, cuda.TARGET_BLOCKS = variants[0]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del k, v, dk, dv
        mx.clear_cache()
    return {"copy_bytes_per_s": bw, "rows": rows}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
