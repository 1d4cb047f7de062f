"""Which tokens of a later document to recompute (issue 33 item 3): teacher-forced KL against recompute-all.

For the pair of a `cartridge eval A B --json` report, every question's reference answer (recompute-all's
greedy answer in that report) is fed after the question in one forward pass, over a fresh mlx-lm prefill
of the composed tokens (the reference) and over each composition; per (strategy, R) it prints and writes
the mean KL (fresh || composed) over those positions and the top-1 agreement. R is `compose`'s
recompute_ratio (boundary counted in); only the choice of the stored tokens differs between strategies:

    deviation    compose(selection="deviation"): K/V deviation at --select-layer (`blend.deviation`)
    attention    compose(selection="attention"): that deviation x the probe's attention mass (`blend.probe_mass`)
    layerN       the same deviation at layer N (computed here from the fresh prefill's K/V: the same K/V
                 a selection pass stopped at layer N would see)
    alldev       deviation summed over all layers (full information; not deployable)
    first/last   B's first / last stored tokens; random: a fixed-seed sample
    mass         attention mass that probe rows (a generic question, `blend.PROBE`) put on each stored token,
                 summed over layers and heads, on the R = 0 composition (`blend.probe_mass`)
    oracle       blocks of 32 tokens ranked by how much recomputing each block alone lowers the KL (measured;
                 additive approximation of the best set; not deployable)

With --bleu, each setting also answers every question greedily (the report's max_tokens) and is compared
with the report's reference answers (`metrics.compare_answers`: BLEU, first token, exact).

    PYTHONPATH=. python benchmarks/blend_select.py REPORT.json OUT.json [--ratios 0,.1,.2] [--strategies a,b]
        [--oracle] [--bleu] [--dtype float32]
"""

import cartridge  # noqa: I001  (first: loads OpenBLAS before mlx)
import argparse
import json
import time
from functools import partial

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from cartridge import blend
from cartridge.compose import ComposedCartridge, Part, compose
from cartridge.eval.composed import by_class, timed_greedy
from cartridge.models.prompt import SEPARATOR

RATIOS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)
BLOCK = 32
SELECT_LAYER = [blend.DEFAULT_SELECT_LAYER]  # compose's selection layer (--select-layer)


def log_probs(model, ids, cache):
    out = model(mx.array(ids)[None], cache=cache)[0].astype(mx.float32)
    return np.array(out - mx.logsumexp(out, axis=-1, keepdims=True))


class Pair:
    """The pair's cartridges, questions, reference log-probs and per-layer deviations of B's stored tokens."""

    def __init__(self, report, dtype="auto"):
        self.report = report
        self.lm = cartridge.load_model("default", dtype=dtype)
        self.carts = [cartridge.load(d["cartridge"]["path"], model=self.lm) for d in report["documents"]]
        base = compose(self.carts, recompute=16, recompute_ratio=0.0)
        self.base = base
        b = base.blended[0]
        self.n_read, self.n_fresh = b["read"], b["fresh"]
        self.first = len(base.tokens) - b["read"]  # composed position of B's first stored token read
        part = base._layers[0][-1]
        self.start, self.shift = part.start, part.shift
        model = self.lm.model
        ref = make_prompt_cache(model)
        t0 = time.perf_counter()
        for at in range(0, len(base.tokens), 256):
            model(mx.array(base.tokens[at:at + 256])[None], cache=ref)
            mx.eval([c.state for c in ref])
        self.prefill_s = time.perf_counter() - t0
        self.dev = []  # (n_layers, n_read): deviation of the stored K/V from the fresh prefill's, per layer
        for layer, c in enumerate(ref):
            fresh = (c.keys[0, :, self.first:len(base.tokens)].astype(mx.float32),
                     c.values[0, :, self.first:len(base.tokens)].astype(mx.float32))
            stored = blend.stored_kv(Part(self.carts[-1].prefixes[layer], self.shift, self.start), base._ropes[layer])
            self.dev.append(np.array(blend.deviation(fresh, stored)))
        self.dev = np.array(self.dev)
        self.rows = []
        for q, a in zip(report["questions"], report["reference"]["answers"]):
            prompt = base.question_prompt(q["question"]) + a["tokens"]
            self.rows.append((q["id"], prompt, log_probs(model, prompt, ref)))
            trim_prompt_cache(ref, len(prompt))
        self.mass = self._mass()

    def _mass(self):
        return np.array(blend.probe_mass(self.lm.model, self.base.prompt_cache(), self.base.question_prompt(blend.PROBE)))

    def score(self, comp):
        """Mean KL (fresh || composed) and top-1 agreement over every question's prompt + reference answer."""
        kl = agree = n = 0
        per = {}
        for qid, prompt, ref in self.rows:
            got = log_probs(self.lm.model, prompt, comp.prompt_cache())
            k = float((np.exp(ref) * (ref - got)).sum())
            per[qid] = k / len(ref)
            kl, agree, n = kl + k, agree + int((got.argmax(-1) == ref.argmax(-1)).sum()), n + len(ref)
        return {"mean_kl": kl / n, "agree": agree, "n": n, "per_question_kl": per}

    def bleu(self, comp):
        """Greedy answers over `comp` against the report's reference answers, all / one document / both."""
        r = self.report
        answers = [timed_greedy(self.lm.model, self.lm.tokenizer, comp.question_prompt(q["question"]),
                                r["settings"]["max_tokens"], comp.prompt_cache) for q in r["questions"]]
        got = by_class(answers, r["reference"]["answers"], r["questions"])
        return {"bleu": {k: (v["bleu"] if v else None) for k, v in got.items()},
                "first_token": got["all"]["first_token"], "exact": got["all"]["exact"]}


