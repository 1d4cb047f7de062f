"""CPU memory and decode speed of a loaded cartridge per tier and attention policy, each load in its own
process (issue 18, item 3).

The case of the issue: a tiny random-weight llama (8 layers, 8 KV heads x head_dim 128 = kv_dim 1024,
hidden 256) and a prefix of about 7,000 tokens (samples/lgpl-3.0.txt repeated), built once in fp16 and
converted to the other tiers. For each (tier, policy) a fresh process loads the cartridge, reads MLX's
peak and active memory after the load (`mx.get_peak_memory`, `mx.get_active_memory`: what MLX
allocated, the model's weights included), then decodes greedily from a question and reports tokens/s,
the process's CPU time per token (all threads: on a shared machine the wall time mostly measures the
other jobs) and the peak over load + decode. The model alone is measured the same way, so the prefix's
own share is the difference; `decode_peak_bytes` is the peak over the decode steps alone (after the
question's prefill). `--compare DIR` runs every row a second time right after, with the `cartridge`
package of another checkout (e.g. the code before a change), into `--compare-json`. `--one-thread`
runs each child on one thread (OPENBLAS_NUM_THREADS=1, no split of the portable path over CPU
streams): its CPU time per token is the work of a step, which a shared machine disturbs least.

`--encode`: the transient memory of encoding one long side instead. For every tier (default: all of
`cartridge.tiers.TIERS`), a fresh process makes random normal fp16 K (8 KV heads x `--tokens` x head_dim
128), then runs `make_params` + `encode_pages` as a build does and reads MLX's peak memory over it (the
input side and the output pages included), as bytes and as a multiple of the side's fp16 bytes, with the
wall seconds. With `--compare DIR` each tier runs again with DIR's `cartridge` package (the code before a
change); both sets go into one JSON (default benchmarks/results/cpu-encode-memory.json).

    python benchmarks/memory.py [--tiers fp16,mlx4g32,...] [--policies auto,dequantize-once,portable]
                                [--work /tmp/cart-mem] [--json benchmarks/results/cpu-memory.json]
                                [--compare DIR --compare-json FILE] [--one-thread]
    python benchmarks/memory.py --encode [--tokens 131072,32768] [--tiers ...] [--compare DIR] [--json FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 8, "intermediate_size": 512,
          "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
          "vocab_size": 49152, "rope_theta": 10000.0, "max_position_embeddings": 16384,
          "tie_word_embeddings": True}
REPEAT = 4  # copies of the sample text: about 7,000 prefix tokens
QUESTION = "Who may copy the library, and under which conditions?"
DECODE_TOKENS = 24
TIER_DEFAULT = "fp16,int8,mlx4g32,mxfp4,turbo4"
MEMORY_JSON = ROOT / "benchmarks" / "results" / "cpu-memory.json"
ENCODE_SHAPE = (8, 128)  # (n_kv_heads, head_dim) of the --encode side: llama3-8b's
ENCODE_PAGE = 256
ENCODE_JSON = ROOT / "benchmarks" / "results" / "cpu-encode-memory.json"


def setup(work, tiers):
    """The tiny model folder and one cartridge per tier under `work` (made once, reused)."""
    import cartridge  # noqa: F401  (before mlx)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from cartridge.models.gguf import tokenizer_from_metadata
    from cartridge.models.loader import default_gguf_path

    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "model.safetensors").exists():
        model_dir.mkdir(exist_ok=True)
        mx.random.seed(0)
        model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
        model.set_dtype(mx.float32)
        (model_dir / "config.json").write_text(json.dumps(CONFIG))
        mx.save_safetensors(str(model_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
        _, meta = mx.load(str(default_gguf_path()), return_metadata=True)
        tokenizer_from_metadata(meta)._tokenizer.save_pretrained(str(model_dir))
    fp16 = work / "fp16.cart"
    if not fp16.exists():
        text = "\n\n".join([(ROOT / "samples" / "lgpl-3.0.txt").read_text()] * REPEAT)
        cartridge.build(text, fp16, model=str(model_dir))
    for tier in tiers:
        if tier != "fp16" and not (work / f"{tier}.cart").exists():
            cartridge.convert(fp16, work / f"{tier}.cart", tier=tier)
    return model_dir


def measure(cart_path, model_dir, policy, max_memory):
    """One load in this process: memory after load, decode tokens/s, peak over load and decode."""
    import cartridge  # noqa: F401  (before mlx)
    import mlx.core as mx
    import mlx_lm

    if os.environ.get("CARTRIDGE_BENCH_ONE_THREAD"):
        from cartridge.attention.kernels import portable

        portable.CPU_SPLIT_PAGES = 1 << 30
    lm = cartridge.load_model(str(model_dir))
    mx.eval(lm.model.parameters())
    model_bytes = mx.get_active_memory()
    mx.reset_peak_memory()
    kw = {} if max_memory is None else {"max_memory": max_memory}
    t = time.perf_counter()
    cart = cartridge.load(cart_path, model=lm, attention=policy, **kw)
    load_s = time.perf_counter() - t
    row = {"policy": cart.attention, "load_s": load_s, "model_bytes": model_bytes,
           "load_peak_bytes": mx.get_peak_memory() - model_bytes,
           "resident_bytes": mx.get_active_memory() - model_bytes,
           "stored_bytes": None,  # from the plan below; else the tier's pages as stored (policy portable)
           "prefix_tokens": len(cart.info.tokens)}
    plan = getattr(cart, "plan", None)  # the loader's report, where it makes one
    if plan:
        row["plan"] = {k: plan[k] for k in ("policy", "reason", "memory")}
        row["stored_bytes"] = plan["memory"]["stored_bytes"]
    prompt = cart.question_prompt(QUESTION)
    times, cpu = [], []
    last, last_cpu = time.perf_counter(), time.process_time()
    for i, _ in enumerate(mlx_lm.stream_generate(cart.model, cart.tokenizer, prompt, prompt_cache=cart.prompt_cache(),
                                                 max_tokens=DECODE_TOKENS)):
        now, now_cpu = time.perf_counter(), time.process_time()
        if i:
            times.append(now - last)
            cpu.append(now_cpu - last_cpu)
        else:  # the question's prefill is done: what follows are decode steps
            row["prefill_peak_bytes"] = mx.get_peak_memory() - model_bytes
            mx.reset_peak_memory()
        last, last_cpu = now, now_cpu
    times.sort()
    cpu.sort()
    row["decode_tokens_per_s"] = 1.0 / times[len(times) // 2]
    row["decode_cpu_ms_per_token"] = 1e3 * cpu[len(cpu) // 2]
    row["decode_peak_bytes"] = mx.get_peak_memory() - model_bytes
    row["peak_bytes"] = max(row["prefill_peak_bytes"], row["decode_peak_bytes"])
    return row


def measure_encode(tier, tokens):
    """One side through `make_params` + `encode_pages` in this process: MLX's peak over each, wall seconds."""
    import cartridge  # noqa: F401  (before mlx)
    import mlx.core as mx

    from cartridge.attention.pages import encode_pages
    from cartridge.tiers import get_tier

    n_kv, head_dim = ENCODE_SHAPE
    mx.random.seed(0)
    x = mx.random.normal((n_kv, tokens, head_dim)).astype(mx.float16)  # (n_kv, T, D)
    mx.eval(x)
    codec = get_tier(tier)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    params = codec.make_params(x, 0, "k")
    params_s, params_peak = time.perf_counter() - t, max(base, mx.get_peak_memory())  # 0: nothing allocated
    mx.reset_peak_memory()
    t = time.perf_counter()
    parts = encode_pages(codec, x, params, ENCODE_PAGE)
    mx.eval(parts)
    side = x.nbytes
    return {"tokens": tokens, "side_fp16_bytes": side, "base_bytes": base, "output_bytes": sum(a.nbytes for a in parts.values()),
            "make_params_peak_bytes": params_peak, "make_params_s": params_s,
            "encode_peak_bytes": mx.get_peak_memory(), "encode_s": time.perf_counter() - t,
            "peak_x_side": max(params_peak, mx.get_peak_memory()) / side}


