"""tests/ maps the package (issue 48 item 5): each test file sits in the folder of what it tests (the package's
folders, and system/ for end-to-end, command-line and repository checks), shared code sits in tests/helpers/
(fixtures in tests/conftest.py), and no test file imports another test file or conftest.py."""

import ast

from helpers import ROOT

FOLDERS = ("attention", "calibrate", "compose", "distributed", "eval", "format", "grow", "models", "promptcache", "read",
           "serve", "system", "tiers", "write")


def misplaced(tests):
    """Files under `tests` out of place, one line each: a test file outside FOLDERS, a module in a test folder that
    is no test file (a helper: tests/helpers/), a test file in tests/helpers/, a file name used twice."""
    found, seen = [], {}
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        if rel.parts[0] == "helpers":
            if path.name.startswith("test_"):
                found.append(f"{rel}: a test file among the helpers")
        elif len(rel.parts) == 1:
            if rel.name != "conftest.py":
                found.append(f"{rel}: in tests/ itself; put it in a folder of {', '.join(FOLDERS)} or in helpers/")
        elif len(rel.parts) != 2 or rel.parts[0] not in FOLDERS:
            found.append(f"{rel}: not in a folder of {', '.join(FOLDERS)}")
        elif not path.name.startswith("test_"):
            found.append(f"{rel}: not a test file; shared code goes in tests/helpers/")
        elif path.name in seen:  # the folders have no __init__.py: pytest imports each file by its name alone
            found.append(f"{rel}: the same file name as {seen[path.name]}")
        seen.setdefault(path.name, rel)
    return found


def imports_of_tests(tests):
    """`file: module` for each import, module level or in a function, of a test file or conftest by a test file."""
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(tests)}: {name}" for name in names
                      if name.split(".")[0].startswith("test_") or name.split(".")[0] == "conftest"]
    return found


def test_every_test_file_sits_in_the_folder_of_what_it_tests():
    assert misplaced(ROOT / "tests") == []


def test_no_test_file_imports_another_test_file_or_conftest():
    assert imports_of_tests(ROOT / "tests") == []


def test_the_checks_find_each_kind_of_misplaced_file(tmp_path):
    files = {"conftest.py": "", "test_flat.py": "", "format/test_a.py": "", "format/cases.py": "",
             "system/test_a.py": "", "other/test_b.py": "", "helpers/cases.py": "", "helpers/test_c.py": "",
             "tiers/more/test_d.py": "",
             "tiers/test_e.py": "import json\nfrom test_a import x\n\ndef f():\n    import conftest, test_f.sub\n",
             "read/test_g.py": "from helpers.cases import y\nfrom . import test_h\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert [line.split(":")[0] for line in misplaced(tmp_path)] == [
        "format/cases.py", "helpers/test_c.py", "other/test_b.py", "system/test_a.py", "test_flat.py",
        "tiers/more/test_d.py"]
    assert misplaced(tmp_path)[3] == "system/test_a.py: the same file name as format/test_a.py"
    assert imports_of_tests(tmp_path) == [
        "tiers/test_e.py: test_a", "tiers/test_e.py: conftest", "tiers/test_e.py: test_f.sub"]
