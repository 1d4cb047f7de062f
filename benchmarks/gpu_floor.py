"""The floor under the 128K target on the GPU machine: in one run, MLX's dense fp16 SDPA and the fused
mlx4g32 step (32 q / 8 kv heads, head_dim 128, 131072 tokens, chained like `cartridge bench`), a trivial
kernel (the fixed cost of one more call in a chain), and plain streaming reads of the fused step's prefix
bytes (and of the dense K/V bytes) over launch shapes: 16-byte streaming loads (`__ldcs`), U of them in
flight per thread, grid-stride. The fastest read of the prefix's bytes is what any kernel reading them
once could approach, doing nothing else. `--part` runs instead one part of issue 34 (same shape):

1. `dense`: an fp16/bf16 cartridge's attention against MLX's SDPA over one contiguous cache, at 32K and 128K
   tokens: decode (1 query token) and questions of 32 and 256 tokens, for
   - `sdpa`: MLX's SDPA over a (1, n_kv, N + L, D) K/V (the baseline of `cartridge bench`, with the tail);
   - `contiguous`: the CUDA backend's path for dense pages now (`attention/contiguous.py`);
   - `flash`: the flash-decoding kernel over the same pages (`kernels/cuda.py`, the path before);
   and, for decode, whole steps that also write the token's K/V (trim 1, then update, from the chained output):
   `kvcache-step` (mlx-lm's KVCache + SDPA), `contiguous-step`, `flash-step`. Each output's max abs error
   against the portable path.
2. `e2e`: decode tokens/s through mlx-lm's generate_step (bench.end_to_end: a random llama3-8b, 32 layers) with
   a prefix of 32K and 128K tokens: mlx-lm's KVCache, and fp16 / int8 cartridges fused, fp16 both ways (the
   contiguous buffer, then the flash kernel: `switched(flash=True)`).
3. `floors`: per tier at 32K and 128K, a bare streaming read of its stored bytes (best of a launch sweep of
   `READ_SRC`), to set beside its fused time from `cartridge bench`.
4. `host`: where an end-to-end decode step's time goes at 32K (random llama3-8b, 32 layers, mlx-lm's KVCache and
   HOST_TIERS fused): tokens/s through `generate_step`, the host's ms to build a step's graph (nothing evaluated), a
   step built then evaluated alone, and MLX primitives per step by kind (`export_to_dot`). `interleave`: the
   VARIANTS (fp16 contiguous / flash, 4- or 8-warp TurboQuant, ...) held at once and timed in turn, 7 rounds at 32K
   and 5 at 128K, so that a shared host's slow stretches hit every variant alike.

    python benchmarks/gpu_floor.py OUT_DIR                        (writes OUT_DIR/h200-floor.json; needs a CUDA GPU)
    python benchmarks/gpu_floor.py --part dense|e2e|floors|host|interleave OUT_DIR  (writes OUT_DIR/h200-{PART}.json)
Results: results/h200-floor.json, results/h200-floor-2.json (a second run); h200-dense.*, h200-e2e.*,
h200-floors.* (issue 34). (`--fp16-gap`, which gave results/h200-fp16-gap.json, is `git show 36f2680:benchmarks/
gpu_floor.py`; `--part dense` measures the same comparison on the current paths.)
"""

import argparse
import collections
import io
import json
import re
import statistics
import time
from contextlib import contextmanager

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx

from dataclasses import replace

from mlx_lm.models.cache import KVCache

from cartridge.attention import contiguous
from cartridge.attention.caches import CartridgeCache
from cartridge.attention.kernels import cuda_inputs, cuda_tuning
from cartridge.attention.pages import make_prefix
from cartridge.attention.policy import dequantize
from cartridge.attention.route import install
from cartridge.eval import bench
from cartridge.tiers import TIERS


@contextmanager
def switched(flash=False, **tuning):
    """Inside the block, layers are laid out (`policy.place`, `bench.time_policy`, `lay_out`) with the CUDA tuning
    changed by `tuning` (`CudaTuning` fields) and, with `flash`, dense pages on the flash-decoding kernels rather than
    the contiguous buffer; a layer keeps what it was laid out with."""
    saved = cuda_tuning.TUNING, contiguous.reads
    cuda_tuning.TUNING = replace(saved[0], **tuning)
    if flash:
        contiguous.reads = lambda prefix: False
    try:
        yield
    finally:
        cuda_tuning.TUNING, contiguous.reads = saved


