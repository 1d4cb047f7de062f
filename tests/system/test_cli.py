"""The command line: build/inspect/ask on an mlx-lm model directory, and one clear line per bad input."""

import hashlib
import json
import sys

import pytest
from helpers.clirun import run_process
from helpers.clirun import run_inprocess as run  # the other modules' `run` too (tests/helpers/clirun.py says which stay real)
from helpers import VECTORS
from helpers.clirun import DOC
from helpers.tiny_models import TINY_CONFIG, make_tiny, save_model_dir


def test_build_summary_and_inspect_json(built, tiny_dir):
    out, r = built
    assert r.stdout.decode().startswith(f"built {out}: ")
    assert "tokens/s prefill" in r.stdout.decode()
    info = json.loads(run_process("inspect", out, "--json").stdout)
    for key in ("format_version", "tokens", "n_layers", "n_kv_heads", "head_dim", "kv_dim", "page_size",
                "tiers", "bytes_per_token", "fp16_bytes_per_token", "total_bytes", "model"):
        assert key in info, key
    assert info["format_version"] == "1.11"
    assert info["source"] == {"name": "doc.txt", "bytes": len((DOC * 3).encode()),
                              "sha256": hashlib.sha256((DOC * 3).encode()).hexdigest(),
                              "first_line": DOC.strip()}
    assert (info["n_layers"], info["n_kv_heads"], info["head_dim"], info["kv_dim"]) == (2, 2, 16, 32)
    assert info["tiers"][1] == {"layer": 1, "k": "fp16", "v": "fp16"}
    assert info["bytes_per_token"] == info["fp16_bytes_per_token"] == 2 * 2 * 32 * 2
    assert info["model"]["ref"] == str(tiny_dir.resolve())
    assert info["total_bytes"] == sum(f.stat().st_size for f in out.iterdir())
    table = run("inspect", out).stdout.decode()
    assert "0-1     fp16     fp16" in table


def test_inspect_shows_the_document(built):
    out, _ = built
    table = run("inspect", out).stdout.decode()
    digest = hashlib.sha256((DOC * 3).encode()).hexdigest()
    assert f"document      doc.txt, {len((DOC * 3).encode()):,} bytes, sha256 {digest}" in table
    assert f"first line    {DOC.strip()!r}" in table


def test_build_system_message_is_shown_and_refused_blank(built, tiny_dir, tmp_path):
    corpus = built[0].parent / "doc.txt"
    r = run("build", corpus, "-o", tmp_path / "s.cart", "--model", tiny_dir, "--system", "Answer briefly.")
    assert r.returncode == 0, r.stderr.decode()
    assert "system        'Answer briefly.'" in run("inspect", tmp_path / "s.cart").stdout.decode()
    assert json.loads(run("inspect", tmp_path / "s.cart", "--json").stdout)["system"] == "Answer briefly."
    assert "system " not in run("inspect", built[0]).stdout.decode()
    r = run("build", corpus, "-o", tmp_path / "b.cart", "--model", tiny_dir, "--system", " ")
    assert r.returncode != 0 and r.stderr.decode().strip() == "error: the system message is empty (or only whitespace)"
    assert not (tmp_path / "b.cart").exists()


def test_inspect_of_a_format_1_0_cartridge_shows_dashes():
    vector = VECTORS / "tiny.cart"  # written before the source keys
    r = run("inspect", vector)
    assert r.returncode == 0, r.stderr.decode()
    assert "document      -, -, sha256 -\nfirst line    -" in r.stdout.decode()
    assert json.loads(run("inspect", vector, "--json").stdout)["source"] == {
        "name": None, "bytes": None, "sha256": None, "first_line": None}
    assert json.loads(run("inspect", vector, "--json").stdout)["sources"] == []


def test_inspect_after_extend_shows_every_source(built, tmp_path):
    more = tmp_path / "annex.txt"
    more.write_text("Annex A. Pets are allowed.\n")
    r = run("extend", built[0], more, "-o", tmp_path / "ext.cart")
    assert r.returncode == 0, r.stderr.decode()
    digest = hashlib.sha256(b"Annex A. Pets are allowed.\n").hexdigest()
    table = run("inspect", tmp_path / "ext.cart").stdout.decode()
    assert f"document 2    annex.txt, 27 bytes, sha256 {digest}\nfirst line    'Annex A. Pets are allowed.'" in table
    sources = json.loads(run("inspect", tmp_path / "ext.cart", "--json").stdout)["sources"]
    assert [(s["name"], s["bytes"]) for s in sources] == [("doc.txt", len((DOC * 3).encode())), ("annex.txt", 27)]


