"""Subprocess used by tests/system/test_crash.py: write a synthetic cartridge, printing "ready" once imports
are done so the parent can time a kill. Exits 1 with one "error: ..." line on a CartridgeError.

    python tests/helpers/crash_writer.py DEST --seed S [--force] [--layers N --tokens T --kv H --dim D --page P]
"""

import argparse
import sys
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
# Load cartridge's container modules without running cartridge/__init__ (which imports mlx-lm, 2 s):
# the writer needs only numpy, hashlib and lmdb, and the crash tests start this script dozens of times.
_pkg = types.ModuleType("cartridge")
_pkg.__path__ = [str(TESTS.parent / "cartridge")]
sys.modules["cartridge"] = _pkg

from helpers.cartfiles import write  # noqa: E402

from cartridge.errors import CartridgeError  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("dest")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--force", action="store_true")
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--tokens", type=int, default=7)
ap.add_argument("--kv", type=int, default=2)
ap.add_argument("--dim", type=int, default=8)
ap.add_argument("--page", type=int, default=4)
a = ap.parse_args()
print("ready", flush=True)
try:
    write(a.dest, force=a.force, n_layers=a.layers, n_kv=a.kv, head_dim=a.dim, page=a.page, n_tokens=a.tokens,
          seed=a.seed)
except CartridgeError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
