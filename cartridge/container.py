"""The on-disk container, format v1 (spec/FORMAT.md is normative; this module follows it).

A cartridge is a directory holding three files:

    MANIFEST    96 bytes: magic, version, sizes, SHA-256 of index.lmdb, SHA-256 of itself
    index.lmdb  LMDB environment (one file): header keys, token ids, tier schema, page tables
    pages.bin   page payloads: one extent per (layer, side, component), each 16 KiB-aligned

It is written into a hidden sibling directory and renamed into place only when complete.
"""

import ctypes
import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from . import keys as K
from .errors import (
    ChecksumError,
    CorruptCartridgeError,
    NotACartridgeError,
    OutputExistsError,
    UnsupportedVersionError,
)

MAGIC = b"CARTRIDG"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
MANIFEST_NAME, INDEX_NAME, DATA_NAME = "MANIFEST", "index.lmdb", "pages.bin"
MANIFEST_STRUCT = struct.Struct("<8sHHIQQ32s")  # magic, major, minor, manifest_size, index_size, data_size, index sha256
MANIFEST_SIZE = MANIFEST_STRUCT.size + 32  # + sha256 of the preceding 64 bytes
ALIGN = 16384
PAGE_RECORD = struct.Struct("<QQ32s")  # offset, length, sha256
MAX_INDEX_BYTES = 1 << 32
MAX_VALUE_BYTES = 1 << 31


@dataclass(frozen=True)
class Extent:
    """Where one (layer, side, component) lives in pages.bin.

    Attributes:
        layer (int), side (str "k"|"v"), component (str): what it holds.
        dtype (str): storage dtype name. shape (tuple): (n_pages, n_kv_heads, page_size, width).
        offset (int): byte offset in pages.bin (multiple of 16384). page_bytes (int): bytes per page.
        checksums (tuple[bytes]): SHA-256 of each page.
    """

    layer: int
    side: str
    component: str
    dtype: str
    shape: tuple
    offset: int
    page_bytes: int
    checksums: tuple


def align_up(n, a=ALIGN):
    """Smallest multiple of `a` that is >= n."""
    return (n + a - 1) // a * a


