"""`python -m cartridge` and `python -m cartridge.cli.entry` run the `cartridge` command, as the console script does."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["cartridge", "cartridge.cli.entry"])
def test_python_m_runs_the_command(module, tmp_path):
    help_ = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and help_.stdout.startswith("Usage: cartridge ") and "inspect" in help_.stdout
    missing = subprocess.run([sys.executable, "-m", module, "inspect", str(tmp_path / "none.cart")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.startswith("error: ") and len(missing.stderr.splitlines()) == 1, missing.stderr
