"""Quick fidelity of tiers against the fp16 cartridge, teacher-forced (issue 19; docs/evaluation.md).

A cheaper stand-in for `cartridge eval` on a loaded machine: the fp16 cartridge's greedy answers (the
reference, as `cartridge eval` makes them) are fed to every other cartridge in one forward pass per
question; at each answer position the argmax is compared with the reference token. Because greedy
decoding follows the argmax, "all positions agree" is exactly "the greedy answer is identical", the first
disagreeing position is exactly the tokens before divergence, and position 0 is first-token agreement.
BLEU (which needs each tier's own continuation after divergence) is not measured. Held-out perplexity is
`cartridge eval`'s (corpus tail, 0.15 of the characters). Needle recall: greedy answers (up to
--needle-tokens tokens) on the document with the 10 needles planted, as `cartridge eval` scores them.

    python benchmarks/quick_fidelity.py --json out.json [--max-tokens 50] [--only LABEL,...]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

import cartridge
from cartridge.eval.dataset import load_needles, load_questions, plant_needles, split_heldout
from cartridge.eval.evaluate import greedy, teacher_forced_logprobs
from cartridge.eval.metrics import needle_found, perplexity
from cartridge.models.loader import load_model
from cartridge.models.prompt import SEPARATOR

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "fp16": {"tier": "fp16"},
    "mlx4g32": {"tier": "mlx4g32"},
    "mlx4g32+rot": {"tier": "mlx4g32+rot"},
    "mlx4g32+rot pf16 pl64": {"tier": "mlx4g32+rot", "protect_first": 16, "protect_last": 64},
    "preset balanced": {"preset": "balanced"},
    "preset compact": {"preset": "compact"},
    "preset safe": {"preset": "safe"},
    "mlx4g32 pf4 pl28": {"tier": "mlx4g32", "protect_first": 4, "protect_last": 28},
    "k=kivi4 v=mlx4g32+rot": {"k_tier": "kivi4", "v_tier": "mlx4g32+rot"},
    "mlx4g32 pf16 pl64": {"tier": "mlx4g32", "protect_first": 16, "protect_last": 64},
    "mxfp4+rot": {"tier": "mxfp4+rot"},
    "nvfp4+rot": {"tier": "nvfp4+rot"},
    "k=mlx4g32+rot v=mlx4g32": {"k_tier": "mlx4g32+rot", "v_tier": "mlx4g32"},
    "int8+rot": {"tier": "int8+rot"},
    "fp8": {"tier": "fp8"},
}
N_LAYERS = 30  # the default model's


def v4_on(layers, k="int8+rot", v="int8+rot", v4="mlx4g32+rot"):
    """A per-layer schema: K `k` everywhere, V `v4` on `layers`, `v` elsewhere."""
    return {"schema": [{"layer": i, "k": k, "v": v4 if i in layers else v} for i in range(N_LAYERS)]}


CONFIGS.update({
    "k=int8+rot v=int6+rot": {"k_tier": "int8+rot", "v_tier": "int6+rot"},
    "int6+rot": {"tier": "int6+rot"},
    "k=int6+rot v=mlx4g32+rot": {"k_tier": "int6+rot", "v_tier": "mlx4g32+rot"},
    "safe? V4 middle third": v4_on(range(10, 20)),
    "safe? V4 last third": v4_on(range(20, 30)),
    "safe? V4 every third": v4_on(range(1, 30, 3)),
    "safe? V4 first third": v4_on(range(0, 10)),
    "safe? V4 middle 12": v4_on(range(9, 21)),
})


def fp16_caches(path):
    """mlx-lm KVCaches holding an fp16 cartridge's K/V (as float32): the prefill it was built from."""
    info, data = cartridge.open_cartridge(path)
    caches = []
    for layer in range(info.n_layers):
        c = KVCache()
        for side in ("k", "v"):
            (extent,) = info.extents[(layer, side)]
            x = mx.array(data.view(extent, "float16")).astype(mx.float32)  # (n_pages, n_kv, P, D)
            # (n_pages, n_kv, P, D) -> (1, n_kv, T, D)
            x = x.transpose(1, 0, 2, 3).reshape(1, x.shape[1], -1, x.shape[-1])[:, :, : len(info.tokens)]
            setattr(c, "keys" if side == "k" else "values", x)
        c.offset = len(info.tokens)
        caches.append(c)
    return tuple(info.tokens.tolist()), caches


