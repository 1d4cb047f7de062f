"""What `cartridge inspect` shows: a JSON-able dict and a human table."""

import json
from pathlib import Path

import mlx.core as mx

from cartridge.attention.backends import device
from cartridge.attention.policy import plan_from_header
from cartridge.format import keys as K
from cartridge.format.kinds import KINDS
from cartridge.tiers import DTYPES, TIERS
from cartridge.tiers.schema import fold_tiers, layer_runs


def _versus_fp16(bpt, fp16):
    """The end of inspect's bytes/token line: "same as fp16)", "3.20x smaller)" or "2.00x larger)" (fp16 plus
    protected copies)."""
    if bpt == fp16:
        return "same as fp16)"
    return f"{fp16 / bpt:.2f}x smaller)" if bpt < fp16 else f"{bpt / fp16:.2f}x larger)"


def per_token_text(bytes_per_token, split):
    """'3,072 bytes/token', and where some layers do not store every token (`CartridgeInfo.per_token_split`),
    which ones it counts and the fixed bytes of the others: '3,072 bytes/token in 3 of 18 layers + 7,864,320
    fixed bytes in 15 window layers' (issue 47)."""
    text = f"{bytes_per_token:,} bytes/token"
    if split["per_token_layers"] == split["layers"]:
        return text
    fixed = " + ".join(f"{f['bytes']:,} fixed bytes in {f['layers']} {kind} layer{'' if f['layers'] == 1 else 's'}"
                       for kind, f in split["fixed"].items())
    return f"{text} in {split['per_token_layers']} of {split['layers']} layers" + (f" + {fixed}" if fixed else "")


def tier_formulas(tiers, n_kv_heads, head_dim):
    """{tier: {"formula", "bytes_per_token_per_layer_side"}} for every tier the schema uses, in first-use order."""
    used = dict.fromkeys(row[side] for row in tiers for side in ("k", "v") if row[side] is not None)
    return {name: {"formula": TIERS[name].formula,
                   "bytes_per_token_per_layer_side": TIERS[name].bytes_per_token(n_kv_heads, head_dim)}
            for name in used}


def layer_rows(info):
    """Per layer: kind, K/V shapes, the prefix tokens it holds and its payload bytes (`inspect --json`);
    a "list" layer: its caches' rows under "caches", tokens the most any of them holds, bytes their sum
    (`LayerKind.describe`)."""
    def nbytes(path):
        return sum(e.page_bytes * e.shape[0] for (p, _), ext in info.extents.items() if p == path for e in ext)
    return [{"layer": i, **m.kind_type.describe(i, m, nbytes)} for i, m in enumerate(info.layers)]


def fold_layers(rows):
    """Runs of layers with the same kind, shapes, tokens held and bytes: [{"layers": "0-3", ...}]."""
    runs = []
    for row in rows:
        key = {k: v for k, v in row.items() if k != "layer"}
        if runs and runs[-1]["key"] == key and runs[-1]["last"] == row["layer"] - 1:
            runs[-1]["last"] = row["layer"]
        else:
            runs.append({"first": row["layer"], "last": row["layer"], "key": key})
    return [{"layers": f"{r['first']}" if r["first"] == r["last"] else f"{r['first']}-{r['last']}",
             "bytes_each": r["key"]["bytes"], **{k: v for k, v in r["key"].items() if k != "bytes"}} for r in runs]


