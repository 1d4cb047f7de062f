"""The layer kinds, cache side: how each kind is planned from a filled mlx-lm cache, stored, and loaded
back (spec/FORMAT.md section 5.5). One class per kind, found through `KINDS`.

Each class extends the kind's header class (`cartridge.format.kinds`: parse, extents, `inspect`) with
the methods of `CacheKind`; `KINDS` has the same names in the same order as `format.kinds.KINDS`.

    plan = layer_plan(cache, routed)                          # what the probe found in one layer
    records = KINDS[plan.kind].write(writer, i, plan, cache, row, page_size, n_tokens)
    layer = KINDS[info.layers[i].kind].load(source, i, info.layers[i])
"""

from dataclasses import dataclass

import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from ..format import keys as K
from ..format import kinds as header
from ..format.keys import HEAD_RECORD_BYTES
from ..format.layout import ALIGN, PAGE_RECORD
from ..tiers import get_tier
from ..attention.layers import DenseLayer, ListLayer, StateLayer, WindowLayer, fresh_cache
from ..attention.pages import make_prefix
from .store import write_kv, write_state


@dataclass
class LayerPlan:
    """What one layer's cache holds and how a cartridge stores it.

    Attributes:
        kind (str): a name in `KINDS`.
        k_shape, v_shape (tuple | None): (n_kv_heads, head_dim) of K and V as the model wrote them.
        window (int | None): a "window" layer's size (mlx-lm's `max_size`).
        state (list | None): a "state" layer's arrays: [(index, dtype name, shape)], one per
            non-empty slot of the ArraysCache; `size` is its slot count.
        size (int | None): the ArraysCache's number of slots.
        dtype (str | None): K/V dtype as the model computed them ("float16", ...).
        parts (list | None): a "list" layer's caches, one `LayerPlan` each (none of them a "list").
    """

    kind: str
    k_shape: tuple = None
    v_shape: tuple = None
    window: int = None
    state: list = None
    size: int = None
    dtype: str = None
    parts: list = None

    def stored_tokens(self, n_tokens):
        """Prefix tokens this layer stores: all of them, the last `window`, or 0 for a state or a list."""
        return KINDS[self.kind].stored_tokens(n_tokens, self.window)

    def units(self):
        """The plans of the caches this layer stores: its parts for a "list", else itself."""
        return [u for _, u in KINDS[self.kind].units(0, self)]


def _dtype_name(x):
    return str(x.dtype).replace("mlx.core.", "")


def kv_layer_plan(kind, cache, window=None):
    """A `LayerPlan` of kind `kind` with the K/V shapes and dtype the model wrote into `cache`.

    Args:
        kind (str): "attention", "dense" or "window". cache (KVCache | RotatingKVCache): after the probe.
        window (int | None): a "window" layer's size. Default: None.
    """
    # keys: (1, n_kv_heads, T, head_dim)
    shapes = (cache.keys.shape[1], cache.keys.shape[3]), (cache.values.shape[1], cache.values.shape[3])
    return LayerPlan(kind, *shapes, window=window, dtype=_dtype_name(cache.keys))