def test_inspect_takes_a_cartz(built, tmp_path, monkeypatch):
    out, _ = built
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert run("pack", out, "-o", tmp_path / "d.cartz").returncode == 0
    r = run_process("inspect", tmp_path / "d.cartz", "--json")
    assert r.returncode == 0, r.stderr.decode()
    d = json.loads(r.stdout)
    assert d["total_bytes"] == (tmp_path / "d.cartz").stat().st_size
    assert d["tokens"] == json.loads(run("inspect", out, "--json").stdout)["tokens"]


def test_build_warns_when_little_context_is_left(tiny_dir, tmp_path):
    corpus = tmp_path / "long.txt"
    corpus.write_text(DOC * 16)  # about 440 tokens of the tiny model's 512
    r = run("build", corpus, "-o", tmp_path / "l.cart", "--model", tiny_dir)
    assert r.returncode == 0, r.stderr.decode()
    warning = [line for line in r.stderr.decode().splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "of the model's 512-token context: only" in warning[0]
    assert "are left for each question and its answer (reserve 256)" in warning[0]
    r = run("build", corpus, "-o", tmp_path / "m.cart", "--model", tiny_dir, "--reserve", "0")
    assert r.returncode == 0 and "warning:" not in r.stderr.decode()


def test_ask_streams_answer_and_reports_timing(built):
    out, _ = built
    r = run_process("ask", out, "How much is the rent?", "--max-tokens", "5")
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode()
    assert "TTFT" in err and "load" in err and "tokens/s" in err


def test_ask_says_when_the_model_ended_its_answer_before_max_tokens(built, monkeypatch):
    from cartridge.cli import ask

    out, _ = built
    for tokens, said in ((3, True), (5, False)):  # an end-of-sequence token after 3 of 5; all 5 given
        monkeypatch.setattr(ask, "answer", lambda *a, n=tokens, **k: {
            "answer": "x", "ttft_s": 0.1, "tokens": n, "decode_tokens_per_s": 1.0, "prompt_tokens": 4,
            "max_tokens": 5, "token_ids": [1] * n, "stopped": False, "stop_string": None})
        r = run("ask", out, "How much is the rent?", "--max-tokens", "5")
        assert r.returncode == 0
        assert (f"({tokens} tokens, the model ended its answer)" in r.stderr.decode()) == said


def test_build_k_encoder_score_writes_the_tiers_format(smol_tokenizer, tmp_path):
    """--k-encoder score: the same files and sizes as nearest's, other K codes; an unknown encoder is refused."""
    model = save_model_dir(make_tiny(smol_tokenizer, seed=3, head_dim=32), tmp_path / "model",
                           {**TINY_CONFIG, "head_dim": 32})
    corpus = tmp_path / "c.txt"
    corpus.write_text(DOC * 3)
    for enc in ("nearest", "score"):
        r = run("build", corpus, "-o", tmp_path / f"{enc}.cart", "--model", model, "--tier", "mlx4g32",
                "--k-encoder", enc)
        assert r.returncode == 0, r.stderr.decode()
    files = [{p.name: p.read_bytes() for p in (tmp_path / f"{e}.cart").iterdir()} for e in ("nearest", "score")]
    assert {n: len(b) for n, b in files[0].items()} == {n: len(b) for n, b in files[1].items()}
    assert files[0] != files[1]
    r = run("build", corpus, "-o", tmp_path / "x.cart", "--model", model, "--k-encoder", "gptq")
    assert r.returncode == 2 and "'gptq' is not one of 'nearest', 'score'" in r.stderr.decode()


def test_build_k_scale_and_v_encoder_inspect_says_so(tiny_dir, tmp_path):
    """--k-scale --v-encoder output: a format 1.11 cartridge whose inspect names its scaled layers, and which
    answers and extends, keeping its scales; an unknown V encoder is refused by click."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(DOC * 3)
    out = tmp_path / "s.cart"
    r = run("build", corpus, "-o", out, "--model", tiny_dir, "--tier", "fp16", "--k-scale",
            "--v-encoder", "output")
    assert r.returncode == 0, r.stderr.decode()
    text = run("inspect", out).stdout.decode()
    assert "format 1.11" in text and "K scaled      per channel in 2 layers" in text
    assert "encoded       K nearest rounding, V for the output (o_proj)" in text
    assert json.loads(run("inspect", out, "--json").stdout)["k_scaled_layers"] == ["0", "1"]
    assert run("ask", out, "Who?", "--max-tokens", 3).returncode == 0
    r = run("extend", out, corpus, "-o", tmp_path / "e.cart")
    assert r.returncode == 0 and "K scaled      per channel in 2 layers" in run("inspect", tmp_path / "e.cart").stdout.decode()
    r = run("build", corpus, "-o", tmp_path / "x.cart", "--model", tiny_dir, "--v-encoder", "gptq")
    assert r.returncode == 2 and "'gptq' is not one of 'nearest', 'output'" in r.stderr.decode()


def test_build_from_stdin(tiny_dir, tmp_path):
    r = run("build", "-", "-o", tmp_path / "s.cart", "--model", tiny_dir, stdin=DOC.encode())
    assert r.returncode == 0, r.stderr.decode()


REAL_PROCESS_CASES = ("not utf-8", "not a cartridge", "question past context")  # build, inspect, ask


@pytest.mark.parametrize("case, expect", [
    ("missing corpus", "does not exist"),
    ("empty corpus", "is empty"),
    ("not utf-8", "is not UTF-8: byte 0xff at offset 4"),
    ("too long", "the model's context is 512 tokens"),
    ("unknown tier", "unknown tier 'int3'"),
    ("output exists", "exists; pass --force"),
    ("not a cartridge", "is a file, not a cartridge: a cartridge is a directory"),
    ("missing model", "model path does not exist"),
    ("empty question", "question is empty"),
    ("missing folder", "does not exist (or is not a folder)"),
    ("file as folder", "c.txt is a file, not a folder; the output must go in a folder"),
    ("empty output", "the output path is empty"),
    ("file at output", "exists and is not a cartridge; refusing"),
    ("empty model", "--model is empty"),
    ("empty v tier", "v_tier is empty"),
    ("schema and tier", "cannot be combined with --tier"),
    ("max tokens past context", "does not fit the model's context of 512 tokens"),
    ("question past context", "the question ("),
    ("k encoder under parallel", "not --preset, --protect-first/--protect-last, --k-encoder score, --k-scale or --v-encoder output"),
    ("k scale under parallel", "not --preset, --protect-first/--protect-last, --k-encoder score, --k-scale or --v-encoder output"),
])
def test_bad_input_one_line_nonzero_exit(case, expect, built, tiny_dir, tmp_path):
    out, _ = built
    cmd = run_process if case in REAL_PROCESS_CASES else run  # one real process per command
    corpus = tmp_path / "c.txt"
    corpus.write_text(DOC)
    target = tmp_path / "new.cart"
    before = sorted(p.name for p in tmp_path.iterdir())
    if case == "missing corpus":
        r = cmd("build", tmp_path / "nope.txt", "-o", target, "--model", tiny_dir)
    elif case == "empty corpus":
        corpus.write_text(" \n")
        r = cmd("build", corpus, "-o", target, "--model", tiny_dir)
    elif case == "not utf-8":
        corpus.write_bytes(b"abcd\xff\xfe")
        r = cmd("build", corpus, "-o", target, "--model", tiny_dir)
    elif case == "too long":
        corpus.write_text(DOC * 40)
        r = cmd("build", corpus, "-o", target, "--model", tiny_dir)
    elif case == "unknown tier":
        r = cmd("build", corpus, "-o", target, "--model", tiny_dir, "--tier", "int3")
    elif case == "output exists":
        r = cmd("build", corpus, "-o", out, "--model", tiny_dir)
    elif case == "not a cartridge":
        r = cmd("inspect", corpus)
    elif case == "missing model":
        r = cmd("build", corpus, "-o", target, "--model", tmp_path / "no-model")
    elif case == "empty question":
        r = cmd("ask", out, "  ")
    elif case == "missing folder":
        r = cmd("build", corpus, "-o", tmp_path / "no-folder" / "x.cart", "--model", tiny_dir)
    elif case == "file as folder":
        r = cmd("build", corpus, "-o", corpus / "x.cart", "--model", tiny_dir)
    elif case == "empty output":
        r = cmd("build", corpus, "-o", "", "--model", tiny_dir)
    elif case == "file at output":
        r = cmd("build", corpus, "-o", corpus, "--model", tiny_dir, "--force")
    elif case == "empty model":
        r = cmd("ask", out, "Who?", "--model", "")
    elif case == "empty v tier":
        r = cmd("build", corpus, "-o", target, "--model", tiny_dir, "--v-tier", "")
    elif case == "schema and tier":
        r = cmd("build", corpus, "-o", target, "--model", tiny_dir, "--tier", "int8", "--schema", corpus)
    elif case == "question past context":
        r = cmd("ask", out, "Who may terminate the lease? " * 100)
    elif case == "k encoder under parallel":
        r = cmd("build", corpus, "-o", target, "--model", tiny_dir, "--k-encoder", "score", "--parallel", "tensor")
    elif case == "k scale under parallel":
        r = cmd("build", corpus, "-o", target, "--model", tiny_dir, "--k-scale", "--parallel", "tensor")
    elif case == "max tokens past context":
        r = cmd("ask", out, "Who?", "--max-tokens", 10_000_000)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode != 0
    assert len(err) == 1, err
    assert err[0].startswith("error: ") and expect in err[0], err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing partial left behind
    assert (out / "MANIFEST").is_file()  # the existing cartridge is untouched


def test_existing_non_cartridge_is_not_offered_force(tiny_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(DOC)
    r = run("build", corpus, "-o", corpus, "--model", tiny_dir)
    assert r.returncode == 1 and "--force" not in r.stderr.decode()
    assert corpus.read_text() == DOC


def test_page_size_far_beyond_the_document_is_lowered(tiny_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(DOC)
    r = run("build", corpus, "-o", tmp_path / "p.cart", "--model", tiny_dir, "--page-size", "65536")
    assert r.returncode == 0, r.stderr.decode()
    info = json.loads(run("inspect", tmp_path / "p.cart", "--json").stdout)
    lines = [line for line in r.stderr.decode().splitlines() if line.startswith(("warning", "note", "error"))]
    assert lines == [f"warning: page size 65536 is larger than the document "
                                              f"({info['tokens']} tokens); writing pages of 256 tokens"]
    assert info["page_size"] == 256


def test_inspect_says_same_as_fp16(built):
    out, _ = built
    shown = run("inspect", out).stdout.decode()
    assert "same as fp16" in shown
    assert "\npreset        -\n" in shown and json.loads(run("inspect", out, "--json").stdout)["preset"] is None


def test_inspect_names_the_preset_of_a_fixed_recipe_build(tiny_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(DOC)
    r = run("build", corpus, "-o", tmp_path / "p.cart", "--model", tiny_dir, "--preset", "exact", "--no-calibrate")
    assert r.returncode == 0, r.stderr.decode()
    assert "\npreset        exact\n" in run("inspect", tmp_path / "p.cart").stdout.decode()


def test_interrupt_while_importing_exits_130(monkeypatch, capsys):
    import types

    from cartridge.cli import entry

    class Interrupting(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "cartridge.cli.main", Interrupting("cartridge.cli.main"))
    with pytest.raises(SystemExit) as e:
        entry.main()
    assert e.value.code == 130
    assert capsys.readouterr().err == "error: interrupted\n"


def test_inspect_folds_only_layers_of_the_same_size():
    """A schema mixing tiers gives layers of different bytes: each run prints its own size."""
    from cartridge.cli.report import fold_layers

    rows = [{"layer": i, "kind": "attention", "bytes": b} for i, b in enumerate([10, 10, 20, 20, 10])]
    assert [(r["layers"], r["bytes_each"]) for r in fold_layers(rows)] == [("0-1", 10), ("2-3", 20), ("4", 10)]


@pytest.mark.parametrize("command", ["build", "convert"])
@pytest.mark.parametrize("extra", [["--tier", "fp16"], ["--protect-first", "0"], ["--boundary-protect", "0"]])
def test_preset_refuses_an_option_given_at_its_default_value(tmp_path, extra, command):
    from click.testing import CliRunner

    from cartridge.cli.main import cli

    doc = tmp_path / "d.txt"
    doc.write_text("A short document.")
    r = CliRunner().invoke(cli, [command, str(doc), "-o", str(tmp_path / "x.cart"), "--preset", "safe", *extra])
    assert r.exit_code == 1 and f"cannot be combined with {extra[0]}" in r.output + str(r.exception)
    assert not (tmp_path / "x.cart").exists()
