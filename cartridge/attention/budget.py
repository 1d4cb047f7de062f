"""Memory budget of a loaded prefix: which (layer, side) pages are decoded to dense, and which stay as stored.

Decoding a side into dense pages ("dequantize-once") makes its attention faster where compute is scarce
(the CPU) and costs its dense bytes instead of its stored bytes. `plan` decides side by side, K sides
first (scores over compressed K are the slower half on CPU: docs/performance.md "Memory on CPU"), in layer
order, and decodes a side only if the bytes held while it is decoded (all stored pages, the sides decoded
so far and this side's decode buffers) stay within the budget; the rest keep their stored pages and take
the portable path. The default budget is the stored bytes x 1.25 + one layer decoded (`default_budget`).
"""

from dataclasses import dataclass

import mlx.core as mx

STORED_FACTOR = 1.25


@dataclass(frozen=True)
class Side:
    """One (layer, side) a plan may decode.

    Attributes:
        layer (int), side (str "k"|"v"): where. stored (int): bytes of its stored pages.
        dense (int): bytes of its dense pages in the dequantize dtype.
        transient (int): bytes its decode holds besides the stored pages (the float32 decode, plus the
            cast to a 16-bit dtype when that is the target).
    """

    layer: int
    side: str
    stored: int
    dense: int
    transient: int


def side_sizes(layer, side, stored, shape, dtype):
    """A `Side` from its stored bytes and (n_pages, n_kv_heads, page_size, head_dim) dense shape."""
    elements = shape[0] * shape[1] * shape[2] * shape[3]
    dense = elements * dtype.size
    return Side(layer, side, stored, dense, elements * 4 + (dense if dtype != mx.float32 else 0))


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


def plan(sides, held, budget):
    """Which sides to decode within `budget` bytes.

    Args:
        sides (list[Side]): the candidates (layers whose policy is dequantize-once).
        held (int): bytes held before any decode: every stored page and every other held array.
        budget (int | None): the most bytes held at any moment; None decodes every side.

    Returns:
        tuple: (decoded, resident, peak): the set of (layer, side) to decode, in the order they are
        decoded (K sides, then V sides, each in layer order), the bytes held after, the most held while
        decoding (this accounting: MLX's own temporaries are not in it).
    """
    order = sorted(sides, key=lambda s: (s.side != "k", s.layer))
    decoded, resident, peak = [], held, held
    for s in order:
        if budget is not None and resident + s.transient > budget:
            continue
        decoded.append((s.layer, s.side))
        peak = max(peak, resident + s.transient)
        resident += s.dense - s.stored
    return decoded, resident, peak
