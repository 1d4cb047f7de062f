"""Attention policies: how decode steps read the prefix pages (issue 4; docs/performance.md "Attention paths").

- "portable": MLX ops over the stored pages (`kernels/portable.py`); CPU, Metal and CUDA.
- "fused": one flash-decoding kernel per backend reading the stored pages (`kernels/cuda.py`); CUDA.
- "dequantize-once": decode the prefix into dense pages of the model's dtype at load (more memory,
  no per-step decode work), then attend with the backend's dense path.
- "auto": per layer, the policy measured fastest for its tiers, head_dim and context on this backend
  (`calibration`: tables from `cartridge bench` runs), within a memory budget (`budget`): a layer whose
  choice is "dequantize-once" decodes only the sides that fit; the others read their stored pages.
"""

import mlx.core as mx

from ..errors import InputError
from ..tiers import protect
from ..tiers.float16 import Float16Codec
from . import budget, calibration
from .cache import LayerPrefix
from .layers import ListLayer

POLICIES = ("auto", "fused", "portable", "dequantize-once")
UNCOMPRESSED = ("fp16", "bf16")
AUTO = calibration.FALLBACK  # the choice where the table has no measurement


def backend():
    """"cpu", "cuda" or "metal": where the default device runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


class DequantizedCodec(Float16Codec):
    """Dense pages in the model's dtype, made once at load by the "dequantize-once" policy."""

    name = "dequantized"


DEQUANTIZED = DequantizedCodec()


