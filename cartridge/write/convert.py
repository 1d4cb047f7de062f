"""Re-encode the stored pages of an fp16 (or bf16) cartridge into other tiers, without any prefill.

    NAME.cart (fp16/bf16 pages) --reader--> per (layer, side) K/V (n_kv_heads, T, head_dim)
         --codec(tier of the new schema)--> page payloads --container writer--> NEW.cart (atomic)

The header is the source's (model, fingerprint, tokens, prompt split, source documents), with the
tier keys of the new schema and its protection (the fp16 copies of the first/last tokens taken from
the source's pages, spec/FORMAT.md 4.5.4), so `convert` of an fp16 cartridge gives the same bytes as a direct
`build` in that tier whenever the direct build encoded the same values: when the model's K/V dtype is
float16 (an fp16 source) or bfloat16 (a bf16 source). From a float32 model the direct build quantizes
the float32 K/V, while `convert` starts from their fp16 rounding; the pages then differ where a value's
fp16 rounding moves a group minimum/maximum or a code across a rounding boundary (measured in
tests/write/test_convert.py and benchmarks/extend.py --convert).

A sliding-window layer's stored window is re-encoded like an attention layer's pages (its window, start
and count records kept; no protected copies, as build keeps none there); a recurrent state layer's arrays
are copied as stored; a "list" layer (several caches) is refused (tests/write/test_convert_kinds.py).
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..attention.pages import encode_pages
from ..storage.kinds import LayerPlan
from ..storage.store import to_numpy
from .encode import layers_bytes, tier_keys
from ..errors import InputError
from ..format import keys as K
from ..format.header import SIDES, require_attention_layers
from ..format.layout import FORMAT_MAJOR, FORMAT_MINOR
from ..format.reader import open_cartridge
from ..format.writer import CartridgeWriter, check_output_path, check_space
from ..tiers import DEFAULT_TIER, check_schema, get_tier, key_scale, presets, protect, read_tier_options, schema_for

LOSSLESS_SOURCES = ("fp16", "bf16")  # tiers that hold the model's K/V closely enough to re-encode
CONVERTED_KINDS = ("attention", "dense", "window", "state")  # a state layer's arrays are copied as stored


@dataclass
class ConvertResult:
    """What `convert` wrote.

    Attributes:
        path (str): the new cartridge directory. tokens (int): prefix tokens.
        seconds (float): total time (read + encode + write).
        bytes (int): total bytes on disk. bytes_per_token (int): K+V payload bytes per token.
        schema (list[dict]): the tier of every (layer, side).
        protect_first, protect_last (int): first and last tokens also kept in fp16 (after clamping to the prefix).
    """

    path: str
    tokens: int
    seconds: float
    bytes: int
    bytes_per_token: int
    schema: list = field(default_factory=list)
    protect_first: int = 0
    protect_last: int = 0


def _check_source(info, path):
    """Refuse a source whose pages are already lossy: re-quantizing them would compound the error."""
    require_attention_layers(info, "convert", kinds=CONVERTED_KINDS)
    for row, layer in zip(info.tiers, info.layers):
        for side in SIDES if layer.kind_type.tiered else ():
            if row[side] not in LOSSLESS_SOURCES:
                raise InputError(
                    f"cartridge {path} stores layer {row['layer']} {side.upper()} as {row[side]}; convert "
                    f"re-encodes fp16 or bf16 pages only (rebuild from the document for another tier)")


def _read_side(info, data, layer, side):
    """The stored K or V of one layer as (n_kv_heads, T, head_dim) in its stored dtype; T = the tokens it
    stores (a window layer: its last `window`, at positions start .. start + count - 1)."""
    (extent,) = info.extents[(layer, side)]  # fp16/bf16: one "values" component
    view = data.view(extent, "<u2" if extent.dtype == "bfloat16" else extent.dtype)
    pages = mx.array(view)  # (n_pages, n_kv, P, D)
    if extent.dtype == "bfloat16":
        pages = pages.view(mx.bfloat16)
    n_pages, n_kv, page_size, head_dim = pages.shape
    x = pages.transpose(1, 0, 2, 3).reshape(n_kv, n_pages * page_size, head_dim)  # (n_kv, n_pages*P, D)
    return x[:, : info.layers[layer].count, :]  # (n_kv, T, D)


def _resolve_schema(info, tier, k_tier, v_tier, boundary_protect, schema):
    rows = read_tier_options(tier, k_tier, v_tier, boundary_protect, schema)
    rows = rows or schema_for(info.n_layers, tier, k_tier, v_tier, boundary_protect)
    check_schema(rows, info.n_layers, info.n_kv_heads, info.head_dim)
    return rows


def convert(source, output, tier=DEFAULT_TIER, k_tier=None, v_tier=None, boundary_protect=0, schema=None,
            force=False, verify="pages", progress=None, protect_first=0, protect_last=0, preset=None):
    """Re-encode an fp16 or bf16 cartridge into other tiers, without the model and without prefill.

    Args:
        source (str | Path): the fp16/bf16 cartridge (directory or .cartz).
        output (str | Path): cartridge directory to create.
        tier, k_tier, v_tier, boundary_protect, schema: the new tiers, exactly as in `cartridge.build`.
            Default: every layer fp16.
        force (bool): replace an existing cartridge at `output`. Default: False.
        verify (str): "pages" checks every source page checksum first (default); "header" skips them.
        progress (callable | None): progress(done_layers, total_layers) after each layer.
        protect_first, protect_last (int): also keep the first N / last M prefix tokens of every (layer, side)
            in fp16, copied from the source's pages, as `cartridge.build` keeps them from the prefill
            (`cartridge.tiers.protect`). Default: 0.
        preset (str | None): "exact", "safe", "balanced" or "compact" (`cartridge.tiers.presets`), as in
            `cartridge.build`; excludes the tier and protection options. Default: None.

    Returns:
        ConvertResult

    Raises:
        InputError: a "list" layer, a source layer stored in a lossy tier (int8, mlx4g32, fp8, ...), an unknown tier, a
            bad schema, bad options (a preset beside the options it sets), a preset whose tiers this
            cartridge's geometry cannot store, or `output` naming the source. OutputExistsError: `output` exists and
            `force` is False.
        WriteError: too little free space, or a failed write (nothing is left behind).
        CartridgeError subclasses from reading the source (naming its path).

    Example:
        >>> cartridge.convert("doc.cart", "doc-q4.cart", tier="mlx4g32", boundary_protect=2)  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    if Path(output).resolve() == Path(source).resolve():  # the lossy result could never be converted back
        raise InputError(f"convert writes a new cartridge; the output {output} is its source")
    o = presets.apply(preset, tier, k_tier, v_tier, boundary_protect, schema, protect_first, protect_last)
    protect.check_counts(o["protect_first"], o["protect_last"])
    check_output_path(output, force)
    info, data = open_cartridge(source, verify)
    try:
        _check_source(info, source)
        rows = _preset_schema(info, preset, o, source)
        kept = protect.clamp(o["protect_first"], o["protect_last"], len(info.tokens))
        check_space(output, layers_bytes(rows, _plans(info), len(info.tokens), info.page_size))
        path = _write(info, data, rows, output, force, progress, kept, preset)
    finally:
        data.close()
    total = sum(f.stat().st_size for f in Path(path).iterdir())
    every = [r for r, layer in zip(rows, info.layers) if layer.stores_every_token]  # as `build_result` counts
    shape = (info.n_kv_heads, info.head_dim)
    bpt = sum(get_tier(r[s]).bytes_per_token(*shape) for r in every for s in SIDES)
    bpt += protect.bytes_per_token(*kept, len(info.tokens), [shape] * (2 * len(every)))
    return ConvertResult(str(path), len(info.tokens), time.perf_counter() - t0, total, bpt, rows, *kept)


