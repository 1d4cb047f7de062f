"""Per-layer tier schemas: which tier stores K and V of every layer.

A schema is a list with one row per layer, `{"layer": i, "k": tier, "v": tier}`, in layer order (the
`tiers` list of `cartridge inspect --json` has this form). `schema_for` makes one from the build
options; `read_schema` takes a user's list or JSON file; `check_schema` refuses what the model cannot
store, before any prefill.
"""

import json
from pathlib import Path

from ..errors import InputError
from .registry import DEFAULT_TIER, get_tier

PROTECTED_TIER = "fp16"  # what boundary_protect keeps


def schema_for(n_layers, tier=DEFAULT_TIER, k_tier=None, v_tier=None, boundary_protect=0):
    """The schema of the build options.

    Args:
        n_layers (int): layers of the model.
        tier (str): tier of both sides. Default: "fp16".
        k_tier, v_tier (str | None): override one side. Default: None (use `tier`).
        boundary_protect (int): N > 0 keeps K fp16 on every layer and V fp16 on the first N and last N
            layers; V uses `v_tier` (or `tier`) elsewhere. Default: 0.

    Returns:
        list[dict]: [{"layer": i, "k": ..., "v": ...}, ...].

    Raises:
        InputError: unknown tier, negative N, 2N > n_layers, or a `k_tier` other than fp16 with N > 0.

    Example:
        >>> [r["v"] for r in schema_for(6, "mlx4g32", boundary_protect=2)]
        ['fp16', 'fp16', 'mlx4g32', 'mlx4g32', 'fp16', 'fp16']
    """
    k, v, n = check_tier_options(tier, k_tier, v_tier, boundary_protect)
    if 2 * n > n_layers:
        raise InputError(f"boundary_protect {n} protects {2 * n} layers; the model has {n_layers}")
    return [{"layer": i, "k": k, "v": PROTECTED_TIER if i < n or i >= n_layers - n else v} for i in range(n_layers)]


def check_tier_options(tier=DEFAULT_TIER, k_tier=None, v_tier=None, boundary_protect=0):
    """Check the tier options that need no model.

    Returns:
        tuple: (K tier, V tier away from the protected layers, N).

    Raises:
        InputError: as `schema_for`, except the layer count.
    """
    for name, value in (("tier", tier), ("k_tier", k_tier), ("v_tier", v_tier)):
        if value is not None and not str(value).strip():
            raise InputError(f"{name} is empty; give a tier name")
    k, v = get_tier(k_tier or tier).name, get_tier(v_tier or tier).name
    n = boundary_protect
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InputError(f"boundary_protect is {n!r}; it must be an integer >= 0")
    if n and k_tier is not None and k_tier != PROTECTED_TIER:
        raise InputError(
            f"k_tier {k_tier!r} conflicts with boundary_protect {n}, which keeps K {PROTECTED_TIER} on every layer")
    return (PROTECTED_TIER if n else k), v, n


def read_schema(schema):
    """A schema from a list of rows or a path to a JSON file of one, checked for form and tier names.

    Args:
        schema (list[dict] | str | Path): rows {"layer": int, "k": tier, "v": tier}, any order.

    Returns:
        list[dict]: rows sorted by layer, each exactly {"layer", "k", "v"}.

    Raises:
        InputError: unreadable file, bad JSON, a row of the wrong form, an unknown tier, a layer named
            twice. Whether the layers are the model's 0 .. n-1 is `check_layer_count`'s check.
    """
    if isinstance(schema, (str, Path)):
        schema = _load_json(Path(schema))
    if not isinstance(schema, list) or not schema:
        got = "an empty list" if schema == [] else type(schema).__name__
        raise InputError(f"schema must be a non-empty JSON list of {{\"layer\", \"k\", \"v\"}} rows; got {got}")
    rows = [_row(r, i) for i, r in enumerate(schema)]
    rows.sort(key=lambda r: r["layer"])
    _refuse_repeats([r["layer"] for r in rows])
    return rows


def _refuse_repeats(layers, what="schema"):
    twice = sorted({n for n in layers if layers.count(n) > 1})
    if twice:
        raise InputError(f"{what} names layer {layer_runs(twice)} more than once (one row a layer)")


