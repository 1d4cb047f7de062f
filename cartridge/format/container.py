"""The on-disk container, format v1 (spec/FORMAT.md is normative; this module follows it).

A cartridge is a directory holding three files:

    MANIFEST    96 bytes: magic, version, sizes, SHA-256 of index.lmdb, SHA-256 of itself
    index.lmdb  LMDB environment (one file): header keys, token ids, tier schema, page tables
    pages.bin   page payloads: one extent per (layer, side, component), each 16 KiB-aligned

It is written into a hidden sibling directory and renamed into place only when complete
(`cartridge.format.atomic`). Reading takes the three files from one directory inode (a concurrent rebuild of
the same path cannot mix old and new files), reads index.lmdb once into memory, checks its SHA-256 and
walks it with the bounded reader of `cartridge.format.lmdbfile` (liblmdb never parses a file on reading).
"""

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import (
    CorruptCartridgeError,
    DigestError,
    FieldError,
    LayoutError,
    NotACartridgeError,
    TruncatedError,
    UnsupportedVersionError,
)
from . import keys as K
from .layout import (
    ALIGN,
    DATA_NAME,
    FORMAT_MAJOR,
    INDEX_NAME,
    MAGIC,
    MANIFEST_NAME,
    MANIFEST_SIZE,
    MANIFEST_STRUCT,
    MAX_INDEX_BYTES,
    MAX_VALUE_BYTES,
    PAGE_RECORD,
    is_pack,
)
from .lmdbfile import read_records

@dataclass(frozen=True)
class Extent:
    """Where one (layer, side, component) lives in pages.bin.

    Attributes:
        layer (int), side (str "k"|"v"), component (str): what it holds.
        dtype (str): storage dtype name. shape (tuple): (n_pages, n_kv_heads, page_size, width).
        offset (int): byte offset in pages.bin (multiple of 16384). page_bytes (int): bytes per page.
        checksums (tuple[bytes]): SHA-256 of each page.
        head_checksums (tuple[bytes] | None): SHA-256 of each (page, head), page-major (format >= 1.2);
            None where the cartridge has no per-head table.
    """

    layer: int
    side: str
    component: str
    dtype: str
    shape: tuple
    offset: int
    page_bytes: int
    checksums: tuple
    head_checksums: tuple = None

    @property
    def head_bytes(self):
        """Bytes of one KV head within one page (heads are contiguous inside a page)."""
        return self.page_bytes // self.shape[1]

def parse_manifest(raw, where=MANIFEST_NAME):
    """Parse and check the bytes of a MANIFEST (spec section 2, in the order it gives).

    Args:
        raw (bytes): the file's bytes (a reader passes at most MANIFEST_SIZE + 1 of them).
        where (str): the file's name, for messages.

    Returns:
        dict: major, minor, index_size, data_size, index_sha256 (bytes), digest (hex of the last 32 bytes).

    Raises:
        NotACartridgeError, UnsupportedVersionError, TruncatedError, DigestError, FieldError.
    """
    if len(raw) < 12 or raw[:8] != MAGIC:
        raise NotACartridgeError(f"{where}: bad magic {bytes(raw[:8])!r}, expected {MAGIC!r}")
    major, minor = struct.unpack_from("<HH", raw, 8)
    if major != FORMAT_MAJOR:
        raise UnsupportedVersionError(f"cartridge file is format {major}; this cartridge reads up to {FORMAT_MAJOR}")
    if len(raw) != MANIFEST_SIZE:
        raise TruncatedError(f"{where}: size {len(raw)} bytes, expected {MANIFEST_SIZE}")
    body = raw[: MANIFEST_STRUCT.size]
    if hashlib.sha256(body).digest() != raw[MANIFEST_STRUCT.size:]:
        raise DigestError(f"{where}: manifest checksum mismatch")
    _, _, _, msize, index_size, data_size, index_sha = MANIFEST_STRUCT.unpack(body)
    if msize != MANIFEST_SIZE or index_size > MAX_INDEX_BYTES or data_size % ALIGN:
        raise FieldError(f"{where}: manifest fields out of range (size {msize}, index {index_size}, "
                                    f"data {data_size}; allowed {MANIFEST_SIZE}, <= {MAX_INDEX_BYTES}, multiple of {ALIGN})")
    return {"major": major, "minor": minor, "index_size": index_size, "data_size": data_size,
            "index_sha256": index_sha, "digest": raw[MANIFEST_STRUCT.size:].hex()}

def check_index(raw, manifest, where=INDEX_NAME):
    """Check index.lmdb's bytes against the manifest digest, then walk them (never the other way round).

    Returns:
        dict[str, bytes]: every record, raw.

    Raises:
        TruncatedError: a size other than the manifest's. DigestError: a SHA-256 mismatch.
        IndexFormatError: a malformed LMDB file (only once the digest matched).
    """
    if len(raw) != manifest["index_size"]:
        raise TruncatedError(f"{where}: size {len(raw)}, manifest says {manifest['index_size']}")
    if hashlib.sha256(raw).digest() != manifest["index_sha256"]:
        raise DigestError(f"{where}: SHA-256 does not match the manifest; the index is damaged")
    return read_records(raw, K.MAX_KEY_BYTES, MAX_VALUE_BYTES)

@dataclass
class Snapshot:
    """The three files of one cartridge directory, opened together.

    Attributes:
        manifest (dict): from `parse_manifest`. index (bytes): all of index.lmdb.
        data (file): pages.bin, open for reading (size checked against the manifest).
        manifest_raw (bytes): the 96 bytes of MANIFEST.
    """

    manifest: dict
    index: bytes
    data: object
    manifest_raw: bytes = b""

