"""What a cartridge stores for each layer of a model, found before the prefill by a probe.

mlx-lm gives every layer a cache object (`make_prompt_cache`). A probe runs the model's own forward
pass over the document's first three tokens (two at once, then one, as a question and its answer
arrive) with those caches, and records for every layer:

- what the model wrote into the cache: (n_kv_heads, head_dim) of K and of V, or the recurrent arrays;
- whether the model's attention reached `cartridge.attention.route` with exactly the K/V its cache
  returned and a mask the cartridge attention understands, and no other layer attended over that
  K/V. Only then can the layer attend over the compressed pages ("attention"); otherwise (gemma2
  computes attention itself, latent attention multiplies the cached latent, gemma4's KV-shared layers
  attend over an earlier layer's K/V) the layer is loaded back into mlx-lm's own cache ("dense").

Kinds (spec/FORMAT.md section 5.5; one class each in `cartridge.storage.kinds`, which plans, stores and
restores them):
    attention   KVCache, attention routed: pages, attended by `CartridgeCache`.
    dense       KVCache, attention computed by the model: pages, decoded into an mlx-lm KVCache.
    window      RotatingKVCache(keep=0): the last `window` tokens, decoded into a RotatingKVCache.
    state       ArraysCache: the recurrent arrays after the document, lossless.
    list        CacheList (several caches in one layer: falcon_h1's mamba state + attention, deepseek_v32's
                latent + indexer keys): each of its caches planned, stored and restored as one of the
                kinds above, restored as a CacheList in the same order.

Any other cache kind is refused with one line naming the model family and the kind.
"""

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

from ..attention import route
from ..storage.kinds import KINDS, layer_plan
from ..errors import InputError

SUPPORTED = "KVCache, RotatingKVCache (keep=0), ArraysCache and CacheLists of them"


def family(model):
    """The model's mlx-lm family name (its `model_type`), or its class's module name."""
    args = getattr(model, "args", None) or getattr(model, "config", None)
    name = getattr(args, "model_type", None) or getattr(model, "model_type", None)
    return name or type(model).__module__.rsplit(".", 1)[-1]


def leaves(caches):
    """Every cache of a layer list, the caches inside each CacheList in their order."""
    return [c for layer in caches for c in (layer.caches if isinstance(layer, CacheList) else (layer,))]


def _refuse_kinds(model, caches):
    for c in caches:
        for leaf in c.caches if type(c) is CacheList else (c,):
            kind = type(leaf).__name__ + (" caches inside CacheLists" if leaf is not c else " caches")
            if type(leaf) not in (KVCache, RotatingKVCache, ArraysCache):
                raise InputError(f"model family {family(model)} uses {kind}; a cartridge stores {SUPPORTED}")
            if type(leaf) is RotatingKVCache and leaf.keep:
                raise InputError(f"model family {family(model)} uses RotatingKVCache with keep={leaf.keep}; "
                                 f"a cartridge stores {SUPPORTED}")


class _Recorder:
    """Wraps each cache's update_and_fetch to remember what it returned (the identity the route checks)."""

    def __init__(self, caches):
        self.returned = {}
        self.windowed = False  # a full-attention cache was asked for a sliding-window mask
        for c in leaves(caches):
            if isinstance(c, (KVCache, RotatingKVCache)):
                c.update_and_fetch = self._wrap(c, c.update_and_fetch)
            if type(c) is KVCache:
                c.make_mask = self._wrap_mask(c.make_mask)
                c.keys_and_values = self._wrap_read(c, c.keys_and_values)
        self.read = set()  # ids of caches whose arrays the model read itself
        self.inside = False

    def _wrap_read(self, cache, fn):
        def keys_and_values():
            if not self.inside:
                self.read.add(id(cache))
            return fn()
        return keys_and_values

    def _wrap_mask(self, fn):
        def make_mask(*args, window_size=None, **kwargs):
            self.windowed = self.windowed or window_size is not None
            return fn(*args, window_size=window_size, **kwargs)
        return make_mask

    def _wrap(self, cache, fn):
        def update_and_fetch(keys, values):
            self.inside = True  # KVCache.update_and_fetch reads keys_and_values itself
            try:
                out = fn(keys, values)
            finally:
                self.inside = False
            self.returned[id(cache)] = out
            return out
        return update_and_fetch


def _forward(model, caches, tokens):
    recorder = _Recorder(caches)
    routed = {}

    def seen(queries, keys, values, cache, mask):
        ret = recorder.returned.get(id(cache))
        plain = mask is None or isinstance(mask, str) or mask.dtype == mx.bool_
        same = ret is not None and keys is ret[0] and values is ret[1]
        ok = plain and same and queries.shape[-1] == keys.shape[-1] and queries.shape[1] % keys.shape[1] == 0
        routed[id(cache)] = routed.get(id(cache), True) and ok
        for other, (k, v) in recorder.returned.items():  # another layer's K/V (gemma4's KV-shared layers)
            if other != id(cache) and (keys is k or values is v):
                routed[other] = False

    route.install()
    with route.watching(seen):
        for chunk in (tokens[:2], tokens[2:3]):
            if chunk:
                mx.eval(model(mx.array([chunk], dtype=mx.uint32), cache=caches))
    if recorder.windowed:
        return {}
    return {k: v and k not in recorder.read for k, v in routed.items()}


def plan_layers(model, tokens):
    """Probe the model on the first tokens of the document; one `LayerPlan` per cache layer.

    Args:
        model (nn.Module): an mlx-lm model. tokens (list[int]): the document's tokens (>= 1).

    Returns:
        list[LayerPlan]: in the order of `make_prompt_cache(model)`.

    Raises:
        InputError: a cache kind a cartridge cannot store, or a model whose forward pass fails
            (one line naming the family); nothing is prefilled.
    """
    try:
        caches = make_prompt_cache(model)
    except Exception as e:  # a family whose cache cannot even be made: one line, not a traceback
        raise InputError(f"model family {family(model)}: cannot make its cache ({type(e).__name__}: {e})") from None
    _refuse_kinds(model, caches)
    try:
        routed = _forward(model, caches, list(tokens[:3]))
    except Exception as e:
        raise InputError(f"model family {family(model)}: its forward pass failed on the probe tokens "
                         f"({type(e).__name__}: {str(e)[:160]})") from None
    for c in leaves(caches):
        if isinstance(c, (KVCache, RotatingKVCache)) and c.keys is None:
            raise InputError(f"model family {family(model)}: a {type(c).__name__} layer got no keys in the probe")
    plans = [layer_plan(c, routed) for c in caches]
    if _restored_runs(model, plans, caches, tokens) is None:
        return plans
    plans = [KINDS[p.kind].unrouted(p) for p in plans]
    error = _restored_runs(model, plans, caches, tokens)
    if error is not None:
        raise InputError(f"model family {family(model)}: it cannot generate over restored caches ({error})")
    return plans


def _restored_runs(model, plans, caches, tokens):
    """None if the model takes a 2-token and a 1-token step over the restored caches with logits that
    are numbers (-inf is one: phi3small masks the ids it never emits with it; NaN and +inf are not);
    otherwise what went wrong, in a few words."""
    try:
        restored = [KINDS[p.kind].restore(p, c) for p, c in zip(plans, caches)]
        for chunk in (tokens[:2], tokens[:1]):
            logits = model(mx.array([chunk], dtype=mx.uint32), cache=restored)
            if mx.any(mx.isnan(logits) | (logits == float("inf"))).item():
                return "logits NaN or +inf"
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None
