"""Memory budget of a loaded prefix: which (layer, side) pages are decoded to dense, which are unpacked,
and which stay as stored.

Decoding a side into dense pages ("dequantize-once") makes its attention faster where compute is scarce
(the CPU) and costs its dense bytes instead of its stored bytes. `plan_decoded` decides side by side, K sides
first (scores over compressed K are the slower half on CPU: docs/performance.md "Memory on CPU"), in layer
order, and decodes a side only if the bytes held while it is decoded (all stored pages, the sides decoded
so far and this side's decode buffers) stay within the budget; the rest keep their stored pages and take
the portable path. `plan_unpacked` first gives the K sides that can be unpacked (affine codes, one byte
each: `cartridge.attention.unpacked`, the CPU) their unpacked codes, which cost far fewer bytes than dense
pages for most of their speed, keeping room for the float32 cast a decode step makes of one such side.
The default budget is the stored bytes x 1.25 + one layer decoded (`default_budget`).
"""

from dataclasses import dataclass, replace

from . import pages

STORED_FACTOR = 1.25


class MemoryBudgetWarning(UserWarning):
    """A memory budget asked for could not be kept as asked (`notes`)."""


@dataclass(frozen=True)
class Side:
    """One (layer, side) a plan may decode.

    Attributes:
        layer (int), side (str "k"|"v"): where. stored (int): bytes of its stored pages.
        dense (int): bytes of its dense pages in the dequantize dtype.
        transient (int): bytes its decode holds besides the stored pages: the dense pages, one chunk's
            float32 decode with its temporaries and its cast (`pages.decode_pages`), and the unpacked codes it is
            decoded from where it can be unpacked.
        unpacked (int): bytes it holds with its codes unpacked; 0 where it cannot be unpacked.
        unpack_transient (int): bytes the unpacking holds besides the stored and the unpacked arrays.
        step (int): bytes a decode step holds while it reads this side unpacked (its float32 cast).
    """

    layer: int
    side: str
    stored: int
    dense: int
    transient: int
    unpacked: int = 0
    unpack_transient: int = 0
    step: int = 0