def top(scores, k):
    return blend.select(list(scores), k)


def top_of(scores, k):
    return top(scores, k)


def strategies(pair, rng_seed=0):
    n = pair.n_read
    out = {
        "deviation": ("deviation", None),  # compose's own selection passes
        "attention": ("attention", None),
        "first": lambda k: list(range(k)),
        "last": lambda k: list(range(n - k, n)),
        "random": lambda k: sorted(np.random.default_rng(rng_seed).choice(n, k, replace=False).tolist()),
        "alldev": lambda k: top(pair.dev.sum(0), k),
        "mass": lambda k: top(pair.mass, k),
        "mass*alldev": lambda k: top(pair.mass * pair.dev.sum(0), k),
    }
    for layer in (1, 4, 8, 16):
        out[f"layer{layer}"] = partial(top_of, pair.dev[layer])
    return {k: v if isinstance(v, tuple) else ("deviation", v) for k, v in out.items()}


def composed(pair, ratio, how):
    """compose() of the pair at `ratio`; how = (selection, choose): its stored-token choice replaced by
    `choose(k)` (None: compose's own, by `selection`)."""
    selection, choose = how
    class Chosen(ComposedCartridge):
        def _select(self, caches, cart, part, k):
            if choose is None or k in (0, len(cart.tokens) - part.start):
                return super()._select(caches, cart, part, k)
            return choose(k)
    t0 = time.perf_counter()
    comp = Chosen(pair.carts, 16, SEPARATOR, ratio, SELECT_LAYER[0], selection)
    return comp, time.perf_counter() - t0


def block_oracle(pair, log):
    """KL with each block of BLOCK stored tokens recomputed alone (besides the boundary); returns per-token gains."""
    r0 = pair.score(composed(pair, 0.0, ("deviation", None))[0])["mean_kl"]
    gain = np.zeros(pair.n_read)
    blocks = []
    for at in range(0, pair.n_read, BLOCK):
        idx = list(range(at, min(at + BLOCK, pair.n_read)))
        ratio = (pair.n_fresh + len(idx)) / (pair.n_fresh + pair.n_read)
        comp, _ = composed(pair, ratio, ("deviation", lambda k, idx=idx: idx[:k] if k <= len(idx) else idx))
        kl = pair.score(comp)["mean_kl"]
        gain[idx] = r0 - kl
        blocks.append({"start": at, "kl": kl, "gain": r0 - kl})
        log(f"block {at}: kl {kl:.5f} gain {r0 - kl:+.5f}")
    return gain, blocks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("out")
    ap.add_argument("--ratios", default=",".join(str(r) for r in RATIOS))
    ap.add_argument("--strategies", default="deviation,attention,first,random")
    ap.add_argument("--oracle", action="store_true")
    ap.add_argument("--bleu", default="", help="ratios at which to answer greedily too, e.g. 0.1,0.2,0.3")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--select-layer", type=int, default=blend.DEFAULT_SELECT_LAYER)
    args = ap.parse_args()
    SELECT_LAYER[0] = args.select_layer
    with open(args.report) as f:
        report = json.load(f)
    t0 = time.perf_counter()
    pair = Pair(report, args.dtype)

    def log(s):
        print(f"[{time.perf_counter() - t0:7.1f}s] {s}", flush=True)

    log(f"B: {pair.n_fresh} fresh + {pair.n_read} read; prefill of the composed tokens {pair.prefill_s:.1f} s")
    q = np.percentile
    log("deviation per layer (mean over B): " + " ".join(f"{d:.3f}" for d in pair.dev.mean(1)))
    log(f"mass on B: total {pair.mass.sum():.3f}, top-5% tokens hold {np.sort(pair.mass)[::-1][:pair.n_read // 20].sum() / pair.mass.sum():.2f}")
    table = strategies(pair)
    result = {"report": args.report, "select_layer": args.select_layer, "n_fresh": pair.n_fresh, "n_read": pair.n_read, "probe": blend.PROBE,
              "deviation_per_layer": pair.dev.mean(1).tolist(), "rows": []}
    if args.oracle:
        gain, blocks = block_oracle(pair, log)
        result["oracle_blocks"] = blocks
        table["oracle"] = ("deviation", lambda k: top(gain + 1e-9 * pair.dev[1], k))
    ratios = [float(r) for r in args.ratios.split(",")]
    bleu_at = {float(r) for r in args.bleu.split(",") if r}
    names = args.strategies.split(",") + (["oracle"] if args.oracle else [])
    done = {}
    for ratio in ratios:
        for name in names:
            key = "all" if ratio == 1.0 else ("boundary" if ratio <= pair.n_fresh / (pair.n_fresh + pair.n_read) else None)
            if key and key in done:
                row = dict(done[key], strategy=name)
            else:
                comp, cs = composed(pair, ratio, table[name])
                b = comp.blended[0]
                at = np.array(b["positions"]) - pair.first
                row = {"strategy": name, "ratio": ratio, "recomputed": b["fresh"] + b["selected"],
                       "of": b["fresh"] + b["read"], "compose_s": cs, "select_s": b["select_s"],
                       "selected_p10_p50_p90": [int(q(at, p)) for p in (10, 50, 90)] if len(at) else [],
                       **pair.score(comp), **(pair.bleu(comp) if ratio in bleu_at else {})}
                if key:
                    done[key] = row
            result["rows"].append(row)
            log(f"R {ratio:.2f} {name:12s} recomputed {row['recomputed']:4d}/{row['of']} kl {row['mean_kl']:.5f} "
                f"top1 {row['agree']}/{row['n']} bleu {row.get('bleu', {}).get('all', -1):.3f} sel {row['selected_p10_p50_p90']} compose {row['compose_s']:.1f}s")
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
