"""Teacher-forced agreement with a reference: known answer tokens are fed after each question in one forward
pass over the reference K/V and over the K/V under test; per position, KL (reference || test) and whether the
argmax agrees. Three subcommands, and a timing one:

    presets DOC QUESTIONS OUT.json [VARIANT ...] [--fixed K/V,...] [--bleu] [--extra T,...] [--heavy] [--attention]
    blend REPORT.json OUT.json [--ratios 0,.1,.2] [--strategies a,b] [--oracle] [--bleu R,...] [--questions Q.jsonl]
    kenc DOC QUESTIONS OUT.json [--configs preset=balanced,mlx4g32] [--encoders nearest,score,...] [--bleu ...]
    scale-cost OUT.json [--contexts 4096,32768] [--tiers mlx4g32+rot,int8]

`presets` (issue 33): calibrated presets against fp16 on real questions, without building cartridges. DOC is
prefilled, each question answered greedily (50 tokens) over the fp16-rounded K/V (cached beside OUT as
OUT.answers.json); for each calibration VARIANT (measurement constants of cartridge.calibrate.sequence,
VARIANTS below) the safe / balanced / compact schemas are chosen and question + fp16 answer teacher-forced over
the K/V round-tripped through each schema's tiers (encode, reference decode). That gives the greedy answer's
first token, whether it is identical and the tokens to its first divergence exactly (before the first
disagreement the contexts are the same); --bleu adds sentence BLEU, for which the schema's own continuation
after that point is generated greedily to 50 tokens. --fixed scores uniform schemas (k_tier/v_tier) too.
Per variant, three more searches over the same measurement: --extra T,... measures those tiers beside the
candidates and chooses among all ("VARIANT+extra/PRESET"); --heavy keeps the measured heavy hitters (leading
tokens) in fp16, their bytes taken from the budget ("VARIANT+heavy/PRESET"); --attention chooses by the summed
attention-output error alone, every layer weighted alike, without the walk's KL ("VARIANT+attention/PRESET").
`presets` also knows the benchmark-only prototype tiers int5 and int5+rot (`PROTOTYPES`, not registered in the
package), so --extra int5+rot / --fixed int5+rot/int5+rot measure a 5-bit tier without a format change.

`blend` (issue 33 item 3): which tokens of a later document to recompute. For the pair of a
`cartridge eval A B --json` report, every question's reference answer (recompute-all's greedy answer there) is
fed over a fresh mlx-lm prefill of the composed tokens (the reference) and over each composition; per
(strategy, R) the mean KL and top-1 agreement. R is `compose`'s recompute_ratio (boundary counted in); only the
choice of the stored tokens differs between strategies:

    deviation    compose(selection="deviation"): K/V deviation at --select-layer (`blend.deviation`)
    attention    compose(selection="attention"): that deviation x the probe's attention mass (`blend.probe_mass`)
    layerN       the same deviation at layer N (computed here from the fresh prefill's K/V: the same K/V
                 a selection pass stopped at layer N would see)
    alldev       deviation summed over all layers (full information; not deployable)
    first/last   B's first / last stored tokens; random: a fixed-seed sample
    qmass*alldev alldev x the attention mass the questions' own prompts + reference answers put on each token
                 (an oracle of the answers' needs; not deployable)
    mass         attention mass that probe rows (a generic question, `blend.PROBE`) put on each stored token,
                 summed over layers and heads, on the R = 0 composition (`blend.probe_mass`)
    oracle       blocks of 32 tokens ranked by how much recomputing each block alone lowers the KL (measured;
                 additive approximation of the best set; not deployable)

With --bleu R,..., each setting at those ratios also answers every question greedily (the report's max_tokens)
and is compared with the report's reference answers (`metrics.compare_answers`: BLEU, first token, exact): the
answer is the reference's up to its first teacher-forced argmax difference and generated from there. --questions
Q.jsonl asks those instead of the report's; their reference answers are greedy (--max-tokens) over the fresh
prefill of the composed tokens (R = 1 answers alike: docs/evaluation.md).

`kenc` (issue 49 items 2-4): the encodings of `ENCODERS` (nearest; score-aware K; K scaled per channel; V for the
output) in real builds. DOC is built in fp16 and each question answered greedily (50 tokens) over that cartridge
(the reference; cached as OUT.answers.json); each --configs entry (preset=NAME or a tier) is built with each
--encoders entry (default nearest,score) (wall and CPU seconds, the
prefill's and the calibration's, bytes/token, and for a preset its calibration record: the probe's measured KL and
top-1, the quantity calibration measures) and each cartridge scored as `presets` scores a schema: question + fp16
answer teacher-forced over it (KL, top-1, first token, identical answers, tokens to divergence); configs named in
--bleu add sentence BLEU of the cartridge's own greedy answer. The cartridges stay in --work (default OUT.work):
a second run with other --bleu scores them again without rebuilding. Rows "CONFIG @ENCODER" in OUT.json.

`scale-cost` (issue 49 item 3): what a K scale (format 1.11, `cartridge.tiers.key_scale`) costs per decode step,
in one run: for one layer and one query token, beside MLX's dense SDPA over the same context and a bare read of
the layer's stored bytes (`cartridge.eval.bench.read_floor`), each attention policy of this device over the same
pages without and with a K scale (the queries multiplied by s and the new key divided by s at the cache, every
kernel unchanged), and the two scale operations alone. Shapes are SmolLM2-135M's (9 query heads over 3 KV heads,
head_dim 64) and Gemma 3 270M's full-attention layers' (4 over 1, head_dim 256); K/V random.

    PYTHONPATH=. python benchmarks/agreement.py {presets,blend,kenc,scale-cost} --help
"""