def inspect_dict(info, path):
    """The `inspect --json` document (see README and spec/FORMAT.md section 7)."""
    path = Path(path)
    total = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return {
        "format_version": info.format_version,
        "tokens": len(info.tokens),
        "document_tokens": info.document_tokens,
        "n_layers": info.n_layers,
        "n_kv_heads": info.n_kv_heads,
        "head_dim": info.head_dim,
        "kv_dim": info.kv_dim,
        "page_size": info.page_size,
        "n_pages": info.n_pages,
        "tiers": info.tiers,
        "tier_runs": fold_tiers(info.tiers),
        "tier_formulas": tier_formulas(info.tiers, info.n_kv_heads, info.head_dim),
        "layers": layer_rows(info),
        "fixed_bytes": info.fixed_bytes(),
        "per_token_split": info.per_token_split(),
        "protected": {"first": info.protect_first, "last": info.protect_last},
        "k_scaled_layers": sorted(str(p) for p in info.key_scales),
        "bytes_per_token": info.bytes_per_token(),
        "fp16_bytes_per_token": info.fp16_bytes_per_token(),
        "total_bytes": total,
        "source_dtype": info.source_dtype,
        "prompt_mode": info.prompt_mode,
        "system": info.system,
        "model": {"ref": info.model_ref, "fingerprint": info.fingerprint["id"], "repo_id": info.model_repo_id,
                  "revision": info.model_revision},
        "source": info.source,
        "sources": info.sources,
        "attention": _auto(info),
        "calibration": calibration(info),
        "preset": preset(info),
        "encoders": encoders(info),
    }


def prompt_format(mode):
    """How `build` and `inspect` name a prompt mode (spec/FORMAT.md 5.4)."""
    if mode == "plain":
        return ('plain text, the model has no chat template: "Question: ...\\nAnswer:" turns; an answer ends at a '
                'new "Question:" line')
    return "the model's chat template"


ENCODER_WORDS = {"nearest": "nearest rounding", "score": "score-aware (the document's queries)",
                 "output": "for the output (o_proj)"}


def encoders(info):
    """How the build chose K's and V's codes (`cartridge.encoders`, format 1.11): {"k", "v"}, or None if not
    recorded (nearest rounding)."""
    try:
        value = json.loads(info.records.get(K.ENCODERS, b"null"))
    except ValueError:  # informational only: a malformed value reads as not recorded
        return None
    ok = isinstance(value, dict) and value.get("k") in ("nearest", "score") and value.get("v") in ("nearest", "output")
    return {"k": value["k"], "v": value["v"]} if ok else None


def preset(info):
    """The preset a build or convert was given (`cartridge.preset`, format 1.9), or None if not recorded."""
    try:
        value = json.loads(info.records.get(K.PRESET, b"null"))
    except ValueError:  # informational only: a malformed value reads as not recorded
        return None
    return value if isinstance(value, str) else None


def calibration(info):
    """The `cartridge.calibration` record (format 1.8: how the schema was chosen), or None if absent."""
    raw = info.records.get(K.CALIBRATION)
    return None if raw is None else json.loads(raw)


def fp16_ratio(c):
    """'3.02x' of a calibration record: fp16's bytes/token over the chosen schema's, of the layers that store
    every token (of the sliding-window layers in a model that has no other)."""
    if not c["fp16_bytes_per_token"] and c.get("fp16_window_bytes_per_token"):
        return f"{c['fp16_window_bytes_per_token'] / max(1, c['window_bytes_per_token']):.2f}x"
    return f"{c['fp16_bytes_per_token'] / max(1, c['bytes_per_token']):.2f}x"


def window_text(c):
    """', sliding-window layers 424 bytes per stored token (3.02x)' of a calibration record (version 4) that
    measured window layers beside others; '' otherwise."""
    if not c.get("window_layers") or not c["fp16_bytes_per_token"]:
        return ""
    w, fp16 = c["window_bytes_per_token"], c["fp16_window_bytes_per_token"]
    return f", sliding-window layers {w:,} bytes per stored token ({fp16 / max(1, w):.2f}x)"


def measured_text(c, n_layers):
    """Which layers a calibration record measured (and how, when not by the walk): 'all 6 layers: 5 sliding-window
    (0-4) on the tokens their window stores, 1 full-attention (5)'; before calibration version 4 every layer was
    full attention."""
    n = c.get("measured_layers", n_layers)
    windows = c.get("window_layers")
    if windows is None:
        return f"all {n} layers (full attention; calibration version {c.get('calibration_version', 1)})"
    full = [j for j in range(n) if j not in set(windows)]
    kinds = [f"{len(windows)} sliding-window ({layer_runs(windows)}) on the tokens their window stores"] * bool(windows)
    kinds += [f"{len(full)} full-attention ({layer_runs(full)})"] * bool(full)
    how = "; by the model's own forward per layer-side" if c.get("method") == "forwards" else ""
    return f"all {n} layers: {', '.join(kinds)}{how}"


