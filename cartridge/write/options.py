"""The checks and choices of a build before any prefill: options, page size, the model's context, the schema.
"""

import warnings

from .. import calibrate as calibrate_mod
from ..errors import InputError
from ..format import keys as K
from ..models.families import plan_layers
from ..models.prompt import check_text, prefix_tokens, prompt_mode
from ..storage.store import check_layer_tiers
from ..tiers import check_schema, get_tier, presets, protect, read_tier_options, schema_for

DEFAULT_PAGE_SIZE = 256
DEFAULT_RESERVE = 256  # tokens a build leaves free for questions and answers before it warns
K_ENCODERS = ("nearest", "score")  # how K's codes are chosen (`cartridge.tiers.score_aware`)
V_ENCODERS = ("nearest", "output")  # how V's codes are chosen (`cartridge.calibrate.outputs`)
# (k_encoder, k_scale, v_encoder) of the calibrated presets, adopted by measurement on two models and documents not
# in samples/ (docs/evaluation.md "Encoding for the document's own queries"); "output" V was not adopted there
PRESET_ENCODING = {"balanced": ("score", True, "nearest"), "compact": ("score", True, "nearest")}


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


def context_length(model):
    """The model's context length in tokens (max_position_embeddings), or None if it does not say."""
    return getattr(getattr(model, "args", None), "max_position_embeddings", None)


def _check_context(lm, tokens, reserve):
    """Refuse a document that does not fit the context; warn when fewer than `reserve` tokens are left."""
    limit = context_length(lm.model)
    if not limit:
        return None
    if len(tokens) >= limit:
        raise InputError(f"the corpus is {len(tokens)} tokens; the model's context is {limit} tokens")
    return warn_context_left(len(tokens), limit, reserve, stacklevel=5)  # this, _check_context, its caller, build


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


def check_k_encoder(k_encoder):
    """Raise InputError unless `k_encoder` is one of K_ENCODERS."""
    if k_encoder not in K_ENCODERS:
        raise InputError(f"K encoder {k_encoder!r} is not one of {', '.join(K_ENCODERS)}")


def check_encoders(k_encoder=None, k_scale=None, v_encoder=None):
    """Raise InputError unless `k_encoder` is one of K_ENCODERS, `k_scale` a bool and `v_encoder` one of
    V_ENCODERS (`build`'s arguments; None: the default `resolve_encoders` gives)."""
    if k_encoder is not None:
        check_k_encoder(k_encoder)
    if k_scale is not None and not isinstance(k_scale, bool):
        raise InputError(f"k_scale is {k_scale!r}; expected True or False")
    if v_encoder is not None and v_encoder not in V_ENCODERS:
        raise InputError(f"V encoder {v_encoder!r} is not one of {', '.join(V_ENCODERS)}")


def resolve_encoders(calibrated_preset, k_encoder, k_scale, v_encoder):
    """(k_encoder, k_scale, v_encoder) a build uses: each as given, or where None, the calibrated preset's
    (`PRESET_ENCODING`), else nearest rounding without a scale.

    Args:
        calibrated_preset (str | None): the preset a build measures its schema for, None for any other build
            (tiers given, a budget without a preset, `--no-calibrate`, a model calibration cannot walk).
    """
    default = PRESET_ENCODING.get(calibrated_preset, ("nearest", False, "nearest"))
    return tuple(d if x is None else x for x, d in zip((k_encoder, k_scale, v_encoder), default))


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


def schema_and_tokens(document, lm, geometry, options, reserve=0, system=None, page_size=DEFAULT_PAGE_SIZE):
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


def probed_schema_and_tokens(document, lm, options, reserve=0, system=None, page_size=DEFAULT_PAGE_SIZE):
    """Like `schema_and_tokens`, with each layer's cache kind and K/V shapes probed from the model itself.

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


def resolve_options(preset, target, calibrate, tier, k_tier, v_tier, boundary_protect, schema, protect_first,
                    protect_last):
    """`build`'s tier, preset and budget options resolved (arguments as `build` takes them).

    Returns:
        tuple: (target CalibrationTarget | None (a budget preset included), options (tier, k_tier, v_tier,
        boundary_protect, schema), (protect_first, protect_last) before clamping, the `cartridge.preset` header key
        or {}).

    Raises:
        InputError: clashing options (a preset beside the options it sets, a budget without calibration).
    """
    named = {} if preset is None else {K.PRESET: preset}
    target, preset = calibrate_mod.resolve_target(preset, target, calibrate, tier, k_tier, v_tier, boundary_protect,
                                                  schema, protect_first, protect_last)
    o = presets.apply(preset, tier, k_tier, v_tier, boundary_protect, schema, protect_first, protect_last)
    protect.check_counts(o["protect_first"], o["protect_last"])
    options = tuple(o[k] for k in ("tier", "k_tier", "v_tier", "boundary_protect", "schema"))
    return target, options, (o["protect_first"], o["protect_last"]), named
