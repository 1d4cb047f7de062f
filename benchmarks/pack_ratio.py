"""Compression ratio of `cartridge pack` per tier: build the sample (default model, samples/lgpl-3.0.txt)
once per tier in the registry (every tier this checkout has, so new tiers are measured without edits),
pack it at each zstd level asked, and time pack and unpack (unpack includes the full verify).

    python benchmarks/pack_ratio.py [--levels 3,19] [--tiers fp16,bf16] [--json out/pack_ratio.json]

ratio = cartridge bytes on disk / .cartz bytes.
"""

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import cartridge  # loads OpenBLAS before mlx
from cartridge.errors import CartridgeError
from cartridge.format.pack import pack, unpack
from cartridge.tiers import TIERS

ROOT = Path(__file__).resolve().parent.parent


def one_tier(doc, lm, tier, levels, folder):
    try:
        built = cartridge.build(doc, folder / f"{tier}.cart", model=lm, tier=tier)
    except CartridgeError as e:  # a tier that cannot store this model's shape
        return {"tier": tier, "skipped": str(e)}
    row = {"tier": tier, "tokens": built.tokens, "bytes_per_token": built.bytes_per_token,
           "cartridge_bytes": built.bytes, "levels": {}}
    for level in levels:
        cartz = folder / f"{tier}-{level}.cartz"
        t0 = time.perf_counter()
        pack(built.path, cartz, level=level)
        t1 = time.perf_counter()
        unpack(cartz, folder / f"{tier}-{level}.unpacked.cart")
        t2 = time.perf_counter()
        size = cartz.stat().st_size
        row["levels"][level] = {"cartz_bytes": size, "ratio": built.bytes / size, "pack_s": t1 - t0,
                                "unpack_verify_s": t2 - t1}
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="3,19")
    ap.add_argument("--tiers", default=",".join(TIERS), help="default: every registered tier")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    doc = (ROOT / "samples" / "lgpl-3.0.txt").read_text()
    lm = cartridge.load_model()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [one_tier(doc, lm, t, levels, Path(tmp)) for t in args.tiers.split(",")]
    for r in rows:
        if "skipped" in r:
            print(f"{r['tier']}: skipped ({r['skipped']})")
            continue
        cells = ", ".join(f"level {lv}: {v['cartz_bytes']:,} bytes, {v['ratio']:.3f}x, pack {v['pack_s']:.2f} s, "
                          f"unpack+verify {v['unpack_verify_s']:.2f} s" for lv, v in r["levels"].items())
        print(f"{r['tier']}: {r['cartridge_bytes']:,} bytes ({r['bytes_per_token']:,} B/token) -> {cells}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": f"{platform.machine()} {platform.processor()}",
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
