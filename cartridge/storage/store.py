"""Store one cache's K/V or recurrent arrays as extents and header records (spec/FORMAT.md section 5.5).

K/V go through the layer's tiers into pages (`write_kv`); recurrent arrays are stored as produced, one
single-page extent per array (`write_state`). Which a layer takes, and how a "list" layer's caches are
stored one after another, is its kind's `write` (`cartridge.storage.kinds`). Every shape written is
the shape the model wrote into its cache, checked against the probe's plan: a disagreement is
refused, not written.
"""

import mlx.core as mx
import numpy as np

from ..errors import InputError
from ..format import keys as K
from ..format.kinds import KINDS
from ..tiers import get_tier, key_scale, protect, score_aware
from ..tiers.schema import check_layer_count
from ..attention.pages import encode_pages


def check_layer_tiers(plans, schema):
    """Refuse a schema whose tier cannot store a layer's K/V shape, naming the layer, side and shape.

    Args:
        plans (list[LayerPlan]): from `cartridge.models.families.plan_layers`.
        schema (list[dict]): one row per layer; rows of "state" layers are not used.

    Raises:
        InputError: a wrong layer count, or one line naming (layer, side, shape) and the tier's reason.
    """
    check_layer_count(schema, len(plans))
    for i, (layer_plan, row) in enumerate(zip(plans, schema)):
        for where, plan in KINDS[layer_plan.kind].units(i, layer_plan):
            if not KINDS[plan.kind].tiered:
                continue
            for side, shape in (("k", plan.k_shape), ("v", plan.v_shape)):
                try:
                    get_tier(row[side]).check(*shape)
                except InputError as e:
                    raise InputError(f"layer {where} {side} ({plan.kind}, {shape[0]} kv heads x head_dim "
                                     f"{shape[1]}): {e}") from None


def to_numpy(x):
    """An mx array as the numpy array the writer stores (bfloat16 as its raw 16 bits)."""
    if x.dtype == mx.bfloat16:  # numpy has no bfloat16
        x = x.view(mx.uint16)
    return np.array(x)


def _dtype_name(x):
    return str(x.dtype).replace("mlx.core.", "")


def write_state(writer, layer, plan, cache):
    """Append a recurrent layer's arrays, one single-page extent each, as produced.

    Args:
        writer (CartridgeWriter): open writer. layer (int | str): layer path. plan (LayerPlan): a "state" plan.
        cache (ArraysCache): the filled cache.

    Returns:
        dict: the layer's records (kind, state).

    Raises:
        InputError: a slot the prefill left other than the probe saw (nothing is published).
    """
    arrays = []
    for index, dtype, shape in plan.state:
        a = cache[index]
        if a is None or _dtype_name(a) != dtype or list(a.shape) != list(shape):
            found = None if a is None else (_dtype_name(a), list(a.shape))
            raise InputError(f"layer {layer} state slot {index}: the prefill left {found}; the probe saw "
                             f"{(dtype, list(shape))}")
        writer.add_extent(layer, K.STATE_SIDE, K.state_component(index), to_numpy(a)[None])
        arrays.append({"index": index, "dtype": dtype, "shape": list(shape)})
    return {K.layer_kind(layer): "state", K.layer_state(layer): {"size": plan.size, "arrays": arrays}}


def write_kv(writer, layer, plan, kv, row, page_size, n_tokens, kept=(0, 0)):
    """Encode one cache's K and V through its tiers and append their extents.

    Args:
        writer (CartridgeWriter): open writer. layer (int | str): layer index, or "i.j" for cache j of
            a "list" layer i.
        plan (LayerPlan): the probe's plan. kv (tuple): K, V (n_kv_heads, T, head_dim) as stored.
        row (dict): {"k": tier, "v": tier}. page_size (int): tokens per page. n_tokens (int): prefix tokens.
        kept (tuple): (N, M) first and last tokens also stored in fp16 records (`cartridge.tiers.protect`,
            format 1.5); (0, 0) for the kinds that do not store every token. Default: (0, 0).

    Inside a `score_aware.weighting` that scales this layer's K, an "attention" layer's K pages and protected
    copies hold K / s and its records say so (`layer.{i}.k.scale`, K codec_version 2: format 1.11).

    Returns:
        dict: the records (kind, shapes, tiers, params, components).

    Raises:
        InputError: the cache holds shapes other than the plan's (nothing is written: the writer aborts).
    """
    records = {K.layer_kind(layer): plan.kind}
    for side, x, shape in zip("kv", kv, (plan.k_shape, plan.v_shape)):
        want = (shape[0], plan.stored_tokens(n_tokens), shape[1])
        if tuple(x.shape) != want:
            raise InputError(f"layer {layer} {side}: the cache holds {tuple(x.shape)}; the header would say {want}")
        codec = get_tier(row[side])
        scale = score_aware.scale_of(layer, side) if plan.kind == "attention" else None
        if scale is not None:  # K stored as K / s, format 1.11 (`cartridge.tiers.key_scale`)
            x = key_scale.divided(x, scale)
            writer.add_record(K.layer_key_scale(layer), key_scale.record(scale))
        params = codec.make_params(x, layer, side)
        parts = encode_pages(codec, x, params, page_size)
        for comp in codec.components(shape[1]):
            page_shape = (-(-want[1] // page_size), shape[0], page_size, comp.width)
            if tuple(parts[comp.name].shape) != page_shape:
                raise InputError(f"layer {layer} {side} {comp.name}: pages {tuple(parts[comp.name].shape)}; "
                                 f"the header would say {page_shape}")
            writer.add_extent(layer, side, comp.name, to_numpy(parts[comp.name]))
        if sum(kept):
            writer.add_record(K.layer_protected(layer, side), protect.take(x, *kept))
        records.update({
            K.layer_shape(layer, side): list(shape),
            K.layer_tier(layer, side): codec.name,
            K.layer_codec_version(layer, side): codec.codec_version if scale is None else key_scale.SCALED_VERSION,
            K.layer_params(layer, side): params,
            K.layer_components(layer, side): [{"name": c.name, "dtype": c.dtype, "width": c.width}
                                              for c in codec.components(shape[1])],
        })
    return records