def encode_rows(tiers, token_counts, compare, path):
    """--encode: every (tokens, tier) in its own process, with this checkout's package and `compare`'s; one JSON."""
    import platform

    import mlx.core as mx

    runs = {"after": ROOT, **({"before": Path(compare).resolve()} if compare else {})}
    rows = []
    for tokens, tier in ((t, tier) for t in token_counts for tier in tiers):
        for label, root in runs.items():
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, "--encode-child", tier, str(tokens)], capture_output=True,
                                 text=True, env={**os.environ, "PYTHONPATH": str(root)})
            if out.returncode:
                print(f"{tier} {label}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            row = {"tier": tier, "run": label, "package": str(root), **json.loads(out.stdout.strip().splitlines()[-1]),
                   "load_average": [load, os.getloadavg()[0]]}
            rows.append(row)
            print(f"{tokens:>7} {tier:<12} {label:<6} peak {row['encode_peak_bytes'] / 1e6:8.1f} MB encode, "
                  f"{row['make_params_peak_bytes'] / 1e6:8.1f} MB make_params = {row['peak_x_side']:5.2f}x the fp16 side "
                  f"({row['side_fp16_bytes'] / 1e6:.1f} MB; output {row['output_bytes'] / 1e6:.1f} MB)  "
                  f"{row['make_params_s'] + row['encode_s']:6.2f} s  (load average {load:.1f})", flush=True)
    result = {"n_kv_heads": ENCODE_SHAPE[0], "head_dim": ENCODE_SHAPE[1], "page_size": ENCODE_PAGE,
              "tokens": token_counts,
              "input": "mx.random.normal, seed 0, as float16", "runs": {k: str(v) for k, v in runs.items()},
              "machine": f"{platform.machine()} {platform.processor()} ({os.cpu_count()} cores, shared)",
              "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    Path(path).write_text(json.dumps(result, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiers", default=TIER_DEFAULT)
    ap.add_argument("--policies", default="auto,dequantize-once,portable")
    ap.add_argument("--work", default="/tmp/cart-mem")
    ap.add_argument("--json", default=str(MEMORY_JSON))
    ap.add_argument("--label", default="", help="recorded with the results (e.g. before/after)")
    ap.add_argument("--compare", help="another checkout whose cartridge package runs every row again")
    ap.add_argument("--compare-json", help="where the --compare rows go")
    ap.add_argument("--one-thread", action="store_true", help="OPENBLAS_NUM_THREADS=1, no CPU stream split")
    ap.add_argument("--encode", action="store_true", help="peak memory of encoding one side per tier instead")
    ap.add_argument("--tokens", default="131072", help="--encode: tokens of the side, comma-separated")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # cart, model dir, policy, max_memory
    ap.add_argument("--encode-child", nargs=2, help=argparse.SUPPRESS)  # tier, tokens
    args = ap.parse_args()
    if args.encode_child:
        print(json.dumps(measure_encode(args.encode_child[0], int(args.encode_child[1]))))
        return
    if args.encode:
        import cartridge  # noqa: F401  (before mlx)
        from cartridge.tiers import TIERS

        tiers = list(TIERS) if args.tiers == TIER_DEFAULT else args.tiers.split(",")
        encode_rows(tiers, [int(t) for t in args.tokens.split(",")], args.compare, args.json if args.json != str(MEMORY_JSON) else ENCODE_JSON)
        return
    if args.child:
        cart, model_dir, policy, mm = args.child
        print(json.dumps(measure(cart, model_dir, policy, None if mm == "-" else int(mm))))
        return
    work = Path(args.work)
    tiers = args.tiers.split(",")
    model_dir = setup(work, tiers)
    rows, other = [], []
    roots = [(ROOT, rows)] + ([(Path(args.compare).resolve(), other)] if args.compare else [])
    for tier in tiers:
        for policy in args.policies.split(","):
            for root, out in roots:
                row = _row(root, work, model_dir, tier, policy, args.one_thread)
                if row:
                    out.append(row)
    _write(args.json, args.label + (" (one thread)" if args.one_thread else ""), rows)
    if args.compare:
        _write(args.compare_json, f"{args.label} (compare: {args.compare})", other)