def check_layer_count(schema, n_layers, what="schema"):
    """Refuse a schema whose rows are not exactly the model's layers 0 .. n_layers-1, one row each.

    Raises:
        InputError: "schema names layer 99; the model has 30 layers (0..29)", "schema has no row for layer 3;
            the model has 30 layers (0..29)" or "schema has 1 layer row; the model has 2 layers" (`what`
            names the schema).
    """
    layers = sorted(r["layer"] for r in schema)
    _refuse_repeats(layers, what)
    beyond = [n for n in layers if not 0 <= n < n_layers]
    missing = sorted(set(range(n_layers)) - set(layers))
    model = f"the model has {n_layers} layers (0..{n_layers - 1})"
    if beyond:
        raise InputError(f"{what} names layer {layer_runs(beyond)}; {model}")
    if layers == list(range(len(layers))) and len(layers) != n_layers:
        raise InputError(f"{what} has {len(schema)} layer row{'' if len(schema) == 1 else 's'}; the model has "
                         f"{n_layers} layers")
    if missing:
        raise InputError(f"{what} has no row for layer {layer_runs(missing)}; {model}")


def check_schema(schema, n_layers, n_kv_heads, head_dim):
    """Refuse a schema whose layer count differs from the model's or whose tier cannot store its shape.

    Raises:
        InputError: naming the layer, side and tier.
    """
    check_layer_count(schema, n_layers)
    checked = set()
    for row in schema:
        for side in ("k", "v"):
            if row[side] not in checked:
                get_tier(row[side]).check(n_kv_heads, head_dim)
                checked.add(row[side])


def _load_json(path):
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(f"schema file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise InputError(f"schema file {path} is not UTF-8") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise InputError(f"schema file {path} is not valid JSON: {e}") from None


def _row(row, i):
    if not isinstance(row, dict) or set(row) != {"layer", "k", "v"}:
        raise InputError(f"schema row {i} must be an object with exactly the keys layer, k, v; got {row!r}")
    if isinstance(row["layer"], bool) or not isinstance(row["layer"], int):
        raise InputError(f"schema row {i}: layer is {row['layer']!r}; expected an integer")
    for side in ("k", "v"):
        if not isinstance(row[side], str):
            raise InputError(f"schema row {i}: {side} is {row[side]!r}; expected a tier name")
        get_tier(row[side])
    return {"layer": row["layer"], "k": row["k"], "v": row["v"]}


def layer_runs(values):
    """Compact '0-3, 5, 7-9' rendering of sorted integers (duplicates shown as given)."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def read_tier_options(tier, k_tier, v_tier, boundary_protect, schema):
    """Check the build's tier options that need no model (tier names, a schema file and its form), before
    any model is loaded or token prefilled; `build` and `convert` both start here.

    Args:
        tier, k_tier, v_tier, boundary_protect: as `schema_for` takes them.
        schema (list | str | Path | None): a per-layer schema (`read_schema`), or None.

    Returns:
        list[dict] | None: the schema read, or None when there is none (the options make it).

    Raises:
        InputError: an unknown tier or a bad N (`check_tier_options`), a bad schema, or a schema given
            together with tier, k_tier, v_tier or boundary_protect.
    """
    check_tier_options(tier, k_tier, v_tier, boundary_protect)
    if schema is None:
        return None
    others = {"tier": tier if tier != DEFAULT_TIER else None, "k_tier": k_tier, "v_tier": v_tier,
              "boundary_protect": boundary_protect or None}
    given = [k for k, v in others.items() if v is not None]
    if given:
        raise InputError(f"a schema sets the tier of every (layer, side); it cannot be combined with "
                         f"{', '.join(given)}")
    return read_schema(schema)


def fold_tiers(tiers):
    """Fold runs of layers with equal (k, v) tiers: [{"layers": "0-29", "k": "fp16", "v": "fp16"}]."""
    runs = []
    for row in tiers:
        if runs and (runs[-1]["k"], runs[-1]["v"]) == (row["k"], row["v"]) and runs[-1]["last"] == row["layer"] - 1:
            runs[-1]["last"] = row["layer"]
        else:
            runs.append({"first": row["layer"], "last": row["layer"], "k": row["k"], "v": row["v"]})
    return [{"layers": f"{r['first']}" if r["first"] == r["last"] else f"{r['first']}-{r['last']}",
             "k": r["k"], "v": r["v"]} for r in runs]


def tier_runs_text(tiers):
    """One line of `fold_tiers`' runs, as build and convert print them: "layer 0 K int8 V int8; layers 1-29 K ..."."""
    return "; ".join(f"{'layers' if '-' in run['layers'] else 'layer'} {run['layers']} K {run['k']} V {run['v']}"
                     for run in fold_tiers(tiers))
