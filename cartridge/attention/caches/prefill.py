"""`PrefillCache` (kind "prefill"): an mlx-lm KVCache that starts holding a cartridge layer's decoded prefix (extend).

Extend prefills new text over the stored document. Decoded once into a plain KVCache, the stored
prefix makes that prefill what mlx-lm's own chunked prefill of the new tokens over cached ones is;
`route` sends its attention on CPU to `kernels.cpu.attention` (the softmax in numpy), elsewhere to
mlx-lm's. Memory: the prefix in the model's dtype, as a build of the whole document holds it.
"""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..kernels import cpu
from ..pages import decode_prefix
from .base import NOT_SAVED, refuse_state


class PrefillCache(KVCache):
    """One layer's prefix (decoded to dense) and the tokens fed after it.

    Args:
        prefix (LayerPrefix): the stored pages of the layer.
        n_tokens (int): prefix tokens to keep (<= prefix.n_tokens; fewer where extend's seam moved).
        dtype (mx.Dtype): the dtype the model computes K/V in.
    """

    def __init__(self, prefix, n_tokens, dtype):
        super().__init__()
        keys, values = decode_prefix(prefix, dtype)  # (1, n_kv_heads, prefix.n_tokens, head_dim)
        mx.eval(keys, values)
        self.keys, self.values = keys[:, :, :n_tokens], values[:, :, :n_tokens]
        self.offset = self.prefix_tokens = n_tokens

    @property
    def state(self):
        """(keys, values, offset, NOT_SAVED): mlx-lm's KVCache state, the prefix included, and the marker
        mlx-lm's `save_prompt_cache` stops at (a file would name a class its `load_prompt_cache` cannot find)."""
        return (*super().state, NOT_SAVED)

    @state.setter
    def state(self, v):
        refuse_state("PrefillCache", "extend over a loaded cartridge")

    @property
    def meta_state(self):
        """(prefix tokens, tail tokens) as strings."""
        return str(self.prefix_tokens), str(self.offset - self.prefix_tokens)

    def tail_kv(self):
        """K and V fed after the prefix, each (n_kv_heads, T, head_dim); (None, None) when none."""
        if self.offset == self.prefix_tokens:
            return None, None
        return tuple(x[0, :, self.prefix_tokens:self.offset] for x in (self.keys, self.values))

    def attention(self, queries, keys, values, scale, mask, fallback):
        """Attention of the newest `queries` over `keys`/`values` (what `update_and_fetch` returned).

        On CPU, with mlx-lm's "causal" or no mask and no sinks, `kernels.cpu.attention`; otherwise
        `fallback(queries, keys, values, scale=, mask=)` (mlx-lm's own).
        """
        if queries.shape[0] == 1 and mx.default_device() == mx.cpu and (mask is None or isinstance(mask, str) and mask == "causal"):
            return cpu.attention(queries, keys, values, scale, causal=mask == "causal")
        return fallback(queries, keys, values, cache=self, scale=scale, mask=mask)