def _row(root, work, model_dir, tier, policy, one_thread=False):
    """One (tier, policy) in a child process with `root`'s cartridge package; None if it failed."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    if one_thread:
        env.update(OPENBLAS_NUM_THREADS="1", CARTRIDGE_BENCH_ONE_THREAD="1")
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, __file__, "--child", str(work / f"{tier}.cart"), str(model_dir), policy, "-"],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        print(f"{tier} {policy}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    row = {"tier": tier, "asked": policy, **json.loads(out.stdout.strip().splitlines()[-1]),
           "load_average": [load, os.getloadavg()[0]]}
    print(f"{tier:<8} {policy:<16} -> {row['policy']:<22} stored {(row['stored_bytes'] or 0) / 1e6:7.1f} MB  "
          f"resident {row['resident_bytes'] / 1e6:7.1f} MB  load peak {row['load_peak_bytes'] / 1e6:7.1f} MB  "
          f"peak {row['prefill_peak_bytes'] / 1e6:6.1f} / {row['decode_peak_bytes'] / 1e6:6.1f} MB (prefill / decode)  "
          f"decode {row['decode_tokens_per_s']:5.1f} tok/s "
          f"{row['decode_cpu_ms_per_token']:6.1f} CPU ms/token  load {row['load_s']:.2f} s  "
          f"(load average {load:.1f}){'' if root == ROOT else '  [compare]'}", flush=True)
    return row


def _write(path, label, rows):
    import platform

    import mlx.core as mx

    result = {"label": label, "config": CONFIG, "question": QUESTION, "decode_tokens": DECODE_TOKENS,
              "machine": f"{platform.machine()} {platform.processor()} ({os.cpu_count()} cores, shared)",
              "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    Path(path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
