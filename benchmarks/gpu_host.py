"""Where an end-to-end decode step's time goes on the GPU (issue 34 item 5): for a random llama3-8b (32 layers,
fp16) with a prefix of N tokens in mlx-lm's dense `KVCache` or in a cartridge of each tier (fused), in one run:

- `tokens_per_s`: greedy decode through mlx-lm's `generate_step` (`bench.decode_tokens_per_s`, best of 3 rounds);
- `build_ms`: the host's time to build one step's graph (the model's forward, nothing evaluated);
- `sync_ms`: one step built and then evaluated with nothing overlapped (build + the device's time + encoding);
- `ops`: MLX primitives per step in the graph (`export_to_dot`), i.e. what the backend encodes, and by kind.

A step whose `build_ms` is near its pipelined time (1000 / tokens_per_s) is bound by the host; the ops count says
how much of that is the cartridge's per-layer work against KVCache's. Every measurement starts from the same
prefix (tails trimmed back), so each runs with a short tail (the single launch). Also: the host's cost of one
more `slice_update` and one more custom kernel call in a chain (build + evaluate, `per_op_us`).

    python benchmarks/gpu_host.py OUT_DIR [--label h200] [--contexts 32768] [--tiers fp16,mlx4g32,...] [--shape llama3-8b]
    python benchmarks/gpu_host.py OUT_DIR --interleave 5    (VARIANTS in turn: OUT_DIR/{label}-interleaved.json)

Writes OUT_DIR/{label}-host.json. Uses only APIs that older commits have too, so the same script times two
versions of the package in one lease (PYTHONPATH).
"""

import argparse
import collections
import io
import json
import re
import statistics
import time

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from cartridge.attention.pages import make_prefix
from cartridge.attention.route import install
from cartridge.eval import bench
from cartridge.tiers import TIERS


def make_caches(model, n, tier, policy="fused"):
    """One cache per layer over a random prefix of n tokens: KVCache (tier "dense") or a cartridge cache read under
    `policy`."""
    n_layers, n_kv, D = bench.model_geometry(model)
    caches = []
    for i in range(n_layers):
        k, v = bench.random_kv(n_kv, n, D, seed=i)
        if tier == "dense":
            c = KVCache()
            c.keys, c.values, c.offset = k[None], v[None], n
        else:
            prefix = make_prefix(TIERS[tier], k, TIERS[tier], v, bench.PAGE_SIZE, layer=i)
            c = bench.layer_cache(prefix, policy, mx.float16, D)
            mx.eval(list(prefix.k_parts.values()), list(prefix.v_parts.values()))
        caches.append(c)
    mx.eval([[c.keys, c.values] for c in caches if isinstance(c, KVCache)])
    return caches


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


def per_op_us():
    """Host cost of one more op in a chain, built and evaluated: slice_update into a (1, 8, 4096, 128) fp16
    buffer, and an elementwise add (for scale)."""
    buf = mx.zeros((1, 8, 4096, 128), dtype=mx.float16)
    x = mx.ones((1, 8, 1, 128), dtype=mx.float16)
    mx.eval(buf, x)
    out = {}
    for name, fn in (("slice_update", lambda b, i: mx.slice_update(b, x, mx.array([0, 0, i % 4096, 0]), (0, 1, 2, 3))),
                     ("add", lambda b, i: b + 1)):
        for n in (100, 1000):
            b = buf
            t0 = time.perf_counter()
            for i in range(n):
                b = fn(b, i)
            t1 = time.perf_counter()
            mx.eval(b)
            t2 = time.perf_counter()
            out[f"{name}_{n}"] = {"build_us": (t1 - t0) / n * 1e6, "total_us": (t2 - t0) / n * 1e6}
    return out


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


# --interleave: (label, tier, {module switch: value}) held while the caches are made and their plans fixed
VARIANTS = (("dense", "dense", {}), ("fp16 contiguous", "fp16", {}),
            ("fp16 flash", "fp16", {"backend.CONTIGUOUS_DENSE": False}), ("mlx4g32", "mlx4g32", {}),
            ("int8", "int8", {}), ("int8+rot", "int8+rot", {}), ("turbo3 8 warps", "turbo3", {}),
            ("turbo3 4 warps", "turbo3", {"cuda.TC_WARPS_TURBO": 4}), ("turbo4 4 warps", "turbo4", {"cuda.TC_WARPS_TURBO": 4}))


