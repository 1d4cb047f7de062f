"""Load time of a cartridge against mlx-lm's load_prompt_cache of the same tokens, and the first token after.

`cartridge.load` (verify="header" and "pages") of a cartridge with the model already loaded, beside mlx-lm's `load_prompt_cache` of the same tokens (its arrays evaluated: `mx.load` is
lazy), the SHA-256 time of the cartridge's stored page bytes, and the time to first token after each load.
All in one process, interleaved, so the machine's load hits every row alike.

    python benchmarks/load_time.py [--cartridge X.cart] [--repeat 9] [--json benchmarks/results/cpu-load.json]

Without --cartridge, samples/lgpl-3.0.txt is built (fp16, default model) into a temporary folder first.

Two other modes (each instead of the comparison above):

    python benchmarks/load_time.py --verify-cost [--large-tokens 46000] [--repeat 5] [--json out/verify_cost.json]

what verification costs: `cartridge.load` with verify="header" and verify="pages" (model already loaded),
`open_cartridge` alone, and a full `verify_cartridge`, on the sample and on a large synthetic cartridge of the
default model's geometry; also the machine's single-core SHA-256 speed, the physical limit of the page check
(docs/integrity.md).

    python benchmarks/load_time.py --map-copy [--json benchmarks/results/cpu-map-copy.json]

whether `mx.asarray` of a numpy view of a mapped file (what load.py does with pages.bin) copies, and at what
cost: MLX 0.32 python/src/convert.cpp (nd_array_to_mlx_contiguous): "Make a copy of the numpy buffer": the
array(const T*, shape, dtype) constructor copies into a buffer of MLX's allocator (on Metal a shared-storage
MTLBuffer). The time of 5 conversions of 256 MiB (a scratch file, $PAGES or /tmp/map_copy_cost.bin) and the
resident-set growth (docs/performance.md).

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
import sys
import tempfile
import time
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from cartridge.format.layout import DATA_NAME
from cartridge.format.reader import open_cartridge, verify_cartridge
from cartridge.format.writer import CartridgeWriter
from cartridge.models import loader
from cartridge.models.loader import architecture_config

QUESTION = "Who may copy and distribute this library?"
ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "lgpl-3.0.txt"


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


def write_json(path, result):
    """Write `result` as indented JSON to `path` (its folder made), if a path was given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


def summary(xs, cpu=None):
    out = {"median_s": statistics.median(xs), "min_s": min(xs), "runs": len(xs)}
    if cpu:  # process CPU time (all threads): less sensitive than wall time to other processes on the machine
        out.update(cpu_median_s=statistics.median(cpu), cpu_min_s=min(cpu))
    return out


