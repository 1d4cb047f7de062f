"""A bounded, read-only walker of the LMDB data file inside a cartridge (spec/FORMAT.md 4.4).

Why not liblmdb for reading: it trusts its input. Fed copies of a cartridge's index.lmdb with random
byte changes (the digest check bypassed, as a hostile author who recomputes the digest would),
py-lmdb 3.0 (liblmdb 0.9.36) died with SIGBUS on 222 of 20,000 files. A digest stops accidental
damage, not a crafted file. This walker reads the same bytes with every page number, offset and length
checked and each page visited at most once, so a malformed file raises `IndexFormatError` and nothing
else, in time linear in the file size. liblmdb is used only to write.

Layout read (liblmdb 0.9 `mdb.c`, data version 1, 64-bit build; all little-endian):

    page       u64 pgno, u16 pad, u16 flags, u16 lower, u16 upper      (16 bytes; overflow pages hold
               a u32 page count where lower/upper are), then u16 node offsets (lower - 16) / 2 of them
    meta       pages 0 and 1: header, u32 magic 0xBEEFC0DE, u32 version 1, u64 address, u64 mapsize,
               2 x db (free, main), u64 last_pg, u64 txnid; the one with the larger txnid is current
    db         u32 pad (the page size, in the free db), u16 flags, u16 depth, u64 branch_pages,
               u64 leaf_pages, u64 overflow_pages, u64 entries, u64 root
    node       u16 lo, u16 hi, u16 flags, u16 ksize, key, data: a branch node's child is
               lo | hi << 16 | flags << 32; a leaf node's data size is lo | hi << 16, and with flag
               F_BIGDATA its data is a u64 page number of an overflow run
"""

import struct

from ..errors import IndexFormatError

PAGE_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
OVERFLOW_COUNT = struct.Struct("<I")  # at offset 12 of an overflow page
META = struct.Struct("<IIQQ")  # magic, version, address, mapsize (at offset 16)
DB = struct.Struct("<IHHQQQQQ")  # pad/psize, flags, depth, branch, leaf, overflow pages, entries, root
META_TAIL = struct.Struct("<QQ")  # last_pg, txnid (at offset 136)
NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
HEADER_SIZE, META_DBS_AT, META_TAIL_AT = 16, 40, 136
MAGIC, DATA_VERSION = 0xBEEFC0DE, 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_DIRTY = 0x01, 0x02, 0x04, 0x08, 0x10
F_BIGDATA = 0x01
PAGE_SIZES = tuple(1 << n for n in range(9, 17))  # 512 .. 65536 bytes
MAX_DEPTH = 32  # liblmdb's CURSOR_STACK


def _fail(msg):
    raise IndexFormatError(f"index.lmdb: {msg}")


def _meta(buf, pgno, psize):
    """Parse meta page `pgno` -> (main db tuple, last_pg, txnid)."""
    base = pgno * psize
    own, _, flags, _, _ = PAGE_HEADER.unpack_from(buf, base)
    magic, version, _, _ = META.unpack_from(buf, base + HEADER_SIZE)
    if own != pgno or flags != P_META or magic != MAGIC:
        _fail(f"meta page {pgno}: page number {own}, flags 0x{flags:x}, magic 0x{magic:x}; expected {pgno}, 0x8, 0x{MAGIC:x}")
    if version != DATA_VERSION:
        _fail(f"meta page {pgno}: LMDB data version {version}; this reader knows {DATA_VERSION}")
    free = DB.unpack_from(buf, base + META_DBS_AT)
    if free[0] != psize:
        _fail(f"meta page {pgno}: page size {free[0]}, meta page 0 says {psize}")
    main = DB.unpack_from(buf, base + META_DBS_AT + DB.size)
    last_pg, txnid = META_TAIL.unpack_from(buf, base + META_TAIL_AT)
    return main, last_pg, txnid


