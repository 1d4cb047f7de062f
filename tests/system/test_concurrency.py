"""Reader processes (4 in make test, 8 under `slow`) load one cartridge and answer while another process builds
a different cartridge into the same folder (again and again, each build replacing the last, until the readers are
done): a build is published while they load and answer, every answer equals the single-process answer, and nothing
reports an error (no lock errors: readers take no locks)."""

import json
import os
import subprocess
import sys

import pytest
from helpers import HELPERS

import cartridge
from cartridge.format.reader import verify_cartridge

DOC = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month, due monthly. " * 3
OTHER = "Section 2. The landlord repairs the roof; the tenant waters the garden every week. " * 4
QUESTION = "How much is the rent?"


def _answer(cart):
    return [sys.executable, str(HELPERS / "answer_worker.py"), str(cart), QUESTION, "12"]


def _builder(text_path, output, tiny_dir, stop):
    """One process that builds `text_path` into `output` again and again, each build replacing the last, at least
    twice and until the file `stop` exists; prints time.time() before the first build and after each. (Two builds
    only, as before, could end before a reader on a loaded machine had answered: nothing written while it read.)"""
    build = f"cartridge.build(open({str(text_path)!r}).read(), {str(output)!r}, model={str(tiny_dir)!r}, page_size=8"
    loop = (f"import os, time, cartridge\nn = 0\nprint(time.time(), flush=True)\n"
            f"while n < 2 or not os.path.exists({str(stop)!r}):\n"
            f"    {build}, force=n > 0)\n    n += 1\n    print(time.time(), flush=True)\n")
    return [sys.executable, "-c", loop]


# the same property with 4 readers as with 8 (each ~5 s of CPU for its interpreter and imports): 8 under slow
@pytest.mark.parametrize("n_readers", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_readers_while_another_build_writes_the_folder(tiny_dir, tmp_path, n_readers):
    """The cartridge and the single-process answer are made in the test's own process (fewer interpreters
    importing mlx-lm on a 2-core machine); the readers and the builder are separate processes."""
    from helpers.answer_worker import answer

    folder = tmp_path / "shelf"
    folder.mkdir()
    (tmp_path / "other.txt").write_text(OTHER)
    cart = folder / "doc.cart"
    cartridge.build(DOC, cart, model=str(tiny_dir), page_size=16)
    expected = answer(str(cart), QUESTION, 12)
    assert len(expected["tokens"]) == 12

    stop = tmp_path / "readers-done"
    builder = subprocess.Popen(_builder(tmp_path / "other.txt", folder / "other.cart", tiny_dir, stop),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    readers = [subprocess.Popen(_answer(cart), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(n_readers)]
    try:
        results = [p.communicate(timeout=600) for p in readers]
    finally:
        stop.touch()  # the builder's last build then ends it
    b_out, b_err = builder.communicate(timeout=600)

    assert builder.returncode == 0, b_err
    answers = []
    for p, (out, err) in zip(readers, results):
        assert p.returncode == 0, err
        assert "lock" not in err.lower() and "error" not in err.lower(), err
        answers.append(json.loads(out))
    assert all(a["tokens"] == expected["tokens"] for a in answers)
    building_from, *built_at = [float(t) for t in b_out.split()]
    assert len(built_at) >= 2
    # the builder writes without a pause from building_from until after the last answer (the stop file)
    assert building_from < max(a["answered"] for a in answers)
    assert verify_cartridge(cart).ok and verify_cartridge(folder / "other.cart").ok
    assert sorted(os.listdir(folder)) == ["doc.cart", "other.cart"]
