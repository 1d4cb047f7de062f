"""`cartridge eval A B ...`: documents composed from separately built cartridges (`cartridge.compose`),
against a fresh prefill of the same text.

    reference   mlx-lm on the whole prompt: chat template around  A + separator + B + ... , question
                (or, with reference="recompute-all", the cartridges composed with every later token
                recomputed: the same K/V up to rounding, tests/compose/test_compose_blend.py, one prefill of B)
    recompute N the fp16 cartridges of A, B, ... built one by one, composed with N recomputed tokens
    + ratio R   and CacheBlend's selective recompute of R of each later document's tokens (`compose`)

The reference's text is what a one-shot build of the joined documents would prefill; with it, the
composed layout's token ids are the same (checked: "layout_tokens_match"). Documents after the first
are laid out without their leading whitespace: a later cartridge must open with the chat template's
header, and whitespace at its start would merge with the header's last token.

Each question names the document that answers it ("source": "a", "b", ... or "both"); answers are
compared with the reference's per class ("one": one document, "both"). Needles (`dataset.plant_needles`)
are planted in one document (default the last), whose cartridge is built again with them. TTFT is
the time from making a question's cache to its first token; the composed ask is timed against asking
the first document's cartridge alone, measured question by question in the same loop.
"""

import statistics
import time
from dataclasses import dataclass

import mlx_lm

from ..compose.blend import DEFAULT_SELECT_LAYER, DEFAULT_SELECTION, check_ratio
from ..write.options import context_length
from ..compose.composed import compose
from ..errors import InputError
from ..read.load import load
from ..models.loader import LoadedModel, load_model
from ..models.prompt import SEPARATOR, check_text, full_prompt_tokens, prefix_tokens, prompt_mode, question_tokens
from .dataset import plant_needles
from .evaluate import needle_result, report_head
from .metrics import compare_answers
from .spec import REFERENCE, build_or_reuse, cache_key, cartridge_path, default_work_dir

LETTERS = "abcdefghijklmnopqrstuvwxyz"
BOTH = "both"
CLASSES = ("one", "both")  # a question answered by one document / by several
REFERENCES = ("fresh", "recompute-all")


@dataclass
class ComposeConfig:
    """Options of one multi-document evaluation.

    Attributes:
        recompute (tuple[int, ...]): the settings: tokens of each later document prefilled again.
            Default: (0, 16, 64).
        ratios (tuple[float, ...]): CacheBlend recompute ratios (`compose(recompute_ratio=)`), each run with every
            `recompute` setting. Default: (0.0,) (the boundary only).
        max_tokens (int): greedy tokens per answer. Default: 50.
        needles_in (str | None): letter of the document the needles are planted in; None is the last.
        work_dir (str | None): cartridge cache folder; None is `spec.default_work_dir()`. Default: None.
        rebuild (bool): rebuild cartridges even if cached. Default: False.
        page_size (int): tokens per page. Default: 256.
        reference (str): "fresh" (mlx-lm prefills the whole prompt for every question) or "recompute-all"
            (`compose` with recompute_ratio 1: the later documents prefilled once after the first).
            Default: "fresh".
    """

    recompute: tuple = (0, 16, 64)
    ratios: tuple = (0.0,)
    max_tokens: int = 50
    needles_in: str | None = None
    work_dir: str | None = None
    rebuild: bool = False
    page_size: int = 256
    reference: str = "fresh"


def sources(n_documents):
    """The "source" values a question about `n_documents` documents may name: ("a", "b", ..., "both")."""
    return tuple(LETTERS[:n_documents]) + (BOTH,)


def layout(documents):
    """The documents as laid out: the first as given, later ones without leading whitespace.

    Raises:
        InputError: fewer than two documents, more than 26, or an empty one.
    """
    if not 2 <= len(documents) <= len(LETTERS):
        raise InputError(f"{len(documents)} document(s): composing needs 2 to {len(LETTERS)}")
    for letter, doc in zip(LETTERS, documents):
        check_text(doc, f"document {letter}")
    return [documents[0]] + [d.lstrip() for d in documents[1:]]


def joined(docs, separator=SEPARATOR):
    """The reference text: the laid-out documents, each without trailing whitespace, joined by `separator`."""
    return separator.join(d.rstrip() for d in docs)


