"""`cartridge eval` on a tiny mlx-lm model directory: table, JSON, PNG, and one line per bad input."""

import json

import pytest
from helpers.clirun import run_inprocess as run

DOC = "".join(f"Clause {i}: the tenant pays {100 + i} euros on day {i}.\n\n" for i in range(1, 9))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval-cli")
    (folder / "doc.txt").write_text(DOC)
    (folder / "q.jsonl").write_text('{"id": 1, "question": "What is paid on day 3?"}\n'
                                    '{"id": 2, "question": "Which clause is last?"}\n')
    (folder / "n.jsonl").write_text('{"id": "a", "depth": 0.5, "fact": "The gate code is 4471.", '
                                    '"question": "What is the gate code?", "answer": "4471"}\n')
    return folder


def _eval(files, tiny_dir, *extra):
    return run("eval", files / "doc.txt", "--questions", files / "q.jsonl", "--model", tiny_dir,
               "--needles", files / "n.jsonl", "--max-tokens", "3", "--page-size", "16",
               "--work-dir", files / "work", *extra)


@pytest.fixture(scope="module")
def first_run(files, tiny_dir):
    return _eval(files, tiny_dir, "--tiers", "fp16,bf16", "--json", files / "r.json", "--plot", files / "r.png")


def test_eval_prints_table_writes_json_and_png(files, first_run):
    r = first_run
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode().splitlines()
    assert out[0].split("  ")[0] == "tier / schema" and "mean BLEU" in out[0] and "needles" in out[0]
    assert out[2].startswith("fp16 ") and out[3].startswith("fresh prefill (no cartridge) ")
    assert out[4].startswith("bf16 ")
    assert "sacrebleu sentence BLEU" in r.stdout.decode()
    assert "eval:" in r.stderr.decode()  # the progress bar
    report = json.loads((files / "r.json").read_text())
    assert [row["label"] for row in report["rows"]] == ["fp16", "fresh prefill", "bf16"]
    assert report["rows"][2]["vs_fp16"]["n"] == 2
    assert report["rows"][0]["needles"]["n"] == 1
    assert (files / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_and_reuse(files, tiny_dir, first_run):
    r = _eval(files, tiny_dir, "--tiers", "bf16", "--no-fresh", "--markdown", "--json", files / "m.json")
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    assert lines[0].startswith("| tier / schema | bytes/token |") and lines[1].startswith("|---|")
    assert [x.split(" | ")[0] for x in lines[2:4]] == ["| fp16", "| bf16"]
    report = json.loads((files / "m.json").read_text())
    assert report["rows"][0]["qa_cartridge"]["built"] is False  # cached by the first run


@pytest.fixture(scope="module")
def tiny64_dir(smol_tokenizer, tmp_path_factory):
    """The tiny model at head_dim 64 (the rotated 4-bit tiers of preset balanced need whole groups of 32)."""
    import mlx.core as mx
    from helpers.tiny_models import TINY_CONFIG, make_tiny
    from mlx.utils import tree_flatten

    path, lm = tmp_path_factory.mktemp("tiny64-model"), make_tiny(smol_tokenizer, head_dim=64)
    (path / "config.json").write_text(json.dumps({**TINY_CONFIG, "head_dim": 64}))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    lm.tokenizer._tokenizer.save_pretrained(str(path))
    return path


def test_eval_shows_bytes_build_kl_answers_and_needles_vs_fp16_per_configuration(files, tiny64_dir):
    import re

    r = _eval(files, tiny64_dir, "--tiers", "fp16,preset=balanced", "--no-fresh", "--json", files / "p.json")
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    head, ref, cal = (re.split(r"\s{2,}", line) for line in (lines[0], lines[2], lines[3]))
    ref, cal = dict(zip(head, ref)), dict(zip(head, cal))
    report = json.loads((files / "p.json").read_text())
    fp16, row = report["rows"]
    found = [a["found"] for a in row["needles"]["answers"]]
    lost = sum(f and not g for f, g in zip((a["found"] for a in fp16["needles"]["answers"]), found))
    gained = sum(g and not f for f, g in zip((a["found"] for a in fp16["needles"]["answers"]), found))
    assert row["vs_fp16"]["needles"] == {"same": 1 - lost - gained, "lost": lost, "gained": gained, "n": 1}
    assert (ref["build KL"], ref["first token"], ref["needles vs fp16"]) == ("-", "ref", "ref")
    assert cal["tier / schema"] == "preset=balanced" and cal["bytes/token"] == f"{row['bytes_per_token']:,}"
    assert cal["build KL"] == f"{row['build_kl']:.4f}" and row["build_kl"] >= 0
    assert cal["first token"] == f"{row['vs_fp16']['first_token']}/2"
    assert cal["mean BLEU"] == f"{row['vs_fp16']['bleu']:.3f}"
    assert cal["needles"] == f"{sum(found)}/1 ({sum(found)}/1)"
    assert cal["needles vs fp16"] == ("same" if lost + gained == 0 else f"-{lost} +{gained}")
    assert "needles vs fp16: same = each found or missed as with the fp16 cartridge" in r.stdout.decode()


@pytest.mark.parametrize("case, expect", [
    ("unknown tier", "--tiers entry 'int3': unknown tier 'int3'"),
    ("bad entry", "field 'bpq' must be bp followed by a whole number"),
    ("missing questions", "questions file"),
    ("json folder missing", "--json"),
    ("bad schemas", "schemas file"),
])
def test_bad_input_one_line(files, tiny_dir, tmp_path, case, expect):
    args = {"unknown tier": ["--tiers", "fp16,int3"], "bad entry": ["--tiers", "bf16:bpq"],
            "json folder missing": ["--json", tmp_path / "no" / "r.json"],
            "bad schemas": ["--schemas", files / "doc.txt"]}.get(case, [])
    if case == "missing questions":
        r = run("eval", files / "doc.txt", "--questions", tmp_path / "none.jsonl", "--model", tiny_dir)
    else:
        r = _eval(files, tiny_dir, *args)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err
    assert list(tmp_path.iterdir()) == []
