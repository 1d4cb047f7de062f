"""Packed cartridges (.cartz): one streamable zstandard file holding the three files and their SHA-256
(spec/FORMAT.md section 9).

    pack:    verify the cartridge -> stream MANIFEST, index.lmdb, pages.bin through zstd -> temp -> rename
    unpack:  stream-decompress -> check each member's size and SHA-256 as it arrives -> temp directory
             -> full `verify_directory` -> rename into place (atomic, like build)
    load:    a .cartz is unpacked once into $XDG_CACHE_HOME/cartridge/<manifest digest>.cart and reused
"""

import hashlib
import os
import shutil
import struct
from pathlib import Path

import zstandard

from ..errors import (
    CorruptCartridgeError,
    DigestError,
    OutputExistsError,
    PackError,
    UnsupportedVersionError,
    WriteError,
    name_cartridge,
)
from .atomic import TempDir, crash_point
from .container import open_snapshot, parse_manifest
from .layout import DATA_NAME, INDEX_NAME, MANIFEST_NAME, MANIFEST_SIZE, ZSTD_MAGIC, is_pack
from .verify import verify_directory
from .writer import check_output_folder, check_output_path

PACK_MAGIC = b"CARTPACK"
PACK_MAJOR, PACK_MINOR = 1, 0
PACK_HEADER = struct.Struct("<8sHHI")  # magic, pack_major, pack_minor, n_members
MEMBER_HEAD = struct.Struct("<H")  # name length; then the name, then u64 size
SIZE = struct.Struct("<Q")
MEMBERS = (MANIFEST_NAME, INDEX_NAME, DATA_NAME)  # this order: the manifest bounds the sizes that follow
DEFAULT_LEVEL = 3
CHUNK = 1 << 20


def _member_header(name, size):
    raw = name.encode("ascii")
    return MEMBER_HEAD.pack(len(raw)) + raw + SIZE.pack(size)


def _copy(src, dst, size, progress, done):
    """Copy `size` bytes from file `src` to writer `dst`; return their SHA-256 and the bytes done."""
    h = hashlib.sha256()
    left = size
    while left:
        block = src.read(min(CHUNK, left))
        if not block:
            raise PackError(f"stream ended {left} bytes before the end of a {size}-byte member")
        h.update(block)
        dst.write(block)
        left -= len(block)
        done += len(block)
        if progress:
            progress(done)
    return h.digest(), done


def pack(src, dest, level=DEFAULT_LEVEL, force=False, progress=None):
    """Write the cartridge `src` as one .cartz file at `dest` (verified first; atomic).

    Args:
        src (str | Path): cartridge directory.
        dest (str | Path): the .cartz file to write.
        level (int): zstandard level, 1..19. Default: 3.
        force (bool): replace an existing `dest` file. Default: False.
        progress (callable | None): progress(done_bytes, total_bytes) as input bytes are read.

    Returns:
        dict: {"path", "bytes_in", "bytes_out"}.

    Raises:
        CartridgeError subclasses: `src` fails verification (nothing is written); OutputExistsError;
        WriteError.
    """
    dest = Path(dest)
    _check_pack_output(dest, force)
    error = verify_directory(src).error
    if error is not None:
        raise name_cartridge(error, src)
    snap = open_snapshot(src)
    total = MANIFEST_SIZE + snap.manifest["index_size"] + snap.manifest["data_size"]
    tmp = _temp(dest, directory=False)
    try:
        with snap.data, open(tmp.path, "wb") as raw:
            cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, threads=-1)
            with cctx.stream_writer(raw, closefd=False) as z:
                z.write(PACK_HEADER.pack(PACK_MAGIC, PACK_MAJOR, PACK_MINOR, len(MEMBERS)))
                done = _pack_members(z, snap, total, progress)
            raw.flush()
            os.fsync(raw.fileno())
        crash_point("pack-written")
        tmp.publish(force)
    except BaseException as e:
        tmp.discard()
        if isinstance(e, OSError):
            raise WriteError(f"could not write {dest}: {e.strerror or e}; nothing was left behind") from e
        raise
    return {"path": str(dest), "bytes_in": done, "bytes_out": dest.stat().st_size}


