"""benchmarks/ stays maintained (issue 32.2): few scripts, each with --help, each listed in
benchmarks/README.md, and every committed result there with what produced it."""

import fnmatch
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
MAX_SCRIPTS = 12
SCRIPTS = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))


def readme_section(title):
    """The text of one `## title` section of benchmarks/README.md."""
    text = (BENCH / "README.md").read_text()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_at_most_twelve_scripts():
    assert len(SCRIPTS) <= MAX_SCRIPTS, SCRIPTS


def test_every_script_is_listed():
    listed = set(re.findall(r"^\| `([^`]+)` \|", readme_section("Scripts"), flags=re.M))
    assert sorted(listed) == SCRIPTS


def test_every_result_has_a_producer():
    patterns = re.findall(r"`([^`]+)`", readme_section("Results").split("|---|---|", 1)[1])
    globs = [p for p in patterns if "." in p or "*" in p]
    unlisted = [f.name for f in sorted((BENCH / "results").iterdir())
                if not any(fnmatch.fnmatch(f.name, g) for g in globs)]
    assert unlisted == []


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.endswith(".py")])
def test_help_runs(script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: ")
