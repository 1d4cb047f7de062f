"""The floor under the 128K target on the GPU machine: in one run, MLX's dense fp16 SDPA and the fused
mlx4g32 step (32 q / 8 kv heads, head_dim 128, 131072 tokens, chained like `cartridge bench`), a trivial
kernel (the fixed cost of one more call in a chain), and plain streaming reads of the fused step's prefix
bytes (and of the dense K/V bytes) over launch shapes: 16-byte streaming loads (`__ldcs`), U of them in
flight per thread, grid-stride. The fastest read of the prefix's bytes is what any kernel reading them
once could approach, doing nothing else.
    python benchmarks/gpu_floor.py OUT_DIR              (writes OUT_DIR/h200-floor.json; needs a CUDA GPU)
    python benchmarks/gpu_floor.py --fp16-gap OUT_DIR   (writes OUT_DIR/h200-fp16-gap.json)
Results: results/h200-floor.json, results/h200-floor-2.json (a second run), results/h200-fp16-gap.json.

`--fp16-gap`: where an fp16 cartridge's decode step loses time to MLX's dense SDPA on the GPU machine
(issue 34 item 1): one layer, 32 q / 8 kv heads, head_dim 128, fp16, chained like `cartridge bench`
(`bench.timeit`), at 32K and 128K tokens, in one run:

- `sdpa`: MLX's SDPA over one contiguous (1, n_kv, N + 1, D) K/V (the bench's dense baseline, + the tail token);
- `sdpa-room`: the same over the first N + 1 tokens of a (1, n_kv, N + 4096, D) buffer (a KVCache with room);
- `sdpa-pages`: the same after concatenating the (n_pages, n_kv, P, D) pages and the tail per step (a copy);
- `fused`: the fused fp16 kernel, single launch (pass 1 + tail + merge in one kernel);
- `fused-2k`: the fused kernel as two launches (pass 1, then the finish);
- `fused-b{B}-u{U}`: single launch with TARGET_BLOCKS B and UNROLL U (the plain pass 1's launch shape);
- `dequantize-once (...)`: the dequantize-once fp16 layer as `policy.place` builds it (its kernel class named).

Each variant's output is checked against the portable path's (max abs error, fp16 output).
"""

import argparse
import json

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx

from cartridge.attention import policy
from cartridge.attention.cache import CartridgeCache, LayerPrefix
from cartridge.attention.kernels import cuda
from cartridge.attention.pages import make_prefix
from cartridge.eval import bench
from cartridge.tiers import TIERS