import cartridge  # noqa: I001  (first: loads OpenBLAS before mlx)
import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from cartridge.compose import blend
from cartridge.write.prefill import prefill
from cartridge.calibrate import fitting, measure, search, sequence
from cartridge.compose.composed import ComposedCartridge, Part, compose
from cartridge.eval.composed import by_class, sources, timed_greedy
from cartridge.eval.dataset import load_questions
from cartridge.eval.metrics import sentence_bleu
from cartridge.models.prompt import SEPARATOR, prefix_tokens, prompt_mode, question_tokens
from cartridge.tiers import TIERS, bitpack, protect
from cartridge.tiers.affine import AffineCodec, affine_values
from cartridge.tiers.rotation import RotatedCodec
from cartridge.attention import backends
from cartridge.attention.timing import timeit
from cartridge.eval.bench import available_policies, random_kv, read_floor, tier_prefix, time_policy
from cartridge.eval.bench_report import environment
from dataclasses import replace


def log_probs(model, ids, cache, start=0):
    """(len(ids) - start, vocab) float32 numpy log-probabilities of the model's forward of ids over cache
    (`measure.log_softmax`: calibration's own, so KL values match its)."""
    out = model(mx.array(ids, dtype=mx.uint32)[None], cache=cache)[0, start:].astype(mx.float32)
    return np.array(measure.log_softmax(out))


def compare(ref, got):
    """Per position of two (T, vocab) log-prob arrays: KL (ref || got) in nats (T,) and argmax equal (T,) bool."""
    return (np.exp(ref) * (ref - got)).sum(-1), ref.argmax(-1) == got.argmax(-1)


def agreement(refs, gots, answers):
    """Per question the teacher-forced log-probs `gots` against `refs` (`compare`): ({"first", "top1", "kl", "div",
    "identical"} over the questions, each question's tokens before the first disagreement)."""
    first = agree = n = 0
    kls, div = [], []
    for ref, got in zip(refs, gots):
        kl, same = compare(ref, got)
        kls.append(float(kl.mean()))
        first, agree, n = first + int(same[0]), agree + int(same.sum()), n + len(same)
        div.append(int(np.argmin(same)) if not same.all() else len(same))
    return {"first": first, "top1": agree / n, "kl": sum(kls) / len(kls), "div": sum(div) / len(div),
            "identical": sum(d == len(a) for d, a in zip(div, answers))}, div

def kept_first(x2, x, first):
    """x2 (1, n_kv, T, D) with its first `first` tokens put back from x (protected tokens, as calibrate.verify)."""
    return mx.concatenate([x[:, :, :first], x2[:, :, first:]], axis=2) if first else x2


# ---- presets ------------------------------------------------------------------------------------------------

class Int5Codec(AffineCodec):
    """Benchmark-only prototype int5 (issue 33): 5-bit affine, group 32, fp16 scale and bias, 5 * kv_dim/8 +
    kv_dim/8 bytes per token per layer-side (144 B at kv_dim 192). Not a registered tier (no spec entry, no kernel
    layout): `PROTOTYPES` are added to this process's TIERS so --extra / --fixed can name int5 and int5+rot. Codes
    are packed LSB first (`bitpack.pack`), the layout `mx.dequantize(bits=5)` reads; encoder `affine_encode`."""

    name = "int5"
    bits = 5
    formula = "5 * kv_dim/8 + kv_dim/8"

    def decode(self, parts, params):
        if mx.default_device() != mx.cpu:
            return super().decode(parts, params)
        d = parts["codes"].shape[-1] * 32 // self.bits
        codes = bitpack.unpack(parts["codes"], self.bits, d)  # (..., D) uint32
        return affine_values(codes, parts["scales"], parts["biases"], self.group_size)


PROTOTYPES = {c.name: c for c in (Int5Codec(), RotatedCodec(Int5Codec()))}


ANSWER_TOKENS = 50
P3 = ("What is this document about? Answer in one sentence.", "Quote the first sentence of the document.",
      "Which names, numbers or dates does the document mention?")