class CacheKind:
    """The methods every kind of `KINDS` implements (besides those of `format.kinds.LayerKind`).

    Attributes:
        cache_type (type | None): the mlx-lm cache class a probe finds for this kind (None: the kind
            is chosen otherwise, as "dense" is for an attention layer the cartridge cannot route).
    """

    cache_type = None

    def layer_plan(self, cache, routed):
        """The `LayerPlan` of a filled mlx-lm cache of `cache_type` (`routed`: id -> attention routed)."""
        raise NotImplementedError

    def unrouted(self, plan):
        """The plan with every "attention" cache (in a list too) made "dense"."""
        raise NotImplementedError

    def write(self, writer, path, plan, cache, row, page_size, n_tokens, kept=(0, 0)):
        """Append one layer's extents and return its header records.

        Args:
            writer (CartridgeWriter): open writer. path (int | str): layer index, or "i.j" for cache j of
                a "list" layer i. plan (LayerPlan): the probe's plan. cache: the layer's filled mlx-lm cache.
            row (dict): {"k": tier, "v": tier}. page_size (int): tokens per page. n_tokens (int): prefix tokens.
            kept (tuple): (N, M) protected first and last tokens (format 1.5). Default: (0, 0).

        Returns:
            dict: the layer's header records (kind, shapes, window or state, tiers, params, components).

        Raises:
            InputError: the cache holds shapes other than the plan's (nothing is written: the writer aborts).
        """
        raise NotImplementedError

    def load(self, source, path, meta):
        """The loaded layer of a cartridge: a LayerPrefix or a Dense/Window/State/List layer (`attention.layers`).

        Args:
            source (StoredLayers): the header and mapped pages (`cartridge.stored`). path (int | str): layer
                path. meta (LayerInfo): its header record.
        """
        raise NotImplementedError

    def restore(self, plan, cache):
        """The probe's filled cache stored (fp16 pages of 2 tokens) and restored as a fresh mlx-lm cache."""
        raise NotImplementedError

    def planned_bytes(self, plan, row, n_tokens, page_size):
        """Payload, alignment and page-table bytes a layer of `plan` takes for an `n_tokens` prefix."""
        raise NotImplementedError


