"""Damaged and hostile files: every page, every manifest byte, index bytes, truncations, absurd sizes
(refused before allocating), versions, and the order "digest before LMDB walk"."""

import os
import struct

import pytest
from helpers.cartfiles import flip, forge_index_bytes, forge_records, pages, peak_bytes, redigest_manifest, write

import cartridge.format.container as container
from cartridge.errors import (
    CartridgeError,
    ChecksumError,
    DigestError,
    FieldError,
    IndexFormatError,
    LayoutError,
    NotACartridgeError,
    TruncatedError,
    UnsupportedVersionError,
)
from cartridge.format import keys as K
from cartridge.format.layout import ALIGN, DATA_NAME, INDEX_NAME, MANIFEST_NAME
from cartridge.format.reader import open_cartridge, verify_cartridge

N_LAYERS, N_PAGES, PAGE_BYTES = 2, 2, 2 * 4 * 8 * 2  # synthetic cartridge: 2 heads x 4 tokens x 8 x fp16


@pytest.fixture
def cart(tmp_path):
    return write(tmp_path / "a.cart")


def _open(path):
    info, data = open_cartridge(path)
    data.close()
    return info


@pytest.mark.parametrize("layer, side, page", [(l, s, p) for l in range(N_LAYERS) for s in "kv" for p in range(N_PAGES)])
def test_flipped_byte_in_any_page_names_that_page(cart, layer, side, page):
    extent = 2 * layer + (side == "v")
    flip(cart / DATA_NAME, extent * ALIGN + page * PAGE_BYTES + 37)
    with pytest.raises(ChecksumError) as e:
        _open(cart)
    assert (e.value.layer, e.value.side, e.value.component, e.value.page) == (layer, side, "values", page)
    assert f"layer {layer}, side {side}, component values, page {page}" in str(e.value)
    report = verify_cartridge(cart)
    assert report.bad_pages == [{"layer": layer, "side": side, "component": "values", "page": page}]
    info, data = open_cartridge(cart, verify="header")  # the caller asked to skip page checksums
    data.close()


def _manifest_class(offset):
    if offset < 8:
        return NotACartridgeError
    if offset in (8, 9):
        return UnsupportedVersionError
    return DigestError


@pytest.mark.parametrize("bit", [0x01, 0x80])
def test_every_manifest_byte_flip_is_refused(cart, bit):
    for offset in range(96):
        flip(cart / MANIFEST_NAME, offset, bit)
        with pytest.raises(CartridgeError) as e:
            _open(cart)
        assert type(e.value) is _manifest_class(offset), (offset, repr(e.value))
        flip(cart / MANIFEST_NAME, offset, bit)
    _open(cart)


def test_index_byte_flips_are_refused_by_the_digest(cart):
    size = os.path.getsize(cart / INDEX_NAME)
    for offset in range(0, size, 7):
        flip(cart / INDEX_NAME, offset)
        with pytest.raises(DigestError):
            _open(cart)
        flip(cart / INDEX_NAME, offset)
    _open(cart)


@pytest.mark.parametrize("name, keep", [
    (MANIFEST_NAME, 0), (MANIFEST_NAME, 11), (MANIFEST_NAME, 12), (MANIFEST_NAME, 64), (MANIFEST_NAME, 95),
    (INDEX_NAME, 0), (INDEX_NAME, 1), (INDEX_NAME, 4096), (INDEX_NAME, -1),
    (DATA_NAME, 0), (DATA_NAME, 1), (DATA_NAME, ALIGN), (DATA_NAME, 3 * ALIGN + 100), (DATA_NAME, -1),
])
def test_truncation_is_refused(cart, name, keep):
    path = cart / name
    size = os.path.getsize(path)
    os.truncate(path, size + keep if keep < 0 else keep)
    expected = NotACartridgeError if name == MANIFEST_NAME and keep < 12 else TruncatedError
    with pytest.raises(expected):
        _open(cart)
    assert not verify_cartridge(cart).ok


