"""Measure the sample end to end: build tokens/s, cartridge bytes, load time, and TTFT with the
cartridge against a full prefill of document + question (mlx-lm, no cartridge).

    python benchmarks/ttft.py [--questions 5] [--tier fp16] [--json out/ttft.json]
"""

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm

from cartridge.models.prompt import full_prompt_tokens

ROOT = Path(__file__).resolve().parent.parent


def ttft(model, tokenizer, prompt, **kw):
    """Seconds from the call to the first generated token, and decode tokens/s over the next 31."""
    t0 = time.perf_counter()
    first, n = None, 0
    for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=32, **kw):
        if first is None:
            first = time.perf_counter()
        n = r.generation_tokens
    end = time.perf_counter()
    return first - t0, (n - 1) / (end - first) if n > 1 else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--tier", default="fp16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    doc = (ROOT / "samples" / "lgpl-3.0.txt").read_text()
    rows = [json.loads(x) for x in (ROOT / "samples" / "lgpl-3.0.questions.jsonl").read_text().splitlines()]
    lm = cartridge.load_model()
    with tempfile.TemporaryDirectory() as tmp:
        built = cartridge.build(doc, Path(tmp) / "s.cart", model=lm, tier=args.tier)
        t0 = time.perf_counter()
        cart = cartridge.load(built.path, model=lm)
        load_s = time.perf_counter() - t0
        res = []
        for row in rows[: args.questions]:
            q = row["question"]
            c_ttft, c_rate = ttft(cart.model, cart.tokenizer, cart.question_prompt(q), prompt_cache=cart.prompt_cache())
            f_ttft, f_rate = ttft(lm.model, lm.tokenizer, full_prompt_tokens(lm.tokenizer, doc, q))
            res.append({"id": row["id"], "cartridge_ttft_s": c_ttft, "full_prefill_ttft_s": f_ttft,
                        "cartridge_decode_tps": c_rate, "full_decode_tps": f_rate})
    out = {
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
        "device": str(mx.default_device()), "mlx": mx.__version__, "tier": args.tier,
        "tokens": built.tokens, "build_seconds": built.seconds, "prefill_tokens_per_s": built.tokens_per_second,
        "cartridge_bytes": built.bytes, "bytes_per_token": built.bytes_per_token, "load_seconds": load_s,
        "median_ttft_cartridge_s": statistics.median(r["cartridge_ttft_s"] for r in res),
        "median_ttft_full_prefill_s": statistics.median(r["full_prefill_ttft_s"] for r in res),
        "median_decode_tps_cartridge": statistics.median(r["cartridge_decode_tps"] for r in res),
        "median_decode_tps_full": statistics.median(r["full_decode_tps"] for r in res),
        "questions": res,
    }
    print(f"{out['tokens']} tokens, build {out['build_seconds']:.1f} s ({out['prefill_tokens_per_s']:.0f} tokens/s), "
          f"{out['cartridge_bytes']:,} bytes ({out['bytes_per_token']:,} B/token), load {load_s:.2f} s")
    print(f"TTFT median: cartridge {out['median_ttft_cartridge_s']:.3f} s, full prefill "
          f"{out['median_ttft_full_prefill_s']:.3f} s ({out['median_ttft_full_prefill_s'] / out['median_ttft_cartridge_s']:.1f}x)")
    print(f"decode median: cartridge {out['median_decode_tps_cartridge']:.1f} tokens/s, dense cache "
          f"{out['median_decode_tps_full']:.1f} tokens/s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
