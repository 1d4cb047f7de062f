"""`cartridge eval`: does a compressed cartridge answer like the fp16 one?

For the fp16 reference and each spec (`cartridge.eval.spec`), two cartridges are built (or reused):

    qa     the corpus as given              -> greedy answers to the questions
    probe  the corpus head + planted needles -> needle answers, held-out perplexity

The held-out text is `--heldout` if given (then the probe holds the whole corpus), else the corpus
tail cut off at a paragraph break (`dataset.split_heldout`). It is scored as a continuation of the
document after a blank line, teacher-forced through the probe cartridge: every held-out token but the
first is scored (the cartridge stores K/V, not the prefix's last logits). A "fresh prefill" row runs
the same three measurements with no cartridge: mlx-lm on the full prompt, and a dense float32
KVCache prefill for perplexity. Every answer is compared with the fp16 cartridge's (`metrics`).
"""

import json
import os
import platform
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx_lm

from .. import __version__
from ..write.options import context_length
from ..write.prefill import prefill
from ..errors import InputError
from ..format.keys import CALIBRATION
from ..read.load import load
from ..models.loader import LoadedModel, load_model
from ..models.prompt import SEPARATOR, full_prompt_tokens, prefix_tokens
from .dataset import plant_needles, split_heldout
from .metrics import BLEU_NAME, compare_answers, compare_needles, needle_found, perplexity, recall_by_depth
from .spec import REFERENCE, build_or_reuse, cache_key, cartridge_path, check_supported, default_work_dir

FRESH = "fresh prefill"
SCORE_STEP = 256  # held-out tokens per teacher-forced forward pass


@dataclass
class EvalConfig:
    """Options of one evaluation.

    Attributes:
        max_tokens (int): greedy tokens per answer (questions and needles). Default: 50.
        fresh (bool): also run the no-cartridge "fresh prefill" row. Default: True.
        heldout (str | None): held-out text; None cuts the corpus tail. Default: None.
        heldout_fraction (float): share of the corpus's characters cut off when `heldout` is None. Default: 0.15.
        work_dir (str | None): cartridge cache folder; None is `spec.default_work_dir()`. Default: None.
        rebuild (bool): rebuild cartridges even if cached. Default: False.
        page_size (int): tokens per page. Default: 256.
    """

    max_tokens: int = 50
    fresh: bool = True
    heldout: str | None = None
    heldout_fraction: float = 0.15
    work_dir: str | None = None
    rebuild: bool = False
    page_size: int = 256


def greedy(model, tokenizer, prompt, max_tokens, cache=None):
    """Greedy answer as mlx-lm generates it.

    Returns:
        dict: {"tokens": list[int] (EOS included when it ended the answer), "text": str}.
    """
    tokens, text = [], []
    for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache):
        tokens.append(int(r.token))
        text.append(r.text)
    return {"tokens": tokens, "text": "".join(text)}


def teacher_forced_logprobs(model, cache, tokens, step=SCORE_STEP):
    """Feed `tokens` after what `cache` holds; natural-log probability of each token given all before it.

    Args:
        model (nn.Module): mlx-lm model. cache (list): its filled caches (cartridge or KVCache).
        tokens (list[int]): the continuation, n >= 2 tokens.
        step (int): tokens per forward pass. Default: 256.

    Returns:
        list[float]: n - 1 values, log p(tokens[i] | prefix, tokens[:i]) for i = 1..n-1.
    """
    out = []
    for start in range(0, len(tokens) - 1, step):
        chunk = tokens[start:start + step]
        logits = model(mx.array(chunk, dtype=mx.uint32)[None], cache=cache)[0].astype(mx.float32)  # (L, vocab)
        nxt = tokens[start + 1:start + 1 + len(chunk)]
        logp = logits[: len(nxt)] - mx.logsumexp(logits[: len(nxt)], axis=-1, keepdims=True)
        out.extend(mx.take_along_axis(logp, mx.array(nxt)[:, None], axis=-1)[:, 0].tolist())
    return out


def needle_result(answers, needles):
    """Needle recall of greedy answers (`metrics.recall_by_depth`) plus each answer and whether it was found.

    Args:
        answers (list[dict]): {"text", ...} per needle, in the order of `needles` (from `load_needles`).
    """
    found = [needle_found(a["text"], n["answer"]) for a, n in zip(answers, needles)]
    result = recall_by_depth(found, [n["depth"] for n in needles])
    result["answers"] = [{"id": n["id"], "text": a["text"], "found": f} for n, a, f in zip(needles, answers, found)]
    return result


