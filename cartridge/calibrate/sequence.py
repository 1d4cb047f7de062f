"""The evaluation sequence E of calibration (`cartridge.calibrate.measure`): the document's last tokens, then
generic probe questions, each with the model's own fp16 greedy answer, teacher-forced over the earlier prefix
as a cartridge of it stores it (`prefix_kv`: a sliding-window layer holds only its window's last tokens).
"""

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..errors import CalibrationUnsupportedError
from ..models.prompt import followup_tokens, question_tokens

PROBE = "What is this document about? Answer in one sentence."
PROBES = (PROBE,)  # generic questions asked one after another (a conversation), each with the fp16 answer
SLICE_TOKENS = 32  # document tokens teacher-forced at the end of the prefix
ANSWER_TOKENS = 8  # fp16 greedy answer tokens to each probe, teacher-forced too
SCORE_DOCUMENT = True  # False: the KL is averaged over the probes' positions only, not the document tail's


def eval_sequence(model, tokenizer, mode, kv, tokens, split, answer_tokens=None, probes=None, windows=None):
    """E = tokens[split:], then each probe question with the model's fp16 greedy answer (a conversation:
    the later probes as follow-up turns), over the prefix `kv`.

    Args:
        kv (list): per layer (K, V) of tokens[:split] as stored (`prefix_kv`), (1, n_kv_heads, S, head_dim).
        answer_tokens (int | None): greedy tokens per probe (fewer if it ends). Default: ANSWER_TOKENS.
        probes (tuple[str] | None): the questions. Default: PROBES.
        windows (list | None): per layer its window size or None (`prefix_kv`). Default: None (no windows).

    Returns:
        tuple: (ids list[int], logprobs (E, vocab) float32 of the model's own forward at E's positions).
    """
    answer_tokens = ANSWER_TOKENS if answer_tokens is None else answer_tokens
    windows = windows or [None] * len(kv)
    cache = [filled_cache(k, v, w, split) for (k, v), w in zip(kv, windows)]
    ids, rows, step, last = [], [], tokens[split:], None
    probes = PROBES if probes is None else probes
    for i, probe in enumerate(probes):
        step = step + (question_tokens(tokenizer, probe, mode) if i == 0 else
                       followup_tokens(tokenizer, probe, mode, last_token=last))
        for _ in range(answer_tokens):
            logits = model(mx.array(step, dtype=mx.uint32)[None], cache=cache)[0].astype(mx.float32)  # (L, vocab)
            rows.append(logits)
            ids += step
            last = int(mx.argmax(logits[-1]).item())
            step = [last]
            if last in _eos(tokenizer) and i + 1 < len(probes):  # the next turn follows the end of this one
                break
    return ids, log_softmax(mx.concatenate(rows))


def _eos(tokenizer):
    ids = getattr(tokenizer, "eos_token_ids", None)
    return set(ids) if ids else {getattr(tokenizer, "eos_token_id", None)}


def scored(n_ids, split_tokens):
    """Positions of E whose KL is averaged: all, or with SCORE_DOCUMENT False the probes' (from the end of
    the document tail, `split_tokens` positions)."""
    return 0 if SCORE_DOCUMENT else min(split_tokens, n_ids - 1)