def budget_flags(target):
    """A calibration record's "target" as the build options that ask for it: {"target_ratio": 3.0} ->
    '--target-ratio 3x' (also --preset, --max-bytes-per-token, --max-kl)."""
    shown = {"preset": "{}", "target_ratio": "{:g}x", "max_bytes_per_token": "{}", "max_kl": "{:g}"}
    return " ".join(f"--{k.replace('_', '-')} {shown.get(k, '{}').format(v)}" for k, v in target.items())


def agreement(c):
    """'top-1 agreement 90% over 49 positions (...)' of a calibration record: E's positions are the
    document's last tokens, then each probe question and the model's answer (`cartridge.calibrate.sequence`)."""
    probes = "the probe questions and their answers" if isinstance(c.get("probe"), list) else \
        "the probe question and its answer"
    return (f"top-1 agreement {c.get('top1_agreement', 0):.0%} over {c.get('eval_tokens', 0)} positions "
            f"(the document's last tokens, {probes})")


def calibration_lines(c, n_layers=None):
    """The `inspect` lines of a calibration record (none when the schema was not measured): the choice, and
    which layers were measured (`n_layers`: the cartridge's, for a record that does not say)."""
    if not c:
        return []
    return [f"calibrated    {budget_flags(c['target'])}: {c['bytes_per_token']:,} bytes/token ({fp16_ratio(c)} "
            f"smaller than fp16){window_text(c)}, predicted KL {c['predicted_kl']:.4f}, measured KL "
            f"{c['measured_kl']:.4f} nats/token, {agreement(c)}",
            f"measured      {measured_text(c, n_layers)}"]


def _auto(info):
    """What `auto` does with this cartridge on this device (model dtype: float32 on CPU, else as computed)."""
    dtype = mx.float32 if device() == "cpu" else DTYPES[info.source_dtype]
    plan = plan_from_header(info, dtype)
    return {"backend": device(), "auto": plan["policy"], "reason": plan["reason"], "memory": plan["memory"],
            "layers": [x["policy"] if x else None for x in plan["layers"]]}


def _memory_line(m):
    mb = 1e6
    limit = ("no budget: fp16/bf16 pages are decoded whole" if m["budget_bytes"] is None else
             f"budget {m['budget_bytes'] / mb:,.1f} MB = stored x 1.25 + one layer decoded")
    return (f"memory        auto holds {m['resident_bytes'] / mb:,.1f} MB after load (stored {m['stored_bytes'] / mb:,.1f} MB, "
            f"{limit}), peak while loading or decoding {m['planned_peak_bytes'] / mb:,.1f} MB (planned; the model's "
            f"weights not included)")


def source_lines(source, label="document"):
    """The document lines of `inspect`: file name, size, SHA-256, first line ("-" where not recorded)."""
    src = {k: source.get(k) for k in ("name", "bytes", "sha256", "first_line")}
    size = "-" if src["bytes"] is None else f"{src['bytes']:,} bytes"
    first = "-" if src["first_line"] is None else repr(src["first_line"][:120])
    return [f"{label:<14}{src['name'] or '-'}, {size}, sha256 {src['sha256'] or '-'}",
            f"first line    {first}"]


def sources_lines(sources):
    """`source_lines` of every source in order ("document", then "document 2", ...); one "-" line if none."""
    return [line for i, src in enumerate(sources or [{}])
            for line in source_lines(src, "document" if i == 0 else f"document {i + 1}")]


def _conversation_lines(d):
    """A saved conversation's line: the tokens after the document (`prompt.document_tokens`, format 1.3)."""
    doc = d.get("document_tokens")
    if doc is None or doc >= d["tokens"]:
        return []
    return [f"conversation  tokens {doc}..{d['tokens']} after the document's {doc:,} (saved by ask --save-as or "
            f"chat /save; continue it with ask; extend and compose take a bare document)"]


def _per_token_layers(split):
    """'' when every layer stores every token, else ' in the 3 of 18 layers that store every token'."""
    if split["per_token_layers"] == split["layers"]:
        return ""
    return f" in the {split['per_token_layers']} of {split['layers']} layers that store every token"


