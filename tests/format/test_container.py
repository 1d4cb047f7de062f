"""Container v1: exact layout, deterministic bytes, atomic publish, and rejection of damaged files."""

import hashlib
import os
import struct

import numpy as np
import pytest
from helpers.cartfiles import pages, write

from cartridge.errors import (
    ChecksumError,
    CorruptCartridgeError,
    NotACartridgeError,
    OutputExistsError,
    UnsupportedVersionError,
)
from cartridge.format import keys as K
from cartridge.format.container import read_index, read_manifest
from cartridge.format.header import parse_header
from cartridge.format.layout import ALIGN, DATA_NAME, INDEX_NAME, MANIFEST_NAME, MANIFEST_SIZE
from cartridge.format.reader import open_cartridge
from cartridge.format.writer import CartridgeWriter

N_LAYERS, N_KV, HEAD_DIM, PAGE, N_TOKENS = 2, 2, 8, 4, 7
N_PAGES = 2


def test_round_trip_and_layout(tmp_path):
    path = write(tmp_path / "a.cart")
    assert sorted(os.listdir(path)) == [MANIFEST_NAME, INDEX_NAME, DATA_NAME]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary left behind
    info, data = open_cartridge(path)
    assert info.tokens.tolist() == list(range(N_TOKENS))
    assert info.tiers == [{"layer": i, "k": "fp16", "v": "fp16"} for i in range(N_LAYERS)]
    offsets = [e.offset for ex in info.extents.values() for e in ex]
    page_bytes = N_KV * PAGE * HEAD_DIM * 2
    assert offsets == [i * ALIGN for i in range(4)]  # each extent 16 KiB-aligned, in (layer, side) order
    assert os.path.getsize(path / DATA_NAME) == 4 * ALIGN
    for (layer, side), (extent,) in info.extents.items():
        assert extent.page_bytes == page_bytes
        np.testing.assert_array_equal(data.view(extent, "float16"), pages(layer, side))
    assert info.bytes_per_token() == N_LAYERS * 2 * N_KV * HEAD_DIM * 2


def test_writer_is_deterministic(tmp_path):
    a, b = write(tmp_path / "a.cart"), write(tmp_path / "b.cart")
    for name in (MANIFEST_NAME, INDEX_NAME, DATA_NAME):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_manifest_bytes(tmp_path):
    path = write(tmp_path / "a.cart")
    raw = (path / MANIFEST_NAME).read_bytes()
    assert len(raw) == MANIFEST_SIZE == 96
    magic, major, minor, size, index_size, data_size = struct.unpack_from("<8sHHIQQ", raw)
    assert (magic, major, minor, size) == (b"CARTRIDG", 1, 2, 96)
    assert index_size == os.path.getsize(path / INDEX_NAME)
    assert data_size == os.path.getsize(path / DATA_NAME)
    assert raw[32:64] == hashlib.sha256((path / INDEX_NAME).read_bytes()).digest()
    assert raw[64:] == hashlib.sha256(raw[:64]).digest()


