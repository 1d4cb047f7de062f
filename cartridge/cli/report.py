"""What `cartridge inspect` shows: a JSON-able dict and a human table."""

from pathlib import Path

from cartridge.attention.policy import backend, resolve
from cartridge.tiers import TIERS


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


def tier_formulas(tiers, n_kv_heads, head_dim):
    """{tier: {"formula", "bytes_per_token_per_layer_side"}} for every tier the schema uses, in first-use order."""
    used = dict.fromkeys(row[side] for row in tiers for side in ("k", "v"))
    return {name: {"formula": TIERS[name].formula,
                   "bytes_per_token_per_layer_side": TIERS[name].bytes_per_token(n_kv_heads, head_dim)}
            for name in used}


def inspect_dict(info, path):
    """The `inspect --json` document (see README and spec/FORMAT.md section 7)."""
    total = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    return {
        "format_version": info.format_version,
        "tokens": len(info.tokens),
        "n_layers": info.n_layers,
        "n_kv_heads": info.n_kv_heads,
        "head_dim": info.head_dim,
        "kv_dim": info.kv_dim,
        "page_size": info.page_size,
        "n_pages": info.n_pages,
        "tiers": info.tiers,
        "tier_runs": fold_tiers(info.tiers),
        "tier_formulas": tier_formulas(info.tiers, info.n_kv_heads, info.head_dim),
        "protected": {"first": info.protect_first, "last": info.protect_last},
        "bytes_per_token": info.bytes_per_token(),
        "fp16_bytes_per_token": info.fp16_bytes_per_token(),
        "total_bytes": total,
        "source_dtype": info.source_dtype,
        "prompt_mode": info.prompt_mode,
        "model": {"ref": info.model_ref, "fingerprint": info.fingerprint["id"]},
        "attention": {"backend": backend(), "auto": resolve("auto")},
    }


def inspect_table(d):
    """Human-readable rendering of `inspect_dict`."""
    lines = [
        f"format        {d['format_version']}",
        f"model         {d['model']['ref']}  (fingerprint {d['model']['fingerprint'][:16]})",
        f"tokens        {d['tokens']:,} in {d['n_pages']} pages of {d['page_size']}",
        f"shape         {d['n_layers']} layers x {d['n_kv_heads']} kv heads x head_dim {d['head_dim']} "
        f"(kv_dim {d['kv_dim']}), computed as {d['source_dtype']}",
        f"bytes/token   {d['bytes_per_token']:,} (fp16 would be {d['fp16_bytes_per_token']:,}; "
        + ("same as fp16)" if d['bytes_per_token'] == d['fp16_bytes_per_token'] else
           f"{d['fp16_bytes_per_token'] / d['bytes_per_token']:.2f}x smaller)"),
        f"on disk       {d['total_bytes']:,} bytes",
        f"protected     first {d['protected']['first']} and last {d['protected']['last']} tokens of every layer "
        f"also kept in fp16",
        f"attention     auto -> {d['attention']['auto']} on this {d['attention']['backend']} device",
        "tiers         layers  K        V        bytes/token/layer (K+V)",
    ]
    for run in d["tier_runs"]:
        per = TIERS[run["k"]].bytes_per_token(d["n_kv_heads"], d["head_dim"]) + \
            TIERS[run["v"]].bytes_per_token(d["n_kv_heads"], d["head_dim"])
        lines.append(f"              {run['layers']:<7} {run['k']:<8} {run['v']:<8} {per:,}")
    lines.append("formulas      bytes/token/layer-side (H = n_kv_heads)")
    for name, f in d["tier_formulas"].items():
        lines.append(f"              {name:<8} {f['formula']} = {f['bytes_per_token_per_layer_side']:,}")
    return "\n".join(lines)
