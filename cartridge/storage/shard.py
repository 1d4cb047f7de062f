"""One rank's slice of a cartridge: which layers and KV heads it holds, and reading just those bytes.

Under tensor parallel (mlx-lm `Model.shard`) rank r of N holds KV heads [r*H/N, (r+1)*H/N) of every
layer; under pipeline parallel (mlx-lm `PipelineMixin.pipeline`) it holds layers [start_idx, end_idx).
Inside a page the KV heads are contiguous (page = (n_kv_heads, P, W)), so a rank's bytes of one page
are one run of (h1 - h0) * head_bytes; `SliceData` reads those runs with pread, nothing else, and
checks them against the per-(page, head) checksums of format 1.2 (spec/FORMAT.md 4.5.2).
"""

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..format.pagefile import bad_heads, head_error, page_error
from ..format.header import SIDES


@dataclass(frozen=True)
class Slice:
    """What one rank holds of a cartridge.

    Attributes:
        mode (str): "tensor", "pipeline" or "replicated" (the whole cartridge).
        rank (int), size (int): the rank and the group size.
        layers (tuple[int, int]): [first, end) layer indices held.
        heads (tuple[int, int]): [first, end) KV heads held of each of those layers.
    """

    mode: str
    rank: int
    size: int
    layers: tuple
    heads: tuple

    def describe(self):
        """One line: what this rank maps."""
        return (f"rank {self.rank}/{self.size} ({self.mode}): layers {self.layers[0]}..{self.layers[1] - 1}, "
                f"KV heads {self.heads[0]}..{self.heads[1] - 1}")


def local_kv_heads(model):
    """KV heads of the first attention layer this (possibly sharded) model runs."""
    layer = next(layer for layer in model.layers if layer is not None)
    attn = layer.self_attn
    return int(getattr(attn, "n_kv_heads", None) or attn.num_key_value_heads)


def slice_for(model, n_layers, n_kv_heads, rank, size):
    """The slice a sharded mlx-lm model needs of a cartridge of `n_layers` x `n_kv_heads`.

    Pipeline: the model's inner module has `pipeline_size` > 1 (mlx-lm `PipelineMixin`). Tensor: the
    model's attention has fewer KV heads than the cartridge (mlx-lm `shard` divides them by N).

    Raises:
        InputError: a model that holds neither all nor 1/size of the heads, or both kinds of sharding.
    """
    inner = getattr(model, "model", model)
    local = local_kv_heads(model)
    piped = getattr(inner, "pipeline_size", 1) > 1
    if local != n_kv_heads:
        if piped or local * size != n_kv_heads:
            raise InputError(f"the model holds {local} KV heads per layer; the cartridge has {n_kv_heads}, "
                             f"so a tensor-parallel rank of {size} would hold {n_kv_heads // size}")
        return Slice("tensor", rank, size, (0, n_layers), (rank * local, (rank + 1) * local))
    if piped:
        return Slice("pipeline", rank, size, (inner.start_idx, inner.end_idx), (0, n_kv_heads))
    return Slice("replicated", rank, size, (0, n_layers), (0, n_kv_heads))


def _pread_into(fd, buf, offset):
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at byte {offset + done} of pages.bin")
        done += n


def _read_extent(fd, extent, h0, h1):
    """uint8 (n_pages, h1 - h0, head_bytes): heads h0..h1-1 of every page, one pread per page."""
    n_pages, hb = extent.shape[0], extent.head_bytes
    buf = np.empty((n_pages, h1 - h0, hb), dtype=np.uint8)
    if h1 - h0 == extent.shape[1]:  # every head: the whole extent is one run
        _pread_into(fd, buf, extent.offset)
        return buf
    for p in range(n_pages):
        _pread_into(fd, buf[p], extent.offset + p * extent.page_bytes + h0 * hb)
    return buf


def _verify_whole_pages(fd, extent, h0, h1):
    """Format < 1.2 (no per-head table): read whole pages to check them; keep only heads h0..h1-1."""
    whole = _read_extent(fd, extent, 0, extent.shape[1])
    for p in range(extent.shape[0]):
        if hashlib.sha256(whole[p].data).digest() != extent.checksums[p]:
            raise page_error(extent, p)
    return np.ascontiguousarray(whole[:, h0:h1])


def _read_checked(fd, extent, h0, h1, verify):
    """Heads h0..h1-1 of `extent`, checked per `verify`; returns (uint8 slabs, bytes read)."""
    if verify == "pages" and extent.head_checksums is None:
        slabs = _verify_whole_pages(fd, extent, h0, h1)
        return slabs, extent.shape[0] * extent.page_bytes
    slabs = _read_extent(fd, extent, h0, h1)
    if verify == "pages":
        wrong = bad_heads(extent, slabs, h0)
        if wrong:
            raise head_error(extent, *wrong[0])
    return slabs, slabs.nbytes


class SliceData:
    """The bytes of one rank's slice of pages.bin, read and checked; offers `view(extent, dtype)` as
    `cartridge.format.pagefile.PageData` does, for the layers and heads of the slice only.

    Args:
        info (CartridgeInfo): the parsed header.
        data_file (file): pages.bin open for reading (`Snapshot.data`); closed by `close()`.
        part (Slice): what to read.
        verify (str): "pages" (check every byte read) or "header" (check nothing).

    Attributes:
        bytes_read (int): bytes of pages.bin read (its own heads, or whole pages before format 1.2).
        bytes_held (int): bytes of page data held.
        verified (str): how the bytes were checked, one line.

    Raises:
        ChecksumError: the first (page, head) or page whose bytes do not match.
    """

    def __init__(self, info, data_file, part, verify="pages"):
        self._file, self.part = data_file, part
        self._arrays, self.bytes_read, self.bytes_held = {}, 0, 0
        h0, h1 = part.heads
        fd = data_file.fileno()
        whole_pages = False
        for layer in range(*part.layers):
            for side in SIDES:
                for extent in info.extents[(layer, side)]:
                    slabs, n = _read_checked(fd, extent, h0, h1, verify)
                    whole_pages |= extent.head_checksums is None and (h0, h1) != (0, extent.shape[1])
                    self._arrays[(layer, side, extent.component)] = slabs
                    self.bytes_read += n
                    self.bytes_held += slabs.nbytes
        self.verified = _verified_line(verify, whole_pages)

    def view(self, extent, dtype):
        """This rank's heads of `extent` as (n_pages, h1 - h0, page_size, width) of `dtype`.

        Raises:
            InputError: for an extent of a layer outside the slice.
        """
        slabs = self._arrays.get((extent.layer, extent.side, extent.component))
        if slabs is None:
            raise InputError(f"layer {extent.layer} is not in this rank's slice ({self.part.describe()})")
        n_pages, _, page_size, width = extent.shape
        # (n_pages, h, head_bytes) -> (n_pages, h, page_size, width)
        return slabs.view(dtype).reshape(n_pages, slabs.shape[1], page_size, width)

    def close(self):
        """Drop the slabs and close pages.bin."""
        self._arrays.clear()
        self._file.close()


def _verified_line(verify, whole_pages):
    if verify != "pages":
        return "not verified (verify='header')"
    if whole_pages:
        return ("whole pages verified: the cartridge (format < 1.2) has no per-head checksums, "
                "so other ranks' heads were read")
    return "own heads verified (per-head checksums)"
