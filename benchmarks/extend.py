"""Extend a ~4K-token document by ~256 tokens, against rebuilding the joined text from scratch
(default model, this machine). Prints one line per run and writes JSON.

    python benchmarks/extend.py [--doc-tokens 4096] [--new-tokens 256] [--tier fp16] [--repeat 2]
                                [--json benchmarks/results/cpu-extend.json]

Both sides get the loaded model (model loading is not timed). Extend's time covers everything it does:
load and verify the stored cartridge, prefill the new tokens over it, encode, write old + new pages,
verify the result, publish. Rebuild's covers prefill of the joined text, encode and write.
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


def run(lm, doc, new, tier, tmp):
    base = tmp / "base.cart"
    if not base.exists():
        cartridge.build(doc, base, model=lm, tier=tier)
    shutil.rmtree(tmp / "ext.cart", ignore_errors=True)
    t0, c0 = time.perf_counter(), time.process_time()
    ext = cartridge.extend(base, new, output=tmp / "ext.cart", model=lm)
    ext_s, ext_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    one = cartridge.build(doc + EXTEND_SEPARATOR + new, tmp / "one.cart", model=lm, tier=tier, force=True)
    build_s, build_cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"cpu seconds (this process, all threads): extend {ext_cpu:.1f}, rebuild {build_cpu:.1f}", flush=True)
    return ext, ext_s, one, build_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--tier", default="fp16")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-answers", action="store_true", help="Skip the 30-token greedy answer comparison.")
    args = ap.parse_args()
    lm = cartridge.load_model()
    doc, new = texts(lm.tokenizer, args.doc_tokens, args.new_tokens)
    print(f"model loaded; building the {args.doc_tokens}-token base cartridge", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="extend-bench-") as tmp:
        tmp = Path(tmp)
        for i in range(args.repeat):
            ext, ext_s, one, build_s = run(lm, doc, new, args.tier, tmp)
            runs.append({"extend_s": ext_s, "extend_prefill_s": ext.prefill_seconds, "rebuild_s": build_s,
                         "rebuild_prefill_s": one.prefill_seconds, "speedup": build_s / ext_s})
            print(f"run {i}: extend {ext_s:.2f} s (prefill {ext.prefill_seconds:.2f} s, {ext.new_tokens} new tokens "
                  f"over {ext.reused_tokens}), rebuild {build_s:.2f} s (prefill {one.prefill_seconds:.2f} s, "
                  f"{one.tokens} tokens): {build_s / ext_s:.1f}x", flush=True)
        same_ids = cartridge.open_cartridge(ext.path)[0].tokens.tolist() == \
            cartridge.open_cartridge(one.path)[0].tokens.tolist()
        q = "What does this license allow?"
        same_answer = None if args.no_answers else answer(ext.path, lm, q) == answer(one.path, lm, q)
    best_ext, best_build = min(r["extend_s"] for r in runs), min(r["rebuild_s"] for r in runs)
    out = {
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}, {os.cpu_count()} cores "
                   f"(shared), load average {os.getloadavg()[0]:.1f} at the end",
        "device": str(mx.default_device()), "mlx": mx.__version__, "model": lm.ref, "tier": args.tier,
        "document_tokens": ext.reused_tokens, "new_tokens": ext.new_tokens, "total_tokens": ext.tokens,
        "runs": runs, "best_extend_s": best_ext, "best_rebuild_s": best_build,
        "speedup_of_best": best_build / best_ext, "token_ids_equal": same_ids,
        "greedy_answer_equal_30_tokens": same_answer,
    }
    print(f"best: extend {best_ext:.2f} s, rebuild {best_build:.2f} s, {best_build / best_ext:.1f}x; "
          f"token ids equal {same_ids}, 30-token greedy answer equal {same_answer}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
