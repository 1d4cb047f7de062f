"""Sensitivity of each (layer, side) to each candidate tier, measured on the document at build.

After the fp16 prefill every layer's K/V is at hand. The last `slice_tokens` tokens of the document, then a
generic probe question and the model's own fp16 greedy answer to it, form the *evaluation sequence* E; it is
teacher-forced over the cache of the earlier prefix as a cartridge of it stores it (K/V rounded to fp16; a
sliding-window layer holds its window's last tokens, `sequence.prefix_kv`, and E's queries see them through
the window's mask). What is replaced and measured is exactly what each layer stores.

One batched pass walks the layers (`wavefront`): row 0 is the reference (fp16 K/V everywhere); at every
WALK_GROUP-th layer j a new row starts from row 0's input with the K *and* V of layers j .. j + WALK_GROUP - 1
replaced by the reference tier's encode + decode, and runs to the end (the layers below see the same
inputs, so they are not run again). The rows grow from 1 to n_layers / WALK_GROUP + 1; the mean next-token
KL(reference || row) over E's positions (`head.walk_kl`) is the measured damage of replacing the group,
shared between its layers by each one's own change of the residual stream (squared, over E): a row
started at that layer and run through it alone, then dropped. Adjacent layers' changes reach the output
through nearly the same layers; two layers a row would halve the row-layers of the walk (30 layers: 270,
not 495), but the schemas chosen from it were measured up to 39% worse (docs/calibration.md): the default is 1.
The model's own forward of E (the greedy answer's) checks the walk.

Running every candidate tier through the model would cost layers x sides x tiers forwards of E; instead
each layer's measured KL is shared between its candidates and sides by their attention-output error on
E's queries over the prefix (no forward): KL is quadratic in a small change of the layer's attention
output, and K and V of one layer move the same output, so KL(side, t) ~ KL(layer) * err(side, t) /
(err(k, ref) + err(v, ref)). `cartridge.calibrate.verify` measures the chosen schema with all
replacements together.
"""

import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..attention import route
from ..attention.caches import SharedPrefixCache
from ..attention.pages import encode_pages
from ..errors import CalibrationUnsupportedError
from ..tiers import TIERS, key_scale, score_aware
from . import sequence
from .attention_error import LEAD_TOKENS, AttentionError
from .head import kl_mean, logits_of, walk_kl
from .sequence import (
    eval_sequence,
    filled_cache,
    first_layer_input,
    log_softmax,  # noqa: F401  (measure.log_softmax: benchmarks/agreement.py's)
    own_logits,
    prefix_kv,
    scored,
    split_of,
)

# rotated and plain tiers alike (which is better depends on the model), 216 .. 54 B at kv_dim 192
CANDIDATES = ("int8+rot", "int8", "int6+rot", "int6", "mlx4g32+rot", "mlx4g32", "turbo4", "turbo3", "turbo2")
REFERENCE_TIER = "mlx4g32+rot"  # the tier run through the model; the others are scaled from it
WALK_GROUP = 1  # consecutive layers one row of the walk replaces together; 2 measured worse (calibration.md)
HEAVY_FACTOR = 8.0  # a heavy hitter draws at least this many times the uniform share of attention
PAGE = 256  # page size of the round trip (the codecs' groups do not cross pages; the build's size is close)
FAITHFUL_KL = 1e-3  # nats: the walk's reference logits vs the model's own forward; more = a family it cannot walk


