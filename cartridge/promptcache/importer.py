"""Turn an mlx-lm prompt-cache file (`mlx_lm.cache_prompt`, `save_prompt_cache`) into a cartridge, without prefill.

    FILE.safetensors ──read, checked (`promptfile`)──► mlx-lm caches + metadata ("model")
        ──tokens: the file's `cartridge export` record, or --document rendered as mlx_lm.cache_prompt does──►
        each layer taken as the kind the model's own cache is (`plan_layers`), K/V checked against the model
        (`kvcheck`) ──tiers, preset or calibration, as `build`──► NAME.cart (atomic)

The prompt an imported cartridge records (spec/FORMAT.md 5.4): mlx_lm.cache_prompt prefills the chat template
over one user message holding the text, continued (no end of turn), and mlx_lm.generate --prompt-cache-file
appends the question's text right after it, then the end of turn and the assistant header. So the cartridge
records the chat template with an empty separator, and `question_prompt` gives the tokens mlx-lm feeds. A
model without a chat template: mlx-lm encodes the text alone and then the question alone (with a second BOS);
the cartridge records its plain layout instead ("\\n\\nQuestion: ...\\nAnswer:").
"""

import time
import warnings
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from .. import calibrate as calibrate_mod
from ..write.append import token_sha256
from ..write.build import build_result, measure_and_write
from ..write.encode import layers_bytes
from ..write.options import (DEFAULT_PAGE_SIZE, DEFAULT_RESERVE, check_reserve, context_length, fit_page_size,
                             layers_schema, resolve_options, warn_context_left)
from ..errors import InputError, ModelLoadError, ModelMismatchError
from ..format import keys as K
from ..format.source import FIELDS, source_keys
from ..format.writer import check_output_path, check_space
from .kvcheck import check_kv
from ..models.families import plan_layers
from ..models.loader import LoadedModel, load_model
from ..models.prompt import CHAT, SEPARATOR, check_text, prompt_mode
from .promptfile import read_prompt_file, read_record
from ..tiers import DEFAULT_TIER


@dataclass
class ImportResult:
    """What `import_prompt_cache` wrote: `BuildResult`'s fields (no prefill: prefill_seconds is 0) and

    Attributes:
        model (str): the model the cartridge records. tokens_from (str): "record" (the file's own token ids,
            written by `cartridge export`) or "document" (re-tokenized from the text).
        checked_tokens (int): tokens whose K/V were recomputed and matched (`kvcheck`).
    """

    path: str
    tokens: int
    seconds: float
    bytes: int
    bytes_per_token: int
    schema: list = field(default_factory=list)
    model: str = ""
    tokens_from: str = ""
    checked_tokens: int = 0
    calibration: dict | None = None


def cache_prompt_tokens(tokenizer, text):
    """The token ids `mlx_lm.cache_prompt --prompt TEXT` prefills (mlx_lm/cache_prompt.py `main`): the chat
    template over one user message, continued (no end of turn, no generation prompt), or, for a tokenizer
    without a chat template, the text's own encoding with its BOS.

    Returns:
        list[int]
    """
    if getattr(tokenizer, "has_chat_template", None) or getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True))
    return list(tokenizer.encode(text))


def opening_tokens(tokenizer):
    """How many tokens `cache_prompt_tokens` renders before the text (the chat template's opening, a default
    system message included): the tokens two texts' renderings share."""
    a, b = cache_prompt_tokens(tokenizer, "A"), cache_prompt_tokens(tokenizer, "B")
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _model(pf, model):
    """The LoadedModel: `model`, else the one the file's metadata names (mlx_lm.cache_prompt's "model")."""
    if isinstance(model, LoadedModel):
        return model
    if model is None:
        model = pf.metadata.get("model")
        if not model:
            raise InputError(f"{pf.path} names no model in its metadata; pass --model (Python: model=)")
        try:
            return load_model(model)
        except ModelLoadError as e:
            raise ModelLoadError(f"{pf.path} was made with model {model} (its metadata): {e}; pass --model") from None
    return load_model(model)


