"""Crash safety: a writer SIGKILLed at any stage, or after random delays, leaves no cartridge or the
previous one (whole) at the destination, and the next build removes its stale temporaries; a file
size limit or a full disk gives one clear error and leaves nothing behind."""

import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cartfiles import files, write
from helpers.clirun import run_inprocess
from helpers import HELPERS

import cartridge
from cartridge.format.atomic import CRASH_ENV
from cartridge.format.reader import verify_cartridge

WRITER = HELPERS / "crash_writer.py"
BEFORE_SWAP = ["temp-created", "extent-written", "data-synced", "index-written", "manifest-written",
               "before-publish"]
AFTER_SWAP = ["after-exchange", "published"]


def run_writer(dest, *args, crash=None, preexec=None, timeout=120):
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    if crash:
        env[CRASH_ENV] = crash
    return subprocess.run([sys.executable, str(WRITER), str(dest), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=preexec)


def siblings(dest):
    """Hidden temporaries of `dest` beside it."""
    return sorted(p.name for p in Path(dest).parent.iterdir() if p.name.startswith(f".{Path(dest).name}."))


@pytest.mark.parametrize("stage", BEFORE_SWAP + ["published"])
def test_kill_at_stage_with_no_previous_cartridge(tmp_path, stage):
    dest = tmp_path / "a.cart"
    r = run_writer(dest, "--seed", 2, crash=stage)
    assert r.returncode == -signal.SIGKILL, r.stderr
    if stage == "published":  # killed after the rename: the new cartridge is whole
        assert verify_cartridge(dest).ok
    else:
        assert not dest.exists()
        assert len(siblings(dest)) == 1  # the dead writer's temporary
        assert run_writer(tmp_path / "b.cart", "--seed", 2).returncode == 0  # another build in the folder
        assert len(siblings(dest)) == 1  # ... leaves a.cart's temporaries alone
    assert run_writer(dest, "--seed", 2, "--force").returncode == 0  # the next build of a.cart
    assert verify_cartridge(dest).ok
    assert siblings(dest) == []  # ... removed the dead writer's temporary


@pytest.mark.parametrize("stage", BEFORE_SWAP + AFTER_SWAP)
def test_kill_at_stage_while_replacing(tmp_path, stage):
    dest = write(tmp_path / "a.cart", seed=1)
    old = files(dest)
    new = files(write(tmp_path / "expected.cart", seed=2))
    r = run_writer(dest, "--seed", 2, "--force", crash=stage)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert verify_cartridge(dest).ok
    assert files(dest) == (new if stage in AFTER_SWAP else old)
    assert run_writer(dest, "--seed", 3, "--force").returncode == 0
    assert siblings(dest) == []


# 4 kills in make test, 8 under slow: the same property at more moments (each kill a new writer process)
@pytest.mark.parametrize("n_kills", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_kill_after_random_delays(tmp_path, n_kills):
    """A 52 MB write killed at n_kills seeded random moments over its whole duration (timed first): the
    destination always holds a whole, verified cartridge: the previous one, or the new one once published."""
    big = ["--layers", 16, "--tokens", 1600, "--kv", 8, "--dim", 64, "--page", 256]
    dest = tmp_path / "big.cart"
    t0 = time.perf_counter()
    assert run_writer(dest, "--seed", 100, *big).returncode == 0
    duration = time.perf_counter() - t0
    rng = random.Random(6)
    outcomes = []
    for i in range(n_kills):
        previous = files(dest)
        env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
        p = subprocess.Popen([sys.executable, str(WRITER), str(dest), "--seed", str(i), "--force", *map(str, big)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 1.3 * duration))
        p.send_signal(signal.SIGKILL)
        rc = p.wait(timeout=60)
        assert verify_cartridge(dest).ok
        now = files(dest)
        outcomes.append("old" if now == previous else "new, finished" if rc == 0 else "new, killed after publishing")
    assert run_writer(dest, "--seed", 99, "--force", *big).returncode == 0
    assert siblings(dest) == []
    print("outcomes", outcomes)


def _fsize_limit(n):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))


@pytest.mark.parametrize("limit, args, stage", [
    (20000, [], "writing pages.bin"),
    (100000, ["--layers", 1, "--kv", 1, "--dim", 1, "--page", 1, "--tokens", 2000], "writing index.lmdb"),
])
def test_file_size_limit_fails_cleanly(tmp_path, limit, args, stage):
    dest = tmp_path / "a.cart"
    for force in (False, True):
        r = run_writer(dest, *args, *(["--force"] if force else []), preexec=_fsize_limit(limit))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert lines[0].startswith(f"error: could not write cartridge {dest} ({stage})")
        assert lines[0].endswith("nothing was left behind")
        if not force:
            assert os.listdir(tmp_path) == []
            write(dest, seed=5)  # now a previous cartridge exists: it must survive the failed replace
            old = files(dest)
    assert files(dest) == old and os.listdir(tmp_path) == ["a.cart"]


@pytest.fixture
def small_disk(tmp_path):
    """A 300 KiB tmpfs (needs root and mount; skipped elsewhere)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_fails_cleanly(small_disk):
    dest = small_disk / "a.cart"
    r = run_writer(dest, "--layers", 16)  # 32 extents x 16 KiB > 300 KiB
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "No space left on device" in lines[0] and lines[0].endswith("nothing was left behind")
    assert os.listdir(small_disk) == []
    assert run_writer(dest, "--layers", 2).returncode == 0  # the space was given back


def test_cli_build_killed_or_out_of_space_keeps_the_previous_cartridge(tiny_dir, tmp_path):
    """The real command: `cartridge build --force` killed at two stages, then under a 40 KB file limit."""
    corpus = tmp_path / "doc.txt"
    corpus.write_text("The tenant may terminate this lease with 60 days of notice. " * 4)
    dest = tmp_path / "doc.cart"
    cmd = [sys.executable, "-m", "cartridge.cli.main", "build", str(corpus), "-o", str(dest), "--model", str(tiny_dir),
           "--page-size", "16"]
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    cartridge.build(corpus.read_text(), dest, model=str(tiny_dir), page_size=16)  # the previous cartridge
    old = files(dest)
    corpus.write_text("Rent is 900 euros a month, due on the first day. " * 4)
    for stage in ("extent-written", "before-publish"):
        r = subprocess.run(cmd + ["--force"], env={**env, CRASH_ENV: stage}, capture_output=True, timeout=300)
        assert r.returncode == -signal.SIGKILL
        assert files(dest) == old and verify_cartridge(dest).ok
    r = subprocess.run(cmd + ["--force"], env=env, capture_output=True, text=True, timeout=300,
                       preexec_fn=_fsize_limit(40000))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (f"error: could not write cartridge {dest} (writing pages.bin): "
                                                 "File too large; nothing was left behind")
    assert files(dest) == old and siblings(dest) == []  # this build also removed the two killed builds' temps
    assert run_inprocess(*cmd[3:], "--force").returncode == 0  # the process is not the point here
    assert files(dest) != old and verify_cartridge(dest).ok
