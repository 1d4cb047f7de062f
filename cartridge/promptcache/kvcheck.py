"""Check that a prompt cache's K/V are what the model computes for its tokens, by recomputing a few of them.

An mlx-lm prompt-cache file records no fingerprint of its model (mlx_lm.cache_prompt stores the path it was given)
and no token ids, so `cartridge import` checks the K/V themselves, at both ends of the document:

- head: the template's opening and the first `CHECK_TOKENS` tokens after it prefilled afresh; every layer that
  holds those positions compared;
- tail: the last `CHECK_TOKENS` tokens fed again over the file's own K/V of the tokens before them (when every
  layer is a KVCache: a sliding window or a recurrent state cannot step back); their K/V compared.

The head catches another model and another start of the text; the tail another end of the text (a document of
the same token count that differs only in the middle is not caught). Each comparison is the relative L2 error
||recomputed - stored|| / ||stored|| of one layer's K or V over those positions, in float32; a layer stored
as mlx-lm's QuantizedKVCache is allowed more (`_error`).
"""

import warnings

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache

from ..write.prefill import prefill
from ..errors import ModelMismatchError
from .promptfile import leaf_caches

CHECK_TOKENS = 16
# relative L2 error allowed per layer and side. Measured with the default model (SmolLM2-135M, float32 on the CPU) on
# the first 3,000 characters of samples/lgpl-3.0.txt (682 tokens), worst layer, head / tail check: over a file of its
# own 0 / 1.3e-6; over a file of its GGUF's 8-bit weights run natively 1.2e-3 / 5.6e-4; over a file of the model cast
# to float16 (float16 K/V) 4.7e-3 / 2.1e-3; another text from token 24 on (the first after the template): 0.84 at the
# head; the last 3 tokens reordered: 0 / 0.81; a tiny random model's file checked by another seed of its shape 1.51 / 1.45.
TOLERANCE = 0.05


class UncheckedWarning(UserWarning):
    """No layer of the prompt cache holds K/V this check can recompute (windows past their size, recurrent states)."""


class _Rollback(KVCache):
    """mlx-lm's KVCache over the K/V of the first tokens of another cache, never written: new tokens are kept
    apart and each step attends over stored + new (one concatenation, freed once the layer has attended)."""

    def __init__(self, keys, values):
        super().__init__()
        self.base, self.new, self.offset = (keys, values), ([], []), keys.shape[2]

    def update_and_fetch(self, keys, values):
        self.new[0].append(keys)
        self.new[1].append(values)
        self.offset += keys.shape[2]
        return tuple(mx.concatenate([b, *n], axis=2) for b, n in zip(self.base, self.new))

    @property
    def state(self):
        """The new tokens' K/V, for `mx.eval`."""
        return self.new


def held(cache):
    """(first position, K, V) of the tokens a K/V cache holds in order, K and V (1, n_kv_heads, L, head_dim);
    None for a cache without K/V (a recurrent state)."""
    if isinstance(cache, _Rollback):
        return (0, *(mx.concatenate([b, *n], axis=2) for b, n in zip(cache.base, cache.new)))
    if type(cache) is KVCache:
        return 0, cache.keys[..., :cache.offset, :], cache.values[..., :cache.offset, :]
    if isinstance(cache, RotatingKVCache):
        k, v = (cache._temporal_order(x) for x in (cache.keys, cache.values))  # mlx-lm's own reordering
        return cache.offset - k.shape[2], k, v
    return None


def _error(recomputed, stored, quant):
    """(||recomputed - stored|| / ||stored||, the error allowed), in float32. For a stored QuantizedKVCache
    (`quant` = (group, bits)) the allowance grows by twice the quantization's own relative error on these values:
    tokens mlx-lm prefilled after quantizing attended over quantized K/V, so their K/V moved by about as much."""
    a, b = recomputed.astype(mx.float32), stored.astype(mx.float32)
    allowed = TOLERANCE
    if quant is not None:
        q = mx.dequantize(*mx.quantize(a, group_size=quant[0], bits=quant[1]), group_size=quant[0], bits=quant[1])
        allowed += 2 * _relative(q, a)
    return _relative(a, b), allowed


