"""convert fp16 -> TIER of an 8K-token cartridge against building TIER directly (prefill included),
on the default model, and how far the converted pages are from the direct build's.

    python benchmarks/convert.py [--copies 5] [--tier mlx4g32] [--repeats 3] [--json out.json]

Both builds get the loaded model (model loading is timed by neither). The document is
samples/lgpl-3.0.txt repeated `--copies` times (5: 8,057 tokens with the default model's chat
template, its context is 8,192).
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import warnings
from pathlib import Path

import cartridge  # noqa: I001  (loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from cartridge.format.layout import DATA_NAME, INDEX_NAME

ROOT = Path(__file__).resolve().parent.parent


def page_difference(a, b):
    """Bytes of pages.bin that differ between two cartridges of the same layout, and the index equality
    outside the page tables (which hold the pages' checksums)."""
    x = np.fromfile(Path(a) / DATA_NAME, np.uint8)
    y = np.fromfile(Path(b) / DATA_NAME, np.uint8)
    ia, _ = cartridge.open_cartridge(a, verify="header")
    ib, _ = cartridge.open_cartridge(b, verify="header")
    keys = {k for k in ia.records if not k.endswith(".pages")}
    return {
        "pages_bin_bytes": int(x.size),
        "pages_bin_bytes_differing": int(np.count_nonzero(x != y)) if x.size == y.size else None,
        "index_equal_outside_page_tables": keys == {k for k in ib.records if not k.endswith(".pages")}
        and all(ia.records[k] == ib.records[k] for k in keys),
        "files_identical": (Path(a) / INDEX_NAME).read_bytes() == (Path(b) / INDEX_NAME).read_bytes()
        and bool(np.array_equal(x, y)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=5)
    ap.add_argument("--tier", default="mlx4g32")
    ap.add_argument("--repeats", type=int, default=3, help="convert runs (the median is reported)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    text = "\n\n".join([(ROOT / "samples" / "lgpl-3.0.txt").read_text()] * a.copies)
    lm = cartridge.load_model()
    out = {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, mlx {mx.default_device()}",
           "model": lm.ref, "tier": a.tier}
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 8,057 of 8,192 tokens: the reserve warning is expected here
        tmp = Path(tmp)
        src = cartridge.build(text, tmp / "fp16.cart", model=lm, tier="fp16")
        print(f"build fp16: {src.tokens} tokens, {src.seconds:.1f} s (prefill {src.prefill_seconds:.1f} s)", flush=True)
        direct = cartridge.build(text, tmp / "direct.cart", model=lm, tier=a.tier)
        print(f"build {a.tier}: {direct.seconds:.1f} s (prefill {direct.prefill_seconds:.1f} s)", flush=True)
        runs = []
        for i in range(a.repeats):
            r = cartridge.convert(src.path, tmp / "conv.cart", tier=a.tier, force=i > 0)
            runs.append(r.seconds)
            print(f"convert fp16 -> {a.tier}: {r.seconds:.2f} s", flush=True)
        out.update({
            "tokens": src.tokens,
            "build_fp16_seconds": src.seconds, "build_fp16_prefill_seconds": src.prefill_seconds,
            "build_tier_seconds": direct.seconds, "build_tier_prefill_seconds": direct.prefill_seconds,
            "convert_seconds": runs, "convert_seconds_median": statistics.median(runs),
            "speedup_vs_build_tier": direct.seconds / statistics.median(runs),
            "source_bytes": src.bytes, "converted_bytes": r.bytes, "direct_bytes": direct.bytes,
            "source_dtype": cartridge.open_cartridge(src.path, verify="header")[0].source_dtype,
            "converted_vs_direct": page_difference(tmp / "conv.cart", tmp / "direct.cart"),
        })
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
