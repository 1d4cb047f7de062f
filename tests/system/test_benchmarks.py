"""benchmarks/ stays maintained (issue 32.2): few scripts, each with --help, each listed in
benchmarks/README.md, and every committed result there with what produced it."""

import fnmatch
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


# Every script's `--help` in ONE interpreter, each run as `python benchmarks/SCRIPT --help` would run it (its folder
# first on sys.path, __main__): the interpreter start and the imports of MLX, mlx-lm and transformers, ~1 s of CPU a
# script, are paid once. Its last line: {script: [exit status, stdout, stderr]} as JSON.
HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback
import cartridge  # first, as each script imports it: OpenBLAS before mlx
scripts, results = sys.argv[1:], {}
for path in scripts:
    sys.argv, out, err, code = [path, "--help"], io.StringIO(), io.StringIO(), 0
    sys.path.insert(0, path.rsplit("/", 1)[0])
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            code = 1
            traceback.print_exc()
    sys.path.pop(0)
    results[path.rsplit("/", 1)[1]] = [code, out.getvalue(), err.getvalue()]
sys.__stdout__.write("\\n" + json.dumps(results))  # the last line
"""


@pytest.fixture(scope="module")
def helps():
    """{script: (exit status, stdout, stderr)} of every Python script's --help, from one interpreter."""
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    scripts = [str(BENCH / s) for s in SCRIPTS if s.endswith(".py")]
    done = subprocess.run([sys.executable, "-c", HELP_ALL, *scripts], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.rsplit("\n", 1)[-1])


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.endswith(".py")])
def test_help_runs(script, helps):
    code, stdout, stderr = helps[script]
    assert code == 0, stderr[-2000:]
    assert stdout.startswith("usage: ")


def private_cartridge_names(source):
    """'line: name' for each private name a script takes from cartridge: `from cartridge.x import _y`, or
    `m._y` on a module it imported from cartridge."""
    import ast

    tree, found, modules = ast.parse(source), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cartridge"):
            found += [f"{node.lineno}: {a.name}" for a in node.names if a.name.startswith("_")]
            modules |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("cartridge")}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and ast.unparse(node.value).split(".")[0] in modules):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_the_private_name_check_finds_what_it_looks_for():
    source = "from cartridge.eval import bench\nfrom cartridge.x import _y\nimport cartridge\nbench._kv(1)\n" \
             "cartridge.tiers._z\nother._w\n"
    assert private_cartridge_names(source) == ["2: _y", "4: bench._kv", "5: cartridge.tiers._z"]


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.endswith(".py")])
def test_scripts_use_only_public_cartridge_names(script):
    assert private_cartridge_names((BENCH / script).read_text()) == []


def test_int5_prototype_codec():
    """agreement.py's benchmark-only int5 (issue 33): 144 B per layer-side at kv_dim 192, the CPU decode equals
    mx.dequantize(bits=5) of the same codes, |x_hat - x| <= scale / 2, int5+rot undoes its rotation, and importing
    the script leaves the registry alone (only `presets` adds the prototypes)."""
    import importlib.util

    import cartridge  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx
    from cartridge.tiers import TIERS

    spec = importlib.util.spec_from_file_location("agreement_script", BENCH / "agreement.py")
    agreement = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agreement)
    assert "int5" not in TIERS and "int5+rot" not in TIERS
    plain, rot = agreement.PROTOTYPES["int5"], agreement.PROTOTYPES["int5+rot"]
    assert plain.bytes_per_token(3, 64) == rot.bytes_per_token(3, 64) == 144
    x = mx.random.normal((3, 40, 64), key=mx.random.key(5)) * 3  # (n_kv, T, D)
    params = plain.make_params(x, 0, "k")
    parts = plain.encode(x, params)
    assert parts["codes"].shape == (3, 40, 10) and parts["scales"].shape == (3, 40, 2)
    with mx.stream(mx.cpu):
        got = plain.decode(parts, params)
        ref = mx.dequantize(parts["codes"], parts["scales"].astype(mx.float32), parts["biases"].astype(mx.float32),
                            group_size=32, bits=5, dtype=mx.float32)
        assert mx.array_equal(got, ref).item()
        half = mx.repeat(parts["scales"].astype(mx.float32), 32, axis=-1) / 2
        assert mx.all(mx.abs(got - x) <= half * (1 + 1e-5)).item()
        rparams = rot.make_params(x, 3, "v")
        back = rot.decode(rot.encode(x, rparams), rparams)
        err = float(mx.sqrt(mx.mean((back - x) ** 2)))
        assert 0 < err < 0.5 * float(mx.sqrt(mx.mean(x ** 2))) / 8  # 5 bits: well under 1/16 of the RMS
