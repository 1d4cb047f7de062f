"""Where an fp16 cartridge's decode step loses time to MLX's dense SDPA on the GPU machine (issue 34 item 1):
one layer, 32 q / 8 kv heads, head_dim 128, fp16, chained like `cartridge bench` (`bench.timeit`), at 32K and
128K tokens, in one run:

- `sdpa`: MLX's SDPA over one contiguous (1, n_kv, N + 1, D) K/V (the bench's dense baseline, + the tail token);
- `sdpa-room`: the same over the first N + 1 tokens of a (1, n_kv, N + 4096, D) buffer (a KVCache with room);
- `sdpa-pages`: the same after concatenating the (n_pages, n_kv, P, D) pages and the tail per step (a copy);
- `fused`: the fused fp16 kernel, single launch (pass 1 + tail + merge in one kernel);
- `fused-2k`: the fused kernel as two launches (pass 1, then the finish);
- `fused-b{B}-u{U}`: single launch with TARGET_BLOCKS B and UNROLL U (the plain pass 1's launch shape);
- `dequantize-once (...)`: the dequantize-once fp16 layer as `policy.place` builds it (its kernel class named).

Each variant's output is checked against the portable path's (max abs error, fp16 output).
                                           python3 benchmarks/gpu_fp16_gap.py OUT_DIR
"""

import json
import sys

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx

from cartridge.attention import policy
from cartridge.attention.cache import CartridgeCache, LayerPrefix
from cartridge.attention.kernels import cuda
from cartridge.attention.pages import make_prefix
from cartridge.eval import bench
from cartridge.tiers import TIERS

N_Q, N_KV, D = 32, 8, 128
SCALE = D ** -0.5


def _cache(prefix, kernel):
    return CartridgeCache(LayerPrefix(prefix.k_codec, prefix.k_parts, prefix.v_codec, prefix.v_parts, prefix.n_tokens,
                                      prefix.k_params, prefix.v_params, kernel))


def run(n):
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


def main(out_dir):
    rows = []
    for n in (32768, 131072):
        rows += run(n)
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
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