def median_time(fn, repeat):
    """Median seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sha256_gbps(n=1 << 28):
    buf = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    hashlib.sha256(buf).digest()
    return n / (time.perf_counter() - t0) / 1e9


def synthetic(path, lm, n_tokens, page_size=256):
    """A cartridge with the default model's geometry and fingerprint, filled with random fp16 pages."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.cartfiles import header as synthetic_header  # the tests' synthetic-cartridge header
    attn = lm.model.layers[0].self_attn
    n_layers, n_kv, head_dim = len(lm.model.layers), attn.n_kv_heads, attn.head_dim
    n_pages = -(-n_tokens // page_size)
    header = synthetic_header(n_layers, n_kv, head_dim, page_size, n_tokens, writer="benchmark", ref="default",
                              fingerprint=lm.fingerprint, config=architecture_config(lm.model), mode="chat_template")
    rng = np.random.default_rng(0)
    with CartridgeWriter(path) as w:
        for layer in range(n_layers):
            for side in "kv":
                pages = rng.standard_normal((n_pages, n_kv, page_size, head_dim), dtype=np.float32)
                w.add_extent(layer, side, "values", pages.astype(np.float16))
        w.commit(header, rng.integers(0, 49152, n_tokens, dtype=np.uint32))
    return path


def verify_row(path, lm, repeat):
    size = sum(f.stat().st_size for f in Path(path).iterdir())

    def opened(mode):
        _, data = open_cartridge(path, verify=mode)
        data.close()

    row = {"path": str(path), "bytes": size}
    for mode in ("header", "pages"):
        row[f"open_{mode}_s"] = median_time(lambda: opened(mode), repeat)
        row[f"load_{mode}_s"] = median_time(lambda: cartridge.load(path, model=lm, verify=mode), repeat)
    row["verify_s"] = median_time(lambda: verify_cartridge(path).raise_for_error(), repeat)
    row["page_check_s"] = row["open_pages_s"] - row["open_header_s"]
    row["page_check_gbps"] = size / row["page_check_s"] / 1e9 if row["page_check_s"] > 0 else None
    return row


def verify_cost(args):
    """--verify-cost: the load/open/verify times of the sample and of a synthetic cartridge."""
    lm = cartridge.load_model()
    out = {"machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
           "sha256_gbps_one_core": sha256_gbps(), "repeat": args.repeat or 5, "rows": {}}
    with tempfile.TemporaryDirectory(dir=ROOT / "out" if (ROOT / "out").is_dir() else None) as tmp:
        sample = cartridge.build((ROOT / "samples" / "lgpl-3.0.txt").read_text(), Path(tmp) / "sample.cart", model=lm)
        out["rows"]["sample"] = {"tokens": sample.tokens, **verify_row(sample.path, lm, args.repeat or 5)}
        big = synthetic(Path(tmp) / "large.cart", lm, args.large_tokens)
        out["rows"]["large"] = {"tokens": args.large_tokens, **verify_row(big, lm, args.repeat or 5)}
    print(f"SHA-256 one core: {out['sha256_gbps_one_core']:.2f} GB/s")
    for name, r in out["rows"].items():
        print(f"{name}: {r['tokens']:,} tokens, {r['bytes']:,} bytes | load header {r['load_header_s']:.3f} s, "
              f"load pages {r['load_pages_s']:.3f} s | open header {r['open_header_s']:.3f} s, open pages "
              f"{r['open_pages_s']:.3f} s (page check {r['page_check_s']:.3f} s, {r['page_check_gbps'] or 0:.2f} GB/s) "
              f"| verify {r['verify_s']:.3f} s")
    write_json(args.json, out)


def map_copy(args):
    """--map-copy: 5 `mx.asarray` conversions of a 256 MiB numpy view of a mapped file: time, resident-set growth
    (bytes), and whether the MLX array shares the mapping's address."""
    path = os.environ.get("PAGES", "/tmp/map_copy_cost.bin")  # a scratch file of random page bytes
    n = 256 * 1024 * 1024
    if not os.path.exists(path) or os.path.getsize(path) != n:
        with open(path, "wb") as f:
            f.write(np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8).tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, dtype=np.uint32).reshape(1024, 8, 32, -1)
        _ = int(view[::7].sum())  # fault the file's pages in (page cache)

        def rss():
            return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

        times, extra = [], []
        for _ in range(5):
            before = rss()
            t = time.perf_counter()
            a = mx.asarray(view)
            mx.eval(a)
            times.append(time.perf_counter() - t)
            extra.append(rss() - before)
            addr_np = view.__array_interface__["data"][0]
            addr_mx = np.array(a, copy=False).__array_interface__["data"][0]
            del a
        del view
    res = {"bytes": n, "asarray_s": times, "median_s": sorted(times)[2], "GB_per_s": n / sorted(times)[2] / 1e9,
           "rss_growth_bytes": extra, "same_address": addr_np == addr_mx, "mlx": mx.__version__,
           "device": str(mx.default_device()), "machine": os.uname().machine, "cpus": os.cpu_count()}
    print(json.dumps(res, indent=1))
    write_json(args.json, res)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cartridge", help="a cartridge of the default model (default: build the sample)")
    ap.add_argument("--repeat", type=int, help="timed loads of each kind, interleaved (default: 9; 5 with "
                    "--verify-cost)")
    ap.add_argument("--json", help="write the result here (e.g. benchmarks/results/cpu-load.json)")
    ap.add_argument("--verify-cost", action="store_true", help="instead: what verification costs (docs/integrity.md)")
    ap.add_argument("--large-tokens", type=int, default=46000,
                    help="--verify-cost: synthetic cartridge size (23,040 B/token; default: %(default)s)")
    ap.add_argument("--map-copy", action="store_true", help="instead: the cost of mx.asarray of a mapped file")
    args = ap.parse_args()
    if args.verify_cost:
        return verify_cost(args)
    if args.map_copy:
        return map_copy(args)
    args.repeat = args.repeat or 9

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
    write_json(args.json, result)


if __name__ == "__main__":
    main()
