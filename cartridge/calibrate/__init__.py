"""Tier schemas chosen by measuring the document at build (issue 33): `measure` rates every candidate
(layer, side, tier) on the model's own predictions, `search` picks the schema of least damage within a
budget, and `calibrated_schema` does both and returns the header record (`cartridge.calibration`,
spec/FORMAT.md 4.7). Every layer the cartridge stores K/V of is measured, sliding-window layers on the
tokens their window stores (calibration version 4); a family the batched walk cannot run is measured by its
own forwards (`forwards`).
"""

import warnings
from dataclasses import dataclass

from mlx_lm.models.cache import make_prompt_cache

from ..errors import CalibrationUnsupportedError, InputError
from ..tiers import TIERS, presets, protect, schema_for
from . import forwards, measure, search
from .sequence import hold_windows, split_of  # noqa: F401  (build's: the window layers' K/V at the split)

CALIBRATION_VERSION = 4  # bump when the measurement or search changes what a budget preset builds
PRESET_RATIOS = {"safe": 2.0, "balanced": 3.0, "compact": 4.5}  # preset -> at most 1/ratio of fp16's bytes/token


@dataclass(frozen=True)
class CalibrationTarget:
    """What a calibrated build aims at (the `budget` of `cartridge.build`, the record's "target"): one bound.

    Attributes:
        preset (str | None): a PRESET_RATIOS name (sets `target_ratio`). target_ratio (float | None): fp16
            bytes/token over at most this. max_bytes_per_token (int | None): K+V payload bytes/token.
        max_kl (float | None): least bytes whose predicted KL (nats/token) vs fp16 is at most this.
    """

    preset: str | None = None
    target_ratio: float | None = None
    max_bytes_per_token: int | None = None
    max_kl: float | None = None

    def check(self):
        """Raise InputError unless exactly one bound is given and it is in range; returns self."""
        given = [n for n in ("preset", "target_ratio", "max_bytes_per_token", "max_kl") if getattr(self, n) is not None]
        if len(given) != 1:
            raise InputError(f"give one of preset, target_ratio, max_bytes_per_token, max_kl; got {given or 'none'}")
        if self.preset is not None and self.preset not in PRESET_RATIOS:
            raise InputError(f"preset {self.preset!r} is not a budget; budget presets: {', '.join(PRESET_RATIOS)}")
        if self.target_ratio is not None and not 1.0 <= self.target_ratio <= 64.0:
            raise InputError(f"target ratio {self.target_ratio!r} is out of range 1..64 (x smaller than fp16)")
        if self.max_bytes_per_token is not None and (isinstance(self.max_bytes_per_token, bool) or
                                                     not isinstance(self.max_bytes_per_token, int)
                                                     or self.max_bytes_per_token < 1):
            raise InputError(f"max bytes per token {self.max_bytes_per_token!r} must be an integer >= 1")
        if self.max_kl is not None and not self.max_kl >= 0:
            raise InputError(f"max KL {self.max_kl!r} must be a number >= 0 (nats per token)")
        return self

    def bounds(self, fp16):
        """Per part (the layers that store every token, the sliding-window layers) its K+V bytes/token bound,
        or None for a KL bound: 1/ratio of the part's fp16 bytes/token; `max_bytes_per_token` bounds the first
        part (the second if there is none) and gives the other the same share of its fp16 bytes.

        Args:
            fp16 (list[int]): each part's fp16 K+V bytes/token (0 for an empty part).
        """
        ratio = PRESET_RATIOS.get(self.preset, self.target_ratio)
        if ratio:
            return [int(b // ratio) for b in fp16]
        if self.max_bytes_per_token is None:
            return None
        base = fp16[0] or fp16[1]
        return [b * self.max_bytes_per_token // base for b in fp16]

    def record(self):
        """This target as the header record's "target" object."""
        return {k: getattr(self, k) for k in ("preset", "target_ratio", "max_bytes_per_token", "max_kl")
                if getattr(self, k) is not None}


def resolve_target(preset, target, calibrate, *given):
    """(target, fixed preset): a budget preset becomes a CalibrationTarget when calibrating; the other preset stays.

    Args:
        preset (str | None), target (CalibrationTarget | None: build's `budget`), calibrate (bool): as
            `cartridge.build` takes them.
        given: build's tier, k_tier, v_tier, boundary_protect, schema, protect_first, protect_last.

    Raises:
        InputError: a budget with a preset or with a tier or protection option, or without calibration.
    """
    if target is not None:
        names = ("tier", "k_tier", "v_tier", "boundary_protect", "schema", "protect_first", "protect_last")
        clash = [n for n, v in zip(names, given) if v not in (None, 0, "fp16")]
        if preset is not None or clash:
            raise InputError(f"a budget chooses the tiers; it cannot be combined with {', '.join(clash or ['preset'])}")
        if not calibrate:
            raise InputError("a target ratio, bytes/token or KL budget needs calibration; drop --no-calibrate")
        return target.check(), None
    if calibrate and preset in PRESET_RATIOS:
        presets.apply(preset, *given)  # the clash check of a preset: it excludes every tier option
        return CalibrationTarget(preset=preset).check(), None
    return None, preset


def parse_ratio(text):
    """'3x', '3', '4.5x' -> 3.0, 4.5 (the CLI's --target-ratio).

    Raises:
        InputError: not a number, optionally followed by x.
    """
    try:
        return float(str(text).strip().lower().removesuffix("x"))
    except ValueError:
        raise InputError(f"target ratio {text!r} is not a number like 3x") from None


class CalibrationFallbackWarning(UserWarning):
    """A budget preset was built with its fixed recipe because calibration cannot measure the model."""


def checked_model(model, target):
    """Before the prefill: None if calibration can measure `model` (by the walk or by its own forwards), else the
    reason (str) for a budget preset's fixed recipe.

    Raises:
        CalibrationUnsupportedError: a model calibration cannot measure, for a budget that is not a preset (a
            target ratio, bytes/token or KL bound has no fixed recipe).
    """
    try:
        measure.check_plain(make_prompt_cache(model))
    except CalibrationUnsupportedError as e:
        if target.preset is None:
            raise CalibrationUnsupportedError(f"{e}; build with --preset, a tier or --schema") from None
        return str(e)
    return None


def parts_of(windows):
    """(layers that store every token, window layers) of per-layer windows (None: every token stored)."""
    return [j for j, w in enumerate(windows) if w is None], [j for j, w in enumerate(windows) if w is not None]


def least_bytes_per_token(n_layers, shapes, tiers):
    """Bytes/token of `n_layers` layers with each side in the smallest of `tiers` (one tier: that tier's schema).

    Args:
        shapes (dict): "k"/"v" -> (n_kv_heads, head_dim). tiers (tuple[str]): tier names.
    """
    return n_layers * sum(min(TIERS[t].bytes_per_token(*shapes[s]) for t in tiers) for s in ("k", "v"))


def check_reachable(target, plans):
    """Before the prefill: refuse a byte budget below the cheapest schema the search could choose (every layer-side
    in its smallest candidate tier), in the words `search.choose_parts` would use after the measurement.

    Args:
        target (CalibrationTarget): checked. plans (list[LayerPlan]): the probe's layers (attention, dense and window layers
            of one K/V shape, as calibration measures them; other plans are left to `checked_model`'s fallback).

    Raises:
        InputError: a part's bytes/token bound is below its cheapest schema's.
    """
    if not plans or any(p.kind not in ("attention", "dense", "window") for p in plans):
        return
    shapes = {"k": plans[0].k_shape, "v": plans[0].v_shape}
    parts = parts_of([p.window if p.kind == "window" else None for p in plans])
    bounds = target.bounds([least_bytes_per_token(len(part), shapes, ("fp16",)) for part in parts])
    if bounds is None:
        return
    try:
        candidates = ("fp16", *fitting(shapes))
    except CalibrationUnsupportedError:  # a preset then takes its fixed recipe after the prefill
        return
    for part, bound, what in zip(parts, bounds, ("", search.WINDOW_PART)):
        least = least_bytes_per_token(len(part), shapes, candidates)
        if part and bound < least:
            raise InputError(f"budget {bound} bytes/token{what} is below the cheapest measured schema "
                             f"({least} bytes/token)")


# Heavy hitters kept in fp16 are measured and recorded, but not chosen by default: extend and compose take
# cartridges without protected tokens only (spec 4.6), and a preset's cartridge must take both.
PROTECT_HEAVY_HITTERS = False


def schema_or_fallback(lm, mode, caches, tokens, target, plans, reason=None, progress=None, held=None):
    """The measured schema within `target`, or for a budget preset calibration cannot measure its fixed
    recipe (`cartridge.tiers.presets`; a CalibrationFallbackWarning says so).

    Args:
        lm, mode, caches, tokens, target, progress, held: as `calibrated_schema` takes them.
        plans (list[LayerPlan]): the layers' kinds and shapes. reason (str | None): `checked_model`'s.

    Returns:
        tuple: (schema list[dict], (first, last) protected tokens before clamping, record dict | None:
        the `cartridge.calibration` header value, None when nothing was measured).

    Raises:
        CalibrationUnsupportedError: as `checked_model`, found after the prefill (the family's own forward
            differs from calibration's walk). InputError: a budget below every candidate schema.
    """
    if reason is None:
        try:
            schema, record, first = calibrated_schema(lm, mode, caches, tokens, target, progress, held)
            return schema, (first, 0), record
        except CalibrationUnsupportedError as e:
            if target.preset is None:
                raise CalibrationUnsupportedError(f"{e}; build with --preset, a tier or --schema") from None
            reason = str(e)
    recipe = presets.resolve(target.preset)
    warnings.warn(CalibrationFallbackWarning(f"{reason}: preset {target.preset} is built with its fixed recipe "
                                             f"(K {recipe['k_tier']}, V {recipe['v_tier']}), not measured"),
                  stacklevel=2)
    schema = schema_for(len(plans), "fp16", recipe["k_tier"], recipe["v_tier"])
    return schema, (recipe["protect_first"], recipe["protect_last"]), None


def calibrated_schema(lm, mode, caches, tokens, target, progress=None, held=None):
    """Measure this document's sensitivity and choose the schema (and protected first tokens) within `target`.

    Args:
        lm (LoadedModel). mode (str): prompt mode. caches (list): the filled prefill caches (KVCache, and
            RotatingKVCache for sliding-window layers). tokens (list[int]): the prefix tokens.
        target (CalibrationTarget): checked. progress (callable | None): progress(done, total) over the layers of the
            measurement. held (dict | None): the window layers' K/V at the measurement's split
            (`hold_windows`), when the prefill went on past it. Default: None.

    Returns:
        tuple: (schema list[dict], record dict: the `cartridge.calibration` header value, N int: leading
        tokens to protect in fp16, 0 when protecting the heavy hitters did not win).

    Raises:
        CalibrationUnsupportedError: a model calibration cannot measure. InputError: a budget below every
            candidate schema.
    """
    measure.check_plain(caches)
    k, v = caches[0].keys, caches[0].values
    shapes = {"k": (k.shape[1], k.shape[3]), "v": (v.shape[1], v.shape[3])}
    candidates = fitting(shapes)
    args = (lm.tokenizer, mode, caches, tokens, candidates, progress, held)
    try:
        sens, method = measure.measure(lm.model, *args), "walk"
    except CalibrationUnsupportedError:  # a family the walk cannot run: the model's own forwards
        sens, method = forwards.measure(lm.model, *args), "forwards"
    parts = parts_of(sens.probe.windows)
    fp16 = [least_bytes_per_token(len(part), shapes, ("fp16",)) for part in parts]
    windows = [min(len(tokens), w) for w in sens.probe.windows if w]
    stored = (len(tokens), max(windows, default=0))  # tokens a layer of each part keeps
    first, choices = _best(sens, parts, shapes, target.bounds(fp16), target.max_kl, stored)
    schema = sorted(choices[0].schema + choices[1].schema, key=lambda r: r["layer"])
    kl, agree = measure.verify(lm.model, sens.probe, schema, first)
    record = {"target": target.record(), "bytes_per_token": choices[0].bytes_per_token, "fp16_bytes_per_token": fp16[0],
              "window_bytes_per_token": choices[1].bytes_per_token, "fp16_window_bytes_per_token": fp16[1],
              "predicted_kl": round(_kl(choices), 6), "measured_kl": round(kl, 6),
              "top1_agreement": round(agree, 4), "protect_first": first,
              "heavy_hitters": {"first": sens.protect_first, "attention_share": round(sens.lead_mass, 4)},
              "eval_tokens": sens.eval_tokens, "probe": _probes(), "measured_layers": len(caches),
              "window_layers": parts[1], "method": method, "calibration_version": CALIBRATION_VERSION,
              "candidates": ["fp16", *candidates], "reference_tier": measure.REFERENCE_TIER,
              "forwards": sens.forwards + 1, "seconds": round(sens.seconds, 2)}
    return schema, record, first


def _probes():
    """The record's "probe": the probe question, or the list of them when E asks several."""
    probes = measure.sequence.PROBES
    return probes[0] if len(probes) == 1 else list(probes)


def fitting(shapes):
    """The candidate tiers that can store both sides' (n_kv_heads, head_dim) `shapes`.

    Raises:
        CalibrationUnsupportedError: the reference tier cannot (the measurement runs it).
    """
    def fits(name):
        try:
            for shape in shapes.values():
                TIERS[name].check(*shape)
        except InputError:
            return False
        return True

    candidates = tuple(t for t in measure.CANDIDATES if fits(t))
    if measure.REFERENCE_TIER not in candidates:
        raise CalibrationUnsupportedError(f"calibration's reference tier {measure.REFERENCE_TIER} cannot store "
                                          f"K/V of {shapes['k']} / {shapes['v']} (kv heads, head_dim)")
    return candidates


def _best(sens, parts, shapes, bounds, max_kl, tokens, protect_heavy_hitters=None):
    """(N, [Choice per part]): the better of no protection and the measured heavy hitters kept in fp16 in the
    layers that store every token (their bytes taken from that part's budget; its Choice's bytes_per_token
    includes the copies). With `protect_heavy_hitters` False (default: `PROTECT_HEAVY_HITTERS`), no protection.

    Args:
        parts, bounds, tokens: as `search.choose_parts` takes them. max_kl (float | None): the KL bound.
    """
    plain = search.choose_parts(sens.kl, parts, shapes, bounds, max_kl, tokens)
    n = sens.protect_first
    if not n or not parts[0] or not (PROTECT_HEAVY_HITTERS if protect_heavy_hitters is None else protect_heavy_hitters):
        return 0, plain
    extra = protect.bytes_per_token(n, 0, tokens[0], [shapes[s] for _ in parts[0] for s in ("k", "v")])
    try:
        kept = search.choose_parts(sens.kl_protected, parts, shapes,
                                   None if bounds is None else [bounds[0] - extra, *bounds[1:]], max_kl, tokens)
    except InputError:  # the copies leave too little of the budget
        return 0, plain
    kept[0] = search.Choice(kept[0].schema, kept[0].bytes_per_token + extra, kept[0].predicted_kl)
    wins = (_kl(kept) < _kl(plain) if bounds is not None else
            _stored_bytes(kept, tokens) < _stored_bytes(plain, tokens))
    return (n, kept) if wins else (0, plain)


def _kl(choices):
    return sum(c.predicted_kl for c in choices)


def _stored_bytes(choices, tokens):
    return sum(c.bytes_per_token * t for c, t in zip(choices, tokens))
