"""`cartridge eval A B`: composed cartridges against a fresh prefill of the joined documents, on the
tiny model (mechanics: layout, classes, recompute-all = the reference, needles, TTFT, table, errors)."""

import json
import re

import pytest
from helpers.clirun import run_inprocess as run

from cartridge.cli.eval_composed import parse_ratios, setting_label
from cartridge.errors import InputError
from cartridge.eval.composed import ComposeConfig, evaluate_composed, joined, layout, sources
from cartridge.eval.dataset import load_questions
from cartridge.models.prompt import SEPARATOR, encode_text, prompt_pieces, prompt_mode

DOC_A = "".join(f"Clause {i}: the tenant pays {100 + i} euros on day {i}.\n\n" for i in range(1, 5))
DOC_B = "  Annex. " + "".join(f"Item {i} is kept in room {20 + i}.\n\n" for i in range(1, 4))
QUESTIONS = [{"id": "a1", "question": "What is paid on day 3?", "source": "a"},
             {"id": "b1", "question": "Where is item 2 kept?", "source": "b"},
             {"id": "ab", "question": "What is paid on day 2, and where is item 1?", "source": "both"}]
NEEDLES = [{"id": "n", "depth": 0.5, "fact": "The gate code is 4471.", "question": "What is the gate code?",
            "answer": "4471"}]


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory):
    config = ComposeConfig(recompute=(0, 10_000), max_tokens=3, page_size=16,
                           work_dir=tmp_path_factory.mktemp("composed-work"))
    return evaluate_composed([DOC_A, DOC_B], QUESTIONS, model=tiny, needles=NEEDLES, config=config)


def test_layout_strips_leading_whitespace_of_later_documents():
    assert layout([" x", "  y \n"]) == [" x", "y \n"]
    assert joined(["a \n", "b\n"]) == "a\n\nb"
    assert sources(3) == ("a", "b", "c", "both")
    with pytest.raises(InputError, match="1 document"):
        layout(["x"])


def test_report_layout_classes_and_ttft(report, tiny):
    assert report["layout_tokens_match"] is True
    assert [r["recompute"] for r in report["rows"]] == [0, 10_000]
    head = encode_text(tiny.tokenizer, prompt_pieces(tiny.tokenizer, prompt_mode(tiny.tokenizer), SEPARATOR)[0], True)
    a, b = (d["prefix_tokens"] for d in report["documents"])
    assert report["composed_tokens"] == a + 2 + b - len(head)  # the separator before "Annex": "\n", "\n"
    for row in report["rows"]:
        v = row["vs_reference"]
        assert (v["all"]["n"], v["one"]["n"], v["both"]["n"]) == (3, 2, 1)
        assert len(row["answers"]) == len(row["single_ttft_s"]) == 3
        assert row["ttft"]["ratio"] == row["ttft"]["median_s"] / row["ttft"]["single_median_s"]
        ratios = sorted(a["ttft_s"] / s for a, s in zip(row["answers"], row["single_ttft_s"]))
        assert row["ttft"]["paired_ratio"] == ratios[1]  # the median of 3
        assert row["needles"]["n"] == 1
    assert report["reference"]["needles"]["n"] == 1
    assert report["settings"]["needles_in"] == "b"


def test_recomputing_all_of_b_answers_as_the_fresh_prefill(report):
    ref = report["reference"]
    full = report["rows"][1]
    assert [a["tokens"] for a in full["answers"]] == [a["tokens"] for a in ref["answers"]]
    assert full["vs_reference"]["all"]["exact"] == 3
    assert full["needles"]["answers"][0]["text"] == ref["needles"]["answers"][0]["text"]


@pytest.fixture(scope="module")
def blended(tiny, tmp_path_factory):
    config = ComposeConfig(recompute=(0,), ratios=(0.5, 1.0), max_tokens=3, page_size=16, reference="recompute-all",
                           work_dir=tmp_path_factory.mktemp("blended-work"))
    return evaluate_composed([DOC_A, DOC_B], QUESTIONS, model=tiny, config=config)


def test_ratio_axis_recomputes_that_share_and_all_of_it_is_the_reference(blended):
    assert [(r["recompute"], r["recompute_ratio"]) for r in blended["rows"]] == [(0, 0.5), (0, 1.0)]
    assert blended["settings"]["recompute_ratio"] == [0.5, 1.0] and blended["reference"]["kind"] == "recompute-all"
    half, full = (r["recomputed"] for r in blended["rows"])
    assert half["of"] == full["of"] and half["tokens"] == round(0.5 * half["of"]) and 0 < half["selected"]
    assert full["tokens"] == full["of"] and full["fraction"] == 1.0
    ref = blended["reference"]["answers"]
    assert [a["tokens"] for a in blended["rows"][1]["answers"]] == [a["tokens"] for a in ref]
    assert setting_label(blended["rows"][0]) == f"recompute 0, ratio 0.5 ({100 * half['fraction']:.1f}% recomputed)"


