"""Prefill a document through a model once and write its K/V as a cartridge.

    text -> chat-template prefix tokens -> chunked prefill (mlx-lm model, mlx-lm KVCache)
         -> per (layer, side) tier codec -> pages -> container (atomic)
"""

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .attention.pages import encode_pages
from .errors import InputError
from .format import keys as K
from .format.layout import FORMAT_MAJOR, FORMAT_MINOR
from .format.writer import CartridgeWriter, check_output_path
from .models.loader import LoadedModel, architecture_config, load_model
from .models.prompt import SEPARATOR, check_text, prefix_tokens, prompt_mode
from .tiers import DEFAULT_TIER, check_schema, check_tier_options, get_tier, presets, protect, read_schema, schema_for

DEFAULT_PAGE_SIZE = 256
DEFAULT_PREFILL_STEP = 512


@dataclass
class BuildResult:
    """What `build` wrote.

    Attributes:
        path (str): the cartridge directory. tokens (int): prefix tokens.
        prefill_seconds (float), seconds (float): prefill time and total time (prefill + encode + write).
        bytes (int): total bytes on disk. bytes_per_token (int): K+V payload bytes per token.
        schema (list[dict]): the tier of every (layer, side): [{"layer": i, "k": tier, "v": tier}].
    """

    path: str
    tokens: int
    prefill_seconds: float
    seconds: float
    bytes: int
    bytes_per_token: int
    schema: list = field(default_factory=list)

    @property
    def tokens_per_second(self):
        """Prefill throughput in tokens per second."""
        return self.tokens / self.prefill_seconds if self.prefill_seconds else float("inf")


def _geometry(model):
    attn = model.layers[0].self_attn
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads")
    head_dim = getattr(attn, "head_dim", None) or model.args.hidden_size // model.args.num_attention_heads
    return len(model.layers), int(n_kv), int(head_dim)


def context_length(model):
    """The model's context length in tokens (max_position_embeddings), or None if it does not say."""
    return getattr(getattr(model, "args", None), "max_position_embeddings", None)


def prefill(model, tokens, step=DEFAULT_PREFILL_STEP, progress=None):
    """Run `tokens` through the model in chunks and return the filled mlx-lm caches.

    Args:
        model (nn.Module): mlx-lm model. tokens (list[int]): prompt tokens.
        step (int): tokens per forward pass. Default: 512.
        progress (callable | None): called as progress(done_tokens, total_tokens) after each chunk.

    Returns:
        list[KVCache]: one per layer, keys/values (1, n_kv_heads, >= len(tokens), head_dim).

    Raises:
        InputError: if the model needs a cache kind other than mlx-lm's full-attention KVCache.
    """
    caches = make_prompt_cache(model)
    if not all(type(c) is KVCache for c in caches):
        kinds = sorted({type(c).__name__ for c in caches})
        raise InputError(f"model uses {', '.join(kinds)}; cartridge stores full-attention KVCache models only")
    body = getattr(model, "model", model)  # the transformer without the LM head: its logits are not needed
    ids = mx.array(tokens, dtype=mx.uint32)
    for start in range(0, len(tokens), step):
        body(ids[None, start:start + step], cache=caches)
        mx.eval([c.state for c in caches])
        if progress:
            progress(min(start + step, len(tokens)), len(tokens))
    return caches


def _to_numpy(paged):
    """A page-major mx array as the numpy array the writer stores (bfloat16 as its raw 16 bits)."""
    if paged.dtype == mx.bfloat16:  # numpy has no bfloat16
        paged = paged.view(mx.uint16)
    return np.array(paged)


def _header(lm, tokens, schema, params, geometry, page_size, mode, source_dtype):
    n_layers, n_kv, head_dim = geometry
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
        K.N_LAYERS: n_layers,
        K.N_KV_HEADS: n_kv,
        K.HEAD_DIM: head_dim,
        K.PAGE_SIZE: page_size,
        K.N_PAGES: -(-len(tokens) // page_size),
        K.SOURCE_DTYPE: source_dtype,
        K.ROPE: "post",
    }
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


def _check_options(page_size, prefill_step):
    for name, value in (("page size", page_size), ("prefill step", prefill_step)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"{name} must be an integer number of tokens, got {value!r}")
    if not 1 <= page_size <= 1 << 16:
        raise InputError(f"page size {page_size} tokens is out of range 1..65536")
    if prefill_step < 1:
        raise InputError(f"prefill step {prefill_step} must be at least 1 token")


def _tier_options(tier, k_tier, v_tier, boundary_protect, schema):
    """Check what needs no model (tier names, schema file and form); return the read schema or None."""
    check_tier_options(tier, k_tier, v_tier, boundary_protect)
    if schema is None:
        return None
    others = {"tier": tier if tier != DEFAULT_TIER else None, "k_tier": k_tier, "v_tier": v_tier,
              "boundary_protect": boundary_protect or None}
    given = [k for k, v in others.items() if v is not None]
    if given:
        raise InputError(f"a schema sets the tier of every (layer, side); it cannot be combined with "
                         f"{', '.join(given)}")
    return read_schema(schema)