def resolve(policy):
    """Check a policy name for this backend: "auto" stays "auto" (chosen per layer by `place`).

    Raises:
        InputError: unknown policy, or "fused" where no fused kernel exists for the backend.
    """
    if policy not in POLICIES:
        raise InputError(f"attention policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
    if policy == "fused" and backend() != "cuda":
        raise InputError(f"the fused attention kernels need the CUDA backend; this device is {backend()}")
    return policy


def allowed(prefix=None, head_dim=None):
    """The concrete policies this backend runs (for `prefix`, a layer's pages of `head_dim`: "fused" only where
    a fused kernel reads its tiers)."""
    if backend() != "cuda":
        return ("portable", "dequantize-once")
    if prefix is not None:
        from .kernels import cuda

        if not cuda.supported(prefix, head_dim):
            return ("portable", "dequantize-once")
    return ("fused", "portable", "dequantize-once")


def dequantize(prefix, dtype):
    """The same prefix with both sides decoded to dense (n_pages, n_kv_heads, P, head_dim) pages."""
    k = prefix.k_codec.decode(prefix.k_parts, prefix.k_params).astype(dtype)
    v = prefix.v_codec.decode(prefix.v_parts, prefix.v_params).astype(dtype)
    if prefix.protected is not None:  # dense pages take the fp16 copies in place
        k, v = (protect.overwrite(x, prefix.protected, side, prefix.n_tokens) for x, side in ((k, "k"), (v, "v")))
    return LayerPrefix(DEQUANTIZED, {"values": k}, DEQUANTIZED, {"values": v}, prefix.n_tokens)


def kernel_for(policy, prefix, head_dim):
    """The fused attention of one layer for a concrete policy, or None for the portable path.

    The fused kernel takes one head_dim for K and V; a layer whose widths differ takes the portable path.
    No fused kernel reads protected tokens' fp16 copies either: such a layer takes the portable path.
    """
    if policy == "portable" or backend() != "cuda" or prefix.protected is not None:
        return None
    from .kernels import cuda

    return cuda.FusedAttention(prefix) if cuda.supported(prefix, head_dim) else None


def _held(layer):
    """Bytes a loaded layer holds: its pages, and for a decoded layer kind also its dense K/V."""
    if isinstance(layer, LayerPrefix):
        return layer.nbytes
    return layer.nbytes + (layer.prefix.nbytes if hasattr(layer, "prefix") else 0)


def _choices(prefixes, policy, head_dims, n_tokens=None, entries=None):
    """Per layer (policy, reason) for page-attended layers, None for the others."""
    if policy != "auto":
        return [(policy, f"{policy}: asked for") if isinstance(p, LayerPrefix) else None for p in prefixes]
    entries = calibration.merged_entries() if entries is None else entries
    out = []
    for p, (k_dim, _) in zip(prefixes, head_dims):
        if not isinstance(p, LayerPrefix):
            out.append(None)
            continue
        tiers = (p.k_codec.name, p.v_codec.name)
        out.append(calibration.choose(entries, backend(), tiers, k_dim, p.n_tokens, "decode", allowed(p, k_dim)))
    return out


def _sides(prefixes, choices, head_dims, dtype):
    """The budget's candidate sides: both sides of every layer whose policy is dequantize-once."""
    sides = []
    for i, (p, c, dims) in enumerate(zip(prefixes, choices, head_dims)):
        if c is None or c[0] != "dequantize-once":
            continue
        for side, dim, parts in (("k", dims[0], p.k_parts), ("v", dims[1], p.v_parts)):
            shape = (*next(iter(parts.values())).shape[:3], dim)
            sides.append(budget.side_sizes(i, side, sum(a.nbytes for a in parts.values()), shape, dtype))
    return sides


def _decoded(p, sides, dtype):
    """`p` with the sides in `sides` decoded to dense pages of `dtype`, each evaluated before the next."""
    if sides == {"k", "v"}:
        return dequantize(p, dtype)
    k_codec, k_parts, v_codec, v_parts = p.k_codec, p.k_parts, p.v_codec, p.v_parts
    for side in sorted(sides):  # one side: it takes the protected tokens' fp16 copies in place
        x = (p.k_codec if side == "k" else p.v_codec).decode(p.k_parts if side == "k" else p.v_parts,
                                                             p.k_params if side == "k" else p.v_params).astype(dtype)
        if p.protected is not None:
            x = protect.overwrite(x, p.protected, side, p.n_tokens)
        mx.eval(x)
        if side == "k":
            k_codec, k_parts = DEQUANTIZED, {"values": x}
        else:
            v_codec, v_parts = DEQUANTIZED, {"values": x}
    # the stored side still reads the protected copies on the portable path
    return LayerPrefix(k_codec, k_parts, v_codec, v_parts, p.n_tokens, p.k_params, p.v_params, None, p.protected)


def _compressed(tiers):
    """True if any of the tier names stores fewer bytes than fp16 (the default memory budget's case)."""
    return any(t not in UNCOMPRESSED for t in tiers)


def _name(choice, sides):
    if choice is None:
        return None
    if choice[0] != "dequantize-once" or sides == {"k", "v"}:
        return choice[0]
    return "portable" if not sides else f"dequantize-once ({'K' if 'k' in sides else 'V'} only)"


def place(prefixes, policy, dtype, head_dims, max_memory=None, entries=None):
    """Choose each layer's policy, decode what the memory budget allows, and attach the kernels.

    Args:
        prefixes (list): one per layer, as stored: a LayerPrefix for a page-attended layer; a ListLayer
            has its parts placed (each list by itself, under the same policy); other layers
            (`cartridge.attention.layers`) pass through unchanged. The list is updated in place
            layer by layer, so a decoded layer's stored pages are freed before the next one is decoded.
        policy (str): from `resolve`: a concrete policy, or "auto" (per layer from the measured table,
            `cartridge.attention.calibration`).
        dtype (mx.Dtype): the model's activation dtype (dense pages use it).
        head_dims (list): per layer (K head_dim, V head_dim), a list of them for a ListLayer; ignored
            for other layers.
        max_memory (int | None): the most bytes the prefix may hold, while loading and after (stored
            pages + dense pages + one decode's buffers). None: with "auto", stored x 1.25 + one decoded
            layer (`budget.default_budget`) when any page-attended layer is stored compressed (an fp16/bf16
            cartridge decodes as before: its pages are already the size of dense ones); with a concrete
            policy, no limit. Sides that do not fit keep
            their stored pages and take the portable path.
        entries (list | None): the table for "auto" (default: shipped + user, `calibration.merged_entries`).

    Returns:
        tuple: (prefixes, report); report is {"policy": one name, or "mixed"; "reason": why (the first
        layer's measurement, and the budget if it limited decoding); "layers": per layer {"layer",
        "policy", "reason"} (None for layers that are not page-attended); "memory": {"budget_bytes",
        "stored_bytes", "resident_bytes", "planned_peak_bytes"}}.
    """
    for i, p in enumerate(prefixes):  # a CacheList layer: its parts as layers of their own
        if isinstance(p, ListLayer):
            prefixes[i] = ListLayer(place(list(p.parts), policy, dtype, head_dims[i], max_memory, entries)[0])
    choices = _choices(prefixes, policy, head_dims, entries=entries)
    sides = _sides(prefixes, choices, head_dims, dtype)
    held = sum(_held(p) for p in prefixes)
    limit = max_memory
    stored_tiers = [t for p in prefixes if isinstance(p, LayerPrefix) for t in (p.k_codec.name, p.v_codec.name)]
    if limit is None and policy == "auto" and _compressed(stored_tiers):
        limit = budget.default_budget(held, sides)
    decoded, resident, peak = budget.plan(sides, held, limit)
    by_layer = {}
    for layer, side in decoded:
        by_layer.setdefault(layer, set()).add(side)
    out = prefixes
    for i, (p, c) in enumerate(zip(prefixes, choices)):
        if c is None:
            continue
        q = _decoded(p, by_layer.get(i, set()), dtype) if c[0] == "dequantize-once" else p
        k_dim, v_dim = head_dims[i]
        kernel = kernel_for(c[0], q, k_dim) if k_dim == v_dim else None
        out[i] = LayerPrefix(q.k_codec, q.k_parts, q.v_codec, q.v_parts, q.n_tokens, q.k_params, q.v_params, kernel,
                             q.protected)
        mx.eval([list(out[i].k_parts.values()), list(out[i].v_parts.values())])
    layers = [None if c is None else {"layer": i, "policy": _name(c, by_layer.get(i, set())), "reason": c[1]}
              for i, c in enumerate(choices)]
    return out, _report(layers, sides, decoded, limit, held, resident, peak)


def _report(layers, sides, decoded, limit, held, resident, peak):
    names = {x["policy"] for x in layers if x}
    first = next((x for x in layers if x), None)
    reason = first["reason"] if first else "no page-attended layers"
    if len(names) > 1:
        count = {n: sum(1 for x in layers if x and x["policy"] == n) for n in sorted(names)}
        reason = ", ".join(f"{n} on {c} layers" for n, c in count.items()) + f"; {reason}"
    if len(decoded) < len(sides):
        reason += (f"; memory budget {limit:,} bytes: {len(decoded)} of {len(sides)} layer-sides decoded, "
                   f"the others read their stored pages (portable)")
    return {"policy": names.pop() if len(names) == 1 else ("mixed" if names else "none"), "reason": reason,
            "layers": layers,
            "memory": {"budget_bytes": limit, "stored_bytes": held, "resident_bytes": resident,
                       "planned_peak_bytes": peak}}


def prepare(prefixes, policy, dtype, head_dims, max_memory=None):
    """`place` without the report: the prepared prefixes (kept for `cartridge.distributed`)."""
    return place(list(prefixes), policy, dtype, head_dims, max_memory)[0]


def plan_header(info, dtype, max_memory=None, entries=None):
    """What `place` does under "auto" for a cartridge, from its header alone (no pages read, no model).

    Args:
        info (CartridgeInfo): the header. dtype (mx.Dtype): the model's activation dtype (float32 on CPU).
        max_memory (int | None): as in `place`. entries (list | None): the table (default: shipped + user).

    Returns:
        dict: {"policy", "reason", "memory"} as in `place`'s report (held bytes: the stored pages only).
    """
    entries = calibration.merged_entries() if entries is None else entries
    choices, sides, held = [], [], 0
    for i, meta in enumerate(info.layers):
        extents = {side: info.extents.get((i, side), []) for side in ("k", "v", "s")}
        stored = {side: sum(e.page_bytes * e.shape[0] for e in ex) for side, ex in extents.items()}
        held += sum(stored.values())
        if meta.kind != "attention":
            choices.append(None)
            continue
        tiers = (info.tiers[i]["k"], info.tiers[i]["v"])
        c = calibration.choose(entries, backend(), tiers, meta.k_shape[1], meta.count, "decode", allowed())
        choices.append(c)
        if c[0] == "dequantize-once":
            for side, shape in (("k", meta.k_shape), ("v", meta.v_shape)):
                pages = extents[side][0].shape
                sides.append(budget.side_sizes(i, side, stored[side], (*pages[:3], shape[1]), dtype))
    limit = max_memory
    if limit is None and _compressed(info.tiers[i][s] for i, c in enumerate(choices) if c for s in ("k", "v")):
        limit = budget.default_budget(held, sides)
    decoded, resident, peak = budget.plan(sides, held, limit)
    by_layer = {}
    for layer, side in decoded:
        by_layer.setdefault(layer, set()).add(side)
    layers = [None if c is None else {"layer": i, "policy": _name(c, by_layer.get(i, set())), "reason": c[1]}
              for i, c in enumerate(choices)]
    return _report(layers, sides, decoded, limit, held, resident, peak)
