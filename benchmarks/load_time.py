"""Load time of a cartridge against mlx-lm's load_prompt_cache of the same tokens, and the first token after.

`cartridge.load` (verify="header" and "pages") of a cartridge with the model already loaded, beside mlx-lm's `load_prompt_cache` of the same tokens (its arrays evaluated: `mx.load` is
lazy), the SHA-256 time of the cartridge's stored page bytes, and the time to first token after each load.
All in one process, interleaved, so the machine's load hits every row alike.

    python benchmarks/load_time.py [--cartridge X.cart] [--repeat 9] [--json benchmarks/results/cpu-load.json]

Without --cartridge, samples/lgpl-3.0.txt is built (fp16, default model) into a temporary folder first.

The mlx-lm file is written by `save_prompt_cache` after a prefill (mlx-lm's own `make_prompt_cache` caches,
the model's dtype) of the cartridge's token ids. Files are in the page cache: this measures parsing, copying,
decoding and hashing, not the disk. Also counted: fingerprint computations across all the loads (one model).
"""

import argparse
import hashlib
import json
import mmap
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from cartridge.format.layout import DATA_NAME
from cartridge.models import loader

QUESTION = "Who may copy and distribute this library?"
SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "lgpl-3.0.txt"


def mlx_lm_cache_file(model, tokens, path, step=512):
    """Prefill `tokens` into mlx-lm's own caches and save them with `save_prompt_cache`."""
    cache = make_prompt_cache(model)
    for a in range(0, len(tokens), step):
        model(mx.array(tokens[a:a + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    save_prompt_cache(str(path), cache)


def load_mlx_lm(path):
    cache = load_prompt_cache(str(path))
    mx.eval([c.state for c in cache])
    return cache


def first_token(model, prompt, cache):
    """Seconds until generate_step's first token is evaluated."""
    t0 = time.perf_counter()
    token, _ = next(generate_step(mx.array(prompt), model, prompt_cache=cache))
    int(token)
    return time.perf_counter() - t0


def sha256_bytes(path):
    """One SHA-256 over every byte of pages.bin (mapped, no copy), single thread; returns the bytes hashed."""
    with open(Path(path) / DATA_NAME, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        with memoryview(m) as mv:
            hashlib.sha256(mv).digest()
        return len(m)


def cpu_name():
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def summary(xs, cpu=None):
    out = {"median_s": statistics.median(xs), "min_s": min(xs), "runs": len(xs)}
    if cpu:  # process CPU time (all threads): less sensitive than wall time to other processes on the machine
        out.update(cpu_median_s=statistics.median(cpu), cpu_min_s=min(cpu))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cartridge", help="a cartridge of the default model (default: build the sample)")
    ap.add_argument("--repeat", type=int, default=9, help="timed loads of each kind, interleaved (default: %(default)s)")
    ap.add_argument("--json", help="write the result here (e.g. benchmarks/results/cpu-load.json)")
    args = ap.parse_args()

    lm = loader.load_model(None)
    tmp = tempfile.TemporaryDirectory(prefix="load-time-")
    if args.cartridge is None:
        args.cartridge = str(Path(tmp.name) / "lgpl.cart")
        cartridge.build(SAMPLE.read_text(), args.cartridge, model=lm)
    load_before = os.getloadavg()
    calls = {"n": 0}
    compute = loader.fingerprint

    def counted(model, tokenizer):
        calls["n"] += 1
        return compute(model, tokenizer)

    loader.fingerprint = counted  # count the fingerprints the loads below compute
    first = cartridge.load(args.cartridge, model=lm, verify="header")  # warm: imports, calibration tables
    tokens, prompt = first.tokens, first.question_prompt(QUESTION)
    times = {"mlx_lm": [], "header": [], "pages": [], "sha256": []}
    cpu = {k: [] for k in times}
    ttft = {"mlx_lm": [], "header": []}

    def timed(kind, fn):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        times[kind].append(time.perf_counter() - w)
        cpu[kind].append(time.process_time() - c)
        return out

    with tmp:
        cache_file = Path(tmp.name) / "prompt.safetensors"
        mlx_lm_cache_file(lm.model, tokens, cache_file)
        load_mlx_lm(cache_file)
        for _ in range(args.repeat):  # loads only: no matmul before them (OpenBLAS threads spin after one)
            timed("mlx_lm", lambda: load_mlx_lm(cache_file))
            for verify in ("header", "pages"):
                cart = timed(verify, lambda: cartridge.load(args.cartridge, model=lm, verify=verify))
                mx.eval([c.state for c in cart.prompt_cache()])  # its background decode ends before the next timing
            stored = timed("sha256", lambda: sha256_bytes(args.cartridge))
        for _ in range(args.repeat):  # the first token right after each load (the cartridge's waits for its decode)
            ttft["mlx_lm"].append(first_token(lm.model, prompt, load_mlx_lm(cache_file)))
            cart = cartridge.load(args.cartridge, model=lm, verify="header")
            ttft["header"].append(first_token(lm.model, prompt, cart.prompt_cache()))
    loader.fingerprint = compute
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "machine": f"{cpu_name()} ({os.cpu_count()} cores), MLX {mx.__version__} CPU",
        "load_average_before_after": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
        "date": time.strftime("%Y-%m-%d"),
        "cartridge": str(args.cartridge), "tokens": len(tokens), "stored_bytes": stored,
        "attention": cart.attention, "question_tokens": len(prompt),
        "mlx_lm_load_prompt_cache": summary(times["mlx_lm"], cpu["mlx_lm"]),
        "cartridge_load_header": summary(times["header"], cpu["header"]),
        "cartridge_load_pages": summary(times["pages"], cpu["pages"]),
        "sha256_stored_bytes": summary(times["sha256"], cpu["sha256"]),
        "ttft_after_mlx_lm_load": summary(ttft["mlx_lm"]),
        "ttft_after_cartridge_load": summary(ttft["header"]),
        "ratio_header_to_mlx_lm": med["header"] / med["mlx_lm"],
        "cpu_ratio_header_to_mlx_lm": statistics.median(cpu["header"]) / statistics.median(cpu["mlx_lm"]),
        "pages_minus_header_over_sha256": (med["pages"] - med["header"]) / med["sha256"],
        "fingerprints_computed": calls["n"], "loads": 1 + 3 * args.repeat,
        "targets": {"header_le_2x_mlx_lm": med["header"] <= 2 * med["mlx_lm"],
                    "pages_le_header_target_plus_sha256": med["pages"] <= 2 * med["mlx_lm"] + med["sha256"]},
    }
    for k in ("mlx_lm_load_prompt_cache", "cartridge_load_header", "cartridge_load_pages", "sha256_stored_bytes",
              "ttft_after_mlx_lm_load", "ttft_after_cartridge_load"):
        r = result[k]
        line = f"{k:28s} median {r['median_s'] * 1e3:7.1f} ms   min {r['min_s'] * 1e3:7.1f} ms"
        print(line + (f"   cpu median {r['cpu_median_s'] * 1e3:7.1f} ms" if "cpu_median_s" in r else ""))
    print(f"header / mlx-lm {result['ratio_header_to_mlx_lm']:.2f}x (cpu {result['cpu_ratio_header_to_mlx_lm']:.2f}x); (pages - header) / sha256 "
          f"{result['pages_minus_header_over_sha256']:.2f}; {calls['n']} fingerprint(s) in {result['loads']} loads; "
          f"{len(tokens)} tokens, {stored / 1e6:.1f} MB stored, attention {cart.attention}; "
          f"load average {result['load_average_before_after']} (before, after)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