def _check_page_size(schema, page_size):
    """Refuse a page size a tier with token-axis groups (kivi4) cannot fill with whole groups."""
    for name in sorted({r[s] for r in schema for s in ("k", "v")}):
        check = getattr(get_tier(name), "check_page_size", None)
        if check:
            check(page_size)


def build(document, output, model=None, tier=DEFAULT_TIER, k_tier=None, v_tier=None, boundary_protect=0,
          schema=None, page_size=DEFAULT_PAGE_SIZE, prefill_step=DEFAULT_PREFILL_STEP, force=False,
          progress=None, protect_first=0, protect_last=0, preset=None):
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
        page_size (int): tokens per page. Default: 256.
        prefill_step (int): tokens per forward pass. Default: 512.
        force (bool): replace an existing cartridge at `output`. Default: False.
        progress (callable | None): progress(done_tokens, total_tokens) during prefill.
        protect_first, protect_last (int): also keep the first N / last M prefix tokens of every
            (layer, side) in fp16 (`cartridge.tiers.protect`); clamped to leave one token. Default: 0.
        preset (str | None): "exact", "safe", "balanced" or "compact" (`cartridge.tiers.presets`);
            excludes the tier and protection options. Default: None.

    Returns:
        BuildResult

    Raises:
        InputError: empty corpus, unknown tier, a tier that cannot store the model's K/V shape, a bad
            schema, corpus longer than the model's context, bad options; all before any prefill.
        OutputExistsError: `output` exists and `force` is False.
        ModelLoadError: the model cannot be loaded.

    Example:
        >>> import cartridge
        >>> r = cartridge.build(open("samples/gpl-2.0.txt").read(), "gpl.cart")  # doctest: +SKIP
        >>> r = cartridge.build(text, "q.cart", tier="mlx4g32", boundary_protect=2)  # doctest: +SKIP
    """
    check_output_path(output, force)  # before any expensive work
    check_text(document, "the corpus")
    _check_options(page_size, prefill_step)
    o = presets.apply(preset, tier, k_tier, v_tier, boundary_protect, schema, protect_first, protect_last)
    tier, k_tier, v_tier, boundary_protect, schema = (o[k] for k in ("tier", "k_tier", "v_tier", "boundary_protect",
                                                                     "schema"))
    protect.check_counts(o["protect_first"], o["protect_last"])
    schema = _tier_options(tier, k_tier, v_tier, boundary_protect, schema)
    lm = model if isinstance(model, LoadedModel) else load_model(model)
    geometry = _geometry(lm.model)
    schema = schema or schema_for(geometry[0], tier, k_tier, v_tier, boundary_protect)
    check_schema(schema, *geometry)
    _check_page_size(schema, page_size)
    mode = prompt_mode(lm.tokenizer)
    tokens = prefix_tokens(lm.tokenizer, document, mode)
    limit = context_length(lm.model)
    if limit and len(tokens) >= limit:
        raise InputError(f"the corpus is {len(tokens)} tokens; the model's context is {limit} tokens")

    t0 = time.perf_counter()
    caches = prefill(lm.model, tokens, prefill_step, progress)
    t1 = time.perf_counter()
    source_dtype = str(caches[0].keys.dtype).replace("mlx.core.", "")
    first, last = protect.clamp(o["protect_first"], o["protect_last"], len(tokens))
    params = {}
    with CartridgeWriter(output, force) as writer:
        for layer, cache in enumerate(caches):
            for side, x in (("k", cache.keys), ("v", cache.values)):
                codec = get_tier(schema[layer][side])
                x = x[0, :, : len(tokens), :]  # (n_kv_heads, T, head_dim)
                params[(layer, side)] = codec.make_params(x, layer, side)
                parts = encode_pages(codec, x, params[(layer, side)], page_size)
                for comp in codec.components(geometry[2]):
                    writer.add_extent(layer, side, comp.name, _to_numpy(parts[comp.name]))
                if first + last:
                    writer.add_record(K.layer_protected(layer, side), protect.take(x, first, last))
            caches[layer] = None  # free this layer's dense K/V before encoding the next
        header = _header(lm, tokens, schema, params, geometry, page_size, mode, source_dtype)
        header.update(protect.header_keys(first, last))
        path = writer.commit(header, np.asarray(tokens, dtype=np.uint32))
    seconds = time.perf_counter() - t0
    total = sum(f.stat().st_size for f in path.iterdir())
    bpt = sum(get_tier(r[s]).bytes_per_token(geometry[1], geometry[2]) for r in schema for s in ("k", "v"))
    bpt += protect.bytes_per_token(first, last, len(tokens), geometry)
    return BuildResult(str(path), len(tokens), t1 - t0, seconds, total, bpt, schema)
