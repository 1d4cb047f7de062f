"""CacheBlend's selective recompute of a later document in a composed context (Yao et al., "CacheBlend: Fast
Large Language Model Serving for RAG with Cached Knowledge Fusion", arXiv:2405.16444, section 4).

A later document's stored K/V were computed after its own chat-template header, not after what precedes it
in the composed context. Layer 0's K/V depend only on the token and its position, so they are exact once the
keys are rotated to their composed positions; from layer 1 on they deviate, and unevenly over the tokens.

1. select: the document's tokens read from pages are prefilled again over what precedes them up to layer
   `select_layer` only (the forward pass stops there; the paper checks layer 1, the default here is 4); the
   tokens whose K/V there deviate most from the stored ones (rotated to their composed positions) are selected,
   optionally weighted by the attention mass a probe question puts on them (`probe_mass`).
2. recompute (`attention.caches.BlendCache`): the selected tokens alone run through every layer, each attending
   causally by composed position over the composed context, where the document's other tokens keep their
   stored K/V and the selected ones have their fresh K/V (the paper's fusion). Their fresh K/V become
   patches at their true positions; their stored copies are masked out of the part (`Part.skip`).

Positions: the model rotates a forward pass's tokens at `cache.offset` + 0, 1, ...; `BlendCache` reports
the count of selected tokens done so far as its offset, and rotates the queries and keys on by each
token's (composed position - that position): RoPE is a rotation, R(a) R(b) = R(a + b).
"""

import math

import mlx.core as mx
import numpy as np

from ..errors import InputError

DEFAULT_SELECT_LAYER = 4  # the paper's is 1; on the default model 4 selects far better (docs/evaluation.md)
CHUNK = 256  # tokens per forward pass of the selection and of the recompute
SELECTIONS = ("attention", "deviation")  # the score: probe attention mass x deviation, or deviation alone
DEFAULT_SELECTION = "attention"  # lower KL, higher BLEU at R = 0.2 on two pairs (docs/evaluation.md)
PROBE = "What does the document say about this?"  # a generic question: its rows stand in for later questions


class _Stopped(Exception):
    """Raised by `_Capture` to end a forward pass at the selection layer."""


class _Capture:
    """The selection layer's stand-in: keeps the K/V the model hands it and stops the forward pass.

    Its offset moves on by the tokens captured, as the layer's cache would have: the model rotates each chunk's
    keys at this offset (left at the cache's, every chunk after the first was rotated as if it were the first).
    """

    def __init__(self, cache):
        self.cache, self.kv, self.done = cache, None, 0

    @property
    def offset(self):
        return self.cache.offset + self.done

    def update_and_fetch(self, keys, values):
        self.kv = keys[0], values[0]  # (n_kv_heads, L, head_dim) at their composed positions
        self.done += keys.shape[2]
        raise _Stopped


def ropes(model):
    """Each layer's rotary embedding module (mlx-lm's `self_attn.rope`).

    Raises:
        InputError: the model's attention has no `rope` module.
    """
    try:
        return [layer.self_attn.rope for layer in model.layers]
    except AttributeError:
        raise InputError("this model's attention has no `rope` module; cartridges cannot be composed for it") from None


def check_ratio(ratio, name="recompute_ratio"):
    """Refuse a recompute ratio that is not a fraction in [0, 1].

    Raises:
        InputError: a bool, a non-number, NaN, or a value outside [0, 1].
    """
    ok = isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and math.isfinite(ratio)
    if not ok or not 0 <= ratio <= 1:
        raise InputError(f"{name} is {ratio!r}; it must be a fraction of the tokens between 0 and 1")


def recompute_count(ratio, n_fresh, n_read):
    """Stored tokens to select: `ratio` of the document's composed tokens, the boundary's `n_fresh` counted in.

    Args:
        ratio (float): in [0, 1]. n_fresh (int): separator + boundary tokens prefilled anyway.
        n_read (int): the document's tokens read from its pages.

    Returns:
        int: in [0, n_read]; n_read at ratio 1.
    """
    return min(n_read, max(0, round(ratio * (n_fresh + n_read)) - n_fresh))


