"""Attention policies: how decode steps read the prefix pages (issue 4; docs/performance.md "Attention paths").

- "portable": MLX ops over the stored pages (`kernels/portable.py`); every device.
- "fused": the device's flash-decoding kernel reading the stored pages, where the registry has one
  (`cartridge.attention.backends`; a kernel that `needs_proof` is taken by "auto" only once proven here).
- "dequantize-once": decode the prefix into dense pages of the model's dtype at load (more memory,
  no per-step decode work), then attend with the backend's dense path.
- "auto": per layer, the policy measured fastest for its tiers, head_dim and context on this backend
  (`auto_table`: tables from `cartridge bench` runs), within a memory budget (`budget`): a layer whose
  choice is "dequantize-once" decodes only the sides that fit; the others read their stored pages (on
  the CPU, affine K sides with their codes unpacked to bytes where that fits: `unpacked`).
"""

import dataclasses

import mlx.core as mx

from ..errors import InputError
from ..tiers import get_tier
from ..tiers.float16 import Float16Codec
from . import auto_table, backends, budget, unpacked
from .prefix import LayerPrefix
from .pages import decode_pages

POLICIES = ("auto", "fused", "portable", "dequantize-once")
UNCOMPRESSED = ("fp16", "bf16")


class DequantizedCodec(Float16Codec):
    """Dense pages in the model's dtype, made once at load by the "dequantize-once" policy."""

    name = "dequantized"
    kernel_layout = None  # by the pages' dtype instead (`layout.layout_of`)
    dense_pages = True

    def scores(self, q, parts, params):
        if mx.default_device() != mx.cpu:
            return super().scores(q, parts, params)
        # (n_pages, n_kv, P, D) @ (1, n_kv, D, R) -> (n_pages, n_kv, P, R), read as (n_pages, n_kv, R, P):
        # OpenBLAS takes this orientation a quarter faster on x86 (docs/performance.md "Memory on CPU")
        return (parts["values"] @ q.swapaxes(-1, -2)[None]).swapaxes(-1, -2)


DEQUANTIZED = DequantizedCodec()