def sha256_file(path, chunk=1 << 24):
    """SHA-256 of a whole file, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.digest()


# ---------------------------------------------------------------------------------------- writing


class CartridgeWriter:
    """Write a cartridge into a temporary sibling directory; `commit()` renames it into place.

    Use as a context manager: leaving the block with an exception removes the temporary directory,
    so nothing partial is ever left at or beside the destination.

    Args:
        dest (str | Path): the cartridge directory to create.
        force (bool): replace an existing cartridge at `dest`. Default: False.

    Raises:
        OutputExistsError: if `dest` exists and `force` is False, or exists and is not a cartridge.
    """

    def __init__(self, dest, force=False):
        self.dest = Path(dest)
        check_output_path(self.dest, force)
        self.force = force
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.dest.name}.tmp-", dir=self.dest.parent))
        self._data = open(self.tmp / DATA_NAME, "wb")
        self._pos = 0
        self._tables = {}

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False

    def abort(self):
        """Remove the temporary directory."""
        if not self._data.closed:
            self._data.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def add_extent(self, layer, side, component, pages):
        """Append one component extent.

        Args:
            layer (int), side (str), component (str): the extent's identity.
            pages (np.ndarray): (n_pages, n_kv_heads, page_size, width), C-contiguous, any dtype.
        """
        pages = np.ascontiguousarray(pages)
        start = align_up(self._pos)
        self._data.write(b"\0" * (start - self._pos))
        raw = pages.reshape(pages.shape[0], -1).view(np.uint8)
        records = []
        for i, page in enumerate(raw):
            self._data.write(page.data)
            records.append(PAGE_RECORD.pack(start + i * page.nbytes, page.nbytes, hashlib.sha256(page.data).digest()))
        self._pos = start + raw.nbytes
        self._tables[K.page_table(layer, side, component)] = b"".join(records)

    def commit(self, header, token_ids):
        """Write the index and manifest, fsync, and rename into place.

        Args:
            header (dict[str, object]): JSON-valued header keys (keys from `cartridge.keys`).
            token_ids (np.ndarray): uint32 token ids of the prefix.
        """
        self._data.write(b"\0" * (align_up(self._pos) - self._pos))
        self._pos = align_up(self._pos)
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()
        records = {k: json.dumps(v, sort_keys=True, separators=(",", ":")).encode() for k, v in header.items()}
        records[K.TOKENS_IDS] = np.asarray(token_ids, dtype="<u4").tobytes()
        records.update(self._tables)
        _write_index(self.tmp, records)
        index_size = (self.tmp / INDEX_NAME).stat().st_size
        body = MANIFEST_STRUCT.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR, MANIFEST_SIZE, index_size, self._pos,
                                    sha256_file(self.tmp / INDEX_NAME))
        _write_synced(self.tmp / MANIFEST_NAME, body + hashlib.sha256(body).digest())
        _fsync_dir(self.tmp)
        publish(self.tmp, self.dest, self.force)
        return self.dest


def _write_index(folder, records):
    """Write records into a fresh LMDB file, then compact-copy it to index.lmdb (deterministic bytes)."""
    build = folder / "index.build"
    size = align_up(sum(len(k) + len(v) + 64 for k, v in records.items()) * 2 + (1 << 20), 1 << 20)
    env = lmdb.open(str(build), subdir=False, map_size=size, lock=False, sync=False, meminit=True)
    with env.begin(write=True) as txn:
        for key in sorted(records):
            txn.put(key.encode("ascii"), records[key])
    env.copy(str(folder / INDEX_NAME), compact=True)
    env.close()
    build.unlink()
    with open(folder / INDEX_NAME, "rb+") as f:
        os.fsync(f.fileno())


def _write_synced(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_output_path(dest, force):
    """Refuse an output path that exists (unless `force` and it is a cartridge).

    Raises:
        OutputExistsError: as described.
    """
    dest = Path(dest)
    if not (dest.exists() or dest.is_symlink()):
        return
    if not force:
        raise OutputExistsError(f"output {dest} exists; pass --force to replace it")
    if not (dest.is_dir() and (dest / MANIFEST_NAME).is_file()):
        raise OutputExistsError(f"output {dest} exists and is not a cartridge; refusing to replace it")


def _exchange(a, b):
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE, macOS renamex_np RENAME_SWAP)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        rc = libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rc = libc.renamex_np(os.fsencode(a), os.fsencode(b), 0x2)
    else:
        return False
    return rc == 0


def publish(tmp, dest, force):
    """Move the finished directory `tmp` to `dest`; an existing cartridge is swapped out atomically."""
    tmp, dest = Path(tmp), Path(dest)
    if dest.exists() and force:
        if not _exchange(tmp, dest):  # no atomic swap here: move the old one aside first
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.rename(dest, old / dest.name)
            os.rename(tmp, dest)
            tmp = old
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.rename(tmp, dest)
    _fsync_dir(dest.parent)


# ---------------------------------------------------------------------------------------- reading


def read_manifest(path):
    """Parse and check MANIFEST against the sizes of the files beside it.

    Returns:
        dict: major, minor, index_size, data_size, index_sha256 (bytes).

    Raises:
        NotACartridgeError, UnsupportedVersionError, CorruptCartridgeError.
    """
    path = Path(path)
    mpath = path / MANIFEST_NAME
    if not path.is_dir() or not mpath.is_file():
        raise NotACartridgeError(f"{path} is not a cartridge (no {MANIFEST_NAME} file)")
    raw = mpath.read_bytes()[: MANIFEST_SIZE + 1]
    if len(raw) < 12 or raw[:8] != MAGIC:
        raise NotACartridgeError(f"{mpath}: bad magic {raw[:8]!r}, expected {MAGIC!r}")
    major, minor = struct.unpack_from("<HH", raw, 8)
    if major != FORMAT_MAJOR:
        raise UnsupportedVersionError(f"cartridge file is format {major}; this cartridge reads up to {FORMAT_MAJOR}")
    if len(raw) != MANIFEST_SIZE:
        raise CorruptCartridgeError(f"{mpath}: size {len(raw)} bytes, expected {MANIFEST_SIZE}")
    body = raw[: MANIFEST_STRUCT.size]
    if hashlib.sha256(body).digest() != raw[MANIFEST_STRUCT.size:]:
        raise CorruptCartridgeError(f"{mpath}: manifest checksum mismatch")
    _, _, _, msize, index_size, data_size, index_sha = MANIFEST_STRUCT.unpack(body)
    if msize != MANIFEST_SIZE or index_size > MAX_INDEX_BYTES or data_size % ALIGN:
        raise CorruptCartridgeError(f"{mpath}: manifest fields out of range (size {msize}, index {index_size}, data {data_size})")
    for name, want in ((INDEX_NAME, index_size), (DATA_NAME, data_size)):
        f = path / name
        have = f.stat().st_size if f.is_file() else None
        if have != want:
            raise CorruptCartridgeError(f"{f}: size {have}, manifest says {want}")
    return {"major": major, "minor": minor, "index_size": index_size, "data_size": data_size, "index_sha256": index_sha}


def read_index(path, manifest):
    """Verify index.lmdb against the manifest digest, then read all of its records.

    Returns:
        dict[str, bytes]: every record, raw.

    Raises:
        CorruptCartridgeError: digest mismatch or an unreadable LMDB file.
    """
    ipath = Path(path) / INDEX_NAME
    if sha256_file(ipath) != manifest["index_sha256"]:
        raise CorruptCartridgeError(f"{ipath}: SHA-256 does not match the manifest; the index is damaged")
    try:  # the digest matched, so these bytes are the ones the writer produced
        env = lmdb.open(str(ipath), subdir=False, readonly=True, lock=False,
                        map_size=max(manifest["index_size"], 1 << 20), max_readers=1)
        with env.begin(buffers=False) as txn:
            records = {k.decode("ascii"): v for k, v in txn.cursor()}
        env.close()
    except (lmdb.Error, UnicodeDecodeError) as e:
        raise CorruptCartridgeError(f"{ipath}: unreadable LMDB index: {e}") from e
    for k, v in records.items():
        if len(k) > K.MAX_KEY_BYTES or len(v) > MAX_VALUE_BYTES:
            raise CorruptCartridgeError(f"{ipath}: key {k[:40]!r} or its value exceeds its length limit")
    return records


def parse_page_table(raw, key, n_pages):
    """Decode a binary page table into (offsets, lengths, checksums).

    Raises:
        CorruptCartridgeError: if its length is not n_pages records.
    """
    if raw is None or len(raw) != n_pages * PAGE_RECORD.size:
        raise CorruptCartridgeError(f"page table {key}: {0 if raw is None else len(raw)} bytes, expected {n_pages * PAGE_RECORD.size}")
    recs = [PAGE_RECORD.unpack_from(raw, i * PAGE_RECORD.size) for i in range(n_pages)]
    return [r[0] for r in recs], [r[1] for r in recs], tuple(r[2] for r in recs)


class PageData:
    """Read-only memory map of pages.bin.

    Args:
        path (Path): the cartridge directory.
    """

    def __init__(self, path):
        self._file = open(Path(path) / DATA_NAME, "rb")
        size = os.fstat(self._file.fileno()).st_size
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def view(self, extent, dtype):
        """The extent as a read-only numpy array shaped `extent.shape`, without a copy."""
        count = int(np.prod(extent.shape))
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=extent.offset).reshape(extent.shape)

    def verify(self, extent):
        """Check every page checksum of `extent`.

        Raises:
            ChecksumError: naming the first bad (layer, side, component, page).
        """
        for i, want in enumerate(extent.checksums):
            start = extent.offset + i * extent.page_bytes
            if hashlib.sha256(self._map[start:start + extent.page_bytes]).digest() != want:
                raise ChecksumError(
                    f"page checksum mismatch: layer {extent.layer}, side {extent.side}, "
                    f"component {extent.component}, page {i}"
                )

    def close(self):
        """Release the mapping (arrays viewing it must be gone)."""
        if self._map is not None:
            self._map.close()
        self._file.close()
