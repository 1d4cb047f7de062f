"""The cache kinds: one small class per kind, each with mlx-lm's cache protocol (`PROTOCOL`), found through `KINDS`.

    kind            class               what it holds                                           made by
    cartridge       CartridgeCache      a layer's stored pages + a dense tail                   Cartridge.prompt_cache()
    dense           PrefixKVCache       a dense layer's decoded prefix + tail (mlx-lm KVCache)  DenseLayer.cache()
    prefill         PrefillCache        a decoded prefix + the new text (mlx-lm KVCache)        extend
    composed        ComposedCache       several documents' pages, patches + a dense tail        compose
    blend           BlendCache          the same, while selected tokens are recomputed          compose (CacheBlend)
    pipeline        PipelineCache       a CartridgeCache whose `keys` a pipeline send chains on distributed
    shared_prefix   SharedPrefixCache   a shared prefix and its replacement for a batch of rows calibrate's walk

Models touch each through `offset`, `update_and_fetch` and `make_mask`; mlx-lm's attention is routed to the
kinds that attend themselves (`cartridge.attention.route`). None of them is made from saved state or saved by
mlx-lm's `save_prompt_cache` (`base.NOT_SAVED`); where a kind cannot do what the protocol asks (trim a
recompute), it raises `CartridgeError`. `PromptCache` is the list of one conversation's caches, one per layer.
Window, recurrent and list layers use mlx-lm's own classes (`cartridge.attention.layers`).
"""

from .base import NOT_SAVED, PROTOCOL, SAVE_HINT, NotSaved
from .blend import BlendCache
from .cartridge import CartridgeCache, sink_partial
from .composed import ComposedCache, Part
from .dense import PrefixKVCache
from .pipeline import PipelineCache
from .prefill import PrefillCache
from .prompt_cache import PromptCache
from .shared_prefix import SharedPrefixCache

KINDS = {
    "cartridge": CartridgeCache,
    "dense": PrefixKVCache,
    "prefill": PrefillCache,
    "composed": ComposedCache,
    "blend": BlendCache,
    "pipeline": PipelineCache,
    "shared_prefix": SharedPrefixCache,
}

__all__ = ["BlendCache", "CartridgeCache", "ComposedCache", "KINDS", "NOT_SAVED", "NotSaved", "PROTOCOL", "Part",
           "PipelineCache", "PrefillCache", "PrefixKVCache", "PromptCache", "SAVE_HINT", "SharedPrefixCache",
           "sink_partial"]
