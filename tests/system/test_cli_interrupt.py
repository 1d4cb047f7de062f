"""Ctrl-C (SIGINT) during `build`, `extend` and `convert` (issue 31): one line, exit status 130, no
traceback, no temporary left and an existing cartridge kept as it was. The command runs in
tests/helpers/interrupt_worker.py, which pauses at a stage (after the first prefill chunk, or after the first
extent written into the temporary directory) so the signal lands there."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.interrupts import start, wait_for

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)

DOC = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month.\n"
LINE = "error: interrupted; nothing was written"


def interrupt(stage, *args, flag):
    """Run the worker to its pause, send SIGINT; returns (exit status, stderr)."""
    proc = start(stage, *args, flag=flag)
    wait_for(flag, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err.decode()


def snapshot(folder):
    """{name: bytes} of every file under `folder` (relative names), to show nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def check_one_line(rc, err):
    assert rc == 130, err
    assert "Traceback" not in err and err.splitlines()[-1] == LINE, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [LINE], err


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "work" / "doc.txt"
    path.parent.mkdir()
    path.write_text(DOC * 4)
    return path


@pytest.mark.parametrize("stage", ["prefill", "write"])
def test_build_interrupted_writes_nothing(tiny_dir, corpus, tmp_path, stage):
    folder = corpus.parent
    before = snapshot(folder)
    rc, err = interrupt(stage, "build", corpus, "-o", folder / "doc.cart", "--model", tiny_dir, "--prefill-step", 8,
                        "--page-size", 16, flag=tmp_path / "flag")
    check_one_line(rc, err)
    assert snapshot(folder) == before and sorted(os.listdir(folder)) == ["doc.txt"]  # no .doc.cart.tmp-* either


def test_build_force_interrupted_keeps_the_existing_cartridge(tiny_dir, corpus, tmp_path):
    folder = corpus.parent
    cartridge.build("Another document.", folder / "doc.cart", model=str(tiny_dir))
    before = snapshot(folder)
    rc, err = interrupt("write", "build", corpus, "-o", folder / "doc.cart", "--model", tiny_dir, "--force",
                        flag=tmp_path / "flag")
    check_one_line(rc, err)
    assert snapshot(folder) == before and sorted(os.listdir(folder)) == ["doc.cart", "doc.txt"]


@pytest.fixture(scope="module")
def tiny64_dir(smol_tokenizer, tmp_path_factory):
    """A tiny model of head_dim 64 (calibration's candidate tiers need it) as an mlx-lm model directory."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from helpers.tiny_models import TINY_CONFIG, make_tiny

    path = tmp_path_factory.mktemp("tiny64-model")
    (path / "config.json").write_text(json.dumps({**TINY_CONFIG, "head_dim": 64}))
    tiny = make_tiny(smol_tokenizer, seed=0, head_dim=64)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(tiny.model.parameters())))
    tiny.tokenizer._tokenizer.save_pretrained(str(path))
    return path


def test_build_force_interrupted_in_calibration_keeps_the_existing_cartridge(tiny64_dir, corpus, tmp_path):
    folder = corpus.parent
    cartridge.build("Another document.", folder / "doc.cart", model=str(tiny64_dir))
    before = snapshot(folder)
    rc, err = interrupt("calibrate", "build", corpus, "-o", folder / "doc.cart", "--model", tiny64_dir, "--force",
                        "--preset", "safe", "--reserve", "0", flag=tmp_path / "flag")
    check_one_line(rc, err)
    assert "calibrating: measuring each layer's K/V tiers" in err
    assert snapshot(folder) == before and sorted(os.listdir(folder)) == ["doc.cart", "doc.txt"]


@pytest.mark.parametrize("stage, output", [("prefill", "in place"), ("write", "in place"), ("prefill", "-o"),
                                           ("write", "-o")])
def test_extend_interrupted_keeps_the_cartridge(tiny_dir, corpus, tmp_path, stage, output):
    folder = corpus.parent
    cartridge.build(DOC, folder / "doc.cart", model=str(tiny_dir), page_size=16)
    before = snapshot(folder)
    dest = [] if output == "in place" else ["-o", folder / "more.cart"]
    rc, err = interrupt(stage, "extend", folder / "doc.cart", corpus, *dest, "--prefill-step", 8,
                        flag=tmp_path / "flag")
    check_one_line(rc, err)
    assert snapshot(folder) == before and sorted(os.listdir(folder)) == ["doc.cart", "doc.txt"]


def test_convert_interrupted_writes_nothing(tiny_dir, corpus, tmp_path):
    folder = corpus.parent
    cartridge.build(DOC, folder / "doc.cart", model=str(tiny_dir), page_size=16)
    before = snapshot(folder)
    rc, err = interrupt("write", "convert", folder / "doc.cart", "-o", folder / "q.cart", "--tier", "nvfp4",
                        flag=tmp_path / "flag")
    check_one_line(rc, err)
    assert snapshot(folder) == before and sorted(os.listdir(folder)) == ["doc.cart", "doc.txt"]


def test_ctrl_c_while_the_console_script_imports_is_one_line(tmp_path):
    """SIGINT while the CLI's modules load (was a traceback and exit status -2 for the first ~2 s):
    `python -X importtime` writes a line as each module finishes; the signal goes on cli.common's line,
    with cli.main's other imports still to come."""
    script = "import sys; from cartridge.cli.entry import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-c", script, "inspect", tmp_path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.rstrip().endswith("cartridge.cli.common"):
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 130 and lines == ["error: interrupted"], err


def test_ask_interrupted_mid_answer_ends_the_answer_line(tiny_dir, corpus, tmp_path):
    """Ctrl-C ends `ask` (status 130); the partial answer's line is ended first, so in a terminal the
    "error: interrupted" line is a line of its own."""
    cart = corpus.parent / "doc.cart"
    cartridge.build(DOC, cart, model=str(tiny_dir), page_size=16)
    flag = tmp_path / "flag"
    proc = start("answer", "ask", cart, "How much is the rent?", "--max-tokens", 200, flag=flag)
    wait_for(flag, proc)
    proc.send_signal(signal.SIGINT)
    out, err = (s.decode() for s in proc.communicate(timeout=120))
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert out.endswith("\n") and out.count("\n") == 1 and len(out) > 1, out
    assert err.splitlines()[-1] == "error: interrupted", err
