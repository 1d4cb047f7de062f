"""Measure every storage tier on the sample document with the default model (docs/tiers.md).

For each tier (and schema rows such as mlx4g32 with boundary_protect 2): build the sample, report
bytes/token and compression against fp16, K and V mean absolute error and relative RMSE of the
decoded pages against the model's float32 K/V, and how many of the first N greedy tokens agree with
the fp16 cartridge's for the sample questions. Also compares turbo's raw and corrected norms.

    python benchmarks/tiers.py [--questions 5] [--tokens 20] [--attention portable] [--json out/tiers.json]

`--attention` is the load policy (cartridge.attention.policy); the default, "portable", attends over the stored
pages with MLX ops, so the agreement column measures the tier and not a dequantized copy.
"""

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np

from cartridge.write.prefill import prefill
from cartridge.models.prompt import prefix_tokens, prompt_mode
from cartridge.tiers import TIERS

ROOT = Path(__file__).resolve().parent.parent
ROWS = [("fp16", {"tier": "fp16"})] + [(t, {"tier": t}) for t in TIERS if t != "fp16"] + [
    ("mlx4g32 + boundary_protect 2", {"tier": "mlx4g32", "boundary_protect": 2}),
    ("turbo3 + boundary_protect 2", {"tier": "turbo3", "boundary_protect": 2}),
    ("K fp8, V turbo3", {"k_tier": "fp8", "v_tier": "turbo3"}),
]


def reference_kv(lm, doc):
    """The model's float32 K/V of the sample prefix: [(k, v)] per layer, numpy (n_kv, T, D)."""
    tokens = prefix_tokens(lm.tokenizer, doc, prompt_mode(lm.tokenizer))
    caches = prefill(lm.model, tokens)
    return [(np.array(c.keys[0, :, :len(tokens)]), np.array(c.values[0, :, :len(tokens)])) for c in caches]


def decoded(cart, layer, side):
    """Decoded pages of one (layer, side) as numpy (n_kv, T, D) float32."""
    p = cart.prefixes[layer]
    codec, parts, params = (p.k_codec, p.k_parts, p.k_params) if side == "k" else (p.v_codec, p.v_parts, p.v_params)
    x = np.array(codec.decode(parts, params))  # (n_pages, n_kv, P, D)
    return x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[:, : p.n_tokens]  # (n_kv, T, D)


def fidelity(cart, ref):
    """K and V mean |error| and relative RMSE over every layer."""
    out = {}
    for i, side in enumerate("kv"):
        abs_sum = sq = norm = n = 0.0
        for layer, pair in enumerate(ref):
            err = decoded(cart, layer, side) - pair[i]
            abs_sum += np.abs(err).sum()
            sq += (err.astype(np.float64) ** 2).sum()
            norm += (pair[i].astype(np.float64) ** 2).sum()
            n += err.size
        out[side] = {"mae": abs_sum / n, "rel_rmse": float(np.sqrt(sq / norm))}
    return out


def greedy(cart, questions, n):
    """First n greedy tokens per question, and decode seconds per token after the first."""
    answers, per_token = [], []
    for q in questions:
        t0, first, toks = time.perf_counter(), None, []
        for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(q), max_tokens=n,
                                        prompt_cache=cart.prompt_cache()):
            first = first or time.perf_counter()
            toks.append(r.token)
        if len(toks) > 1:
            per_token.append((time.perf_counter() - first) / (len(toks) - 1))
        answers.append(toks)
    return answers, float(np.median(per_token)) if per_token else float("nan")


def agreement(answers, baseline):
    """Common-prefix length with the baseline per question, and questions identical on all tokens."""
    prefix = []
    for a, b in zip(answers, baseline):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix.append(k)
    return prefix, sum(a == b for a, b in zip(answers, baseline))


