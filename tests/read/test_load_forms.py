"""`cartridge.load`'s three forms and the entry points they forward to: one cartridge (`read.load.load`), a list
(`cartridge.load_many`), a `group=` (`cartridge.load_sharded`)."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from cartridge import api
from cartridge.compose.composed import ComposedCartridge
from cartridge.distributed.load import ShardedCartridge
from cartridge.errors import InputError
from cartridge.read.loaded import Cartridge

DOC_A = "Section 1. The lessee may terminate the agreement with 30 days of written notice. " * 3
DOC_B = "Annex B. Rent is due on the first day of each month, payable by bank transfer to the lessor. " * 2


@pytest.fixture(scope="module")
def paths(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("forms")
    cartridge.build(DOC_A, d / "a.cart", model=tiny, page_size=16)
    cartridge.build(DOC_B, d / "b.cart", model=tiny, page_size=16)
    return [d / "a.cart", d / "b.cart"]


def _keys(cart):
    """Layer 0's stored K pages as float32 numpy."""
    p = cart.prefixes[0]
    return np.array(p.k_codec.decode(p.k_parts, p.k_params).astype(mx.float32))


def test_the_public_names_are_the_entry_points():
    assert cartridge.load is api.load
    assert cartridge.load_many is api.load_many
    assert cartridge.load_sharded is api.load_sharded
    assert {"load", "load_many", "load_sharded"} <= set(cartridge.__all__)


def test_one_path_loads_one_cartridge(paths, tiny):
    cart = cartridge.load(paths[0], model=tiny)
    assert type(cart) is Cartridge and cart.path == paths[0]
    assert cart.tokens == cartridge.load(paths[0], model=tiny, verify="header").tokens


def test_a_list_is_load_many(paths, tiny):
    listed = cartridge.load(paths, model=tiny, recompute=4, recompute_ratio=0.5)
    many = cartridge.load_many(paths, model=tiny, recompute=4, recompute_ratio=0.5)
    assert type(listed) is ComposedCartridge and type(many) is ComposedCartridge
    assert listed.tokens == many.tokens and listed.recompute_ratio == many.recompute_ratio == 0.5
    assert [c.path for c in listed.carts] == paths


def test_a_group_is_load_sharded(paths, tiny):
    group = mx.distributed.init()  # one process: the rank holds every layer and head
    forwarded = cartridge.load(paths[0], model=tiny, group=group)
    direct = cartridge.load_sharded(paths[0], model=tiny, group=group)
    assert type(forwarded) is ShardedCartridge and forwarded.part == direct.part
    assert forwarded.part.mode == "replicated"
    np.testing.assert_array_equal(_keys(forwarded), _keys(cartridge.load(paths[0], model=tiny)))


@pytest.mark.parametrize("form", ["one", "list", "group"])
def test_a_bad_max_memory_is_refused_in_every_form(paths, tiny, form):
    path = {"one": paths[0], "list": paths, "group": paths[0]}[form]
    group = mx.distributed.init() if form == "group" else None
    with pytest.raises(InputError, match="^max_memory 0: give a positive whole number of bytes$"):
        cartridge.load(path, model=tiny, group=group, max_memory=0)


def test_load_many_needs_two_cartridges(paths, tiny):
    with pytest.raises(InputError, match="at least two"):
        cartridge.load_many(paths[:1], model=tiny)
