"""Attention over dense pages as MLX's own SDPA over one contiguous K/V buffer per side (issue 34 item 1).

An fp16/bf16 cartridge's pages (or the dense pages of "dequantize-once") are laid out once per layer as
(1, n_kv_heads, n_tokens + room, head_dim), the layout mlx-lm's `KVCache` holds, with room for the tail
(grown `ROOM_STEP` tokens at a time, as `KVCache.step`). Each call writes the cache's new tail tokens into
the room in place and calls `mx.fast.scaled_dot_product_attention` over the first `offset` tokens: one kernel,
no split of prefix and tail, no merge. On an H200 the fused flash-decoding kernel over the same fp16 pages
took 1.09-1.11x MLX's SDPA over a contiguous cache (docs/performance.md "Attention backends"); MLX's SDPA
over the first N + 1 tokens of a buffer with room ran at dense speed (benchmarks/results/h200-fp16-gap.json).

The buffer is the layer's, shared by every cache made from one loaded cartridge; the tail stays in each
`CartridgeCache`'s chunks (trim, `tail_chunks` readers, composed and distributed caches are unchanged), and the
room mirrors the tail of the cache that called last: a call from another cache first copies that cache's
whole tail in, a call from the same cache copies only what was written since (`CartridgeCache.written_from`).
The buffer is a second copy of the prefix beside the pages (made on the first call, in the queries' dtype, and
again when a call comes from another thread than the last).

A question (more than one query token) of fp16 pages whose rows per KV head lie in `QUESTION_ROWS` (where the
tensor-core kernels were measured faster than MLX's SDPA, on an H100 and an H200) is answered by those kernels over
the pages themselves (`cuda.FusedAttention`, built on the first such call), not from the buffer: its tokens stay in the
cache's tail, and the next call that reads the buffer copies them in (`written_from` is left where it was). Decode
steps always read the buffer.
"""

import threading
import weakref

import mlx.core as mx

from ...tiers.layout import BF16, F32, FP16, layout_of

ROOM_STEP = 256  # tail tokens the buffer grows by (mlx-lm's KVCache.step)
# Questions of fp16 pages answered by `cuda.FusedAttention` over the pages: the rows per KV head (GQA group x question
# tokens) where its tensor-core kernels beat MLX's SDPA over the buffer, measured on an H100 (2026-12-05,
# benchmarks/results/h100-s8-questions.json, 32 q / 8 kv heads, head_dim 128): 8 rows (flash_pass1_tc's row blocks)
# 0.14x / 0.17x at 131,072 / 32,768 tokens; 16-128 rows (`cuda_prefill`) 0.20-0.21x / 0.24-0.25x; 192-384 rows
# 0.56-0.64x; within 1.6e-5 of it (the float64 route test passed there). Fewer than 8 rows: not measured; 512 rows
# and more: the kernel is slower (1.06x), the buffer answers. Benchmarks switch QUESTIONS_ON_PAGES.
QUESTION_ROWS = (8, 384)
QUESTIONS_ON_PAGES = True


