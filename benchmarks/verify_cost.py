"""Measure what verification costs: `cartridge.load` with verify="header" and verify="pages" (model
already loaded), `open_cartridge` alone, and a full `verify_cartridge`, on the sample (default model,
samples/lgpl-3.0.txt) and on a large synthetic cartridge of the default model's geometry. Also the
machine's single-core SHA-256 speed, the physical limit of the page check.

    python benchmarks/verify_cost.py [--large-tokens 46000] [--repeat 5] [--json out/verify_cost.json]

Files are in the page cache (just written), so this measures hashing and parsing, not the disk.
"""

import argparse
import hashlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import numpy as np

from cartridge.format.reader import open_cartridge, verify_cartridge
from cartridge.format.writer import CartridgeWriter
from cartridge.models.loader import architecture_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from cartfiles import header as synthetic_header  # noqa: E402  (the tests' synthetic-cartridge header)


def timed(fn, repeat):
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


def measure(path, lm, repeat):
    size = sum(f.stat().st_size for f in Path(path).iterdir())

    def opened(mode):
        _, data = open_cartridge(path, verify=mode)
        data.close()

    row = {"path": str(path), "bytes": size}
    for mode in ("header", "pages"):
        row[f"open_{mode}_s"] = timed(lambda: opened(mode), repeat)
        row[f"load_{mode}_s"] = timed(lambda: cartridge.load(path, model=lm, verify=mode), repeat)
    row["verify_s"] = timed(lambda: verify_cartridge(path).raise_for_error(), repeat)
    row["page_check_s"] = row["open_pages_s"] - row["open_header_s"]
    row["page_check_gbps"] = size / row["page_check_s"] / 1e9 if row["page_check_s"] > 0 else None
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--large-tokens", type=int, default=46000, help="synthetic cartridge size (23,040 B/token)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lm = cartridge.load_model()
    out = {"machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
           "sha256_gbps_one_core": sha256_gbps(), "repeat": args.repeat, "rows": {}}
    with tempfile.TemporaryDirectory(dir=ROOT / "out" if (ROOT / "out").is_dir() else None) as tmp:
        sample = cartridge.build((ROOT / "samples" / "lgpl-3.0.txt").read_text(), Path(tmp) / "sample.cart", model=lm)
        out["rows"]["sample"] = {"tokens": sample.tokens, **measure(sample.path, lm, args.repeat)}
        big = synthetic(Path(tmp) / "large.cart", lm, args.large_tokens)
        out["rows"]["large"] = {"tokens": args.large_tokens, **measure(big, lm, args.repeat)}
    print(f"SHA-256 one core: {out['sha256_gbps_one_core']:.2f} GB/s")
    for name, r in out["rows"].items():
        print(f"{name}: {r['tokens']:,} tokens, {r['bytes']:,} bytes | load header {r['load_header_s']:.3f} s, "
              f"load pages {r['load_pages_s']:.3f} s | open header {r['open_header_s']:.3f} s, open pages "
              f"{r['open_pages_s']:.3f} s (page check {r['page_check_s']:.3f} s, {r['page_check_gbps'] or 0:.2f} GB/s) "
              f"| verify {r['verify_s']:.3f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
