"""Sensitivity of each (layer, side) to each candidate tier, measured on the document at build.

After the fp16 prefill every layer's K/V is at hand. The last `slice_tokens` tokens of the document, then a
generic probe question and the model's own fp16 answer to it, form the *evaluation sequence* E; it is
teacher-forced over the cache of the earlier prefix, once with the fp16 K/V (the reference logits) and
once per (layer, side) with that one layer-side replaced by the reference tier's encode + decode, run
from that layer on (the layers below see the same inputs). The mean next-token KL(fp16 || replaced) over
E's positions is that layer-side's measured damage.

Running every candidate tier through the model would cost layers x sides x tiers forwards of E; instead
the other tiers' damage is scaled from the measured one by their attention-output error on E's queries
over the prefix (no forward): KL is quadratic in a small logit change, and the logit change roughly
linear in the attention-output change, so KL(t) ~ KL(ref) * err(t)^2 / err(ref)^2 per layer-side.
`cartridge.calibrate.verify` measures the chosen schema with all replacements together.
"""

import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..attention import route
from ..attention.pages import encode_pages
from ..errors import InputError
from ..models.prompt import question_tokens
from ..tiers import TIERS

CANDIDATES = ("int8+rot", "int6+rot", "mlx4g32+rot", "turbo4", "turbo3", "turbo2")  # 216 .. 54 B at kv_dim 192
REFERENCE_TIER = "mlx4g32+rot"  # the tier run through the model; the others are scaled from it
PROBE = "What is this document about? Answer in one sentence."
SLICE_TOKENS = 32  # document tokens teacher-forced at the end of the prefix
ANSWER_TOKENS = 8  # fp16 greedy answer tokens to the probe, teacher-forced too
LEAD_TOKENS = 32  # heavy hitters are looked for among the first prefix tokens (the format protects first N)
HEAVY_FACTOR = 8.0  # a heavy hitter draws at least this many times the uniform share of attention
PAGE = 256  # page size of the round trip (the codecs' groups do not cross pages; the build's size is close)


@dataclass
class Sensitivity:
    """Measured damage of every candidate (layer, side, tier).

    Attributes:
        kl (dict): (layer, side, tier) -> predicted mean next-token KL in nats vs fp16 (fp16 itself: 0).
        measured (dict): (layer, side) -> KL measured by a forward with the reference tier.
        attn_err (dict): (layer, side, tier) -> squared relative attention-output error on E's queries.
        eval_tokens (int): positions of E. forwards (int): model passes run. seconds (float): wall time.
        probe (Probe): the reference pass, for `verify`.
        protect_first (int): N leading heavy-hitter tokens (`heavy_hitters`), 0 if none.
        kl_protected (dict): like `kl`, with the first N tokens kept in fp16 (empty when N is 0).
        lead_mass (float): the share of the attention mass on those N tokens (mean over layers).
    """

    kl: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)
    attn_err: dict = field(default_factory=dict)
    eval_tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0
    probe: object = None
    protect_first: int = 0
    kl_protected: dict = field(default_factory=dict)
    lead_mass: float = 0.0


@dataclass
class Probe:
    """The evaluation sequence and what the reference pass recorded.

    Attributes:
        split (int): prefix tokens attended over. ids (mx.array): (1, E) uint32 evaluation tokens.
        kv (list): per layer (K, V), each (1, n_kv_heads, split, head_dim) in the model's dtype.
        hidden (list): per layer, the (1, E, hidden) input of that layer in the reference pass.
        queries (list): per layer, (n_heads, E, head_dim) float32 post-RoPE queries of the reference pass.
        logprobs (mx.array): (E, vocab) float32 reference log-probabilities.
    """

    split: int
    ids: object
    kv: list
    hidden: list
    queries: list
    logprobs: object


def body_of(model):
    """The transformer body (`.layers`, `.norm`, `.embed_tokens`) of a llama-style mlx-lm model, or raise."""
    body = getattr(model, "model", None)
    if not all(hasattr(body, a) for a in ("layers", "norm", "embed_tokens")):
        raise InputError("calibration needs an mlx-lm model with .model.layers/.norm/.embed_tokens "
                         "(llama-style); build with a tier or --no-calibrate")
    return body


def check_plain(caches):
    """Refuse caches other than plain full-attention KVCache (calibration replaces whole layer-sides)."""
    kinds = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if kinds:
        raise InputError(f"calibration supports full-attention layers only; this model has {', '.join(kinds)} "
                         f"caches; build with a tier or --no-calibrate")


def logits_of(model, h):
    """LM-head logits of the final hidden state h (1, E, hidden) -> (E, vocab) float32."""
    body = model.model
    out = body.norm(h)
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False) or not hasattr(model, "lm_head")
    out = body.embed_tokens.as_linear(out) if tied else model.lm_head(out)
    return out[0].astype(mx.float32)