def resolve(policy):
    """Check a policy name for this backend: "auto" stays "auto" (chosen per layer by `place`).

    Raises:
        InputError: unknown policy, or "fused" where this device has no fused kernel (`backends.kernel`).
    """
    if policy not in POLICIES:
        raise InputError(f"attention policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
    if policy == "fused" and backends.kernel(backends.device()) is None:
        have = ", ".join(b.device for b in backends.REGISTRY if b.policy == "fused")
        raise InputError(f"no fused attention kernel runs on this device ({backends.device()}); they run on: {have}")
    return policy


def allowed(prefix=None, head_dim=None, prove=False):
    """The concrete policies this backend runs (for `prefix`, a layer's pages of `head_dim`: "fused" only where
    the device's kernel reads it, and with `prove` only once a kernel that needs proof has passed it here:
    `backends.proof.proven`, which runs the check on first use)."""
    from .backends import proof  # (it imports the cache, so mlx-lm: not at import, for `cartridge inspect`)

    fused = backends.kernel(backends.device())
    if fused is not None and prefix is not None:
        if not fused.supports(prefix, head_dim, "decode") or (prove and not proof.proven(fused, prefix, head_dim)):
            fused = None
    return backends.policies(fused is not None)


def _allowed_by_name(tiers, head_dim=None):
    """`allowed()` for a layer known by its tier names only (a header): "fused" where the kernel reads both and,
    for a kernel that needs proof, a stored proof for them at `head_dim` passed."""
    fused = backends.kernel(backends.device())
    if fused is not None:
        from .backends import proof  # (it imports the cache, so mlx-lm: on a fused device only, for inspect)

        if not (fused.reads([get_tier(t) for t in tiers]) and proof.proven_by_name(fused, tiers, head_dim)):
            fused = None
    return backends.policies(fused is not None)


def dequantize(prefix, dtype):
    """The same prefix with both sides decoded to dense (n_pages, n_kv_heads, P, head_dim) pages (`decode_pages`:
    a chunk of pages at a time, the protected tokens' fp16 copies in place)."""
    k, v = (decode_pages(codec, parts, params, dtype, prefix.protected, side, prefix.n_tokens)
            for codec, parts, params, side in ((prefix.k_codec, prefix.k_parts, prefix.k_params, "k"),
                                               (prefix.v_codec, prefix.v_parts, prefix.v_params, "v")))
    return LayerPrefix(DEQUANTIZED, {"values": k}, DEQUANTIZED, {"values": v}, prefix.n_tokens,
                       key_scale=prefix.key_scale)


def backend_for(policy, prefix, head_dim):
    """The backend record of one layer for a concrete policy (`AttentionBackend.build`), or None for the portable
    path.

    "fused" and "dequantize-once" layers take the device's kernel where it reads them (dense pages too). A
    kernel that needs proof runs under "fused" even if never checked here (it warns once:
    `proof.warn_unchecked`); under the other policies only once proven for these pages (`proof.proven`).
    The fused kernel takes one head_dim for K and V; a layer whose widths differ takes the portable path.
    """
    from .backends import proof  # (it imports the cache, so mlx-lm: not at import, for `cartridge inspect`)

    fused = backends.kernel(backends.device()) if policy != "portable" else None
    if fused is None or not fused.supports(prefix, head_dim, "decode"):
        return None
    if policy == "fused":
        proof.warn_unchecked(fused, prefix, head_dim)
    elif not proof.proven(fused, prefix, head_dim):
        return None
    return fused.build(prefix)


def _reads_prefill(policy):
    """The device entry that reads a question's prefill over the pages itself (the CPU's: no fused decode
    kernel, `backends.cpu`), or None: under "portable" (MLX ops over the stored pages, the reference) and on a
    device whose fused kernel reads prefills itself (`backend_for`)."""
    dev = backends.get(backends.device())
    return dev if policy != "portable" and dev is not None and dev.policy is None else None


def _prefill_layers(prefixes, choices, head_dims):
    """(layer, ((n_pages, n_kv_heads, P), K head_dim, V head_dim)) of each layer whose prefill `_reads_prefill`."""
    out = []
    for i, (p, c, dims) in enumerate(zip(prefixes, choices, head_dims)):
        dev = None if c is None else _reads_prefill(c[0])
        if dev is not None and dev.supports(p, dims[0], "prefill"):
            out.append((i, (next(iter(p.k_parts.values())).shape[:3], *dims)))
    return out


def _held(layer):
    """Bytes a loaded layer holds: its pages, and for a decoded layer kind (dense, window) also its dense K/V."""
    if isinstance(layer, LayerPrefix):
        return layer.nbytes
    if hasattr(layer, "parts"):  # a ListLayer: its caches
        return sum(_held(p) for p in layer.parts)
    return layer.nbytes + (layer.prefix.nbytes if hasattr(layer, "prefix") else 0)


def _stored(layer):
    """Bytes of a loaded layer's stored pages (or recurrent arrays) as the file holds them: not the dense K/V a
    dense or window layer is decoded into at load (issue 47: `ask` counted a window layer's float32 decode as
    stored)."""
    if hasattr(layer, "parts"):
        return sum(_stored(p) for p in layer.parts)
    return layer.prefix.nbytes if hasattr(layer, "prefix") else layer.nbytes


def _choices(prefixes, policy, head_dims, n_tokens=None, entries=None):
    """Per layer (policy, reason) for page-attended layers, None for the others."""
    if policy != "auto":
        return [(policy, f"{policy}: asked for") if isinstance(p, LayerPrefix) else None for p in prefixes]
    entries = auto_table.merged_entries() if entries is None else entries
    out = []
    for p, dims in zip(prefixes, head_dims):
        if not isinstance(p, LayerPrefix):  # (a ListLayer's dims are a list of pairs: placed by itself)
            out.append(None)
            continue
        k_dim = dims[0]
        tiers = (p.k_codec.name, p.v_codec.name)
        out.append(auto_table.choose(entries, backends.device(), tiers, k_dim, p.n_tokens, "decode",
                                      allowed(p, k_dim, prove=True)))
    return out


def _sides(prefixes, choices, head_dims, dtype, unpack):
    """The budget's candidate sides: both sides of every layer whose policy is dequantize-once; with
    `unpack`, the sizes of unpacked codes for the sides whose tier has them."""
    sides = []
    for i, (p, c, dims) in enumerate(zip(prefixes, choices, head_dims)):
        if c is None or c[0] != "dequantize-once":
            continue
        for side, dim, codec, parts in (("k", dims[0], p.k_codec, p.k_parts), ("v", dims[1], p.v_codec, p.v_parts)):
            shape = (*next(iter(parts.values())).shape[:3], dim)
            sizes = unpacked.sizes(codec, shape) if unpack and unpacked.can_unpack(codec) else None
            sides.append(budget.side_sizes(i, side, sum(a.nbytes for a in parts.values()), shape, dtype, sizes))
    return sides


def _decoded(p, sides, dtype, unpack=(), via_unpacked=False, lazy=False):
    """`p` with the sides in `sides` decoded to dense pages of `dtype` and those in `unpack` unpacked
    (`unpacked.unpack`), each side evaluated before the next (one side's buffers at a time). With
    `via_unpacked`, an affine side is decoded from its unpacked codes: the same values, and on the CPU
    half the temporaries of `mx.dequantize` (int8, 6,450 tokens: 29 MB against 56 MB for 27 MB of values).
    With `lazy` (no memory budget), the decode is left to the first forward pass (`decode_pages`)."""
    out = {"k": (p.k_codec, p.k_parts), "v": (p.v_codec, p.v_parts)}
    for side in sorted(set(sides) | set(unpack)):
        codec, parts = out[side]
        params = p.k_params if side == "k" else p.v_params
        if side in sides:  # a dense side takes the protected tokens' fp16 copies in place
            if via_unpacked and unpacked.can_unpack(codec):
                codec, parts = unpacked.UnpackedCodec(codec), unpacked.unpack(codec, parts)
            values = decode_pages(codec, parts, params, dtype, p.protected, side, p.n_tokens, lazy)
            out[side] = DEQUANTIZED, {"values": values}
        else:
            out[side] = unpacked.UnpackedCodec(codec), unpacked.unpack(codec, parts)
        if not lazy:
            mx.eval(list(out[side][1].values()))
    # a side still compressed reads the protected copies on the portable path; two dense sides do not
    protected = None if set(sides) == {"k", "v"} else p.protected
    return LayerPrefix(*out["k"], *out["v"], p.n_tokens, p.k_params, p.v_params, None, protected, p.key_scale)


def _compressed(tiers):
    """True if any of the tier names stores fewer bytes than fp16 (the default memory budget's case)."""
    return any(t not in UNCOMPRESSED for t in tiers)


def _name(choice, sides, unpack=()):
    if choice is None:
        return None
    if choice[0] != "dequantize-once" or set(sides) == {"k", "v"}:
        return choice[0]
    packed = f"{'K' if 'k' in unpack else 'V'} unpacked" if unpack else ""
    if not sides:
        return f"portable ({packed})" if packed else "portable"
    return f"dequantize-once ({'K' if 'k' in sides else 'V'} only{', ' + packed if packed else ''})"


def _layers(choices, decoded, unpack):
    """The report's per-layer rows: {"layer", "policy", "reason"} (None for layers not page-attended)."""
    dense, packed = _by_layer(decoded), _by_layer(unpack)
    return [None if c is None else {"layer": i, "policy": _name(c, dense.get(i, set()), packed.get(i, set())),
                                    "reason": c[1]} for i, c in enumerate(choices)]


def _by_layer(keys):
    out = {}
    for layer, side in keys:
        out.setdefault(layer, set()).add(side)
    return out


def place(prefixes, policy, dtype, head_dims, max_memory=None, entries=None, unpack=None):
    """Choose each layer's policy, decode what the memory budget allows, and lay out each layer's backend record.

    Args:
        prefixes (list): one per layer, as stored: a LayerPrefix for a page-attended layer; a ListLayer
            has its parts placed (each list by itself, under the same policy); other layers
            (`cartridge.attention.layers`) pass through unchanged. The list is updated in place
            layer by layer, so a decoded layer's stored pages are freed before the next one is decoded.
        policy (str): from `resolve`: a concrete policy, or "auto" (per layer from the measured table,
            `cartridge.attention.auto_table`).
        dtype (mx.Dtype): the model's activation dtype (dense pages use it).
        head_dims (list): per layer (K head_dim, V head_dim), a list of them for a ListLayer; ignored
            for other layers.
        max_memory (int | None): the most bytes the prefix may hold, while loading and after (stored
            pages + dense pages + one decode's buffers). None: with "auto", stored x 1.25 + one decoded
            layer (`budget.default_budget`) when any page-attended layer is stored compressed (an fp16/bf16
            cartridge decodes as before: its pages are already the size of dense ones); with a concrete
            policy, no limit. Sides that do not fit keep their stored pages and take the portable path.
        entries (list | None): the table for "auto" (default: shipped + user, `auto_table.merged_entries`).
        unpack (bool | None): under a limit, first unpack the K sides of affine tiers to one byte per code
            (`cartridge.attention.unpacked`; `budget.plan_unpacked`). None: on the CPU only, where MLX's
            quantized scores are scalar code. Default: None.

    Returns:
        tuple: (prefixes, report); report is {"policy": one name, or "mixed"; "reason": why (the first
        layer's measurement, and the budget if it limited decoding); "layers": per layer {"layer",
        "policy", "reason"} (None for layers that are not page-attended); "memory": {"budget_bytes",
        "stored_bytes", "resident_bytes", "planned_peak_bytes"}}.
    """
    from .layers import ListLayer  # (loads mlx-lm's cache classes: not at import, for `cartridge inspect`)

    unpack = backends.device() == "cpu" if unpack is None else unpack
    for i, p in enumerate(prefixes):  # a CacheList layer: its parts as layers of their own
        if isinstance(p, ListLayer):
            parts = place(list(p.parts), policy, dtype, head_dims[i], max_memory, entries, unpack)[0]
            prefixes[i] = ListLayer(parts)
    choices = _choices(prefixes, policy, head_dims, entries=entries)
    sides = _sides(prefixes, choices, head_dims, dtype, unpack)
    held, stored = sum(_held(p) for p in prefixes), sum(_stored(p) for p in prefixes)
    limit = max_memory
    stored_tiers = [t for p in prefixes if isinstance(p, LayerPrefix) for t in (p.k_codec.name, p.v_codec.name)]
    if limit is None and policy == "auto" and _compressed(stored_tiers):
        limit = budget.default_budget(held, sides)
    layers = _prefill_layers(prefixes, choices, head_dims)
    decoded, packed, resident, peak, prefill = _plan_memory(sides, held, limit, layers, dtype)
    dense, unpacking = _by_layer(decoded), _by_layer(packed)
    out = prefixes
    for i, (p, c) in enumerate(zip(prefixes, choices)):
        if c is None:
            continue
        q = p
        if c[0] == "dequantize-once":
            q = _decoded(p, dense.get(i, set()), dtype, unpacking.get(i, set()), unpack, lazy=limit is None)
        k_dim, v_dim = head_dims[i]
        record = backend_for(c[0], q, k_dim) if k_dim == v_dim else None
        dev = _reads_prefill(c[0]) if i in prefill and record is None else None
        if dev is not None and dev.supports(q, k_dim, "prefill"):
            record = dev.build(q)
        extra = record.held_bytes(dtype) if hasattr(record, "held_bytes") else 0  # a copy the backend lays out
        if extra and limit is not None and resident + extra > limit:
            record = record.without_copy()
        else:
            resident += extra
        out[i] = dataclasses.replace(q, backend=record)
        if limit is not None:  # within a budget each layer's decode ends (its temporaries freed) before the next
            mx.eval([list(out[i].k_parts.values()), list(out[i].v_parts.values())])
    return out, _report(_layers(choices, decoded, packed), sides, decoded, packed, limit, stored, resident, peak,
                        max(prefill.values(), default=0))


def _plan_memory(sides, held, limit, layers, dtype):
    """`budget.plan_unpacked`, then a question's prefill over the pages decoded for the call on the `layers`
    ((layer, shapes) of `_prefill_layers`) that keep a side not decoded to dense pages (over float32 pages the
    portable path is as fast: docs/performance.md), where the resident bytes leave room for the largest of them
    within `limit` (`budget.prefill_reserve`; else none: the portable path).

    Returns:
        tuple: (decoded, unpacked, resident, peak, prefill): as `plan_unpacked`, and {layer: the bytes its
        prefill holds} for the layers that take it.
    """
    decoded, packed, resident, peak = budget.plan_unpacked(sides, held, limit)
    dense = set(decoded)
    prefill = {i: budget.prefill_reserve([shapes], dtype) for i, shapes in layers
               if not {(i, "k"), (i, "v")} <= dense}
    most = max(prefill.values(), default=0)
    if limit is not None and resident + most > limit:
        prefill, most = {}, 0
    return decoded, packed, resident, max(peak, resident + most), prefill


def _report(layers, sides, decoded, packed, limit, stored, resident, peak, prefill=0):
    names = {x["policy"] for x in layers if x}
    first = next((x for x in layers if x), None)
    reason = first["reason"] if first else "no page-attended layers"
    if len(names) > 1:
        count = {n: sum(1 for x in layers if x and x["policy"] == n) for n in sorted(names)}
        reason = ", ".join(f"{n} on {c} layer{'' if c == 1 else 's'}" for n, c in count.items()) + f"; {reason}"
    if len(decoded) < len(sides):
        reason += (f"; memory budget {limit:,} bytes: {len(decoded)} of {len(sides)} layer-sides decoded, "
                   f"the others read their stored pages (portable)")
        if packed:
            reason += f", {len(packed)} of them with their codes unpacked to bytes"
    if prefill:
        reason += f"; a question's prefill decodes each layer's pages for the call ({prefill / 1e6:,.1f} MB at most)"
    return {"policy": names.pop() if len(names) == 1 else ("mixed" if names else "none"), "reason": reason,
            "layers": layers,
            "memory": {"budget_bytes": limit, "stored_bytes": stored, "resident_bytes": resident,
                       "planned_peak_bytes": peak}}


def plan_from_header(info, dtype, max_memory=None, entries=None):
    """What `place` does under "auto" for a cartridge, from its header alone (no pages read, no model).

    Args:
        info (CartridgeInfo): the header. dtype (mx.Dtype): the model's activation dtype (float32 on CPU).
        max_memory (int | None): as in `place`. entries (list | None): the table (default: shipped + user).

    Returns:
        dict: {"policy", "reason", "memory"} as in `place`'s report (held: the stored pages, and the dense K/V
        that dense and window layers are decoded into at load).
    """
    entries = auto_table.merged_entries() if entries is None else entries
    choices, sides, layers = [], [], []
    stored_bytes = sum(e.page_bytes * e.shape[0] for ext in info.extents.values() for e in ext)
    held = stored_bytes + sum(_decoded_at_load(unit, dtype) for _, unit in info.units())
    for i, meta in enumerate(info.layers):
        extents = {side: info.extents.get((i, side), []) for side in ("k", "v", "s")}
        stored = {side: sum(e.page_bytes * e.shape[0] for e in ex) for side, ex in extents.items()}
        if meta.kind != "attention":
            choices.append(None)
            continue
        tiers = (info.tiers[i]["k"], info.tiers[i]["v"])
        c = auto_table.choose(entries, backends.device(), tiers, meta.k_shape[1], meta.count, "decode",
                               _allowed_by_name(tiers, meta.k_shape[1]))
        choices.append(c)
        if _reads_prefill(c[0]) is not None:
            layers.append((i, (extents["k"][0].shape[:3], meta.k_shape[1], meta.v_shape[1])))
        if c[0] == "dequantize-once":
            for side, shape in (("k", meta.k_shape), ("v", meta.v_shape)):
                dims = (*extents[side][0].shape[:3], shape[1])
                codec = get_tier(info.tiers[i][side])
                unpack = backends.device() == "cpu" and unpacked.can_unpack(codec)
                sizes = unpacked.sizes(codec, dims) if unpack else None
                sides.append(budget.side_sizes(i, side, stored[side], dims, dtype, sizes))
    limit = max_memory
    if limit is None and _compressed(info.tiers[i][s] for i, c in enumerate(choices) if c for s in ("k", "v")):
        limit = budget.default_budget(held, sides)
    decoded, packed, resident, peak, prefill = _plan_memory(sides, held, limit, layers, dtype)
    return _report(_layers(choices, decoded, packed), sides, decoded, packed, limit, stored_bytes, resident, peak,
                   max(prefill.values(), default=0))


def _decoded_at_load(unit, dtype):
    """Bytes of the dense K/V a "dense" or "window" layer (`unit`, a LayerInfo) is decoded into at load
    (`attention.layers.DenseLayer`), held beside its stored pages; 0 for the other kinds."""
    if unit.kind not in ("dense", "window"):
        return 0
    return unit.count * (unit.k_shape[0] * unit.k_shape[1] + unit.v_shape[0] * unit.v_shape[1]) * dtype.size
