"""The CUDA backend's path for dense pages: MLX's own SDPA over one contiguous K/V buffer per layer (issue 34 item 1).

An fp16/bf16 cartridge's pages (or the dense pages of "dequantize-once") are laid out once per layer as
(1, n_kv_heads, n_tokens + room, head_dim), the layout mlx-lm's `KVCache` holds, with room for a tail (grown
`ROOM_STEP` tokens at a time, as `KVCache.step`). Each call writes the calling cache's new tail tokens into the room
in place and calls `mx.fast.scaled_dot_product_attention` over the first `offset` tokens: one kernel, no split of
prefix and tail, no merge (why, measured: docs/performance.md "Dense pages").

The buffer (`ContiguousKV`) is a second copy of the prefix beside the pages, shared by every cache made from one
loaded cartridge (the layer's record, `Contiguous`, holds it). Each cache keeps its tail in its own chunks (trim,
`tail_chunks` readers, composed and distributed caches are unchanged); the room mirrors the tail of one cache at a
time, its owner: a call from another cache first copies that cache's whole tail in, a call from the owner copies only
what was written since its previous call (`Tail.written_from`) or was left out of the room before (`synced`). The
buffer is made on the first call, in the queries' dtype, and again when a call comes from another thread than the last.

A question (more than one query token) of fp16 pages whose rows per KV head lie in `CudaTuning.question_rows` is
answered by the tensor-core kernels over the pages themselves (`kernels.cuda.attend`), not from the buffer: its tokens
stay in the cache's tail, and the next call that reads the buffer copies them in. Decode steps always read the buffer.
"""

import threading
import weakref
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from ..tiers.layout import BF16, F32, FP16, layout_of
from .kernels import cuda, cuda_inputs

ROOM_STEP = 256  # tail tokens the buffer grows by (mlx-lm's KVCache.step)


