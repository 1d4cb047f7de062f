"""Write a cartridge (spec/FORMAT.md sections 2-4) into a locked temporary sibling and publish it
atomically (`cartridge.format.atomic`). Named crash points let tests kill a writer at each stage.
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import lmdb
import numpy as np

from ..errors import InputError, OutputExistsError, WriteError
from . import keys as K
from .atomic import TempDir, crash_point
from .layout import (
    DATA_NAME,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    INDEX_NAME,
    MAGIC,
    MANIFEST_NAME,
    MANIFEST_SIZE,
    MANIFEST_STRUCT,
    PAGE_RECORD,
    align_up,
    sha256_file,
)


class CartridgeWriter:
    """Write a cartridge into a temporary sibling directory; `commit()` renames it into place.

    Use as a context manager: leaving the block with an exception removes the temporary directory,
    so nothing partial is ever left at or beside the destination. An OS or LMDB failure while writing
    (disk full, RLIMIT_FSIZE, permissions) becomes one `WriteError`.

    Args:
        dest (str | Path): the cartridge directory to create.
        force (bool): replace an existing cartridge at `dest`. Default: False.

    Raises:
        OutputExistsError: if `dest` exists and `force` is False, or exists and is not a cartridge.
        WriteError: if the temporary directory cannot be created.
    """

    def __init__(self, dest, force=False):
        self.dest = Path(dest)
        check_output_path(self.dest, force)
        self.force = force
        try:
            self._tmp = TempDir(self.dest)
            self._data = open(self._tmp.path / DATA_NAME, "wb")
        except OSError as e:
            if hasattr(self, "_tmp"):
                self._tmp.discard()
            raise _write_error(self.dest, e) from e
        self.tmp = self._tmp.path
        self._pos = 0
        self._tables = {}
        self._stage = f"writing {DATA_NAME}"

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
            if isinstance(exc, (OSError, lmdb.Error)):
                raise _write_error(self.dest, exc, self._stage) from exc
        return False

    def abort(self):
        """Remove the temporary directory."""
        if not self._data.closed:
            try:
                self._data.close()
            except OSError:  # flushing the buffer can fail again on a full disk; the file goes anyway
                pass
        self._tmp.discard()

    def add_extent(self, layer, side, component, pages):
        """Append one component extent (in the order of spec section 3.2).

        Args:
            layer (int), side (str), component (str): the extent's identity.
            pages (np.ndarray): (n_pages, n_kv_heads, page_size, width), C-contiguous, any dtype.
        """
        pages = np.ascontiguousarray(pages)
        start = align_up(self._pos)
        self._data.write(b"\0" * (start - self._pos))
        raw = pages.reshape(pages.shape[0], -1).view(np.uint8)  # (n_pages, page_bytes)
        records = []
        for i, page in enumerate(raw):
            self._data.write(page.data)
            records.append(PAGE_RECORD.pack(start + i * page.nbytes, page.nbytes, hashlib.sha256(page.data).digest()))
        self._pos = start + raw.nbytes
        self._tables[K.page_table(layer, side, component)] = b"".join(records)
        heads = raw.reshape(pages.shape[0] * pages.shape[1], -1)  # (n_pages * n_kv_heads, head_bytes)
        self._tables[K.head_table(layer, side, component)] = b"".join(hashlib.sha256(h.data).digest() for h in heads)
        crash_point("extent-written")

    def add_record(self, key, raw):
        """Add one binary index record (e.g. `layer.{i}.{side}.protected`), written at commit."""
        self._tables[key] = bytes(raw)

    def commit(self, header, token_ids, check=None):
        """Write the index and manifest, fsync, and rename into place.

        Args:
            header (dict[str, object]): JSON-valued header keys (keys from `cartridge.format.keys`).
            token_ids (np.ndarray): uint32 token ids of the prefix.
            check (callable | None): called with the finished temporary directory before it is
                published; an exception it raises leaves the destination as it was. Default: None.

        Returns:
            Path: the published cartridge directory.
        """
        self._data.write(b"\0" * (align_up(self._pos) - self._pos))
        self._pos = align_up(self._pos)
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()
        crash_point("data-synced")
        self._stage = f"writing {INDEX_NAME}"
        records = {k: json.dumps(v, sort_keys=True, separators=(",", ":")).encode() for k, v in header.items()}
        records[K.TOKENS_IDS] = np.asarray(token_ids, dtype="<u4").tobytes()
        records.update(self._tables)
        _write_index(self.tmp, records)
        crash_point("index-written")
        self._stage = f"writing {MANIFEST_NAME}"
        write_manifest(self.tmp, self._pos, header.get(K.FORMAT_MINOR, FORMAT_MINOR))
        crash_point("manifest-written")
        if check is not None:
            self._stage = "checking"
            check(self.tmp)
        self._stage = "publishing"
        return self._tmp.publish(self.force)


def _write_error(dest, e, stage="creating a temporary directory"):
    what = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return WriteError(f"could not write cartridge {dest} ({stage}): {what}; nothing was left behind")


def write_manifest(folder, data_size, minor=FORMAT_MINOR):
    """Write MANIFEST for the index.lmdb in `folder` and a pages.bin of `data_size` bytes (spec 2); its
    format_minor is the header's `cartridge.format_minor` (`minor`), so the two always agree."""
    folder = Path(folder)
    index_size = (folder / INDEX_NAME).stat().st_size
    body = MANIFEST_STRUCT.pack(MAGIC, FORMAT_MAJOR, minor, MANIFEST_SIZE, index_size, data_size,
                                sha256_file(folder / INDEX_NAME))
    _write_synced(folder / MANIFEST_NAME, body + hashlib.sha256(body).digest())


