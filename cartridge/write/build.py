"""Prefill a document through a model once and write its K/V as a cartridge.

    text -> chat-template prefix tokens -> chunked prefill (mlx-lm model, mlx-lm KVCache)
         -> per (layer, side) tier codec -> pages -> container (atomic)
"""

import inspect
import time
import warnings
from contextlib import nullcontext
from types import SimpleNamespace
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .. import calibrate as calibrate_mod
from ..calibrate import queries
from ..storage.kinds import KINDS, LayerPlan
from ..storage.store import check_layer_tiers
from ..errors import InputError
from ..format import keys as K
from ..format.layout import FORMAT_MAJOR, FORMAT_MINOR
from ..format.source import source_keys
from ..format.writer import CartridgeWriter, check_output_path, check_space
from ..models.families import plan_layers
from ..models.loader import LoadedModel, architecture_config, load_model
from ..models.prompt import SEPARATOR, check_text, prefix_tokens, prompt_mode
from ..tiers import DEFAULT_TIER, check_schema, get_tier, presets, protect, read_tier_options, schema_for
from ..tiers import score_aware

DEFAULT_PAGE_SIZE = 256
DEFAULT_PREFILL_STEP = 512
DEFAULT_RESERVE = 256  # tokens a build leaves free for questions and answers before it warns
K_ENCODERS = ("nearest", "score")  # how K's codes are chosen (`cartridge.tiers.score_aware`)


class ContextWarning(UserWarning):
    """The document leaves fewer than `reserve` tokens of the model's context for questions."""


class PageSizeWarning(UserWarning):
    """A page size far beyond the document was lowered to what the document needs (`fit_page_size`)."""


def fit_page_size(page_size, n_tokens):
    """The page size a build of `n_tokens` writes: `page_size`, or less where one page would be mostly padding.

    A page size above both the default (256) and the document is lowered to the smallest power of two
    >= max(n_tokens, 256), with a PageSizeWarning: the padded last page (spec/FORMAT.md 3.1) would
    otherwise make the file bytes of `page_size` tokens per (layer, side). Powers of two >= 256 are
    whole token groups of every tier (kivi4's 32).

    Returns:
        int: tokens per page.
    """
    fitted = max(DEFAULT_PAGE_SIZE, 1 << max(0, n_tokens - 1).bit_length())
    if page_size <= fitted:
        return page_size
    warnings.warn(PageSizeWarning(f"page size {page_size} is larger than the document ({n_tokens} tokens); "
                                  f"writing pages of {fitted} tokens"), stacklevel=3)
    return fitted


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


def context_length(model):
    """The model's context length in tokens (max_position_embeddings), or None if it does not say."""
    return getattr(getattr(model, "args", None), "max_position_embeddings", None)


def prefill(model, tokens, step=DEFAULT_PREFILL_STEP, progress=None, caches=None):
    """Run `tokens` through the model in chunks and return the filled mlx-lm caches.

    Args:
        model (nn.Module): mlx-lm model. tokens (list[int]): prompt tokens.
        step (int): tokens per forward pass. Default: 512.
        progress (callable | None): called as progress(done_tokens, total_tokens) once with 0 before
            the first chunk and after each chunk.
        caches (list | None): caches to continue (e.g. a cartridge's `prompt_cache()`, for extend);
            None makes fresh mlx-lm caches. Default: None.

    Returns:
        list: mlx-lm's cache objects (`make_prompt_cache`), one per cache layer, filled (or `caches`,
        filled further). Check the model's cache kinds first (`cartridge.models.families.plan_layers`).
    """
    return _feed(model, tokens, step, progress, make_prompt_cache(model) if caches is None else caches)


def prefill_holding(model, tokens, step=DEFAULT_PREFILL_STEP, progress=None):
    """`prefill` that stops once at calibration's split (`calibrate.split_of`) to keep what the sliding-window
    layers store there (`calibrate.hold_windows`): calibration measures a cartridge of the tokens before it.

    Returns:
        tuple: (the filled caches, {layer: (K, V)} of the window layers at the split).
    """
    split = calibrate_mod.split_of(tokens)
    caches = prefill(model, tokens[:split], step, progress and (lambda done, _: progress(done, len(tokens))))
    held = calibrate_mod.hold_windows(caches)
    rest = progress and (lambda done, _: progress(split + done, len(tokens)))
    return prefill(model, tokens[split:], step, rest, caches), held