def _plans(info):
    """The `LayerPlan` of every source layer (kind, shapes, window, state arrays), for the size estimate."""
    return [LayerPlan(m.kind, m.k_shape, m.v_shape, window=m.window, size=m.state_size,
                      state=[list(a) for a in m.arrays]) for m in info.layers]


def _preset_schema(info, preset, o, source):
    """The new schema from the resolved options `o`; a preset this geometry cannot store is refused naming it."""
    try:
        return _resolve_schema(info, *(o[k] for k in ("tier", "k_tier", "v_tier", "boundary_protect", "schema")))
    except InputError as e:
        if preset is None:
            raise
        raise InputError(f"preset {preset!r} cannot be applied to {source}: {e}") from None


def _write(info, data, rows, output, force, progress, kept=(0, 0), preset=None):
    params = {}
    with CartridgeWriter(output, force) as writer:
        for layer, meta in enumerate(info.layers):
            if not meta.kind_type.tiered:  # a state layer's arrays, as stored (its records are kept)
                for extent in info.extents[(layer, K.STATE_SIDE)]:
                    raw = "<u2" if extent.dtype == "bfloat16" else extent.dtype  # bfloat16 as its 16 bits, as stored
                    writer.add_extent(layer, K.STATE_SIDE, extent.component, np.array(data.view(extent, raw)))
            for side in SIDES if meta.kind_type.tiered else ():
                codec = get_tier(rows[layer][side])
                x = _read_side(info, data, layer, side)
                params[(layer, side)] = codec.make_params(x, layer, side)
                parts = encode_pages(codec, x, params[(layer, side)], info.page_size)
                for comp in codec.components(info.head_dim):
                    writer.add_extent(layer, side, comp.name, to_numpy(parts[comp.name]))
                if sum(kept) and meta.stores_every_token:  # the fp16 copies build keeps: an fp16 source's pages are the prefill's fp16 K/V
                    writer.add_record(K.layer_protected(layer, side), protect.take(x, *kept))
                del x, parts  # the source mapping must have no views left when it is closed
            if progress:
                progress(layer + 1, info.n_layers)
        header = _header(info, [r for r, m in zip(rows, info.layers) if m.kind_type.tiered], params)
        for layer, scale in info.key_scales.items():  # the pages re-encoded are K / s: the scale stays (1.11)
            writer.add_record(K.layer_key_scale(layer), key_scale.record(scale))
            header[K.layer_codec_version(layer, "k")] = key_scale.SCALED_VERSION
        header.update(protect.header_keys(*kept), **({} if preset is None else {K.PRESET: preset}))
        return writer.commit(header, info.tokens)


def _is_tier_key(key):
    """layer.{i}.{side}.{tier,codec_version,params,components}, layer.{i}.k.scale, page and head tables: rewritten
    by convert."""
    parts = key.split(".")
    return parts[0] == "layer" and len(parts) >= 4 and parts[2] in (*SIDES, K.STATE_SIDE) and (
        parts[3] in ("tier", "codec_version", "params", "components", "scale") or parts[-1] in ("pages", "head_sums"))


def _header(info, rows, params):
    """The source's JSON header records (every key, known or not) with the new schema's tier keys."""
    header = {key: json.loads(raw) for key, raw in info.records.items()  # the source's choice of tiers is not kept
              if key not in (K.TOKENS_IDS, K.PRESET, K.CALIBRATION, K.ENCODERS) and not _is_tier_key(key)}
    header.update({K.FORMAT_MAJOR: FORMAT_MAJOR, K.FORMAT_MINOR: FORMAT_MINOR})
    header.update(tier_keys(rows, params, info.head_dim))
    return header