def side_sizes(layer, side, stored, shape, dtype, unpacking=None):
    """A `Side` from its stored bytes and (n_pages, n_kv_heads, page_size, head_dim) dense shape.

    Args:
        unpacking (tuple | None): (unpacked, unpack_transient, step) bytes (`unpacked.sizes`) of a side
            that may be unpacked; None for one that may not. Default: None.
    """
    per_page = shape[1] * shape[2] * shape[3]
    elements = shape[0] * per_page
    dense = elements * dtype.size
    chunk = min(elements, max(1, pages.DECODE_CHUNK // per_page) * per_page)  # elements decoded at once
    per_element = pages.DECODE_BYTES + (dtype.size if dtype.size != 4 else 0)  # float32 decode, then its cast
    unpacking = unpacking or (0, 0, 0)
    return Side(layer, side, stored, dense, dense + chunk * per_element + unpacking[0], *unpacking)


def default_budget(stored, sides):
    """stored x 1.25 + one layer: the most dense bytes of one layer's K and V (0 with none to decode).

    Args:
        stored (int): bytes of every layer's stored pages (and other held arrays).
        sides (list[Side]): the sides that may be decoded.
    """
    per_layer = {}
    for s in sides:
        per_layer[s.layer] = per_layer.get(s.layer, 0) + s.dense
    return int(stored * STORED_FACTOR) + max(per_layer.values(), default=0)


def plan_decoded(sides, held, budget, reserve=0):
    """Which sides to decode within `budget` bytes.

    Sides are decoded at load layer by layer, so the peak is bounded whatever the order: while a side
    is decoded, every other side is at most as it is after, and this one holds its stored pages and its
    decode buffers. A side is decoded if that bound stays within the budget for every side decoded.

    Args:
        sides (list[Side]): the candidates (layers whose policy is dequantize-once).
        held (int): bytes held before any decode: every stored page and every other held array.
        budget (int | None): the most bytes held at any moment; None decodes every side.
        reserve (int): bytes held beside the resident ones after loading (a decode step's buffers), which
            the budget must also leave room for. Default: 0.

    Returns:
        tuple: (decoded, resident, peak): the (layer, side) to decode, K sides then V sides, each in layer
        order; the bytes held after; the most held while decoding (this accounting: MLX's own
        temporaries are not in it).
    """
    order = sorted(sides, key=lambda s: (s.side != "k", s.layer))
    decoded, resident, worst = [], held, reserve
    for s in order:
        grown, extra = s.dense - s.stored, s.transient - (s.dense - s.stored)  # bytes after; more while decoding
        if budget is not None and resident + grown + max(worst, extra) > budget:
            continue
        decoded.append((s.layer, s.side))
        resident, worst = resident + grown, max(worst, extra)
    return decoded, resident, resident + worst if decoded else held


def plan_unpacked(sides, held, budget):
    """`plan_decoded` after unpacking every K side that can be unpacked, if all of them fit `budget`.

    The K sides are unpacked in layer order; they fit if, for each, the bytes held while it is unpacked
    (the sides before it as after, its stored pages, its unpacked arrays and temporaries) and the bytes
    held after it plus the float32 cast a decode step makes of the largest unpacked side stay within the
    budget. Then `plan_decoded` decodes sides to dense (an unpacked one from its stored pages instead of unpacking
    it) within the budget less that cast. If not all of them fit, nothing is unpacked (`plan_decoded` alone):
    a few unpacked sides gain less than the dense ones their cast's room would hold.

    Args:
        sides (list[Side]): the candidates. held (int): bytes held before. budget (int | None): None
            unpacks nothing and decodes every side (as `plan_decoded`).

    Returns:
        tuple: (decoded, unpacked, resident, peak): `plan_decoded`'s decoded sides; the (layer, side) that are
        unpacked and not decoded, in layer order; the bytes held after; the most held while loading or
        while a decode step reads an unpacked side (this accounting).
    """
    candidates = sorted((s for s in sides if s.unpacked and s.side == "k"), key=lambda s: s.layer)
    resident, peak, reserve = held, held, 0
    for s in candidates:
        during = resident + s.unpacked + s.unpack_transient
        resident, reserve = resident + s.unpacked - s.stored, max(reserve, s.step)
        peak = max(peak, during)
    if budget is None or not candidates or max(peak, resident + reserve) > budget:
        decoded, resident, peak = plan_decoded(sides, held, budget)
        return decoded, [], resident, peak
    keys = {(s.layer, s.side) for s in candidates}
    rest = [replace(s, stored=s.unpacked) if (s.layer, s.side) in keys else s for s in sides]
    decoded, resident, dense_peak = plan_decoded(rest, resident, budget, reserve)
    left = [(s.layer, s.side) for s in candidates if (s.layer, s.side) not in set(decoded)]
    step = max((s.step for s in candidates if (s.layer, s.side) in set(left)), default=0)
    return decoded, left, resident, max(peak, dense_peak, resident + step)


def prefill_reserve(layers, dtype):
    """Bytes a question's prefill holds beside the resident pages where each layer's pages are decoded for
    the call (`kernels.cpu.question_prefill`): the largest layer's K and V as dense pages of `dtype`. It runs
    where the plan's resident bytes leave that room within the budget (after, not instead of, what `plan_decoded` and
    `plan_unpacked` decode or unpack: a decode step's reads of those pages come first).

    Args:
        layers (list[tuple]): per page-attended layer ((n_pages, n_kv_heads, P), K head_dim, V head_dim).
        dtype (mx.Dtype): the queries' dtype (the decoded pages').
    """
    return max((n * h * p * (k_dim + v_dim) * dtype.size for (n, h, p), k_dim, v_dim in layers), default=0)


def notes(report, policy):
    """What a memory budget did against what was asked, one line each: a budget below the stored bytes
    (they are always held, so the budget cannot go lower), and an explicit dequantize-once that the budget
    turned into another path on some layers.

    Args:
        report (dict): `policy.place`'s report ("memory", "layers"). policy (str): the policy asked for.

    Returns:
        list[str]: empty when the budget was kept and the policy taken everywhere.
    """
    m, mb = report.get("memory") or {}, 1e6
    budget, lines = m.get("budget_bytes"), []
    if budget is not None and budget < m["stored_bytes"]:
        lines.append(f"the memory budget of {budget / mb:,.1f} MB is below the {m['stored_bytes'] / mb:,.1f} MB of "
                     f"stored pages, which are always held (the budget cannot go lower); "
                     f"{m['resident_bytes'] / mb:,.1f} MB are held")
    rows = [x for x in report.get("layers", []) if x]
    other = [x["policy"] for x in rows if x["policy"] != "dequantize-once"]
    if policy == "dequantize-once" and other and budget is not None:
        paths = ", ".join(f"{name} on {other.count(name)}" for name in sorted(set(other)))
        lines.append(f"attention dequantize-once: within the memory budget of {budget / mb:,.1f} MB, {len(other)} of "
                     f"{len(rows)} layers take another path ({paths}) instead of dense pages")
    return lines
