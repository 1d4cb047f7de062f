"""Calibration of a model the batched walk cannot run (`measure.measure` raises CalibrationUnsupportedError:
no llama-style `.model.layers/.norm/.embed_tokens`, blocks called otherwise, attention sinks, a logit scale,
latent attention): the model's own forward, once per (layer, side).

E and its reference log-probabilities are the walk's (`sequence.eval_sequence`: the model's own forward over
the stored prefix). For each (layer, side) the stored K (or V) is replaced by the reference tier's round trip
and E is run again through the model with mlx-lm's own caches (`sequence.filled_cache`): the mean KL against
the reference is that side's measured damage. The other candidates are scaled from it by their squared
relative reconstruction error ||x' - x||^2 / ||x||^2 over the stored K/V (KL is quadratic in a small change;
without the layer's queries, which such a family may not hand to the routed attention, the attention-output
error of `measure` cannot be taken). 2 x layers forwards of E: about version 1's cost (docs/calibration.md).
"""

import time

import mlx.core as mx

from . import sequence
from .head import kl_mean
from .measure import REFERENCE_TIER, Probe, Sensitivity, check_plain, fp16_rounded, round_trip
from .sequence import eval_sequence, own_logits, prefix_kv, scored, split_of


def reconstruction_error(x2, x):
    """||x2 - x||^2 / ||x||^2 over all elements, float32 (a lazy scalar); x2, x (1, n_kv, S, D)."""
    x, x2 = x.astype(mx.float32), x2.astype(mx.float32)
    return ((x2 - x) ** 2).sum() / mx.maximum((x ** 2).sum(), 1e-30)


def measure(model, tokenizer, mode, caches, tokens, candidates, progress=None, held=None):
    """Measure every candidate (layer, side, tier) by the model's own forwards (module docstring).

    Args:
        as `measure.measure` takes them; `candidates` must include REFERENCE_TIER.

    Returns:
        Sensitivity: `attn_err` holds the reconstruction errors; no heavy hitters (protect_first 0);
        `probe.embedded` is None (verify runs the model's own forward, `measure.verify`).

    Raises:
        CalibrationUnsupportedError: caches other than KVCache / sliding-window RotatingKVCache, or K/V
            shapes that differ between layers (`measure.check_plain`).
    """
    t0, c0 = time.perf_counter(), time.process_time()
    check_plain(caches)
    split = split_of(tokens)
    kv, windows = prefix_kv(caches, split, held)
    kv = [tuple(fp16_rounded(a) for a in pair) for pair in kv]
    if progress:
        progress(0, len(kv))
    ids, own = eval_sequence(model, tokenizer, mode, kv, tokens, split, windows=windows)
    probe = Probe(split, mx.array(ids, dtype=mx.uint32)[None], kv, None,
                  start=scored(len(ids), len(tokens) - split), windows=windows, logprobs=own)
    out = Sensitivity(eval_tokens=len(ids), forwards=sequence.ANSWER_TOKENS * len(sequence.PROBES) + 2 * len(kv),
                      probe=probe)
    for j, pair in enumerate(kv):
        for i, side in enumerate("kv"):
            trips = {name: round_trip(name, pair[i], j, side) for name in candidates}
            errors = {name: reconstruction_error(x2, pair[i]) for name, x2 in trips.items()}
            mx.eval(errors)
            replaced = list(kv)
            replaced[j] = tuple(trips[REFERENCE_TIER] if n == i else x for n, x in enumerate(pair))
            logits = own_logits(model, probe.ids, replaced, windows, split)
            kl = kl_mean(own[probe.start:], logits[probe.start:])
            ref = errors[REFERENCE_TIER].item()
            out.kl.update({(j, side, name): kl * e.item() / ref if ref > 0 else 0.0 for name, e in errors.items()})
            out.kl[(j, side, "fp16")] = 0.0
            out.attn_err.update({(j, side, name): e.item() for name, e in errors.items()})
        out.measured[j] = out.kl[(j, "k", REFERENCE_TIER)] + out.kl[(j, "v", REFERENCE_TIER)]
        if progress:
            progress(j + 1, len(kv))
    out.seconds = time.perf_counter() - t0
    out.stages, out.cpu_stages = {"forwards": round(out.seconds, 3)}, {"forwards": round(time.process_time() - c0, 3)}
    return out
