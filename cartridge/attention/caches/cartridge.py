"""`CartridgeCache` (kind "cartridge"): mlx-lm's cache protocol over a frozen compressed prefix plus a dense tail.

The prefix is the cartridge's pages for one layer, shared by every cache made from one loaded
cartridge and never written. New tokens (the question, then generated tokens) go to a dense tail
preallocated in fixed chunks, so nothing grows by concatenation. Attention is computed as
prefix part (+) tail part, merged exactly by log-sum-exp (`cartridge.attention.kernels`), or by the
layer's backend (`LayerPrefix.backend`), which gets the tail and the cache's scratch as arguments
(`cartridge.attention.state`) and returns the output.
"""


import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ...errors import CartridgeError
from .. import backends
from ..kernels import merge, prefix_partial, tail_partial
from ..state import Scratch, Tail
from .base import NOT_SAVED, refuse_state


def sink_partial(sinks, n_kv, L, v_dim):
    """Attention sinks as one more partial (o, m, l) = (0, sink, 1) per query row: a logit with no value.

    Args:
        sinks (mx.array): (n_q_heads,) sink logits; head h = kv * group + g.
        n_kv (int): KV heads. L (int): query tokens. v_dim (int): V's head_dim.

    Returns:
        tuple: o (n_kv, group * L, v_dim) zeros, m (n_kv, group * L) the sink, l ones; float32.
    """
    # (n_q,) -> (n_kv, group) -> (n_kv, group * L): row g * L + i holds head g's sink
    m = mx.repeat(sinks.astype(mx.float32).reshape(n_kv, -1), L, axis=1)
    return mx.zeros((*m.shape, v_dim), dtype=mx.float32), m, mx.ones(m.shape, dtype=mx.float32)


