"""Operations that skip the re-prefill, against rebuilding (default model, this machine). Prints one line
per run and writes JSON.

    python benchmarks/extend.py [--doc-tokens 2048,4096] [--new-tokens 256] [--tier fp16] [--repeat 2]
                                [--json benchmarks/results/cpu-extend.json]
    python benchmarks/extend.py --convert [--copies 5] [--tier mlx4g32] [--repeat 3]
                                [--json benchmarks/results/cpu-convert.json]

Extend (the default): a ~4K-token document extended by ~256 tokens, against rebuilding the joined text from
scratch. Each document size (comma-separated) is built once, then extended and rebuilt `--repeat` times, in
turn. Extend's time covers everything it does: load and verify the stored cartridge, prefill the new tokens
over it, encode, write old + new pages, verify the result, publish. Rebuild's covers prefill of the joined
text, encode and write. Wall and process CPU seconds are both recorded, with the load average before and
after each run: the CPU may be shared.

--convert: `cartridge convert` fp16 -> TIER of an 8K-token cartridge against building TIER directly (prefill
included), `--repeat` converts (the median is reported), and how far the converted pages are from the direct
build's. The document is samples/lgpl-3.0.txt repeated `--copies` times (5: 8,057 tokens with the default
model's chat template, its context is 8,192).

Both sides always get the loaded model (model loading is timed by neither).
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import cartridge  # noqa: I001  (first: it loads OpenBLAS before mlx; imported after, MLX keeps its reference BLAS)

import mlx.core as mx
import mlx_lm
import numpy as np
from cartridge.grow.extend import EXTEND_SEPARATOR
from cartridge.format.layout import DATA_NAME, INDEX_NAME

ROOT = Path(__file__).resolve().parent.parent


def texts(tokenizer, doc_tokens, new_tokens):
    """A document of about `doc_tokens` tokens (the sample, repeated) and a new text of about `new_tokens`."""
    sample = (ROOT / "samples" / "lgpl-3.0.txt").read_text()
    ids = []
    while len(ids) < doc_tokens + new_tokens + 64:
        ids += tokenizer.encode(sample + "\n\n", add_special_tokens=False)
    doc = tokenizer.decode(ids[:doc_tokens]).rstrip()
    start = len(ids) // 2  # a different passage than the document's end
    new = tokenizer.decode(ids[start:start + new_tokens]).strip()
    return doc, new


def answer(path, lm, question, n=30):
    cart = cartridge.load(path, model=lm)
    return [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(question),
                                                    max_tokens=n, prompt_cache=cart.prompt_cache())]


def timed(f):
    """(result, wall seconds, process CPU seconds) of f()."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = f()
    return out, time.perf_counter() - t0, time.process_time() - c0


def run(lm, doc, new, tier, tmp):
    """One extend of the base cartridge and one rebuild of the joined text: their results and a JSON row."""
    base = tmp / "base.cart"
    if not base.exists():
        cartridge.build(doc, base, model=lm, tier=tier)
    shutil.rmtree(tmp / "ext.cart", ignore_errors=True)
    load0 = os.getloadavg()[0]
    ext, ext_s, ext_cpu = timed(lambda: cartridge.extend(base, new, output=tmp / "ext.cart", model=lm))
    one, build_s, build_cpu = timed(lambda: cartridge.build(doc + EXTEND_SEPARATOR + new, tmp / "one.cart",
                                                            model=lm, tier=tier, force=True))
    row = {"extend_s": ext_s, "extend_prefill_s": ext.prefill_seconds, "extend_cpu_s": ext_cpu,
           "rebuild_s": build_s, "rebuild_prefill_s": one.prefill_seconds, "rebuild_cpu_s": build_cpu,
           "speedup": build_s / ext_s, "speedup_cpu": build_cpu / ext_cpu,
           "load_average_before": load0, "load_average_after": os.getloadavg()[0]}
    print(f"extend {ext_s:.2f} s (prefill {ext.prefill_seconds:.2f} s, {ext.new_tokens} new tokens over "
          f"{ext.reused_tokens}; {ext_cpu:.1f} CPU s), rebuild {build_s:.2f} s (prefill {one.prefill_seconds:.2f} s, "
          f"{one.tokens} tokens; {build_cpu:.1f} CPU s): {row['speedup']:.1f}x wall, {row['speedup_cpu']:.1f}x CPU; "
          f"load {load0:.1f} -> {row['load_average_after']:.1f}", flush=True)
    return ext, one, row


