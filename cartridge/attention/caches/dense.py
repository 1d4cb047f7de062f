"""`PrefixKVCache` (kind "dense"): mlx-lm's KVCache over a dense layer's shared decoded prefix, for the layers
whose model computes attention itself (`cartridge.attention.layers.DenseLayer`)."""

from mlx_lm.models.cache import KVCache

from .base import NOT_SAVED, refuse_state


class PrefixKVCache(KVCache):
    """mlx-lm's KVCache over a dense layer's shared decoded prefix: as `CartridgeCache`, it trims its tail and
    never the prefix (so every layer of a cartridge's prompt cache trims alike, and no write lands in the
    shared arrays), and mlx-lm's `save_prompt_cache` refuses it at once (`NotSaved`).

    Args:
        keys, values (mx.array): the decoded prefix, (1, n_kv_heads, T, head_dim), shared and never written.
    """

    def __init__(self, keys, values):
        super().__init__()
        self.keys, self.values = keys, values
        self.offset = self.prefix_tokens = keys.shape[2]

    @property
    def state(self):
        """(keys, values, offset, NOT_SAVED): mlx-lm's KVCache state and the marker `save_prompt_cache` stops at."""
        return self.keys, self.values, self.offset, NOT_SAVED

    @state.setter
    def state(self, v):
        refuse_state("PrefixKVCache", "a loaded cartridge's prompt_cache()")

    @property
    def meta_state(self):
        """(prefix tokens, tail tokens) as strings."""
        return str(self.prefix_tokens), str(self.offset - self.prefix_tokens)

    def trim(self, n):
        """Drop up to n tokens from the end of the tail, never from the prefix; returns how many were dropped."""
        n = min(self.offset - self.prefix_tokens, n)
        self.offset -= n
        return n
