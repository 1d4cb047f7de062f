"""8 processes load one cartridge and answer while another process builds a different cartridge into
the same folder (twice, the second replacing the first): every answer equals the single-process answer,
and nothing reports an error (no lock errors: readers take no locks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from cartridge.format.reader import verify_cartridge

HERE = Path(__file__).resolve().parent
DOC = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month, due monthly. " * 3
OTHER = "Section 2. The landlord repairs the roof; the tenant waters the garden every week. " * 4
QUESTION = "How much is the rent?"


def _cli(*args):
    return [sys.executable, "-m", "cartridge.cli.main", *map(str, args)]


def _answer(cart):
    return [sys.executable, str(HERE / "answer_worker.py"), str(cart), QUESTION, "12"]


def test_eight_readers_while_another_build_writes_the_folder(tiny_dir, tmp_path):
    folder = tmp_path / "shelf"
    folder.mkdir()
    (tmp_path / "doc.txt").write_text(DOC)
    (tmp_path / "other.txt").write_text(OTHER)
    cart = folder / "doc.cart"
    build = subprocess.run(_cli("build", tmp_path / "doc.txt", "-o", cart, "--model", tiny_dir, "--page-size", 16),
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    solo = subprocess.run(_answer(cart), capture_output=True, text=True, timeout=300)
    assert solo.returncode == 0, solo.stderr
    expected = json.loads(solo.stdout)
    assert len(expected["tokens"]) == 12

    builder_cmd = " && ".join(" ".join(map(str, _cli("build", tmp_path / "other.txt", "-o", folder / "other.cart",
                                                      "--model", tiny_dir, "--page-size", 8, *force)))
                              for force in ([], ["--force"]))
    builder_cmd += f" && {sys.executable} -c 'import time; print(time.time())'"
    builder = subprocess.Popen(builder_cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    readers = [subprocess.Popen(_answer(cart), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(8)]
    results = [p.communicate(timeout=600) for p in readers]
    b_out, b_err = builder.communicate(timeout=600)

    assert builder.returncode == 0, b_err
    answers = []
    for p, (out, err) in zip(readers, results):
        assert p.returncode == 0, err
        assert "lock" not in err.lower() and "error" not in err.lower(), err
        answers.append(json.loads(out))
    assert all(a["tokens"] == expected["tokens"] for a in answers)
    built_at = float(b_out.strip().splitlines()[-1])
    assert min(a["answered"] for a in answers) < built_at  # the builds overlapped the readers' loads
    assert verify_cartridge(cart).ok and verify_cartridge(folder / "other.cart").ok
    assert sorted(os.listdir(folder)) == ["doc.cart", "other.cart"]
