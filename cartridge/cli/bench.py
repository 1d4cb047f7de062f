"""`cartridge bench`: attention and decode speed per context, tier and attention policy."""

import json
import os
import re
import sys

import click
import mlx.core as mx

import cartridge
from cartridge.attention import backends
from cartridge.attention import auto_table
from cartridge.attention.policy import POLICIES
from cartridge.errors import InputError
from cartridge.format.atomic import write_file
from cartridge.tiers import TIERS

from .common import check_output_file

MAX_REPEATS = 1000  # timed rounds per measurement; more only makes a run endless
MAX_CONTEXT = 1 << 19  # tokens; beyond it is refused (0 crashed with SIGFPE, 10**8 and 2**20 at llama3-8b on CPU segfaulted)


def _split(text, option, noun, hint=""):
    """The comma-separated items of `text`; refused when there are none or one is empty."""
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise InputError(f"{option} names no {noun}{hint}")
    if not all(items):
        raise InputError(f"{option} {text!r} has an empty item; separate {noun}s with single commas")
    return items


def _once(values, option):
    """`values`, refused when one repeats."""
    for i, v in enumerate(values):
        if v in values[:i]:
            raise InputError(f"{option} names {v} twice")
    return values


def _contexts(text, option, what="context"):
    """Comma-separated token counts (ASCII digits, no thousands separators), each from 1 to MAX_CONTEXT,
    none twice; `what` names one in the refusal ("context", "question")."""
    items = _split(text, option, "token count")
    if not all(re.fullmatch(r"[0-9]+", x) for x in items):
        raise InputError(f"{option} must be comma-separated token counts in plain digits (8192, not 8,192 "
                         f"or 8_192), got {text!r}")
    counts = [int(x) for x in items]
    for n in counts:
        if not 1 <= n <= MAX_CONTEXT:
            raise InputError(f"{option} {n}: a {what} must be from 1 to {MAX_CONTEXT} tokens")
    return _once(counts, option)


def _policies(text, known, backend):
    """Comma-separated attention policies, each one of `known` (those of this backend)."""
    names = _split(text, "--policies", "policy", f"; known on this backend ({backend}): {', '.join(known)}")
    for p in names:
        if p == "auto":
            raise InputError(f"bench measures policies one by one, not the auto choice; choose from: "
                             f"{', '.join(known)}")
        if p in POLICIES and p not in known:
            raise InputError(f"attention policy {p!r} does not run on this backend ({backend}); "
                             f"choose from: {', '.join(known)}")
        if p not in known:
            raise InputError(f"unknown attention policy {p!r}; choose from: {', '.join(known)}")
    return _once(names, "--policies")


def _tiers(text, known, option):
    """Comma-separated tier names, each registered, none twice."""
    names = _split(text, option, "tier", f"; known tiers: {', '.join(known)}")
    for t in names:
        if t not in known:
            raise InputError(f"unknown tier {t!r}; known tiers: {', '.join(known)}")
    return _once(names, option)


def _check_memory(B, model, dtype, contexts):
    """Refuse end-to-end contexts whose dense baseline cache (K and V of every layer in `dtype`) cannot
    fit in 80% of the device's memory twice over: mlx-lm's KVCache holds it twice for a moment (its first
    update copies into a larger buffer). Out of memory there would end the run and lose its results."""
    n_layers, n_kv, D = B.model_geometry(model)
    info = mx.device_info()  # Metal names the device's memory "memory_size", CUDA "total_memory"
    total = (info.get("memory_size") or info.get("total_memory")
             or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))  # CPU: the host's memory
    for n in contexts:
        need = 2 * n_layers * 2 * n_kv * D * n * dtype.size
        if need > 0.8 * total:
            raise InputError(f"end-to-end decode at {n:,} tokens needs about {need / 2**30:.1f} GiB for the dense "
                             f"baseline cache; this device has {total / 2**30:.1f} GiB; pass smaller "
                             "--e2e-contexts or --no-e2e")


