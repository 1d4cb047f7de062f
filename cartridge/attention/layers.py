"""Layers that are not attended over compressed pages: each loads back into mlx-lm's own cache kind.

- "dense" (a KVCache layer whose model computes attention itself: gemma2, latent attention): the
  decoded prefix in an mlx-lm `KVCache`.
- "window" (sliding-window attention): the last `window` prefix tokens, decoded, in an mlx-lm
  `RotatingKVCache` in the state mlx-lm's own prefill leaves, so the window moves during generation
  exactly as mlx-lm's does.
- "state" (recurrent layers): the stored arrays in an mlx-lm `ArraysCache`.
- "list" (several caches in one layer, mlx-lm `CacheList`): each cache restored as its own kind (a
  page-attended one as a `CartridgeCache`), in an mlx-lm `CacheList` in the same order, so model code
  that reads `cache[0]`, `cache[1]` of a layer finds what mlx-lm's own `make_cache` gives it.

Each class decodes once at load and hands every `prompt_cache()` a cache of its own: generation
mutates a cache (a rotating cache writes in place; a recurrent step replaces its arrays), never the
shared arrays. The page-attended kind ("attention") is `cartridge.attention.caches.CartridgeCache`.
"""

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

from .caches import CartridgeCache, PrefixKVCache
from .pages import decode_prefix
from .prefix import LayerPrefix


class DenseLayer:
    """A full-attention layer whose model attends itself: the decoded prefix in an mlx-lm KVCache.

    Args:
        prefix (LayerPrefix): the stored pages. dtype (mx.Dtype): the dtype the model computed K/V in.
    """

    kind = "dense"
    trims = True  # its KVCache's tail trims back in place

    def __init__(self, prefix, dtype):
        self.prefix = prefix
        self.keys, self.values = decode_prefix(prefix, dtype)
        mx.eval(self.keys, self.values)  # at load, before the next layer is decoded

    def cache(self):
        """A fresh PrefixKVCache holding the prefix (its first update copies into new storage)."""
        return PrefixKVCache(self.keys, self.values)

    @property
    def nbytes(self):
        """Bytes of the decoded K/V this layer keeps."""
        return self.keys.nbytes + self.values.nbytes


class WindowLayer(DenseLayer):
    """A sliding-window layer: the last `window` tokens of a `total`-token prefix in a RotatingKVCache.

    Args:
        prefix (LayerPrefix): pages of the last min(total, window) tokens.
        dtype (mx.Dtype): K/V dtype. window (int): mlx-lm's max_size. total (int): prefix tokens.
    """

    kind = "window"
    trims = False  # a rotating cache overwrites the window: a fresh copy instead

    def __init__(self, prefix, dtype, window, total):
        super().__init__(prefix, dtype)
        self.window, self.total = window, total

    def cache(self):
        """A RotatingKVCache as mlx-lm's prefill leaves it: temporal order, offset = prefix tokens."""
        c = RotatingKVCache(max_size=self.window, keep=0)
        # copies: a one-token step writes into the cache's arrays in place
        c.keys, c.values = mx.array(self.keys), mx.array(self.values)
        c.offset, c._idx = self.total, self.keys.shape[2]
        return c


class StateLayer:
    """A recurrent layer: its stored arrays in an ArraysCache.

    Args:
        size (int): the ArraysCache's slots. arrays (dict[int, mx.array]): slot -> array, as produced.
    """

    kind = "state"
    trims = False

    def __init__(self, size, arrays):
        self.size, self.arrays = size, arrays

    def cache(self):
        """A fresh ArraysCache holding the stored arrays (a step replaces them, never writes into them)."""
        c = ArraysCache(self.size)
        for i, a in self.arrays.items():
            c[i] = a
        return c

    @property
    def nbytes(self):
        """Bytes of the stored arrays."""
        return sum(a.nbytes for a in self.arrays.values())


class ListLayer:
    """A layer of several caches (mlx-lm CacheList), each stored and restored as its own kind.

    Args:
        parts (list): per cache, in the CacheList's order: a LayerPrefix (page-attended) or a
            Dense/Window/State layer.
    """

    kind = "list"
    trims = False  # its caches are renewed as a whole (`trimmable` asks each of them)

    def __init__(self, parts):
        self.parts = parts

    def cache(self):
        """A fresh CacheList: each part's own fresh cache (a CartridgeCache over a shared prefix)."""
        return CacheList(*(fresh_cache(p) for p in self.parts))

    @property
    def nbytes(self):
        """Bytes its parts keep."""
        return sum(p.nbytes for p in self.parts)


def fresh_cache(layer):
    """A new cache of one loaded layer for one generation: a CartridgeCache over a page-attended
    prefix, else the layer's own fresh copy."""
    return CartridgeCache(layer) if is_paged(layer) else layer.cache()


def trims(layer):
    """True if a loaded layer is one cache whose tail trims back in place (page-attended or dense)."""
    return is_paged(layer) or layer.trims


def trimmable(layer):
    """True if a loaded layer's tail can be trimmed back: it `trims`, or it is a list of caches that all do."""
    if isinstance(layer, ListLayer):
        return all(trimmable(p) for p in layer.parts)
    return trims(layer)


def cache_offset(caches):
    """Tokens a prompt cache holds: the offset of its first cache that has one (a CacheList's caches
    included); None if none has (recurrent states only)."""
    for c in caches or ():
        for leaf in getattr(c, "caches", (c,)):
            if hasattr(leaf, "offset"):
                return leaf.offset
    return None


def is_paged(layer):
    """True for a layer attended over its pages (a `LayerPrefix`)."""
    return isinstance(layer, LayerPrefix)