def timed_greedy(model, tokenizer, prompt, max_tokens, make_cache=None):
    """Greedy answer as mlx-lm generates it, timed.

    Args:
        prompt (list[int]): tokens fed after what the cache holds. make_cache (callable | None): returns
            a fresh prompt cache (None: mlx-lm's own, the whole prompt prefilled).

    Returns:
        dict: {"tokens": list[int] (EOS included when it ended the answer), "text": str, "ttft_s":
        float, seconds from making the cache to the first token}.
    """
    t0 = time.perf_counter()
    cache = make_cache() if make_cache else None
    tokens, text, ttft = [], [], None
    for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache):
        ttft = time.perf_counter() - t0 if ttft is None else ttft
        tokens.append(int(r.token))
        text.append(r.text)
    return {"tokens": tokens, "text": "".join(text), "ttft_s": ttft}


def by_class(answers, references, questions):
    """`metrics.compare_answers` over all questions and per class ("one", "both"; a class without
    questions is None)."""
    out = {"all": compare_answers(answers, references)}
    for cls in CLASSES:
        idx = [i for i, q in enumerate(questions) if (q["source"] == BOTH) == (cls == BOTH)]
        out[cls] = compare_answers([answers[i] for i in idx], [references[i] for i in idx]) if idx else None
    return out


class _Run:
    """State of one evaluation: model, laid-out documents, questions, needles, config, progress."""

    def __init__(self, lm, docs, questions, needles, config, progress):
        self.lm, self.docs, self.questions, self.needles, self.config = lm, docs, questions, needles, config
        self.letters = LETTERS[: len(docs)]
        at = config.needles_in or self.letters[-1]
        if at not in self.letters:
            raise InputError(f"needles_in is {at!r}; the documents are {', '.join(self.letters)}")
        self.needle_index = self.letters.index(at)
        self.needle_docs = list(docs)
        if needles:
            self.needle_docs[self.needle_index] = plant_needles(docs[self.needle_index], needles)
        self.work_dir = config.work_dir or default_work_dir()
        self.progress, self.done, self.total = progress, 0, 0

    def step(self, what, n=1):
        self.done += n
        if self.progress:
            self.progress(self.done, self.total, what)

    def check_room(self):
        """Refuse documents + the longest question + the answer that exceed the model's context."""
        limit, tok = context_length(self.lm.model), self.lm.tokenizer
        if not limit:
            return
        rows = self.questions + self.needles
        longest = max(len(question_tokens(tok, r["question"], prompt_mode(tok))) for r in rows)
        for docs in (self.docs, self.needle_docs) if self.needles else (self.docs,):
            need = len(prefix_tokens(tok, joined(docs))) + longest + self.config.max_tokens
            if need > limit:
                raise InputError(f"the joined documents + question + answer are {need:,} tokens; the model's "
                                 f"context is {limit:,}")

    def cartridge(self, letter, doc, what):
        """Build (or reuse) the fp16 cartridge of one document: (Cartridge, {"path", "built"})."""
        key = cache_key(doc, self.lm.fingerprint["id"], REFERENCE, self.config.page_size)
        path = cartridge_path(self.work_dir, f"compose-{letter}", REFERENCE, key)
        path, built = build_or_reuse(doc, REFERENCE, self.lm, path, self.config.page_size, self.config.rebuild)
        self.step(f"{what} {letter} {'built' if built else 'reused'}")
        return load(path, model=self.lm, verify="pages"), {"path": str(path), "built": built}

    def cartridges(self):
        """[(Cartridge, meta)] of the documents, and the same list with the needle document planted."""
        built = [self.cartridge(letter, doc, "cartridge") for letter, doc in zip(self.letters, self.docs)]
        planted = list(built)
        if self.needles:
            i = self.needle_index
            planted[i] = self.cartridge(self.letters[i], self.needle_docs[i], "needle cartridge")
        return built, planted

    def ask(self, rows, prompt_for, make_cache, what, max_tokens=None):
        out = []
        for row in rows:
            out.append(timed_greedy(self.lm.model, self.lm.tokenizer, prompt_for(row["question"]),
                                    max_tokens or self.config.max_tokens, make_cache))
            self.step(what)
        return out

    def reference(self, docs, rows, what):
        """Fresh-prefill answers: mlx-lm on the whole prompt of the joined text, one per row."""
        text, tok = joined(docs), self.lm.tokenizer
        return self.ask(rows, lambda q: full_prompt_tokens(tok, text, q), None, what)

    def recompute_all(self, carts, rows, what):
        """Reference answers over the cartridges composed with every later token recomputed."""
        t0 = time.perf_counter()
        comp = compose(carts, recompute=0, recompute_ratio=1.0)
        seconds = time.perf_counter() - t0
        return self.ask(rows, comp.question_prompt, comp.prompt_cache, what), seconds

    def setting(self, n, ratio, carts, needle_carts, reference):
        """Compose with `n` recomputed tokens and recompute ratio `ratio`; measure answers, single-cartridge TTFT, needles."""
        t0 = time.perf_counter()
        comp = compose(carts, recompute=n, recompute_ratio=ratio)
        row = {"recompute": n, "recompute_ratio": ratio, "compose_seconds": time.perf_counter() - t0,
               **recomputed(comp), "answers": [], "single_ttft_s": []}
        n = f"{n}, ratio {ratio:g}" if ratio else n  # for the progress lines
        single = carts[0]
        self._warm(comp, single)
        for q in self.questions:  # one cartridge and the composed context, question by question
            one = self.ask([q], single.question_prompt, single.prompt_cache, f"recompute {n}: one cartridge", 1)
            row["single_ttft_s"].append(one[0]["ttft_s"])
            row["answers"] += self.ask([q], comp.question_prompt, comp.prompt_cache, f"recompute {n}: questions")
        row["vs_reference"] = by_class(row["answers"], reference["answers"], self.questions)
        row["ttft"] = _ttft(row["answers"], row["single_ttft_s"])
        if self.needles:
            nc = compose(needle_carts, recompute=row["recompute"], recompute_ratio=ratio)
            row["needles"] = needle_result(self.ask(self.needles, nc.question_prompt, nc.prompt_cache,
                                                    f"recompute {n}: needles"), self.needles)
        return row

    def _warm(self, comp, single):
        """One untimed question on each path first (allocations, first-call work)."""
        q = self.questions[0]["question"]
        for c in (single, comp):
            timed_greedy(self.lm.model, self.lm.tokenizer, c.question_prompt(q), 1, c.prompt_cache)