def _relative(a, b):
    return (mx.linalg.norm(a - b) / mx.maximum(mx.linalg.norm(b), 1e-6)).item()


def compare(recomputed, stored, start, end, quant):
    """The worst relative error, against its allowance, over positions start .. end-1 held by both cache lists.

    Args:
        recomputed, stored (list): mlx-lm caches of the same kinds, layer by layer. start, end (int): positions.
        quant (dict): layer path -> (group_size, bits) of a stored layer that was a QuantizedKVCache, or None.

    Returns:
        tuple | None: (error float, allowed float, layer path str, "K" or "V") of the largest error / allowed,
        None where no layer holds those positions in both.
    """
    worst = None
    for (where, a), (_, b) in zip(leaf_caches(recomputed), leaf_caches(stored)):
        ha, hb = held(a), held(b)
        if ha is None or hb is None:
            continue
        lo, hi = max(start, ha[0], hb[0]), min(end, ha[0] + ha[1].shape[2], hb[0] + hb[1].shape[2])
        if lo >= hi:
            continue
        for side, x, y in (("K", ha[1], hb[1]), ("V", ha[2], hb[2])):
            e, allowed = _error(x[..., lo - ha[0]:hi - ha[0], :], y[..., lo - hb[0]:hi - hb[0], :], quant.get(where))
            if worst is None or e / allowed > worst[0] / worst[1]:
                worst = (e, allowed, where, side)
    return worst


def _rolled_back(cache, start):
    """A `_Rollback` over the first `start` tokens of a KVCache (a CacheList of them); None for any other kind."""
    if isinstance(cache, CacheList):
        parts = [_rolled_back(c, start) for c in cache.caches]
        return None if any(p is None for p in parts) else CacheList(*parts)
    if type(cache) is KVCache:
        return _Rollback(cache.keys[..., :start, :], cache.values[..., :start, :])
    return None


def check_kv(lm, tokens, caches, quant, name, opening=0):
    """Refuse a prompt cache whose K/V are not what `lm` computes for `tokens` (module docstring).

    Args:
        lm (LoadedModel): the model. tokens (list[int]): the tokens the caches hold.
        caches (list): mlx-lm caches of the model's kinds (`importer.model_caches`). quant (dict): as `compare`.
        name (str | Path): the file, named in the error.
        opening (int): tokens of the chat template before the document (a system message), recomputed too, so
            that the head check reaches the document. Default: 0.

    Returns:
        int: tokens whose K/V were recomputed and compared (0 with an `UncheckedWarning`).

    Raises:
        ModelMismatchError: a layer's K or V differs by more than `TOLERANCE`.
    """
    n = min(CHECK_TOKENS, len(tokens))
    head = min(opening + CHECK_TOKENS, len(tokens))
    results = [(compare(prefill(lm.model, tokens[:head]), caches, 0, head, quant), 0, head)]
    start = len(tokens) - n
    back = [_rolled_back(c, start) for c in caches]
    if start > 0 and all(b is not None for b in back):
        prefill(lm.model, tokens[start:], caches=back)
        results.append((compare(back, caches, start, len(tokens), quant), start, len(tokens)))
    checked = 0
    for worst, a, b in results:
        if worst is None:
            continue
        checked += b - a
        error, allowed, where, side = worst
        if error > allowed:
            raise ModelMismatchError(
                f"{name}: its K/V are not what model {lm.ref} computes for these tokens (layer {where} {side} differs "
                f"by {error:.1%}, allowed {allowed:.1%}, at tokens {a}..{b - 1}): a prompt cache of another model, "
                f"of another text, or exported from a compressed cartridge (import an fp16 one)")
    if not checked:
        warnings.warn(UncheckedWarning(f"{name}: no layer holds K/V that can be recomputed here (sliding windows "
                                       f"past their size, recurrent states): its K/V were not checked"), stacklevel=3)
    return checked