def _feed(model, tokens, step, progress, caches):
    body = getattr(model, "model", model)  # the transformer without the LM head: its logits are not needed
    if body is not model and "cache" not in inspect.signature(body.__call__).parameters:
        body = model
    ids = mx.array(tokens, dtype=mx.uint32)
    if progress:
        progress(0, len(tokens))  # before the first chunk, so a progress bar's clock starts with the prefill
    for start in range(0, len(tokens), step):
        body(ids[None, start:start + step], cache=caches)
        mx.eval([c.state for c in caches])
        if progress:
            progress(min(start + step, len(tokens)), len(tokens))
    return caches


def tier_keys(schema, params, head_dim):
    """The layer.{i}.{k,v}.* header keys (tier, codec version, params, components) of a schema."""
    header = {}
    for row in schema:
        for side in ("k", "v"):
            codec = get_tier(row[side])
            header[K.layer_tier(row["layer"], side)] = codec.name
            header[K.layer_codec_version(row["layer"], side)] = codec.codec_version
            header[K.layer_params(row["layer"], side)] = params[(row["layer"], side)]
            header[K.layer_components(row["layer"], side)] = [
                {"name": c.name, "dtype": c.dtype, "width": c.width} for c in codec.components(head_dim)
            ]
    return header


def _header(lm, tokens, plans, records, page_size, mode, source_dtype, source):
    n_kv, head_dim = next((u.k_shape for p in plans for u in p.units() if u.k_shape), (1, 1))  # pre-1.4 readers
    header = {
        K.FORMAT_MAJOR: FORMAT_MAJOR,
        K.FORMAT_MINOR: FORMAT_MINOR,
        K.WRITER: "cartridge 0.1.0",
        K.MODEL_REF: lm.ref,
        K.MODEL_FINGERPRINT: lm.fingerprint,
        K.MODEL_CONFIG: architecture_config(lm.model),
        K.PROMPT_MODE: mode,
        K.PROMPT_SEPARATOR: SEPARATOR,
        K.TOKENS_COUNT: len(tokens),
        K.N_LAYERS: len(plans),
        K.N_KV_HEADS: n_kv,
        K.HEAD_DIM: head_dim,
        K.PAGE_SIZE: page_size,
        K.N_PAGES: -(-len(tokens) // page_size),
        K.SOURCE_DTYPE: source_dtype,
        K.ROPE: "post",
        **source,
        **hub_keys(lm),
    }
    header.update(records)
    return header


def hub_keys(lm):
    """model.repo_id and model.revision (format 1.10) of a model resolved from the Hugging Face hub, else none."""
    hub = getattr(lm, "hub", None)
    if hub is None:
        return {}
    return {K.MODEL_REPO_ID: hub.repo_id, **({} if hub.revision is None else {K.MODEL_REVISION: hub.revision})}


def cartridge_bytes(schema, n_kv_heads, head_dim, n_tokens, page_size):
    """Bytes a cartridge of this schema takes on disk, within one 16 KiB alignment per extent.

    Returns:
        int: page payloads (bytes/token of every (layer, side) x padded tokens), alignment, page
        tables, token ids and 1 MiB for the index's own structure and the manifest.
    """
    return layers_bytes(schema, attention_plans((len(schema), n_kv_heads, head_dim)), n_tokens, page_size)


def layers_bytes(schema, plans, n_tokens, page_size):
    """`cartridge_bytes` of layers of any kind (`LayerPlan`s): a window layer's pages hold its last
    `window` tokens, a state layer's arrays one page each, a list layer's caches each as its kind."""
    return 4 * n_tokens + (1 << 20) + sum(KINDS[p.kind].planned_bytes(p, row, n_tokens, page_size) for p, row in zip(plans, schema))


def attention_plans(geometry):
    """One "attention" `LayerPlan` per layer of a model of `geometry` (n_layers, n_kv_heads, head_dim)."""
    n_layers, n_kv, head_dim = geometry
    return [LayerPlan("attention", (n_kv, head_dim), (n_kv, head_dim)) for _ in range(n_layers)]


def _check_context(lm, tokens, reserve):
    """Refuse a document that does not fit the context; warn when fewer than `reserve` tokens are left."""
    limit = context_length(lm.model)
    if not limit:
        return None
    if len(tokens) >= limit:
        raise InputError(f"the corpus is {len(tokens)} tokens; the model's context is {limit} tokens")
    return warn_context_left(len(tokens), limit, reserve, stacklevel=5)  # this, _check_context, plan, build


def warn_context_left(n_tokens, limit, reserve, stacklevel=2):
    """Warn (`ContextWarning`) when a document of `n_tokens` leaves fewer than `reserve` tokens of the
    model's `limit`-token context for questions; returns the tokens left. `stacklevel` as warnings.warn's."""
    left = limit - n_tokens
    if left < reserve:
        warnings.warn(f"the document is {n_tokens:,} tokens of the model's {limit:,}-token context: only "
                      f"{left:,} are left for each question and its answer (reserve {reserve})",
                      ContextWarning, stacklevel=stacklevel)
    return left


def _whole_tokens(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an integer number of tokens, got {value!r}")


MAX_PREFILL_STEP = 2**31 - 1  # MLX slices take 32-bit indices


def check_prefill_step(prefill_step):
    """Raise InputError unless `prefill_step` is a whole number of tokens >= 1 (build and extend)."""
    _whole_tokens("prefill step", prefill_step)
    if not 1 <= prefill_step <= MAX_PREFILL_STEP:
        raise InputError(f"prefill step {prefill_step} must be 1 to {MAX_PREFILL_STEP:,} tokens")


def _check_options(page_size, prefill_step, reserve=0):
    _whole_tokens("page size", page_size)
    if not 1 <= page_size <= 1 << 16:
        raise InputError(f"page size {page_size} tokens is out of range 1..65536")
    check_prefill_step(prefill_step)
    check_reserve(reserve)


def check_reserve(reserve):
    """Refuse a `reserve` (tokens to leave for questions) that is not a whole number >= 0."""
    if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
        raise InputError(f"reserve is {reserve!r}; it must be an integer number of tokens >= 0")


def check_options(document, options, page_size, prefill_step, reserve=0):
    """The checks that need no model: corpus text, page size, prefill step, tier options.

    Args:
        options (tuple): (tier, k_tier, v_tier, boundary_protect, schema) as `build` takes them.

    Raises:
        InputError: as `build` describes.
    """
    check_text(document, "the corpus")
    _check_options(page_size, prefill_step, reserve)
    read_tier_options(*options)


def plan(document, lm, geometry, options, reserve=0, system=None, page_size=DEFAULT_PAGE_SIZE):
    """Resolve the schema and tokenize the document for a model of `geometry` (n_layers, n_kv_heads, head_dim).

    Returns:
        tuple: (schema list[dict], prompt mode str, tokens list[int], context tokens left int | None).

    Raises:
        InputError: a bad schema or tier for this geometry, or a corpus longer than the model's context.
    """
    tier, k_tier, v_tier, boundary_protect, _ = options
    schema = read_tier_options(*options) or schema_for(geometry[0], tier, k_tier, v_tier, boundary_protect)
    check_schema(schema, *geometry)
    check_page_size(schema, page_size)
    mode = prompt_mode(lm.tokenizer)
    tokens = prefix_tokens(lm.tokenizer, document, mode, system=system)
    return schema, mode, tokens, _check_context(lm, tokens, reserve)


def probe_plan(document, lm, options, reserve=0, system=None, page_size=DEFAULT_PAGE_SIZE):
    """Like `plan`, with each layer's cache kind and K/V shapes probed from the model itself.

    Returns:
        tuple: (schema list[dict], plans list[LayerPlan], prompt mode str, tokens list[int],
        context tokens left int | None).

    Raises:
        InputError: a cache kind a cartridge cannot store (`plan_layers`), a tier that cannot store a
            layer's shape, a bad schema, or a corpus longer than the model's context; before any prefill.
    """
    mode = prompt_mode(lm.tokenizer)
    tokens = prefix_tokens(lm.tokenizer, document, mode, system=system)
    left = _check_context(lm, tokens, reserve)
    plans = plan_layers(lm.model, tokens)  # shapes and cache kinds from the model itself; refuses before prefill
    return layers_schema(plans, options, page_size), plans, mode, tokens, left


def layers_schema(plans, options, page_size):
    """The schema of the tier `options` (tier, k_tier, v_tier, boundary_protect, schema) for layers of `plans`.

    Raises:
        InputError: a bad schema, a tier that cannot store a layer's shape, or a page size a tier cannot fill.
    """
    tier, k_tier, v_tier, boundary_protect, _ = options
    schema = read_tier_options(*options) or schema_for(len(plans), tier, k_tier, v_tier, boundary_protect)
    check_layer_tiers(plans, schema)
    check_page_size(schema, page_size)
    return schema


def check_page_size(schema, page_size):
    """Refuse a page size a tier with token-axis groups (kivi4) cannot fill with whole groups.

    Raises:
        InputError: naming the tier, the page size and its token group.
    """
    for name in sorted({r[s] for r in schema for s in ("k", "v")}):
        check = getattr(get_tier(name), "check_page_size", None)
        if check:
            check(page_size)


def build(document, output, model=None, tier=DEFAULT_TIER, k_tier=None, v_tier=None, boundary_protect=0,
          schema=None, page_size=DEFAULT_PAGE_SIZE, prefill_step=DEFAULT_PREFILL_STEP, force=False,
          progress=None, source_name=None, reserve=DEFAULT_RESERVE, system=None, protect_first=0, protect_last=0,
          preset=None, budget=None, calibrate=True, calibration_progress=None, k_encoder="nearest"):
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
        budget (cartridge.calibrate.Budget | None): a target ratio, bytes/token or KL bound for a
            measured schema; excludes `preset` and the tier options. Default: None.
        calibrate (bool): measure budget presets on the document (False: today's fixed recipes, no
            extra cost; a `budget` then is refused). Default: True.
        calibration_progress (callable | None): progress(done, total) over the layers of the measurement.
        k_encoder (str): "nearest" (each K element rounded to its nearest code) or "score" (K's codes chosen for
            the score error under the second moment of the document's own queries, gathered during the prefill:
            `cartridge.tiers.score_aware`; the calibration measures the tiers so encoded). The stored format is
            the same. Default: "nearest".

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
    check_k_encoder(k_encoder)
    budget, options, protected, named = resolve_options(preset, budget, calibrate, tier, k_tier, v_tier,
                                                        boundary_protect, schema, protect_first, protect_last)
    check_options(document, options, page_size, prefill_step, reserve)
    if system is not None:
        check_text(system, "the system message")
    lm = model if isinstance(model, LoadedModel) else load_model(model)
    declined = None if budget is None else calibrate_mod.checked_model(lm.model, budget)
    schema, plans, mode, tokens, left = probe_plan(document, lm, options, reserve, system, page_size)
    page_size = fit_page_size(page_size, len(tokens))
    if budget is not None and declined is None:
        calibrate_mod.check_reachable(budget, plans)
    check_space(output, layers_bytes(schema, plans, len(tokens), page_size))

    t0 = time.perf_counter()
    holds = budget is not None and declined is None and any(p.kind == "window" for p in plans)
    moments, watch = queries.collecting() if k_encoder == "score" else (None, nullcontext())
    with watch:
        caches, held = prefill_holding(lm.model, tokens, prefill_step, progress) if holds else \
            (prefill(lm.model, tokens, prefill_step, progress), None)
    t1 = time.perf_counter()
    extras = header_extras(document, source_name, system) | named
    with score_aware.weighting(moments and moments.weights(caches)):  # the calibration measures what is written
        path, schema, kept = measure_and_write(output, lm, mode, tokens, caches, schema, plans, page_size, force,
                                               extras, protected, (budget, declined, calibration_progress), held)
    result = build_result(path, tokens, t1 - t0, time.perf_counter() - t0, schema, plans, left, kept)
    result.calibration = extras.get(K.CALIBRATION)
    result.prompt_mode = mode
    return result


def check_k_encoder(k_encoder):
    """Raise InputError unless `k_encoder` is one of K_ENCODERS."""
    if k_encoder not in K_ENCODERS:
        raise InputError(f"K encoder {k_encoder!r} is not one of {', '.join(K_ENCODERS)}")


def resolve_options(preset, budget, calibrate, tier, k_tier, v_tier, boundary_protect, schema, protect_first,
                    protect_last):
    """`build`'s tier, preset and budget options resolved (arguments as `build` takes them).

    Returns:
        tuple: (budget Budget | None (a budget preset included), options (tier, k_tier, v_tier, boundary_protect,
        schema), (protect_first, protect_last) before clamping, the `cartridge.preset` header key or {}).

    Raises:
        InputError: clashing options (a preset beside the options it sets, a budget without calibration).
    """
    named = {} if preset is None else {K.PRESET: preset}
    budget, preset = calibrate_mod.resolve_budget(preset, budget, calibrate, tier, k_tier, v_tier, boundary_protect,
                                                  schema, protect_first, protect_last)
    o = presets.apply(preset, tier, k_tier, v_tier, boundary_protect, schema, protect_first, protect_last)
    protect.check_counts(o["protect_first"], o["protect_last"])
    options = tuple(o[k] for k in ("tier", "k_tier", "v_tier", "boundary_protect", "schema"))
    return budget, options, (o["protect_first"], o["protect_last"]), named


def measure_and_write(output, lm, mode, tokens, caches, schema, plans, page_size, force, extras, protected,
                      calibration=(None, None, None), held=None):
    """Measure the schema where a budget asks for it (`calibrate.schema_or_fallback`), then `write_layers`.

    Args:
        output, lm, mode, tokens, caches, schema, plans, page_size, force: as `write_layers` takes them;
            `caches` is a list (it is emptied layer by layer as each is written).
        extras (dict): more header keys (`write_layers`'s `source`); a measured schema adds its record.
        protected (tuple): (first, last) tokens to keep in fp16, before clamping.
        calibration (tuple): (budget Budget | None, `calibrate.checked_model`'s reason, progress callable).
        held (dict | None): window layers' K/V held at calibration's split (`prefill_holding`). Default: None.

    Returns:
        tuple: (Path of the cartridge, the schema written, (first, last) protected tokens as clamped).
    """
    budget, declined, progress = calibration
    if budget is not None:
        schema, protected, record = calibrate_mod.schema_or_fallback(lm, mode, caches, tokens, budget, plans,
                                                                     declined, progress, held)
        extras.update({} if record is None else {K.CALIBRATION: record})
        check_layer_tiers(plans, schema)
    kept = protect.clamp(*protected, len(tokens))
    path = write_layers(output, lm, tokens, _drain(caches), schema, plans, page_size, mode, force, extras, kept)
    return path, schema, kept


def header_extras(document, source_name, system):
    """The optional header keys of a build: source.* (spec 4.5.1) and prompt.system (spec 5.4)."""
    return source_keys(document, source_name) | ({} if system is None else {K.PROMPT_SYSTEM: system})


def _drain(caches):
    for layer, cache in enumerate(caches):
        caches[layer] = None  # free this layer's dense K/V before encoding the next
        yield cache


def kv_caches(layers):
    """(keys, values) pairs, each (1, n_kv_heads, T, head_dim), as the cache objects `write_layers` takes."""
    for keys, values in layers:
        yield SimpleNamespace(keys=keys, values=values)


def write_layers(output, lm, tokens, caches, schema, plans, page_size, mode, force=False, source=None,
                 kept=(0, 0), open_writer=CartridgeWriter):
    """Encode every layer's K/V (or state) with its tiers and write the cartridge (atomic).

    Args:
        output (str | Path): cartridge directory to create.
        lm (LoadedModel): the model the K/V came from (ref, fingerprint and architecture are recorded).
        tokens (list[int]): the prefix tokens.
        caches (iterable): per layer in order, its filled mlx-lm cache (or `kv_caches` of (keys, values)).
        schema (list[dict]), plans (list[LayerPlan]): tiers and each layer's kind and shapes, already
            checked (`probe_plan`; `attention_plans` for a model of full-attention layers only).
        page_size (int): tokens per page. mode (str): the prompt mode.
        force (bool): replace an existing cartridge at `output`. Default: False.
        source (dict | None): more header keys: source.* (`format.source.source_keys`), prompt.system.
            Default: None.
        kept (tuple): (N, M) protected first and last tokens, already clamped (format 1.5). Default: (0, 0).
        open_writer (callable): makes the writer from (output, force); `cartridge.serve.shelf.Recorded` keeps
            the encoded pages for another thread to write. Default: CartridgeWriter.

    Returns:
        Path: the published cartridge directory (what the writer's `commit` returns).

    Raises:
        InputError: a cache holds shapes other than its plan's (nothing is published).
    """
    records, source_dtype = {}, next((u.dtype for p in plans for u in p.units() if u.dtype), None)
    with open_writer(output, force) as writer:
        for layer, cache in enumerate(caches):
            if source_dtype is None and KINDS[plans[layer].kind].tiered:
                source_dtype = str(cache.keys.dtype).replace("mlx.core.", "")
            records.update(KINDS[plans[layer].kind].write(writer, layer, plans[layer], cache, schema[layer],
                                                          page_size, len(tokens), kept))
        header = _header(lm, tokens, plans, records, page_size, mode, source_dtype or "float32", source or {})
        header.update(protect.header_keys(*kept))
        return writer.commit(header, np.asarray(tokens, dtype=np.uint32))


def build_result(path, tokens, prefill_seconds, seconds, schema, plans, context_left=None, kept=(0, 0)):
    """The BuildResult of a written cartridge (sizes read from disk); bytes per token of the layers
    that store every token, with the fp16 copies of `kept` (N, M) protected tokens spread over them."""
    total = sum(f.stat().st_size for f in path.iterdir())
    bpt = sum(get_tier(r[s]).bytes_per_token(*getattr(u, f"{s}_shape")) for p, r in zip(plans, schema)
              for u in p.units() if KINDS[u.kind].stores_every_token for s in ("k", "v"))
    shapes = [getattr(p, f"{s}_shape") for p in plans if KINDS[p.kind].stores_every_token for s in ("k", "v")]
    bpt += protect.bytes_per_token(*kept, len(tokens), shapes)
    return BuildResult(str(path), len(tokens), prefill_seconds, seconds, total, bpt, schema, context_left)