_FIXED_WHY = {"window": "each keeps only the last tokens of its window", "state": "recurrent state"}


def _fixed_lines(split):
    """inspect's line per kind of layer whose payload does not grow with the document (bytes/token leaves it out)."""
    return [f"fixed         {f['bytes']:,} bytes in {f['layers']} {kind} layer{'' if f['layers'] == 1 else 's'} "
            f"(not in bytes/token: {_FIXED_WHY.get(kind, 'a fixed payload')})" for kind, f in split["fixed"].items()]


def inspect_table(d):
    """Human-readable rendering of `inspect_dict`."""
    lines = [
        f"format        {d['format_version']}",
        f"model         {d['model']['ref']}  (fingerprint {d['model']['fingerprint'][:16]})",
        f"hub repo      {d['model'].get('repo_id') or '-'}, revision {d['model'].get('revision') or '-'}",
        f"prompt        {prompt_format(d['prompt_mode'])}",
        f"tokens        {d['tokens']:,} in {d['n_pages']} page{'' if d['n_pages'] == 1 else 's'} of {d['page_size']}",
        *_conversation_lines(d),
        f"shape         {d['n_layers']} layers x {d['n_kv_heads']} kv heads x head_dim {d['head_dim']} "
        f"(kv_dim {d['kv_dim']}), computed as {d['source_dtype']}",
        f"bytes/token   {d['bytes_per_token']:,}{_per_token_layers(d['per_token_split'])} (fp16 would be "
        f"{d['fp16_bytes_per_token']:,}; " + _versus_fp16(d['bytes_per_token'], d['fp16_bytes_per_token']),
        *_fixed_lines(d["per_token_split"]),
        f"on disk       {d['total_bytes']:,} bytes",
        *sources_lines(d["sources"]),
        f"protected     first {d['protected']['first']} and last {d['protected']['last']} tokens of every layer "
        f"also kept in fp16",
        *([f"encoded       K {ENCODER_WORDS[d['encoders']['k']]}, V {ENCODER_WORDS[d['encoders']['v']]} (at build; "
           f"tokens added later nearest)"] if d.get("encoders") else []),
        *([f"K scaled      per channel in {len(d['k_scaled_layers'])} layers (format 1.11; the queries are "
           f"multiplied by the scale)"] if d.get("k_scaled_layers") else []),
        *([f"system        {d['system'][:120]!r}"] if d.get("system") is not None else []),
        f"preset        {d.get('preset') or '-'}",
        *calibration_lines(d.get("calibration"), d["n_layers"]),
        f"attention     auto -> {d['attention']['auto']} on this {d['attention']['backend']} device: "
        f"{d['attention']['reason']}",
        _memory_line(d["attention"]["memory"]),
    ]
    w = max([8] + [len(name) for run in d["tier_runs"] for name in (run["k"], run["v"]) if name])  # the K/V columns
    lines.append(f"tiers         layers  {'K':<{w}} {'V':<{w}} bytes/token/layer (K+V)")
    shapes = {row["layer"]: row for row in d["layers"]}
    for run in d["tier_runs"]:
        first = shapes[int(run["layers"].split("-")[0])]
        if run["k"] is None:
            what = KINDS[first["kind"]].tier_label
            lines.append(f"              {run['layers']:<7} {what:<{w}} {what:<{w}} -")
            continue
        per = sum(TIERS[run[s]].bytes_per_token(*u[f"{s}_shape"]) for u in first.get("caches", [first])
                  if KINDS[u["kind"]].tiered for s in ("k", "v"))
        lines.append(f"              {run['layers']:<7} {run['k']:<{w}} {run['v']:<{w}} {per:,}")
    lines.append("layers        layers  kind       holds")
    for run in fold_layers(d["layers"]):
        lines.append(f"              {run['layers']:<7} {run['kind']:<10} {KINDS[run['kind']].holds(run)}")
    lines.append("formulas      bytes/token/layer-side (H = n_kv_heads)")
    for name, f in d["tier_formulas"].items():
        lines.append(f"              {name:<8} {f['formula']} = {f['bytes_per_token_per_layer_side']:,}")
    return "\n".join(lines)