BASE = {"PROBES": P3[:1], "ANSWER_TOKENS": 8, "SCORE_DOCUMENT": True, "SLICE_TOKENS": 32}
VARIANTS = {"base": BASE, "p3": {**BASE, "PROBES": P3}, "p3qa": {**BASE, "PROBES": P3, "SCORE_DOCUMENT": False},
            "p3a16": {**BASE, "PROBES": P3, "ANSWER_TOKENS": 16}, "qa": {**BASE, "SCORE_DOCUMENT": False}}
PRESET_RATIOS = (("safe", 2.0), ("balanced", 3.0), ("compact", 4.5))


class Presets:
    """The prefilled document, its fp16-rounded K/V, the questions, their fp16 answers and reference log-probs."""

    def __init__(self, lm, doc, qfile, answers_file):
        self.model, self.tok = lm.model, lm.tokenizer
        self.mode = prompt_mode(self.tok)
        self.tokens = prefix_tokens(self.tok, Path(doc).read_text(), self.mode)
        self.caches = prefill(self.model, self.tokens)
        self.kv = [tuple(measure.fp16_rounded(a) for a in (c.keys[..., :c.offset, :], c.values[..., :c.offset, :]))
                   for c in self.caches]
        qs = [json.loads(line)["question"] for line in Path(qfile).read_text().splitlines() if line.strip()]
        ids = getattr(self.tok, "eos_token_ids", None)
        self.eos = set(ids) if ids else {self.tok.eos_token_id}
        self.seqs = [question_tokens(self.tok, q, self.mode) for q in qs]
        if os.path.exists(answers_file):
            self.answers = json.loads(Path(answers_file).read_text())
        else:
            self.answers = [self.continued(self.kv, s, []) for s in self.seqs]
            Path(answers_file).write_text(json.dumps(self.answers))
        self.ref = self.log_probs_over(self.kv)
        self.shapes = {"k": (self.kv[0][0].shape[1], self.kv[0][0].shape[3]),
                       "v": (self.kv[0][1].shape[1], self.kv[0][1].shape[3])}

    def cache(self, pairs):
        return [sequence.filled_cache(k, v) for k, v in pairs]

    def continued(self, pairs, s, head):
        """head + the greedy continuation over `pairs` after question tokens s, to ANSWER_TOKENS (or EOS, kept)."""
        cache, step, out = self.cache(pairs), s + head, list(head)
        while len(out) < ANSWER_TOKENS:
            t = int(mx.argmax(self.model(mx.array(step, dtype=mx.uint32)[None], cache=cache)[0, -1]).item())
            out.append(t)
            if t in self.eos:
                break
            step = [t]
        return out

    def log_probs_over(self, pairs):
        """Per question, the log-probs predicting its fp16 answer's tokens (teacher-forced) over `pairs`."""
        return [log_probs(self.model, s + a[:-1], self.cache(pairs), start=len(s) - 1)
                for s, a in zip(self.seqs, self.answers)]

    def score(self, schema, bleu=False, first=0):
        """Teacher-forced agreement of `schema` (its first `first` prefix tokens kept in fp16) with fp16."""
        pairs = [tuple(kept_first(measure.round_trip(row[s], x, row["layer"], s), x, first)
                       if row[s] != "fp16" else x for s, x in zip("kv", p)) for row, p in zip(schema, self.kv)]
        res, div = agreement(self.ref, self.log_probs_over(pairs), self.answers)
        if bleu:
            res["bleu"] = float(np.mean([1.0 if d == len(a) else
                                         sentence_bleu(self.text(self.continued(pairs, s, a[:d])), self.text(a))
                                         for s, a, d in zip(self.seqs, self.answers, div)]))
        return res

    def text(self, ids):
        return self.tok.decode([t for t in ids if t not in self.eos])


def rounded(r):
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "schema"}


def searches(args, sens, run, candidates):
    """{suffix: (kl dict, protected first tokens, their bytes/token)} of the searches this run asks for."""
    plain = {k: v for k, v in sens.kl.items() if k[2] in ("fp16", *candidates)}
    out = {"": (plain, 0, 0)}
    if args.extra:
        out["+extra"] = (sens.kl, 0, 0)
    if args.heavy and sens.protect_first:
        n = sens.protect_first
        shapes = [run.shapes[s] for _ in range(len(run.kv)) for s in "kv"]
        kept = {k: v for k, v in sens.kl_protected.items() if k[2] in ("fp16", *candidates)}
        out["+heavy"] = (kept, n, protect.bytes_per_token(n, 0, len(run.tokens), shapes))
    if args.attention:
        out["+attention"] = ({k: (0.0 if k[2] == "fp16" else sens.attn_err[k]) for k in plain}, 0, 0)
    return out


