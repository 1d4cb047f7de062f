"""Atomic publication: stale temporaries are removed only when their writer is dead, a rebuild onto a
mapped cartridge leaves the old mapping's bytes intact (STYLE.md 11), and readers opening while the
same path is rebuilt again and again always see one whole cartridge."""

import os
import subprocess
import sys
import time

import numpy as np
from helpers import HELPERS, ROOT
from helpers.cartfiles import pages, write

from cartridge.format.atomic import STALE_NEW_SECONDS, TempDir, clean_stale
from cartridge.format.layout import DATA_NAME
from cartridge.format.reader import open_cartridge



def test_clean_stale_removes_only_dead_writers_temporaries(tmp_path):
    dest = tmp_path / "a.cart"
    live = TempDir(dest)  # a writer in progress: holds its lock
    (live.path / "pages.bin").write_bytes(b"x")
    dead = tmp_path / ".a.cart.tmp-dead1"
    dead.mkdir()
    (dead / "pages.bin").write_bytes(b"y")
    dead_file = tmp_path / ".a.cart.tmp-deadf"  # a killed `pack` leaves a file
    dead_file.write_bytes(b"z")
    young = tmp_path / ".a.cart.new-young"
    young.mkdir()
    old = tmp_path / ".a.cart.new-old"
    old.mkdir()
    os.utime(old, (time.time() - STALE_NEW_SECONDS - 5,) * 2)
    others = [tmp_path / ".b.cart.tmp-x", tmp_path / ".a.cart.notes", tmp_path / "a.cart.tmp-x"]
    for p in others:
        p.mkdir()
    removed = clean_stale(dest)
    assert sorted(removed) == sorted([dead.name, dead_file.name, old.name])
    assert live.path.is_dir() and young.is_dir() and all(p.is_dir() for p in others)
    live.discard()
    assert not live.path.exists()


def test_rebuild_while_mapped_keeps_old_bytes_and_shows_new(tmp_path):
    path = write(tmp_path / "a.cart", seed=1)
    info_old, data_old = open_cartridge(path)
    (extent,) = info_old.extents[(1, "v")]
    old_view = data_old.view(extent, "float16")
    write(path, force=True, seed=2)  # atomic swap onto the mapped path
    np.testing.assert_array_equal(old_view, pages(1, "v", seed=1))  # the old reader's mapping is intact
    info_new, data_new = open_cartridge(path)
    np.testing.assert_array_equal(data_new.view(info_new.extents[(1, "v")][0], "float16"), pages(1, "v", seed=2))
    del old_view
    data_old.close()
    data_new.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cart"]


REBUILDER = """
import sys, types
from pathlib import Path
sys.path.insert(0, {tests!r})
pkg = types.ModuleType("cartridge"); pkg.__path__ = [{pkg!r}]; sys.modules["cartridge"] = pkg
from helpers.cartfiles import write
for i in range({n}):
    write({dest!r}, force=True, seed=i % 2, n_layers=4, n_tokens=40)
"""


def test_readers_during_repeated_rebuilds_see_one_whole_cartridge(tmp_path):
    dest = write(tmp_path / "a.cart", seed=0, n_layers=4, n_tokens=40)
    want = {seed: pages(3, "v", 10, seed=seed) for seed in (0, 1)}
    code = REBUILDER.format(tests=str(HELPERS.parent), pkg=str(ROOT / "cartridge"), n=200, dest=str(dest))
    writer = subprocess.Popen([sys.executable, "-c", code])
    seen, opens = set(), 0
    while writer.poll() is None:
        info, data = open_cartridge(dest)  # raises on any mixture of old and new files
        got = np.array(data.view(info.extents[(3, "v")][0], "float16"))
        seen.update(s for s, w in want.items() if np.array_equal(got, w))
        assert any(np.array_equal(got, w) for w in want.values())
        data.close()
        opens += 1
    assert writer.returncode == 0
    assert opens > 10 and seen == {0, 1}, (opens, seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cart"]
    assert (dest / DATA_NAME).is_file()
