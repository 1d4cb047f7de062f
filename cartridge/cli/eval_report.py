"""What `cartridge eval` prints and draws: one table (text or markdown) and a fidelity/bytes plot."""

COLUMNS = ("tier / schema", "bytes/token", "compression", "build KL", "first token", "exact answer", "mean BLEU",
           "tokens to divergence", "held-out ppl", "ppl vs fp16", "needles", "needles vs fp16")


def _vs(row, key, fmt):
    cmp = row.get("vs_fp16")
    return "ref" if cmp is None else fmt(cmp, key)


def _count(cmp, key):
    return f"{cmp[key]}/{cmp['n']}"


def _needles(row):
    nd = row.get("needles")
    if not nd:
        return "-"
    depths = " ".join(f"{d['found']}/{d['n']}" for d in nd["by_depth"].values())
    return f"{nd['found']}/{nd['n']} ({depths})"


def row_cells(row):
    """The table cells of one report row, as strings."""
    cart = row["kind"] == "cartridge"
    return [
        row["label"] + (" (no cartridge)" if not cart else ""),
        f"{row['bytes_per_token']:,}" if cart else "-",
        f"{row['compression']:.2f}x" if cart else "-",
        "-" if row.get("build_kl") is None else f"{row['build_kl']:.4f}",
        _vs(row, "first_token", _count),
        _vs(row, "exact", _count),
        _vs(row, "bleu", lambda c, k: f"{c[k]:.3f}"),
        _vs(row, "divergence", lambda c, k: f"{c[k]:.1f}"),
        f"{row['perplexity']:.3f}",
        "ref" if "perplexity_change" not in row else f"{100 * row['perplexity_change']:+.3f}%",
        _needles(row),
        _needles_vs(row),
    ]


def _needles_vs(row):
    """"ref", "same" (every needle found or missed as by fp16), "-L +G" (lost, gained), or "-" (no needles)."""
    if row.get("vs_fp16") is None:
        return "ref" if row.get("needles") else "-"
    cmp = row["vs_fp16"].get("needles")
    if cmp is None:
        return "-"
    return "same" if cmp["same"] == cmp["n"] else f"-{cmp['lost']} +{cmp['gained']}"


def _caption(report):
    s, d = report["settings"], report["documents"]
    depths = " ".join(next((r["needles"]["by_depth"] for r in report["rows"] if r.get("needles")), {}))
    return [
        f"model {report['model']['ref']}; {d['questions']} questions x {s['max_tokens']} greedy tokens; "
        f"document {d['qa_tokens']:,} tokens",
        "compression: fp16 bytes/token / these bytes/token; build KL: nats/token vs fp16 measured on the document "
        "when the build chose the tiers (- where they were given); "
        f"first token / exact answer / BLEU / tokens to divergence: each answer against the fp16 cartridge's; "
        f"BLEU = {report['bleu']}; tokens to divergence = leading tokens shared with the fp16 answer "
        "(its whole length when identical)",
        f"held-out ppl: {d['heldout_tokens_scored']} tokens of the {s['heldout_source']}, teacher-forced after a "
        f"{d['probe_tokens']:,}-token probe document",
        f"needles: {d['needles']} planted facts, exact-match recall, by depth {depths or '-'}; needles vs fp16: "
        "same = each found or missed as with the fp16 cartridge, else -lost +gained",
        *_per_token_caption(report["rows"]),
    ]


def _per_token_caption(rows):
    """Where some layers do not store every token (a windowed model): which ones bytes/token counts, and the
    fixed bytes of the others per row (issue 47)."""
    split = next((r["per_token_split"] for r in rows if r.get("per_token_split")), None)
    if split is None or split["per_token_layers"] == split["layers"]:
        return []
    kinds = ", ".join(f"{f['layers']} {kind}" for kind, f in split["fixed"].items())
    fixed = "; ".join(f"{r['label']} {sum(f['bytes'] for f in r['per_token_split']['fixed'].values()):,}"
                      for r in rows if r.get("per_token_split"))
    return [f"bytes/token: the {split['per_token_layers']} of {split['layers']} layers that store every token; "
            f"the others ({kinds} layers) hold fixed bytes: {fixed}"]


def render_text(columns, rows, caption):
    """Fixed-width table (columns, then rows of cell strings) with caption lines below, for the terminal."""
    rows = [list(columns)] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [""] + caption)


def render_markdown(columns, rows, caption):
    """GitHub markdown table with the caption as a list below it (for the README)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines + [""] + [f"- {c}" for c in caption])


def text_table(report):
    """Fixed-width table with a caption, for the terminal."""
    return render_text(COLUMNS, [row_cells(r) for r in report["rows"]], _caption(report))


def markdown_table(report):
    """GitHub markdown table with the caption as a list below it (for the README)."""
    return render_markdown(COLUMNS, [row_cells(r) for r in report["rows"]], _caption(report))


def _series(report):
    """[(label, bytes/token, BLEU, first-token fraction, needle recall or None)] for cartridge rows."""
    out = []
    for r in report["rows"]:
        if r["kind"] != "cartridge":
            continue
        cmp = r["vs_fp16"] or {"bleu": 1.0, "first_token_fraction": 1.0}
        out.append((r["label"], r["bytes_per_token"], cmp["bleu"], cmp["first_token_fraction"],
                    r["needles"]["recall"] if r.get("needles") else None))
    return out


def write_plot(report, path):
    """PNG: fidelity against bytes/token, one point per cartridge (BLEU, first-token, needle recall)."""
    import matplotlib  # (1.5-2 s with pyplot on this machine: not at CLI start, only for --plot)

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # (after matplotlib.use: not at CLI start)

    pts = _series(report)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    xs = [p[1] for p in pts]
    ax.scatter(xs, [p[2] for p in pts], marker="o", s=40, label="mean BLEU vs fp16 answers")
    ax.scatter(xs, [p[3] for p in pts], marker="^", s=30, label="first-token agreement")
    if all(p[4] is not None for p in pts):
        ax.scatter(xs, [p[4] for p in pts], marker="s", s=20, label="needle recall")
    spots = {}  # points at the same place share one label: "fp16, bf16"
    for label, x, bleu, *_ in pts:
        spots.setdefault((x, round(bleu, 3)), []).append(label)
    for (x, bleu), labels in spots.items():
        ax.annotate(", ".join(labels), (x, bleu), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlim(0, 1.1 * max(xs))
    ax.set_xlabel("bytes per token (K+V, all layers)")
    ax.set_ylabel("fidelity (0-1)")
    ax.set_ylim(-0.05, 1.08)
    ax.set_title(f"cartridge eval: {report['model']['ref']}, {report['documents']['questions']} questions")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