def _page_size(buf):
    if len(buf) < META_TAIL_AT + META_TAIL.size:
        _fail(f"{len(buf)} bytes; too short for a meta page")
    psize = DB.unpack_from(buf, META_DBS_AT)[0]
    if psize not in PAGE_SIZES:
        _fail(f"page size {psize}; allowed powers of two {PAGE_SIZES[0]}..{PAGE_SIZES[-1]}")
    if len(buf) % psize or len(buf) < 3 * psize:
        _fail(f"{len(buf)} bytes is not a whole number (>= 3) of {psize}-byte pages")
    return psize


class _Walk:
    """State of one walk: the buffer, its geometry and the pages already seen."""

    def __init__(self, buf, psize, last_pg, max_key, max_value):
        self.buf, self.psize, self.last_pg = buf, psize, last_pg
        self.max_key, self.max_value = max_key, max_value
        self.seen = bytearray(last_pg + 1)
        self.seen[0] = self.seen[1] = 1  # the meta pages
        self.counts = {P_BRANCH: 0, P_LEAF: 0, P_OVERFLOW: 0}
        self.records, self.last_key = {}, None

    def claim(self, pgno, n, what):
        """Mark pages pgno .. pgno+n-1 as read; each page may belong to one place only."""
        if not 2 <= pgno or pgno + n - 1 > self.last_pg:
            _fail(f"{what} page {pgno} (+{n - 1}) outside pages 2..{self.last_pg}")
        if any(self.seen[pgno:pgno + n]):
            _fail(f"{what} page {pgno} is referenced twice (a cycle or shared page)")
        self.seen[pgno:pgno + n] = b"\1" * n

    def page(self, pgno, kind):
        """Check page `pgno` of type `kind` and return (base offset, node offsets)."""
        self.claim(pgno, 1, "branch" if kind == P_BRANCH else "leaf")
        base = pgno * self.psize
        own, _, flags, lower, upper = PAGE_HEADER.unpack_from(self.buf, base)
        if own != pgno or flags & ~P_DIRTY != kind:
            _fail(f"page {pgno}: page number {own}, flags 0x{flags:x}; expected {pgno}, 0x{kind:x}")
        if not HEADER_SIZE < lower <= upper <= self.psize or lower % 2:
            _fail(f"page {pgno}: lower {lower}, upper {upper} out of bounds {HEADER_SIZE}..{self.psize}")
        n = (lower - HEADER_SIZE) // 2
        ptrs = struct.unpack_from(f"<{n}H", self.buf, base + HEADER_SIZE)
        for ptr in ptrs:
            if not upper <= ptr <= self.psize - NODE.size or ptr % 2:
                _fail(f"page {pgno}: node at {ptr} outside {upper}..{self.psize - NODE.size}")
        self.counts[kind] += 1
        return base, ptrs

    def node_key(self, pgno, base, ptr):
        lo, hi, flags, ksize = NODE.unpack_from(self.buf, base + ptr)
        end = ptr + NODE.size + ksize
        if end > self.psize:
            _fail(f"page {pgno}: key of {ksize} bytes at {ptr} runs past the page")
        return lo, hi, flags, bytes(self.buf[base + ptr + NODE.size:base + end]), end

    def branch(self, pgno, level, stack):
        base, ptrs = self.page(pgno, P_BRANCH)
        children = []
        for ptr in ptrs:
            lo, hi, flags, _, _ = self.node_key(pgno, base, ptr)
            children.append((lo | hi << 16 | flags << 32, level + 1))
        stack.extend(reversed(children))  # popped in key order

    def leaf(self, pgno):
        base, ptrs = self.page(pgno, P_LEAF)
        for ptr in ptrs:
            lo, hi, flags, key, end = self.node_key(pgno, base, ptr)
            size = lo | hi << 16
            if flags not in (0, F_BIGDATA):
                _fail(f"page {pgno}: node flags 0x{flags:x}; only plain and F_BIGDATA records are allowed")
            if flags == F_BIGDATA:
                value = self.overflow(pgno, base, end, size)
            elif end + size > self.psize:
                _fail(f"page {pgno}: value of {size} bytes at {end} runs past the page")
            else:
                value = bytes(self.buf[base + end:base + end + size])
            self.add(key, value)

    def overflow(self, pgno, base, at, size):
        if at + 8 > self.psize:
            _fail(f"page {pgno}: overflow page number at {at} runs past the page")
        if size > self.max_value:
            _fail(f"page {pgno}: value of {size} bytes exceeds {self.max_value}")
        (first,) = struct.unpack_from("<Q", self.buf, base + at)
        if not 2 <= first <= self.last_pg:
            _fail(f"page {pgno}: overflow page {first} outside pages 2..{self.last_pg}")
        start = first * self.psize
        own, _, flags, _, _ = PAGE_HEADER.unpack_from(self.buf, start)
        (count,) = OVERFLOW_COUNT.unpack_from(self.buf, start + 12)
        if own != first or flags & ~P_DIRTY != P_OVERFLOW or count < 1:
            _fail(f"overflow page {first}: page number {own}, flags 0x{flags:x}, count {count}")
        if HEADER_SIZE + size > count * self.psize:
            _fail(f"overflow page {first}: value of {size} bytes exceeds its {count} pages")
        self.claim(first, count, "overflow")
        self.counts[P_OVERFLOW] += count
        return bytes(self.buf[start + HEADER_SIZE:start + HEADER_SIZE + size])

    def add(self, key, value):
        if not 1 <= len(key) <= self.max_key:
            _fail(f"key of {len(key)} bytes; allowed 1..{self.max_key}")
        if self.last_key is not None and key <= self.last_key:
            _fail(f"key {key[:40]!r} is out of order after {self.last_key[:40]!r}")
        try:
            name = key.decode("ascii")
        except UnicodeDecodeError:
            _fail(f"key {key[:40]!r} is not ASCII")
        self.records[name] = value
        self.last_key = key