def presets_main(args):
    TIERS.update(PROTOTYPES)  # this process only
    run = Presets(cartridge.load_model(args.model), args.doc, args.questions, args.out + ".answers.json")
    fp16_bpt = len(run.kv) * 2 * TIERS["fp16"].bytes_per_token(*run.shapes["k"])
    candidates, extra = fitting(run.shapes), tuple(filter(None, args.extra.split(",")))
    results = {}
    for variant in args.variants or ["base"]:
        t0 = time.time()
        for name, val in VARIANTS[variant].items():
            setattr(sequence, name, val)
        sens = measure.measure(run.model, run.tok, run.mode, run.caches, run.tokens, candidates + extra)
        secs = time.time() - t0
        for suffix, (kl, first, copies) in searches(args, sens, run, candidates).items():
            for preset, ratio in PRESET_RATIOS:
                ch = search.choose(kl, len(run.kv), run.shapes, int(fp16_bpt // ratio) - copies)
                r = run.score(ch.schema, args.bleu, first)
                r.update(bytes=ch.bytes_per_token + copies, pred=ch.predicted_kl, calib_s=secs, protect_first=first,
                         schema=[(row["k"], row["v"]) for row in ch.schema])
                results[f"{variant}{suffix}/{preset}"] = r
                print(f"{variant}{suffix}", preset, rounded(r), flush=True)
    for name in filter(None, args.fixed.split(",")):
        kt, vt = name.split("/")
        schema = [{"layer": i, "k": kt, "v": vt} for i in range(len(run.kv))]
        r = run.score(schema, args.bleu)
        r.update(bytes=search.schema_bytes(schema, run.shapes))
        results[f"fixed/{name}"] = r
        print("fixed", name, rounded(r), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


# ---- blend --------------------------------------------------------------------------------------------------

RATIOS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)
BLOCK = 32


class Pair:
    """The pair's cartridges, questions, reference log-probs and per-layer deviations of B's stored tokens."""

    def __init__(self, report, dtype="auto", select_layer=blend.DEFAULT_SELECT_LAYER, model="default", questions=None,
                 max_tokens=32):
        self.report, self.select_layer = report, select_layer
        self.lm = cartridge.load_model(model, dtype=dtype)
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
        self.b_kv = []  # per layer: the fresh prefill's (k, v) of B's composed tokens (boundary + read)
        for layer, c in enumerate(ref):
            self.b_kv.append((c.keys[0, :, len(self.carts[0].tokens):len(base.tokens)],
                              c.values[0, :, len(self.carts[0].tokens):len(base.tokens)]))
            fresh = (c.keys[0, :, self.first:len(base.tokens)].astype(mx.float32),
                     c.values[0, :, self.first:len(base.tokens)].astype(mx.float32))
            stored = blend.stored_kv(Part(self.carts[-1].prefixes[layer], self.shift, self.start), base._ropes[layer])
            self.dev.append(np.array(blend.deviation(fresh, stored)))
        self.dev = np.array(self.dev)
        if questions is not None:  # their reference answers: greedy over the fresh prefill of the composed tokens
            self.questions, self.max_tokens = questions, max_tokens
            self.answers = []
            for q in questions:
                self.answers.append(self.greedy(base.question_prompt(q["question"]), max_tokens, lambda: ref))
                trim_prompt_cache(ref, ref[0].offset - len(base.tokens))
        else:
            self.questions, self.max_tokens = report["questions"], report["settings"]["max_tokens"]
            self.answers = report["reference"]["answers"]
        self.rows = []
        for q, a in zip(self.questions, self.answers):
            asked = base.question_prompt(q["question"])
            prompt = asked + a["tokens"]
            self.rows.append((q["id"], prompt, log_probs(model, prompt, ref), len(asked), a))
            trim_prompt_cache(ref, ref[0].offset - len(base.tokens))
        self.mass = np.array(blend.probe_mass(model, base.prompt_cache(), base.question_prompt(blend.PROBE)))

    def question_mass(self):
        """Attention mass that the questions' own prompts + reference answers put on B's stored tokens over the R = 0
        composition, summed over questions (`blend.probe_mass`; not deployable: the questions come later)."""
        if not hasattr(self, "_qmass"):
            self._qmass = sum(np.array(blend.probe_mass(self.lm.model, self.base.prompt_cache(), prompt))
                              for _, prompt, *_ in self.rows)
        return self._qmass

    def greedy(self, prompt, max_tokens, make_cache):
        """`timed_greedy`'s answer {"tokens", "text"}, the text decoded from the tokens (EOS left out)."""
        tokens = timed_greedy(self.lm.model, self.lm.tokenizer, prompt, max_tokens, make_cache)["tokens"]
        return {"tokens": tokens, "text": self.text(tokens)}

    def text(self, tokens):
        eos = set(self.lm.tokenizer.eos_token_ids)
        return self.lm.tokenizer.decode([t for t in tokens if t not in eos])

    def score(self, comp, bleu=False):
        """Mean KL (fresh || composed) and top-1 agreement over every question's prompt + reference answer; with
        `bleu`, also the greedy answers over `comp` against the reference answers (all / one document / both).

        The greedy answer follows the composed argmax: it equals the reference up to the first position where the
        teacher-forced argmax differs from the reference token (the same contexts before it), so only the rest is
        generated (`timed_greedy` from there, to the answer's max tokens)."""
        kl = agree = n = 0
        per, answers = {}, []
        for qid, prompt, ref, asked, a in self.rows:
            got = log_probs(self.lm.model, prompt, comp.prompt_cache())
            k, same = compare(ref, got)
            per[qid] = float(k.sum()) / len(ref)
            kl, agree, n = kl + float(k.sum()), agree + int(same.sum()), n + len(ref)
            if bleu:
                hits = got[asked - 1:asked - 1 + len(a["tokens"])].argmax(-1) == np.array(a["tokens"])
                d = int(np.argmin(hits)) if not hits.all() else len(hits)
                tail = [] if d == len(hits) else self.greedy(prompt[:asked + d], self.max_tokens - d,
                                                             comp.prompt_cache)["tokens"]
                tokens = a["tokens"][:d] + tail
                answers.append({"tokens": tokens, "text": self.text(tokens)})
        out = {"mean_kl": kl / n, "agree": agree, "n": n, "per_question_kl": per}
        if bleu:
            refs = [{"tokens": a["tokens"], "text": self.text(a["tokens"])} for *_, a in self.rows]
            got = by_class(answers, refs, self.questions)
            out.update(bleu={k: (v["bleu"] if v else None) for k, v in got.items()},
                       first_token=got["all"]["first_token"], exact=got["all"]["exact"],
                       per_question_bleu=[r["bleu"] for r in got["all"]["per_question"]],
                       answers=[a["tokens"] for a in answers])
        return out


def top(scores, k):
    return blend.select(list(scores), k)


def normed(d):
    return d / d.mean()


def gradual(pair, first, then, widen=3):
    """The paper's gradual filtering (section 4.3), from the fresh prefill's deviations: `widen` x k candidates by
    layer `first`'s deviation, the k of them deviating most at layer `then`."""
    def choose(k):
        cand = np.array(top(pair.dev[first], min(pair.n_read, widen * k)))
        return sorted(cand[np.argsort(-pair.dev[then][cand], kind="stable")[:k]].tolist())
    return choose


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
        "qmass*alldev": lambda k: top(pair.question_mass() * pair.dev.sum(0), k),
    }
    for layer in (1, 4, 8, 16):
        if layer < len(pair.dev):
            out[f"layer{layer}"] = partial(top, pair.dev[layer])
    out["layer4+8"] = lambda k: top(normed(pair.dev[4]) + normed(pair.dev[8]), k)
    out["layer1+4"] = lambda k: top(normed(pair.dev[1]) + normed(pair.dev[4]), k)
    out["gradual1-8"] = gradual(pair, 1, 8)
    out["gradual4-12"] = gradual(pair, 4, 12)
    out["gradual4-16"] = gradual(pair, 4, 16)
    return {k: v if isinstance(v, tuple) else ("deviation", v) for k, v in out.items()}


def composed(pair, ratio, how, fresh_below=0):
    """compose() of the pair at `ratio`; how = (selection, choose): its stored-token choice replaced by
    `choose(k)` (None: compose's own, by `selection`). fresh_below=N: layers 0..N-1 of the questions' caches hold
    the fresh prefill's K/V for every token of B (what a selection pass at layer N computes anyway)."""
    selection, choose = how
    class Chosen(ComposedCartridge):
        def _select(self, caches, cart, part, k):
            if choose is None or k in (0, len(cart.tokens) - part.start):
                return super()._select(caches, cart, part, k)
            return choose(k)

        def prompt_cache(self):
            caches = super().prompt_cache()
            for layer in range(fresh_below if self.blended else 0):  # not while composing
                c = caches[layer]
                caches[layer] = type(c)(c.parts[:1], [pair.b_kv[layer]], c.length, c.rope)
            return caches
    t0 = time.perf_counter()
    comp = Chosen(pair.carts, 16, SEPARATOR, ratio, pair.select_layer, selection)
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


def blend_main(args):
    report = json.loads(Path(args.report).read_text())
    t0 = time.perf_counter()
    questions = load_questions(args.questions, sources(len(report["documents"]))) if args.questions else None
    pair = Pair(report, args.dtype, args.select_layer, args.model, questions, args.max_tokens)

    def log(s):
        print(f"[{time.perf_counter() - t0:7.1f}s] {s}", flush=True)

    log(f"B: {pair.n_fresh} fresh + {pair.n_read} read; prefill of the composed tokens {pair.prefill_s:.1f} s")
    q = np.percentile
    log("deviation per layer (mean over B): " + " ".join(f"{d:.3f}" for d in pair.dev.mean(1)))
    log(f"mass on B: total {pair.mass.sum():.3f}, top-5% tokens hold "
        f"{np.sort(pair.mass)[::-1][:pair.n_read // 20].sum() / pair.mass.sum():.2f}")
    table = strategies(pair)
    result = {"report": args.report, "select_layer": args.select_layer, "n_fresh": pair.n_fresh,
              "n_read": pair.n_read, "probe": blend.PROBE, "deviation_per_layer": pair.dev.mean(1).tolist(),
              "questions": args.questions or "the report's", "max_tokens": pair.max_tokens,
              "reference_answers": [a["tokens"] for a in pair.answers], "load_average_start": os.getloadavg(),
              "rows": []}
    if args.oracle:
        gain, blocks = block_oracle(pair, log)
        result["oracle_blocks"] = blocks
        table["oracle"] = ("deviation", lambda k: top(gain + 1e-9 * pair.dev[1], k))
    bleu_at = {float(r) for r in args.bleu.split(",") if r}
    done = {}
    for ratio in (float(r) for r in args.ratios.split(",")):
        for name in args.strategies.split(",") + (["oracle"] if args.oracle else []):
            boundary = ratio <= pair.n_fresh / (pair.n_fresh + pair.n_read)
            base, _, below = name.partition("@fresh")  # NAME@freshN: layers < N fresh for all of B
            key = "all" if ratio == 1.0 else ("boundary" if boundary and not below else None)
            if key and key in done:
                row = dict(done[key], strategy=name)
            else:
                comp, cs = composed(pair, ratio, table[base], int(below or 0))
                b = comp.blended[0]
                at = np.array(b["positions"]) - pair.first
                row = {"strategy": name, "ratio": ratio, "recomputed": b["fresh"] + b["selected"],
                       "of": b["fresh"] + b["read"], "compose_s": cs, "select_s": b["select_s"],
                       "selected_p10_p50_p90": [int(q(at, p)) for p in (10, 50, 90)] if len(at) else [],
                       **pair.score(comp, ratio in bleu_at)}
                if key:
                    done[key] = row
            result["rows"].append(row)
            result["load_average_end"], result["seconds"] = os.getloadavg(), time.perf_counter() - t0
            log(f"R {ratio:.2f} {name:12s} recomputed {row['recomputed']:4d}/{row['of']} kl {row['mean_kl']:.5f} "
                f"top1 {row['agree']}/{row['n']} bleu {row.get('bleu', {}).get('all', -1):.3f} "
                f"sel {row['selected_p10_p50_p90']} compose {row['compose_s']:.1f}s")
            Path(args.out).write_text(json.dumps(result, indent=1))


# ---- kenc ---------------------------------------------------------------------------------------------------

ENCODERS = {  # label -> build keywords (issue 49 items 2-4), each explicit (a preset has its own default)
    "nearest": {"k_encoder": "nearest", "k_scale": False, "v_encoder": "nearest"},
    "score": {"k_encoder": "score", "k_scale": False, "v_encoder": "nearest"},
    "scale": {"k_encoder": "nearest", "k_scale": True, "v_encoder": "nearest"},
    "score+scale": {"k_encoder": "score", "k_scale": True, "v_encoder": "nearest"},
    "score+scale+vout": {"k_encoder": "score", "k_scale": True, "v_encoder": "output"},
}


def build_options(config):
    """A --configs entry as build keywords: "preset=balanced" -> {"preset": "balanced"}, "mlx4g32" -> its tier."""
    key, _, value = config.rpartition("=")
    return {key: value} if key else {"tier": value}


class Reference:
    """The fp16 cartridge's greedy answers to the questions and their teacher-forced log-probs over it."""

    def __init__(self, lm, fp16_path, qfile, answers_file):
        self.lm = lm
        ids = getattr(lm.tokenizer, "eos_token_ids", None)
        self.eos = set(ids) if ids else {lm.tokenizer.eos_token_id}
        cart = cartridge.load(fp16_path, model=lm)
        self.seqs = [cart.question_prompt(q["question"]) for q in load_questions(qfile)]
        if os.path.exists(answers_file):
            self.answers = json.loads(Path(answers_file).read_text())
        else:
            self.answers = [self.continued(cart, s, []) for s in self.seqs]
            Path(answers_file).write_text(json.dumps(self.answers))
        self.ref = self.forced(cart)

    def continued(self, cart, s, head):
        """head + the greedy continuation over `cart` after question tokens s, to ANSWER_TOKENS (or EOS, kept)."""
        cache, step, out = cart.prompt_cache(), s + head, list(head)
        while len(out) < ANSWER_TOKENS:
            t = int(mx.argmax(self.lm.model(mx.array(step, dtype=mx.uint32)[None], cache=cache)[0, -1]).item())
            out.append(t)
            if t in self.eos:
                break
            step = [t]
        return out

    def forced(self, cart):
        """Per question, the log-probs predicting its fp16 answer's tokens (teacher-forced) over `cart`."""
        return [log_probs(self.lm.model, s + a[:-1], cart.prompt_cache(), start=len(s) - 1)
                for s, a in zip(self.seqs, self.answers)]

    def score(self, cart, bleu=False):
        """`Presets.score`'s agreement of `cart` with the fp16 cartridge: KL, top-1, first token, identical answers,
        tokens to divergence; with `bleu`, sentence BLEU of its greedy answer (the fp16 answer up to the first
        divergence, its own continuation after)."""
        res, div = agreement(self.ref, self.forced(cart), self.answers)
        if bleu:
            res["bleu"] = float(np.mean([1.0 if d == len(a) else
                                         sentence_bleu(self.text(self.continued(cart, s, a[:d])), self.text(a))
                                         for s, a, d in zip(self.seqs, self.answers, div)]))
        return res

    def text(self, ids):
        return self.lm.tokenizer.decode([t for t in ids if t not in self.eos])


def timed_build(doc, path, lm, options):
    """cartridge.build of `doc` at `path` (replaced), with its wall and CPU seconds and calibration record."""
    wall, cpu = time.perf_counter(), time.process_time()
    r = cartridge.build(doc, path, model=lm, reserve=0, force=True, **options)
    row = {"build_s": round(time.perf_counter() - wall, 2), "build_cpu_s": round(time.process_time() - cpu, 2),
           "prefill_s": round(r.prefill_seconds, 2), "bytes_per_token": r.bytes_per_token,
           "schema": [(row["k"], row["v"]) for row in r.schema]}
    if r.calibration:
        c = r.calibration
        row.update(calibration_s=c["seconds"], probe_kl=c["measured_kl"], predicted_kl=c["predicted_kl"],
                   probe_top1=c["top1_agreement"], window_bytes_per_token=c["window_bytes_per_token"])
    return row


def kenc_main(args):
    """Nearest against score-aware K encoding (issue 49): real builds of each --configs entry both ways."""
    lm = cartridge.load_model(args.model)
    doc = Path(args.doc).read_text()
    work = Path(args.work or args.out + ".work")
    work.mkdir(parents=True, exist_ok=True)
    results = json.loads(Path(args.out).read_text()) if os.path.exists(args.out) else {"rows": {}}
    results.update(model=lm.ref, doc=args.doc, questions=args.questions, answer_tokens=ANSWER_TOKENS)
    fp16 = work / "fp16.cart"
    if not (fp16 / "MANIFEST").exists():
        results["fp16"] = timed_build(doc, fp16, lm, {"tier": "fp16"})
    ref = Reference(lm, fp16, args.questions, args.out + ".answers.json")
    bleu = set(filter(None, args.bleu.split(",")))
    for config in filter(None, args.configs.split(",")):
        for enc in args.encoders.split(","):
            label, path = f"{config} @{enc}", work / f"{config.replace('=', '-')}-{enc}.cart"
            row = results["rows"].get(label, {})
            if not (path / "MANIFEST").exists() or not row:
                row = timed_build(doc, path, lm, {**build_options(config), **ENCODERS[enc]})
            if config in bleu and "bleu" not in row or "kl" not in row:
                row.update(ref.score(cartridge.load(path, model=lm), config in bleu))
            results["rows"][label] = row
            print(label, rounded(row), flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))