class ContiguousKV:
    """One layer's K and V, each one (1, n_kv_heads, capacity, head_dim) buffer: the prefix, then room for one
    cache's tail. Shared by the caches of one loaded cartridge; calls from several threads (serve) take turns.

    Args:
        prefix (LayerPrefix): the layer's dense pages: both sides' `values` (n_pages, n_kv_heads, P, head_dim).
    """

    def __init__(self, prefix):
        self.prefix = prefix
        self.keys = self.values = None  # in the queries' dtype, made on the first call
        self.owner = None  # weakref to the scratch (`state.Scratch`) of the cache whose tail the room holds
        self.synced = 0  # the owner's tail tokens 0 .. synced - 1 are in the room as of its last read
        self.lock = threading.Lock()
        self.thread = None  # the thread whose streams the buffer's pending writes run on

    def _layout(self, parts, dtype, capacity):
        """A side's pages (n_pages, n_kv, P, D) as (1, n_kv, capacity, D) of `dtype`: the prefix, then zeros."""
        x = parts["values"]
        n_pages, n_kv, page, D = x.shape
        # (n_pages, n_kv, P, D) -> (1, n_kv, n_pages * P, D), the valid tokens, then the room
        seq = x.transpose(1, 0, 2, 3).reshape(1, n_kv, n_pages * page, D)[:, :, :self.prefix.n_tokens]
        room = mx.zeros((1, n_kv, capacity - self.prefix.n_tokens, D), dtype=dtype)
        return mx.concatenate([seq.astype(dtype), room], axis=2)

    def _reserve(self, need, dtype):
        """Make the buffers hold at least `need` tokens in `dtype` (True if they were made anew: room empty)."""
        if self.keys is not None and self.keys.dtype == dtype and self.keys.shape[2] >= need:
            return False
        capacity = -(-need // ROOM_STEP) * ROOM_STEP + ROOM_STEP
        if self.keys is None or self.keys.dtype != dtype:
            self.keys = self._layout(self.prefix.k_parts, dtype, capacity)
            self.values = self._layout(self.prefix.v_parts, dtype, capacity)
            self.owner = None
            return True
        # growth keeps the room's contents (one copy of the buffer per ROOM_STEP tail tokens, as KVCache)
        extra = capacity - self.keys.shape[2]
        n_kv, D = self.keys.shape[1], self.keys.shape[3]
        pad = mx.zeros((1, n_kv, extra, D), dtype=dtype)
        self.keys = mx.concatenate([self.keys, pad], axis=2)
        self.values = mx.concatenate([self.values, pad], axis=2)
        return False

    def read(self, owner, tail, dtype):
        """The prefix and `tail` as (keys, values), each (1, n_kv, prefix + tail tokens, head_dim) of `dtype`,
        after writing into the room the tail tokens not yet there (all of them for a new owner).

        Args:
            owner (state.Scratch): the calling cache's scratch: who the tail belongs to.
            tail (state.Tail): its tail. dtype (mx.Dtype): the queries' dtype.
        """
        with self.lock:  # MLX arrays are values: the slices keep this call's tail even if another cache reads next
            n = self.prefix.n_tokens
            if self.thread != threading.get_ident():
                # MLX streams belong to a thread: writes queued on another thread's stream (a prefill chunk whose
                # output mlx-lm never evaluates) cannot be evaluated here, so the buffer is laid out anew
                self.keys = self.values = None
                self.thread = threading.get_ident()
            fresh = self._reserve(n + tail.length, dtype)
            held = self.owner() if self.owner is not None else None
            start = 0 if fresh or held is not owner else min(tail.written_from, self.synced, tail.length)
            size = tail.chunk_size
            for i in range(start // size, tail.n_chunks):
                a, b = max(start, i * size), min(tail.length, (i + 1) * size)  # tail tokens [a, b) of chunk i
                # sliced from the chunks, so that evaluating the attention evaluates the chunks' writes too
                # (generate_step evaluates only its outputs); 4-D slices, no astype to the same dtype: host time
                for buf, chunk in ((self.keys, tail.k_chunks[i]), (self.values, tail.v_chunks[i])):
                    x = chunk[:, :, a - i * size:b - i * size]
                    buf[:, :, n + a:n + b] = x if x.dtype == dtype else x.astype(dtype)
            self.owner, self.synced = weakref.ref(owner), tail.length
            return self.keys[:, :, :n + tail.length], self.values[:, :, :n + tail.length]

    def left_out(self, owner, tail):
        """Note that the owner's tail tokens from `tail.written_from` on were attended without the room (a question
        over the pages): its next read copies them in."""
        with self.lock:
            if self.owner is not None and self.owner() is owner:
                self.synced = min(self.synced, tail.written_from)


@dataclass(frozen=True, eq=False)
class Contiguous:
    """The CUDA backend's record of a layer of dense pages (`LayerPrefix.backend`).

    Attributes:
        buffer (ContiguousKV): the layer's contiguous K/V, shared by its caches.
        pages (CudaInputs): the same pages as the flash kernels take them: questions in `question_rows`, and the
            layer's record where a memory budget leaves no room for the buffer (`without_copy`).
    """

    name: ClassVar[str] = "cuda"
    buffer: ContiguousKV
    pages: cuda_inputs.CudaInputs

    def held_bytes(self, dtype):
        """Bytes of the buffers the first call lays out: both sides' prefix + `ROOM_STEP` tokens in `dtype`
        (`cartridge.attention.policy.place` counts them, and within a memory budget that they would exceed
        takes `without_copy` instead)."""
        prefix = self.buffer.prefix
        _, n_kv, _, D = prefix.k_parts["values"].shape
        return 2 * n_kv * (prefix.n_tokens + ROOM_STEP) * D * dtype.size

    def without_copy(self):
        """The flash-decoding kernels' record of the same dense pages (`kernels.cuda`): no second copy of the
        prefix, a little slower than MLX's SDPA (docs/performance.md "Dense pages")."""
        return self.pages


def lay_out(prefix, tuning=None):
    """The `Contiguous` record of a layer that `reads` holds for (the buffer itself is made on the first call).

    Args:
        prefix (LayerPrefix): the layer's dense pages. tuning (CudaTuning | None): as `cuda_inputs.lay_out`.
    """
    return Contiguous(ContiguousKV(prefix), cuda_inputs.lay_out(prefix, tuning))


def on_pages(record, queries, tail):
    """True if this call is answered by the kernels over the pages instead of the buffer: a question (L > 1) of fp16
    pages whose rows per KV head lie in `question_rows` and that `cuda.question_kernel_takes` (fp16/bf16 queries, a
    GPU with tensor cores, the tail its kernels read); bf16 pages keep the buffer (the kernels round to fp16)."""
    pages = record.pages
    _, n_q, L, _ = queries.shape
    lo, hi = pages.tuning.question_rows
    if L < 2 or not lo <= n_q // pages.n_kv * L <= hi:
        return False
    return pages.k_spec[0] == FP16 and cuda.question_kernel_takes(pages, queries, tail)


def attend(record, prefix, queries, tail, scale, sinks, scratch):
    """Attention of the last L tail tokens over prefix + tail, causal among the tail (`AttentionBackend.attend`):
    over the pages (`on_pages`), else MLX's SDPA over the buffer, after it copies in the cache's new tail tokens.

    Args:
        record (Contiguous): the layer's. prefix (LayerPrefix): its pages.
        queries (mx.array): (1, n_q_heads, L, head_dim). tail (state.Tail): the cache's tail.
        scale (float): softmax scale. sinks (mx.array | None): (n_q_heads,) sink logits (gpt-oss), or None.
        scratch (state.Scratch): the cache's (its identity names the buffer's owner).

    Returns:
        mx.array: (1, n_q_heads, L, head_dim) in the queries' dtype.
    """
    if on_pages(record, queries, tail):
        record.buffer.left_out(scratch, tail)
        return cuda.attend(record.pages, prefix, queries, tail, scale, sinks, scratch)
    k, v = record.buffer.read(scratch, tail, queries.dtype)
    # "causal" with fewer queries than keys lines the queries up with the last keys: every prefix token visible
    mask = "causal" if queries.shape[2] > 1 else None
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


def reads(prefix):
    """True if `Contiguous` reads this layer: both sides dense pages (an fp16/bf16/float32 tier's or the
    "dequantize-once" codec's, not rotated) of one dtype and head_dim, and no protected tokens."""
    sides = ((prefix.k_codec, prefix.k_parts), (prefix.v_codec, prefix.v_parts))
    found = [layout_of(codec, parts) for codec, parts in sides]
    if prefix.protected is not None or any(f is None or f.tier_id not in (FP16, BF16, F32) for f in found) \
            or any(hasattr(codec, "base") for codec, _ in sides):  # a +rot side: stored in its rotated basis
        return False
    k, v = prefix.k_parts["values"], prefix.v_parts["values"]
    return k.dtype == v.dtype and k.shape[-1] == v.shape[-1]
