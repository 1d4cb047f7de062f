"""Where the decode-step time of the tensor-core path goes (GPU machine): timing floor, pass 1 alone,
pass 2 alone, the whole step, at several prefix lengths.  python3 benchmarks/gpu_probe.py OUT_DIR"""

import json
import sys

import mlx.core as mx

from cartridge.bench import timeit
from cartridge.cache import CartridgeCache
from cartridge.kernels import cuda

sys.path.insert(0, "benchmarks")
from gpu_check import prefix  # noqa: E402


def main(out):
    n_q, n_kv, D = 32, 8, 128
    tiny = mx.zeros((16,), dtype=mx.float16)
    mx.eval(tiny)
    rows = [{"floor_us": round(timeit(lambda: tiny + 1) * 1e6, 1)}]
    print(rows[0], flush=True)
    for N in (8192, 131072):
        k, v = (mx.random.normal((n_kv, N, D)).astype(mx.float16) for _ in range(2))
        q = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
        mx.eval(k, v, q)
        pre = prefix("mlx4g32", k, v, 256)
        cache = CartridgeCache(pre)
        cache.update_and_fetch(q[:, :n_kv], q[:, :n_kv])
        mx.eval(cache.state)
        fa = pre.kernel
        row = {"N": N, "sdpa_us": round(timeit(lambda: mx.fast.scaled_dot_product_attention(
            q, k[None], v[None], scale=D ** -0.5)) * 1e6, 1)}
        row["step_us"] = round(timeit(lambda: cache.attention(q, D ** -0.5)) * 1e6, 1)
        R = n_q // n_kv
        per, n_splits = cuda.split_plan(N, n_kv, 1, 16 * cuda.WARPS, cuda.MMA_TARGET_BLOCKS)
        prm = fa._params(R, 1, per, n_splits, cache.tail_len, cache.chunk_size)
        fprm = fa._scale(D ** -0.5)
        mx.eval(prm, fprm)

        def pass1():
            return cuda._pass1_mma()(
                inputs=[q, fprm, *fa.k_in, *fa.v_in, prm],
                template=[("T", q.dtype), ("HD", D), ("NKV", n_kv), ("PAGE", 256), ("WARPS", cuda.WARPS),
                          ("STAGES", 3)],
                grid=(n_splits * cuda.WARPS * 32, n_kv, 1), threadgroup=(cuda.WARPS * 32, 1, 1),
                output_shapes=[(n_splits, n_kv, R, D), (n_splits, n_kv, R), (n_splits, n_kv, R)],
                output_dtypes=[mx.float32] * 3)

        row["pass1_us"] = round(timeit(pass1) * 1e6, 1)
        O, M, L = pass1()
        mx.eval(O, M, L)
        row["finish_us"] = round(timeit(lambda: fa._finish(cache, q, fprm, prm, O, M, L, R, D)) * 1e6, 1)
        row["prm_slice_us"] = round(timeit(lambda: fa._params(R, 1, per, n_splits, cache.tail_len,
                                                             cache.chunk_size) + 0) * 1e6, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    json.dump(rows, open(f"{out}/gpu_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