class KVCacheKind(CacheKind):
    """What the kinds whose cache holds K/V share: pages through the tiers, decoded or attended at load."""

    cache_type = KVCache

    def layer_plan(self, cache, routed):
        return kv_layer_plan(self.name, cache)

    def unrouted(self, plan):
        return plan

    def stored_kv(self, cache, n_tokens):
        """K, V (n_kv_heads, T, head_dim) of the prefix as the cache holds them, T = `stored_tokens`."""
        return cache.keys[0, :, :n_tokens, :], cache.values[0, :, :n_tokens, :]

    def write(self, writer, path, plan, cache, row, page_size, n_tokens, kept=(0, 0)):
        return write_kv(writer, path, plan, self.stored_kv(cache, n_tokens), row, page_size, n_tokens,
                        kept if self.stores_every_token else (0, 0))

    def from_prefix(self, prefix, dtype, window, total):
        """The loaded layer of a LayerPrefix: itself, or decoded into mlx-lm's cache of this kind."""
        raise NotImplementedError

    def load(self, source, path, meta):
        return self.from_prefix(source.prefix(path, meta), source.dtype, meta.window, source.n_tokens)

    def restore(self, plan, cache):
        k, v = self.stored_kv(cache, cache.offset)
        fp16 = get_tier("fp16")
        return fresh_cache(self.from_prefix(make_prefix(fp16, k, fp16, v, page_size=2), k.dtype, plan.window,
                                            cache.offset))

    def planned_bytes(self, plan, row, n_tokens, page_size):
        n_pages, total = -(-plan.stored_tokens(n_tokens) // page_size), 0
        for side, (n_kv, head_dim) in (("k", plan.k_shape), ("v", plan.v_shape)):
            codec = get_tier(row[side])
            tables = n_pages * (PAGE_RECORD.size + n_kv * HEAD_RECORD_BYTES)  # page + per-head checksums
            total += (n_pages * page_size * codec.bytes_per_token(n_kv, head_dim)
                      + len(codec.components(head_dim)) * (ALIGN + tables))
        return total


class AttentionKind(KVCacheKind, header.AttentionKind):
    """A KVCache layer attended over its pages: loaded as its LayerPrefix (`CartridgeCache` per question)."""

    def layer_plan(self, cache, routed):
        return kv_layer_plan(self.name if routed.get(id(cache)) else "dense", cache)

    def unrouted(self, plan):
        return LayerPlan("dense", plan.k_shape, plan.v_shape, dtype=plan.dtype)

    def from_prefix(self, prefix, dtype, window, total):
        return prefix


class DenseKind(KVCacheKind, header.DenseKind):
    """A KVCache layer whose model attends itself: decoded into an mlx-lm KVCache (`DenseLayer`)."""

    cache_type = None  # an attention layer the probe could not route (`AttentionKind.layer_plan`)

    def from_prefix(self, prefix, dtype, window, total):
        return DenseLayer(prefix, dtype)


class WindowKind(KVCacheKind, header.WindowKind):
    """A RotatingKVCache(keep=0) layer: its last `window` tokens, loaded as a `WindowLayer`."""

    cache_type = RotatingKVCache

    def layer_plan(self, cache, routed):
        return kv_layer_plan(self.name, cache, window=cache.max_size)

    def stored_kv(self, cache, n_tokens):
        n = min(n_tokens, cache.max_size)
        k, v = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
        return k[0, :, -n:, :], v[0, :, -n:, :]

    def write(self, writer, path, plan, cache, row, page_size, n_tokens, kept=(0, 0)):
        records = super().write(writer, path, plan, cache, row, page_size, n_tokens, kept)
        count = plan.stored_tokens(n_tokens)
        records[K.layer_window(path)] = {"size": plan.window, "start": n_tokens - count, "count": count}
        return records

    def from_prefix(self, prefix, dtype, window, total):
        return WindowLayer(prefix, dtype, window, total)


class StateKind(CacheKind, header.StateKind):
    """An ArraysCache layer: its recurrent arrays, loaded as a `StateLayer`."""

    cache_type = ArraysCache

    def layer_plan(self, cache, routed):
        arrays = [(i, _dtype_name(a), list(a.shape)) for i, a in enumerate(cache.cache) if a is not None]
        return LayerPlan(self.name, state=arrays, size=len(cache.cache))

    def unrouted(self, plan):
        return plan

    def write(self, writer, path, plan, cache, row, page_size, n_tokens, kept=(0, 0)):
        return write_state(writer, path, plan, cache)

    def load(self, source, path, meta):
        return StateLayer(meta.state_size, dict(zip((a[0] for a in meta.arrays), source.arrays(path))))

    def restore(self, plan, cache):
        return StateLayer(plan.size, {i: cache[i] for i, _, _ in plan.state}).cache()

    def planned_bytes(self, plan, row, n_tokens, page_size):
        return sum(ALIGN + PAGE_RECORD.size + HEAD_RECORD_BYTES + int(np.prod(shape)) * 4 for _, _, shape in plan.state)


class ListKind(CacheKind, header.ListKind):
    """A CacheList layer: each cache planned, stored and loaded as its own kind, in order."""

    cache_type = CacheList

    def layer_plan(self, cache, routed):
        return LayerPlan(self.name, parts=[layer_plan(c, routed) for c in cache.caches])

    def unrouted(self, plan):
        return LayerPlan(self.name, parts=[KINDS[p.kind].unrouted(p) for p in plan.parts])

    def write(self, writer, path, plan, cache, row, page_size, n_tokens, kept=(0, 0)):
        records = {K.layer_kind(path): self.name, K.layer_caches(path): len(plan.parts)}
        for j, (part, c) in enumerate(zip(plan.parts, cache.caches)):
            records.update(KINDS[part.kind].write(writer, K.part(path, j), part, c, row, page_size, n_tokens))
        return records

    def load(self, source, path, meta):
        return ListLayer([source.layer(p, u) for p, u in self.units(path, meta)])

    def restore(self, plan, cache):
        return CacheList(*(KINDS[p.kind].restore(p, c) for p, c in zip(plan.parts, cache.caches)))

    def planned_bytes(self, plan, row, n_tokens, page_size):
        return sum(KINDS[p.kind].planned_bytes(p, row, n_tokens, page_size) for p in plan.parts)


KINDS = {k.name: k for k in (AttentionKind(), DenseKind(), WindowKind(), StateKind(), ListKind())}


def layer_plan(cache, routed):
    """The `LayerPlan` of one filled mlx-lm cache, by the kind whose `cache_type` it is.

    Args:
        cache: a KVCache, RotatingKVCache, ArraysCache or CacheList (`families` refuses any other).
        routed (dict): id(cache) -> True if its attention reached the cartridge route unchanged.
    """
    kind = next(k for k in KINDS.values() if k.cache_type is not None and isinstance(cache, k.cache_type))
    return kind.layer_plan(cache, routed)