def test_existing_output_refused_unless_force(tmp_path):
    path = write(tmp_path / "a.cart")
    with pytest.raises(OutputExistsError, match="--force"):
        write(path)
    write(path, force=True)
    open_cartridge(path)
    (tmp_path / "file.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match="not a cartridge"):
        write(tmp_path / "file.txt", force=True)
    assert (tmp_path / "file.txt").read_text() == "keep me"


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with CartridgeWriter(tmp_path / "a.cart") as w:
            w.add_extent(0, "k", "values", pages(0, "k"))
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("case, error, match", [
    ("no manifest", NotACartridgeError, "no MANIFEST"),
    ("bad magic", NotACartridgeError, "bad magic"),
    ("future major", UnsupportedVersionError, "format 2; this cartridge reads up to 1"),
    ("manifest byte", CorruptCartridgeError, "manifest checksum"),
    ("index byte", CorruptCartridgeError, "SHA-256 does not match"),
    ("data truncated", CorruptCartridgeError, r"^cartridge \S+a\.cart: pages\.bin is truncated: [\d,]+ bytes, its manifest says [\d,]+$"),
    ("page byte", ChecksumError, "layer 1, side v, component values, page 1"),
])
def test_damaged_files_are_refused(tmp_path, case, error, match):
    path = write(tmp_path / "a.cart")
    m, i, d = path / MANIFEST_NAME, path / INDEX_NAME, path / DATA_NAME
    if case == "no manifest":
        m.unlink()
    elif case == "bad magic":
        _flip(m, 0)
    elif case == "future major":
        raw = bytearray(m.read_bytes())
        raw[8:10] = struct.pack("<H", 2)
        m.write_bytes(bytes(raw))
    elif case == "manifest byte":
        _flip(m, 20)
    elif case == "index byte":
        _flip(i, os.path.getsize(i) // 2)
    elif case == "data truncated":
        os.truncate(d, os.path.getsize(d) - ALIGN)
    elif case == "page byte":
        _flip(d, 3 * ALIGN + N_KV * PAGE * HEAD_DIM * 2 + 5)
    with pytest.raises(error, match=match):
        open_cartridge(path)


def test_header_bounds_checked_before_use(tmp_path):
    path = write(tmp_path / "a.cart")
    manifest = read_manifest(path)
    records = read_index(path, manifest)
    bad = dict(records, **{K.N_KV_HEADS: b"100000"})
    with pytest.raises(CorruptCartridgeError, match="allowed 1..1024"):
        parse_header(bad, manifest)
    bad = dict(records, **{K.N_PAGES: b"3"})
    with pytest.raises(CorruptCartridgeError, match="n_pages"):
        parse_header(bad, manifest)
    bad = dict(records, **{K.layer_tier(1, "v"): b'"int3"'})
    with pytest.raises(CorruptCartridgeError, match="unknown tier"):
        parse_header(bad, manifest)
    unknown = dict(records, **{"cartridge.some_future_field": b'"ignored"'})
    assert parse_header(unknown, manifest).n_layers == N_LAYERS


def test_header_matches_json_schema(tmp_path):
    import json

    import jsonschema
    from helpers import ROOT

    path = write(tmp_path / "a.cart")
    records = read_index(path, read_manifest(path))
    binary = {k for k in records if k == K.TOKENS_IDS or k.endswith((".pages", ".head_sums"))}
    header = {k: json.loads(v) for k, v in records.items() if k not in binary}
    schema = json.loads((ROOT / "spec" / "header.schema.json").read_text())
    jsonschema.validate(header, schema)
    header[K.N_KV_HEADS] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(header, schema)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_threaded_page_check_names_the_first_bad_page(tmp_path, threads):
    """Pages split over threads: every page is hashed, and the error names the first bad one in extent
    order whichever thread found it (here two bad pages: layer 0 k page 1 and layer 1 v page 0)."""
    from cartridge.format.container import check_index, open_snapshot
    from cartridge.format.pagefile import PageData

    path = write(tmp_path / "a.cart")
    page_bytes = N_KV * PAGE * HEAD_DIM * 2
    _flip(path / DATA_NAME, 3 * ALIGN + 7)  # layer 1 v, page 0
    _flip(path / DATA_NAME, page_bytes + 2)  # layer 0 k, page 1
    snap = open_snapshot(path)
    data = PageData(snap.data)
    info = parse_header(check_index(snap.index, snap.manifest), snap.manifest)
    extents = [e for ex in info.extents.values() for e in ex]
    with pytest.raises(ChecksumError, match="layer 0, side k, component values, page 1") as e:
        data.verify_all(extents, threads)
    assert (e.value.layer, e.value.side, e.value.page) == (0, "k", 1)
    data.verify_all(extents[1:3], threads)  # the two good extents pass
    data.close()


def test_page_runs_cover_every_page_once_in_order():
    from cartridge.format.pagefile import _runs

    items = list(range(10))
    for n in (1, 2, 3, 4, 10, 20):
        runs = _runs(items, [1] * 10, n)
        assert [x for r in runs for x in r] == items
        assert len(runs) == min(n, 10) and all(runs)
    assert _runs([], [], 4) == [[]]
