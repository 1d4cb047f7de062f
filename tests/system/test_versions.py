"""The mlx / mlx-lm this runs on are inside pyproject.toml's ranges, the versions checked under mlx-lm's
generation loops (docs/python.md#versions-checked): a venv moved outside them fails here, not silently."""

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[2]


def _requirements():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return {r.name: r for r in reqs if r.name in ("mlx", "mlx-lm") and (r.marker is None or r.marker.evaluate())}


def test_every_mlx_requirement_has_an_upper_bound():
    reqs = _requirements()
    assert set(reqs) == {"mlx", "mlx-lm"}
    for r in reqs.values():
        assert any(s.operator == "<" for s in r.specifier), f"{r} allows versions nobody checked"


@pytest.mark.parametrize("name", ["mlx", "mlx-lm"])
def test_the_installed_version_is_one_the_ranges_allow(name):
    installed = importlib.metadata.version(name)
    assert _requirements()[name].specifier.contains(installed), f"{name} {installed} is outside pyproject.toml"


def test_the_docs_name_the_ranges_of_pyproject():
    text = (ROOT / "docs" / "python.md").read_text()
    section = text[text.index("## Versions checked"):]
    for r in _requirements().values():
        low = next(s.version for s in r.specifier if s.operator == ">=")
        high = next(s.version for s in r.specifier if s.operator == "<")
        assert re.search(rf"{re.escape(r.name)} >= ?{re.escape(low)}, < ?{re.escape(high)}", section), r
