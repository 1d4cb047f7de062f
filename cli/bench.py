"""`cartridge bench`: attention and decode speed per context, tier and attention policy."""

import json
import sys
from pathlib import Path

import click

from cartridge.errors import InputError


def _ints(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--contexts must be comma-separated token counts, got {text!r}") from None


def _tiers(text, known):
    names = [t.strip() for t in text.split(",") if t.strip()]
    for t in names:
        if t not in known:
            raise InputError(f"unknown tier {t!r}; known tiers: {', '.join(known)}")
    return names


def _table(result):
    lines = [f"{'context':>8} {'tier':<14} {'policy':<17} {'attention µs':>13} {'vs dense':>9} {'bytes':>14}"]
    dense = {r["context"]: r["us"] for r in result["attention"] if r["policy"] == "mlx-sdpa"}
    for r in result["attention"]:
        us = f"{r['us']:.1f}" if r["us"] else "-"
        rel = f"{r['us'] / dense[r['context']]:.2f}x" if r["us"] and dense.get(r["context"]) else "-"
        nb = f"{r['prefix_bytes']:,}" if r["prefix_bytes"] else "-"
        lines.append(f"{r['context']:>8} {r['tier']:<14} {str(r['policy']):<17} {us:>13} {rel:>9} {nb:>14}"
                     + (f"  ({r['error'][:60]})" if r["error"] else ""))
    if result["end_to_end"]:
        lines.append(f"\n{'context':>8} {'tier':<14} {'policy':<17} {'decode tok/s':>13} {'peak GB':>9}")
        for r in result["end_to_end"]:
            tps = f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "-"
            peak = f"{r['peak_bytes'] / 1e9:.2f}" if r["peak_bytes"] else "-"
            lines.append(f"{r['context']:>8} {r['tier']:<14} {str(r['policy']):<17} {tps:>13} {peak:>9}"
                         + (f"  ({r['error'][:60]})" if r["error"] else ""))
    bw = result["copy_bytes_per_s"]
    lines.append(f"\ncopy bandwidth {bw / 1e9:.1f} GB/s; {json.dumps(result['environment'])}")
    return "\n".join(lines)


@click.command()
@click.option("--contexts", default=None, help="Prefix lengths in tokens (default: 8192,32768,65536,131072 "
              "on CUDA; 2048,8192 elsewhere).")
@click.option("--tiers", default=None, help="Comma-separated tiers (default: all registered).")
@click.option("--shape", default=None, help="Microbenchmark shape: llama3-8b, llama3.2-1b, smollm2-135m "
              "(default: llama3-8b on CUDA, smollm2-135m elsewhere).")
@click.option("--e2e-contexts", default=None, help="Prefix lengths for end-to-end decode (default: --contexts).")
@click.option("--no-e2e", is_flag=True, help="Skip end-to-end decode.")
@click.option("--e2e-tiers", default=None, help="Tiers for end-to-end decode (default: --tiers).")
@click.option("--policies", default=None, help="Attention policies to measure (default: all on this backend).")
@click.option("--repeats", default=20, show_default=True, help="Timed repeats per measurement (median).")
@click.option("--json", "json_path", default=None, help="Write all results to this JSON file.")
@click.option("--plot", "plot_path", default=None, help="Write a PNG plot of attention time vs context.")
def bench(contexts, tiers, shape, e2e_contexts, no_e2e, e2e_tiers, policies, repeats, json_path, plot_path):
    """Measure decode-step attention and end-to-end decode for each context, tier and policy.

    End to end uses a model: on CUDA a random-weight Llama-3.2-1B-shaped model in float16, elsewhere
    the default model (SmolLM2-135M-Instruct). K/V prefixes are synthetic, of the model's shape.
    """
    import mlx.core as mx

    from cartridge import bench as B
    from cartridge.tiers import TIERS

    cuda = B.backend() == "cuda"
    ctx = _ints(contexts) if contexts else ([8192, 32768, 65536, 131072] if cuda else [2048, 8192])
    names = _tiers(tiers, TIERS) if tiers else sorted(TIERS)
    e2e_names = _tiers(e2e_tiers, TIERS) if e2e_tiers else None
    if policies:
        B.POLICIES = [p.strip() for p in policies.split(",")]
    shape = shape or ("llama3-8b" if cuda else "smollm2-135m")
    if shape not in B.SHAPES:
        raise InputError(f"unknown shape {shape!r}; known: {', '.join(B.SHAPES)}")
    e2e = None
    if not no_e2e:
        if cuda:
            e2e = (B.random_model("llama3.2-1b"), mx.float16)
        else:
            import cartridge

            e2e = (cartridge.load_model().model, mx.float32)
    result = B.run(ctx, names, shape, e2e, _ints(e2e_contexts) if e2e_contexts else None, repeats,
                   progress=lambda msg: click.echo(f"bench: {msg}", err=True), e2e_tiers=e2e_names)
    click.echo(_table(result))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
    if plot_path:
        B.plot(result, plot_path)
    sys.stdout.flush()