def _write_index(folder, records):
    """Write records into a fresh LMDB file, then compact-copy it to index.lmdb (deterministic bytes)."""
    build = folder / "index.build"
    size = align_up(sum(len(k) + len(v) + 64 for k, v in records.items()) * 2 + (1 << 20), 1 << 20)
    env = lmdb.open(str(build), subdir=False, map_size=size, lock=False, sync=False, meminit=True)
    try:
        with env.begin(write=True) as txn:
            for key in sorted(records):
                txn.put(key.encode("ascii"), records[key])
        env.copy(str(folder / INDEX_NAME), compact=True)
    finally:
        env.close()
    build.unlink()
    with open(folder / INDEX_NAME, "rb+") as f:
        os.fsync(f.fileno())


def _write_synced(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def check_output_folder(dest):
    """Refuse an empty output path, or one whose folder does not exist or cannot be written.

    The folder is probed by creating and removing an empty hidden directory in it, so a read-only
    or pseudo file system is refused before any expensive work (prefill, compression).

    Raises:
        InputError: empty path, or missing parent folder.
        WriteError: the folder cannot be written.
    """
    if not str(dest).strip():
        raise InputError("the output path is empty")
    parent = Path(dest).absolute().parent
    if parent.exists() and not parent.is_dir():
        raise InputError(f"{parent} is a file, not a folder; the output must go in a folder")
    if not parent.is_dir():
        raise InputError(f"folder {parent} does not exist (or is not a folder); create it first")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".cartridge-probe-", dir=parent))
    except OSError as e:  # /proc: ENOENT, a read-only mount: EROFS; the system's words, for what they are worth
        raise WriteError(f"folder {parent} is not writable (creating a directory in it failed: "
                         f"{e.strerror or e})") from None


def check_space(dest, nbytes):
    """Refuse, before any expensive work, to write `nbytes` where the output's file system has less free.

    Raises:
        WriteError: naming the bytes needed, the bytes free and the folder.
    """
    parent = Path(dest).absolute().parent
    free = shutil.disk_usage(parent).free
    if free < nbytes:
        raise WriteError(f"cartridge {dest} needs about {nbytes:,} bytes; only {free:,} are free in {parent}")


def check_utf8_path(path, what):
    """Refuse a path that is not valid UTF-8 (undecodable bytes from the command line): LMDB, which
    writes every cartridge index, takes its path as UTF-8.

    Raises:
        InputError: naming `what` (e.g. "output path").
    """
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{what} {str(path)!r} is not valid UTF-8") from None


def is_cartridge_dir(path):
    """True for a folder holding a MANIFEST: a cartridge as written (a packed .cartz is a file)."""
    path = Path(path)
    return path.is_dir() and (path / MANIFEST_NAME).is_file()


def check_output_path(dest, force):
    """Refuse an output path that exists (unless `force` and it is a cartridge), that names a packed
    .cartz (a writer makes a directory), that lies inside a cartridge's folder, or that cannot be written
    (`check_output_folder`).

    Raises:
        OutputExistsError: as described.
        InputError, WriteError: from `check_output_folder`; InputError for a .cartz name.
    """
    for parent in Path(dest).absolute().parents:  # replacing that cartridge later would delete this one with it
        if is_cartridge_dir(parent):
            raise InputError(f"output {dest} is inside the cartridge {parent}; write it somewhere else")
    check_output_folder(dest)
    check_utf8_path(dest, "output path")
    dest = Path(dest)
    if dest.suffix == ".cartz":
        raise InputError(f"output {dest}: a .cartz is a packed cartridge; write {dest.with_suffix('.cart')} and "
                         f"`cartridge pack` it to {dest}")
    if not (dest.exists() or dest.is_symlink()):
        return
    if not is_cartridge_dir(dest):
        raise OutputExistsError(f"output {dest} exists and is not a cartridge; refusing to replace it")
    if not force:
        raise OutputExistsError(f"output {dest} exists; pass --force (Python: force=True) to replace it")