@dataclass
class Sensitivity:
    """Measured damage of every candidate (layer, side, tier).

    Attributes:
        kl (dict): (layer, side, tier) -> predicted mean next-token KL in nats vs fp16 (fp16 itself: 0).
        measured (dict): layer -> KL measured with its K and V both replaced by the reference tier (its
            share of its group's, WALK_GROUP layers replaced together).
        attn_err (dict): (layer, side, tier) -> squared relative attention-output error on E's queries.
        eval_tokens (int): positions of E. forwards (int): model passes run (the batched walk counts one).
        seconds (float): wall time. probe (Probe): the reference pass, for `verify`.
        protect_first (int): N leading heavy-hitter tokens (`heavy_hitters`), 0 if none.
        kl_protected (dict): like `kl`, with the first N tokens kept in fp16 (empty when N is 0).
        lead_mass (float): the share of the attention mass on those N tokens (mean over layers).
        stages (dict): wall seconds of "answer" (E and the model's own forward), "walk" (with the attention
            errors) and "protected" (the attention errors with the heavy hitters kept).
        cpu_stages (dict): the same stages in process CPU seconds (`time.process_time`, all threads).
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
    stages: dict = field(default_factory=dict)
    cpu_stages: dict = field(default_factory=dict)


@dataclass
class Probe:
    """The evaluation sequence and what the reference pass recorded.

    Attributes:
        split (int): prefix tokens attended over. ids (mx.array): (1, E) uint32 evaluation tokens.
        kv (list): per layer (K, V) as stored (`sequence.prefix_kv`), each (1, n_kv_heads, S, head_dim) in the
            model's dtype, fp16-rounded: S = split, or a window layer's min(split, window).
        embedded (mx.array | None): (1, E, hidden) input of layer 0 (`sequence.first_layer_input`); None when
            measured by the model's own forwards (`forwards`): `verify` then runs the model's own forward.
        queries (list): per layer, (n_heads, E, head_dim) float32 post-RoPE queries of the reference row.
        logprobs (mx.array): (E, vocab) float32 reference log-probabilities (the walk's row 0).
        start (int): the first of E's positions the KL and top-1 agreement are averaged over (`scored`).
        windows (list): per layer its sliding window's size, or None for a layer that stores every token.
    """

    split: int
    ids: object
    kv: list
    embedded: object
    start: int = 0
    windows: list = None
    queries: list = field(default_factory=list)
    logprobs: object = None


def text_model(model):
    """The model calibration walks: a multimodal wrapper's `language_model` (gemma3, mistral3, qwen2-vl, ...: their
    forward hands the text and the same caches to it), else the model itself."""
    inner = getattr(model, "language_model", None)
    return inner if inner is not None and not hasattr(getattr(model, "model", None), "layers") else model


def body_of(model):
    """The transformer body (`.layers`, `.norm`, `.embed_tokens`) of a llama-style mlx-lm model, or raise
    CalibrationUnsupportedError."""
    body = getattr(model, "model", None)
    if not all(hasattr(body, a) for a in ("layers", "norm", "embed_tokens")):
        raise CalibrationUnsupportedError("calibration walks .model.layers/.norm/.embed_tokens, which this "
                                          "model does not have")
    return body


def check_plain(caches):
    """Raise CalibrationUnsupportedError for caches other than a KVCache or a sliding-window RotatingKVCache
    (keep 0), or K/V shapes that differ between layers (the search prices every layer alike)."""
    kinds = sorted({type(c).__name__ for c in caches if type(c) not in (KVCache, RotatingKVCache)
                    or getattr(c, "keep", 0)})
    if kinds:
        raise CalibrationUnsupportedError(f"calibration measures attention layers (KVCache, sliding-window "
                                          f"RotatingKVCache) only; this model has {', '.join(kinds)} caches")
    shapes = {(x.shape[1], x.shape[3]) for c in caches if c.keys is not None for x in (c.keys, c.values)}
    if len(shapes) > 2 or len({(c.keys.shape[1], c.keys.shape[3]) for c in caches if c.keys is not None}) > 1:
        raise CalibrationUnsupportedError("calibration measures models whose layers have one K/V shape")


def run_from(model, h, kv, windows=None, position=None):
    """Every layer on input h (1, E, hidden) over caches holding `kv` (per layer (K, V) as stored), each with
    its own mask (mlx-lm's, of its window): (E, vocab) float32 logits.

    Args:
        windows (list | None): per layer its window or None (`sequence.prefix_kv`). Default: no windows.
        position (int | None): prefix tokens before h's first (the window layers'). Default: their K's length.
    """
    windows = windows or [None] * len(kv)
    for block, (k, v), window in zip(model.model.layers, kv, windows):
        cache = filled_cache(k, v, window, position)
        h = block(h, create_attention_mask(h, cache, window_size=window), cache=cache)
        mx.eval(h)  # a layer at a time, so Ctrl-C is honoured between layers
    return logits_of(model, h)[0]


def fp16_rounded(x):
    """x as an fp16 cartridge stores it (rounded to fp16), in x's dtype: the reference K/V."""
    return x.astype(mx.float16).astype(x.dtype)