def fresh_layer_kv(model, caches, ids, layer):
    """K/V of `ids` at `layer` when prefilled after what `caches` hold, running layers 0..layer-1 only.

    Args:
        model: the mlx-lm model. caches (list): one cache per layer; layers below `layer` get `ids` appended.
        ids (list[int]): tokens, at positions caches[0].offset on. layer (int): the layer whose K/V are kept.

    Returns:
        tuple: (k, v), each (n_kv_heads, len(ids), head_dim) float32.
    """
    capture, ks, vs = _Capture(caches[layer]), [], []
    stopped = caches[:layer] + [capture] + caches[layer + 1:]
    for at in range(0, len(ids), CHUNK):
        try:
            model(mx.array(ids[at:at + CHUNK])[None], cache=stopped)
        except _Stopped:
            pass
        ks.append(capture.kv[0].astype(mx.float32))
        vs.append(capture.kv[1].astype(mx.float32))
        mx.eval(ks[-1], vs[-1])  # the lower layers' tails grow chunk by chunk
    return mx.concatenate(ks, axis=1), mx.concatenate(vs, axis=1)


def stored_kv(part, rope):
    """The part's stored K/V from `part.start` on, K rotated to its composed positions (by `part.shift`).

    Returns:
        tuple: (k, v), each (n_kv_heads, n_tokens - start, head_dim) float32.
    """
    p = part.prefix

    def tokens(codec, parts, params):  # (n_pages, n_kv, P, D) -> (n_kv, n_tokens, D)
        x = codec.decode(parts, params)
        return x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[:, part.start:p.n_tokens]

    k = tokens(p.k_codec, p.k_parts, p.k_params).astype(mx.float32)
    if p.key_scale is not None:  # stored as K / s (format 1.11)
        k = k * p.key_scale[:, None, :]
    n_kv, T, D = k.shape
    k = rope(k.reshape(n_kv * T, 1, D), offset=part.shift).reshape(n_kv, T, D)  # every row moved by Δ
    return k, tokens(p.v_codec, p.v_parts, p.v_params).astype(mx.float32)


def deviation(fresh, stored):
    """Per-token K/V deviation: ||ΔK||² / mean ||K||² + ||ΔV||² / mean ||V||² over the KV heads, K and V each
    scaled by the fresh side's mean squared norm so that neither dominates.

    Args:
        fresh, stored (tuple): (k, v), each (n_kv_heads, T, head_dim).

    Returns:
        mx.array: (T,) float32.
    """
    out = 0
    for f, s in zip(fresh, stored):
        out = out + ((f - s) ** 2).sum(axis=(0, 2)) / mx.maximum((f ** 2).sum(axis=(0, 2)).mean(), 1e-30)
    return out


def probe_mass(model, caches, ids):
    """Attention mass that `ids`, fed after the composed context, put on the last part's stored tokens,
    summed over rows, heads and layers.

    Args:
        model: the mlx-lm model. caches (list[ComposedCache]): a fresh prompt cache of the composition.
        ids (list[int]): the probe's tokens (a question prompt).

    Returns:
        mx.array: (n_tokens - start,) float32, for the last part's stored tokens from its `start` on.
    """
    for c in caches:
        c.record = []
    model(mx.array(ids)[None], cache=caches)
    return sum(m for c in caches for m in c.record)


def select(scores, k):
    """Indices of the `k` largest scores, ascending (ties: the earlier token first)."""
    if k == 0:
        return []
    order = np.argsort(-np.array(scores), kind="stable")[:k]
    return sorted(int(i) for i in order)


def skip_mask(prefix, selected):
    """Bool (n_pages * page_size,): True at the stored positions `selected` (indices into the stored tokens)."""
    shape = next(iter(prefix.k_parts.values())).shape  # (n_pages, n_kv, P, W)
    mask = np.zeros(shape[0] * shape[2], dtype=bool)
    mask[selected] = True
    return mx.array(mask)
