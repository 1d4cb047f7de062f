"""Fidelity and TTFT of two cartridges composed in one context (default model, this machine): the
sample split in two at a paragraph break, built separately, composed with N recomputed tokens, against
a fresh prefill of the same composed token ids (mlx-lm, no cartridge). Prints a table, writes JSON.

    python benchmarks/compose.py [--questions 5] [--recompute 0,16,64] [--max-tokens 30] [--json OUT]

Per question: first-token agreement and 30-token greedy BLEU against the fresh prefill, the token
index of the first divergence, TTFT composed vs fresh vs asking the second cartridge alone.
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import cartridge  # noqa: I001  (first: it loads OpenBLAS before mlx; imported after, MLX keeps its reference BLAS)

import mlx.core as mx
import mlx_lm
from cartridge.eval.metrics import first_divergence, first_token_agrees, sentence_bleu

ROOT = Path(__file__).resolve().parent.parent


def greedy(model, tokenizer, prompt, n, **kw):
    t0, ttft, out = time.perf_counter(), None, []
    for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n, **kw):
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        out.append(r.token)
    return out, ttft


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--recompute", default="0,16,64")
    ap.add_argument("--max-tokens", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    text = (ROOT / "samples" / "lgpl-3.0.txt").read_text().rstrip()
    paragraphs = text.split("\n\n")
    half = len(paragraphs) // 2
    docs = ["\n\n".join(paragraphs[:half]), "\n\n".join(paragraphs[half:])]
    rows = [json.loads(x) for x in (ROOT / "samples" / "lgpl-3.0.questions.jsonl").read_text().splitlines()]
    rows = rows[: args.questions]
    lm = cartridge.load_model()
    tok = lm.tokenizer
    results = {}
    with tempfile.TemporaryDirectory(prefix="compose-bench-") as tmp:
        paths = [Path(tmp) / f"{i}.cart" for i in range(2)]
        for doc, path in zip(docs, paths):
            cartridge.build(doc, path, model=lm)
        single = cartridge.load(paths[1], model=lm)
        fresh = {}
        c0 = cartridge.load(paths, model=lm, recompute=0)
        for row in rows:
            q = c0.question_prompt(row["question"])
            fresh[row["id"]] = greedy(lm.model, tok, c0.tokens + q, args.max_tokens)
            one = greedy(lm.model, tok, single.question_prompt(row["question"]), args.max_tokens,
                         prompt_cache=single.prompt_cache())
            fresh[row["id"]] += (one[1],)
        for n in map(int, args.recompute.split(",")):
            t0 = time.perf_counter()
            comp = cartridge.load(paths, model=lm, recompute=n)
            load_s = time.perf_counter() - t0
            per = []
            for row in rows:
                ref, ref_ttft, one_ttft = fresh[row["id"]]
                got, ttft = greedy(lm.model, tok, comp.question_prompt(row["question"]), args.max_tokens,
                                   prompt_cache=comp.prompt_cache())
                per.append({"id": row["id"], "first_token": first_token_agrees(got, ref),
                            "bleu": sentence_bleu(tok.decode(got), tok.decode(ref)),
                            "first_divergence": first_divergence(got, ref), "ttft_s": ttft,
                            "fresh_ttft_s": ref_ttft, "single_cartridge_ttft_s": one_ttft})
            results[n] = {"compose_load_s": load_s, "questions": per,
                          "first_token_agreement": sum(p["first_token"] for p in per) / len(per),
                          "mean_bleu": statistics.mean(p["bleu"] for p in per),
                          "median_ttft_s": statistics.median(p["ttft_s"] for p in per),
                          "median_fresh_ttft_s": statistics.median(p["fresh_ttft_s"] for p in per),
                          "median_single_ttft_s": statistics.median(p["single_cartridge_ttft_s"] for p in per)}
            r = results[n]
            print(f"recompute {n:3d}: first token {r['first_token_agreement']:.0%}, BLEU {r['mean_bleu']:.3f}, "
                  f"TTFT {r['median_ttft_s']:.3f} s (one cartridge {r['median_single_ttft_s']:.3f} s, fresh prefill "
                  f"{r['median_fresh_ttft_s']:.2f} s), compose {load_s:.2f} s", flush=True)
        tokens = len(c0.tokens)
    out = {"machine": f"{platform.machine()} {platform.platform()}, {os.cpu_count()} cores (shared), load average "
                      f"{os.getloadavg()[0]:.1f} at the end",
           "device": str(mx.default_device()), "mlx": mx.__version__, "model": lm.ref, "tier": "fp16",
           "composed_tokens": tokens, "max_tokens": args.max_tokens, "by_recompute": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
