"""The bounded LMDB walker: same records as liblmdb on well-formed files, IndexFormatError on crafted
ones (cycles, out-of-range pages, nodes past a page, unsorted keys), and liblmdb never reads."""

import os
import random
import struct

import lmdb
import pytest

from cartridge.errors import IndexFormatError
from cartridge.format.lmdbfile import DB, META_DBS_AT, META_TAIL_AT, NODE, PAGE_HEADER, read_records
from cartridge.format.writer import _write_index


def _lmdb_file(tmp_path, records):
    _write_index(tmp_path, records)
    return (tmp_path / "index.lmdb").read_bytes()


def _liblmdb(path):
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    with env.begin(buffers=False) as txn:
        out = {k.decode(): v for k, v in txn.cursor()}
    env.close()
    return out


@pytest.mark.parametrize("n, max_value", [(1, 10), (40, 300), (600, 3000), (3000, 100), (30, 70000)])
def test_same_records_as_liblmdb(tmp_path, n, max_value):
    rng = random.Random(n)
    records = {f"layer.{i}.{rng.randrange(10 ** 6)}.pages": os.urandom(rng.randrange(max_value)) for i in range(n)}
    buf = _lmdb_file(tmp_path, records)
    got = read_records(buf)
    assert got == _liblmdb(tmp_path / "index.lmdb") == records
    assert list(got) == sorted(records)


# ---------------------------------------------------------------------------------------- crafted files


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """An index with a branch root over several leaves and one overflow value."""
    folder = tmp_path_factory.mktemp("deep")
    records = {f"key.{i:04d}": bytes([i % 251]) * 90 for i in range(200)}
    records["key.big"] = b"\x07" * 9000
    return _lmdb_file(folder, records)


def _geometry(buf):
    psize = DB.unpack_from(buf, META_DBS_AT)[0]
    main = DB.unpack_from(buf, psize + META_DBS_AT + DB.size)
    return psize, main[7], main[2]  # page size, root, depth


def _ptrs(buf, pgno, psize):
    _, _, _, lower, _ = PAGE_HEADER.unpack_from(buf, pgno * psize)
    return list(struct.unpack_from(f"<{(lower - 16) // 2}H", buf, pgno * psize + 16))


def _branch_child_at(buf, i):
    psize, root, depth = _geometry(buf)
    assert depth == 2
    return psize, root, root * psize + _ptrs(buf, root, psize)[i]


def _set_child(buf, node_at, pgno):
    struct.pack_into("<HHH", buf, node_at, pgno & 0xFFFF, (pgno >> 16) & 0xFFFF, pgno >> 32)


def _first_leaf(buf):
    psize, root, _ = _geometry(buf)
    lo, hi, flags, _ = NODE.unpack_from(buf, root * psize + _ptrs(buf, root, psize)[0])
    return psize, lo | hi << 16 | flags << 32


def _big_node(buf):
    """Offset of the F_BIGDATA node's overflow page number."""
    psize = _geometry(buf)[0]
    for pgno in range(2, len(buf) // psize):
        _, _, flags, _, _ = PAGE_HEADER.unpack_from(buf, pgno * psize)
        if flags & 0x02:
            for ptr in _ptrs(buf, pgno, psize):
                _, _, nflags, ksize = NODE.unpack_from(buf, pgno * psize + ptr)
                if nflags == 1:
                    return pgno * psize + ptr + NODE.size + ksize
    raise AssertionError("no overflow node")


def _cycle(buf):
    psize, root, at = _branch_child_at(buf, 1)
    _set_child(buf, at, root)


def _shared_leaf(buf):
    psize, root, at = _branch_child_at(buf, 1)
    _, first = _first_leaf(buf)
    _set_child(buf, at, first)


def _child_out_of_range(buf):
    _set_child(buf, _branch_child_at(buf, 1)[2], 1 << 40)


def _node_past_page(buf):
    psize, leaf = _first_leaf(buf)
    struct.pack_into("<H", buf, leaf * psize + 16, psize - 4)


def _key_past_page(buf):
    psize, leaf = _first_leaf(buf)
    struct.pack_into("<H", buf, leaf * psize + _ptrs(buf, leaf, psize)[0] + 6, 60000)


def _unsorted(buf):
    psize, leaf = _first_leaf(buf)
    ptrs = _ptrs(buf, leaf, psize)
    struct.pack_into("<HH", buf, leaf * psize + 16, ptrs[1], ptrs[0])


def _overflow_to_meta(buf):
    struct.pack_into("<Q", buf, _big_node(buf), 1)


def _overflow_count_huge(buf):
    (first,) = struct.unpack_from("<Q", buf, _big_node(buf))
    struct.pack_into("<I", buf, first * _geometry(buf)[0] + 12, 0xFFFFFFFF)


def _entries_wrong(buf):
    psize = _geometry(buf)[0]
    at = psize + META_DBS_AT + DB.size + 32  # main db md_entries
    struct.pack_into("<Q", buf, at, struct.unpack_from("<Q", buf, at)[0] + 1)


def _last_page_beyond(buf):
    psize = _geometry(buf)[0]
    struct.pack_into("<Q", buf, psize + META_TAIL_AT, len(buf) // psize)


def _page_size_odd(buf):
    struct.pack_into("<I", buf, META_DBS_AT, 3000)


def _version(buf):
    struct.pack_into("<I", buf, _geometry(buf)[0] + 20, 2)


def _lower_odd(buf):
    psize, leaf = _first_leaf(buf)
    struct.pack_into("<H", buf, leaf * psize + 12, 17)


CRAFTED = {
    "branch child is its own parent (cycle)": (_cycle, "referenced twice"),
    "two branch children share a leaf": (_shared_leaf, "referenced twice"),
    "branch child beyond the file": (_child_out_of_range, "outside pages"),
    "node offset past the page": (_node_past_page, "outside"),
    "key length past the page": (_key_past_page, "runs past the page"),
    "keys out of order": (_unsorted, "out of order"),
    "overflow value points at a meta page": (_overflow_to_meta, "outside pages 2.."),
    "overflow page count 2^32-1": (_overflow_count_huge, "outside pages"),
    "entry count differs from meta": (_entries_wrong, "the meta page says"),
    "last page beyond the file": (_last_page_beyond, "last page"),
    "page size not a power of two": (_page_size_odd, "page size 3000"),
    "future LMDB data version": (_version, "LMDB data version 2"),
    "page lower bound odd": (_lower_odd, "out of bounds"),
    "truncated by one page": (lambda b: b.__delitem__(slice(len(b) - _geometry(b)[0], None)), "last page"),
    "cut mid-page": (lambda b: b.__delitem__(slice(len(b) - 100, None)), "whole number"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_index_refused(deep, case):
    buf = bytearray(deep)
    damage, match = CRAFTED[case]
    damage(buf)
    with pytest.raises(IndexFormatError, match=match):
        read_records(bytes(buf))


def test_crafted_base_file_is_valid(deep):
    assert len(read_records(deep)) == 201 and _geometry(deep)[2] == 2


def test_liblmdb_never_reads_a_cartridge(tmp_path, monkeypatch):
    from helpers.cartfiles import write

    from cartridge.format.reader import open_cartridge, verify_cartridge

    path = write(tmp_path / "a.cart")

    def refuse(*a, **k):
        raise AssertionError("liblmdb opened an index on the reading path")

    monkeypatch.setattr(lmdb, "open", refuse)
    info, data = open_cartridge(path)
    assert info.n_layers == 2
    data.close()
    assert verify_cartridge(path).ok
