"""Why composed answers diverge from a fresh prefill, and whether more recompute helps (issue 20).

Takes a `cartridge eval A B --json` report (its fresh-prefill answers are the reference, its fp16
cartridges are reused) and, for each recompute setting ("all" = every token of the later document):

- teacher-forced agreement: the reference answer fed after the question in one forward pass over the
  composed cache; at each answer position the argmax is compared with the reference token. Greedy
  decoding follows the argmax, so the first disagreeing position is the greedy answer's tokens before
  divergence and position 0 its first token (as benchmarks/quick_fidelity.py);
- the later document's stored K/V against a fresh prefill of the composed token ids (mlx-lm KVCache,
  float32): relative error ||x' - x|| / ||x|| per layer, for the document's tokens by position
  (stored keys rotated to their true positions; recomputed tokens read from the composed patch).

    python benchmarks/compose_recompute.py out/composed/lgpl-3.0.json --recompute 0,16,64,256,all --json OUT
"""

import argparse
import json
import os
import time

import cartridge  # noqa: I001  (first: it loads OpenBLAS before mlx)

import mlx.core as mx
from cartridge.build import prefill
from cartridge.compose import compose
from cartridge.models.loader import load_model
from cartridge.models.prompt import _encode, _pieces

BUCKETS = ((0, 16), (16, 64), (64, 256), (256, 512), (512, 1 << 30))  # document-token positions


def teacher_forced(comp, model, question, ref_tokens):
    """(first disagreeing answer position, agreeing positions) of `ref_tokens` after `question`."""
    prompt = comp.question_prompt(question)
    ids = mx.array(prompt + ref_tokens[:-1])[None]
    logits = model(ids, cache=comp.prompt_cache())[0, len(prompt) - 1:]  # (len(ref), vocab)
    pred = mx.argmax(logits, axis=-1).tolist()
    agree = [p == t for p, t in zip(pred, ref_tokens)]
    first = next((i for i, ok in enumerate(agree) if not ok), len(agree))
    return first, sum(agree)


def _decoded(codec, parts, params):
    x = codec.decode(parts, params).astype(mx.float32)  # (n_pages, n_kv, P, D)
    return x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])  # (n_kv, n_pages * P, D)


def _rel(a, b):
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()


def kv_error(comp, fresh, doc_start):
    """Per bucket of the later document's positions (from its first token, at true position
    `doc_start`): mean over layers of the K and V relative error of what the composed context holds
    (patch or stored part) against the fresh prefill; and the per-layer values."""
    part = len(comp._layers[0]) > 1
    total = fresh[0].offset
    ranges = {f"{lo}-{hi if hi < 1 << 30 else 'end'}": (doc_start + lo, min(doc_start + hi, total))
              for lo, hi in BUCKETS if doc_start + lo < total}
    ranges["first document (fp16 rounding)"] = (0, len(comp.carts[0].tokens))
    errs = {name: {"per_layer_k": [], "per_layer_v": []} for name in ranges}
    for layer in range(len(comp._layers)):
        c = fresh[layer]  # its buffers run past `offset`
        fk, fv = (x[0, :, :total].astype(mx.float32) for x in (c.keys, c.values))  # (n_kv, total, D)
        hk, hv = _held(comp, layer, part, total)  # (n_kv, total, D) each
        for name, (a, b) in ranges.items():
            errs[name]["per_layer_k"].append(_rel(hk[:, a:b], fk[:, a:b]))
            errs[name]["per_layer_v"].append(_rel(hv[:, a:b], fv[:, a:b]))
    return {name: {"k": sum(e["per_layer_k"]) / len(e["per_layer_k"]),
                   "v": sum(e["per_layer_v"]) / len(e["per_layer_v"]), **e} for name, e in errs.items()}


def _held(comp, layer, part, total):
    """(n_kv, total, D) K and V the composed context holds, at true positions (float32)."""
    a = comp.carts[0]._prefixes[layer]
    ks, vs = [_decoded(a.k_codec, a.k_parts, a.k_params)[:, : a.n_tokens]], [
        _decoded(a.v_codec, a.v_parts, a.v_params)[:, : a.n_tokens]]
    if comp._patches[layer]:
        pk, pv = comp._patches[layer][0]
        ks.append(pk.astype(mx.float32))
        vs.append(pv.astype(mx.float32))
    if part:
        p = comp._layers[layer][1]
        k = _decoded(p.prefix.k_codec, p.prefix.k_parts, p.prefix.k_params)[:, p.start: p.prefix.n_tokens]
        n_kv, T, D = k.shape
        k = comp._ropes[layer](k.reshape(n_kv * T, 1, D), offset=p.shift).reshape(n_kv, T, D)  # moved by Δ
        ks.append(k)
        vs.append(_decoded(p.prefix.v_codec, p.prefix.v_parts, p.prefix.v_params)[:, p.start: p.prefix.n_tokens])
    return mx.concatenate(ks, axis=1)[:, :total], mx.concatenate(vs, axis=1)[:, :total]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("--recompute", default="0,16,64,256,all")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = json.load(open(args.report))
    lm = load_model()
    carts = [cartridge.load(d["cartridge"]["path"], model=lm) for d in report["documents"]]
    tok = lm.tokenizer
    head = len(_encode(tok, _pieces(tok, carts[1].info.prompt_mode, carts[1].info.separator)[0], True))
    later = len(carts[1].tokens) - head  # the later document's tokens, without its header
    composed = compose(carts, recompute=0).tokens
    doc_start = len(composed) - later  # true position of its first token
    settings = [later if s == "all" else int(s) for s in args.recompute.split(",")]
    refs = [a["tokens"] for a in report["reference"]["answers"]]
    t0 = time.perf_counter()
    fresh = prefill(lm.model, composed)
    fresh_s = time.perf_counter() - t0
    rows = []
    for n in settings:
        t0 = time.perf_counter()
        comp = compose(carts, recompute=n)
        row = {"recompute": n, "compose_seconds": time.perf_counter() - t0, "questions": []}
        for q, ref in zip(report["questions"], refs):
            first, agree = teacher_forced(comp, lm.model, q["question"], ref)
            row["questions"].append({"id": q["id"], "source": q["source"], "first_divergence": first,
                                     "agree": agree, "n": len(ref)})
        row["kv_error"] = kv_error(comp, fresh, doc_start)
        rows.append(row)
        qs = row["questions"]
        print(f"recompute {n:4d}: identical {sum(x['first_divergence'] == x['n'] for x in qs)}/{len(qs)}, "
              f"first token {sum(x['first_divergence'] > 0 for x in qs)}/{len(qs)}, positions agreeing "
              f"{sum(x['agree'] for x in qs)}/{sum(x['n'] for x in qs)}, K/V error by position "
              + " ".join(f"{b}: {e['k']:.3f}/{e['v']:.3f}" for b, e in row["kv_error"].items()), flush=True)
    out = {"report": args.report, "machine": report["machine"], "load_average": os.getloadavg(),
           "later_document_tokens": later, "fresh_prefill_seconds": fresh_s, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