# ---- scale-cost ----------------------------------------------------------------------------------------------

COST_SHAPES = {"smollm2-135m": (9, 3, 64), "gemma3-270m": (4, 1, 256)}  # (n_q_heads, n_kv_heads, head_dim)


def scale_ops(shape, dtype, repeats):
    """µs of the two operations a scaled layer adds per decode step, as `CartridgeCache` does them (the scale laid
    out per head and cast once): q * s (1, n_q, 1, D) and k * (1 / s) (1, n_kv, 1, D)."""
    n_q, n_kv, d = shape
    s = mx.random.uniform(0.5, 2.0, (n_kv, d))
    per_q = mx.repeat(s, n_q // n_kv, axis=0)[None, :, None, :].astype(dtype)
    inverse = (1.0 / s)[None, :, None, :].astype(dtype)
    q, k = mx.random.normal((1, n_q, 1, d)).astype(dtype), mx.random.normal((1, n_kv, 1, d)).astype(dtype)
    mx.eval(per_q, inverse, q, k)
    return timeit(lambda: [q * per_q, k * inverse], repeats) * 1e6


def rows_for(name, shape, n_tokens, tiers, repeats):
    n_q, n_kv, d = shape
    dtype = mx.float32 if backends.device() == "cpu" else mx.float16
    k, v = random_kv(n_kv, n_tokens, d, seed=n_tokens)
    q = mx.random.normal((1, n_q, 1, d)).astype(dtype)
    new_k = mx.random.normal((1, n_kv, 1, d)).astype(dtype)
    dense_k, dense_v = k[None].astype(dtype), v[None].astype(dtype)
    mx.eval(q, new_k, dense_k, dense_v)
    base = {"shape": name, "context": n_tokens}
    out = [{**base, "what": "dense sdpa", "us": timeit(lambda x: mx.fast.scaled_dot_product_attention(
        x, dense_k, dense_v, scale=d ** -0.5), repeats, chain=q) * 1e6},
        {**base, "what": "scale ops alone", "us": scale_ops(shape, dtype, repeats)}]
    scale = mx.random.uniform(0.5, 2.0, (n_kv, d))
    for tier in tiers:
        prefix, error = tier_prefix(tier, k, v)
        if prefix is None:
            out.append({**base, "what": f"{tier}", "error": error})
            continue
        out.append({**base, "what": f"{tier} read floor", "us": read_floor(prefix, tier, n_tokens, repeats)["us"]})
        for policy in available_policies():
            for label, p in (("plain", prefix), ("scaled", replace(prefix, key_scale=scale))):
                us, _, error = time_policy(p, policy, dtype, q, new_k, repeats)
                out.append({**base, "what": f"{tier} {policy} {label}", "us": us, "error": error})
    return out


def cost_main(args):
    """What a K scale costs per decode step (module docstring, `scale-cost`): printed and written to OUT."""
    rows = []
    for name, shape in COST_SHAPES.items():
        for n in (int(c) for c in args.contexts.split(",")):
            for row in rows_for(name, shape, n, args.tiers.split(","), args.repeats):
                rows.append(row)
                us = f"{row['us']:9.1f} us" if row.get("us") is not None else f"  {row.get('error')}"
                print(f"{name:13s} {n:7d}  {row['what']:40s}{us}", flush=True)
    Path(args.out).write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))


