"""The LM head of calibration's walk (`measure.wavefront`): each row's mean next-token KL against row 0.

Row 0 (the reference) gets its full log-probabilities p. The other rows differ from it by a small change
of the final hidden state, and KL(p || q) needs of their logits only what p weighs: with delta = z_row - z_0
the change of the logits (a linear map of the change of the normed hidden state),

    KL(p || q) = log sum_v p_v exp(delta_v) - sum_v p_v delta_v,

where sum_v p_v delta_v = (W^T p) . dx is one vector product per position (exact). The first sum is taken
exactly over the HEAD_TOKENS most probable tokens of p at each position and to first order over the rest
(sum_tail p_v (1 + delta_v), the linear part again from W^T p); the rest's second-order term,
sum_tail p_v (exp(delta_v) - 1 - delta_v), is estimated from TAIL_SAMPLES tail tokens at evenly spaced
quantiles of its mass (systematic sampling, deterministic). The rows' logits are then
(rows x positions x (HEAD_TOKENS + TAIL_SAMPLES)) instead of (rows x positions x vocab): for the default
model 48x fewer multiply-adds than the LM head over every row, which was a fifth of the walk's time
(h11-LICENSE.txt: 25.5 s -> 5.0 s, every layer's KL within -0.5% .. +0.2% of the full logits').
"""

import mlx.core as mx
import numpy as np
from mlx import nn

from .sequence import log_softmax, log_softmax_inplace

HEAD_TOKENS = 512  # most probable tokens of the reference per position, taken exactly (of 49,152 for SmolLM2)
TAIL_SAMPLES = 512  # tail tokens per position at evenly spaced quantiles of its mass: its second-order term
LOGIT_ROWS = 4  # rows of E per LM-head chunk of the exact path: (4, E, vocab) float32 logits at a time


def logits_of(model, h):
    """LM-head logits of final hidden states h (B, E, hidden) -> (B, E, vocab) float32."""
    return _head(model, model.model.norm(h))


def _tied(model):
    """The head is the embedding: so configured (llama's args, gemma3's attribute) or no `lm_head` at all."""
    return (getattr(getattr(model, "args", None), "tie_word_embeddings", False)
            or getattr(model, "tie_word_embeddings", False) is True or not hasattr(model, "lm_head"))


def _head(model, x):
    """Logits (B, E, vocab) float32 of normed hidden states x (B, E, hidden)."""
    out = model.model.embed_tokens.as_linear(x) if _tied(model) else model.lm_head(x)
    return out.astype(mx.float32)


def head_rows(model, ids):
    """Rows of the LM head's weight for token ids (E, K) -> (E, K, hidden) float32, or None when the head is
    not a tied embedding or a plain `nn.Linear` (the walk then takes every row's full logits)."""
    if _tied(model):
        return model.model.embed_tokens(ids).astype(mx.float32)  # Embedding and QuantizedEmbedding: W[ids]
    head = getattr(model, "lm_head", None)
    return head.weight[ids].astype(mx.float32) if isinstance(head, nn.Linear) else None


def kl_rows(ref_logprobs, logits):
    """Per row, the mean over positions of KL(ref || q) in nats: ref_logprobs (E, vocab), logits (B, E, vocab)
    float32 -> (B,) float32 (lazy except on CPU, where numpy computes it). A token the reference gives
    probability 0 (a -inf logit: phi3small masks its unused ids) adds 0."""
    if mx.default_device() != mx.cpu:
        terms = mx.exp(ref_logprobs) * (ref_logprobs - log_softmax(logits))
        return mx.where(ref_logprobs > -mx.inf, terms, 0.0).sum(axis=-1).mean(axis=-1)
    mx.eval(ref_logprobs, logits)
    ref = np.asarray(ref_logprobs)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both mask a token: dropped by the where
        terms = np.exp(ref) * (ref - log_softmax_inplace(np.array(logits)))
    return mx.array(np.where(ref > -np.inf, terms, 0.0).sum(axis=-1).mean(axis=-1))


def kl_mean(ref_logprobs, logits):
    """Mean over positions of KL(ref || q) in nats; ref_logprobs and logits (E, vocab) float32."""
    return kl_rows(ref_logprobs, logits[None]).item()


