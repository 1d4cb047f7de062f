"""Tables and plot of issue 19's measurements from `cartridge eval --json` files (docs/evaluation.md).

    python benchmarks/issue19_report.py benchmarks/results/eval-issue19-*.json --plot docs/eval-issue19.png
    python benchmarks/issue19_report.py --layers benchmarks/results/layer-error-issue19-*.json \
        --plot docs/layer-error-issue19.png

Prints one markdown table per document (every row against that document's fp16 cartridge) and draws
mean BLEU and needle recall against bytes/token for every document in one PNG; with --layers, the
`benchmarks/layer_error.py` outputs instead: a table of mean errors per configuration and document and
the per-layer K and attention-output errors.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HEAD = ("| configuration | bytes/token | vs fp16 | first token | exact answer | mean BLEU | tokens to divergence "
        "| held-out ppl vs fp16 | needles |\n|---|---|---|---|---|---|---|---|---|")


def row(r, ref_needles):
    v = r.get("vs_fp16")
    n = r["needles"]
    needles = f"{n['found']}/{n['n']}" + ("" if v is None else (" (= fp16)" if n["found"] == ref_needles else ""))
    if v is None:
        return (f"| {r['label']} | {r['bytes_per_token']:,} | 1.00x | ref | ref | ref | ref | "
                f"ppl {r['perplexity']:.3f} | {needles} |")
    return (f"| {r['label']} | {r['bytes_per_token']:,} | {r['compression']:.2f}x | {v['first_token']}/{v['n']} | "
            f"{v['exact']}/{v['n']} | {v['bleu']:.3f} | {v['divergence']:.1f} | {100 * r['perplexity_change']:+.3f}% "
            f"| {needles} |")


def table(report):
    rows = [r for r in report["rows"] if r["kind"] == "cartridge"]
    ref = next(r for r in rows if r["vs_fp16"] is None)
    return "\n".join([HEAD] + [row(r, ref["needles"]["found"]) for r in rows])


def plot(reports, path):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for report in reports:
        name = Path(report["corpus"]["path"] if isinstance(report.get("corpus"), dict) else report["corpus"]).stem
        rows = [r for r in report["rows"] if r["kind"] == "cartridge"]
        for ax, value in zip(axes, (lambda r: 1.0 if r["vs_fp16"] is None else r["vs_fp16"]["bleu"],
                                    lambda r: r["needles"]["recall"])):
            xs, ys = [r["bytes_per_token"] for r in rows], [value(r) for r in rows]
            ax.scatter(xs, ys, label=name)
            for r, x, y in zip(rows, xs, ys):
                ax.annotate(r["label"], (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    axes[0].set(xlabel="bytes/token (all layers, K+V, protected copies included)", ylabel="mean BLEU vs fp16")
    axes[1].set(xlabel="bytes/token", ylabel="needle recall (10 needles)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def layer_table(results):
    """Markdown: mean K/V relative error and attention-output relative error, one column pair per document."""
    names = [Path(r["document"]).stem for r in results]
    head = "| configuration | " + " | ".join(f"{n}: K rel / V rel / attn rel" for n in names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]
    for label in results[0]["configs"]:
        cells = []
        for r in results:
            m = r["configs"][label]["mean"]
            cells.append(f"{m['k_rel']:.4f} / {m['v_rel']:.4f} / {m['attn_rel']:.4f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_layers(results, path):
    shown = ["mlx4g32", "mlx4g32+rot", "mlx4g32+rot:pf4:pl28", "k=kivi4:v=mlx4g32+rot", "nvfp4+rot", "int8",
             "preset=safe", "preset=compact"]
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4 * len(results)), squeeze=False)
    for row, res in zip(axes, results):
        for label in shown:
            layers = res["configs"][label]["layers"]
            row[0].plot([r["k_rel"] for r in layers], label=label)
            row[1].plot([r["attn_rel"] for r in layers], label=label)
        name = Path(res["document"]).name
        row[0].set(title=f"{name}: K relative error", xlabel="layer", yscale="log")
        row[1].set(title=f"{name}: attention-output relative error (question queries)", xlabel="layer",
                   yscale="log")
    axes[0][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--layers", action="store_true", help="the files are benchmarks/layer_error.py outputs")
    args = ap.parse_args()
    if args.layers:
        results = [r for p in args.reports for r in json.loads(Path(p).read_text())["results"]]
        print(layer_table(results))
        if args.plot:
            plot_layers(results, args.plot)
        return
    reports = [json.loads(Path(p).read_text()) for p in args.reports]
    for p, report in zip(args.reports, reports):
        print(f"\n{p}\n\n{table(report)}")
    if args.plot:
        plot(reports, args.plot)


if __name__ == "__main__":
    main()
