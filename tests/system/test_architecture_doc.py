"""docs/architecture.md stays true to the package (issue 48 item 5): its package list is the one
scripts/architecture_check.py makes from the code, every path it cites exists, and it names every module.
After moving modules, `python scripts/architecture_check.py --write` rewrites the list; the other two checks
name what to edit by hand."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "architecture_check.py"
_spec = importlib.util.spec_from_file_location("architecture_check", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def make_package(root):
    """A tiny package 'cartridge' under `root`: base.py (a leaf), a folder using it, a top module using the folder,
    and two folders that import each other's modules."""
    pkg = root / "cartridge"
    files = {
        "__init__.py": '"""The tiny package."""\n',
        "base.py": '"""The leaf module.\n\nMore words."""\n',
        "top.py": '"""Uses the folder: a first line that\ngoes on."""\nfrom .mid import core\n',
        "mid/__init__.py": "",
        "mid/core.py": '"""Core."""\nfrom .. import base\n',
        "mid/data/x.json": "{}",
        "a/__init__.py": '"""Folder a."""\n',
        "a/one.py": "from ..b import two\n",
        "b/__init__.py": '"""Folder b."""\n',
        "b/two.py": "def f():\n    from ..a import three  # a lazy import counts\n",
        "a/three.py": "from .. import base\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_page_agrees_with_the_code():
    assert check.differences(check.DOC.read_text()) == []


def test_the_script_exits_zero_on_the_page():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_package_list_layers_cycles_and_first_lines(tmp_path):
    pkg = make_package(tmp_path)
    rows = [line.split(None, 2) if not line.startswith("     ") else ["", *line.split(None, 1)]
            for line in check.package_list(pkg)]
    assert rows == [
        ["2", "cartridge/top.py", "Uses the folder: a first line that …"],
        ["1*", "cartridge/a/", "Folder a."],
        ["1*", "cartridge/b/", "Folder b."],
        ["1", "cartridge/mid/", check.NO_DOCSTRING],
        ["", "mid/data/", "data: .json"],
        ["0", "cartridge/__init__.py", "The tiny package."],
        ["0", "cartridge/base.py", "The leaf module."],
    ]


def test_differences_name_what_the_page_gets_wrong(tmp_path):
    pkg = make_package(tmp_path)
    listed = check.package_list(pkg)
    stale = [line.replace("Folder a.", "Folder A, as it was.") for line in listed if "base.py" not in line]
    page = "\n".join([
        "# Architecture", "`mid/core.py`, `a/one.py`, `b/two.py`, `a/three.py` and `cartridge/gone.py`.",
        check.BEGIN, "```text", *stale, "```", check.END])
    paths = check.repository_paths(tmp_path)
    found = check.differences(page, pkg, paths)
    assert found[0] == "package list differs from the code (- page, + code):"
    assert sorted(found[1:4]) == sorted([
        "-" + next(line for line in stale if "Folder A" in line),
        "+" + next(line for line in listed if "Folder a." in line),
        "+" + next(line for line in listed if "base.py" in line)])
    assert found[4:] == ["names a path that does not exist: cartridge/gone.py",
                         "never names this module: cartridge/base.py"]
    fixed = page.replace("`cartridge/gone.py`", "`cartridge/base.py`")
    fixed = fixed.replace("\n".join(stale), "\n".join(listed))
    assert check.differences(fixed, pkg, paths) == []
    assert check.unnamed_modules(fixed.replace("`a/three.py`", "three"), pkg) == ["cartridge/a/three.py"]


def test_a_page_without_the_markers_is_refused(tmp_path):
    pkg = make_package(tmp_path)
    found = check.differences("# Architecture\n", pkg, check.repository_paths(tmp_path))
    assert found[0].startswith("no package list")