def walk_kl(model, h, start, head_tokens=None, tail_samples=None):
    """Row 0's log-probabilities and each other row's mean KL against them (module docstring).

    Args:
        model (nn.Module): the mlx-lm model. h (mx.array): (R, E, hidden) final hidden states, before the norm.
        start (int): the first position the KL is averaged over.
        head_tokens (int | None): tokens per position taken exactly. Default: HEAD_TOKENS; at least the
            vocabulary (or a head `head_rows` cannot read): every row's full logits (`kl_rows`).
        tail_samples (int | None): tail tokens per position for its second-order term. Default: TAIL_SAMPLES.

    Returns:
        tuple: ((E, vocab) float32 log-probabilities of row 0, list[float] of R - 1 mean KLs in nats).
    """
    x = model.model.norm(h)
    logprobs = log_softmax(_head(model, x[:1])[0])  # (E, vocab)
    ref, x = logprobs[start:], x[:, start:].astype(mx.float32)  # (E', vocab), (R, E', hidden)
    k = HEAD_TOKENS if head_tokens is None else head_tokens
    if k >= ref.shape[-1] or head_rows(model, mx.zeros((1, 1), dtype=mx.uint32)) is None:
        return logprobs, _full_kl(model, ref, x[1:])
    ids, p_top, tail_weight = _columns(np.asarray(ref), k, TAIL_SAMPLES if tail_samples is None else tail_samples)
    rows = head_rows(model, mx.array(ids))  # (E', K + M, hidden)
    _, (wp,) = mx.vjp(lambda a: _head(model, a), [x[:1]], [mx.exp(ref)[None]])  # (1, E', hidden): W^T p
    wp_tail = wp[0] - (mx.array(p_top, dtype=mx.float32)[:, None] @ rows[:, :k])[:, 0]  # W^T p, tail tokens
    dx = x[1:] - x[:1]  # (R - 1, E', hidden)
    delta = rows @ dx.transpose(1, 2, 0)  # (E', K + M, R - 1): logit changes of the columns
    linear_tail = (dx * wp_tail).sum(axis=-1).T  # (E', R - 1)
    mx.eval(delta, linear_tail)
    return logprobs, _kl_from_columns(p_top, tail_weight, np.asarray(delta), np.asarray(linear_tail))


def _columns(ref, k, m):
    """Per position, the K most probable token ids and M tail ids at evenly spaced quantiles of the tail's
    mass (systematic sampling: deterministic), ref (E, vocab) log-probabilities.

    Returns:
        tuple: (ids (E, K + M) int64, p of the top ids (E, K) float64, mass per tail sample (E, 1) float64).
    """
    order = np.argsort(-ref, axis=-1, kind="stable")  # (E, vocab), most probable first
    p = np.exp(np.take_along_axis(ref, order, axis=-1).astype(np.float64))
    cum = np.cumsum(p[:, k:], axis=-1)  # (E, vocab - K)
    mass = cum[:, -1:]  # (E, 1)
    quantiles = (np.arange(m) + 0.5) / m * mass  # (E, M)
    picks = np.stack([np.searchsorted(c, q) for c, q in zip(cum, quantiles)]).clip(max=cum.shape[1] - 1)
    ids = np.concatenate([order[:, :k], np.take_along_axis(order[:, k:], picks, axis=-1)], axis=-1)
    return ids, p[:, :k], mass / m if m else np.zeros_like(mass)


def _kl_from_columns(p_top, tail_weight, delta, linear_tail):
    """(R - 1) mean KLs: log(1 + a) - a + c per position, in float64 (KL is tiny next to the sums' terms).

    With g(d) = exp(d) - 1 - d >= 0: a = sum_top p (exp(delta) - 1) + linear_tail + t,
    c = sum_top p g(delta) + t, t = tail_weight x sum_samples g(delta). p_top (E, K), tail_weight (E, 1),
    delta (E, K + M, R - 1), linear_tail (E, R - 1)."""
    k, d = p_top.shape[1], delta.astype(np.float64)
    grown = np.expm1(d)
    second = grown - d  # (E, K + M, R - 1)
    tail = tail_weight * second[:, k:].sum(axis=1)  # (E, R - 1)
    a = (p_top[..., None] * grown[:, :k]).sum(axis=1) + linear_tail + tail
    c = (p_top[..., None] * second[:, :k]).sum(axis=1) + tail
    kl = np.log1p(np.maximum(a, -1 + 1e-12)) - a + c
    return [max(0.0, float(v)) for v in kl.mean(axis=0)]


def _full_kl(model, ref, x):
    """Mean KLs of rows x (B, E, hidden), normed, from their full logits, LOGIT_ROWS rows at a time."""
    kls = []
    for r in range(0, x.shape[0], LOGIT_ROWS):
        kls.append(kl_rows(ref, _head(model, x[r:r + LOGIT_ROWS])))
        mx.eval(kls[-1])
    return [max(0.0, kl) for kl in mx.concatenate(kls).tolist()] if kls else []