class ContiguousAttention:
    """One layer's attention over dense pages by `mx.fast.scaled_dot_product_attention` on a contiguous buffer.

    Args:
        prefix (LayerPrefix): the layer's dense pages: both sides' `values` (n_pages, n_kv_heads, P, head_dim),
            float16, bfloat16 or float32 (an fp16/bf16 tier, or the "dequantize-once" codec), no protected tokens.
    """

    def __init__(self, prefix):
        self.prefix = prefix
        self.keys = self.values = None  # (1, n_kv, capacity, D) in the queries' dtype, made on the first call
        self.owner = None  # weakref to the cache whose tail the room holds
        self.lock = threading.Lock()  # caches of one cartridge on several threads (serve) share the buffer
        self.thread = None  # the thread whose streams the buffer's pending writes run on
        self.fused = None  # cuda.FusedAttention over the same pages, for questions (made on the first one)

    def held_bytes(self, dtype):
        """Bytes of the buffers the first call lays out: both sides' prefix + `ROOM_STEP` tokens in `dtype`
        (`cartridge.attention.policy.place` counts them, and within a memory budget that they would exceed
        takes `without_copy` instead)."""
        _, n_kv, _, D = self.prefix.k_parts["values"].shape
        return 2 * n_kv * (self.prefix.n_tokens + ROOM_STEP) * D * dtype.size

    def without_copy(self):
        """The flash-decoding kernel over the same dense pages (`cartridge.attention.kernels.cuda`): no second
        copy of the prefix, ~1.1x MLX's SDPA on an H200 (docs/performance.md)."""
        from . import cuda  # (it builds CUDA arrays at import)

        return cuda.FusedAttention(self.prefix)

    def on_pages(self, cache, queries, sinks=None):
        """The kernel over the pages that answers this call instead of the buffer, or None: while QUESTIONS_ON_PAGES,
        a question (L > 1) of fp16 pages whose rows per KV head lie in QUESTION_ROWS and that
        `cuda.FusedAttention.question_kernel_takes` (fp16/bf16 queries, a GPU with tensor cores, the tail and sinks
        its kernels read); bf16 pages keep the buffer (the kernels round to fp16)."""
        _, n_q, L, _ = queries.shape
        rows = n_q // self.prefix.k_parts["values"].shape[1] * L
        if not QUESTIONS_ON_PAGES or L < 2 or not QUESTION_ROWS[0] <= rows <= QUESTION_ROWS[1]:
            return None
        if self.fused is None:
            self.fused = self.without_copy()
        from . import cuda_prefill

        takes = self.fused.k_spec[0] == cuda_prefill.FP16 and self.fused.question_kernel_takes(cache, queries, sinks)
        return self.fused if takes else None

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

    def _sync(self, cache, dtype):
        """Write the cache's tail tokens not yet in the room (all of them for a new owner) into it."""
        n = self.prefix.n_tokens
        if self.thread != threading.get_ident():
            # MLX streams belong to a thread: writes queued on another thread's stream (a prefill chunk whose output
            # mlx-lm never evaluates) cannot be evaluated here, so the buffer is laid out anew
            self.keys = self.values = None
            self.thread = threading.get_ident()
        fresh = self._reserve(n + cache.tail_len, dtype)
        owner = self.owner() if self.owner is not None else None
        start = 0 if fresh or owner is not cache else min(cache.written_from, cache.tail_len)
        size = cache.chunk_size
        for i in range(start // size, -(-cache.tail_len // size)):
            a, b = max(start, i * size), min(cache.tail_len, (i + 1) * size)  # tail tokens [a, b) of chunk i
            # sliced from the chunks, so that evaluating the attention evaluates the chunks' writes too (generate_step
            # evaluates only its outputs); 4-D slices, no astype to the same dtype: host time per decode step
            for buf, chunk in ((self.keys, cache.tail_chunks[0][i]), (self.values, cache.tail_chunks[1][i])):
                x = chunk[:, :, a - i * size:b - i * size]
                buf[:, :, n + a:n + b] = x if x.dtype == dtype else x.astype(dtype)
        self.owner = weakref.ref(cache)
        cache.written_from = cache.tail_len

    def __call__(self, cache, queries, scale, sinks=None):
        """Attention of the last L tail tokens over prefix + tail, causal among the tail.

        Args:
            cache (CartridgeCache): the tail (its chunks, `tail_len`, `written_from`).
            queries (mx.array): (1, n_q_heads, L, head_dim). scale (float): softmax scale.
            sinks (mx.array | None): (n_q_heads,) sink logits (gpt-oss), or None.

        Returns:
            mx.array: (1, n_q_heads, L, head_dim) in the queries' dtype.
        """
        kernel = self.on_pages(cache, queries, sinks)
        if kernel is not None:  # the buffer is not touched: the next call that reads it copies this call's tokens
            return kernel(cache, queries, scale, sinks)
        with self.lock:  # MLX arrays are values: the slices keep this call's tail even if another cache syncs next
            self._sync(cache, queries.dtype)
            n = self.prefix.n_tokens + cache.tail_len
            k, v = self.keys[:, :, :n], self.values[:, :, :n]
        # "causal" with fewer queries than keys lines the queries up with the last keys: every prefix token visible
        mask = "causal" if queries.shape[2] > 1 else None
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


def reads(prefix):
    """True if `ContiguousAttention` reads this layer: both sides dense pages (an fp16/bf16/float32 tier's or the
    "dequantize-once" codec's, not rotated) of one dtype and head_dim, and no protected tokens."""
    sides = ((prefix.k_codec, prefix.k_parts), (prefix.v_codec, prefix.v_parts))
    found = [layout_of(codec, parts) for codec, parts in sides]
    if prefix.protected is not None or any(f is None or f.tier_id not in (FP16, BF16, F32) for f in found) \
            or any(hasattr(codec, "base") for codec, _ in sides):  # a +rot side: stored in its rotated basis
        return False
    k, v = prefix.k_parts["values"], prefix.v_parts["values"]
    return k.dtype == v.dtype and k.shape[-1] == v.shape[-1]
