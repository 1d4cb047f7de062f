"""Fidelity metrics on fixed tiny inputs, with values worked out by hand."""

import math

import pytest

from cartridge.eval.metrics import (
    BLEU_NAME,
    compare_answers,
    first_divergence,
    first_token_agrees,
    needle_found,
    perplexity,
    recall_by_depth,
    sentence_bleu,
)


@pytest.mark.parametrize("a, b, want", [
    ([5, 6, 7], [5, 6, 9, 1], 2),
    ([5, 6, 7], [5, 6, 7], 3),      # identical: the full length
    ([5, 6], [5, 6, 7, 8], 2),      # a prefix of the other: the shorter length
    ([1, 2], [9, 2], 0),
    ([], [1], 0),
])
def test_first_divergence(a, b, want):
    assert first_divergence(a, b) == want
    assert first_divergence(b, a) == want


def test_first_token_agreement():
    assert first_token_agrees([3, 1], [3, 2])
    assert not first_token_agrees([4, 1], [3, 1])
    assert not first_token_agrees([], [])


def test_sentence_bleu_exact_values():
    # 13a tokens: 4 each; n-gram precisions 3/4, 2/3, 1/2, 0/1 -> exp smoothing makes the last 1/2
    # (sacrebleu: 1 / 2^k for the k-th zero count); brevity penalty 1; BLEU = (3/4 * 2/3 * 1/2 * 1/2)^(1/4)
    assert sentence_bleu("a b c d", "a b c e") == pytest.approx(0.125 ** 0.25, abs=1e-12)
    # 6 tokens each, no zero count: precisions 5/6, 3/5, 2/4, 1/3; BLEU = (5/6 * 3/5 * 2/4 * 1/3)^(1/4)
    assert sentence_bleu("The cat sat on the mat", "The cat sat on a mat") == pytest.approx(
        (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, abs=1e-12)
    # brevity penalty: 3 of the reference's 6 tokens, all n-grams match -> BLEU = exp(1 - 6/3)
    assert sentence_bleu("The cat sat", "The cat sat on a mat") == pytest.approx(math.exp(1 - 6 / 3), abs=1e-12)
    assert sentence_bleu("x", "y") == 0.0
    assert sentence_bleu("", "an answer") == 0.0
    assert sentence_bleu("Yes.", "Yes.") == 1.0
    assert sentence_bleu("", "") == 1.0  # identical texts, also when both are empty
    assert sentence_bleu("a b c d", "A B C D") < 1.0  # case-sensitive


def test_bleu_is_named_with_its_settings():
    for part in ("sacrebleu", "nrefs:1", "case:mixed", "eff:yes", "tok:13a", "smooth:exp", "version:", "0-1"):
        assert part in BLEU_NAME, part


def test_perplexity_from_logprobs():
    assert perplexity([math.log(0.5), math.log(0.25)]) == pytest.approx(math.sqrt(8), rel=1e-15)
    assert perplexity([0.0, 0.0, 0.0]) == 1.0
    assert perplexity([-2.0]) == pytest.approx(math.e ** 2, rel=1e-15)
    with pytest.raises(ValueError):
        perplexity([])


@pytest.mark.parametrize("answer, expected, want", [
    ("It was signed on 14 March 1998.", "14 March 1998", True),
    ("It was signed on 14  March\n1998", "14 March 1998", True),   # whitespace runs count as one space
    ("It was signed on 14 march 1998.", "14 March 1998", False),   # case matters
    ("The year 19984.", "1998", False),                           # no match inside a longer number
    ("Port 18443", "8443", False),
    ("It cost 3,417 euros.", "3,417", True),
    ("It cost 3417 euros.", "3,417", False),                      # digits exactly as planted
    ("Tag v4.18.2, released", "v4.18.2", True),
    ("LX-40917", "LX-40917", True),
    ("anything", "", False),
])
def test_needle_exact_match(answer, expected, want):
    assert needle_found(answer, expected) is want


def test_compare_answers_counts_and_means():
    ref = [{"tokens": [1, 2, 3], "text": "a b c d"}, {"tokens": [4, 5], "text": "Yes."},
           {"tokens": [7, 8, 9, 2], "text": "x"}]
    got = [{"tokens": [1, 2, 9], "text": "a b c e"}, {"tokens": [4, 5], "text": "Yes."},
           {"tokens": [6, 8, 9, 2], "text": "y"}]
    c = compare_answers(got, ref)
    assert (c["n"], c["first_token"], c["exact"]) == (3, 2, 1)
    assert c["first_token_fraction"] == pytest.approx(2 / 3)
    assert c["exact_fraction"] == pytest.approx(1 / 3)
    assert c["divergence"] == pytest.approx((2 + 2 + 0) / 3)
    assert c["bleu"] == pytest.approx((0.125 ** 0.25 + 1.0 + 0.0) / 3, abs=1e-12)
    assert [q["exact"] for q in c["per_question"]] == [False, True, False]
    assert compare_answers(ref, ref)["bleu"] == 1.0
    with pytest.raises(ValueError):
        compare_answers(got[:2], ref)


def test_recall_by_depth():
    r = recall_by_depth([True, False, True, True], [0.5, 0.1, 0.1, 0.9])
    assert (r["found"], r["n"], r["recall"]) == (3, 4, 0.75)
    assert list(r["by_depth"]) == ["0.1", "0.5", "0.9"]
    assert r["by_depth"]["0.1"] == {"found": 1, "n": 2, "recall": 0.5}
    assert r["by_depth"]["0.9"] == {"found": 1, "n": 1, "recall": 1.0}
