"""`cartridge eval A B ...` (several documents): parse the composed mode's options, call
`cartridge.eval.composed.evaluate_composed`, print its table (text or markdown)."""

from cartridge.errors import InputError
from cartridge.eval.dataset import load_questions

from .eval_report import render_markdown, render_text

COLUMNS = ("setting", "first token (one doc / both)", "exact answer (one / both)", "mean BLEU (one / both)",
           "tokens to divergence (one / both)", "needles", "median TTFT", "vs one cartridge")
SINGLE_ONLY = ("tiers", "schemas", "heldout", "heldout_fraction", "no_fresh", "plot_path")


def parse_recompute(text):
    """"0,16,64" -> (0, 16, 64).

    Raises:
        InputError: an empty, non-integer, negative or repeated entry.
    """
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise InputError(f"--recompute entry {part!r} must be a whole number of tokens >= 0 (as 0,16,64)")
        if int(part) in out:
            raise InputError(f"--recompute lists {int(part)} more than once")
        out.append(int(part))
    return tuple(out)


def parse_ratios(text):
    """"0,0.1,0.15" -> (0.0, 0.1, 0.15).

    Raises:
        InputError: an entry that is not a number in [0, 1], or a repeated one.
    """
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            value = None
        if value is None or not 0 <= value <= 1:  # NaN fails both comparisons
            raise InputError(f"--recompute-ratio entry {part.strip()!r} must be a fraction between 0 and 1 "
                             "(as 0,0.1,0.15)")
        if value in out:
            raise InputError(f"--recompute-ratio lists {value:g} more than once")
        out.append(value)
    return tuple(out)


def check_options(n_corpora, given):
    """Refuse options of the other mode: `given` are the option names set on the command line.

    Raises:
        InputError: a one-document option with several documents, or --recompute/--recompute-ratio/--needles-in
            with one.
    """
    if n_corpora > 1:
        wrong = [name for name in SINGLE_ONLY if name in given]
        if wrong:
            flags = ", ".join("--" + w.removesuffix("_path").replace("_", "-") for w in wrong)
            raise InputError(f"{flags}: for one document; several documents are composed from fp16 cartridges")
    else:
        wrong = [name for name in ("recompute", "recompute_ratio", "reference", "needles_in") if name in given]
        if wrong:
            raise InputError(f"--{wrong[0].replace('_', '-')} needs two or more documents (it composes them)")


def _pair(cmp, fmt):
    return " / ".join("-" if cmp.get(c) is None else fmt(cmp[c]) for c in ("one", "both"))


def _needles(nd):
    if not nd:
        return "-"
    return f"{nd['found']}/{nd['n']} (" + " ".join(f"{d['found']}/{d['n']}" for d in nd["by_depth"].values()) + ")"


def setting_label(row):
    """"recompute 16", or with a CacheBlend recompute ratio "recompute 16, ratio 0.15 (15.1% recomputed)"."""
    label = f"recompute {row['recompute']}"
    if row.get("recompute_ratio"):
        label += f", ratio {row['recompute_ratio']:g} ({100 * row['recomputed']['fraction']:.1f}% recomputed)"
    return label


def row_cells(row):
    """The cells of one setting's row."""
    v, t = row["vs_reference"], row["ttft"]
    return [
        setting_label(row),
        _pair(v, lambda c: f"{c['first_token']}/{c['n']}"),
        _pair(v, lambda c: f"{c['exact']}/{c['n']}"),
        _pair(v, lambda c: f"{c['bleu']:.3f}"),
        _pair(v, lambda c: f"{c['divergence']:.1f}"),
        _needles(row.get("needles")),
        f"{t['median_s']:.3f} s",
        f"{t['ratio']:.2f}x ({t['single_median_s']:.3f} s)"
        + (f", paired {t['paired_ratio']:.2f}x" if "paired_ratio" in t else ""),
    ]


def _rows(report):
    ref = report["reference"]
    kind = "recompute all" if ref.get("kind") == "recompute-all" else "fresh prefill"
    first = [f"{kind} (reference)", "ref", "ref", "ref", "ref", _needles(ref.get("needles")),
             f"{ref['ttft_median_s']:.3f} s", "-"]
    return [first] + [row_cells(r) for r in report["rows"]]


def _caption(report):
    s, docs, q = report["settings"], report["documents"], report["questions"]
    n_both = sum(x["source"] == "both" for x in q)
    sizes = ", ".join(f"{d['letter']} {d['prefix_tokens']:,}" for d in docs)
    return [
        f"model {report['model']['ref']}; {len(q)} questions ({len(q) - n_both} answered by one document, {n_both} "
        f"by both) x {s['max_tokens']} greedy tokens; fp16 cartridges, tokens with the chat-template header: {sizes}; "
        f"composed {report['composed_tokens']:,}; same token ids as the reference's text: "
        f"{'yes' if report['layout_tokens_match'] else 'NO'}",
        "first token / exact answer / BLEU / tokens to divergence: each composed answer against the reference's "
        f"({'recompute all' if report['reference'].get('kind') == 'recompute-all' else 'fresh prefill'}); "
        f"BLEU = {report['bleu']}",
        f"needles: {len(report['needles'])} facts planted in document {s['needles_in'] or '-'}, exact-match recall "
        "by depth",
        f"TTFT: median over the questions, from making the cache to the first token; vs one cartridge: against "
        f"asking document {report['single']['letter']}'s cartridge alone ({report['single']['attention']}, median "
        "in brackets), each question asked of both back to back; paired: median of the per-question ratios; "
        f"load average at the end {_load(report)}",
    ]


def _load(report):
    la = report.get("load_average")
    return "-" if not la else " / ".join(f"{x:.1f}" for x in la)


def text_table(report):
    """Fixed-width table with a caption, for the terminal."""
    return render_text(COLUMNS, _rows(report), _caption(report))


def markdown_table(report):
    """GitHub markdown table with the caption as a list below it."""
    return render_markdown(COLUMNS, _rows(report), _caption(report))


def run_composed(corpora, texts, questions_path, lm_ref, needles, recompute, ratios, needles_in, common, progress,
                 reference="fresh"):
    """Load the questions, run `evaluate_composed`; the report with the document paths recorded."""
    from cartridge.eval.composed import ComposeConfig, evaluate_composed, sources  # (loads mlx-lm: not at CLI start)

    questions = load_questions(questions_path, sources(len(texts)))
    config = ComposeConfig(recompute=parse_recompute(recompute), ratios=parse_ratios(ratios), needles_in=needles_in,
                           reference=reference, **common)
    report = evaluate_composed(texts, questions, model=lm_ref, needles=needles, config=config, progress=progress)
    for doc, path in zip(report["documents"], corpora):
        doc["path"] = path
    return report
