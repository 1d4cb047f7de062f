"""`build_sharded`: `cartridge.build` on every rank of an MLX distributed group. Every rank prefills its shard of the
document; rank 0 gathers the K/V heads (tensor) or layers (pipeline) and writes one cartridge laid out exactly as a
single-process build."""

import hashlib
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..errors import CartridgeError, InputError
from ..format.writer import check_output_path, check_space
from ..models.loader import LoadedModel
from ..storage.shard import slice_for
from ..tiers import DEFAULT_TIER
from ..write.build import build_result
from ..write.encode import attention_plans, cartridge_bytes, header_extras, kv_caches, write_layers
from ..write.options import DEFAULT_RESERVE, check_options, fit_page_size, schema_and_tokens
from ..write.prefill import prefill
from .agreement import agree, digest_bytes


def _require_kv_caches(model):
    """Refuse a model whose cache is not mlx-lm's full-attention KVCache in every layer."""
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)} - {"KVCache"})
    if kinds:
        raise InputError(f"model uses {', '.join(kinds)}; a sharded build stores full-attention KVCache models "
                         f"only: build it with cartridge.build")


def _global_geometry(model):
    """(n_layers, n_kv_heads, head_dim) of the whole model, from its args (a shard holds fewer)."""
    args = model.args
    attn = next(layer for layer in model.layers if layer is not None).self_attn
    head_dim = getattr(attn, "head_dim", None) or args.hidden_size // args.num_attention_heads
    n_kv = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    return int(args.num_hidden_layers), int(n_kv), int(head_dim)


def _owners(part, group):
    """Layer -> the rank that holds it, from every rank's [first, end) layer range (one all_gather)."""
    ranges = np.array(mx.distributed.all_gather(mx.array(list(part.layers), dtype=mx.int32), group=group))
    return {layer: r for r, (a, b) in enumerate(ranges.reshape(-1, 2)) for layer in range(a, b)}


def _gather_layers(caches, part, geometry, n_tokens, group):
    """Yield every layer's whole (keys, values), (1, n_kv_heads, T, head_dim), on every rank, in layer order.

    Tensor: all_gather of each rank's heads (rank order is head order). Pipeline: all_gather of the
    owner's K/V and zeros elsewhere, keeping the owner's row. Every rank evaluates each gather, so the
    collectives stay in step whether or not the rank writes.
    """
    n_layers, n_kv, head_dim = geometry
    owners = _owners(part, group) if part.mode == "pipeline" else None
    dtype = caches[0].keys.dtype
    for layer in range(n_layers):
        local = layer - part.layers[0]
        if part.mode == "pipeline":
            held = 0 <= local < len(caches)
            xs = ((caches[local].keys, caches[local].values) if held
                  else (mx.zeros((1, n_kv, n_tokens, head_dim), dtype),) * 2)
            # (N, n_kv, T, D) -> the owner's (1, n_kv, T, D)
            out = [mx.distributed.all_gather(x[0, :, :n_tokens], group=group)
                   .reshape(group.size(), n_kv, n_tokens, head_dim)[owners[layer]][None] for x in xs]
        elif part.mode == "tensor":
            c = caches[layer]
            # (h, T, D) per rank -> (N * h, T, D): heads in rank order
            out = [mx.distributed.all_gather(x[0, :, :n_tokens], group=group)[None] for x in (c.keys, c.values)]
        else:
            out = [caches[layer].keys[:, :, :n_tokens], caches[layer].values[:, :, :n_tokens]]
        mx.eval(out)
        if 0 <= local < len(caches):
            caches[local] = None  # free this layer's dense K/V before the next
        yield out[0], out[1]


def build_sharded(document, output, model, group=None, tier=DEFAULT_TIER, k_tier=None, v_tier=None,
                  boundary_protect=0, schema=None, page_size=256, prefill_step=512, force=False, progress=None,
                  source_name=None, reserve=DEFAULT_RESERVE, system=None):
    """`cartridge.build` on every rank of `group` with a sharded model; rank 0 writes the cartridge.

    Every rank prefills its shard (mlx-lm's sharded forward); rank 0 gathers all K/V heads (tensor) or
    layers (pipeline), one layer at a time, and writes one cartridge with the single-process layout.

    Args:
        document (str): the corpus text (the same on every rank).
        output (str | Path): cartridge directory rank 0 creates.
        model (LoadedModel): this rank's model, sharded with `shard_model` (or whole).
        group (mx.distributed.Group | None): the ranks; None means `mx.distributed.init()`.
        tier, k_tier, v_tier, boundary_protect, schema, page_size, prefill_step, force, progress,
            source_name, reserve, system: as `cartridge.build`.

    Returns:
        BuildResult | None: on rank 0; None on the other ranks.

    Raises:
        RankMismatchError: on every rank, with one message, when any rank refused the inputs (an
            output that exists on rank 0, a bad tier ...) or the ranks' models or documents differ.
    """
    group = group or mx.distributed.init()
    options = (tier, k_tier, v_tier, boundary_protect, schema)
    error, tokens, fp = None, [], None
    try:
        if not isinstance(model, LoadedModel):
            raise InputError("pass the model as a LoadedModel (cartridge.distributed.load_sharded_model)")
        fp = model.fingerprint["id"]
        if group.rank() == 0:
            check_output_path(output, force)
        check_options(document, options, page_size, prefill_step, reserve)
        _require_kv_caches(model.model)
        geometry = _global_geometry(model.model)
        schema, mode, tokens, left = schema_and_tokens(document, model, geometry, options, reserve, system, page_size)
        page_size = fit_page_size(page_size, len(tokens))
        if group.rank() == 0:
            check_space(output, cartridge_bytes(schema, geometry[1], geometry[2], len(tokens), page_size))
        part = slice_for(model.model, geometry[0], geometry[1], group.rank(), group.size())
    except CartridgeError as e:
        error = str(e).splitlines()[0] if str(e) else type(e).__name__
    token_digest = hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).digest()
    agree(group, ("model fingerprint", "document tokens"), (digest_bytes(fp), token_digest), error)
    t0 = time.perf_counter()
    caches = prefill(model.model, tokens, prefill_step, progress)
    t1 = time.perf_counter()
    layers = _gather_layers(caches, part, geometry, len(tokens), group)
    if group.rank() != 0:
        for _ in layers:
            pass
        return None
    try:
        path = write_layers(output, model, tokens, kv_caches(layers), schema, attention_plans(geometry), page_size,
                            mode, force, header_extras(document, source_name, system))
    finally:
        for _ in layers:  # a failed write still takes part in the remaining gathers
            pass
    result = build_result(path, tokens, t1 - t0, time.perf_counter() - t0, schema, attention_plans(geometry), left)
    result.prompt_mode = mode
    return result
