"""Question and needle files, needle planting and the held-out split."""

import json

import pytest
from helpers import ROOT
from helpers.samples import QUESTIONS

from cartridge.errors import InputError
from cartridge.eval.dataset import load_needles, load_questions, paragraph_starts, plant_needles, split_heldout

NEEDLES = ROOT / "samples" / "needles.jsonl"


def test_sample_questions_load():
    rows = load_questions(QUESTIONS)
    assert len(rows) == 20
    assert rows[1] == {"id": 2, "question": "What is the date of version 3 of this license?", "answer": "29 June 2007"}


def test_second_document_questions_load_and_short_answers_are_in_it():
    """samples/h11-readme.*: the second evaluation document (issue 19) and its 20 questions."""
    rows = load_questions(ROOT / "samples" / "h11-readme.questions.jsonl")
    text = (ROOT / "samples" / "h11-readme.txt").read_text()
    assert [r["id"] for r in rows] == list(range(1, 21))
    short = [r["answer"] for r in rows if " " not in r["answer"]]  # names and figures quoted verbatim
    assert len(short) == 9 and all(a in text for a in short), short


@pytest.mark.parametrize("name, docs, n_short", [
    ("lgpl-3.0", ("lgpl-3.0.part1.txt", "lgpl-3.0.part2.txt"), 0),
    ("uvicorn-starlette", ("uvicorn-readme.txt", "starlette-readme.txt"), 5),
])
def test_composed_question_files(name, docs, n_short):
    """samples/*.compose.questions.jsonl: 12 questions about a pair of documents (`cartridge eval A B`),
    4 answered by each document and 4 needing both; one-word answers are quoted from their document
    (and, for one document's questions, absent from the other)."""
    rows = load_questions(ROOT / "samples" / f"{name}.compose.questions.jsonl", ("a", "b", "both"))
    assert [r["source"] for r in rows] == ["a"] * 4 + ["b"] * 4 + ["both"] * 4
    assert [r["id"] for r in rows] == [f"{s}{i}" for s in ("a", "b", "ab") for i in range(1, 5)]
    assert all(r["answer"] for r in rows)
    texts = {s: (ROOT / "samples" / d).read_text() for s, d in zip("ab", docs)}
    texts["both"] = texts["a"] + texts["b"]
    short = [(r["source"], r["answer"]) for r in rows if " " not in r["answer"]]
    assert len(short) == n_short and all(a in texts[s] for s, a in short), short
    assert not any(a in texts["b" if s == "a" else "a"] for s, a in short if s != "both"), short


def test_lgpl_halves_are_the_sample_split_before_section_4(smol_tokenizer):
    """part1 + part2 is the sample byte for byte; part 2 opens with the heading of section 4."""
    one, two = ((ROOT / "samples" / f"lgpl-3.0.part{i}.txt").read_text() for i in (1, 2))
    assert one + two == (ROOT / "samples" / "lgpl-3.0.txt").read_text()
    assert two.startswith("  4. Combined Works.\n") and one.endswith("document.\n\n")
    sizes = [len(smol_tokenizer.encode(t.strip(), add_special_tokens=False)) for t in (one, two)]
    assert sizes == [750, 855]


def test_readme_pair_under_2000_tokens(smol_tokenizer):
    sizes = [len(smol_tokenizer.encode((ROOT / "samples" / f).read_text().strip(), add_special_tokens=False))
             for f in ("uvicorn-readme.txt", "starlette-readme.txt")]
    assert sizes == [1195, 1183]


def test_sample_needles_have_exact_digits_at_five_depths():
    rows = load_needles(NEEDLES)
    assert len(rows) == 10
    assert sorted({r["depth"] for r in rows}) == [0.1, 0.3, 0.5, 0.7, 0.9]
    for r in rows:
        assert any(ch.isdigit() for ch in r["answer"]), r
        assert r["answer"] in r["fact"] and r["answer"] not in r["question"], r


def test_plant_needles_at_the_nearest_paragraph_break():
    doc = "A.\n\nB.\n\nC."
    assert paragraph_starts(doc) == [0, 4, 8, 10]
    assert plant_needles(doc, [{"depth": 0.5, "fact": "X is 7."}]) == "A.\n\nX is 7.\n\nB.\n\nC."
    got = plant_needles(doc, [{"depth": 1.0, "fact": "Z 9."}, {"depth": 0.0, "fact": "Y 8."},
                              {"depth": 0.9, "fact": "W 1."}])
    assert got == "Y 8.\n\nA.\n\nB.\n\nW 1.\n\nC.\n\nZ 9.\n\n"  # depth 0.9 -> char 9, nearest break 8


def test_plant_needles_without_blank_lines_uses_line_breaks():
    assert plant_needles("one\ntwo\nthree", [{"depth": 0.6, "fact": "F 2."}]) == "one\ntwo\n\nF 2.\n\nthree"


def test_split_heldout_cuts_at_a_break():
    doc = "aaaa\n\nbbbb\n\ncccc\n\ndddd"
    head, tail = split_heldout(doc, 0.25)
    assert (head, tail) == ("aaaa\n\nbbbb\n\ncccc\n\n", "dddd")
    with pytest.raises(InputError, match="must be in"):
        split_heldout(doc, 1.0)
    with pytest.raises(InputError, match="no paragraph"):
        split_heldout("oneword", 0.2)


@pytest.mark.parametrize("line, expect", [
    ("not json", "line 1: not JSON"),
    ("[1, 2]", "line 1: expected a JSON object, found list"),
    ('{"id": 3}', "line 1: field 'question' must be a non-empty string, found None"),
    ('{"question": "  "}', "field 'question' must be a non-empty string"),
])
def test_bad_questions_file(tmp_path, line, expect):
    path = tmp_path / "q.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InputError, match=expect):
        load_questions(path)


def test_missing_or_empty_files(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_questions(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="has no rows"):
        load_needles(tmp_path / "empty.jsonl")


@pytest.mark.parametrize("change, expect", [
    ({"depth": 1.5}, "'depth' must be a number in \\[0, 1\\], found 1.5"),
    ({"depth": True}, "'depth' must be a number"),
    ({"answer": ""}, "field 'answer' must be a non-empty string"),
])
def test_bad_needle_row(tmp_path, change, expect):
    row = {"id": "n", "depth": 0.5, "fact": "F is 1.", "question": "What is F?", "answer": "1", **change}
    path = tmp_path / "n.jsonl"
    path.write_text(json.dumps(row))
    with pytest.raises(InputError, match=expect):
        load_needles(path)