def session_start(**lists):
    """A result dict (device, MLX version, copy bandwidth in bytes/s, printed, and `lists`) and a query
    (1, 32, 1, 128) float16, standard normal."""
    result = {"device": mx.device_info(), "mlx": mx.__version__, **lists}
    result["copy_bytes_per_s"] = bench.copy_bandwidth(1 << 30)
    print(f"copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
    mx.eval(q)
    return result, q


READ_SRC = """
const size_t n = n_vec[0];  // 16-byte vectors
const uint4* p = reinterpret_cast<const uint4*>(buf);
const size_t stride = (size_t)gridDim.x * blockDim.x;
size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
uint32_t acc = 0;
for (; i + (U - 1) * stride < n; i += U * stride) {
  uint4 u[U];
#pragma unroll
  for (int j = 0; j < U; ++j) u[j] = __ldcs(p + i + j * stride);
#pragma unroll
  for (int j = 0; j < U; ++j) acc ^= u[j].x ^ u[j].y ^ u[j].z ^ u[j].w;
}
for (; i < n; i += stride) {
  const uint4 u = __ldcs(p + i);
  acc ^= u.x ^ u.y ^ u.z ^ u.w;
}
if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;  // keeps the loads; practically never taken
if (blockIdx.x == 0) for (int k = threadIdx.x; k < 4096; k += blockDim.x) out[k] = q[k];
"""
TRIVIAL_SRC = "if (blockIdx.x == 0) for (int k = threadIdx.x; k < 4096; k += blockDim.x) out[k] = q[k];\n"


def reads(q, nbytes, result):
    buf = mx.zeros((nbytes // 4,), dtype=mx.uint32)
    nv = mx.array([nbytes // 16], dtype=mx.int64)
    mx.eval(buf, nv)
    for unroll in (1, 4, 8):
        kernel = mx.fast.cuda_kernel(name=f"floor_read_u{unroll}", input_names=["buf", "n_vec", "q"],
                                     output_names=["out", "sink"], source=f"constexpr int U = {unroll};\n" + READ_SRC)
        for threads in (256, 512):
            for blocks in (132, 264, 528, 1056, 2112):
                def step(x):
                    return kernel(inputs=[buf, nv, x], grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
                                  output_shapes=[x.shape, (blocks,)], output_dtypes=[x.dtype, mx.uint32])[0]
                us = bench.timeit(step, 10, chain=q) * 1e6
                row = {"bytes": nbytes, "unroll": unroll, "threads": threads, "blocks": blocks, "us": round(us, 1),
                       "TBps": round(nbytes / us / 1e6, 3)}
                result["reads"].append(row)
                print(json.dumps(row), flush=True)
    del buf
    mx.clear_cache()


def main(out):
    result, q = session_start(reads=[])
    trivial = mx.fast.cuda_kernel(name="floor_trivial", input_names=["q"], output_names=["out"], source=TRIVIAL_SRC)
    result["trivial_us"] = round(bench.timeit(
        lambda x: trivial(inputs=[x], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
                          output_dtypes=[x.dtype])[0], 10, chain=q) * 1e6, 2)
    print(f"trivial kernel {result['trivial_us']} us", flush=True)
    bench.POLICIES = ["fused"]
    result["attention"] = bench.attention_step((32, 8, 128), 131072, ["mlx4g32"])
    for row in result["attention"]:
        print(json.dumps(row), flush=True)
    prefix = next(r["prefix_bytes"] for r in result["attention"] if r["tier"] == "mlx4g32")
    dense = next(r for r in result["attention"] if r["policy"] == "mlx-sdpa")
    for nbytes in (prefix, dense["prefix_bytes"]):
        reads(q, nbytes, result)
    best = min(r["us"] for r in result["reads"] if r["bytes"] == prefix)
    fused = next(r["us"] for r in result["attention"] if r["tier"] == "mlx4g32")
    result["summary"] = {"dense_us": dense["us"], "fused_us": fused, "fused_over_dense": fused / dense["us"],
                         "best_prefix_read_us": best, "best_read_over_dense": best / dense["us"],
                         "target_us": 0.4 * dense["us"]}
    print(json.dumps(result["summary"]), flush=True)
    json.dump(result, open(f"{out}/h200-floor.json", "w"), indent=1, default=str)


N_Q, N_KV, D = 32, 8, 128
SCALE = D ** -0.5


def _cache(prefix, kernel):
    return CartridgeCache(LayerPrefix(prefix.k_codec, prefix.k_parts, prefix.v_codec, prefix.v_parts, prefix.n_tokens,
                                      prefix.k_params, prefix.v_params, kernel))


def fp16_gap_rows(n):
    """The --fp16-gap rows at context `n`: each variant's us per step and its error against the portable path."""
    k, v = bench._kv(N_KV, n, D, seed=n)
    q = mx.random.normal((1, N_Q, 1, D)).astype(mx.float16)
    new = mx.random.normal((1, N_KV, 1, D)).astype(mx.float16)
    prefix = make_prefix(TIERS["fp16"], k, TIERS["fp16"], v, bench.PAGE_SIZE)
    mx.eval(q, new, prefix.k_parts, prefix.v_parts)
    rows, outs = [], {}

    def time(name, fn):
        try:
            outs[name] = fn(q)
            mx.eval(outs[name])
            us = bench.timeit(fn, 20, chain=q) * 1e6
            rows.append({"variant": name, "context": n, "us": us, "error": None})
        except Exception as e:  # recorded: a variant that does not build or run here
            rows.append({"variant": name, "context": n, "us": None, "error": f"{type(e).__name__}: {e}"})

    dk = mx.concatenate([k[None], new], axis=2)
    dv = mx.concatenate([v[None], new], axis=2)
    mx.eval(dk, dv)
    time("sdpa", lambda x: mx.fast.scaled_dot_product_attention(x, dk, dv, scale=SCALE))
    del dk, dv
    rk = mx.zeros((1, N_KV, n + 4096, D), dtype=mx.float16)
    rv = mx.zeros((1, N_KV, n + 4096, D), dtype=mx.float16)
    rk[:, :, :n], rv[:, :, :n] = k[None], v[None]
    rk[:, :, n:n + 1], rv[:, :, n:n + 1] = new, new
    mx.eval(rk, rv)
    time("sdpa-room", lambda x: mx.fast.scaled_dot_product_attention(x, rk[:, :, :n + 1], rv[:, :, :n + 1],
                                                                        scale=SCALE))
    del rk, rv
    pk, pv = prefix.k_parts["values"], prefix.v_parts["values"]

    def paged(x):
        ks = mx.concatenate([pk.transpose(1, 0, 2, 3).reshape(1, N_KV, -1, D), new], axis=2)
        vs = mx.concatenate([pv.transpose(1, 0, 2, 3).reshape(1, N_KV, -1, D), new], axis=2)
        return mx.fast.scaled_dot_product_attention(x, ks, vs, scale=SCALE)

    time("sdpa-pages", paged)

    portable = _cache(prefix, None)
    portable.update_and_fetch(new, new)
    ref = portable.attention(q, SCALE)
    mx.eval(ref)

    def fused_variant(name, **settings):
        saved = {key: getattr(cuda, key) for key in settings}
        for key, value in settings.items():
            setattr(cuda, key, value)
        try:
            c = _cache(prefix, cuda.FusedAttention(prefix))
            c.update_and_fetch(new, new)
            mx.eval(c.state)
            time(name, lambda x: c.attention(x, SCALE))
        finally:
            for key, value in saved.items():
                setattr(cuda, key, value)

    fused_variant("fused")
    fused_variant("fused-2k", SINGLE_LAUNCH=False)
    for blocks in (264, 528, 1056):
        for unroll in (2, 4, 8):
            if (blocks, unroll) != (cuda.TARGET_BLOCKS, cuda.UNROLL):
                fused_variant(f"fused-b{blocks}-u{unroll}", TARGET_BLOCKS=blocks, UNROLL=unroll)
    placed, _ = policy.place([prefix], "dequantize-once", mx.float16, [(D, D)])
    c = CartridgeCache(placed[0])
    c.update_and_fetch(new, new)
    mx.eval(c.state)
    time(f"dequantize-once ({type(placed[0].kernel).__name__})", lambda x: c.attention(x, SCALE))
    for r in rows:
        out = outs.get(r["variant"])
        r["max_abs_err_vs_portable"] = None if out is None else float(mx.max(mx.abs(out.astype(mx.float32) -
                                                                                    ref.astype(mx.float32))))
    return rows


def fp16_gap(out_dir):
    """--fp16-gap: every variant at 32K and 128K; writes out_dir/h200-fp16-gap.json and prints a table."""
    rows = []
    for n in (32768, 131072):
        rows += fp16_gap_rows(n)
        mx.clear_cache()
    dense = {r["context"]: r["us"] for r in rows if r["variant"] == "sdpa"}
    with open(f"{out_dir}/h200-fp16-gap.json", "w") as f:
        json.dump({"device": mx.device_info().get("device_name"), "rows": rows}, f, indent=1)
    print(f"{'context':>8} {'variant':36} {'us':>8} {'vs sdpa':>8} {'err':>9}")
    for r in rows:
        us = f"{r['us']:8.1f}" if r["us"] else "       -"
        ratio = f"{r['us'] / dense[r['context']]:7.2f}x" if r["us"] and dense.get(r["context"]) else "        "
        err = r.get("max_abs_err_vs_portable")
        print(f"{r['context']:>8} {r['variant']:36} {us} {ratio} {err if err is not None else '-':>9.3g}"
              if err is not None else f"{r['context']:>8} {r['variant']:36} {us} {ratio} {r['error']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The floor under the 128K decode-step target on a CUDA GPU: dense "
                                     "SDPA, the fused mlx4g32 step and plain streaming reads of the same bytes.")
    parser.add_argument("out", help="folder for h200-floor.json (or h200-fp16-gap.json)")
    parser.add_argument("--fp16-gap", action="store_true", help="instead: where the fp16 decode step loses time "
                        "to MLX's dense SDPA (variants of SDPA and of the fused fp16 kernel, 32K and 128K)")
    args = parser.parse_args()
    if args.fp16_gap:
        fp16_gap(args.out)
    else:
        main(args.out)
