"""`PipelineCache` (kind "pipeline"): a `CartridgeCache` for a rank of mlx-lm's pipeline-parallel models
(`cartridge.distributed`), which chain the send to the next rank onto their layer cache's `keys`."""

import mlx.core as mx

from .cartridge import CartridgeCache


class PipelineCache(CartridgeCache):
    """A CartridgeCache whose `keys` mlx-lm's pipeline models may chain a send onto (`mx.depends`),
    so evaluating the cache evaluates the send to the next rank."""

    def _last(self):
        return max(0, self.tail_len - 1) // self.chunk_size

    @property
    def keys(self):
        """The tail chunk that holds the newest token, (1, n_kv_heads, chunk_size, head_dim); a 0-d array
        while the tail is empty."""
        return self._k_chunks[self._last()] if self._k_chunks else mx.array(0)

    @keys.setter
    def keys(self, value):
        if self._k_chunks:
            self._k_chunks[self._last()] = value
