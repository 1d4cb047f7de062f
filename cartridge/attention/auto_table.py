"""`auto` from measurements: which attention policy is fastest per (backend, tier, head_dim, mode, context).

A table is a JSON document {"version": 1, "entries": [...]}; each entry is one measured case:

    {"backend": "cpu", "tier": "mlx4g32", "head_dim": 64, "mode": "decode", "context": 8192,
     "policy": "dequantize-once", "us": {"portable": 6407.0, "dequantize-once": 1613.0},
     "dense_us": 2983.0, "machine": "x86_64 (2 cores)", "measured": "2026-12-01"}

"mode" is "decode" (1-8 query rows per KV head, as `cartridge bench` times one decode step) or
"multi-token" (a question's prefill over the prefix). Entries come from a `cartridge bench --json`
result (`table_from_bench`), so a bench run on any machine becomes a table. The package ships tables
measured on the project's machines (`auto_tables/*.json`); a user table (`user_table_path()`, written by
`cartridge bench --calibrate`) replaces the shipped entries of every (backend, tier, head_dim, mode) it
measures. `choose` looks a layer up: the nearest head_dim, then the nearest context (log scale).

The user table also keeps the proofs of kernels that need one (`backends.proof`): {"proofs": [{"backend",
"tiers", "head_dim", "ok", "error", "rel_err", "context", "us", "dense_us", "measured"}, ...]}; a proof that
passed adds its times as decode entries for the cases no bench run measured.
"""

import json
import math
import os
import platform
import time
from pathlib import Path

from ..errors import CartridgeError, InputError
from ..format.atomic import write_file
from . import backends

SHIPPED = Path(__file__).with_name("auto_tables")
TABLE_VERSION = 1
FALLBACK = backends.devices()  # device -> the policy where the table has no measurement for a case
_SESSION_PROOFS = []  # proofs this process could not write to the user table (read-only home)


def user_table_path():
    """The user's table: $CARTRIDGE_AUTO_TABLE, else $XDG_CONFIG_HOME/cartridge/auto-table.json (XDG_CONFIG_HOME
    defaults to ~/.config)."""
    if os.environ.get("CARTRIDGE_AUTO_TABLE"):
        return Path(os.environ["CARTRIDGE_AUTO_TABLE"])
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "cartridge" / "auto-table.json"


def _machine(env):
    name = env.get("device") or env.get("processor") or env.get("machine") or "unknown machine"
    return f"{name} {env['backend']}" + (f" ({env['cores']} cores)" if env.get("cores") else "")


def table_from_bench(result, date=None):
    """The table of a `cartridge bench --json` result: one entry per (tier, context, mode) it timed.

    Args:
        result (dict): the bench result ("environment", "shape", "attention" rows).
        date (str | None): when it was measured, for a result without environment.date. Default: None.

    Returns:
        dict: {"version": 1, "entries": [...]} (module docstring); the fastest policy of each case among
        the policies measured without error.

    Raises:
        InputError: `result` is not a bench result (no environment, shape or attention rows).
    """
    try:
        env, head_dim, rows = result["environment"], result["shape"]["head_dim"], result["attention"]
    except (KeyError, TypeError):
        raise InputError("not a `cartridge bench --json` result: it needs environment, shape.head_dim and "
                         "attention rows") from None
    # decode steps are "decode"; question prefills (`multi_token` rows) are "multi-token", each context at its
    # longest question, however few rows it has
    multi = [r for r in result.get("multi_token", []) if isinstance(r, dict)]
    longest = {}
    for r in multi:
        longest[r.get("context")] = max(longest.get(r.get("context"), 0), r.get("query_rows", 1))
    tagged = [(r, "decode") for r in rows] + [(r, "multi-token") for r in multi
                                             if r.get("query_rows", 1) == longest[r.get("context")]]
    dense = {(r["context"], m): r["us"] for r, m in tagged if r.get("policy") == "mlx-sdpa" and r.get("us")}
    cases = {}
    for r, m in tagged:
        if r.get("kind") != "cartridge" or not r.get("us"):
            continue
        cases.setdefault((r["tier"], r["context"], m), {})[r["policy"]] = r["us"]
    entries = []
    for (tier, context, m), us in sorted(cases.items()):
        entries.append({"backend": env["backend"], "tier": tier, "head_dim": head_dim, "mode": m,
                        "context": context, "policy": min(us, key=us.get), "us": us,
                        "dense_us": dense.get((context, m)), "machine": _machine(env),
                        "measured": env.get("date") or date or "undated"})
    return {"version": TABLE_VERSION, "entries": entries}


