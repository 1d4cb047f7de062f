"""`SharedPrefixCache` (kind "shared_prefix"): the cache of one layer in calibration's batched walk
(`cartridge.calibrate.measure.wavefront`).

The first rows of the walk attend over the same fp16 prefix and the last one (or few) over its replacement,
each row also over its own evaluation tokens. mlx-lm's attention would take R copies of the prefix and run R x n_heads
small products; here the shared rows' queries are stacked into one product per KV head, and the own-token
part is merged in the same softmax. `route` sends a `PrefillCache`'s attention to its `attention` method.
It holds one call's rows: `update_and_fetch` keeps nothing, so it is made afresh for each step of the walk.
On CPU the exponentials run in numpy, in place in the scores' buffers (`shifted_exp`): MLX's CPU exp is
scalar code, ~8x numpy's SIMD one (attention/kernels/cpu.py), and they were most of the walk's time.
"""

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from .base import NOT_SAVED, refuse_state, refuse_trim
from .prefill import PrefillCache


class SharedPrefixCache(PrefillCache):
    """One layer of the walk: a shared prefix (k, v), the last `replaced_rows` rows' replacement (k2, v2).

    Args:
        k, v, k2, v2 (mx.array): (1, n_kv_heads, S, head_dim) each: the K/V the layer stores, of positions
            position - S .. position - 1.
        replaced_rows (int): the last rows attending over (k2, v2), at least 1 and fewer than the rows.
            Default: 1.
        position (int | None): the position of the rows' first own token (RoPE's offset). Default: S.
        window (int | None): a sliding-window layer's size (mlx-lm's `max_size`): a query at position p
            attends the keys at p - window + 1 .. p only, as `create_causal_mask(window_size=)`. Default: None.

    Attributes:
        scale (float): the softmax scale of the layer's attention, once it has attended.
    """

    def __init__(self, k, v, k2, v2, replaced_rows=1, position=None, window=None):
        KVCache.__init__(self)  # not PrefillCache's: nothing to decode
        self.prefix, self.replaced, self.replaced_rows = (k, v), (k2, v2), replaced_rows
        self.window, self.scale = window, None
        self.offset = self.prefix_tokens = k.shape[2] if position is None else position

    def update_and_fetch(self, keys, values):
        """Keep the rows' own K/V, (R, n_kv_heads, E, head_dim); the prefix is attended in `attention`."""
        self.offset += keys.shape[2]
        return keys, values

    @property
    def state(self):
        """(k, v, k2, v2, NOT_SAVED): the prefix and its replacement, and the marker `save_prompt_cache` stops at."""
        return (*self.prefix, *self.replaced, NOT_SAVED)

    @state.setter
    def state(self, v):
        refuse_state("SharedPrefixCache", "calibration's walk")

    @property
    def meta_state(self):
        """(prefix tokens, replaced rows, position of the rows' first own token) as strings."""
        return str(self.prefix[0].shape[2]), str(self.replaced_rows), str(self.prefix_tokens)

    def is_trimmable(self):
        """False: it keeps no tokens of its own to trim."""
        return False

    def trim(self, n):
        """Refused (`is_trimmable` is False).

        Raises:
            CartridgeError: always.
        """
        refuse_trim("SharedPrefixCache", "it keeps none of the tokens fed to it")

    def empty(self):
        """Never empty: it holds the prefix."""
        return False

    @property
    def nbytes(self):
        """Bytes of the prefix and its replacement."""
        return sum(x.nbytes for x in (*self.prefix, *self.replaced))

    def attention(self, queries, keys, values, scale, mask, fallback=None):
        """Causal attention of queries (R, n_heads, E, head_dim) over the prefix of their row and their own
        keys/values (R, n_kv_heads, E, head_dim): (R, n_heads, E, head_dim) in the queries' dtype."""
        r, h, e, d = queries.shape
        n_kv, n, s = keys.shape[1], self.replaced_rows, self.prefix[0].shape[2]
        self.scale = scale
        q = (queries.astype(mx.float32) * scale).reshape(r, n_kv, h // n_kv * e, d)  # (R, n_kv, g * E, D)
        rows = q.shape[2]
        pre = mx.concatenate([_stacked(q[:-n], self.prefix[0].swapaxes(-1, -2)),
                              _stacked(q[-n:], self.replaced[0].swapaxes(-1, -2))])  # (R, n_kv, g E, S)
        own = q @ keys.astype(mx.float32).swapaxes(-1, -2)  # (R, n_kv, g E, E)
        position = mx.arange(rows) % e  # query row g_i * E + i is at position i
        own = mx.where(mx.arange(e)[None] <= position[:, None], own, -mx.inf)
        if self.window is not None:  # own key j is seen from i > j - window; prefix key m from i < m + window - S
            own = mx.where(mx.arange(e)[None] > position[:, None] - self.window, own, -mx.inf)
            pre = mx.where(window_visible(e, s, self.window)[position], pre, -mx.inf)
        (p_pre, p_own), sums = shifted_exp(pre, own)
        out_pre = mx.concatenate([_stacked(p_pre[:-n], self.prefix[1]), _stacked(p_pre[-n:], self.replaced[1])])
        out = (out_pre + p_own @ values.astype(mx.float32)) / (sums[0] + sums[1])
        return out.reshape(r, h, e, d).astype(queries.dtype)  # (R, n_kv, g, E, D) -> (R, n_heads, E, D)


def window_visible(e, s, window):
    """(E, S) bool: which of a window layer's S stored prefix keys (the positions just before E's first) each of
    E's queries attends to: key m from query i when m > i + S - window (mlx-lm's sliding-window mask)."""
    return mx.arange(s)[None] > mx.arange(e)[:, None] + s - window


def _stacked(x, y):
    """x (B, n_kv, M, N) times y (1, n_kv, N, P) as one product per KV head -> (B, n_kv, M, P) float32."""
    b, n_kv, m, _ = x.shape
    prod = x.transpose(1, 0, 2, 3).reshape(n_kv, b * m, -1) @ y[0].astype(mx.float32)  # (n_kv, B M, P)
    return prod.reshape(n_kv, b, m, -1).transpose(1, 0, 2, 3)


def shifted_exp(*scores):
    """exp(s - m) of float32 score arrays sharing their leading axes, m the max over all of their last axes.

    Args:
        scores (mx.array): float32 (..., N_i) each; -inf entries are masked.

    Returns:
        tuple: ([exp(s_i - m)] each shaped as s_i, [their row sums (..., 1) float32]). On CPU the exponentials
        are computed by numpy in the scores' own (evaluated) buffers, so the inputs (and any view of them,
        slices included) must not be used again.
    """
    if mx.default_device() != mx.cpu:
        top = mx.max(mx.concatenate([s.max(axis=-1, keepdims=True) for s in scores], axis=-1), axis=-1, keepdims=True)
        exps = [mx.exp(s - top) for s in scores]
        return exps, [e.sum(axis=-1, keepdims=True) for e in exps]
    mx.eval(*scores)
    views = [np.asarray(s) for s in scores]  # the arrays' own buffers: writes are changes of the arrays
    top = np.maximum.reduce([a.max(axis=-1, keepdims=True) for a in views])
    for a in views:
        np.subtract(a, top, out=a)
        np.exp(a, out=a)
    return list(scores), [mx.array(a.sum(axis=-1, keepdims=True)) for a in views]