def verify(model, probe, schema, first=0):
    """KL and top-1 agreement vs fp16 on E with every (layer, side) replaced by its schema tier together
    (through the walk's layers, or the model's own forward for a probe of `forwards`).

    Args:
        probe (Probe): from `measure`. schema (list[dict]): {"layer", "k", "v"} rows.
        first (int): leading prefix tokens kept in fp16 (protected). Default: 0.

    Returns:
        tuple: (mean KL nats float, top-1 agreement float in 0..1).
    """
    model, kv = text_model(model), []
    for row, pair, window in zip(schema, probe.kv, probe.windows):
        kept = first if window is None else 0  # a window layer does not store the leading tokens
        kv.append(tuple(_protected(round_trip(row[s], x, row["layer"], s), x, kept) if row[s] != "fp16" else x
                        for s, x in zip("kv", pair)))
        mx.eval(kv[-1])  # a layer at a time: one graph of every round trip would hold off Ctrl-C for seconds
    logits = (own_logits(model, probe.ids, kv, probe.windows, probe.split) if probe.embedded is None else
              run_from(model, probe.embedded, kv, probe.windows, probe.split))[probe.start:]
    ref = probe.logprobs[probe.start:]
    agree = (mx.argmax(logits, axis=-1) == mx.argmax(ref, axis=-1)).astype(mx.float32).mean().item()
    return max(0.0, kl_mean(ref, logits)), agree


def _protected(x2, x, first):
    """x2 (1, n_kv, T, D) with its first `first` tokens put back from x."""
    return mx.concatenate([x[:, :, :first], x2[:, :, first:]], axis=2) if first else x2


def round_trip(name, x, layer, side):
    """x (1, n_kv, T, D) -> its tier's decoded pages (1, n_kv, T, D) in x's dtype (encode, reference decode)."""
    codec, y = TIERS[name], x[0]
    scale = score_aware.scale_of(layer, side)  # K written as K / s: measured so (`cartridge.tiers.key_scale`)
    if scale is not None:
        y = key_scale.divided(y, scale)
    params = codec.make_params(y, layer, side)  # the codecs take statistics in float32 themselves, in blocks
    pages = codec.decode(encode_pages(codec, y, params, PAGE), params)  # (n_pages, n_kv, P, D)
    n_pages, n_kv, p, d = pages.shape
    # (n_pages, n_kv, P, D) -> (n_kv, n_pages * P, D) -> (1, n_kv, T, D)
    out = pages.transpose(1, 0, 2, 3).reshape(n_kv, n_pages * p, d)[:, :y.shape[1]]
    return (out if scale is None else out * mx.array(scale)[:, None, :])[None].astype(x.dtype)


def measurable(model, caches):
    """Raise CalibrationUnsupportedError unless calibration can walk this model's layers and caches."""
    body_of(text_model(model))
    check_plain(caches)


