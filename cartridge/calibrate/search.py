"""Choose the per-layer (K tier, V tier) schema of least measured damage within a byte budget.

The measured damage of each (layer, side, tier) (`cartridge.calibrate.measure`) is taken as additive over
layer-sides, so the choice is a multiple-choice knapsack: one tier per (layer, side), total bytes/token
within the budget, least summed KL. It is solved exactly by dynamic programming over bytes/token in units
of their greatest common divisor (a few thousand cells for a 30-layer model), which also gives the
smallest budget whose predicted KL is under a `max_kl` bound.

A model with sliding-window layers is two parts (`choose_parts`): the layers that store every token (their
bytes grow with the document) and the window layers (a fixed number of tokens each). A byte budget bounds
each part apart, so the cartridge keeps its ratio to fp16 at any length; a KL bound takes the pair of the
parts' schemas of least stored bytes at this document's length (docs/calibration.md "Budgets").
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


def options(kl, layers, shapes):
    """Per (layer, side) in order, the [(bytes/token, KL, tier)] candidates measured for it.

    Args:
        kl (dict): (layer, side, tier) -> KL. layers (list[int]): the layers, in order.
        shapes (dict): side -> (n_kv_heads, head_dim).
    """
    items = []
    for layer in layers:
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


def _backtrack(items, unit, picks, cell, layers):
    chosen = []
    for opts, pick in zip(reversed(items), reversed(picks)):
        b, _, tier = opts[pick[cell]]
        chosen.append(tier)
        cell -= b // unit
    chosen.reverse()
    return [{"layer": layer, "k": chosen[2 * i], "v": chosen[2 * i + 1]} for i, layer in enumerate(layers)]


@dataclass
class _Part:
    """One part's DP (`_table`): its layers, options, byte unit, least KL per cell and picks."""

    layers: list
    items: list
    unit: int
    best: object
    picks: list

    def choice(self, cell, shapes):
        schema = _backtrack(self.items, self.unit, self.picks, cell, self.layers)
        return Choice(schema, schema_bytes(schema, shapes), float(self.best[cell]))


def _part(kl, layers, shapes):
    items = options(kl, layers, shapes)
    return _Part(list(layers), items, *(_table(items) if items else (1, np.zeros(1), [])))


def choose(kl, layers, shapes, max_bytes_per_token=None, max_kl=None, what=""):
    """The schema of least predicted KL within `max_bytes_per_token`, or the smallest within `max_kl`.

    Args:
        kl (dict): (layer, side, tier) -> measured KL (fp16 included, at 0).
        layers (int | list[int]): the layers to choose for (an int n: 0 .. n - 1); none: an empty Choice.
        shapes (dict): side -> (n_kv_heads, head_dim).
        max_bytes_per_token (int | None): K+V payload bytes/token over these layers. Default: None.
        max_kl (float | None): predicted-KL bound (nats/token), used when no byte budget is given.
        what (str): words after "bytes/token" naming these layers in the error. Default: "".

    Returns:
        Choice

    Raises:
        InputError: neither bound given, or a budget below the cheapest candidate schema.
    """
    part = _part(kl, range(layers) if isinstance(layers, int) else layers, shapes)
    best = part.best
    if max_bytes_per_token is not None:
        cell = min(int(max_bytes_per_token) // part.unit, len(best) - 1)
        if cell < 0 or not np.isfinite(best[cell]):
            least = sum(o[0][0] for o in part.items)
            raise InputError(f"budget {max_bytes_per_token} bytes/token{what} is below the cheapest measured schema "
                             f"({least} bytes/token)")
        cell = int(np.argmin(np.where(np.arange(len(best)) <= cell, best, np.inf)))
    elif max_kl is not None:
        cell = int(np.argmax(best <= max_kl)) if (best <= max_kl).any() else len(best) - 1
    else:
        raise InputError("give a byte budget or a KL bound")
    return part.choice(cell, shapes)


WINDOW_PART = " of the sliding-window layers"  # how `choose_parts` names the second part in its errors


def choose_parts(kl, parts, shapes, bounds=None, max_kl=None, tokens=(1, 1)):
    """One Choice per part: (layers that store every token, window layers), each schema within its part's byte
    bound, or together the least stored bytes whose summed predicted KL is within `max_kl`.

    Args:
        kl (dict), shapes (dict): as `choose` takes them. parts (tuple[list[int], list[int]]): the two parts' layers.
        bounds (list | None): per part its K+V bytes/token bound (a window layer's per stored token); None
            for a KL bound. max_kl (float | None): the KL bound when `bounds` is None.
        tokens (tuple[int, int]): tokens each part's layers store (stored bytes = bytes/token x tokens).
            Default: (1, 1).

    Returns:
        list[Choice]: one per part (an empty part: no rows, 0 bytes, 0 KL).

    Raises:
        InputError: as `choose`, the window part's budget named as such.
    """
    if bounds is not None:
        return [choose(kl, layers, shapes, bound, what=what)
                for layers, bound, what in zip(parts, bounds, ("", WINDOW_PART))]
    if not parts[0] or not parts[1]:
        return [choose(kl, layers, shapes, max_kl=max_kl) for layers in parts]
    a, b = (_part(kl, layers, shapes) for layers in parts)
    # best is non-increasing in the cell: the least cell of b within what a leaves of the bound, by bisection
    cells_b = np.searchsorted(-b.best, -(max_kl - a.best), side="left")  # (cells of a,)
    cost = np.arange(len(a.best)) * a.unit * tokens[0] + cells_b * b.unit * tokens[1]
    cost = np.where(cells_b < len(b.best), cost, np.inf)
    cell_a = int(np.argmin(cost)) if np.isfinite(cost).any() else len(a.best) - 1
    cell_b = int(min(cells_b[cell_a], len(b.best) - 1))
    return [a.choice(cell_a, shapes), b.choice(cell_b, shapes)]


def schema_bytes(schema, shapes):
    """K+V payload bytes/token of a schema (every layer of the same shapes)."""
    return sum(TIERS[r[s]].bytes_per_token(*shapes[s]) for r in schema for s in ("k", "v"))
