"""Extend a ~4K-token document by ~256 tokens, against rebuilding the joined text from scratch
(default model, this machine). Prints one line per run and writes JSON.

    python benchmarks/extend.py [--doc-tokens 2048,4096] [--new-tokens 256] [--tier fp16] [--repeat 2]
                                [--json benchmarks/results/cpu-extend.json]

Each document size (comma-separated) is built once, then extended and rebuilt `--repeat` times, in
turn. Both sides get the loaded model (model loading is not timed). Extend's time covers everything it
does: load and verify the stored cartridge, prefill the new tokens over it, encode, write old + new
pages, verify the result, publish. Rebuild's covers prefill of the joined text, encode and write.
Wall and process CPU seconds are both recorded, with the load average before and after each run:
the CPU may be shared.
"""

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import cartridge  # noqa: I001  (first: it loads OpenBLAS before mlx; imported after, MLX keeps its reference BLAS)

import mlx.core as mx
import mlx_lm
from cartridge.extend import EXTEND_SEPARATOR

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-tokens", default="4096", help="Document sizes in tokens, comma-separated.")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--tier", default="fp16")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-answers", action="store_true", help="Skip the 30-token greedy answer comparison.")
    args = ap.parse_args()
    lm = cartridge.load_model()
    sizes = [measure(lm, int(n), args) for n in args.doc_tokens.split(",")]
    out = {
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}, {os.cpu_count()} cores "
                   f"(shared), load average {os.getloadavg()[0]:.1f} at the end",
        "device": str(mx.default_device()), "mlx": mx.__version__, "model": lm.ref, "tier": args.tier,
        "sizes": sizes,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
