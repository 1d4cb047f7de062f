"""`cartridge.eval.evaluate` on a tiny random-weight model: rows, exact self-agreement, and perplexity
checked against a plain forward pass over the whole text (no cache at all)."""

import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cartridge.errors import InputError
from cartridge.eval.dataset import split_heldout
from cartridge.eval.evaluate import FRESH, EvalConfig, evaluate, teacher_forced_logprobs
from cartridge.eval.spec import Spec, parse_entry
from cartridge.models.prompt import SEPARATOR, prefix_tokens

DOC = "".join(f"Clause {i}: the tenant pays {100 + i} euros on day {i}.\n\n" for i in range(1, 9))
QUESTIONS = [{"id": 1, "question": "What is paid on day 3?"}, {"id": 2, "question": "Which clause is last?"}]
NEEDLES = [{"id": "a", "depth": 0.2, "fact": "The gate code is 4471.", "question": "What is the gate code?",
            "answer": "4471"},
           {"id": "b", "depth": 0.8, "fact": "The boiler was installed on 3 May 2004.",
            "question": "When was the boiler installed?", "answer": "3 May 2004"}]


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory):
    fp16_again = Spec("fp16 again", {"schema": [{"layer": i, "k": "fp16", "v": "fp16"} for i in range(2)]})
    config = EvalConfig(max_tokens=6, work_dir=tmp_path_factory.mktemp("work"), page_size=16)
    steps = []
    r = evaluate(DOC, QUESTIONS, model=tiny, specs=[parse_entry("bf16"), parse_entry("fp16"), fp16_again],
                 needles=NEEDLES, config=config, progress=lambda d, t, w: steps.append((d, t)))
    r["_steps"] = steps
    return r


def test_rows_in_order_with_sizes(report):
    rows = {r["label"]: r for r in report["rows"]}
    assert [r["label"] for r in report["rows"]] == ["fp16", FRESH, "bf16", "fp16 again"]  # "fp16" listed once
    assert rows["fp16"]["vs_fp16"] is None and "perplexity_change" not in rows["fp16"]
    for label in ("fp16", "bf16", "fp16 again"):
        assert rows[label]["bytes_per_token"] == rows[label]["fp16_bytes_per_token"] == 2 * 2 * 32 * 2
        assert rows[label]["compression"] == 1.0
    assert rows[FRESH]["dense_cache_bytes_per_token"] == 2 * 2 * 32 * 4  # float32 K and V, 2 layers
    assert report["documents"]["questions"] == 2 and report["documents"]["needles"] == 2
    assert report["_steps"][-1][0] == report["_steps"][-1][1] == 4 * (2 + 2 + 1 + 2) - 2  # no builds for fresh


def test_same_fp16_cartridge_built_twice_agrees_exactly(report):
    rows = {r["label"]: r for r in report["rows"]}
    ref, again = rows["fp16"], rows["fp16 again"]
    assert again["qa_cartridge"]["path"] != ref["qa_cartridge"]["path"]
    cmp = again["vs_fp16"]
    assert (cmp["n"], cmp["first_token"], cmp["exact"], cmp["bleu"]) == (2, 2, 2, 1.0)
    assert cmp["divergence"] == sum(len(a["tokens"]) for a in ref["answers"]) / 2
    assert again["perplexity_change"] == 0.0
    assert again["needles"]["answers"] == ref["needles"]["answers"]
    assert all(1 <= len(a["tokens"]) <= 6 for a in ref["answers"])


def test_perplexity_matches_a_plain_forward_pass(report, tiny):
    head, tail = split_heldout(DOC, 0.15)
    tok = tiny.tokenizer
    cont = list(tok.encode(SEPARATOR + tail.strip(), add_special_tokens=False))
    assert report["documents"]["heldout_tokens_scored"] == len(cont) - 1
    # the probe document holds the needles; rebuild its prefix the way evaluate does
    from cartridge.eval.dataset import plant_needles
    prefix = prefix_tokens(tok, plant_needles(head, NEEDLES))
    assert report["documents"]["probe_tokens"] == len(prefix)
    logits = tiny.model(mx.array(prefix + cont)[None])[0].astype(mx.float32)  # (T, vocab), no cache
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    scored = [logp[len(prefix) + i - 1, cont[i]].item() for i in range(1, len(cont))]
    want = math.exp(-sum(scored) / len(scored))
    rows = {r["label"]: r for r in report["rows"]}
    assert rows[FRESH]["perplexity"] == pytest.approx(want, rel=1e-4)
    assert rows["fp16"]["perplexity"] == pytest.approx(want, rel=1e-2)


def test_teacher_forcing_in_chunks_equals_one_pass(tiny):
    ids = prefix_tokens(tiny.tokenizer, DOC)
    cont = list(range(1000, 1011))
    got = []
    for step in (256, 3):
        cache = make_prompt_cache(tiny.model)
        tiny.model(mx.array(ids)[None], cache=cache)
        got.append(teacher_forced_logprobs(tiny.model, cache, cont, step=step))
    assert len(got[0]) == len(cont) - 1
    assert got[1] == pytest.approx(got[0], abs=1e-4)


def test_refuses_bad_requests(tiny, tmp_path):
    with pytest.raises(InputError, match="no questions"):
        evaluate(DOC, [], model=tiny)
    with pytest.raises(InputError, match="max_tokens is 0"):
        evaluate(DOC, QUESTIONS, model=tiny, config=EvalConfig(max_tokens=0))
    with pytest.raises(InputError, match="held-out text is 1 token"):
        evaluate(DOC, QUESTIONS, model=tiny, config=EvalConfig(heldout=" ", work_dir=tmp_path))  # just "\n\n"
    with pytest.raises(InputError, match="the model's context is 512"):
        evaluate(DOC, QUESTIONS, model=tiny, config=EvalConfig(heldout=DOC * 8, work_dir=tmp_path))
    assert list(tmp_path.iterdir()) == []  # refused before building anything


def test_heldout_text_without_needles_uses_one_cartridge_per_spec(tiny, tmp_path):
    r = evaluate(DOC, QUESTIONS[:1], model=tiny, specs=[parse_entry("bf16")],
                 config=EvalConfig(max_tokens=2, fresh=False, heldout="The rent rises by 3 euros.",
                                   work_dir=tmp_path, page_size=16))
    for row in r["rows"]:
        assert row["probe_cartridge"] == row["qa_cartridge"]
    assert len(list(tmp_path.iterdir())) == 2  # fp16 and bf16, one each
    assert r["settings"]["heldout_source"] == "--heldout text"
    assert r["documents"]["probe_tokens"] == r["documents"]["qa_tokens"]