def _table(result):
    # "vs dense": attention time over MLX's dense attention time at that context (below 1 is faster)
    lines = [f"{'context':>8} {'tier':<14} {'policy':<17} {'attention µs':>13} {'vs dense':>9} {'bytes':>14}"]
    dense = {r["context"]: r["us"] for r in result["attention"] if r["policy"] == "mlx-sdpa"}
    for r in result["attention"]:
        us = f"{r['us']:.1f}" if r["us"] else "-"
        rel = f"{r['us'] / dense[r['context']]:.2f}x" if r["us"] and dense.get(r["context"]) else "-"
        nb = f"{r['prefix_bytes']:,}" if r["prefix_bytes"] else "-"
        lines.append(f"{r['context']:>8} {r['tier']:<14} {str(r['policy']):<17} {us:>13} {rel:>9} {nb:>14}"
                     + (f"  ({r['error'][:60]})" if r["error"] else ""))
    multi = result.get("multi_token") or []
    if multi:
        lines.append(f"\n{'context':>8} {'question':>8} {'tier':<14} {'policy':<17} {'attention µs':>13} {'vs dense':>9}")
        base = {(r["context"], r["query_tokens"]): r["us"] for r in multi if r["policy"] == "mlx-sdpa"}
        for r in multi:
            b = base.get((r["context"], r["query_tokens"]))
            us = f"{r['us']:.1f}" if r["us"] else "-"
            rel = f"{r['us'] / b:.2f}x" if r["us"] and b else "-"
            lines.append(f"{r['context']:>8} {r['query_tokens']:>8} {r['tier']:<14} {str(r['policy']):<17} {us:>13} "
                         f"{rel:>9}" + (f"  ({r['error'][:60]})" if r["error"] else ""))
    if result["end_to_end"]:
        lines.append(f"\n{'context':>8} {'tier':<14} {'policy':<17} {'decode tok/s':>13} {'peak GB':>9}")
        for r in result["end_to_end"]:
            tps = f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "-"
            peak = f"{r['peak_bytes'] / 1e9:.2f}" if r["peak_bytes"] else "-"
            lines.append(f"{r['context']:>8} {r['tier']:<14} {str(r['policy']):<17} {tps:>13} {peak:>9}"
                         + (f"  ({r['error'][:60]})" if r["error"] else ""))
    lines += _gate_lines(result)
    bw = result["copy_bytes_per_s"]
    lines.append(f"\ncopy bandwidth {bw / 1e9:.1f} GB/s; {json.dumps(result['environment'])}")
    return "\n".join(lines)


def _gate_lines(result):
    """The gate: per context and tier, the fastest policy's time over dense and over a bare read of its bytes."""
    from cartridge.eval.bench_report import gate  # (loads MLX: not at CLI start)

    rows = result.get("gate") or gate(result)
    if not rows:
        return []

    def ratio(x):
        return f"{x:.2f}x" if x is not None else "-"
    lines = ["\ngate: the fastest policy per tier (what auto takes from this run); time over MLX dense attention, "
             "stored bytes over fp16, time over a bare read of the same bytes (mx.sum over the stored arrays)",
             f"{'context':>8} {'tier':<10} {'policy':<17} {'µs':>10} {'vs dense':>9} {'bytes':>7} {'vs read':>8}"]
    for r in rows:
        flag = "  SLOWER THAN DENSE" if r["slower_than_dense"] else ""
        lines.append(f"{r['context']:>8} {r['tier']:<10} {r['policy']:<17} {r['us']:>10.1f} {ratio(r['vs_dense']):>9} "
                     f"{ratio(r['bytes_vs_fp16']):>7} {ratio(r['vs_read']):>8}{flag}")
    return lines


def _check_lines(records):
    from cartridge.attention.backends import proof  # (loads mlx-lm: not at CLI start)

    return proof.lines(records)