def read_table(path):
    """The entries of a table file.

    Raises:
        InputError: unreadable, not JSON, or not a table of this version.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"attention table {path}: cannot read it ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != TABLE_VERSION or not isinstance(doc.get("entries"), list):
        raise InputError(f"attention table {path}: expected {{\"version\": {TABLE_VERSION}, \"entries\": [...]}}")
    return doc["entries"]


def _key(e):
    return e["backend"], e["tier"], e["head_dim"], e["mode"]


def merged_entries(user=None):
    """Shipped entries, with every (backend, tier, head_dim, mode) the user table measures replaced by its entries.

    Args:
        user (Path | None): the user table (default `user_table_path()`; absent is fine).
    """
    shipped = [e for f in sorted(SHIPPED.glob("*.json")) for e in read_table(f)]
    user = user_table_path() if user is None else Path(user)
    mine = read_table(user) if user.exists() else []
    replaced = {_key(e) for e in mine}
    return [e for e in shipped if _key(e) not in replaced] + mine


def _nearest(entries, head_dim, n_tokens):
    """The entry closest in head_dim (exact first), then in log2 context."""
    return min(entries, key=lambda e: (abs(e["head_dim"] - head_dim),
                                       abs(math.log2(e["context"]) - math.log2(max(n_tokens, 1))), -e["context"]))


def choose(entries, backend, tiers, head_dim, n_tokens, mode="decode", allowed=None):
    """The measured-fastest policy for one layer, and why.

    Args:
        entries (list[dict]): table entries (`merged_entries`).
        backend (str): a device name (`backends.devices`). tiers (tuple[str]): the layer's K and V tiers.
        head_dim (int): the layer's head_dim. n_tokens (int): prefix tokens. mode (str): "decode" or
            "multi-token". allowed (set | None): policies this backend runs (None: any in the table).

    Returns:
        tuple: (policy, reason). The policy minimises the summed measured time of the layer's tiers (each
        at its nearest case); the reason says by how much and where it was measured, e.g. "portable: 0.80x
        dequantize-once, 1.10x dense at 8192 tokens (mlx4g32, head_dim 64), measured 2026-12-01 on ...".
        With no entry for a tier: FALLBACK[backend] (dequantize-once where `allowed` excludes it) and a
        reason saying so.
    """
    fallback = FALLBACK[backend]
    if allowed is not None and fallback not in allowed:  # e.g. no fused kernel for this layer's tiers
        fallback = "dequantize-once"
    picked = []
    for tier in dict.fromkeys(tiers):
        cands = [e for e in entries if e["backend"] == backend and e["tier"] == tier and e["mode"] == mode]
        if not cands:
            return fallback, f"{fallback}: no measurement of {tier} on {backend} in the auto table; the default there"
        picked.append(_nearest(cands, head_dim, n_tokens))
    policies = set.intersection(*(set(e["us"]) for e in picked))
    if allowed is not None:
        policies &= set(allowed)
    if not policies:
        return fallback, f"{fallback}: no measured policy runs here (default)"
    total = {p: sum(e["us"][p] for e in picked) for p in policies}
    best = min(sorted(total), key=total.get)
    return best, _reason(best, total, picked)


def _reason(best, total, picked):
    e = picked[0]
    parts = [f"{total[best] / total[p]:.2f}x {p}" for p in sorted(total) if p != best]
    dense = [x["dense_us"] for x in picked]
    if all(dense):
        parts.append(f"{total[best] / sum(dense):.2f}x dense")
    what = ", ".join(parts) or "the only policy measured"
    tiers = "+".join(x["tier"] for x in picked)
    return (f"{best}: {what} at {e['context']} tokens ({tiers}, head_dim {e['head_dim']}), measured "
            f"{e['measured']} on {e['machine']}")


def write_bench_table(table, path):
    """Write a full table (`table_from_bench`) to `path`, keeping the kernel proofs already there."""
    try:
        kept = _document(path)["proofs"]
    except InputError:  # an unreadable old table is replaced whole
        kept = []
    return write_table({**table, "proofs": kept} if kept else table, path)


def write_table(table, path):
    """Write `table` as JSON to `path` atomically (its folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, lambda tmp: Path(tmp).write_text(json.dumps(table, indent=1) + "\n"))
    return path


def _document(path):
    """The whole user table document ({"version", "entries", "proofs"}), empty where the file is absent."""
    if not Path(path).exists():
        return {"version": TABLE_VERSION, "entries": [], "proofs": []}
    entries = read_table(path)
    doc = json.loads(Path(path).read_text())
    return {"version": TABLE_VERSION, "entries": entries, "proofs": [p for p in doc.get("proofs", [])
                                                                     if isinstance(p, dict)]}


def proofs(path=None):
    """The proof records of the user table (`path`, default `user_table_path()`) and of this process."""
    return _document(user_table_path() if path is None else path)["proofs"] + _SESSION_PROOFS


def find_proof(backend, tiers, head_dim, path=None):
    """The proof record of (backend name, (K tier, V tier), head_dim), or None."""
    want = (backend, list(tiers), head_dim)
    return next((p for p in reversed(proofs(path)) if (p.get("backend"), p.get("tiers"), p.get("head_dim")) == want),
                None)


def _proof_entries(rec, device, have):
    """Decode entries of a passed proof's times, one per tier no entry in `have` measures."""
    if not rec["ok"] or not rec.get("us"):
        return []
    us = rec["us"]
    return [{"backend": device, "tier": tier, "head_dim": rec["head_dim"], "mode": "decode", "context": rec["context"],
             "policy": min(us, key=us.get), "us": us, "dense_us": rec.get("dense_us"),
             "machine": f"{platform.machine()} {device} (kernel proof)", "measured": rec["measured"]}
            for tier in dict.fromkeys(rec["tiers"]) if (device, tier, rec["head_dim"], "decode") not in have]


def add_proof(rec, path=None):
    """Keep a proof record (`backends.proof.check`) in the user table, replacing one of the same key; where the
    table cannot be written, for this process only. Returns the path written, or None."""
    rec = {**rec, "measured": rec.get("measured") or today()}
    path = user_table_path() if path is None else Path(path)
    doc = _document(path)
    key = (rec["backend"], rec["tiers"], rec["head_dim"])
    doc["proofs"] = [p for p in doc["proofs"] if (p.get("backend"), p.get("tiers"), p.get("head_dim")) != key] + [rec]
    device = backends.get(rec["backend"]).device
    doc["entries"] += _proof_entries(rec, device, {_key(e) for e in doc["entries"]})
    try:
        return write_table(doc, path)
    except (OSError, CartridgeError):
        _SESSION_PROOFS.append(rec)
        return None


def today():
    """The date stamped on a bench result, YYYY-MM-DD."""
    return time.strftime("%Y-%m-%d")
