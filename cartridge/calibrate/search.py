"""Choose the per-layer (K tier, V tier) schema of least measured damage within a byte budget.

The measured damage of each (layer, side, tier) (`cartridge.calibrate.measure`) is taken as additive over
layer-sides, so the choice is a multiple-choice knapsack: one tier per (layer, side), total bytes/token
within the budget, least summed KL. It is solved exactly by dynamic programming over bytes/token in units
of their greatest common divisor (a few thousand cells for a 30-layer model), which also gives the
smallest budget whose predicted KL is under a `max_kl` bound.
"""

from dataclasses import dataclass
from functools import reduce
from math import gcd

import numpy as np

from ..errors import InputError
from ..tiers import TIERS


@dataclass
class Choice:
    """A chosen schema.

    Attributes:
        schema (list[dict]): {"layer", "k", "v"} rows. bytes_per_token (int): its K+V payload bytes/token.
        predicted_kl (float): sum of the measured per-layer-side KL (nats/token) of its tiers.
    """

    schema: list
    bytes_per_token: int
    predicted_kl: float


def options(kl, n_layers, shapes):
    """Per (layer, side) in order, the [(bytes/token, KL, tier)] candidates measured for it.

    Args:
        kl (dict): (layer, side, tier) -> KL. shapes (dict): side -> (n_kv_heads, head_dim).
    """
    items = []
    for layer in range(n_layers):
        for side in ("k", "v"):
            items.append(sorted((TIERS[t].bytes_per_token(*shapes[side]), kl[(l, s, t)], t)
                                for (l, s, t) in kl if l == layer and s == side))
    return items


def _table(items):
    """DP over items: best[b] = least KL within b units; picks[i][b] = option of item i at b."""
    unit = reduce(gcd, (b for opts in items for b, _, _ in opts))
    top = sum(max(b for b, _, _ in opts) for opts in items) // unit
    best, picks = np.zeros(top + 1), []
    for opts in items:
        new, pick = np.full(top + 1, np.inf), np.zeros(top + 1, dtype=np.int16)
        for j, (b, kl, _) in enumerate(opts):
            shifted = np.full(top + 1, np.inf)
            shifted[b // unit:] = best[:top + 1 - b // unit] + kl
            better = shifted < new
            new[better], pick[better] = shifted[better], j
        best = new
        picks.append(pick)
    return unit, best, picks


def _backtrack(items, unit, picks, cell, n_layers):
    chosen = []
    for opts, pick in zip(reversed(items), reversed(picks)):
        b, _, tier = opts[pick[cell]]
        chosen.append(tier)
        cell -= b // unit
    chosen.reverse()
    return [{"layer": i, "k": chosen[2 * i], "v": chosen[2 * i + 1]} for i in range(n_layers)]


def choose(kl, n_layers, shapes, max_bytes_per_token=None, max_kl=None):
    """The schema of least predicted KL within `max_bytes_per_token`, or the smallest within `max_kl`.

    Args:
        kl (dict): (layer, side, tier) -> measured KL (fp16 included, at 0).
        n_layers (int). shapes (dict): side -> (n_kv_heads, head_dim).
        max_bytes_per_token (int | None): K+V payload bytes/token over all layers. Default: None.
        max_kl (float | None): predicted-KL bound (nats/token), used when no byte budget is given.

    Returns:
        Choice

    Raises:
        InputError: neither bound given, or a budget below the cheapest candidate schema.
    """
    items = options(kl, n_layers, shapes)
    unit, best, picks = _table(items)
    if max_bytes_per_token is not None:
        cell = min(int(max_bytes_per_token) // unit, len(best) - 1)
        if cell < 0 or not np.isfinite(best[cell]):
            least = sum(o[0][0] for o in items)
            raise InputError(f"budget {max_bytes_per_token} bytes/token is below the cheapest measured schema "
                             f"({least} bytes/token)")
        cell = int(np.argmin(np.where(np.arange(len(best)) <= cell, best, np.inf)))
    elif max_kl is not None:
        cell = int(np.argmax(best <= max_kl)) if (best <= max_kl).any() else len(best) - 1
    else:
        raise InputError("give a byte budget or a KL bound")
    schema = _backtrack(items, unit, picks, cell, n_layers)
    return Choice(schema, schema_bytes(schema, shapes), float(best[cell]))


def schema_bytes(schema, shapes):
    """K+V payload bytes/token of a schema (every layer of the same shapes)."""
    return sum(TIERS[r[s]].bytes_per_token(*shapes[s]) for r in schema for s in ("k", "v"))