def recomputed(comp):
    """What a composition recomputed of its later documents: {"recomputed": {"tokens", "of", "fraction",
    "selected"}, "select_seconds", "recompute_seconds"} (separator and boundary counted in, `compose.blended`)."""
    done = sum(b["fresh"] + b["selected"] for b in comp.blended)
    of = sum(b["fresh"] + b["read"] for b in comp.blended)
    return {"recomputed": {"tokens": done, "of": of, "fraction": done / of,
                           "selected": sum(b["selected"] for b in comp.blended)},
            "select_seconds": sum(b["select_s"] for b in comp.blended),
            "recompute_seconds": sum(b["recompute_s"] for b in comp.blended)}


def _ttft(answers, single):
    """Median TTFTs of the composed answers and of the single cartridge, their ratio, and the median of
    the per-question ratios (each pair timed back to back: less moved by a machine's changing load)."""
    comp, one = statistics.median(a["ttft_s"] for a in answers), statistics.median(single)
    paired = statistics.median(a["ttft_s"] / s for a, s in zip(answers, single))
    return {"median_s": comp, "single_median_s": one, "ratio": comp / one, "paired_ratio": paired}


def _check(questions, config, n_documents):
    if not questions:
        raise InputError("no questions to ask")
    if config.reference not in REFERENCES:
        raise InputError(f"reference is {config.reference!r}; it must be one of {', '.join(REFERENCES)}")
    if config.max_tokens < 1:
        raise InputError(f"max_tokens is {config.max_tokens}; it must be at least 1")
    allowed = sources(n_documents)
    for q in questions:
        if q.get("source") not in allowed:
            raise InputError(f"question {q['id']!r}: source {q.get('source')!r} is not one of {', '.join(allowed)}")
    bad = [n for n in config.recompute if isinstance(n, bool) or not isinstance(n, int) or n < 0]
    if not config.recompute or bad:
        raise InputError(f"recompute settings {list(config.recompute)!r}: give whole numbers of tokens >= 0")
    if not config.ratios:
        raise InputError("no recompute ratio to run: give at least one (0 is the boundary only)")
    for r in config.ratios:
        check_ratio(r, "recompute ratio")