def measure(model, tokenizer, mode, caches, tokens, candidates=CANDIDATES, progress=None, held=None):
    """Measure every candidate (layer, side, tier) on this document (see the module docstring).

    Args:
        model (nn.Module): the mlx-lm model. tokenizer: its tokenizer wrapper. mode (str): prompt mode.
        caches (list): the filled KVCache / RotatingKVCache of the prefill of `tokens` (not modified).
        tokens (list[int]): the prefix tokens.
        candidates (tuple[str]): tiers to rate; must include REFERENCE_TIER. Default: CANDIDATES.
        progress (callable | None): progress(done, total) over the layers of the walk, from 0 (called with 0
            before the evaluation sequence is made).
        held (dict | None): the window layers' K/V at the split (`sequence.hold_windows`), when the caches
            went on past it. Default: None.

    Returns:
        Sensitivity

    Raises:
        CalibrationUnsupportedError: a model or cache kind calibration cannot walk, or a family whose
            layer-by-layer forward differs from its own by more than FAITHFUL_KL.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    model = text_model(model)
    measurable(model, caches)
    if progress:  # from the start: the evaluation sequence's answer comes before the walk
        progress(0, len(model.model.layers))
    split = split_of(tokens)
    kv, windows = prefix_kv(caches, split, held)
    kv = [tuple(fp16_rounded(a) for a in pair) for pair in kv]
    for pair in kv:
        mx.eval(pair)  # a layer at a time (Ctrl-C between), not inside the evaluation sequence's first forward
    ids, own = eval_sequence(model, tokenizer, mode, kv, tokens, split, windows=windows)
    x = mx.array(ids, dtype=mx.uint32)[None]
    probe = Probe(split, x, kv, first_layer_input(model, x), start=scored(len(ids), len(tokens) - split),
                  windows=windows)
    out = Sensitivity(eval_tokens=len(ids), forwards=sequence.ANSWER_TOKENS * len(sequence.PROBES) + 1, probe=probe)
    t1, c1 = time.perf_counter(), time.process_time()
    try:
        errors, pieces = wavefront(model, probe, candidates, out, progress)
    except (TypeError, ValueError, AttributeError) as e:  # a family whose blocks are not called llama's way
        raise CalibrationUnsupportedError(f"calibration cannot walk this model's layers ({type(e).__name__}: "
                                          f"{e})") from None
    faithful = kl_mean(own, probe.logprobs)
    if not faithful <= FAITHFUL_KL:
        raise CalibrationUnsupportedError(f"calibration's layer-by-layer forward of this model differs from its "
                                          f"own (KL {faithful:.3g} nats, at most {FAITHFUL_KL} allowed)")
    t2, c2 = time.perf_counter(), time.process_time()
    full = [e.mass() for e, w in zip(errors, windows) if w is None]  # heavy hitters: of the layers storing them
    out.protect_first, out.lead_mass = heavy_hitters(mx.stack(full).mean(axis=0)) if full else (0, 0.0)
    if out.protect_first:
        _protected_errors(out, errors, pieces)
    _scale(len(caches), candidates, out)
    t3, c3 = time.perf_counter(), time.process_time()
    out.seconds = t3 - t0
    out.stages = {"answer": round(t1 - t0, 3), "walk": round(t2 - t1, 3), "protected": round(t3 - t2, 3)}
    out.cpu_stages = {"answer": round(c1 - c0, 3), "walk": round(c2 - c1, 3), "protected": round(c3 - c2, 3)}
    return out


def wavefront(model, probe, candidates, out, progress=None):
    """The batched walk over the layers (module docstring): fills probe.queries, probe.logprobs,
    out.measured and out.attn_err; returns (per-layer AttentionError, `_layer_errors`' pieces)."""
    layers, errors, pieces, direct = model.model.layers, [], {}, []
    h = probe.embedded  # (rows, E, hidden): row 0 the reference, row i + 1 replaces the layers of group i
    seen = lambda q, k, v, cache, mask: probe.queries.append(q[0].astype(mx.float32))  # (n_heads, E, D)
    route.install()
    if progress:
        progress(0, len(layers))
    with route.watching(seen):
        for j, block in enumerate(layers):
            (k, v), window = probe.kv[j], probe.windows[j]
            k2, v2 = (round_trip(REFERENCE_TIER, a, j, s) for a, s in ((k, "k"), (v, "v")))
            opens = j % WALK_GROUP == 0  # a new row for the group; else one for this layer alone, run one layer
            h = mx.concatenate([h, h[:1]])  # (rows + 1, E, hidden)
            cache = SharedPrefixCache(k, v, k2, v2, 1 if opens else 2, probe.split, window)
            h = block(h, "causal", cache=cache)
            direct.append(((h[-1] - h[0])[probe.start:] ** 2).sum())  # layer j's own change of the residual
            errors.append(AttentionError(probe.queries[j], k, v, cache.scale, window))
            lazy, layer_pieces = _layer_errors(errors[j], j, k, v, candidates, {"k": k2, "v": v2})
            mx.eval(h, lazy, layer_pieces, direct[-1])
            h = h if opens else h[:-1]
            out.attn_err.update({key: e.item() for key, e in lazy.items()})
            pieces.update(layer_pieces if window is None else {})  # a window layer stores no leading tokens
            if progress:
                progress(j + 1, len(layers))
    probe.logprobs, kls = walk_kl(model, h, probe.start)
    out.measured = _split(kls, [d.item() for d in direct])
    return errors, pieces


def _split(kls, direct):
    """layer -> KL: each group's measured KL (kls, one per WALK_GROUP layers) shared between its layers by
    their own change of the residual stream (direct, one per layer)."""
    measured = {}
    for i, kl in enumerate(kls):
        group = range(i * WALK_GROUP, min((i + 1) * WALK_GROUP, len(direct)))
        total = sum(direct[j] for j in group)
        measured.update({j: kl * (direct[j] / total if total > 0 else 1 / len(group)) for j in group})
    return measured


def _layer_errors(error, layer, k, v, candidates, ref_trips):
    """({(layer, side, tier): lazy attention error}, {same key: `AttentionError.protected`'s pieces}) of every
    candidate on both sides of one layer."""
    lazy, pieces = {}, {}
    for side, x in (("k", k), ("v", v)):
        for name in candidates:
            x2 = ref_trips[side] if name == REFERENCE_TIER else round_trip(name, x, layer, side)
            lazy[(layer, side, name)], pieces[(layer, side, name)] = error(side, x2)
    return lazy, pieces


def _protected_errors(out, errors, pieces):
    """The attention errors with the first `out.protect_first` tokens kept in fp16 (one sync)."""
    lazy = {(*key, "protected"): errors[key[0]].protected(key[1], p, out.protect_first) for key, p in pieces.items()}
    mx.eval(lazy)
    out.attn_err.update({key: e.item() for key, e in lazy.items()})


def _scale(n_layers, candidates, out):
    """Share each layer's measured KL between its sides and candidates by attention error (module docstring)."""
    for layer in range(n_layers):
        ref = sum(out.attn_err[(layer, s, REFERENCE_TIER)] for s in "kv")
        scale = out.measured[layer] / ref if ref > 0 else 0.0
        for side in "kv":
            for name in candidates:
                out.kl[(layer, side, name)] = scale * out.attn_err[(layer, side, name)]
                if out.protect_first:  # a window layer's error is the same with leading tokens protected
                    err = out.attn_err.get((layer, side, name, "protected"), out.attn_err[(layer, side, name)])
                    out.kl_protected[(layer, side, name)] = scale * err
            out.kl[(layer, side, "fp16")] = 0.0
            if out.protect_first:
                out.kl_protected[(layer, side, "fp16")] = 0.0


def heavy_hitters(mass, lead=LEAD_TOKENS, factor=HEAVY_FACTOR):
    """(N, share): N = 1 + the last of the first `lead` prefix tokens whose mean attention mass is at least
    `factor` x uniform (attention sinks, Xiao et al. 2024; H2O's heavy hitters, Zhang et al. 2023), 0 if
    none; share = the mass on tokens 0..N-1. mass (mx.array): (T,) summing to 1."""
    t = mass.shape[0]
    lead_mass = mass[:min(lead, t - 1)].tolist()
    heavy = [j for j, m in enumerate(lead_mass) if m >= factor / t]
    n = heavy[-1] + 1 if heavy else 0
    return n, float(mass[:n].sum().item()) if n else 0.0
