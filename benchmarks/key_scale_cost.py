"""What per-channel K scaling (format 1.11, `cartridge.tiers.key_scale`) costs per decode step, in one run: for one
layer and one query token, beside MLX's dense SDPA over the same context and a bare read of the layer's stored
bytes (`cartridge.eval.bench.read_floor`), each attention policy of this device over the same pages without and
with a K scale (the queries multiplied by s and the new key divided by s at the cache, every kernel unchanged),
and the two scale operations alone. Shapes are SmolLM2-135M's (9 query heads over 3 KV heads, head_dim 64) and
Gemma 3 270M's full-attention layers' (4 over 1, head_dim 256); K/V random (speed does not depend on values).

    PYTHONPATH=. python benchmarks/key_scale_cost.py OUT.json [--contexts 4096,32768] [--tiers mlx4g32+rot,int8]
"""

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cartridge  # noqa: F401, E402, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from cartridge.attention import backends  # noqa: E402
from cartridge.attention.timing import timeit  # noqa: E402
from cartridge.eval.bench import available_policies, random_kv, read_floor, tier_prefix, time_policy  # noqa: E402
from cartridge.eval.bench_report import environment  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "gemma3-270m": (4, 1, 256)}  # (n_q_heads, n_kv_heads, head_dim)


def scale_ops(shape, dtype, repeats):
    """µs of the two operations a scaled layer adds per decode step: q * s (1, n_q, 1, D) and k / s (1, n_kv, 1, D)."""
    n_q, n_kv, d = shape
    s = mx.random.uniform(0.5, 2.0, (n_kv, d))
    per_q = mx.repeat(s, n_q // n_kv, axis=0)[None, :, None, :]
    inverse = (1.0 / s)[None, :, None, :]
    q, k = mx.random.normal((1, n_q, 1, d)).astype(dtype), mx.random.normal((1, n_kv, 1, d)).astype(dtype)
    mx.eval(per_q, inverse, q, k)
    return timeit(lambda: [(q * per_q).astype(dtype), (k * inverse).astype(dtype)], repeats) * 1e6


def rows_for(name, shape, n_tokens, tiers, repeats):
    n_q, n_kv, d = shape
    dtype = mx.float32 if backends.device() == "cpu" else mx.float16
    k, v = random_kv(n_kv, n_tokens, d, seed=n_tokens)
    q = mx.random.normal((1, n_q, 1, d)).astype(dtype)
    new_k = mx.random.normal((1, n_kv, 1, d)).astype(dtype)
    dense_k, dense_v = k[None].astype(dtype), v[None].astype(dtype)
    mx.eval(q, new_k, dense_k, dense_v)
    base = {"shape": name, "context": n_tokens}
    out = [{**base, "what": "dense sdpa", "us": timeit(lambda x: mx.fast.scaled_dot_product_attention(
        x, dense_k, dense_v, scale=d ** -0.5), repeats, chain=q) * 1e6},
        {**base, "what": "scale ops alone", "us": scale_ops(shape, dtype, repeats)}]
    scale = mx.random.uniform(0.5, 2.0, (n_kv, d))
    for tier in tiers:
        prefix, error = tier_prefix(tier, k, v)
        if prefix is None:
            out.append({**base, "what": f"{tier}", "error": error})
            continue
        out.append({**base, "what": f"{tier} read floor", "us": read_floor(prefix, tier, n_tokens, repeats)["us"]})
        for policy in available_policies():
            for label, p in (("plain", prefix), ("scaled", replace(prefix, key_scale=scale))):
                us, _, error = time_policy(p, policy, dtype, q, new_k, repeats)
                out.append({**base, "what": f"{tier} {policy} {label}", "us": us, "error": error})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--tiers", default="mlx4g32+rot,int8")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rows = []
    for name, shape in SHAPES.items():
        for n in (int(c) for c in args.contexts.split(",")):
            for row in rows_for(name, shape, n, args.tiers.split(","), args.repeats):
                rows.append(row)
                us = f"{row['us']:9.1f} us" if row.get("us") is not None else f"  {row.get('error')}"
                print(f"{name:13s} {n:7d}  {row['what']:40s}{us}", flush=True)
    Path(args.out).write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