class _Run:
    """State of one evaluation: model, documents, config, progress."""

    def __init__(self, lm, corpus, questions, needles, config, progress):
        self.lm, self.questions, self.needles, self.config = lm, questions, needles, config
        self.qa_doc = corpus
        if config.heldout:
            head, heldout, self.heldout_source = corpus, config.heldout, "--heldout text"
        else:
            head, heldout = split_heldout(corpus, config.heldout_fraction)
            self.heldout_source = f"corpus tail (about {config.heldout_fraction:g} of its characters, cut at a break)"
        self.probe_doc = plant_needles(head, needles) if needles else head
        tok = lm.tokenizer
        self.heldout_tokens = list(tok.encode(SEPARATOR + heldout.strip(), add_special_tokens=False))
        self.probe_prefix = prefix_tokens(tok, self.probe_doc)
        self._check_lengths()
        self.work_dir = config.work_dir or default_work_dir()
        self.progress, self.done, self.total = progress, 0, 0

    def _check_lengths(self):
        if len(self.heldout_tokens) < 2:
            raise InputError(f"the held-out text is {len(self.heldout_tokens)} token(s); at least 2 are needed")
        limit = context_length(self.lm.model)
        need = len(self.probe_prefix) + len(self.heldout_tokens)
        if limit and need > limit:
            raise InputError(f"probe document + held-out text is {need} tokens; the model's context is {limit}")

    def step(self, what, n=1):
        self.done += n
        if self.progress:
            self.progress(self.done, self.total, what)

    def answers(self, prompt_and_cache, rows, what):
        out = []
        for row in rows:
            prompt, cache = prompt_and_cache(row["question"])
            out.append(greedy(self.lm.model, self.lm.tokenizer, prompt, self.config.max_tokens, cache))
            self.step(what)
        return out

    def needle_result(self, answers):
        return needle_result(answers, self.needles)

    def cartridge_row(self, spec):
        """Build or reuse the qa and probe cartridges of `spec` and measure them."""
        row = {"label": spec.label, "kind": "cartridge", "options": spec.options}
        t0 = time.perf_counter()
        carts = {}
        for role, doc in (("qa", self.qa_doc), ("probe", self.probe_doc)):
            if role == "probe" and doc == self.qa_doc:  # --heldout and no needles: one cartridge serves both
                carts[role], row[f"{role}_cartridge"] = carts["qa"], row["qa_cartridge"]
                self.step(f"{spec.label}: {role} cartridge is the qa one")
                continue
            self.step(f"{spec.label}: {role} cartridge", 0)
            key = cache_key(doc, self.lm.fingerprint["id"], spec, self.config.page_size)
            path, built = build_or_reuse(doc, spec, self.lm, cartridge_path(self.work_dir, role, spec, key),
                                         self.config.page_size, self.config.rebuild)
            carts[role] = load(path, model=self.lm, verify="pages")
            row[f"{role}_cartridge"] = {"path": str(path), "built": built}
            self.step(f"{spec.label}: {role} cartridge {'built' if built else 'reused'}")
        info = carts["qa"].info
        row.update(bytes_per_token=info.bytes_per_token(), fp16_bytes_per_token=info.fp16_bytes_per_token(),
                   per_token_split=info.per_token_split(),
                   bytes_on_disk=sum(f.stat().st_size for f in carts["qa"].path.iterdir() if f.is_file()))
        row["compression"] = row["fp16_bytes_per_token"] / row["bytes_per_token"]
        calibration = info.records.get(CALIBRATION)  # format 1.8: the KL measured when the tiers were chosen
        row["build_kl"] = None if calibration is None else json.loads(calibration)["measured_kl"]
        self._measure(row, spec.label, lambda role, q: (carts[role].question_prompt(q), carts[role].prompt_cache()),
                      lambda: carts["probe"].prompt_cache())
        row["seconds"] = time.perf_counter() - t0
        return row

    def fresh_row(self):
        """The same measurements with no cartridge: full-prompt prefill per question."""
        tok, t0 = self.lm.tokenizer, time.perf_counter()
        row = {"label": FRESH, "kind": "fresh", "options": {}}
        docs = {"qa": self.qa_doc, "probe": self.probe_doc}

        def dense_cache():
            caches = prefill(self.lm.model, self.probe_prefix)
            # what mlx-lm's dense KVCache keeps: (1, n_kv_heads, T, head_dim) K and V per layer
            row["dense_cache_bytes_per_token"] = sum(2 * c.keys.shape[1] * c.keys.shape[3] * c.keys.dtype.size
                                                     for c in caches)
            return caches

        self._measure(row, FRESH, lambda role, q: (full_prompt_tokens(tok, docs[role], q), None), dense_cache)
        row["seconds"] = time.perf_counter() - t0
        return row

    def _measure(self, row, label, prompt_for, probe_cache):
        row["answers"] = self.answers(lambda q: prompt_for("qa", q), self.questions, f"{label}: questions")
        if self.needles:
            row["needles"] = self.needle_result(
                self.answers(lambda q: prompt_for("probe", q), self.needles, f"{label}: needles"))
        logprobs = teacher_forced_logprobs(self.lm.model, probe_cache(), self.heldout_tokens)
        row["perplexity"] = perplexity(logprobs)
        self.step(f"{label}: perplexity")