def _kernel_checks(tiers, shape, n_tokens, table_path):
    """With --calibrate, before timing: check every tier the device's kernel reads, where that kernel needs
    proof (`cartridge.attention.backends.proof`), at the run's shape and longest context."""
    from cartridge.attention.backends import proof  # (loads mlx-lm: not at CLI start)

    fused = backends.kernel(backends.device())
    if fused is None or not fused.needs_proof:
        return []
    click.echo(f"bench: checking the {fused.name} kernel of each tier against the portable path", err=True)
    _, n_kv, head_dim = shape
    return proof.check_tiers(fused, tiers, n_kv, head_dim, n_tokens, table_path or None)


def _calibrate(result, table_path):
    """Write the table of `result` (`cartridge.attention.auto_table`) and say where."""
    table = auto_table.table_from_bench(result)
    path = auto_table.write_bench_table(table, table_path or auto_table.user_table_path())
    click.echo(f"calibrate: {len(table['entries'])} measured cases written to {path}; cartridge.load(attention=\"auto\") "
               "uses them", err=True)


@click.command()
@click.option("--contexts", default=None, help="Comma-separated prefix lengths in tokens, each 1 to 524288 "
              "(default: 8192,32768,65536,131072 on CUDA; 2048,8192 elsewhere).")
@click.option("--tiers", default=None, help="Comma-separated tiers (default: all registered).")
@click.option("--shape", default=None, help="Microbenchmark shape: llama3-8b, llama3.2-1b, smollm2-135m "
              "(default: llama3-8b on CUDA, smollm2-135m elsewhere).")
@click.option("--e2e-contexts", default=None, help="Prefix lengths for end-to-end decode, each 1 to 524288 "
              "(default: --contexts).")
@click.option("--no-e2e", is_flag=True, help="Skip end-to-end decode.")
@click.option("--e2e-tiers", default=None, help="Tiers for end-to-end decode (default: --tiers).")
@click.option("--e2e-shape", default="llama3.2-1b", show_default=True,
              type=click.Choice(["llama3.2-1b", "llama3-8b"]), help="CUDA: the random-weight model decoded end to "
              "end (elsewhere the default model, SmolLM2-135M-Instruct, and this option is ignored).")
@click.option("--policies", default=None, help="Comma-separated attention policies to measure: fused (CUDA "
              "only), portable, dequantize-once (default: all on this backend).")
@click.option("--query-tokens", default=None, help="Comma-separated question lengths in tokens, each timed as one "
              "prefill over every context (TTFT's attention); none to skip (default: 32,256 on CUDA, none elsewhere).")
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(min=1, max=MAX_REPEATS),
              help=f"Timed rounds per measurement (median), 1 to {MAX_REPEATS}. Attention steps are chained, each "
              "output the next query; on a GPU a round is the cost of one more step in a long chain.")
@click.option("--json", "json_path", default=None, help="Write all results to this JSON file (its folder must exist).")
@click.option("--plot", "plot_path", default=None, help="Write a PNG plot (.png) of attention time vs context (its "
              "folder must exist).")
@click.option("--force", is_flag=True, help="Replace existing --json/--plot files (refused otherwise).")
@click.option("--calibrate", is_flag=True, help="Write the fastest policy per tier, head_dim and context of this "
              "run as the table `auto` uses (--table, default: the user table, ~/.config/cartridge/auto-table.json).")
@click.option("--table", "table_path", default=None, help="Where --calibrate writes the table.")
@click.option("--from-json", "from_json", default=None, help="Measure nothing: print the results, gate and (with "
              "--calibrate) the table of an earlier `cartridge bench --json` file, from any machine.")
