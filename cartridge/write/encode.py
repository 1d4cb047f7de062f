"""Encode a prefilled model's K/V with each layer's tiers and write the cartridge: `write_layers`, its header
keys and its size on disk.
"""

from types import SimpleNamespace

import numpy as np

from ..format import keys as K
from ..format.layout import FORMAT_MAJOR, FORMAT_MINOR
from ..format.source import source_keys
from ..format.writer import CartridgeWriter
from ..models.loader import architecture_config
from ..models.prompt import SEPARATOR
from ..storage.kinds import KINDS, LayerPlan
from ..tiers import get_tier, protect


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


def header_extras(document, source_name, system):
    """The optional header keys of a build: source.* (spec 4.5.1) and prompt.system (spec 5.4)."""
    return source_keys(document, source_name) | ({} if system is None else {K.PROMPT_SYSTEM: system})


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
            checked (`probed_schema_and_tokens`; `attention_plans` for a model of full-attention layers only).
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
