"""tiers/registry: the tier registry sits below tiers/schema, so the package imports both at the top
(issue 32.9: no cycle through `tiers/__init__`)."""

import ast
from pathlib import Path

import pytest

from cartridge.errors import InputError
from cartridge.tiers import registry, schema

TIERS_DIR = Path(registry.__file__).parent


def package_names_imported(path):
    """Names a module takes from its own package (`from . import X`) that are not submodules."""
    tree = ast.parse(path.read_text())
    return [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node.level == 1 and node.module is None for alias in node.names
            if not (TIERS_DIR / f"{alias.name}.py").exists()]


@pytest.mark.parametrize("name", ["registry.py", "schema.py"])
def test_takes_nothing_from_the_package(name):
    assert package_names_imported(TIERS_DIR / name) == []


def test_package_reexports_the_registry():
    import cartridge.tiers as tiers

    assert tiers.get_tier is registry.get_tier and tiers.TIERS is registry.TIERS
    assert schema.get_tier is registry.get_tier
    assert "noqa: E402" not in (TIERS_DIR / "__init__.py").read_text()


def test_unknown_tier_refused():
    with pytest.raises(InputError, match="unknown tier 'int3'"):
        registry.get_tier("int3")