def measure(lm, doc_tokens, args):
    """`args.repeat` runs for a document of about `doc_tokens` tokens: one JSON entry."""
    doc, new = texts(lm.tokenizer, doc_tokens, args.new_tokens)
    print(f"building the {doc_tokens}-token base cartridge", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="extend-bench-") as tmp:
        tmp = Path(tmp)
        for _ in range(args.repeat):
            ext, one, row = run(lm, doc, new, args.tier, tmp)
            runs.append(row)
        same_ids = cartridge.open_cartridge(ext.path)[0].tokens.tolist() == \
            cartridge.open_cartridge(one.path)[0].tokens.tolist()
        q = "What does this license allow?"
        same_answer = None if args.no_answers else answer(ext.path, lm, q) == answer(one.path, lm, q)
    best_ext, best_build = min(r["extend_s"] for r in runs), min(r["rebuild_s"] for r in runs)
    print(f"{ext.reused_tokens} + {ext.new_tokens} tokens, best: extend {best_ext:.2f} s, rebuild {best_build:.2f} s, "
          f"{best_build / best_ext:.1f}x; token ids equal {same_ids}, 30-token greedy answer equal {same_answer}",
          flush=True)
    return {"document_tokens": ext.reused_tokens, "new_tokens": ext.new_tokens, "total_tokens": ext.tokens,
            "runs": runs, "best_extend_s": best_ext, "best_rebuild_s": best_build,
            "speedup_of_best": best_build / best_ext,
            "best_extend_cpu_s": min(r["extend_cpu_s"] for r in runs),
            "best_rebuild_cpu_s": min(r["rebuild_cpu_s"] for r in runs),
            "token_ids_equal": same_ids, "greedy_answer_equal_30_tokens": same_answer}


def page_difference(a, b):
    """Bytes of pages.bin that differ between two cartridges of the same layout, and the index equality
    outside the page tables and head_sums (which hold the pages' checksums; head_sums since format 1.2)."""
    x = np.fromfile(Path(a) / DATA_NAME, np.uint8)
    y = np.fromfile(Path(b) / DATA_NAME, np.uint8)
    ia, _ = cartridge.open_cartridge(a, verify="header")
    ib, _ = cartridge.open_cartridge(b, verify="header")
    checksums = (".pages", ".head_sums")
    keys = {k for k in ia.records if not k.endswith(checksums)}
    return {
        "pages_bin_bytes": int(x.size),
        "pages_bin_bytes_differing": int(np.count_nonzero(x != y)) if x.size == y.size else None,
        "index_equal_outside_page_tables": keys == {k for k in ib.records if not k.endswith(checksums)}
        and all(ia.records[k] == ib.records[k] for k in keys),
        "files_identical": (Path(a) / INDEX_NAME).read_bytes() == (Path(b) / INDEX_NAME).read_bytes()
        and bool(np.array_equal(x, y)),
    }


def convert_against_build(lm, args):
    """`args.repeat` converts fp16 -> args.tier of the sample x args.copies, against one direct build: JSON."""
    text = "\n\n".join([(ROOT / "samples" / "lgpl-3.0.txt").read_text()] * args.copies)
    out = {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, mlx {mx.default_device()}",
           "model": lm.ref, "tier": args.tier}
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 8,057 of 8,192 tokens: the reserve warning is expected here
        tmp = Path(tmp)
        src = cartridge.build(text, tmp / "fp16.cart", model=lm, tier="fp16")
        print(f"build fp16: {src.tokens} tokens, {src.seconds:.1f} s (prefill {src.prefill_seconds:.1f} s)", flush=True)
        direct = cartridge.build(text, tmp / "direct.cart", model=lm, tier=args.tier)
        print(f"build {args.tier}: {direct.seconds:.1f} s (prefill {direct.prefill_seconds:.1f} s)", flush=True)
        runs = []
        for i in range(args.repeat):
            r = cartridge.convert(src.path, tmp / "conv.cart", tier=args.tier, force=i > 0)
            runs.append(r.seconds)
            print(f"convert fp16 -> {args.tier}: {r.seconds:.2f} s", flush=True)
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
    return out


def extend_against_build(lm, args):
    """Extend against rebuild for each of args.doc_tokens: JSON."""
    sizes = [measure(lm, int(n), args) for n in args.doc_tokens.split(",")]
    return {
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}, {os.cpu_count()} cores "
                   f"(shared), load average {os.getloadavg()[0]:.1f} at the end",
        "device": str(mx.default_device()), "mlx": mx.__version__, "model": lm.ref, "tier": args.tier,
        "sizes": sizes,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--convert", action="store_true", help="Time `cartridge convert` fp16 -> --tier instead.")
    ap.add_argument("--doc-tokens", default="4096", help="Document sizes in tokens, comma-separated.")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--copies", type=int, default=5, help="--convert: copies of the sample in the document.")
    ap.add_argument("--tier", default=None, help="Default: fp16 (extend), mlx4g32 (--convert).")
    ap.add_argument("--repeat", "--repeats", type=int, default=None, help="Runs. Default: 2 (extend), 3 (--convert).")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-answers", action="store_true", help="Skip the 30-token greedy answer comparison.")
    args = ap.parse_args()
    args.tier = args.tier or ("mlx4g32" if args.convert else "fp16")
    args.repeat = args.repeat or (3 if args.convert else 2)
    lm = cartridge.load_model()
    out = (convert_against_build if args.convert else extend_against_build)(lm, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