def _pack_members(z, snap, total, progress):
    report = (lambda d: progress(d, total)) if progress else None
    done = 0
    for name, size, source in ((MANIFEST_NAME, MANIFEST_SIZE, None), (INDEX_NAME, len(snap.index), None),
                               (DATA_NAME, snap.manifest["data_size"], snap.data)):
        z.write(_member_header(name, size))
        if source is None:
            payload = snap.manifest_raw if name == MANIFEST_NAME else snap.index
            z.write(payload)
            digest, done = hashlib.sha256(payload).digest(), done + size
            if report:
                report(done)
        else:
            digest, done = _copy(source, z, size, report, done)
        z.write(digest)
    return done


def _check_pack_output(dest, force):
    check_output_folder(dest)
    if dest.is_dir():
        raise OutputExistsError(f"output {dest} is a directory; refusing to replace it with a .cartz file")
    if dest.exists() or dest.is_symlink():
        if dest.is_symlink() or not is_pack(dest):
            raise OutputExistsError(f"output {dest} exists and is not a .cartz file; refusing to replace it")
        if not force:
            raise OutputExistsError(f"output {dest} exists; pass --force (Python: force=True) to replace it")


def _temp(dest, directory):
    try:
        return TempDir(dest, directory=directory)
    except OSError as e:
        raise WriteError(f"could not write {dest}: {e.strerror or e}; nothing was left behind") from e


# ---------------------------------------------------------------------------------------- unpacking


def _read_exact(r, n, what):
    buf = bytearray()
    while len(buf) < n:
        block = r.read(n - len(buf))
        if not block:
            raise PackError(f"packed cartridge truncated: {what} needs {n} bytes, got {len(buf)}")
        buf += block
    return bytes(buf)


def _read_header(r):
    magic, major, minor, n = PACK_HEADER.unpack(_read_exact(r, PACK_HEADER.size, "the header"))
    if magic != PACK_MAGIC:
        raise PackError(f"not a packed cartridge: magic {magic!r}, expected {PACK_MAGIC!r}")
    if major != PACK_MAJOR:
        raise UnsupportedVersionError(f"packed cartridge is pack format {major}; this cartridge reads up to {PACK_MAJOR}")
    if n != len(MEMBERS):
        raise PackError(f"packed cartridge has {n} members; expected {len(MEMBERS)}")


def _read_member_head(r, want_name):
    (length,) = MEMBER_HEAD.unpack(_read_exact(r, MEMBER_HEAD.size, "a member name length"))
    name = _read_exact(r, length, "a member name") if length <= 255 else b""
    if name != want_name.encode():
        raise PackError(f"packed member is {name[:40]!r} ({length} bytes); expected {want_name!r}")
    (size,) = SIZE.unpack(_read_exact(r, SIZE.size, "a member size"))
    return size


def _check_digest(r, name, digest):
    if _read_exact(r, 32, f"the SHA-256 of {name}") != digest:
        raise PackError(f"packed member {name}: SHA-256 does not match its bytes")


def _read_manifest(r):
    """Read the header and the MANIFEST member; return its raw bytes and parsed dict."""
    _read_header(r)
    size = _read_member_head(r, MANIFEST_NAME)
    if size != MANIFEST_SIZE:
        raise PackError(f"packed {MANIFEST_NAME} is {size} bytes; expected {MANIFEST_SIZE}")
    raw = _read_exact(r, size, MANIFEST_NAME)
    _check_digest(r, MANIFEST_NAME, hashlib.sha256(raw).digest())
    return raw, parse_manifest(raw, f"packed {MANIFEST_NAME}")


def _reader(f):
    return zstandard.ZstdDecompressor().stream_reader(f, closefd=False)


FRAME_FIELD_BYTES = {"dict_id": (0, 1, 2, 4), "content_size": (0, 2, 4, 8)}  # RFC 8878 3.1.1.1