def tuning(**values):
    """The CUDA tuning in use with `values` changed."""
    return replace(cuda_tuning.TUNING, **values)


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


def _timed(rows, outs, name, fn, q, **info):
    try:
        outs[name] = fn(q)
        mx.eval(outs[name])
        us = bench.timeit(fn, 20 if q.shape[2] == 1 else 5, chain=q) * 1e6
        rows.append({"variant": name, "us": us, "error": None, **info})
    except Exception as e:  # recorded: a variant that does not run here
        rows.append({"variant": name, "us": None, "error": f"{type(e).__name__}: {e}", **info})


def _step(cache, attend):
    """A decode step from the chained output x (1, n_q, 1, D): trim the last token, write x's first KV heads as
    the new token's K/V, attend."""
    def fn(x):
        cache.trim(1)
        new = x[:, :N_KV]
        cache.update_and_fetch(new, new)
        return attend(x)
    return fn


def dense_rows(n, tier):
    k, v = bench.random_kv(N_KV, n, D, seed=n)
    dtype = mx.bfloat16 if tier == "bf16" else mx.float16
    prefix = make_prefix(TIERS[tier], k, TIERS[tier], v, bench.PAGE_SIZE)
    mx.eval(prefix.k_parts, prefix.v_parts)
    rows = []
    for L in (1, 32, 256):
        info = {"tier": tier, "context": n, "query_tokens": L}
        q = mx.random.normal((1, N_Q, L, D)).astype(dtype)
        new = mx.random.normal((1, N_KV, L, D)).astype(dtype)
        mask = "causal" if L > 1 else None
        outs, start = {}, len(rows)
        dk = mx.concatenate([k[None].astype(dtype), new], axis=2)
        dv = mx.concatenate([v[None].astype(dtype), new], axis=2)
        mx.eval(q, new, dk, dv)
        _timed(rows, outs, "sdpa", lambda x: mx.fast.scaled_dot_product_attention(x, dk, dv, scale=SCALE, mask=mask),
               q, **info)
        if L == 1:
            kv = KVCache()
            kv.update_and_fetch(dk, dv)
            _timed(rows, outs, "kvcache-step", _step(kv, lambda x: mx.fast.scaled_dot_product_attention(
                x, kv.keys[..., :kv.offset, :], kv.values[..., :kv.offset, :], scale=SCALE)), q, **info)
            del kv
        del dk, dv
        ref = CartridgeCache(prefix)
        ref.update_and_fetch(new, new)
        want = ref.attention(q, SCALE, mask)
        mx.eval(want)
        for name, record in (("contiguous", contiguous.lay_out(prefix)), ("flash", cuda_inputs.lay_out(prefix))):
            c = CartridgeCache(replace(prefix, backend=record))
            c.update_and_fetch(new, new)
            _timed(rows, outs, name, lambda x: c.attention(x, SCALE, mask), q, **info)
            if L == 1:
                _timed(rows, outs, name + "-step", _step(c, lambda x: c.attention(x, SCALE, mask)), q, **info)
            del c, record
            mx.clear_cache()
        for r in rows[start:]:
            got = outs.get(r["variant"])
            if r["variant"].endswith("step") or got is None:
                continue
            r["max_abs_err_vs_portable"] = float(mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))))
    return rows


