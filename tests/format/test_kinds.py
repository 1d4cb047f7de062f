"""The layer-kind table (issue 32.7): one class per kind with the same methods, found through one table;
a kind name outside it is refused by the header parser in one line."""

import shutil
from pathlib import Path

import pytest
from helpers.cartfiles import forge_records
from helpers import VECTORS

import cartridge  # noqa: F401  (first: loads OpenBLAS before mlx)
from cartridge.storage import kinds as cache_kinds
from cartridge.errors import FieldError
from cartridge.format import keys as K
from cartridge.format import kinds as header_kinds
from cartridge.format.reader import open_cartridge

HEADER_METHODS = ("parse", "units", "stored_tokens", "components", "describe", "holds")
CACHE_METHODS = ("layer_plan", "unrouted", "write", "load", "restore", "planned_bytes")
ATTRIBUTES = ("tiered", "stores_every_token", "fixed", "tier_label", "cache_type")


def test_the_cache_table_extends_the_header_table_kind_for_kind():
    assert list(header_kinds.KINDS) == ["attention", "dense", "window", "state", "list"]
    assert list(cache_kinds.KINDS) == list(header_kinds.KINDS)
    for name, kind in cache_kinds.KINDS.items():
        assert kind.name == name
        assert isinstance(kind, type(header_kinds.KINDS[name]))


@pytest.mark.parametrize("name", list(cache_kinds.KINDS))
def test_every_kind_implements_every_method(name):
    kind = cache_kinds.KINDS[name]
    for method in HEADER_METHODS + CACHE_METHODS:
        assert callable(getattr(kind, method)), (name, method)
    for method in CACHE_METHODS:  # none left to the base's NotImplementedError
        assert getattr(type(kind), method) is not getattr(cache_kinds.CacheKind, method), (name, method)
    for attribute in ATTRIBUTES:
        assert hasattr(kind, attribute), (name, attribute)


def test_only_attention_and_dense_store_every_token_and_only_state_and_list_are_untiered():
    kinds = header_kinds.KINDS
    assert [n for n, k in kinds.items() if k.stores_every_token] == ["attention", "dense"]
    assert [n for n, k in kinds.items() if not k.tiered] == ["state", "list"]
    assert [n for n, k in kinds.items() if k.fixed] == ["window", "state"]
    assert [k.stored_tokens(100, 16) for k in kinds.values()] == [100, 100, 16, 0, 0]


def test_a_kind_outside_the_table_is_refused_in_one_line(tmp_path):
    path = Path(shutil.copytree(VECTORS / "tiny-1.4.cart", tmp_path / "v.cart"))
    forge_records(path, lambda r: {**r, K.layer_kind(0): b'"latent"'})
    with pytest.raises(FieldError) as e:
        open_cartridge(path)
    assert str(e.value) == f"cartridge {path}: layer.0.kind is 'latent'; allowed attention, dense, window, state, list"


def test_a_list_inside_a_list_is_refused_naming_the_kinds_a_cache_may_be():
    records = {K.layer_kind(0): b'"list"', K.layer_caches(0): b"1", K.layer_kind("0.0"): b'"list"'}
    with pytest.raises(FieldError) as e:
        header_kinds.parse_kind(records, 0, 3)
    assert str(e.value) == "layer.0.0.kind is 'list'; allowed attention, dense, window, state"