ABSURD = {  # claim -> (damage, error): each claim would allocate gigabytes if believed
    "index_size 2^40": (lambda p: redigest_manifest(p, lambda r: struct.pack_into("<Q", r, 16, 1 << 40)), FieldError),
    "data_size 2^60": (lambda p: redigest_manifest(p, lambda r: struct.pack_into("<Q", r, 24, 1 << 60)), TruncatedError),
    "tokens.count 2^31-1": (lambda p: forge_records(p, lambda r: {**r, K.TOKENS_COUNT: b"2147483647"}), FieldError),
    "n_pages 2^31 with 2^31-1 tokens of 1 per page": (lambda p: forge_records(p, lambda r: {
        **r, K.TOKENS_COUNT: b"2147483647", K.PAGE_SIZE: b"1", K.N_PAGES: b"2147483647"}), FieldError),
    "pages of 1024 heads x 65536 tokens x 4096 dims": (lambda p: forge_records(p, lambda r: {
        **r, K.N_KV_HEADS: b"1024", K.HEAD_DIM: b"4096", K.PAGE_SIZE: b"65536", K.N_PAGES: b"1",
        **{K.layer_components(i, s): b'[{"dtype":"float16","name":"values","width":4096}]' for i in range(2) for s in "kv"}}),
        LayoutError),
    "page table longer than n_pages": (lambda p: forge_records(p, lambda r: {**r, K.page_table(0, "k", "values"): b"\0" * 48 * 3}), LayoutError),
}


@pytest.mark.parametrize("claim", sorted(ABSURD))
def test_absurd_sizes_refused_before_allocation(cart, claim):
    damage, error = ABSURD[claim]
    damage(cart)
    with pytest.raises(error):
        _open(cart)
    peak = peak_bytes(lambda: pytest.raises(error, _open, cart))
    assert peak < 1 << 20, f"{claim}: {peak:,} bytes allocated before refusing"


def test_unknown_future_major_is_named(cart):
    redigest_manifest(cart, lambda r: struct.pack_into("<H", r, 8, 7))
    with pytest.raises(UnsupportedVersionError, match="cartridge file is format 7; this cartridge reads up to 1"):
        _open(cart)


def test_unknown_minor_and_fields_are_ignored(cart):
    before = _open(cart)
    forge_records(cart, lambda r: {**r, K.FORMAT_MINOR: b"99", "cartridge.future_field": b'{"x":[1,2]}',
                                  "layer.0.k.future_stat": b"3.5", "zzz.binary": b"\xff\x00\x01"})
    redigest_manifest(cart, lambda r: struct.pack_into("<H", r, 10, 99))
    info = _open(cart)
    assert info.format_version == "1.99"
    assert info.tokens.tolist() == before.tokens.tolist() and info.extents == before.extents
    assert verify_cartridge(cart).ok


def test_index_is_walked_only_after_its_digest_matched(cart, monkeypatch):
    """Ordering: damaged bytes never reach the LMDB walker; forged-digest garbage does, and is refused."""
    calls = []
    real = container.read_records
    monkeypatch.setattr(container, "read_records", lambda *a: calls.append(1) or real(*a))
    garbage = bytes(range(256)) * 48  # not an LMDB file
    (cart / INDEX_NAME).write_bytes(garbage[:os.path.getsize(cart / INDEX_NAME)])
    with pytest.raises(DigestError):
        _open(cart)
    assert calls == []  # refused by the digest: the walker never saw the bytes
    forge_index_bytes(cart, garbage)
    with pytest.raises(IndexFormatError):
        _open(cart)
    assert calls == [1]  # the digest matched the forgery, so the walker ran, and refused it


def test_damaged_page_data_never_reaches_an_answer(cart):
    """verify="pages" (the default) refuses before any page is mapped into an array."""
    flip(cart / DATA_NAME, 5)
    with pytest.raises(ChecksumError):
        open_cartridge(cart)
    flip(cart / DATA_NAME, 5)
    info, data = open_cartridge(cart)
    (extent,) = info.extents[(0, "k")]
    assert (data.view(extent, "float16") == pages(0, "k")).all()
    data.close()
