"""Seeded fuzz of every parser of hostile input (see tests/helpers/fuzz_parsers.py): no crash, no hang, no
exception other than CartridgeError. CI runs 200 inputs per target; `--fuzz-iterations 2000` is the
10,000-input run."""

import pytest
from helpers.fuzz_parsers import TARGETS, Corpus, run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return Corpus(tmp_path_factory.mktemp("fuzz"))


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fuzz_parser(corpus, target, request):
    n = request.config.getoption("--fuzz-iterations")
    stats = run(target, n, seed=0, corpus=corpus)
    assert stats.inputs == n
    assert stats.refused > 0  # the mutations do reach the checks