def check_frame(f):
    """Require `f` to hold exactly one complete zstandard frame with a content checksum (RFC 8878 3.1.1),
    walking block headers only (a few bytes per 128 KiB block; nothing is decompressed).

    The decompressing reader cannot tell a frame cut inside its last block or checksum from a whole
    one; this check can, so a truncated .cartz is refused however little is missing.

    Raises:
        PackError: wrong magic, reserved bits, a block running past the end, a missing checksum, or
        bytes after the frame.
    """
    size = os.fstat(f.fileno()).st_size
    head = f.read(6)
    if len(head) < 6 or head[:4] != ZSTD_MAGIC:
        raise PackError(f"not a packed cartridge: no zstandard frame (first bytes {head[:4].hex()})")
    fhd = head[4]
    single_segment, checksum = fhd >> 5 & 1, fhd >> 2 & 1
    if fhd >> 3 & 1 or not checksum:
        raise PackError(f"zstandard frame descriptor 0x{fhd:02x}: reserved bit set or no content checksum")
    fcs = FRAME_FIELD_BYTES["content_size"][fhd >> 6] or single_segment
    pos = 5 + (not single_segment) + FRAME_FIELD_BYTES["dict_id"][fhd & 3] + fcs
    last = False
    while not last:
        f.seek(pos)
        raw = f.read(3)
        if len(raw) < 3:
            raise PackError(f"packed cartridge truncated: zstandard block header at {pos} of {size} bytes")
        h = int.from_bytes(raw, "little")
        last, kind, bsize = h & 1, h >> 1 & 3, h >> 3
        if kind == 3:
            raise PackError(f"zstandard block at {pos}: reserved block type")
        pos += 3 + (1 if kind == 1 else bsize)
    if pos + 4 != size:
        raise PackError(f"packed cartridge is {size} bytes; its zstandard frame ends at {pos + 4}"
                        f"{' (truncated)' if pos + 4 > size else ' (bytes follow it)'}")
    f.seek(0)


def read_pack_manifest(src):
    """The parsed MANIFEST inside a .cartz (decompresses only its first few hundred bytes).

    Raises:
        PackError, and the errors of `parse_manifest`.
    """
    with open(src, "rb") as f, _reader(f) as r:
        try:
            check_frame(f)
            return _read_manifest(r)[1]
        except zstandard.ZstdError as e:
            raise PackError(f"{src}: not a readable zstandard stream: {e}") from None


def _unpack_into(r, folder, progress):
    raw, manifest = _read_manifest(r)
    total = MANIFEST_SIZE + manifest["index_size"] + manifest["data_size"]
    free = shutil.disk_usage(folder).free
    if total - MANIFEST_SIZE > free:  # refuse before writing what a hostile header claims
        raise WriteError(f"unpacking needs {total:,} bytes; {free:,} are free at {folder.parent}")
    (folder / MANIFEST_NAME).write_bytes(raw)
    report = (lambda d: progress(d, total)) if progress else None
    done = MANIFEST_SIZE
    for name, key in ((INDEX_NAME, "index_size"), (DATA_NAME, "data_size")):
        size = _read_member_head(r, name)
        if size != manifest[key]:
            raise PackError(f"packed {name} is {size} bytes; its manifest says {manifest[key]}")
        with open(folder / name, "wb") as out:
            digest, done = _copy(r, out, size, report, done)
            out.flush()
            os.fsync(out.fileno())
        _check_digest(r, name, digest)
        if name == INDEX_NAME and digest != manifest["index_sha256"]:
            raise DigestError(f"packed {INDEX_NAME}: SHA-256 does not match its manifest")
        crash_point(f"unpacked-{name}")
    if r.read(1):
        raise PackError("packed cartridge has bytes after its last member")
    return done