def evaluate_composed(documents, questions, model=None, needles=(), config=None, progress=None):
    """Answers over several composed cartridges against a fresh prefill of the joined documents.

    Args:
        documents (list[str]): 2-26 texts, in order ("a", "b", ...).
        questions (list[dict]): from `dataset.load_questions(path, sources(len(documents)))`.
        model (str | LoadedModel | None): model reference or loaded model. Default: None ("default").
        needles (list[dict]): from `dataset.load_needles`; empty skips needle recall. Default: ().
        config (ComposeConfig | None): options. Default: ComposeConfig().
        progress (callable | None): progress(done_steps, total_steps, what) after each step.

    Returns:
        dict: JSON-able report: "reference" (fresh-prefill answers and needles), "rows" (one per
        (ratio, recompute) setting: answers, "recomputed" (`recomputed`), "select_seconds", "recompute_seconds",
        "vs_reference" = {"all", "one", "both"} `metrics.compare_answers`,
        "ttft" {median_s, single_median_s, ratio}, "needles", "compose_seconds"), the documents'
        token counts, "layout_tokens_match", settings, BLEU implementation, machine and load.

    Raises:
        InputError: fewer than two documents, a bad question source or recompute setting, text too long.

    Example:
        >>> from cartridge.eval.dataset import load_questions
        >>> docs = [open("samples/lgpl-3.0.part1.txt").read(), open("samples/lgpl-3.0.part2.txt").read()]
        >>> qs = load_questions("samples/lgpl-3.0.compose.questions.jsonl", sources(2))
        >>> r = evaluate_composed(docs, qs)  # doctest: +SKIP
        >>> r["rows"][0]["vs_reference"]["one"]["first_token"]  # doctest: +SKIP
    """
    config = config or ComposeConfig()
    docs = layout(list(documents))
    questions, needles = list(questions), list(needles)
    _check(questions, config, len(docs))
    lm = model if isinstance(model, LoadedModel) else load_model(model)
    run = _Run(lm, docs, questions, needles, config, progress)
    run.check_room()
    n_q, n_n, n_s = len(questions), len(needles), len(config.recompute) * len(config.ratios)
    run.total = len(docs) + bool(needles) + n_q + n_n + n_s * (2 * n_q + n_n)
    t0 = time.perf_counter()
    built, needle_built = run.cartridges()
    carts, needle_carts = [c for c, _ in built], [c for c, _ in needle_built]
    reference = _reference(run, carts, needle_carts)
    rows = [run.setting(n, r, carts, needle_carts, reference) for r in config.ratios for n in config.recompute]
    report = _report(run, built, reference, rows, time.perf_counter() - t0)
    if needles:
        report["documents"][run.needle_index]["needle_cartridge"] = needle_built[run.needle_index][1]
    return report


def _reference(run, carts, needle_carts):
    """The reference's answers (and needles): a fresh prefill per question, or the recompute-all composition."""
    if run.config.reference == "fresh":
        reference = {"kind": "fresh", "answers": run.reference(run.docs, run.questions, "fresh prefill: questions")}
        if run.needles:
            reference["needles"] = needle_result(run.reference(run.needle_docs, run.needles, "fresh prefill: needles"),
                                                 run.needles)
    else:
        answers, seconds = run.recompute_all(carts, run.questions, "recompute all: questions")
        reference = {"kind": "recompute-all", "answers": answers, "compose_seconds": seconds}
        if run.needles:
            reference["needles"] = needle_result(run.recompute_all(needle_carts, run.needles,
                                                                   "recompute all: needles")[0], run.needles)
    reference["ttft_median_s"] = statistics.median(a["ttft_s"] for a in reference["answers"])
    return reference


def _report(run, built, reference, rows, seconds):
    tok, cfg = run.lm.tokenizer, run.config
    comp_tokens = compose([c for c, _ in built], recompute=0, recompute_ratio=0).tokens
    return {
        "mode": "composed",
        **report_head(run.lm, seconds),
        "settings": {"max_tokens": cfg.max_tokens, "decoding": "greedy (argmax), mlx_lm.stream_generate",
                     "page_size": cfg.page_size, "tier": "fp16", "recompute": list(cfg.recompute),
                     "recompute_ratio": list(cfg.ratios), "select_layer": DEFAULT_SELECT_LAYER,
                     "selection": DEFAULT_SELECTION,
                     "separator": SEPARATOR, "needles_in": run.letters[run.needle_index] if run.needles else None},
        "documents": [{"letter": letter, "prefix_tokens": len(c.tokens), "cartridge": meta}
                      for letter, (c, meta) in zip(run.letters, built)],
        "composed_tokens": len(comp_tokens),
        "layout_tokens_match": comp_tokens == prefix_tokens(tok, joined(run.docs)),
        "single": {"letter": run.letters[0], "attention": built[0][0].attention},
        "questions": run.questions,
        "needles": run.needles,
        "reference": reference,
        "rows": rows,
    }
