"""pages.bin read back: a read-only memory map of the page payloads (spec/FORMAT.md section 3) and the checks of
their SHA-256 against the page and per-head tables of the index (`cartridge.format.container` reads the index)."""

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..errors import ChecksumError
from .layout import DATA_NAME

def bad_heads(extent, slabs, first=0):
    """(page, head) pairs of `slabs` whose SHA-256 differs from the extent's per-head table.

    Args:
        extent (Extent): with `head_checksums` set.
        slabs (np.ndarray): uint8 (n_pages, n_heads, head_bytes): heads first..first+n_heads-1 of every page.
        first (int): the first KV head held in `slabs`. Default: 0.

    Returns:
        list[tuple[int, int]]: (page, head) of every mismatch, in order.
    """
    n_kv = extent.shape[1]
    return [(p, first + j) for p in range(slabs.shape[0]) for j in range(slabs.shape[1])
            if hashlib.sha256(slabs[p, j].data).digest() != extent.head_checksums[p * n_kv + first + j]]


class PageData:
    """Read-only memory map of pages.bin.

    Args:
        source (str | Path | file): the cartridge directory, or pages.bin already open for reading
            (`Snapshot.data`).
    """

    def __init__(self, source):
        self._file = source if hasattr(source, "fileno") else open(Path(source) / DATA_NAME, "rb")
        size = os.fstat(self._file.fileno()).st_size
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    @property
    def size(self):
        """Bytes mapped."""
        return 0 if self._map is None else len(self._map)

    def view(self, extent, dtype):
        """The extent as a read-only numpy array shaped `extent.shape`, without a copy."""
        count = int(np.prod(extent.shape))
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=extent.offset).reshape(extent.shape)

    def slabs(self, extent):
        """The extent's bytes as a uint8 (n_pages, n_kv_heads, head_bytes) view, without a copy."""
        count = extent.shape[0] * extent.page_bytes
        raw = np.frombuffer(self._map, dtype=np.uint8, count=count, offset=extent.offset)
        return raw.reshape(extent.shape[0], extent.shape[1], extent.head_bytes)

    def read(self, start, end):
        """A copy of bytes start..end of pages.bin."""
        return self._map[start:end] if self._map is not None else b""

    def bad_pages(self, extent):
        """Indices of the pages of `extent` whose SHA-256 differs from the page table's."""
        bad = []
        with memoryview(self._map) as mv:
            for i, want in enumerate(extent.checksums):
                start = extent.offset + i * extent.page_bytes
                if hashlib.sha256(mv[start:start + extent.page_bytes]).digest() != want:
                    bad.append(i)
        return bad

    def verify_all(self, extents, threads=None):
        """Check every page checksum of `extents`, hashing from the mapping (no copies) on `threads` threads:
        hashlib releases the GIL while it hashes a buffer, so the pages are split into that many runs of
        about equal bytes.

        Args:
            extents (list[Extent]): the extents to check, in the order their errors are reported.
            threads (int | None): hashing threads. Default: None (`HASH_THREADS`).

        Raises:
            ChecksumError: naming the first bad (layer, side, component, page) in `extents` order.
        """
        pages = [(n, i) for n, e in enumerate(extents) for i in range(len(e.checksums))]
        runs = _runs(pages, [extents[n].page_bytes for n, _ in pages], threads or HASH_THREADS)
        with memoryview(self._map) if self._map is not None else memoryview(b"") as mv:

            def bad(run):
                return [(n, i) for n, i in run
                        if hashlib.sha256(mv[extents[n].offset + i * extents[n].page_bytes:][:extents[n].page_bytes])
                        .digest() != extents[n].checksums[i]]

            if len(runs) == 1:
                found = bad(runs[0])
            else:
                with ThreadPoolExecutor(len(runs)) as pool:
                    found = [x for r in pool.map(bad, runs) for x in r]
        if found:
            n, i = min(found)
            raise page_error(extents[n], i)

    def verify(self, extent):
        """Check every page checksum of `extent`.

        Raises:
            ChecksumError: naming the first bad (layer, side, component, page).
        """
        bad = self.bad_pages(extent)
        if bad:
            raise page_error(extent, bad[0])

    def close(self):
        """Release the mapping (arrays viewing it must be gone)."""
        if self._map is not None:
            self._map.close()
        self._file.close()


HASH_THREADS = min(4, os.cpu_count() or 1)  # page hashing threads (`PageData.verify_all`)


def _runs(items, sizes, n):
    """`items` cut into at most `n` consecutive runs of about equal total `sizes` (none empty)."""
    total, runs, run, acc = sum(sizes), [], [], 0
    for item, size in zip(items, sizes):
        run.append(item)
        acc += size
        if acc * n >= total * (len(runs) + 1) and len(runs) < n - 1:
            runs.append(run)
            run = []
    return runs + [run] if run or not runs else runs


def page_error(extent, page):
    """The ChecksumError for page `page` of `extent`."""
    return ChecksumError(f"page checksum mismatch: layer {extent.layer}, side {extent.side}, "
                         f"component {extent.component}, page {page}",
                         extent.layer, extent.side, extent.component, page)


def head_error(extent, page, head):
    """The ChecksumError for KV head `head` of page `page` of `extent` (per-head table, format >= 1.2)."""
    return ChecksumError(f"head checksum mismatch: layer {extent.layer}, side {extent.side}, "
                         f"component {extent.component}, page {page}, head {head}",
                         extent.layer, extent.side, extent.component, page)