def memo_prefill(kv_from):
    """Prefill each document once for all configs (the K/V do not depend on the tier); with `kv_from`,
    take them from the fp16 cartridges there (e.g. a `cartridge eval` work folder) instead."""
    build_module = sys.modules["cartridge.build"]  # the package's `build` name is the function
    original, memo = build_module.prefill, {}
    for path in sorted(Path(kv_from).glob("fp16-*.cart")) if kv_from else ():
        key, caches = fp16_caches(path)
        memo[key] = caches

    def prefill(model, tokens, step=512, progress=None):
        key = tuple(tokens)
        if key not in memo:
            memo[key] = original(model, tokens, step)
        return list(memo[key])

    build_module.prefill = prefill


def forced_agreement(cart, prompt, answer):
    """Per answer position: does the cartridge's argmax equal the reference token? list[bool]."""
    cache = cart.prompt_cache()
    feed = prompt + answer[:-1]
    logits = cart.model(mx.array(feed, dtype=mx.uint32)[None], cache=cache)[0]  # (L, vocab)
    pred = mx.argmax(logits[len(prompt) - 1:], axis=-1).tolist()
    return [p == a for p, a in zip(pred, answer)]


def row_for(label, cart, probe, ref, questions, needles, heldout, args):
    lm = cart.model
    row = {"label": label, "bytes_per_token": cart.info.bytes_per_token(),
           "compression": cart.info.fp16_bytes_per_token() / cart.info.bytes_per_token()}
    if ref:  # None for the reference row; empty with --questions 0 (perplexity only)
        agree = [forced_agreement(cart, cart.question_prompt(q["question"]), a) for q, a in zip(questions, ref)]
        row["first_token"] = sum(a[0] for a in agree)
        row["exact"] = sum(all(a) for a in agree)
        row["tokens_to_divergence"] = sum(a.index(False) if False in a else len(a) for a in agree) / len(agree)
        row["token_agreement"] = sum(sum(a) for a in agree) / sum(len(a) for a in agree)
    row["perplexity"] = perplexity(teacher_forced_logprobs(lm, probe.prompt_cache(), heldout))
    if args.needle_tokens:
        found = [needle_found(greedy(lm, cart.tokenizer, probe.question_prompt(n["question"]), args.needle_tokens,
                                     probe.prompt_cache())["text"], n["answer"]) for n in needles]
        row["needles"] = sum(found)
        row["needles_found"] = found
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--max-tokens", type=int, default=50)
    ap.add_argument("--needle-tokens", type=int, default=0, help="0: no needle recall (the slowest part)")
    ap.add_argument("--only", default=None)
    ap.add_argument("--questions", type=int, default=20, help="the first N questions")
    ap.add_argument("--kv-from", default=None, help="folder of fp16 cartridges of the same documents")
    ap.add_argument("--work", default="/tmp/quick_fidelity")
    ap.add_argument("--doc", default="lgpl-3.0", help="a document of samples/ with its NAME.questions.jsonl")
    args = ap.parse_args()
    corpus = (ROOT / f"samples/{args.doc}.txt").read_text()
    questions = load_questions(ROOT / f"samples/{args.doc}.questions.jsonl")[: args.questions]
    needles = load_needles(ROOT / "samples/needles.jsonl")
    lm = load_model(None)
    head, tail = split_heldout(corpus, 0.15)
    probe_doc = plant_needles(head, needles)
    heldout = list(lm.tokenizer.encode(SEPARATOR + tail.strip(), add_special_tokens=False))
    memo_prefill(args.kv_from)
    labels = ["fp16"] + [x for x in (args.only.split(",") if args.only else CONFIGS) if x != "fp16"]
    out, ref = {"max_tokens": args.max_tokens, "rows": []}, None
    for label in labels:
        t0 = time.perf_counter()
        carts = []
        for role, doc in (("qa", corpus), ("probe", probe_doc)):
            print(f"{time.strftime('%H:%M:%S')} {label}: building {role}", flush=True)
            r = cartridge.build(doc, f"{args.work}/{role}-{len(out['rows'])}.cart", model=lm, force=True,
                                **CONFIGS[label])
            carts.append(cartridge.load(r.path, model=lm))
        print(f"{time.strftime('%H:%M:%S')} {label}: measuring", flush=True)
        if ref is None:
            ref = [greedy(lm.model, lm.tokenizer, carts[0].question_prompt(q["question"]), args.max_tokens,
                          carts[0].prompt_cache())["tokens"] for q in questions]
            out["reference_answers"] = ref
            row = row_for(label, *carts, None, questions, needles, heldout, args)
        else:
            row = row_for(label, *carts, ref, questions, needles, heldout, args)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        out["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "needles_found"}), flush=True)
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
