"""Open or verify a cartridge given as a directory or as a packed .cartz file.

The directory checks live in `container`/`header` (what every reader checks) and `verify` (the full
list); `pack` unpacks a .cartz and verifies the result. This module dispatches between the two, so
`verify` and `pack` need not know of each other.
"""

import tempfile
import time
from pathlib import Path

from ..errors import CartridgeError, InputError, name_cartridge
from .container import check_index, open_snapshot
from .pagefile import PageData
from .header import parse_header
from .pack import is_pack, open_packed, unpack
from .verify import VerifyReport, check_padding, verify_directory

VERIFY_MODES = ("pages", "header")


def open_cartridge(path, verify="pages"):
    """Read and check a cartridge's manifest, index and (optionally) every page checksum.

    Args:
        path (str | Path): the cartridge directory, or a packed .cartz file (unpacked once into
            $XDG_CACHE_HOME/cartridge/ and checked there on every open).
        verify (str): "pages" (default: every page checksum and the zero padding of spec 3.2) or
            "header" (neither).

    Returns:
        tuple: (CartridgeInfo, PageData).

    Raises:
        InputError: for an unknown verify mode. NotACartridgeError, UnsupportedVersionError,
        CorruptCartridgeError (and its subclasses, e.g. ChecksumError, DigestError, PackError): when a
        check fails.
    """
    if verify not in VERIFY_MODES:
        raise InputError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    try:
        if is_pack(path):
            return open_packed(path, lambda folder: _open_dir(folder, verify))
        return _open_dir(Path(path), verify)
    except CartridgeError as e:
        name_cartridge(e, path)
        raise


def _open_dir(path, verify):
    snap = open_snapshot(path)
    data = PageData(snap.data)
    try:
        info = parse_header(check_index(snap.index, snap.manifest), snap.manifest)
        if verify == "pages":
            data.verify_all([e for extents in info.extents.values() for e in extents])
            check_padding(info, data)
    except BaseException:
        data.close()
        raise
    return info, data


def verify_cartridge(path):
    """Run every check on the cartridge at `path` (`verify.verify_directory`).

    Args:
        path (str | Path): cartridge directory, or a .cartz (checked by unpacking it into a temporary
            directory: section 9 of the spec, then every directory check).

    Returns:
        VerifyReport: `ok` False and `error` set on the first failure (CartridgeError errors are
        reported, not raised; call `raise_for_error()` to raise).

    Example:
        >>> cartridge.verify_cartridge("doc.cart").raise_for_error()  # doctest: +SKIP
    """
    if not is_pack(path):
        return _named_report(verify_directory(path), path)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".cartridge-verify-") as tmp:
        try:
            report = verify_directory(unpack(path, Path(tmp) / "unpacked.cart"))
            report.checks.insert(0, "pack")
        except CartridgeError as e:
            report = VerifyReport(str(path), error=e)
    report.path, report.ok, report.seconds = str(path), report.error is None, time.perf_counter() - t0
    return _named_report(report, path)


def _named_report(report, path):
    if report.error is not None:
        name_cartridge(report.error, path)
    return report