def per_query_head(scale, n_heads):
    """A K scale (n_kv_heads, head_dim) laid out as (1, n_heads, 1, head_dim): head i takes KV head i // group's
    row (mlx-lm's GQA), n_heads a multiple of n_kv_heads (n_kv_heads itself for keys)."""
    return mx.repeat(scale, n_heads // scale.shape[0], axis=0)[None, :, None, :]


class CartridgeCache(_BaseCache):
    """One layer's cache: frozen prefix pages + dense tail in chunks of `chunk_size` tokens.

    Args:
        prefix (LayerPrefix): the shared prefix of this layer.
        chunk_size (int): tail tokens per preallocated chunk. Default: 256.

    Models use it through `offset` and `update_and_fetch`; attention goes through
    `cartridge.attention.route.scaled_dot_product_attention`, which calls `attention()`.
    What a backend keeps from call to call for one cache is the cache's: `written_from` (handed over in
    `Tail`) and `scratch` (the buffers its kernels write in place).
    """

    def __init__(self, prefix, chunk_size=256):
        self.prefix = prefix
        self.chunk_size = chunk_size
        self._k_chunks, self._v_chunks = [], []
        self.tail_len = 0
        self.written_from = 0  # lowest tail position written since the last call to the layer's backend
        self.scratch = Scratch()  # device buffers the backend's kernels write in place for this cache
        # the registry entry whose `attend` reads the layer's backend record (None: the portable path)
        self._backend = None if prefix.backend is None else backends.get(prefix.backend.name)
        # K stored as K / s (format 1.11): the tail keeps its keys / s and the queries are multiplied by s, so that
        # every backend reads one basis, (q * s) . (k / s) = q . k
        self._tail_scale = prefix.key_scale  # what the tail's keys are divided by (None: stored as computed)
        self._scales = {}  # (what, heads, dtype) -> the scale laid out and cast once: one multiply per call

    @property
    def offset(self):
        """Tokens held: prefix + tail (the position of the next token)."""
        return self.prefix.n_tokens + self.tail_len

    def _write(self, chunks, x, start):
        B, n_kv, L, D = x.shape
        index, at = divmod(start, self.chunk_size)
        if at + L <= self.chunk_size and index < len(chunks):  # every decode step: one op, no loop
            chunks[index][:, :, at:at + L] = x  # (4-D slices: cheaper to build than with an Ellipsis)
            return
        done = 0
        while done < L:
            index, at = divmod(start + done, self.chunk_size)
            if index == len(chunks):
                chunks.append(mx.zeros((B, n_kv, self.chunk_size, D), dtype=x.dtype))
            n = min(L - done, self.chunk_size - at)
            # the whole of x when it fits (every decode step): one op fewer per side and layer
            chunks[index][..., at:at + n, :] = x if n == L else x[..., done:done + n, :]
            done += n

    def update_and_fetch(self, keys, values):
        """Append new K/V (1, n_kv_heads, L, head_dim) to the tail.

        Returns:
            tuple: the tail chunk lists (`tail_chunks`). Models hand them to the attention function,
            which reads prefix and tail from the cache itself; plain `mx.fast` attention refuses them.
        """
        if keys.shape[0] != 1:
            raise CartridgeError(f"a cartridge holds one sequence; got batch size {keys.shape[0]}")
        self.written_from = min(self.written_from, self.tail_len)
        if self._tail_scale is not None:
            keys = keys * self._scale_as("k", keys)
        self._write(self._k_chunks, keys, self.tail_len)
        self._write(self._v_chunks, values, self.tail_len)
        self.tail_len += keys.shape[2]
        return self.tail_chunks

    def _scale_as(self, what, x):
        """(1, heads, 1, head_dim) in x's dtype: s for queries ("q", query head i reading KV head i // group), 1 / s
        for new keys ("k"); made once per (what, heads, dtype)."""
        key = (what, x.shape[1], x.dtype)
        if key not in self._scales:
            s = per_query_head(1.0 / self._tail_scale if what == "k" else self.prefix.key_scale, x.shape[1])
            self._scales[key] = s.astype(x.dtype)
            mx.eval(self._scales[key])
        return self._scales[key]

    def tail(self):
        """The tail as the layer's backend reads it (`state.Tail`: the chunks themselves, not copies)."""
        return Tail(self._k_chunks, self._v_chunks, self.tail_len, self.chunk_size, self.written_from)

    @property
    def tail_chunks(self):
        """The tail's preallocated chunks, for kernels that read the tail in place.

        Returns:
            tuple: (k_chunks, v_chunks), lists of (1, n_kv_heads, chunk_size, head_dim) arrays in the K/V
            dtype; the first `tail_len` tokens across the chunks are the tail, the rest is unused.
        """
        return self._k_chunks, self._v_chunks

    def tail_kv(self):
        """The tail's keys and values as the model computed them (a scaled layer's keys multiplied back), each
        (n_kv_heads, tail_len, head_dim); (None, None) when empty."""
        k, v = self.tail().kv()
        if k is None or self._tail_scale is None:
            return k, v
        return (k * self._tail_scale[:, None, :]).astype(k.dtype), v

    def attention(self, queries, scale, mask=None, sinks=None):
        """Attention of `queries` over prefix + tail.

        Args:
            queries (mx.array): (1, n_q_heads, L, head_dim), the last L tokens of the tail.
            scale (float): softmax scale, usually head_dim ** -0.5.
            mask (None | str | mx.array): None, "causal", or a bool array broadcastable to
                (1, n_q_heads, L, offset); the causal structure among new tokens always applies.
            sinks (mx.array | None): (n_q_heads,) sink logits (gpt-oss): one more logit per head in
                the softmax, with no value. Default: None.

        Returns:
            mx.array: (1, n_q_heads, L, v_head_dim) in the queries' dtype.

        Raises:
            CartridgeError: for a mask that hides prefix tokens or is not boolean.
        """
        p = self.prefix
        if p.key_scale is not None:  # before any rotation: the kernels rotate q * s into K's stored basis
            queries = queries * self._scale_as("q", queries)
        if self._backend is not None and (mask is None or isinstance(mask, str)):
            tail = Tail(self._k_chunks, self._v_chunks, self.tail_len, self.chunk_size, self.written_from)
            out = self._backend.attend(p.backend, p, queries, tail, scale, sinks, self.scratch)
            self.written_from = self.tail_len
            if out is not None:
                return out
        _, n_q, L, D = queries.shape
        n_kv = p.n_kv_heads
        group = n_q // n_kv
        # (1, n_q, L, D) -> (n_kv, group * L, D): the query heads of one KV head side by side
        q = (queries.astype(mx.float32) * scale).reshape(n_kv, group * L, D)
        tail = self._tail_partials(q, mask, n_kv, group, L)  # checks the mask before any prefix work
        parts = [prefix_partial(q, p, p.n_tokens)]
        if p.protected is not None:  # fp16 copies of the positions prefix_partial masked out
            parts.append(tail_partial(q, p.protected.k, p.protected.v, True))
        parts += tail
        if sinks is not None:
            parts.append(sink_partial(sinks, n_kv, L, parts[0][0].shape[-1]))
        # (n_kv, group * L, Dv) -> (1, n_q, L, Dv)
        return merge(parts).reshape(1, n_q, L, -1).astype(queries.dtype)

    def _tail_partials(self, q, mask, n_kv, group, L):
        """The partials of the tail's chunks, each under its slice of `_tail_keep` (causal + `mask`);
        q is (n_kv, group * L, D), scaled float32. The one tail path of this cache and of composed caches."""
        keep = self._tail_keep(mask, n_kv, group, L)  # (n_kv | 1, group * L, tail_len)
        partials, start = [], 0
        for k, v in self.tail().parts():
            end = start + k.shape[1]
            partials.append(tail_partial(q, k, v, keep[..., start:end]))
            start = end
        return partials

    def _tail_keep(self, mask, n_kv, group, L):
        """Which tail keys each query row sees: causal among the new tokens, and `mask` if given."""
        qpos = mx.arange(group * L) % L + (self.tail_len - L)
        keep = (qpos[:, None] >= mx.arange(self.tail_len)[None, :])[None]
        if mask is None or isinstance(mask, str):
            return keep
        if mask.dtype != mx.bool_:
            raise CartridgeError(f"only boolean masks are supported over a cartridge prefix, got {mask.dtype}")
        # (..., L, offset) -> (n_kv, group * L, offset)
        full = mx.broadcast_to(mask, (1, n_kv * group, L, self.offset)).reshape(n_kv, group * L, self.offset)
        if not mx.all(full[..., : self.prefix.n_tokens]).item():
            raise CartridgeError("a mask that hides cartridge prefix tokens is not supported")
        return keep & full[..., self.prefix.n_tokens:]

    def make_mask(self, N, return_array=False, window_size=None):
        """Mask for N new tokens, as mlx-lm's KVCache gives it ("causal", None or a bool array)."""
        if window_size is not None:
            raise CartridgeError("sliding-window attention is not supported over a cartridge prefix")
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=None)

    @property
    def state(self):
        """([k chunks], [v chunks], NOT_SAVED): the tail chunks, each (1, n_kv_heads, chunk_size, head_dim), for
        `mx.eval`; the marker makes mlx-lm's `save_prompt_cache` fail at once (`NotSaved`)."""
        return self._k_chunks, self._v_chunks, NOT_SAVED

    @state.setter
    def state(self, v):
        refuse_state(type(self).__name__, "a loaded cartridge's prompt_cache()")

    @property
    def meta_state(self):
        """(prefix tokens, tail tokens, chunk size) as strings."""
        return str(self.prefix.n_tokens), str(self.tail_len), str(self.chunk_size)

    def is_trimmable(self):
        """The tail can be trimmed (mlx-lm's `can_trim_prompt_cache`); the shared prefix cannot."""
        return True

    def trim(self, n):
        """Drop up to n tokens from the end of the tail, never from the prefix (mlx-lm's `trim_prompt_cache`
        calls it); returns how many were dropped, as mlx-lm's KVCache.trim does."""
        n = min(self.tail_len, n)
        self.tail_len -= n
        return n

    def size(self):
        """Tokens held (prefix + tail)."""
        return self.offset

    def empty(self):
        """Never empty: the prefix always holds at least one token."""
        return False

    @property
    def nbytes(self):
        """Bytes held: prefix pages + allocated tail chunks."""
        return self.prefix.nbytes + sum(c.nbytes for c in self._k_chunks + self._v_chunks)