def _compare(rows, reference):
    ref = next(r for r in rows if r is reference)
    for row in rows:
        if row is ref:
            row["vs_fp16"] = None
            continue
        row["vs_fp16"] = compare_answers(row["answers"], ref["answers"])
        if ref.get("needles") and row.get("needles"):
            row["vs_fp16"]["needles"] = compare_needles(row["needles"], ref["needles"])
        row["perplexity_change"] = row["perplexity"] / ref["perplexity"] - 1


def machine():
    """A one-line description of where this runs: CPU model, cores, memory, MLX device and version."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else float("nan")
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.machine()}, " \
           f"MLX {mx.__version__} {mx.default_device()}"


def _specs_in_order(specs):
    """The reference first, then `specs` without any spec equal to it."""
    return [REFERENCE] + [s for s in specs if s.options != REFERENCE.options]


def evaluate(corpus, questions, model=None, specs=(), needles=(), config=None, progress=None):
    """Compare cartridges of `specs` against the fp16 cartridge (and a fresh prefill) on `questions`.

    Args:
        corpus (str): the document. questions (list[dict]): from `dataset.load_questions`.
        model (str | LoadedModel | None): model reference or loaded model. Default: None ("default").
        specs (list[Spec]): what to evaluate besides the fp16 reference. Default: ().
        needles (list[dict]): from `dataset.load_needles`; empty skips needle recall. Default: ().
        config (EvalConfig | None): options. Default: EvalConfig().
        progress (callable | None): progress(done_steps, total_steps, what) after each step.

    Returns:
        dict: JSON-able report: "rows" (one per spec, fp16 first, then the fresh prefill), each with
        answers, "vs_fp16" (`metrics.compare_answers`, None for fp16), "perplexity",
        "perplexity_change" (relative to fp16), "needles" (`metrics.recall_by_depth` + answers),
        bytes/token and compression; plus the settings, documents, BLEU implementation and machine.

    Raises:
        InputError: a question list that is empty, a spec this build cannot do, text too long.

    Example:
        >>> from cartridge.eval.dataset import load_questions, load_needles
        >>> from cartridge.eval.spec import parse_tiers
        >>> r = evaluate(open("samples/lgpl-3.0.txt").read(), load_questions("samples/lgpl-3.0.questions.jsonl"),
        ...              specs=parse_tiers("bf16"), needles=load_needles("samples/needles.jsonl"))  # doctest: +SKIP
        >>> r["rows"][1]["vs_fp16"]["exact"]  # fresh prefill answers identical to the fp16 cartridge's  # doctest: +SKIP
        20
    """
    config = config or EvalConfig()
    if not questions:
        raise InputError("no questions to ask")
    if config.max_tokens < 1:
        raise InputError(f"max_tokens is {config.max_tokens}; it must be at least 1")
    lm = model if isinstance(model, LoadedModel) else load_model(model)
    specs = _specs_in_order(list(specs))
    for spec in specs:
        check_supported(spec, len(lm.model.layers))
    run = _Run(lm, corpus, list(questions), list(needles), config, progress)
    per_row = len(run.questions) + len(run.needles) + 1
    run.total = len(specs) * (per_row + 2) + (per_row if config.fresh else 0)
    t0 = time.perf_counter()
    rows = [run.cartridge_row(specs[0])]
    if config.fresh:
        rows.append(run.fresh_row())
    rows += [run.cartridge_row(s) for s in specs[1:]]
    _compare(rows, rows[0])
    return _report(run, rows, time.perf_counter() - t0)


def report_head(lm, seconds):
    """The fields every eval report starts with: version, model, machine, load average, seconds, BLEU's name."""
    return {"cartridge_version": __version__, "model": {"ref": lm.ref, "fingerprint": lm.fingerprint["id"]},
            "machine": machine(), "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "seconds": seconds, "bleu": BLEU_NAME}


def _report(run, rows, seconds):
    tok, cfg = run.lm.tokenizer, run.config
    return {
        **report_head(run.lm, seconds),
        "settings": {"max_tokens": cfg.max_tokens, "decoding": "greedy (argmax), mlx_lm.stream_generate",
                     "page_size": cfg.page_size, "fresh": cfg.fresh, "heldout_source": run.heldout_source},
        "documents": {"qa_tokens": len(prefix_tokens(tok, run.qa_doc)), "probe_tokens": len(run.probe_prefix),
                      "heldout_tokens_scored": len(run.heldout_tokens) - 1, "needles": len(run.needles),
                      "questions": len(run.questions)},
        "questions": run.questions,
        "needles": run.needles,
        "rows": rows,
    }