def run_from(model, layer, h, kv):
    """Layers `layer`.. on input h over caches holding `kv` (list of (K, V) from `layer` on): (E, vocab) logits."""
    body = model.model
    caches = [_cache(k, v) for k, v in kv]
    mask = create_attention_mask(h, caches[0])
    for block, cache in zip(body.layers[layer:], caches):
        h = block(h, mask, cache=cache)
    return logits_of(model, h)


def _cache(k, v):
    cache = KVCache()
    cache.keys, cache.values, cache.offset = k, v, k.shape[2]
    return cache


def kl_mean(ref_logprobs, logits):
    """Mean over positions of KL(ref || q) in nats; ref_logprobs and logits (E, vocab) float32."""
    q = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return (mx.exp(ref_logprobs) * (ref_logprobs - q)).sum(axis=-1).mean().item()


def eval_sequence(model, tokenizer, mode, caches, tokens, slice_tokens=SLICE_TOKENS, answer_tokens=ANSWER_TOKENS):
    """E = the document's last `slice_tokens` + the probe question + the model's fp16 greedy answer.

    Returns:
        tuple: (split int, ids list[int]).
    """
    split = max(1, len(tokens) - min(slice_tokens, len(tokens) // 2))
    question = question_tokens(tokenizer, PROBE, mode)
    answer, cache = [], [_cache(c.keys[..., :len(tokens), :], c.values[..., :len(tokens), :]) for c in caches]
    step = question
    for _ in range(answer_tokens):
        nxt = int(mx.argmax(model(mx.array(step, dtype=mx.uint32)[None], cache=cache)[0, -1]).item())
        answer.append(nxt)
        step = [nxt]
    return split, tokens[split:] + question + answer[:-1]


def reference(model, caches, split, ids):
    """The reference pass over E: per-layer inputs, queries and the fp16 log-probabilities (a `Probe`)."""
    body = body_of(model)
    kv = [tuple(fp16_rounded(a[..., :split, :]) for a in (c.keys, c.values)) for c in caches]
    x = mx.array(ids, dtype=mx.uint32)[None]
    h, hidden, queries = body.embed_tokens(x), [], []
    seen = lambda q, k, v, cache, mask: queries.append(q[0].astype(mx.float32))  # (n_heads, E, D)
    route.install()
    fresh = [_cache(k, v) for k, v in kv]
    mask = create_attention_mask(h, fresh[0])
    with route.watching(seen):
        for block, cache in zip(body.layers, fresh):
            hidden.append(h)
            h = block(h, mask, cache=cache)
    logits = logits_of(model, h)
    mx.eval(hidden, queries, logits)
    return Probe(split, x, kv, hidden, queries, logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def fp16_rounded(x):
    """x as an fp16 cartridge stores it (rounded to fp16), in x's dtype: the reference K/V."""
    return x.astype(mx.float16).astype(x.dtype)


def verify(model, probe, schema, first=0):
    """KL and top-1 agreement vs fp16 on E with every (layer, side) replaced by its schema tier together.

    Args:
        probe (Probe): from `reference`. schema (list[dict]): {"layer", "k", "v"} rows.
        first (int): leading prefix tokens kept in fp16 (protected). Default: 0.

    Returns:
        tuple: (mean KL nats float, top-1 agreement float in 0..1).
    """
    kv = [tuple(_protected(round_trip(row[s], x, row["layer"], s), x, first) if row[s] != "fp16" else x
                for s, x in zip("kv", pair)) for row, pair in zip(schema, probe.kv)]
    logits = run_from(model, 0, probe.hidden[0], kv)
    agree = (mx.argmax(logits, axis=-1) == mx.argmax(probe.logprobs, axis=-1)).astype(mx.float32).mean().item()
    return max(0.0, kl_mean(probe.logprobs, logits)), agree


def _protected(x2, x, first):
    """x2 (1, n_kv, T, D) with its first `first` tokens put back from x."""
    return mx.concatenate([x[:, :, :first], x2[:, :, first:]], axis=2) if first else x2


def round_trip(name, x, layer, side):
    """x (1, n_kv, T, D) -> its tier's decoded pages (1, n_kv, T, D) in x's dtype (encode, reference decode)."""
    codec, y = TIERS[name], x[0]
    params = codec.make_params(y.astype(mx.float32), layer, side)
    pages = codec.decode(encode_pages(codec, y, params, PAGE), params)  # (n_pages, n_kv, P, D)
    n_pages, n_kv, p, d = pages.shape
    # (n_pages, n_kv, P, D) -> (n_kv, n_pages * P, D) -> (1, n_kv, T, D)
    out = pages.transpose(1, 0, 2, 3).reshape(n_kv, n_pages * p, d)[:, :y.shape[1]]
    return out[None].astype(x.dtype)


class AttentionError:
    """Squared relative error ||o' - o||^2 / ||o||^2 of one layer's softmax(q K^T / sqrt(D)) V over the prefix
    when K or V is replaced; the fp16 softmax and output are computed once per layer.

    Args:
        q (mx.array): (n_heads, E, D) float32 queries. k, v (mx.array): (1, n_kv, T, D) reference K/V.
    """

    def __init__(self, q, k, v):
        h, e, d = q.shape
        self.q = q.reshape(k.shape[1], h // k.shape[1] * e, d) * d ** -0.5  # (n_kv, group * E, D): GQA groups
        self.k, self.v = k, v
        self.p = self._softmax(k)  # (n_kv, group * E, T)
        self.o = self.p @ v[0].astype(mx.float32)  # (n_kv, group * E, D)
        self.norm = (self.o ** 2).sum()

    def _softmax(self, k):
        return mx.softmax(self.q @ k[0].astype(mx.float32).swapaxes(-1, -2), axis=-1)

    def mass(self):
        """(T,) float32: the mean attention probability of each prefix token over heads and query rows."""
        return self.p.mean(axis=(0, 1))

    def __call__(self, side, x2, first=0):
        """The error with `side` ("k" or "v") replaced by x2 (1, n_kv, T, D), its first `first` tokens kept."""
        if first:
            ref = self.k if side == "k" else self.v
            x2 = mx.concatenate([ref[:, :, :first], x2[:, :, first:]], axis=2)
        o2 = (self._softmax(x2) @ self.v[0].astype(mx.float32) if side == "k"
              else self.p @ x2[0].astype(mx.float32))
        return (((o2 - self.o) ** 2).sum() / self.norm).item()


def measure(model, tokenizer, mode, caches, tokens, candidates=CANDIDATES, progress=None):
    """Measure every candidate (layer, side, tier) on this document (see the module docstring).

    Args:
        model (nn.Module): the mlx-lm model. tokenizer: its tokenizer wrapper. mode (str): prompt mode.
        caches (list[KVCache]): the filled caches of the prefill of `tokens` (not modified).
        tokens (list[int]): the prefix tokens.
        candidates (tuple[str]): tiers to rate; must include REFERENCE_TIER. Default: CANDIDATES.
        progress (callable | None): progress(done, total) over the (layer, side) forwards, from 0.

    Returns:
        Sensitivity

    Raises:
        InputError: a model or cache kind calibration cannot replace layer-sides of.
    """
    t0 = time.perf_counter()
    body_of(model)
    check_plain(caches)
    split, ids = eval_sequence(model, tokenizer, mode, caches, tokens)
    probe = reference(model, caches, split, ids)
    out = Sensitivity(eval_tokens=len(ids), forwards=1 + ANSWER_TOKENS, probe=probe)
    total = 2 * len(caches)
    if progress:
        progress(0, total)
    errors = [AttentionError(probe.queries[i], *probe.kv[i]) for i in range(len(caches))]
    mass = mx.stack([e.mass() for e in errors]).mean(axis=0)  # (T,)
    out.protect_first, out.lead_mass = heavy_hitters(mass)
    for layer in range(len(caches)):
        for i, side in enumerate(("k", "v")):
            _rate(model, probe, layer, side, candidates, out, errors[layer])
            if progress:
                progress(2 * layer + i + 1, total)
    out.seconds = time.perf_counter() - t0
    return out


def heavy_hitters(mass, lead=LEAD_TOKENS, factor=HEAVY_FACTOR):
    """(N, share): N = 1 + the last of the first `lead` prefix tokens whose mean attention mass is at least
    `factor` x uniform (attention sinks, Xiao et al. 2024; H2O's heavy hitters, Zhang et al. 2023), 0 if
    none; share = the mass on tokens 0..N-1. mass (mx.array): (T,) summing to 1."""
    t = mass.shape[0]
    heavy = [j for j in range(min(lead, t - 1)) if mass[j].item() >= factor / t]
    n = heavy[-1] + 1 if heavy else 0
    return n, float(mass[:n].sum().item()) if n else 0.0


def _rate(model, probe, layer, side, candidates, out, error):
    """Measure (layer, side) at REFERENCE_TIER by a forward; scale the other candidates by attention error."""
    k, v = probe.kv[layer]
    for name in candidates:
        x2 = round_trip(name, k if side == "k" else v, layer, side)
        out.attn_err[(layer, side, name)] = error(side, x2)
        if out.protect_first:
            out.attn_err[(layer, side, name, "protected")] = error(side, x2, out.protect_first)
        if name == REFERENCE_TIER:
            kv = [(x2, v) if side == "k" else (k, x2)] + probe.kv[layer + 1:]
            logits = run_from(model, layer, probe.hidden[layer], kv)
            out.measured[(layer, side)] = max(0.0, kl_mean(probe.logprobs, logits))
            out.forwards += 1
    ref = out.attn_err[(layer, side, REFERENCE_TIER)]
    for name in candidates:
        scale = out.measured[(layer, side)] / ref if ref > 0 else 0.0
        out.kl[(layer, side, name)] = scale * out.attn_err[(layer, side, name)]
        if out.protect_first:
            out.kl_protected[(layer, side, name)] = scale * out.attn_err[(layer, side, name, "protected")]
    out.kl[(layer, side, "fp16")] = 0.0
    if out.protect_first:
        out.kl_protected[(layer, side, "fp16")] = 0.0