def read_floor(prefix):
    """Best µs of a bare streaming read of the prefix's stored bytes (one buffer of as many bytes)."""
    nbytes = prefix.nbytes // 16 * 16
    buf = mx.zeros((nbytes // 4,), dtype=mx.uint32)
    nv = mx.array([nbytes // 16], dtype=mx.int64)
    q = mx.random.normal((1, N_Q, 1, D)).astype(mx.float16)
    mx.eval(buf, nv, q)
    best = None
    for unroll in (4, 8):
        kernel = mx.fast.cuda_kernel(name=f"dense_floor_read_u{unroll}", input_names=["buf", "n_vec", "q"],
                                     output_names=["out", "sink"], source=f"constexpr int U = {unroll};\n" + READ_SRC)
        for blocks in (528, 1056, 2112):
            def step(x):
                return kernel(inputs=[buf, nv, x], grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
                              output_shapes=[x.shape, (blocks,)], output_dtypes=[x.dtype, mx.uint32])[0]
            us = bench.timeit(step, 10, chain=q) * 1e6
            best = us if best is None else min(best, us)
    return best


def floors():
    rows = []
    for n in (32768, 131072):
        k, v = bench.random_kv(N_KV, n, D, seed=n)
        for tier in TIERS:
            prefix, error = bench.tier_prefix(tier, k, v)
            if prefix is None:
                continue
            mx.eval(prefix.k_parts, prefix.v_parts)
            rows.append({"tier": tier, "context": n, "bytes": prefix.nbytes, "read_us": read_floor(prefix)})
            print(json.dumps(rows[-1]), flush=True)
            del prefix
            mx.clear_cache()
    return rows


def e2e():
    model, rows = bench.random_model("llama3-8b"), []
    bench.POLICIES = ["fused"]
    for n in (32768, 131072):
        for contiguous_dense in (True, False):
            with switched(flash=not contiguous_dense):
                found = bench.end_to_end(model, n, ["fp16", "int8"] if contiguous_dense else ["fp16"], mx.float16)
            for r in found:
                if r["kind"] == "baseline" and not contiguous_dense:
                    continue
                r["contiguous_dense"] = contiguous_dense
                rows.append(r)
                print(json.dumps(r), flush=True)
            mx.clear_cache()
    return rows


SWEEP_TIERS = ("turbo3", "turbo2", "turbo4", "mxfp4", "kivi4", "int6", "fp8")
TC_SHAPES = ((264, 3, 4), (528, 3, 4), (1056, 3, 4), (528, 4, 4), (528, 2, 4), (264, 3, 8))  # blocks, stages, warps
MMA_SHAPES = ((264, 3), (528, 3), (528, 4), (1056, 3))  # blocks, stages


def sweep():
    """Fused decode µs per launch shape: flash_pass1_tc tiers over TC_SHAPES, mlx4g32 (flash_pass1_mma) over
    MMA_SHAPES, at 32K and 128K tokens (chained, like the bench)."""
    rows = []
    for n in (131072, 32768):
        k, v = bench.random_kv(N_KV, n, D, seed=n)
        q = mx.random.normal((1, N_Q, 1, D)).astype(mx.float16)
        new = mx.random.normal((1, N_KV, 1, D)).astype(mx.float16)
        mx.eval(q, new)
        for tier in ("mlx4g32",) + SWEEP_TIERS:
            prefix, _ = bench.tier_prefix(tier, k, v)
            mx.eval(prefix.k_parts, prefix.v_parts)
            for shape in MMA_SHAPES if tier == "mlx4g32" else TC_SHAPES:
                names = ("mma_target_blocks", "mma_stages") if tier == "mlx4g32" else \
                    ("tc_target_blocks", "tc_stages", "tc_warps")
                with switched(**dict(zip(names, shape))):
                    us, _, error = bench.time_policy(prefix, "fused", mx.float16, q, new, 10)
                rows.append({"tier": tier, "context": n, "shape": shape, "us": us, "error": error})
                print(json.dumps(rows[-1]), flush=True)
            del prefix
            mx.clear_cache()
    return rows


def profile():
    """Two fused decode steps each of mlx4g32 and turbo3 at 128K, evaluated one by one (for `ncu -c 4`)."""
    k, v = bench.random_kv(N_KV, 131072, D, seed=131072)
    q = mx.random.normal((1, N_Q, 1, D)).astype(mx.float16)
    for tier in ("mlx4g32", "turbo3"):
        prefix, _ = bench.tier_prefix(tier, k, v)
        cache = bench.layer_cache(prefix, "fused", mx.float16, D)
        cache.update_and_fetch(q[:, :N_KV], q[:, :N_KV])
        mx.eval(cache.state, prefix.k_parts, prefix.v_parts)
        for _ in range(2):
            mx.eval(cache.attention(q, SCALE))
    return []


PREFILL_TIERS = ("fp16", "mlx4g32", "mlx4g32+rot", "int8", "fp8", "kivi4", "nvfp4", "turbo4", "turbo3")
# launch shapes of cuda_prefill's kernel swept for these tiers: (WARPS, TARGET_BLOCKS)
PREFILL_SHAPES = {"fp16": ((4, 264), (8, 528), (8, 132)), "mlx4g32": ((4, 264), (8, 528), (8, 132)),
                  "turbo3": ((4, 264),)}


def _prefill_variants(prefix, L, tier):
    """(name, backend record) of the question-prefill paths timed for L query tokens: the pages decoded for the call
    from one query row (`cuda_decode`), the prefill kernel from one row (its launch shape in use, then those of
    PREFILL_SHAPES), dequantize-once's contiguous buffer, and (L < 256) the decode kernel's row blocks; each record
    laid out with its own tuning."""
    never = 1 << 30
    decoded = tuning(dense_min_rows={}, dense_min_rows_other=1, decoded_min_rows=1, prefill_min_rows=never,
                     prefill_dense_rows={})
    out = [("decoded-cuda", cuda_inputs.lay_out(prefix, decoded))]
    prefill = dict(dense_min_rows={}, dense_min_rows_other=never, decoded_min_rows=never, prefill_min_rows=1)
    out.append(("prefill", cuda_inputs.lay_out(prefix, tuning(**prefill))))
    out += [(f"prefill-w{w}-b{b}", cuda_inputs.lay_out(prefix, tuning(**prefill, prefill_warps=w,
                                                                     prefill_target_blocks=b)))
            for w, b in PREFILL_SHAPES.get(tier, ())]
    out.append(("dequantize-once", contiguous.lay_out(dequantize(prefix, mx.float16), decoded)))
    if L < 256:
        out.append(("kernel", cuda_inputs.lay_out(prefix, tuning(dense_min_rows={}, dense_min_rows_other=never,
                                                                 decoded_min_rows=never, prefill_min_rows=never,
                                                                 prefill_dense_rows={}))))
    return out


def prefill():
    """A question's attention (L tokens, causal) over the prefix: MLX's dense SDPA; `cuda_prefill`'s kernel (at
    several launch shapes for a few tiers); the pages decoded for the call by `cuda_decode`, then MLX's SDPA;
    dequantize-once's contiguous buffer; the decode kernel's row blocks (L < 256). Each output's max abs error
    against the first (the decoded pages and MLX's SDPA)."""
    rows = []
    for n, lengths in ((131072, (32, 64, 256)), (32768, (32, 256))):
        k, v = bench.random_kv(N_KV, n, D, seed=n)
        for L in lengths:
            q = mx.random.normal((1, N_Q, L, D)).astype(mx.float16)
            new = mx.random.normal((1, N_KV, L, D)).astype(mx.float16)
            dk = mx.concatenate([k[None], new], axis=2)
            dv = mx.concatenate([v[None], new], axis=2)
            mx.eval(q, new, dk, dv)
            us = bench.timeit(lambda x: mx.fast.scaled_dot_product_attention(x, dk, dv, scale=SCALE, mask="causal"),
                              5, inner=10, chain=q) * 1e6
            rows.append({"tier": "dense", "context": n, "query_tokens": L, "variant": "sdpa", "us": us})
            print(json.dumps(rows[-1]), flush=True)
            del dk, dv
            for tier in PREFILL_TIERS:
                prefix, _ = bench.tier_prefix(tier, k, v)
                mx.eval(prefix.k_parts, prefix.v_parts)
                ref = None
                for name, record in _prefill_variants(prefix, L, tier):
                    c = CartridgeCache(replace(prefix, backend=record))
                    c.update_and_fetch(new, new)
                    row = {"tier": tier, "context": n, "query_tokens": L, "variant": name, "error": None}
                    try:
                        got = c.attention(q, SCALE, "causal")
                        mx.eval(got)
                        ref = got if ref is None else ref
                        row["us"] = bench.timeit(lambda x: c.attention(x, SCALE, "causal"), 5, inner=10, chain=q) * 1e6
                        row["max_abs_vs_first"] = float(mx.max(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))))
                    except Exception as e:  # recorded: a path that does not run here
                        row["us"], row["error"] = None, f"{type(e).__name__}: {e}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    del c, record
                    mx.clear_cache()
                del prefix
                mx.clear_cache()
    _prefill_table(rows)
    return rows


def _prefill_table(rows):
    """Print each (context, L, tier)'s variants as x MLX's dense SDPA."""
    base = {(r["context"], r["query_tokens"]): r["us"] for r in rows if r["tier"] == "dense"}
    print(f"{'context':>7} {'L':>4} {'tier':12} " + " ".join(f"{v:>16}" for v in ("variant: x sdpa",)))
    for key in sorted({(r["context"], r["query_tokens"], r["tier"]) for r in rows if r["tier"] != "dense"}):
        cells = [f"{r['variant']} {r['us'] / base[key[:2]]:.2f}" if r["us"] else f"{r['variant']} -"
                 for r in rows if (r["context"], r["query_tokens"], r["tier"]) == key]
        print(f"{key[0]:>7} {key[1]:>4} {key[2]:12} sdpa {base[key[:2]]:.0f} us | " + ", ".join(cells), flush=True)


QUESTION_TOKENS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
QUESTION_CONTEXTS = (131072, 32768)


def questions():
    """A question (L tokens, causal) over an fp16 / bf16 cartridge's pages at 32K and 128K tokens: MLX's SDPA over
    one (1, n_kv, N + L, D) cache (`sdpa`); the contiguous buffer (`contiguous`: no question rows on the pages); the
    prefill kernel over the pages at every L (`kernel`: `prefill_dense_rows` widened); what the backend does now
    (`routed`); for fp16 up to 128 tokens, the flash kernels over the pages without the buffer (what a memory budget
    takes) with `prefill_dense_rows` empty (`fused-no-dense-rows`: the row-block kernels below 128 rows) and as
    committed (`fused`). The contiguous variants share one buffer. Each output's max abs difference from
    `contiguous`."""
    rows, dense_rows = [], cuda_tuning.TUNING.prefill_dense_rows
    for n in QUESTION_CONTEXTS:
        k, v = bench.random_kv(N_KV, n, D, seed=n)
        for tier in ("fp16", "bf16"):
            dtype = mx.bfloat16 if tier == "bf16" else mx.float16
            prefix = make_prefix(TIERS[tier], k, TIERS[tier], v, bench.PAGE_SIZE)
            mx.eval(prefix.k_parts, prefix.v_parts)
            buffer = contiguous.ContiguousKV(prefix)
            variants = {"contiguous": tuning(question_rows=(1, 0)),
                        "kernel": tuning(prefill_dense_rows={t: (1, 1 << 30) for t in dense_rows}),
                        "routed": tuning()}
            records = {name: contiguous.Contiguous(buffer, cuda_inputs.lay_out(prefix, t)) for name, t in
                       variants.items()}
            for L in QUESTION_TOKENS:
                q = mx.random.normal((1, N_Q, L, D)).astype(dtype)
                new = mx.random.normal((1, N_KV, L, D)).astype(dtype)
                dk = mx.concatenate([k[None].astype(dtype), new], axis=2)
                dv = mx.concatenate([v[None].astype(dtype), new], axis=2)
                mx.eval(q, new, dk, dv)
                info = {"tier": tier, "context": n, "query_tokens": L, "rows": N_Q // N_KV * L}
                us = bench.timeit(lambda x: mx.fast.scaled_dot_product_attention(x, dk, dv, scale=SCALE,
                                                                                  mask="causal"), 5, inner=10, chain=q)
                rows.append({**info, "variant": "sdpa", "us": us * 1e6})
                del dk, dv
                ref = None
                for name, record in records.items():
                    c = CartridgeCache(replace(prefix, backend=record))
                    c.update_and_fetch(new, new)
                    row = {**info, "variant": name, "error": None, "on_pages": contiguous.on_pages(record, q, c.tail())}
                    try:
                        got = c.attention(q, SCALE, "causal")
                        mx.eval(got)
                        ref = got if ref is None else ref
                        row["us"] = bench.timeit(lambda x: c.attention(x, SCALE, "causal"), 5, inner=10, chain=q) * 1e6
                        row["max_abs_vs_contiguous"] = float(mx.max(mx.abs(got.astype(mx.float32) -
                                                                           ref.astype(mx.float32))))
                    except Exception as e:  # recorded: a path that does not run here
                        row["us"], row["error"] = None, f"{type(e).__name__}: {e}"
                    rows.append(row)
                    del c
                n_rows = len(rows)
                if tier == "fp16" and L <= 128:  # the fused kernel over the pages without the buffer (a memory budget)
                    for name, t in (("fused-no-dense-rows", tuning(prefill_dense_rows={})), ("fused", tuning())):
                        f = CartridgeCache(replace(prefix, backend=cuda_inputs.lay_out(prefix, t)))
                        f.update_and_fetch(new, new)
                        row = {**info, "variant": name, "error": None}
                        try:
                            got = f.attention(q, SCALE, "causal")
                            row["us"] = bench.timeit(lambda x: f.attention(x, SCALE, "causal"), 5, inner=10,
                                                     chain=q) * 1e6
                            row["max_abs_vs_contiguous"] = float(mx.max(mx.abs(got.astype(mx.float32) -
                                                                               ref.astype(mx.float32))))
                        except Exception as e:  # recorded: a path that does not run here
                            row["us"], row["error"] = None, f"{type(e).__name__}: {e}"
                        rows.append(row)
                        del f
                base = rows[n_rows - 4]["us"]
                print(" ".join(f"{r['variant']} {r['us'] / base:.3f}x" if r["us"] else f"{r['variant']} -"
                               for r in rows[n_rows - 3:]), f"| {tier} {n} L={L} sdpa {base:.0f} us", flush=True)
                mx.clear_cache()
            del prefix, buffer, records
            mx.clear_cache()
    return rows


def make_caches(model, n, tier, policy="fused"):
    """One cache per layer over a random prefix of n tokens: KVCache (tier "dense") or a cartridge cache read under
    `policy` (`bench.dense_caches`, `bench.cartridge_caches`; fp16)."""
    if tier == "dense":
        return bench.dense_caches(model, n, mx.float16)[0]
    return bench.cartridge_caches(model, n, tier, policy, mx.float16)[0]


def count_ops(out):
    """{primitive name: count} in the graph of `out` (MLX's `export_to_dot`: one rectangle per primitive)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return dict(collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue())))


def step_times(model, caches, n, steps=30):
    """(median build ms, median sync ms) of single decode steps, each trimmed back to the prefix after."""
    y = mx.array([[1]], dtype=mx.uint32)
    builds, syncs = [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        logits = model(y, cache=caches)
        t1 = time.perf_counter()
        mx.eval(logits)
        t2 = time.perf_counter()
        if i >= 3:
            builds.append((t1 - t0) * 1e3)
            syncs.append((t2 - t0) * 1e3)
        for c in caches:
            c.trim(c.offset - n)
    return statistics.median(builds), statistics.median(syncs)


def measure(model, n, tier, policy):
    """One row: ops per step, build and sync ms, tokens/s (see the module docstring)."""
    caches = make_caches(model, n, tier, policy)
    y = mx.array([[1]], dtype=mx.uint32)
    kinds = count_ops(model(y, cache=caches))
    for c in caches:
        c.trim(c.offset - n)
    build, sync = step_times(model, caches, n)
    tps = bench.decode_tokens_per_s(model, caches, 32)
    return {"tier": tier, "context": n, "tokens_per_s": tps, "step_ms": 1e3 / tps, "build_ms": build,
            "sync_ms": sync, "ops": sum(kinds.values()), "op_kinds": kinds}


# `--part interleave`: (label, tier, `switched` arguments) held while the caches are made
VARIANTS = (("dense", "dense", {}), ("fp16 contiguous", "fp16", {}),
            ("fp16 flash", "fp16", {"flash": True}), ("mlx4g32", "mlx4g32", {}),
            ("int8", "int8", {}), ("int8+rot", "int8+rot", {}), ("turbo3 8 warps", "turbo3", {}),
            ("turbo3 4 warps", "turbo3", {"tc_warps_turbo": 4}), ("turbo4 4 warps", "turbo4", {"tc_warps_turbo": 4}))


def interleaved(model, n, rounds, only=None):
    """Every VARIANTS entry's caches made at once, then `rounds` rounds of decode tokens/s (generate_step, 32
    tokens, tails trimmed back before each) taken in turn, so that a slow stretch of a shared host hits every
    variant alike: rows with each round's tokens/s, their median and best."""
    made = []
    for label, tier, switches in VARIANTS:
        if only and label not in only:
            continue
        try:
            with switched(**switches):
                caches = make_caches(model, n, tier)
            step_times(model, caches, n, steps=2)  # warm: each layer's plans made
            made.append((label, caches, None))
        except Exception as e:
            made.append((label, None, f"{type(e).__name__}: {e}"))
    runs = {label: [] for label, _, _ in made}
    for _ in range(rounds):
        for label, caches, error in made:
            if caches is None:
                continue
            for c in caches:
                c.trim(c.offset - n)
            runs[label].append(bench.decode_tokens_per_s(model, caches, 32, rounds=1))
    return [{"variant": label, "context": n, "tokens_per_s": runs[label], "error": error,
             "median": statistics.median(runs[label]) if runs[label] else None,
             "best": max(runs[label]) if runs[label] else None} for label, _, error in made]


def host():
    """Where an end-to-end decode step's time goes at 32K tokens (random llama3-8b, 32 layers, fp16), per cache:
    mlx-lm's KVCache (twice, first and last) and each HOST_TIERS cartridge (fused)."""
    install()
    model, rows = bench.random_model("llama3-8b"), []
    for tier in ("dense", *HOST_TIERS, "dense"):
        try:
            rows.append(measure(model, 32768, tier, "fused"))
        except Exception as e:  # recorded: a kernel that does not build, out of memory
            rows.append({"tier": tier, "context": 32768, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(rows[-1]), flush=True)
        mx.clear_cache()
    return rows


def interleave():
    """VARIANTS' decode tokens/s taken in turn: all at 32K (7 rounds), INTERLEAVE_128K at 128K (5 rounds)."""
    install()
    model = bench.random_model("llama3-8b")
    rows = interleaved(model, 32768, 7)
    mx.clear_cache()
    rows += interleaved(model, 131072, 5, INTERLEAVE_128K)
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


HOST_TIERS = ("fp16", "mlx4g32", "int8", "int8+rot", "turbo3", "mxfp4")
INTERLEAVE_128K = ("dense", "mlx4g32", "int8+rot", "turbo3 8 warps", "turbo3 4 warps", "turbo4 4 warps")


PARTS = {"floors": floors, "e2e": e2e, "sweep": sweep, "profile": profile, "prefill": prefill, "questions": questions,
         "host": host, "interleave": interleave}


def part_main(part, out, label="h200"):
    """One part of issue 34 (`--part`): writes out/{label}-{part}.json and, for `dense`, prints a table."""
    result = {"device": mx.device_info(), "mlx": mx.__version__, "dense": [], "floors": []}
    result["copy_bytes_per_s"] = bench.copy_bandwidth(1 << 30)
    if part != "dense":
        result[part] = PARTS[part]()
        json.dump(result, open(f"{out}/{label}-{part}.json", "w"), indent=1, default=str)
        return
    for n in (32768, 131072):
        for tier in ("fp16", "bf16"):
            result["dense"] += dense_rows(n, tier)
            mx.clear_cache()
        json.dump(result, open(f"{out}/{label}-dense.json", "w"), indent=1, default=str)
    base = {(r["tier"], r["context"], r["query_tokens"]): r["us"] for r in result["dense"] if r["variant"] == "sdpa"}
    print(f"copy {result['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    print(f"{'tier':5} {'context':>7} {'L':>4} {'variant':16} {'us':>8} {'vs sdpa':>8} {'err':>9}")
    for r in result["dense"]:
        b = base.get((r["tier"], r["context"], r["query_tokens"]))
        us = f"{r['us']:8.1f}" if r["us"] else "       -"
        ratio = f"{r['us'] / b:7.3f}x" if r["us"] and b else "        "
        err = r.get("max_abs_err_vs_portable")
        print(f"{r['tier']:5} {r['context']:>7} {r['query_tokens']:>4} {r['variant']:16} {us} {ratio} "
              f"{'' if err is None else f'{err:9.3g}'} {r['error'] or ''}")




if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The floor under the 128K decode-step target on a CUDA GPU: dense "
                                     "SDPA, the fused mlx4g32 step and plain streaming reads of the same bytes.")
    parser.add_argument("out", help="folder for h200-floor.json (or LABEL-PART.json)")
    parser.add_argument("--label", default="h200", help="the files' prefix (the card and session: h100-s7)")
    parser.add_argument("--part", choices=("dense", *PARTS), default=None, help="instead: one part of issue 34 (dense "
                        "pages against MLX's SDPA; decode tokens/s end to end; each tier's bare read; launch shapes of "
                        "the fused decode; two steps each of mlx4g32 and turbo3 for ncu; a question's prefill paths; where an "
                        "end-to-end decode step's time goes; decode variants timed in turn)")
    args = parser.parse_args()
    if args.part:
        part_main(args.part, args.out, args.label)
    else:
        main(args.out)
