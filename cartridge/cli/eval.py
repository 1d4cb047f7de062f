"""`cartridge eval`: fidelity of compressed cartridges against the fp16 one; with several documents,
of composed cartridges against a fresh prefill of the joined text (`eval_composed`). Thin: parse,
call `cartridge.eval.evaluate.evaluate` (or `evaluate_composed`), print the table, write JSON and the plot."""

import json
import sys
from pathlib import Path

import click
from click.core import ParameterSource
from tqdm import tqdm

from cartridge.errors import InputError
from cartridge.eval.dataset import load_needles, load_questions
from cartridge.format.atomic import write_file
from cartridge.format.writer import check_utf8_path
from cartridge.tiers import TIERS

from .common import MODEL_FORMS, check_output_file, read_corpus
from .eval_composed import check_options, run_composed
from .eval_composed import markdown_table as composed_markdown
from .eval_composed import text_table as composed_text
from .eval_report import markdown_table, text_table, write_plot

SAMPLE_NEEDLES = Path(__file__).resolve().parents[1] / "samples" / "needles.jsonl"  # shipped in the package


def _specs(tiers, schemas):
    from cartridge.eval.spec import load_schemas, parse_tiers  # (loads mlx-lm: not at CLI start)

    if tiers is not None and not tiers.strip(" ,"):
        raise InputError("--tiers is empty: name at least one tier (leave the option out for every tier)")
    specs = parse_tiers(tiers or ",".join(TIERS))
    if schemas:
        specs += load_schemas(schemas)
    labels = [s.label for s in specs]
    clash = sorted({x for x in labels if labels.count(x) > 1})
    if clash:
        raise InputError(f"label(s) {', '.join(clash)} appear in both --tiers and --schemas")
    return specs


def _needles(value):
    if value == "none":
        return []
    if value is None:
        if not SAMPLE_NEEDLES.is_file():
            click.echo("note: no --needles file and no samples/needles.jsonl here; needle recall skipped", err=True)
            return []
        value = SAMPLE_NEEDLES
    return load_needles(value)


def _bar():
    """A progress callback drawing one tqdm bar on stderr, made at its first call; and a closer."""
    bars = []

    def progress(done, total, what):
        if not bars:
            bars.append(tqdm(total=total, unit="step", desc="eval", file=sys.stderr, dynamic_ncols=True))
        bars[0].set_postfix_str(what, refresh=False)
        bars[0].update(done - bars[0].n)

    return progress, lambda: [b.close() for b in bars]


@click.command("eval")
@click.argument("corpus", nargs=-1, required=True)
@click.option("--questions", "questions_path", required=True, help="JSONL: one {\"question\": ...} a line.")
@click.option("--model", default=None, help=f"The model: {MODEL_FORMS}.")
@click.option("--tiers", default=None, help="Comma-separated entries: TIER, TIER:bpN, k=TIER:v=TIER[:bpN], "
              "...:pfN:plM (protected tokens), preset=NAME, ...:kenc=nearest|score, ...:kscale|nokscale, "
              "...:venc=nearest|output (build's encoders) (e.g. fp16,mlx4g32:bp2,k=fp16:v=fp8,preset=balanced:nokscale). "
              "Default: every registered tier.")
@click.option("--schemas", default=None, help="JSON file: label -> schema list or build keywords.")
@click.option("--needles", default=None, help="Needle set (JSONL); default samples/needles.jsonl; none to skip.")
@click.option("--heldout", default=None, help="Held-out text file (default: the corpus tail, see --heldout-fraction).")
@click.option("--heldout-fraction", default=0.15, show_default=True, help="Corpus share held out without --heldout.")
@click.option("--max-tokens", default=50, show_default=True, help="Greedy tokens per answer.")
@click.option("--no-fresh", is_flag=True, help="Skip the no-cartridge fresh-prefill row (the slowest part).")
@click.option("--work-dir", default=None, help="Cartridge cache folder. Default: ~/.cache/cartridge/eval.")
@click.option("--rebuild", is_flag=True, help="Rebuild cartridges even if cached.")
@click.option("--page-size", default=256, show_default=True, help="Tokens per page.")
@click.option("--json", "json_path", default=None, help="Write the full report (every answer) as JSON here.")
@click.option("--plot", "plot_path", default=None, help="Write a PNG of fidelity against bytes/token here.")
@click.option("--force", is_flag=True, help="Replace existing --json/--plot files (refused otherwise).")
@click.option("--markdown", is_flag=True, help="Print the table as GitHub markdown.")
@click.option("--recompute", default="0,16,64", show_default=True,
              help="Several documents: comma-separated settings, tokens of each later document recomputed.")