def unpack(src, dest, force=False, progress=None):
    """Restore the .cartz `src` as the cartridge directory `dest`, verified, atomically.

    Args:
        src (str | Path): the .cartz file.
        dest (str | Path): the cartridge directory to create.
        force (bool): replace an existing cartridge at `dest`. Default: False.
        progress (callable | None): progress(done_bytes, total_bytes) as bytes are restored.

    Returns:
        Path: `dest`.

    Raises:
        PackError, UnsupportedVersionError, DigestError and the other errors of `verify_directory`
        (nothing is left at `dest`); OutputExistsError; WriteError (disk full, file size limit).
    """
    dest = Path(dest)
    check_output_path(dest, force)
    if not Path(src).is_file():
        raise PackError(f"{src} is not a file")
    tmp = _temp(dest, directory=True)
    try:
        with open(src, "rb") as f:
            check_frame(f)
            with _reader(f) as r:
                _unpack_into(r, tmp.path, progress)
        verify_directory(tmp.path).raise_for_error()
        return tmp.publish(force)
    except BaseException as e:
        tmp.discard()
        if isinstance(e, zstandard.ZstdError):
            raise PackError(f"{src}: corrupt zstandard stream: {e}") from None
        if isinstance(e, PackError):
            raise name_cartridge(e, src) from None
        if isinstance(e, OSError):
            raise WriteError(f"could not write {dest}: {e.strerror or e}; nothing was left behind") from e
        raise


# ---------------------------------------------------------------------------------------- cache


def cache_root():
    """$XDG_CACHE_HOME/cartridge, or ~/.cache/cartridge."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cartridge"


def unpack_cached(src, refresh=False):
    """The cartridge directory of the .cartz `src` in the cache, unpacking it the first time.

    The cache entry is named by the SHA-256 of the pack's MANIFEST (which covers the index digest and
    so every page checksum); it is reused for a .cartz whose own SHA-256 is listed beside it (NAME.packs:
    the packs that unpacked into it), so a damaged copy of a good pack is unpacked and refused, not answered
    from the good entry. An entry whose MANIFEST differs, or `refresh`, is unpacked again.

    Returns:
        Path: the cached cartridge directory (callers verify it as they open it).
    """
    manifest = read_pack_manifest(src)
    dest = cache_root() / f"{manifest['digest']}.cart"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(f"cannot use the cache folder {dest.parent} for {src}: {e.strerror or e} "
                         "(set XDG_CACHE_HOME to a writable folder, or unpack it yourself)") from None
    mpath = dest / MANIFEST_NAME
    # the entry is reused only for a .cartz whose own bytes unpacked into it before: a damaged copy of a pack
    # with the same MANIFEST is unpacked (and so refused) rather than answered from the good entry
    packs, pack_sha = dest.with_suffix(".packs"), _file_sha256(src)
    if (not refresh and mpath.is_file() and mpath.read_bytes()[64:].hex() == manifest["digest"]
            and pack_sha in _lines(packs)):
        return dest
    try:
        out = unpack(src, dest, force=dest.is_dir())
    except (OutputExistsError, WriteError):
        # another process unpacked the same MANIFEST first (verified as it was published; whether this copy of
        # the pack is whole is then not known until it unpacks alone)
        if not refresh and mpath.is_file() and mpath.read_bytes()[64:].hex() == manifest["digest"]:
            return dest
        raise
    with open(packs, "a") as f:  # one line an append: concurrent writers interleave whole lines
        f.write(pack_sha + "\n")
    return out


def _file_sha256(path):
    """Hex SHA-256 of a file's bytes, read in 8 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 23), b""):
            h.update(block)
    return h.hexdigest()


def _lines(path):
    """The lines of a small text file, or none if it does not exist."""
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def open_packed(src, opener):
    """Open the .cartz `src` through its cache entry with `opener(dir)`; a damaged entry is unpacked
    again once (then any error stands).

    Raises:
        the errors of `opener` and `unpack`.
    """
    dest = unpack_cached(src)
    try:
        return opener(dest)
    except CorruptCartridgeError:
        return opener(unpack_cached(src, refresh=True))
