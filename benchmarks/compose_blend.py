"""Teacher-forced check of composed contexts on the real model (issue 33 item 3): which tokens to recompute.

For two questions of a `cartridge eval A B --json` report (ids a1 and b1), the reference answer is fed after
the question in one forward pass, over a fresh mlx-lm prefill of the composed tokens and over each
composition; printed and written per setting: argmax agreement with the fresh prefill and the mean KL
(fresh || composed) over those positions, the tokens of B recomputed, the compose seconds, and the 10th /
50th / 90th percentile of the selected tokens' positions within B.

    PYTHONPATH=. python benchmarks/compose_blend.py benchmarks/results/eval-blend-lgpl-3.0.json OUT.json
"""

import sys
import time

import cartridge  # noqa: I001  (first: loads OpenBLAS before mlx)
import json
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from cartridge.compose import compose

SETTINGS = {  # the LGPL pair: B's boundary is the separator + 16 tokens, 20% of B's 856 composed tokens is 171
    "first 16 (ratio 0)": {"recompute": 16, "recompute_ratio": 0.0},
    "ratio 0.2, layer 1": {"recompute": 16, "recompute_ratio": 0.2},
    "ratio 0.2, layer 4": {"recompute": 16, "recompute_ratio": 0.2, "select_layer": 4},
    "ratio 0.2, layer 12": {"recompute": 16, "recompute_ratio": 0.2, "select_layer": 12},
    "first 170 (20%, ratio 0)": {"recompute": 170, "recompute_ratio": 0.0},
    "ratio 1": {"recompute": 16, "recompute_ratio": 1.0},
}


def log_probs(model, ids, cache):
    out = model(mx.array(ids)[None], cache=cache)[0].astype(mx.float32)
    return np.array(out - mx.logsumexp(out, axis=-1, keepdims=True))


def main(report_path, out_path):
    report = json.load(open(report_path))
    lm = cartridge.load_model("default")
    carts = [cartridge.load(d["cartridge"]["path"], model=lm) for d in report["documents"]]
    rows = [(q, a) for q, a in zip(report["questions"], report["reference"]["answers"]) if q["id"] in ("a1", "b1")]
    base = compose(carts, recompute=16, recompute_ratio=0.0)
    fresh = []
    for q, a in rows:
        prompt = base.question_prompt(q["question"]) + a["tokens"]
        fresh.append((prompt, log_probs(lm.model, base.tokens + prompt, make_prompt_cache(lm.model))[len(base.tokens):]))
    out = {}
    for name, kw in SETTINGS.items():
        t0 = time.perf_counter()
        comp = compose(carts, **kw)
        seconds = time.perf_counter() - t0
        agree = n = 0
        kl = 0.0
        for prompt, ref in fresh:
            got = log_probs(lm.model, prompt, comp.prompt_cache())
            agree, n = agree + int((got.argmax(-1) == ref.argmax(-1)).sum()), n + len(ref)
            kl += float((np.exp(ref) * (ref - got)).sum())
        b = comp.blended[0]
        at = np.array(b["positions"]) - len(carts[0].tokens)
        out[name] = {"recomputed": b["fresh"] + b["selected"], "of": b["fresh"] + b["read"], "agree": agree, "n": n,
                     "mean_kl": kl / n, "compose_s": seconds,
                     "selected_at_p10_p50_p90": [int(np.percentile(at, p)) for p in (10, 50, 90)] if len(at) else []}
        print(name, out[name], flush=True)
    json.dump({"report": report_path, "questions": [q["id"] for q, _ in rows], "settings": out},
              open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