def read_records(buf, max_key=511, max_value=1 << 31):
    """Read every key/value record of the main database of an LMDB file held in memory.

    Args:
        buf (bytes | memoryview): the whole file.
        max_key (int): longest key allowed, in bytes. Default: 511 (liblmdb's limit).
        max_value (int): longest value allowed, in bytes. Default: 2^31.

    Returns:
        dict[str, bytes]: records in key order.

    Raises:
        IndexFormatError: on any out-of-bounds page number, offset, length, flag, cycle, unsorted or
        non-ASCII key, or a count that differs from the meta page's.
    """
    psize = _page_size(buf)
    metas = [_meta(buf, i, psize) for i in (0, 1)]
    main, last_pg, _ = metas[metas[0][2] < metas[1][2]]  # liblmdb's mdb_env_pick_meta
    _, flags, depth, n_branch, n_leaf, n_overflow, entries, root = main
    if not 2 <= last_pg < len(buf) // psize:
        _fail(f"last page {last_pg}; the file's pages are 2..{len(buf) // psize - 1}")
    if flags or not 1 <= depth <= MAX_DEPTH:
        _fail(f"main database flags 0x{flags:x}, depth {depth}; expected 0 and 1..{MAX_DEPTH}")
    walk = _Walk(buf, psize, last_pg, max_key, max_value)
    stack = [(root, 0)]
    while stack:
        pgno, level = stack.pop()
        if level < depth - 1:
            walk.branch(pgno, level, stack)
        else:
            walk.leaf(pgno)
    found = (walk.counts[P_BRANCH], walk.counts[P_LEAF], walk.counts[P_OVERFLOW], len(walk.records))
    if found != (n_branch, n_leaf, n_overflow, entries):
        _fail(f"(branch, leaf, overflow pages, entries) are {found}; the meta page says "
              f"{(n_branch, n_leaf, n_overflow, entries)}")
    return walk.records