def interleaved(model, n, rounds, only=None):
    """Every VARIANTS entry's caches made at once, then `rounds` rounds of decode tokens/s (generate_step, 32
    tokens, tails trimmed back before each) taken in turn, so that a slow stretch of a shared host hits every
    variant alike: rows with each round's tokens/s, their median and best."""
    from cartridge.attention.backends import cuda as backend
    from cartridge.attention.kernels import cuda

    modules = {"backend": backend, "cuda": cuda}
    made = []
    for label, tier, switches in VARIANTS:
        if only and label not in only:
            continue
        saved = {k: getattr(modules[k.split(".")[0]], k.split(".")[1]) for k in switches}
        for k, v in switches.items():
            setattr(modules[k.split(".")[0]], k.split(".")[1], v)
        try:
            caches = make_caches(model, n, tier)
            step_times(model, caches, n, steps=2)  # the first calls fix each layer's plan under the switches
            made.append((label, caches, None))
        except Exception as e:
            made.append((label, None, f"{type(e).__name__}: {e}"))
        for k, v in saved.items():
            setattr(modules[k.split(".")[0]], k.split(".")[1], v)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--label", default="h200")
    parser.add_argument("--contexts", default="32768")
    parser.add_argument("--tiers", default="fp16,mlx4g32,int8,int8+rot,turbo3,mxfp4")
    parser.add_argument("--policy", default="fused", help="the cartridges' attention policy (CPU: dequantize-once)")
    parser.add_argument("--shape", default="llama3-8b", choices=("llama3-8b", "llama3.2-1b"))
    parser.add_argument("--interleave", type=int, default=0, help="instead: VARIANTS' decode speed, N rounds in turn")
    parser.add_argument("--variants", default="", help="with --interleave: these VARIANTS labels only (comma-separated)")
    parser.add_argument("--version", default="", help="a name for the package version timed (old, new)")
    args = parser.parse_args()
    install()
    result = {"device": mx.device_info(), "mlx": mx.__version__, "version": args.version, "rows": [],
              "per_op": per_op_us()}
    print(json.dumps(result["per_op"]), flush=True)
    model = bench.random_model(args.shape)
    if args.interleave:
        for n in (int(c) for c in args.contexts.split(",")):
            result["rows"] += interleaved(model, n, args.interleave, [v for v in args.variants.split(",") if v])
        with open(f"{args.out}/{args.label}-interleaved-{args.contexts.replace(',', '-')}.json", "w") as f:
            json.dump(result, f, indent=1)
        for r in result["rows"]:
            runs = " ".join(f"{x:.1f}" for x in r["tokens_per_s"])
            print(f"{r['variant']:16s} {r['context']:7d} median {r['median'] or 0:6.1f} best {r['best'] or 0:6.1f}  [{runs}]"
                  f"{'  ' + r['error'][:80] if r['error'] else ''}")
        return
    for n in (int(c) for c in args.contexts.split(",")):
        for tier in ["dense", *args.tiers.split(","), "dense"]:
            try:
                row = measure(model, n, tier, args.policy)
            except Exception as e:  # recorded: a kernel that does not build, out of memory
                row = {"tier": tier, "context": n, "error": f"{type(e).__name__}: {e}"}
            row["version"] = args.version
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            mx.clear_cache()
    with open(f"{args.out}/{args.label}-host{'-' + args.version if args.version else ''}.json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'tier':10s} {'ctx':>7s} {'tok/s':>7s} {'step ms':>8s} {'build ms':>9s} {'sync ms':>8s} {'ops':>6s}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['tier']:10s} {r['context']:7d} {r['error'][:90]}")
            continue
        print(f"{r['tier']:10s} {r['context']:7d} {r['tokens_per_s']:7.1f} {r['step_ms']:8.2f} {r['build_ms']:9.2f} "
              f"{r['sync_ms']:8.2f} {r['ops']:6d}")


if __name__ == "__main__":
    main()