class _Moved(Exception):
    """The directory was replaced while its files were being opened: try again."""

def _open_member(path, dfd, name, missing):
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK, dir_fd=dfd)  # a FIFO must not block the open
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CorruptCartridgeError(f"{path / name} is not a regular file")
        os.set_blocking(fd, True)
        return fd
    except FileNotFoundError:
        try:
            now, then = os.stat(path), os.fstat(dfd)
            moved = (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino)
        except FileNotFoundError:
            moved = False
        if moved:
            raise _Moved() from None
        raise missing from None

def _read_fd(fd, limit):
    with os.fdopen(fd, "rb") as f:
        return f.read(limit)

def _snapshot(path, dfd):
    raw = _read_fd(_open_member(path, dfd, MANIFEST_NAME,
                                NotACartridgeError(f"{path} is not a cartridge (no {MANIFEST_NAME} file)")),
                   MANIFEST_SIZE + 1)
    manifest = parse_manifest(raw, str(path / MANIFEST_NAME))
    fds = {}
    try:
        for name, key in ((INDEX_NAME, "index_size"), (DATA_NAME, "data_size")):
            fds[name] = _open_member(path, dfd, name, TruncatedError(f"{path / name} is missing"))
            have = os.fstat(fds[name]).st_size
            if have != manifest[key]:
                state = "truncated" if have < manifest[key] else "longer than recorded"
                raise TruncatedError(f"cartridge {path}: {name} is {state}: {have:,} bytes, "
                                     f"its manifest says {manifest[key]:,}")
        index = _read_fd(fds.pop(INDEX_NAME), manifest["index_size"] + 1)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return Snapshot(manifest, index, os.fdopen(fds.pop(DATA_NAME), "rb"), raw)

def open_snapshot(path, attempts=3):
    """Open MANIFEST, index.lmdb and pages.bin of one cartridge directory and check the manifest.

    The files are opened relative to one directory handle, so a rebuild that swaps the directory in
    the meantime is noticed (a file vanishes) and the open is retried on the new directory.

    Args:
        path (str | Path): the cartridge directory.
        attempts (int): opens tried while the directory keeps being replaced. Default: 3.

    Returns:
        Snapshot

    Raises:
        NotACartridgeError, UnsupportedVersionError, DigestError, TruncatedError, CorruptCartridgeError.
    """
    path = Path(path)
    for _ in range(attempts):
        try:
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise NotACartridgeError(f"{path} does not exist") from None
        except NotADirectoryError:
            raise NotACartridgeError(_file_not_cartridge(path)) from None
        try:
            return _snapshot(path, dfd)
        except _Moved:
            continue
        finally:
            os.close(dfd)
    raise CorruptCartridgeError(f"{path} was replaced {attempts} times while being opened; try again")

def _file_not_cartridge(path):
    """Why the plain file `path` is no cartridge directory, saying what a cartridge is."""
    if is_pack(path):
        return f"{path} is a .cartz pack (a file), not a cartridge directory: unpack it (cartridge unpack), or load it"
    note = " (an mlx-lm prompt-cache file: `cartridge import` it first)" if _is_prompt_cache_file(path) else ""
    return (f"{path} is a file, not a cartridge{note}: a cartridge is a directory (holding {MANIFEST_NAME}, "
            f"{INDEX_NAME} and {DATA_NAME}) or a packed .cartz file")

def _is_prompt_cache_file(path):
    """True for a safetensors file whose metadata names cache classes as mlx-lm's `save_prompt_cache` writes
    them ("1.0": "KVCache", ...); reads only the header (safetensors: 8-byte little-endian length, then JSON)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if n < 1 << 24 else {}
    except (OSError, struct.error, ValueError):
        return False
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(metadata, dict) and any(k.startswith("1.") for k in metadata)

def read_manifest(path):
    """Parse and check MANIFEST against the sizes of the files beside it (see `open_snapshot`)."""
    snap = open_snapshot(path)
    snap.data.close()
    return snap.manifest

def read_index(path, manifest):
    """Read index.lmdb of the cartridge at `path` and check it against `manifest` (see `check_index`)."""
    ipath = Path(path) / INDEX_NAME
    with open(ipath, "rb") as f:
        return check_index(f.read(manifest["index_size"] + 1), manifest, str(ipath))

def parse_page_table(raw, key, n_pages):
    """Decode a binary page table into (offsets, lengths, checksums).

    Raises:
        LayoutError: if its length is not n_pages records.
    """
    if raw is None or len(raw) != n_pages * PAGE_RECORD.size:
        raise LayoutError(f"page table {key}: {0 if raw is None else len(raw)} bytes, expected {n_pages * PAGE_RECORD.size}")
    recs = list(PAGE_RECORD.iter_unpack(raw))
    return [r[0] for r in recs], [r[1] for r in recs], tuple(r[2] for r in recs)

def parse_head_table(raw, key, n_pages, n_kv_heads):
    """Decode an optional per-head checksum table into a tuple of n_pages * n_kv_heads digests.

    Returns:
        tuple[bytes] | None: None when the key is absent (format 1.0).

    Raises:
        LayoutError: if its length is not n_pages * n_kv_heads * 32 bytes.
    """
    if raw is None:
        return None
    want = n_pages * n_kv_heads * K.HEAD_RECORD_BYTES
    if len(raw) != want:
        raise LayoutError(f"head checksum table {key}: {len(raw)} bytes, expected {want}")
    return tuple(raw[i:i + K.HEAD_RECORD_BYTES] for i in range(0, want, K.HEAD_RECORD_BYTES))