def norm_study(ref, tiers=("turbo4", "turbo3", "turbo2"), seed=0):
    """turbo raw vs corrected norm: K/V relative RMSE, softmax total variation of K scores (queries =
    64 random keys of the same layer / 8, a proxy), and relative RMSE of p.V with exact p."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in tiers:
        codec = TIERS[name]
        for kind in ("raw", "corrected"):
            m = {"k_rel_rmse": [], "v_rel_rmse": [], "k_softmax_tv": [], "v_output_rel_rmse": []}
            for layer, (k, v) in enumerate(ref):
                dec = {}
                for side, x in (("k", k), ("v", v)):
                    params = {**codec.make_params(mx.array(x), layer, side), "norm": kind}
                    dec[side] = np.array(codec.decode(codec.encode(mx.array(x), params), params))
                    m[f"{side}_rel_rmse"].append(np.sqrt(((dec[side] - x) ** 2).sum() / (x ** 2).sum()))
                q = k[:, rng.choice(k.shape[1], 64, replace=False)] / 8.0
                p, pd = softmax(q @ k.swapaxes(-1, -2)), softmax(q @ dec["k"].swapaxes(-1, -2))
                m["k_softmax_tv"].append(0.5 * np.abs(p - pd).sum(-1).mean())
                o, od = p @ v, p @ dec["v"]
                m["v_output_rel_rmse"].append(np.sqrt(((od - o) ** 2).sum() / (o ** 2).sum()))
            out[f"{name} {kind}"] = {key: float(np.mean(val)) for key, val in m.items()}
    return out


def softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def measure(lm, doc, ref, questions, n_tokens, rows, tmp, attention):
    results, baseline = [], None
    for label, kwargs in rows:
        built = cartridge.build(doc, Path(tmp) / "t.cart", model=lm, force=True, **kwargs)
        cart = cartridge.load(built.path, model=lm, attention=attention)
        answers, s_per_token = greedy(cart, questions, n_tokens)
        baseline = baseline or answers
        prefix, identical = agreement(answers, baseline)
        results.append({"row": label, "options": kwargs, "bytes_per_token": built.bytes_per_token,
                        "bytes_per_token_per_layer_side": built.bytes_per_token / (2 * len(ref)),
                        "cartridge_bytes": built.bytes, "build_seconds": built.seconds,
                        "fidelity": fidelity(cart, ref), "answers": answers, "agree_prefix": prefix,
                        "identical_answers": identical, "decode_s_per_token": s_per_token})
        print(line(results[-1], results[0], len(questions), n_tokens), flush=True)
        del cart
        mx.clear_cache()
    return results


HEADER = ("| tier | bytes/token (all layers) | per layer-side | vs fp16 | K MAE | K rel RMSE | V MAE | V rel RMSE "
          "| first-{n} agreement: common prefix (mean) | identical answers | decode ms/token |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def line(r, fp16, n_q, n_tok):
    f = r["fidelity"]
    return (f"| {r['row']} | {r['bytes_per_token']:,} | {r['bytes_per_token_per_layer_side']:g} "
            f"| {fp16['bytes_per_token'] / r['bytes_per_token']:.2f}x | {f['k']['mae']:.2e} | {f['k']['rel_rmse']:.4f} "
            f"| {f['v']['mae']:.2e} | {f['v']['rel_rmse']:.4f} | {np.mean(r['agree_prefix']):.1f} / {n_tok} "
            f"({', '.join(map(str, r['agree_prefix']))}) | {r['identical_answers']}/{n_q} "
            f"| {1000 * r['decode_s_per_token']:.0f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--attention", default="portable", help="load policy: portable, dequantize-once, fused, auto")
    ap.add_argument("--no-norm-study", action="store_true")
    args = ap.parse_args()
    doc = (ROOT / "samples" / "lgpl-3.0.txt").read_text()
    rows = [json.loads(x) for x in (ROOT / "samples" / "lgpl-3.0.questions.jsonl").read_text().splitlines() if x.strip()]
    questions = [r["question"] for r in rows[: args.questions]]
    lm = cartridge.load_model()
    ref = reference_kv(lm, doc)
    print(HEADER.format(n=args.tokens))
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(lm, doc, ref, questions, args.tokens, ROWS, tmp, args.attention)
    study = {} if args.no_norm_study else norm_study(ref)
    for key, m in study.items():
        print(f"{key:18s} " + "  ".join(f"{k} {v:.5f}" for k, v in m.items()))
    out = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
           "device": str(mx.default_device()), "mlx": mx.__version__, "model": "default (SmolLM2-135M-Instruct)",
           "document": "samples/lgpl-3.0.txt", "tokens": len(ref[0][0][0]), "questions": questions,
           "greedy_tokens": args.tokens, "attention": args.attention, "rows": results, "turbo_norm_study": study}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=float))


if __name__ == "__main__":
    main()