def _prompt(pf, lm, document):
    """(tokens, header keys of the prompt layout, the document as used or None) of the file; a document that
    has the file's token count only without its trailing whitespace is taken without it (one warning)."""
    record = read_record(pf)
    if document is not None:
        check_text(document, "the document")
        tokens = cache_prompt_tokens(lm.tokenizer, document)
        if len(tokens) != pf.tokens and document != document.rstrip():
            stripped = cache_prompt_tokens(lm.tokenizer, document.rstrip())
            if len(stripped) == pf.tokens:  # `--prompt "$(cat doc.txt)"`: the shell drops the trailing newline
                warnings.warn(f"the document's trailing whitespace left out: {pf.path} holds {pf.tokens:,} tokens, "
                              f"the document without it (as `--prompt \"$(cat FILE)\"` passes it)", stacklevel=3)
                document, tokens = document.rstrip(), stripped
        if len(tokens) != pf.tokens:
            raise InputError(f"the document is {len(tokens):,} tokens as mlx_lm.cache_prompt renders it for this "
                             f"model; {pf.path} holds {pf.tokens:,}: give the text that was passed to --prompt")
        if record is not None and tokens != record["tokens"]:
            raise InputError(f"the document's tokens differ from the token ids {pf.path} records")
    elif record is None:
        raise InputError(f"{pf.path} holds no token ids (mlx_lm.cache_prompt stores none): pass --document with "
                         f"the text given to mlx_lm.cache_prompt --prompt")
    if record is None:  # mlx_lm.cache_prompt's layout (module docstring)
        mode = prompt_mode(lm.tokenizer)
        return tokens, {K.PROMPT_MODE: mode, K.PROMPT_SEPARATOR: "" if mode == CHAT else SEPARATOR}, document
    tokens, keys = record["tokens"], {K.PROMPT_MODE: record["prompt_mode"], K.PROMPT_SEPARATOR: record["separator"]}
    if record["system"] is not None:
        keys[K.PROMPT_SYSTEM] = record["system"]
    doc = record["document_tokens"]
    if doc < len(tokens):  # a saved conversation (spec 4.5.3): the document, then its turns
        keys[K.DOCUMENT_TOKENS] = doc
        keys[K.LINEAGE_PARTS] = [{"kind": kind, "start": a, "end": b, "tokens_sha256": token_sha256(tokens[a:b])}
                                 for kind, a, b in (("build", 0, doc), ("conversation", doc, len(tokens)))]
    return tokens, keys, document


def _mismatch(pf, where, found, plan, lm):
    return ModelMismatchError(f"{pf.path}: layer {where} holds {found}; model {lm.ref} makes {plan}: a prompt cache "
                              f"of another model")


def _as_kv(pf, where, c, plan, lm):
    """A K/V layer of the file as the KVCache the model's layer is, and its quantization ((group, bits) or None)."""
    quant = None
    if isinstance(c, QuantizedKVCache):
        quant = (c.group_size, c.bits)
        keys, values = (mx.dequantize(*side, group_size=c.group_size, bits=c.bits)[..., :c.offset, :]
                        for side in (c.keys, c.values))
    elif type(c) is KVCache:
        keys, values = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
    elif type(c) is RotatingKVCache and c.offset <= c.max_size and c.keys.shape[2] >= c.offset:
        keys, values = (x[..., :c.offset, :] for x in (c.keys, c.values))  # nothing rotated out: in order
    elif type(c) is RotatingKVCache:
        raise InputError(f"{pf.path}: layer {where} is a RotatingKVCache(max_size={c.max_size}) that kept "
                         f"{c.max_size} of {c.offset} tokens (mlx_lm.cache_prompt --max-kv-size); this model's "
                         f"layer keeps every token: make the prompt cache without --max-kv-size")
    else:
        raise _mismatch(pf, where, f"a {type(c).__name__}", "a KVCache", lm)
    for side, x, want in (("K", keys, plan.k_shape), ("V", values, plan.v_shape)):
        if (x.shape[1], x.shape[3]) != tuple(want):
            raise _mismatch(pf, where, f"{side} of {x.shape[1]} kv heads x {x.shape[3]}",
                            f"{want[0]} x {want[1]}", lm)
    out = KVCache()
    out.keys, out.values, out.offset = keys, values, keys.shape[2]
    return out, quant


def _take(pf, where, c, plan, lm, quant):
    """The file's cache of one layer as the kind of the model's layer (`plan`); `quant` gets leaf -> (group, bits)."""
    if plan.kind in ("attention", "dense"):
        out, quant[where] = _as_kv(pf, where, c, plan, lm)
        return out
    if plan.kind == "window":
        if type(c) is not RotatingKVCache or (c.max_size, c.keep) != (plan.window, 0):
            found = f"a {type(c).__name__}" + (f"(max_size={c.max_size}, keep={c.keep})" if hasattr(c, "keep") else "")
            raise _mismatch(pf, where, found, f"a RotatingKVCache(max_size={plan.window}, keep=0)", lm)
        if (c.keys.shape[1], c.keys.shape[3]) != tuple(plan.k_shape):
            raise _mismatch(pf, where, f"K of {c.keys.shape[1]} kv heads x {c.keys.shape[3]}",
                            f"{plan.k_shape[0]} x {plan.k_shape[1]}", lm)
        return c
    if plan.kind == "state":
        found = [(i, list(a.shape)) for i, a in enumerate(getattr(c, "cache", [])) if a is not None]
        if type(c) is not ArraysCache or len(c.cache) != plan.size or found != [(i, s) for i, _, s in plan.state]:
            raise _mismatch(pf, where, f"a {type(c).__name__} of {found}", f"an ArraysCache of {plan.state}", lm)
        for i, dtype, _ in plan.state:
            c[i] = c[i].astype(getattr(mx, dtype))  # the dtype this model computes its state in
        return c
    if type(c) is not CacheList or len(c.caches) != len(plan.parts):
        raise _mismatch(pf, where, f"a {type(c).__name__}", f"a CacheList of {len(plan.parts)} caches", lm)
    return CacheList(*(_take(pf, f"{where}.{j}", part, p, lm, quant) for j, (part, p) in
                       enumerate(zip(c.caches, plan.parts))))


