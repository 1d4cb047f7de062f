"""Calibrated presets against fp16 on real questions, without building cartridges (issue 33).

usage: PYTHONPATH=. python benchmarks/preset_agreement.py DOC QUESTIONS OUT.json [VARIANT ...]
       (env FIXED="k_tier/v_tier,..." scores those uniform schemas too; BLEU=1 adds sentence BLEU)

Prefills DOC with the default model, answers each question greedily (50 tokens) over the fp16-rounded K/V
(cached beside OUT as OUT.answers.json), then for each calibration VARIANT (measurement constants of
cartridge.calibrate.measure, below) chooses the safe / balanced / compact schemas and teacher-forces
question + fp16 answer over the K/V round-tripped through each schema's tiers (encode, reference decode).
Teacher forcing on the fp16 answer gives the greedy answer's first token, whether it is identical and the
tokens to its first divergence exactly (before the first disagreement the contexts are the same); BLEU
needs the schema's own continuation after that point, generated greedily to 50 tokens.
"""
import json
import os
import sys
import time

import cartridge  # noqa: F401  (OpenBLAS first)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from cartridge.build import prefill
from cartridge.calibrate import fitting, measure, search, sequence
from cartridge.models.loader import load_model
from cartridge.models.prompt import prefix_tokens, prompt_mode, question_tokens
from cartridge.tiers import TIERS
from cartridge.eval.metrics import sentence_bleu

doc, qfile, out = sys.argv[1:4]
variants = sys.argv[4:] or ["base"]
lm = load_model("default")
model, tok = lm.model, lm.tokenizer
mode = prompt_mode(tok)
tokens = prefix_tokens(tok, open(doc).read(), mode)
caches = prefill(model, tokens)
kv = [tuple(measure.fp16_rounded(a) for a in (c.keys[..., :c.offset, :], c.values[..., :c.offset, :])) for c in caches]
qs = [json.loads(l)["question"] for l in open(qfile) if l.strip()]
eos = set(tok.eos_token_ids) if hasattr(tok, "eos_token_ids") else {tok.eos_token_id}


def mkcache(pairs):
    out = []
    for k, v in pairs:
        c = KVCache()
        c.keys, c.values, c.offset = k, v, k.shape[2]
        out.append(c)
    return out


ans_file = out + ".answers.json"
if os.path.exists(ans_file):
    answers = json.load(open(ans_file))
else:
    answers = []
    for q in qs:
        cache, step, a = mkcache(kv), question_tokens(tok, q, mode), []
        for _ in range(50):
            logits = model(mx.array(step, dtype=mx.uint32)[None], cache=cache)[0, -1]
            t = int(mx.argmax(logits).item())
            a.append(t)
            if t in eos:
                break
            step = [t]
        answers.append(a)
    json.dump(answers, open(ans_file, "w"))

seqs = [question_tokens(tok, q, mode) for q in qs]


def logits_for(pairs):
    res = []
    for s, a in zip(seqs, answers):
        ids = s + a[:-1]
        lg = model(mx.array(ids, dtype=mx.uint32)[None], cache=mkcache(pairs))[0, len(s) - 1:].astype(mx.float32)
        mx.eval(lg)
        res.append(lg)
    return res


ref = logits_for(kv)


def score(schema):
    pairs = [tuple(measure.round_trip(row[s], x, row["layer"], s) if row[s] != "fp16" else x
                   for s, x in zip("kv", p)) for row, p in zip(schema, kv)]
    got = logits_for(pairs)
    first = agree = n = 0
    kls, div = [], []
    for r, g in zip(ref, got):
        lr = measure.log_softmax(r)
        kls.append(measure.kl_rows(lr, g[None]).item())
        same = (mx.argmax(r, -1) == mx.argmax(g, -1)).tolist()
        first += same[0]
        agree += sum(same)
        n += len(same)
        div.append(same.index(False) if False in same else len(same))
    res = {"first": first, "top1": agree / n, "kl": sum(kls) / len(kls), "div": sum(div) / len(div),
           "identical": sum(d == len(a) for d, a in zip(div, answers))}
    if os.environ.get("BLEU"):
        bleus = []
        for s, a, d in zip(seqs, answers, div):
            bleus.append(1.0 if d == len(a) else sentence_bleu(text(continued(pairs, s, a[:d])), text(a)))
        res["bleu"] = sum(bleus) / len(bleus)
    return res


def text(ids):
    return tok.decode([t for t in ids if t not in eos])


def continued(pairs, s, head):
    """head + the schema's greedy continuation to 50 tokens (or EOS)."""
    cache, step, outp = mkcache(pairs), s + head, list(head)
    while len(outp) < 50:
        t = int(mx.argmax(model(mx.array(step, dtype=mx.uint32)[None], cache=cache)[0, -1]).item())
        outp.append(t)
        if t in eos:
            break
        step = [t]
    return outp


shapes = {"k": (kv[0][0].shape[1], kv[0][0].shape[3]), "v": (kv[0][1].shape[1], kv[0][1].shape[3])}
fp16_bpt = len(kv) * 2 * TIERS["fp16"].bytes_per_token(*shapes["k"])
P3 = ("What is this document about? Answer in one sentence.", "Quote the first sentence of the document.",
      "Which names, numbers or dates does the document mention?")
BASE = dict(PROBES=P3[:1], ANSWER_TOKENS=8, SCORE_DOCUMENT=True, SLICE_TOKENS=32)
VARIANTS = {"base": BASE, "p3": {**BASE, "PROBES": P3}, "p3qa": {**BASE, "PROBES": P3, "SCORE_DOCUMENT": False},
            "p3a16": {**BASE, "PROBES": P3, "ANSWER_TOKENS": 16}, "qa": {**BASE, "SCORE_DOCUMENT": False}}
results = {}
for variant in variants:
    t0 = time.time()
    for name, val in VARIANTS[variant].items():
        setattr(sequence, name, val)
    sens = measure.measure(model, tok, mode, caches, tokens, fitting(shapes))
    secs = time.time() - t0
    for preset, ratio in (("safe", 2.0), ("balanced", 3.0), ("compact", 4.5)):
        ch = search.choose(sens.kl, len(kv), shapes, int(fp16_bpt // ratio))
        r = score(ch.schema)
        r.update(bytes=ch.bytes_per_token, pred=ch.predicted_kl, calib_s=secs,
                 schema=[(row["k"], row["v"]) for row in ch.schema])
        results[f"{variant}/{preset}"] = r
        print(variant, preset, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "schema"},
              flush=True)
for name in os.environ.get("FIXED", "").split(","):
    if not name:
        continue
    kt, vt = name.split("/")
    schema = [{"layer": i, "k": kt, "v": vt} for i in range(len(kv))]
    r = score(schema)
    r.update(bytes=search.schema_bytes(schema, shapes))
    results[f"fixed/{name}"] = r
    print("fixed", name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
json.dump(results, open(out, "w"), indent=1)