def split_of(tokens, slice_tokens=None):
    """Prefix tokens E attends over: all but the last `slice_tokens` (default SLICE_TOKENS; at most half the
    document)."""
    slice_tokens = SLICE_TOKENS if slice_tokens is None else slice_tokens
    return max(1, len(tokens) - min(slice_tokens, len(tokens) // 2))


def filled_cache(k, v, window=None, position=None):
    """The mlx-lm cache of a layer holding k, v (1, n_kv_heads, S, head_dim) after a prefix of `position` tokens
    (default S), as a cartridge restores it: a KVCache, or for a `window` a RotatingKVCache(max_size=window)
    in temporal order (`attention.layers.WindowLayer.cache`)."""
    if window is None:
        cache = KVCache()
        cache.keys, cache.values, cache.offset = k, v, k.shape[2]
        return cache
    cache = RotatingKVCache(max_size=window, keep=0)
    cache.keys, cache.values = mx.array(k), mx.array(v)  # copies: a one-token step writes in place
    cache.offset, cache._idx = k.shape[2] if position is None else position, k.shape[2]
    return cache


def own_logits(model, ids, kv, windows, position):
    """The model's own forward of ids (1, E) over mlx-lm caches holding `kv` (per layer (K, V) as stored, of a
    `position`-token prefix; `windows` as `prefix_kv` gives them): (E, vocab) float32 logits."""
    caches = [filled_cache(k, v, w, position) for (k, v), w in zip(kv, windows)]
    return model(ids, cache=caches)[0].astype(mx.float32)


def window_kv(cache):
    """K, V (1, n_kv_heads, S, head_dim) a window layer stores after the prefix its RotatingKVCache has seen: its
    last S = min(offset, max_size) tokens in temporal order (`attention.kinds.WindowKind.stored_kv`)."""
    n = min(cache.offset, cache.max_size)
    return tuple(cache._temporal_order(x)[..., -n:, :] for x in (cache.keys, cache.values))


def hold_windows(caches):
    """{layer: `window_kv`} of every window layer (RotatingKVCache) of filled caches, evaluated: what `prefix_kv`
    needs of them when the prefill goes on past the split."""
    held = {j: window_kv(c) for j, c in enumerate(caches) if isinstance(c, RotatingKVCache)}
    mx.eval(held)
    return held


def prefix_kv(caches, split, held=None):
    """Per layer, the K/V a cartridge of tokens[:split] stores, and the layer's window.

    Args:
        caches (list): filled KVCache / RotatingKVCache (keep 0) of a prefill of at least `split` tokens.
        split (int): prefix tokens. held (dict | None): `hold_windows` of the caches when they held `split`
            tokens. Default: None (taken from the caches, where they still hold them).

    Returns:
        tuple: (kv list of (K, V) (1, n_kv_heads, S, head_dim): S = split, or min(split, window) for a window
        layer; windows list: per layer its window size or None).

    Raises:
        CalibrationUnsupportedError: a window layer whose stored tokens at `split` are neither held nor
            still in its cache (its window has moved past them).
    """
    kv, windows = [], []
    for j, c in enumerate(caches):
        if not isinstance(c, RotatingKVCache):
            kv.append((c.keys[..., :split, :], c.values[..., :split, :]))
            windows.append(None)
            continue
        windows.append(c.max_size)
        if held and j in held:
            kv.append(held[j])
            continue
        keys, values = (c._temporal_order(x) for x in (c.keys, c.values))  # positions offset - n .. offset - 1
        s, first = min(split, c.max_size), c.offset - keys.shape[2]
        if first > split - s:
            raise CalibrationUnsupportedError(f"layer {j}'s window no longer holds the tokens it stored at {split}")
        kv.append(tuple(x[..., split - s - first:split - first, :] for x in (keys, values)))
    return kv, windows


class _FirstLayerInput(Exception):
    """Raised by the stand-in first layer of `first_layer_input` with the hidden states it was called with."""


class _Capture:
    """A stand-in for a model's first layer: raises `_FirstLayerInput` with its input; other attributes are
    the layer's own (a family may read them before calling it)."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, h, *args, **kwargs):
        raise _FirstLayerInput(h)

    def __getattr__(self, name):
        return getattr(self.layer, name)


def first_layer_input(model, ids):
    """The hidden states (1, E, hidden) the model's first layer gets for ids (1, E) uint32: its own embedding,
    scaled where the family scales it (gemma's sqrt(hidden)). Read by running the model's forward up to that
    layer; a family whose forward cannot be run so (its layers not a list) gives `embed_tokens(ids)`, which
    calibration's self-check then judges."""
    layers = model.model.layers
    if not isinstance(layers, list):
        return model.model.embed_tokens(ids)
    first, layers[0] = layers[0], _Capture(layers[0])
    try:
        model(ids)
    except _FirstLayerInput as e:
        return e.args[0]
    except (TypeError, ValueError, AttributeError):
        pass
    finally:
        layers[0] = first
    return model.model.embed_tokens(ids)


def log_softmax(logits):
    """(..., vocab) float32 logits -> log-probabilities (on CPU by numpy: MLX's CPU exp is scalar code,
    `attention.caches.shared_prefix.shifted_exp`)."""
    if mx.default_device() != mx.cpu:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logits)
    return mx.array(log_softmax_inplace(np.array(logits)))


def log_softmax_inplace(a):
    """Log-softmax of float32 a (..., vocab) in place; returns a."""
    np.subtract(a, a.max(axis=-1, keepdims=True), out=a)
    np.subtract(a, np.log(np.exp(a).sum(axis=-1, keepdims=True)), out=a)
    return a