def test_bad_settings_refused(tiny):
    with pytest.raises(InputError, match="source 'c' is not one of a, b, both"):
        evaluate_composed([DOC_A, DOC_B], [{"id": 1, "question": "Q?", "source": "c"}], model=tiny)
    with pytest.raises(InputError, match="recompute settings"):
        evaluate_composed([DOC_A, DOC_B], QUESTIONS, model=tiny, config=ComposeConfig(recompute=(-1,)))
    with pytest.raises(InputError, match="recompute ratio is nan"):
        evaluate_composed([DOC_A, DOC_B], QUESTIONS, model=tiny, config=ComposeConfig(ratios=(float("nan"),)))
    with pytest.raises(InputError, match="needles_in is 'z'"):
        evaluate_composed([DOC_A, DOC_B], QUESTIONS, model=tiny, needles=NEEDLES, config=ComposeConfig(needles_in="z"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval-composed-cli")
    (folder / "a.txt").write_text(DOC_A)
    (folder / "b.txt").write_text(DOC_B)
    (folder / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (folder / "n.jsonl").write_text(json.dumps(NEEDLES[0]) + "\n")
    return folder


def _eval(files, tiny_dir, *extra):
    return run("eval", files / "a.txt", files / "b.txt", "--questions", files / "q.jsonl", "--model", tiny_dir,
               "--needles", files / "n.jsonl", "--max-tokens", "2", "--page-size", "16", "--work-dir",
               files / "work", *extra)


def test_cli_markdown_and_json(files, tiny_dir):
    r = _eval(files, tiny_dir, "--recompute", "0,4", "--markdown", "--json", files / "r.json")
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    assert lines[0].startswith("| setting | first token (one doc / both) |")
    assert [x.split(" | ")[0] for x in lines[2:5]] == ["| fresh prefill (reference)", "| recompute 0", "| recompute 4"]
    assert all(re.fullmatch(r"[0-2]/2 / [01]/1", x.split(" | ")[1]) for x in lines[3:5]), lines
    report = json.loads((files / "r.json").read_text())
    assert report["mode"] == "composed" and [d["path"] for d in report["documents"]] == [
        str(files / "a.txt"), str(files / "b.txt")]
    assert [len(a["tokens"]) <= 2 for a in report["rows"][0]["answers"]] == [True] * 3


@pytest.mark.parametrize("case, expect", [
    ("tiers with two documents", "--tiers: for one document"),
    ("recompute with one document", "--recompute needs two or more documents"),
    ("bad recompute", "--recompute entry 'x' must be a whole number"),
    ("bad ratio", "--recompute-ratio entry '1.5' must be a fraction between 0 and 1"),
    ("bad source", "field 'source' must be one of 'a', 'b', 'both', found 'c'"),
    ("json folder missing", "--json"),
])
def test_bad_input_one_line(files, tiny_dir, tmp_path, case, expect):
    if case == "recompute with one document":
        r = run("eval", files / "a.txt", "--questions", files / "q.jsonl", "--model", tiny_dir, "--recompute", "4")
    else:
        q = tmp_path / "q.jsonl"
        if case == "bad source":
            q.write_text(json.dumps({"question": "Q?", "source": "c"}) + "\n")
        args = {"tiers with two documents": ["--tiers", "bf16"], "bad recompute": ["--recompute", "0,x"],
                "bad ratio": ["--recompute-ratio", "0,1.5"],
                "json folder missing": ["--json", tmp_path / "no" / "r.json"],
                "bad source": ["--questions", q]}[case]
        r = _eval(files, tiny_dir, *args)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == (["q.jsonl"] if case == "bad source" else [])


def test_questions_with_sources_load(files):
    rows = load_questions(files / "q.jsonl", sources(2))
    assert [r["source"] for r in rows] == ["a", "b", "both"]


def test_parse_ratios():
    assert parse_ratios("0,0.05,1") == (0.0, 0.05, 1.0)
    for bad, expect in (("nan", "entry 'nan'"), ("0.1,0.1", "lists 0.1 more than once"), ("", "entry ''")):
        with pytest.raises(InputError, match=expect):
            parse_ratios(bad)