@click.option("--recompute-ratio", default="0", show_default=True,
              help="Several documents: comma-separated CacheBlend recompute ratios, the fraction of each later document's "
              "tokens recomputed (those whose K/V deviate most), each run with every --recompute setting.")
@click.option("--reference", type=click.Choice(["fresh", "recompute-all"]), default="fresh", show_default=True,
              help="Several documents: what answers are compared with: a fresh prefill of the whole prompt per "
              "question, or the documents composed with every later token recomputed (one prefill of them).")
@click.option("--needles-in", default=None, help="Several documents: letter of the document the needles are "
              "planted in (a, b, ...). Default: the last.")
@click.pass_context
def eval_command(ctx, corpus, questions_path, model, tiers, schemas, needles, heldout, heldout_fraction, max_tokens,
                 no_fresh, work_dir, rebuild, page_size, json_path, plot_path, force, markdown, recompute, recompute_ratio, reference,
                 needles_in):
    """Build one cartridge per tier/schema of CORPUS and compare its answers with the fp16 cartridge's.

    With two or more documents (CORPUS A B ...): build one fp16 cartridge per document, compose them
    with each --recompute and --recompute-ratio setting and compare the answers with a fresh prefill of the joined text;
    every question line names the document that answers it ("source": "a", "b", ... or "both").

    The --json and --plot files are checked before any work (their folder must exist; an existing file
    is replaced only with --force) and written atomically, mode 0666 minus the umask.
    """
    given = {k for k in ctx.params if ctx.get_parameter_source(k) != ParameterSource.DEFAULT}
    check_options(len(corpus), given)
    json_path = check_output_file(json_path, "--json", force)
    plot_path = check_output_file(plot_path, "--plot", force)
    if work_dir is not None:
        check_utf8_path(work_dir, "--work-dir")  # cartridges are built there
    texts = [read_corpus(c) for c in corpus]
    progress, close = _bar()
    try:
        if len(texts) > 1:
            common = dict(max_tokens=max_tokens, work_dir=work_dir, rebuild=rebuild, page_size=page_size)
            report = run_composed(list(corpus), texts, questions_path, model, _needles(needles), recompute,
                                  recompute_ratio, needles_in, common, progress, reference)
        else:
            report = _single(texts[0], questions_path, model, tiers, schemas, needles, heldout, heldout_fraction,
                             max_tokens, no_fresh, work_dir, rebuild, page_size, progress)
            report["corpus"] = corpus[0]
    finally:
        close()
    if len(texts) > 1:
        click.echo(composed_markdown(report) if markdown else composed_text(report))
    else:
        click.echo(markdown_table(report) if markdown else text_table(report))
    if json_path:
        write_file(json_path, lambda tmp: tmp.write_text(json.dumps(report, indent=1)))
    if plot_path:
        write_file(plot_path, lambda tmp: write_plot(report, tmp))


def _single(text, questions_path, model, tiers, schemas, needles, heldout, heldout_fraction, max_tokens, no_fresh,
            work_dir, rebuild, page_size, progress):
    """One document: every tier/schema against the fp16 cartridge (`cartridge.eval.evaluate`)."""
    from cartridge.eval.evaluate import EvalConfig, evaluate  # (loads mlx-lm: not at CLI start)

    questions = load_questions(questions_path)
    specs = _specs(tiers, schemas)
    config = EvalConfig(max_tokens=max_tokens, fresh=not no_fresh,
                        heldout=read_corpus(heldout, "held-out file") if heldout else None,
                        heldout_fraction=heldout_fraction, work_dir=work_dir, rebuild=rebuild, page_size=page_size)
    return evaluate(text, questions, model=model, specs=specs, needles=_needles(needles), config=config,
                    progress=progress)