def main():
    ap = argparse.ArgumentParser(description="Teacher-forced agreement with a reference (see the module docstring).")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("presets", help="calibrated presets' schemas against fp16 on the document's questions")
    p.add_argument("doc")
    p.add_argument("questions", help="JSONL, one {\"question\": ...} per line")
    p.add_argument("out", help="JSON results (the fp16 answers are cached beside it as OUT.answers.json)")
    p.add_argument("variants", nargs="*", metavar="VARIANT", help=f"calibration variants: {', '.join(VARIANTS)} "
                   "(default: base)")
    p.add_argument("--fixed", default="", help="uniform schemas scored too, e.g. int8/int8,turbo4/turbo3")
    p.add_argument("--bleu", action="store_true", help="sentence BLEU of each schema's own greedy answer too")
    p.add_argument("--extra", default="", help="tiers measured beside the candidates, e.g. mxfp4+rot,nvfp4+rot")
    p.add_argument("--heavy", action="store_true", help="also the schemas with the heavy hitters kept in fp16")
    p.add_argument("--attention", action="store_true", help="also the schemas chosen by attention error alone")
    p.add_argument("--model", default="default")
    p.set_defaults(run=presets_main)
    b = sub.add_parser("blend", help="which tokens of a composition's later document to recompute")
    b.add_argument("report", help="a `cartridge eval A B --json` report")
    b.add_argument("out")
    b.add_argument("--ratios", default=",".join(str(r) for r in RATIOS))
    b.add_argument("--strategies", default="deviation,attention,first,random")
    b.add_argument("--oracle", action="store_true")
    b.add_argument("--bleu", default="", help="ratios at which to answer greedily too, e.g. 0.1,0.2,0.3")
    b.add_argument("--questions", help="JSONL questions asked instead of the report's; their reference answers are "
                   "then greedy over the fresh prefill of the composed tokens")
    b.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per reference answer (with --questions)")
    b.add_argument("--dtype", default="auto")
    b.add_argument("--select-layer", type=int, default=blend.DEFAULT_SELECT_LAYER)
    b.add_argument("--model", default="default", help="the model the report's cartridges were built with")
    b.set_defaults(run=blend_main)
    k = sub.add_parser("kenc", help="nearest against score-aware K encoding (issue 49) in real builds")
    k.add_argument("doc")
    k.add_argument("questions", help="JSONL, one {\"question\": ...} per line")
    k.add_argument("out", help="JSON results, updated as rows come (fp16 answers cached as OUT.answers.json)")
    k.add_argument("--configs", default="preset=balanced,preset=compact,mlx4g32",
                   help="build options, each built with k_encoder nearest and score: preset=NAME or a tier")
    k.add_argument("--bleu", default="", help="configs whose answers are also generated and BLEU-scored")
    k.add_argument("--encoders", default="nearest,score", help=f"encodings each config is built with: "
                   f"{', '.join(ENCODERS)}")
    k.add_argument("--work", help="folder of the cartridges, kept to be scored again (default: OUT.work)")
    k.add_argument("--model", default="default")
    k.set_defaults(run=kenc_main)
    c = sub.add_parser("scale-cost", help="what a K scale (format 1.11) costs per decode step")
    c.add_argument("out", help="JSON results")
    c.add_argument("--contexts", default="4096,32768")
    c.add_argument("--tiers", default="mlx4g32+rot,int8")
    c.add_argument("--repeats", type=int, default=30)
    c.set_defaults(run=cost_main)
    args = ap.parse_args()
    unknown = [v for v in getattr(args, "variants", []) if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r} (choose from {', '.join(VARIANTS)})")
    args.run(args)


if __name__ == "__main__":
    main()