def bench(contexts, tiers, shape, e2e_contexts, no_e2e, e2e_tiers, e2e_shape, policies, query_tokens, repeats,
          json_path, plot_path, force, calibrate, table_path, from_json):
    """Measure decode-step attention and end-to-end decode for each context, tier and policy.

    End to end uses a model: on CUDA a random-weight Llama-3.2-1B-shaped model in float16, elsewhere
    the default model (SmolLM2-135M-Instruct). K/V prefixes are synthetic, of the model's shape.
    Every option, and the --json/--plot paths, are checked before any work; the files are written
    atomically.
    """
    if from_json:
        try:
            result = json.loads(open(from_json).read())
        except (OSError, ValueError) as e:
            raise InputError(f"--from-json {from_json}: cannot read it ({e})") from None
        if not isinstance(result, dict) or "attention" not in result:
            raise InputError(f"--from-json {from_json}: not a `cartridge bench --json` result")
        try:
            result.setdefault("end_to_end", [])
            click.echo(_table(result))
            if calibrate:
                _calibrate(result, table_path)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # a JSON of another shape
            raise InputError(f"--from-json {from_json}: not a `cartridge bench --json` result ({type(e).__name__}: "
                             f"{e})") from None
        return
    json_path = check_output_file(json_path, "--json", force)
    plot_path = check_output_file(plot_path, "--plot", force)
    if plot_path and plot_path.suffix.lower() != ".png":
        raise InputError(f"--plot {plot_path}: the plot is a PNG; give a file name ending in .png")
    if json_path and plot_path and json_path.resolve() == plot_path.resolve():
        raise InputError(f"--json and --plot name the same file {json_path}; give two files")
    from cartridge.eval import bench as B, bench_report  # (loads mlx-lm: not at CLI start)

    cuda = backends.device() == "cuda"
    default = [8192, 32768, 65536, 131072] if cuda else [2048, 8192]
    ctx = _contexts(contexts, "--contexts") if contexts is not None else default
    e2e_ctx = _contexts(e2e_contexts, "--e2e-contexts") if e2e_contexts is not None else None
    names = _tiers(tiers, TIERS, "--tiers") if tiers is not None else sorted(TIERS)
    e2e_names = _tiers(e2e_tiers, TIERS, "--e2e-tiers") if e2e_tiers is not None else None
    if query_tokens is None:
        query_tokens = "32,256" if cuda else "none"
    questions = [] if query_tokens == "none" else _contexts(query_tokens, "--query-tokens", "question")
    B.POLICIES = None  # every policy of this backend, unless --policies names some
    if policies is not None:
        B.POLICIES = _policies(policies, B.available_policies(), backends.device())
    shape = ("llama3-8b" if cuda else "smollm2-135m") if shape is None else shape
    if shape not in B.SHAPES:
        raise InputError(f"unknown shape {shape!r}; known: {', '.join(B.SHAPES)}")
    e2e = None
    if not no_e2e:
        if cuda:
            e2e = (B.random_model(e2e_shape), mx.float16)
        else:
            e2e = (cartridge.load_model().model, mx.float32)
        _check_memory(B, *e2e, e2e_ctx or ctx)
    checks = _kernel_checks(names, B.SHAPES[shape], max(ctx), table_path) if calibrate else []
    result = B.run(ctx, names, shape, e2e, e2e_ctx, repeats,
                   progress=lambda msg: click.echo(f"bench: {msg}", err=True), e2e_tiers=e2e_names,
                   query_tokens=questions)
    click.echo("\n".join([_table(result), *_check_lines(checks)]))
    # the plot first: it can fail (matplotlib, a folder removed meanwhile) where the JSON text cannot
    if plot_path:
        write_file(plot_path, lambda tmp: _plot(bench_report.plot, result, tmp))
    if json_path:
        write_file(json_path, lambda tmp: tmp.write_text(json.dumps(result, indent=2)))
    if calibrate:
        _calibrate(result, table_path)
    sys.stdout.flush()


def _plot(plot, result, tmp):
    """`bench_report.plot` into the file `tmp` as PNG (through a file object: the temporary's name has no .png)."""
    with open(tmp, "wb") as f:
        plot(result, f)
