"""The kinds of layer a cartridge stores (spec/FORMAT.md section 5.5), one class each, found through `KINDS`.

    attention   mlx-lm KVCache whose attention is routed to the cartridge: pages of every prefix token
    dense       KVCache whose model attends itself (gemma2, latent attention): pages of every prefix token
    window      RotatingKVCache(keep=0): pages of the last `window` prefix tokens
    state       ArraysCache: the recurrent arrays as produced, one single-page extent each, no tier
    list        CacheList: nothing itself; cache j stored as a layer of its own kind under the path "i.j"

Every class has the same methods, and nothing outside them asks which kind a layer is. This module holds
the header side of a kind: parsing and checking its records, the extents it stores, how `inspect`
describes it. `cartridge.storage.kinds` extends each class with the cache side (plan, store, load).
"""

from dataclasses import dataclass

import numpy as np

from ..errors import FieldError
from ..tiers import TIERS
from . import keys as K
from .fields import LIMITS, json_field, typed

SIDES = ("k", "v")
MAX_STATE_ARRAYS = 64
STATE_DTYPES = ("float32", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


@dataclass(frozen=True)
class LayerInfo:
    """What one layer stores (spec/FORMAT.md section 5.5; a file before 1.4: every layer "attention").

    Attributes:
        kind (str): a name in `KINDS`.
        k_shape, v_shape (tuple | None): (n_kv_heads, head_dim) of each side; None for "state".
        start, count (int): the stored prefix positions start .. start + count - 1 (0 for "state").
        window (int | None): a "window" layer's size.
        state_size (int | None): a "state" layer's slots. arrays (tuple): ((index, dtype, shape), ...).
        parts (tuple): a "list" layer's caches, one LayerInfo each (none of them a "list").
    """

    kind: str
    k_shape: tuple = None
    v_shape: tuple = None
    start: int = 0
    count: int = 0
    window: int = None
    state_size: int = None
    arrays: tuple = ()
    parts: tuple = ()

    @property
    def kind_type(self):
        """The `LayerKind` of this layer."""
        return KINDS[self.kind]

    @property
    def stores_every_token(self):
        """True for the kinds whose pages hold every prefix token (and so protected copies, format 1.5)."""
        return KINDS[self.kind].stores_every_token

    def n_pages(self, page_size):
        """Pages per K/V component of this layer."""
        return -(-self.count // page_size)

    def shape(self, side):
        """(n_kv_heads, head_dim) of side "k" or "v"."""
        return self.k_shape if side == "k" else self.v_shape


class LayerKind:
    """One layer kind, header side. Subclasses set the attributes and override what differs.

    Attributes:
        name (str): the `layer.{i}.kind` value.
        tiered (bool): its K and V go through tiers into pages (tier, params and components records).
        stores_every_token (bool): its pages hold every prefix token (bytes/token; protected copies).
        fixed (bool): its payload does not grow with the document (`CartridgeInfo.fixed_bytes`).
        tier_label (str | None): what `inspect` prints in the tier columns of an untiered layer.
    """

    name = None
    tiered = True
    stores_every_token = True
    fixed = False
    tier_label = None

    def parse(self, records, path, n_tokens):
        """The LayerInfo of the cache at layer path `path` (an index, or "i.j"), its records checked.

        Args:
            records (dict[str, bytes]): the index. path (int | str): layer path. n_tokens (int): prefix tokens.

        Raises:
            FieldError: a record absent, malformed or inconsistent with `n_tokens`.
        """
        return LayerInfo(self.name, *kv_shapes(records, path), 0, n_tokens)

    def units(self, path, layer):
        """[(path, unit)] of the caches a layer stores: itself. `layer` is a LayerInfo or a LayerPlan."""
        return [(path, layer)]

    def stored_tokens(self, n_tokens, window=None):
        """Prefix tokens a layer of this kind stores after an `n_tokens` prefix."""
        return n_tokens

    def components(self, records, path, info, tiers, page_size):
        """[(side, [(component, dtype, extent shape)], n_pages)] of one cache, in the order they are stored.

        Args:
            records (dict): the index. path (int | str): layer path. info (LayerInfo): its record.
            tiers (dict): {"k": tier, "v": tier}. page_size (int): tokens per page.

        Raises:
            FieldError: the components record does not match the tier's components.
        """
        out = []
        for side in SIDES:
            codec = TIERS[tiers[side]]
            n_kv, head_dim = info.shape(side)
            expected = [{"name": c.name, "dtype": c.dtype, "width": c.width} for c in codec.components(head_dim)]
            found = json_field(records, K.layer_components(path, side))
            if found != expected:
                raise FieldError(
                    f"layer {path} {side}: components {str(found)[:200]} do not match tier {codec.name}: {expected}"
                )
            n_pages = info.n_pages(page_size)
            comps = [(c.name, c.dtype, (n_pages, n_kv, page_size, c.width)) for c in codec.components(head_dim)]
            out.append((side, comps, n_pages))
        return out

    def describe(self, path, info, nbytes):
        """The `inspect --json` row of one cache: kind, tokens held, payload bytes, then its own fields.

        Args:
            path (int | str): layer path. info (LayerInfo): its record. nbytes (callable): path -> payload bytes.
        """
        return {"kind": self.name, "tokens": info.count, "bytes": nbytes(path),
                "k_shape": list(info.k_shape), "v_shape": list(info.v_shape)}

    def holds(self, run):
        """What a run of `describe` rows (with "bytes_each") holds, in words, for the `inspect` table."""
        k, v = run["k_shape"], run["v_shape"]
        return f"{self.held_tokens(run)}; K {k[0]}x{k[1]}, V {v[0]}x{v[1]} ({run['bytes_each']:,} bytes a layer)"

    def held_tokens(self, run):
        """The tokens part of `holds`."""
        return f"{run['tokens']:,} tokens"


class AttentionKind(LayerKind):
    """Full attention over the compressed pages (`CartridgeCache`)."""

    name = "attention"


class DenseKind(LayerKind):
    """Full attention the model computes itself, over the prefix decoded into an mlx-lm KVCache."""

    name = "dense"


class WindowKind(LayerKind):
    """Sliding-window attention: the last `window` prefix tokens (spec 5.5, `layer.{i}.window`)."""

    name = "window"
    stores_every_token = False
    fixed = True

    def parse(self, records, path, n_tokens):
        shapes, key = kv_shapes(records, path), K.layer_window(path)
        w = typed(records, key, dict)
        size = w.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= LIMITS[K.TOKENS_COUNT][1]:
            raise FieldError(f"{key}.size is {str(size)[:40]}; expected an integer >= 1")
        want = {"size": size, "start": n_tokens - min(n_tokens, size), "count": min(n_tokens, size)}
        if w != want:
            raise FieldError(f"{key} is {str(w)[:120]}; {n_tokens} tokens need {want}")
        return LayerInfo(self.name, *shapes, want["start"], want["count"], window=size)

    def stored_tokens(self, n_tokens, window=None):
        return min(n_tokens, window)

    def describe(self, path, info, nbytes):
        return {**super().describe(path, info, nbytes), "window": info.window, "start": info.start}

    def held_tokens(self, run):
        return (f"{run['tokens']:,} tokens (window {run['window']:,}: positions {run['start']:,}.."
                f"{run['start'] + run['tokens'] - 1:,})")


class StateKind(LayerKind):
    """Recurrent state: the ArraysCache's arrays, stored as produced (spec 5.5, `layer.{i}.state`)."""

    name = "state"
    tiered = False
    stores_every_token = False
    fixed = True
    tier_label = "state"

    def parse(self, records, path, n_tokens):
        key = K.layer_state(path)
        st = typed(records, key, dict)
        size, arrays = st.get("size"), st.get("arrays")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_STATE_ARRAYS \
                or not isinstance(arrays, list) or len(arrays) > size:
            raise FieldError(f"{key} is {str(st)[:120]}; expected size 1..{MAX_STATE_ARRAYS} "
                             f"and at most size arrays")
        out, last = [], -1
        for a in arrays:
            if not _state_array_ok(a, last, size):
                raise FieldError(f"{key}: array {str(a)[:120]} is not "
                                 f"{{index (increasing, < size), dtype ({', '.join(STATE_DTYPES)}), shape}}")
            last = a["index"]
            out.append((a["index"], a["dtype"], tuple(a["shape"])))
        return LayerInfo(self.name, state_size=size, arrays=tuple(out))

    def stored_tokens(self, n_tokens, window=None):
        return 0

    def components(self, records, path, info, tiers, page_size):
        return [(K.STATE_SIDE, [(K.state_component(i), d, (1, *shape))], 1) for i, d, shape in info.arrays]

    def describe(self, path, info, nbytes):
        return {"kind": self.name, "tokens": info.count, "bytes": nbytes(path),
                "arrays": [{"index": a, "dtype": d, "shape": list(s)} for a, d, s in info.arrays]}

    def holds(self, run):
        arrays = ", ".join(f"{a['dtype']}{a['shape']}" for a in run["arrays"])
        return f"recurrent state {arrays} ({run['bytes_each']:,} bytes a layer)"


def _state_array_ok(a, last, size):
    """An entry of `layer.{i}.state.arrays`: {index > last and < size, dtype, shape of 1..8 positive ints}."""
    return isinstance(a, dict) and set(a) == {"index", "dtype", "shape"} and isinstance(a["index"], int) \
        and not isinstance(a["index"], bool) and last < a["index"] < size and a["dtype"] in STATE_DTYPES \
        and isinstance(a["shape"], list) and 1 <= len(a["shape"]) <= 8 \
        and all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1 << 31 for n in a["shape"]) \
        and int(np.prod(a["shape"], dtype=np.float64)) <= 1 << 34


class ListKind(LayerKind):
    """Several caches in one layer (mlx-lm CacheList, format 1.5): cache j is a layer of its own kind
    (never a list) under the layer path "i.j" (spec 5.5, `layer.{i}.caches`)."""

    name = "list"
    tiered = False
    stores_every_token = False
    tier_label = "mixed"

    def parse(self, records, path, n_tokens):
        count = typed(records, K.layer_caches(path), int)
        if not 1 <= count <= K.MAX_LIST_CACHES:
            raise FieldError(f"{K.layer_caches(path)} is {count}; allowed 1..{K.MAX_LIST_CACHES}")
        return LayerInfo(self.name, parts=tuple(parse_kind(records, K.part(path, j), n_tokens, LIST_CACHE_KINDS)
                                                for j in range(count)))

    def units(self, path, layer):
        return [(K.part(path, j), u) for j, u in enumerate(layer.parts)]

    def stored_tokens(self, n_tokens, window=None):
        return 0

    def components(self, records, path, info, tiers, page_size):
        return []  # its caches are units of their own

    def describe(self, path, info, nbytes):
        caches = [KINDS[u.kind].describe(p, u, nbytes) for p, u in self.units(path, info)]
        return {"kind": self.name, "tokens": max(c["tokens"] for c in caches),
                "bytes": sum(c["bytes"] for c in caches), "caches": caches}

    def holds(self, run):
        caches = " + ".join(f"{c['kind']} {KINDS[c['kind']].holds({**c, 'bytes_each': c['bytes']})}"
                            for c in run["caches"])
        return f"caches: {caches}"


KINDS = {k.name: k for k in (AttentionKind(), DenseKind(), WindowKind(), StateKind(), ListKind())}
LIST_CACHE_KINDS = tuple(name for name in KINDS if name != "list")  # a list's caches


def kv_shapes(records, path):
    """((n_kv_heads, head_dim) of K, of V) from `layer.{path}.{k,v}.shape`.

    Raises:
        FieldError: a shape that is not two integers within the global limits.
    """
    return tuple(_shape(records, path, side) for side in SIDES)


def _shape(records, path, side):
    value = typed(records, K.layer_shape(path, side), list)
    if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value) \
            or not (1 <= value[0] <= LIMITS[K.N_KV_HEADS][1] and 1 <= value[1] <= LIMITS[K.HEAD_DIM][1]):
        raise FieldError(f"{K.layer_shape(path, side)} is {str(value)[:60]}; expected [n_kv_heads 1..1024, "
                         f"head_dim 1..4096]")
    return tuple(value)


def parse_kind(records, path, n_tokens, allowed=tuple(KINDS)):
    """The LayerInfo of the cache with a `layer.{path}.kind` record, parsed by its kind's class.

    Args:
        records (dict[str, bytes]): the index. path (int | str): layer path. n_tokens (int): prefix tokens.
        allowed (tuple): the kind names allowed here. Default: every name in `KINDS`.

    Raises:
        FieldError: a kind outside `allowed` ("layer.3.kind is 'conv'; allowed attention, ..."), or a bad record.
    """
    kind = typed(records, K.layer_kind(path), str)
    if kind not in allowed:
        raise FieldError(f"{K.layer_kind(path)} is {kind[:40]!r}; allowed {', '.join(allowed)}")
    return KINDS[kind].parse(records, path, n_tokens)


def layer_units(layers):
    """[(path, unit)] of every stored cache: (i, layer) for a layer, ("i.j", cache) for cache j of a
    "list" layer i; in the order their extents are stored. `layers`: LayerInfos or LayerPlans."""
    return [unit for i, m in enumerate(layers) for unit in KINDS[m.kind].units(i, m)]