def model_caches(pf, plans, lm):
    """The file's caches taken as the kinds of the model's layers (`plans`), and their quantization.

    Returns:
        tuple: (list of mlx-lm caches, dict layer path -> (group_size, bits) of a QuantizedKVCache or None).

    Raises:
        ModelMismatchError: another layer count, cache kind or K/V shape than the model's.
        InputError: a rotating cache that lost tokens (`mlx_lm.cache_prompt --max-kv-size`).
    """
    if len(pf.caches) != len(plans):
        raise ModelMismatchError(f"{pf.path} holds {len(pf.caches)} layers; model {lm.ref} has {len(plans)}: a "
                                 f"prompt cache of another model")
    quant = {}
    return [_take(pf, str(i), c, p, lm, quant) for i, (c, p) in enumerate(zip(pf.caches, plans))], quant


def import_prompt_cache(file, output, model=None, document=None, tier=DEFAULT_TIER, k_tier=None, v_tier=None,
                        boundary_protect=0, schema=None, page_size=DEFAULT_PAGE_SIZE, force=False, protect_first=0,
                        protect_last=0, preset=None, budget=None, calibrate=True, calibration_progress=None,
                        reserve=DEFAULT_RESERVE):
    """Write the prompt cache of an mlx-lm prompt-cache file as a cartridge, without prefill.

    Args:
        file (str | Path): a file of `mlx_lm.cache_prompt` or `save_prompt_cache` (or `cartridge export`).
        output (str | Path): cartridge directory to create.
        model (str | LoadedModel | None): the model; None: the one the file's metadata names ("model").
        document (str | None): the text given to `mlx_lm.cache_prompt --prompt`: its tokens (rendered as
            mlx_lm.cache_prompt renders them) must be as many as the file holds (with or, as `--prompt
            "$(cat FILE)"` passes it, without its trailing whitespace). Required unless the file
            records its token ids (a `cartridge export` file). Default: None.
        tier, k_tier, v_tier, boundary_protect, schema, page_size, protect_first, protect_last, preset, budget,
            calibrate, calibration_progress, reserve: as `cartridge.build` takes them.
        force (bool): replace an existing cartridge at `output`. Default: False.

    Returns:
        ImportResult

    Raises:
        InputError: a file that is not an mlx-lm prompt cache, an unsupported cache class, no token ids and no
            document, a document of another token count, bad tier options; nothing is written.
        ModelMismatchError: the file's layers, cache kinds, shapes or K/V are not this model's for these tokens
            (`kvcheck.check_kv`): a prompt cache of another model, or of another text.
        ModelLoadError: the model cannot be loaded. OutputExistsError, WriteError: as `build`.

    Example:
        >>> cartridge.import_prompt_cache("doc.safetensors", "doc.cart", document=open("doc.txt").read())  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    check_output_path(output, force)
    check_reserve(reserve)
    target, options, protected, named = resolve_options(preset, budget, calibrate, tier, k_tier, v_tier,
                                                        boundary_protect, schema, protect_first, protect_last)
    pf = read_prompt_file(file)
    lm = _model(pf, model)
    tokens, prompt_keys, document = _prompt(pf, lm, document)
    tokens_from = "record" if document is None else "document"
    if context_length(lm.model):
        warn_context_left(len(tokens), context_length(lm.model), reserve, stacklevel=3)
    declined = None if target is None else calibrate_mod.checked_model(lm.model, target)
    plans = plan_layers(lm.model, tokens)
    page_size = fit_page_size(page_size, len(tokens))
    schema = layers_schema(plans, options, page_size)
    if target is not None and declined is None:
        calibrate_mod.check_reachable(target, plans)
    caches, quant = model_caches(pf, plans, lm)
    checked = check_kv(lm, tokens, caches, quant, pf.path, opening_tokens(lm.tokenizer))
    check_space(output, layers_bytes(schema, plans, len(tokens), page_size))
    extras = _source(pf, document) | prompt_keys | named
    path, schema, kept = measure_and_write(output, lm, prompt_keys[K.PROMPT_MODE], tokens, caches, schema, plans,
                                           page_size, force, extras, protected,
                                           (target, declined, calibration_progress))
    r = build_result(path, tokens, 0.0, time.perf_counter() - t0, schema, plans, None, kept)
    return ImportResult(r.path, r.tokens, r.seconds, r.bytes, r.bytes_per_token, r.schema, lm.ref, tokens_from,
                        checked, extras.get(K.CALIBRATION))


def _source(pf, document):
    """source.* keys (spec 4.5.1) naming the prompt-cache file, with the document's size, SHA-256 and first line
    when it was given (else not recorded)."""
    if document is not None:
        return source_keys(document, pf.path.name)
    entry = {**{k: None for k in FIELDS}, "name": pf.path.name}
    return {K.SOURCE_NAME: pf.path.name, K.SOURCE_DOCUMENTS: [entry]}
