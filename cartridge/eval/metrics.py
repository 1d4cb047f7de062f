"""Fidelity metrics: how closely one greedy answer follows a reference answer, perplexity, needle recall.

Pure functions on token-id lists, strings and log-probabilities; no model here (`cartridge.eval.evaluate`
produces the inputs). Every answer is a list of token ids as `mlx_lm.stream_generate` yields them
(the end-of-sequence token included when generation stopped on it), plus its decoded text.
"""

import math
import re

from sacrebleu.metrics import BLEU

# sacrebleu's sentence-level BLEU (what sacrebleu.sentence_bleu computes): 13a tokenization, mixed
# case, exponential smoothing, effective n-gram order (short answers are not zeroed), one reference.
_BLEU = BLEU(effective_order=True)
_BLEU.sentence_score("a", ["a"])  # the signature needs one evaluation to know the number of references
BLEU_NAME = f"sacrebleu sentence BLEU ({_BLEU.get_signature()}), scaled to 0-1"


def first_divergence(answer, reference):
    """Number of leading tokens `answer` and `reference` share.

    Args:
        answer, reference (Sequence[int]): token ids.

    Returns:
        int: index of the first differing token; the shorter length when one is a prefix of the other
        (so identical answers give their full length).

    Example:
        >>> first_divergence([5, 6, 7], [5, 6, 9, 1])
        2
    """
    n = 0
    for a, b in zip(answer, reference):
        if a != b:
            break
        n += 1
    return n


def first_token_agrees(answer, reference):
    """True if both answers are non-empty and start with the same token."""
    return bool(answer) and bool(reference) and answer[0] == reference[0]


def sentence_bleu(answer, reference):
    """Sentence BLEU of the text `answer` against the single reference text `reference`, 0-1 scale.

    Args:
        answer, reference (str): decoded answers.

    Returns:
        float: sacrebleu's sentence BLEU (see `BLEU_NAME`) divided by 100. Identical texts score
        exactly 1.0 (sacrebleu scores an empty pair 0 and identical text 1.0 +- 1 ulp).
    """
    if answer == reference:
        return 1.0
    return min(1.0, _BLEU.sentence_score(answer, [reference]).score / 100.0)


def perplexity(logprobs):
    """exp(-mean(logprobs)): perplexity of the tokens whose natural-log probabilities are given.

    Args:
        logprobs (Sequence[float]): log p(token | context) of each scored token, natural log.

    Returns:
        float

    Raises:
        ValueError: if `logprobs` is empty.
    """
    logprobs = list(logprobs)
    if not logprobs:
        raise ValueError("perplexity of zero tokens is undefined")
    return math.exp(-math.fsum(logprobs) / len(logprobs))


def needle_found(answer, expected):
    """Exact-match needle recall: `expected` occurs verbatim in `answer`, as a whole token.

    Runs of whitespace count as one space on both sides; case, digits and punctuation must match
    exactly, and the match may not continue into a letter or digit ("1998" is not found in
    "19984", "3,417" is found in "cost 3,417 euros.").

    Args:
        answer (str): the generated answer. expected (str): the planted value, e.g. "14 March 1998".

    Returns:
        bool
    """
    answer, expected = " ".join(answer.split()), " ".join(expected.split())
    if not expected:
        return False
    return re.search(rf"(?<![0-9A-Za-z]){re.escape(expected)}(?![0-9A-Za-z])", answer) is not None


def compare_answers(answers, references):
    """Agreement of answers with the reference answers to the same questions.

    Args:
        answers, references (list[dict]): per question {"tokens": list[int], "text": str}, same order.

    Returns:
        dict: n, first_token (count), first_token_fraction, exact (count of identical token lists),
        exact_fraction, bleu (mean `sentence_bleu`), divergence (mean `first_divergence`), and
        per_question: [{"first_token", "exact", "bleu", "divergence"}].

    Raises:
        ValueError: if the lists differ in length or are empty.
    """
    if len(answers) != len(references) or not answers:
        raise ValueError(f"{len(answers)} answers against {len(references)} references")
    rows = [{
        "first_token": first_token_agrees(a["tokens"], r["tokens"]),
        "exact": list(a["tokens"]) == list(r["tokens"]),
        "bleu": sentence_bleu(a["text"], r["text"]),
        "divergence": first_divergence(a["tokens"], r["tokens"]),
    } for a, r in zip(answers, references)]
    n = len(rows)
    first = sum(r["first_token"] for r in rows)
    exact = sum(r["exact"] for r in rows)
    return {
        "n": n, "first_token": first, "first_token_fraction": first / n, "exact": exact,
        "exact_fraction": exact / n, "bleu": math.fsum(r["bleu"] for r in rows) / n,
        "divergence": sum(r["divergence"] for r in rows) / n, "per_question": rows,
    }


def recall_by_depth(found, depths):
    """Needle recall per planting depth.

    Args:
        found (list[bool]): whether each needle's answer matched. depths (list[float]): its depth.

    Returns:
        dict: {"found": int, "n": int, "recall": float, "by_depth": {depth: {"found", "n", "recall"}}},
        depths as strings (JSON keys) in increasing order.
    """
    by = {}
    for hit, depth in sorted(zip(found, depths), key=lambda x: x[1]):
        d = by.setdefault(f"{depth:g}", {"found": 0, "n": 0})
        d["found"] += int(hit)
        d["n"] += 1
    for d in by.values():
        d["recall"] = d["found"] / d["n"]
    total = sum(found)
    return {"found": total, "n": len(found), "recall": total / len(found) if found else float("nan"),
            "by_depth": by}


def compare_needles(result, reference):
    """Needle by needle, this row's recall against the reference's (the fp16 cartridge's).

    Args:
        result, reference (dict): `needle_result`s of the same needles, "answers" in the same order.

    Returns:
        dict: {"same": needles found or missed by both, "lost": found by the reference only, "gained": found
        by this row only, "n": needles}.
    """
    pairs = [(a["found"], r["found"]) for a, r in zip(result["answers"], reference["answers"])]
    return {"same": sum(a == r for a, r in pairs), "lost": sum(r and not a for a, r in pairs),
            "gained": sum(a and not r for a, r in pairs), "n": len(pairs)}
