"""The evaluation sequence E of calibration (`cartridge.calibrate.measure`): the document's last tokens, then
generic probe questions, each with the model's own fp16 greedy answer, teacher-forced over the earlier prefix.
"""

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..models.prompt import followup_tokens, question_tokens

PROBE = "What is this document about? Answer in one sentence."
PROBES = (PROBE,)  # generic questions asked one after another (a conversation), each with the fp16 answer
SLICE_TOKENS = 32  # document tokens teacher-forced at the end of the prefix
ANSWER_TOKENS = 8  # fp16 greedy answer tokens to each probe, teacher-forced too
SCORE_DOCUMENT = True  # False: the KL is averaged over the probes' positions only, not the document tail's


def eval_sequence(model, tokenizer, mode, kv, tokens, split, answer_tokens=None, probes=None):
    """E = tokens[split:], then each probe question with the model's fp16 greedy answer (a conversation:
    the later probes as follow-up turns), over the prefix `kv`.

    Args:
        kv (list): per layer (K, V) of tokens[:split], (1, n_kv_heads, split, head_dim).
        answer_tokens (int | None): greedy tokens per probe (fewer if it ends). Default: ANSWER_TOKENS.
        probes (tuple[str] | None): the questions. Default: PROBES.

    Returns:
        tuple: (ids list[int], logprobs (E, vocab) float32 of the model's own forward at E's positions).
    """
    answer_tokens = ANSWER_TOKENS if answer_tokens is None else answer_tokens
    ids, rows, cache, step, last = [], [], [filled_cache(k, v) for k, v in kv], tokens[split:], None
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


def filled_cache(k, v):
    """A KVCache holding k, v (1, n_kv_heads, T, head_dim)."""
    cache = KVCache()
    cache.keys, cache.values, cache.offset = k, v, k.shape[2]
    return cache


def log_softmax(logits):
    """(..., vocab) float32 logits -> log-probabilities (on CPU by numpy: MLX's CPU exp is scalar code,
    `walk.shifted_exp`)."""
    if mx.default_device() != mx.cpu:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logits)
    return mx.array(log_softmax_inplace(np.array(logits)))


def log_softmax_inplace(a):
    """Log-softmax of float32 a (..., vocab) in place; returns a."""
    np.subtract(a, a.max(axis=-1, keepdims=True), out=a)
    np.subtract(a, np.log(np.exp(a).sum(axis=-1, keepdims=True)), out=a)
    return a
