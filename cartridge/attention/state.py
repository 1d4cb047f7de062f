"""What a `CartridgeCache` hands its layer's backend on every attention call: its dense tail (`Tail`, a value) and
its scratch (`Scratch`, device buffers the cache owns and a kernel writes in place). A backend reads these
arguments and returns the output; it never reaches into the cache (tests/attention/test_decode_purity.py)."""

from typing import NamedTuple

import mlx.core as mx
import numpy as np


class Tail(NamedTuple):
    """A cache's dense tail as a backend reads it.

    Attributes:
        k_chunks, v_chunks (list[mx.array]): the cache's preallocated chunks, each (1, n_kv_heads, chunk_size,
            head_dim) in the K/V dtype; the first `length` tokens across them are the tail, the rest is unused.
            Read only: the cache writes them (`update_and_fetch`).
        length (int): tail tokens. chunk_size (int): tokens per chunk.
        written_from (int): the lowest tail position written since the cache's previous call to its backend
            (positions from there on may differ from what that call saw; a trim lowers it at the next write).
    """

    k_chunks: list
    v_chunks: list
    length: int
    chunk_size: int
    written_from: int

    @property
    def n_chunks(self):
        """Chunks holding tail tokens."""
        return -(-self.length // self.chunk_size)

    def parts(self):
        """[(k, v)] per used chunk, each (n_kv_heads, tokens_in_chunk, head_dim)."""
        out = []
        for i, (k, v) in enumerate(zip(self.k_chunks, self.v_chunks)):
            n = min(self.chunk_size, self.length - i * self.chunk_size)
            if n > 0:
                out.append((k[0, :, :n, :], v[0, :, :n, :]))
        return out

    def kv(self):
        """The tail's keys and values, each (n_kv_heads, length, head_dim); (None, None) when empty."""
        parts = self.parts()
        if not parts:
            return None, None
        return tuple(mx.concatenate(side, axis=1) for side in zip(*parts))


class Scratch(dict):
    """One cache's device buffers that its backend's kernels write in place from call to call, by key (the CUDA
    single launch's partials and block counters: `kernels.cuda`). The cache owns them, so two caches of one layer
    never share one; calls on one cache run in order (each decode step's queries depend on the previous output).
    Its identity is the cache's, for a backend that tells caches apart (`contiguous.ContiguousKV`)."""

    def buffer(self, key, size):
        """The float32 (size,) buffer kept under `key`, made zero on first use: a buffer with its data (not a
        broadcast zero), since the kernel writes it in place."""
        work = self.get(key)
        if work is None:
            work = self[key] = mx.array(np.zeros(size, dtype=np.float32))
        return work
