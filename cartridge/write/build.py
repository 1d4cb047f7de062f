"""Prefill a document through a model once and write its K/V as a cartridge.

    text -> chat-template prefix tokens, checked options and schema (`options`)
         -> chunked prefill (`prefill`: mlx-lm model, mlx-lm KVCache)
         -> per (layer, side) tier codec -> pages -> container, atomic (`encode`)
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

from .. import calibrate as calibrate_mod
from ..calibrate import outputs, queries
from ..format import keys as K
from ..format.writer import check_output_path, check_space
from ..models.loader import LoadedModel, load_model
from ..models.prompt import check_text
from ..storage.kinds import KINDS
from ..storage.store import check_layer_tiers
from ..tiers import DEFAULT_TIER, get_tier, protect, score_aware
from .encode import header_extras, layers_bytes, write_layers
from .options import (DEFAULT_PAGE_SIZE, DEFAULT_RESERVE, check_encoders, check_options, fit_page_size,
                      probed_schema_and_tokens, resolve_encoders, resolve_options)
from .prefill import DEFAULT_PREFILL_STEP, prefill, prefill_holding


@dataclass
class BuildResult:
    """What `build` wrote.

    Attributes:
        path (str): the cartridge directory. tokens (int): prefix tokens.
        prefill_seconds (float), seconds (float): prefill time and total time (prefill + encode + write).
        bytes (int): total bytes on disk. bytes_per_token (int): K+V payload bytes per token.
        schema (list[dict]): the tier of every (layer, side): [{"layer": i, "k": tier, "v": tier}].
        context_left (int | None): tokens of the model's context left after the document (None if the
            model does not say).
        calibration (dict | None): the `cartridge.calibration` record of a measured schema, else None.
        prompt_mode (str | None): "chat_template" or "plain" (spec/FORMAT.md 5.4). Default: None (not said).
    """

    path: str
    tokens: int
    prefill_seconds: float
    seconds: float
    bytes: int
    bytes_per_token: int
    schema: list = field(default_factory=list)
    context_left: int | None = None
    calibration: dict | None = None
    prompt_mode: str | None = None

    @property
    def tokens_per_second(self):
        """Prefill throughput in tokens per second."""
        return self.tokens / self.prefill_seconds if self.prefill_seconds else float("inf")


def build(document, output, model=None, tier=DEFAULT_TIER, k_tier=None, v_tier=None, boundary_protect=0,
          schema=None, page_size=DEFAULT_PAGE_SIZE, prefill_step=DEFAULT_PREFILL_STEP, force=False,
          progress=None, source_name=None, reserve=DEFAULT_RESERVE, system=None, protect_first=0, protect_last=0,
          preset=None, budget=None, calibrate=True, calibration_progress=None, k_encoder=None, k_scale=None,
          v_encoder=None):
    """Prefill `document` and write a cartridge to `output`.

    Args:
        document (str): the corpus text.
        output (str | Path): cartridge directory to create.
        model (str | LoadedModel | None): model reference ("default", GGUF path, mlx-lm directory) or
            a model from `cartridge.load_model`. Default: None ("default").
        tier (str): tier of every (layer, side) when `schema` is None. Default: "fp16".
        k_tier, v_tier (str | None): the tier of one side, overriding `tier`. Default: None.
        boundary_protect (int): N > 0 keeps K fp16 on every layer and V fp16 on the first N and last
            N layers (the chosen tier elsewhere). Default: 0.
        schema (list[dict] | str | Path | None): per layer {"layer": i, "k": tier, "v": tier}, or a
            JSON file of that list; excludes the four options above. Default: None.
        page_size (int): tokens per page; one far beyond the document is lowered (`fit_page_size`).
            Default: 256.
        prefill_step (int): tokens per forward pass. Default: 512.
        force (bool): replace an existing cartridge at `output`. Default: False.
        progress (callable | None): progress(done_tokens, total_tokens) during prefill, from 0.
        source_name (str | None): the file the document came from, recorded (its last component)
            with the document's size, SHA-256 and first line (spec/FORMAT.md 4.2). Default: None.
        reserve (int): warn (`ContextWarning`) when fewer tokens than this are left of the model's
            context after the document. Default: 256.
        system (str | None): a system message, rendered before the document where the chat template
            puts it and recorded (`prompt.system`, spec/FORMAT.md 5.4); questions and conversations are
            then answered under it. Default: None (the template's own default, if any).
        protect_first, protect_last (int): also keep the first N / last M prefix tokens of every
            (layer, side) of the layers that store every token in fp16 (`cartridge.tiers.protect`, format
            1.5); clamped to leave one token. Default: 0.
        preset (str | None): "exact", "safe", "balanced" or "compact"; excludes the tier and protection
            options. With `calibrate`, safe/balanced/compact are byte budgets (1/2, 1/3, 1/4.5 of fp16's
            bytes/token) filled by measurement (`cartridge.calibrate`); without, the fixed recipes of
            `cartridge.tiers.presets`. Default: None.
        budget (cartridge.calibrate.CalibrationTarget | None): a target ratio, bytes/token or KL bound for a
            measured schema; excludes `preset` and the tier options. Default: None.
        calibrate (bool): measure budget presets on the document (False: today's fixed recipes, no
            extra cost; a `budget` then is refused). Default: True.
        calibration_progress (callable | None): progress(done, total) over the layers of the measurement.
        k_encoder (str | None): "nearest" (each K element rounded to its nearest code) or "score" (K's codes chosen
            for the score error under the second moment of the document's own queries, gathered during the
            prefill: `cartridge.tiers.score_aware`; the calibration measures the tiers so encoded; same format).
            None: "score" for a calibrated `balanced` or `compact` preset, else "nearest" (`options.resolve_encoders`).
        k_scale (bool | None): store each attention layer's K divided by a per-channel scale chosen from the
            document's keys and queries, the queries multiplied by it when attending (`cartridge.tiers.key_scale`;
            format 1.11: a reader before it refuses the cartridge).
            None: True for a calibrated `balanced` or `compact` preset, else False.
        v_encoder (str | None): "nearest", or "output": V's codes chosen for the attention output's error through
            the model's o_proj (`cartridge.calibrate.outputs`; same format). None: "nearest".

    Returns:
        BuildResult

    Raises:
        InputError: empty corpus, unknown tier, a tier that cannot store the model's K/V shape, a bad
            schema, corpus longer than the model's context, bad options, a system message for a model
            without a chat template; all before any prefill.
        OutputExistsError: `output` exists and `force` is False.
        WriteError: the output's file system has less free space than the cartridge needs (checked
            before prefill), or a write failed.
        ModelLoadError: the model cannot be loaded.
        CalibrationUnsupportedError: a target ratio, bytes/token or KL `budget` for a model calibration
            cannot measure (a budget preset is then built with its fixed recipe, with a
            CalibrationFallbackWarning).

    Example:
        >>> import cartridge
        >>> r = cartridge.build(open("samples/gpl-2.0.txt").read(), "gpl.cart")  # doctest: +SKIP
        >>> r = cartridge.build(text, "q.cart", tier="mlx4g32", boundary_protect=2)  # doctest: +SKIP
    """
    check_output_path(output, force)  # before any expensive work
    check_encoders(k_encoder, k_scale, v_encoder)
    target, options, protected, named = resolve_options(preset, budget, calibrate, tier, k_tier, v_tier,
                                                        boundary_protect, schema, protect_first, protect_last)
    check_options(document, options, page_size, prefill_step, reserve)
    if system is not None:
        check_text(system, "the system message")
    lm = model if isinstance(model, LoadedModel) else load_model(model)
    declined = None if target is None else calibrate_mod.checked_model(lm.model, target)
    k_encoder, k_scale, v_encoder = resolve_encoders(preset if target is not None and declined is None else None,
                                                     k_encoder, k_scale, v_encoder)
    schema, plans, mode, tokens, left = probed_schema_and_tokens(document, lm, options, reserve, system, page_size)
    page_size = fit_page_size(page_size, len(tokens))
    if target is not None and declined is None:
        calibrate_mod.check_reachable(target, plans)
    check_space(output, layers_bytes(schema, plans, len(tokens), page_size))

    t0 = time.perf_counter()
    holds = target is not None and declined is None and any(p.kind == "window" for p in plans)
    moments, watch = queries.collecting() if k_encoder == "score" or k_scale else (None, nullcontext())
    with watch:
        caches, held = prefill_holding(lm.model, tokens, prefill_step, progress) if holds else \
            (prefill(lm.model, tokens, prefill_step, progress), None)
    t1 = time.perf_counter()
    extras = header_extras(document, source_name, system) | named
    if (k_encoder, v_encoder) != ("nearest", "nearest"):  # absent: nearest rounding (format 1.11, informational)
        extras[K.ENCODERS] = {"k": k_encoder, "v": v_encoder}
    weights, scales = encoding_weights(lm.model, caches, plans, moments, k_encoder, k_scale, v_encoder)
    with score_aware.weighting(weights, scales):  # the calibration measures what is written
        path, schema, kept = measure_and_write(output, lm, mode, tokens, caches, schema, plans, page_size, force,
                                               extras, protected, (target, declined, calibration_progress), held)
    result = build_result(path, tokens, t1 - t0, time.perf_counter() - t0, schema, plans, left, kept)
    result.calibration = extras.get(K.CALIBRATION)
    result.prompt_mode = mode
    return result


def encoding_weights(model, caches, plans, moments, k_encoder, k_scale, v_encoder):
    """The weights and K scales `score_aware.weighting` encodes under (issue 49).

    Args:
        model: the mlx-lm model. caches (list): the prefill's caches. plans (list[LayerPlan]): the layers.
        moments (QueryMoments | None): the queries seen during the prefill (with "score" or `k_scale`).
        k_encoder, k_scale, v_encoder: as `build` takes them.

    Returns:
        tuple: ((layer, side) -> weight, layer -> K scale), each {} where nothing asks for it.
    """
    kinds = [p.kind for p in plans]
    seen = moments.weights(caches) if moments is not None else {}
    weights = dict(seen) if k_encoder == "score" else {}
    if v_encoder == "output":
        weights |= outputs.output_weights(model, kinds, [p.v_shape for p in plans])
    return weights, queries.key_scales(seen, caches, kinds) if k_scale else {}


def measure_and_write(output, lm, mode, tokens, caches, schema, plans, page_size, force, extras, protected,
                      calibration=(None, None, None), held=None):
    """Measure the schema where a calibration target asks for it (`calibrate.schema_or_fallback`), then `write_layers`.

    Args:
        output, lm, mode, tokens, caches, schema, plans, page_size, force: as `write_layers` takes them;
            `caches` is a list (it is emptied layer by layer as each is written).
        extras (dict): more header keys (`write_layers`'s `source`); a measured schema adds its record.
        protected (tuple): (first, last) tokens to keep in fp16, before clamping.
        calibration (tuple): (target CalibrationTarget | None, `calibrate.checked_model`'s reason, progress callable).
        held (dict | None): window layers' K/V held at calibration's split (`prefill_holding`). Default: None.

    Returns:
        tuple: (Path of the cartridge, the schema written, (first, last) protected tokens as clamped).
    """
    target, declined, progress = calibration
    if target is not None:
        schema, protected, record = calibrate_mod.schema_or_fallback(lm, mode, caches, tokens, target, plans,
                                                                     declined, progress, held)
        extras.update({} if record is None else {K.CALIBRATION: record})
        check_layer_tiers(plans, schema)
    kept = protect.clamp(*protected, len(tokens))
    path = write_layers(output, lm, tokens, _drain(caches), schema, plans, page_size, mode, force, extras, kept)
    return path, schema, kept


def _drain(caches):
    for layer, cache in enumerate(caches):
        caches[layer] = None  # free this layer's dense K/V before encoding the next
        yield cache


def build_result(path, tokens, prefill_seconds, seconds, schema, plans, context_left=None, kept=(0, 0)):
    """The BuildResult of a written cartridge (sizes read from disk); bytes per token of the layers
    that store every token, with the fp16 copies of `kept` (N, M) protected tokens spread over them."""
    total = sum(f.stat().st_size for f in path.iterdir())
    bpt = sum(get_tier(r[s]).bytes_per_token(*getattr(u, f"{s}_shape")) for p, r in zip(plans, schema)
              for u in p.units() if KINDS[u.kind].stores_every_token for s in ("k", "v"))
    shapes = [getattr(p, f"{s}_shape") for p in plans if KINDS[p.kind].stores_every_token for s in ("k", "v")]
    bpt += protect.bytes_per_token(*kept, len(tokens), shapes)
    return BuildResult(str(path), len(tokens), prefill_seconds, seconds, total, bpt, schema, context_left)
