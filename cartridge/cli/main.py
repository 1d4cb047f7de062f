"""`cartridge` command: build, inspect, ask, serve. Thin: parse options, call the library, print.

Every error the library raises on purpose (CartridgeError) and every usage error becomes one line on
stderr and exit status 1 (2 for usage errors).
"""

import json
import sys
import time

import click

import cartridge
from cartridge.errors import CartridgeError, InputError

from .bench import bench as bench_command
from .common import read_corpus
from .eval import eval_command
from .integrity import pack, unpack, verify
from .report import inspect_dict, inspect_table
from .serve import serve


def _model_ref(model):
    """--model as given, refusing an empty string (which would otherwise mean the current folder)."""
    if model is not None and not model.strip():
        raise InputError("--model is empty; give a GGUF file, an mlx-lm model folder or \"default\"")
    return model


@click.group()
@click.version_option(cartridge.__version__, prog_name="cartridge")
def cli():
    """Persistent, memory-mappable KV caches for MLX language models."""


@cli.command()
@click.argument("corpus")
@click.option("-o", "--output", required=True, help="Cartridge directory to create.")
@click.option("--model", default=None, help='"default", a GGUF file or an mlx-lm model directory.')
@click.option("--tier", default="fp16", show_default=True, help="Storage tier of every layer's K and V.")
@click.option("--k-tier", default=None, help="Tier of K (overrides --tier for keys).")
@click.option("--v-tier", default=None, help="Tier of V (overrides --tier for values).")
@click.option("--boundary-protect", default=0, show_default=True, metavar="N",
              help="Keep K fp16 on every layer and V fp16 on the first N and last N layers.")
@click.option("--schema", "schema", default=None, metavar="FILE.json",
              help='Per-layer tiers: a JSON list of {"layer": i, "k": tier, "v": tier}; excludes the tier options.')
@click.option("--prefill-step", default=512, show_default=True, help="Tokens per forward pass.")
@click.option("--page-size", default=256, show_default=True, help="Tokens per page.")
@click.option("--force", is_flag=True, help="Replace an existing cartridge at OUTPUT.")
def build(corpus, output, model, tier, k_tier, v_tier, boundary_protect, schema, prefill_step, page_size, force):
    """Prefill CORPUS (a UTF-8 text file, or - for stdin) once and write a cartridge."""
    from tqdm import tqdm

    from cartridge.format.writer import check_output_path
    from cartridge.tiers import check_tier_options

    from .report import fold_tiers

    check_tier_options(tier, k_tier, v_tier, boundary_protect)
    _model_ref(model)
    check_output_path(output, force)
    text = read_corpus(corpus)
    bars = []  # made at the first progress call, so errors before prefill print nothing else

    def progress(done, total):
        if not bars:
            bars.append(tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, dynamic_ncols=True))
        bars[0].update(done - bars[0].n)

    try:
        r = cartridge.build(text, output, model=model, tier=tier, k_tier=k_tier, v_tier=v_tier,
                            boundary_protect=boundary_protect, schema=schema, page_size=page_size,
                            prefill_step=prefill_step, force=force, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    tiers = "; ".join(f"layers {run['layers']} K {run['k']} V {run['v']}" for run in fold_tiers(r.schema))
    click.echo(f"built {r.path}: {r.tokens} tokens, {r.seconds:.1f} s ({r.tokens_per_second:.0f} tokens/s prefill), "
               f"{r.bytes:,} bytes ({r.bytes_per_token:,} bytes/token; {tiers})")
    if page_size > r.tokens:
        click.echo(f"note: --page-size {page_size} is larger than the document ({r.tokens} tokens); the padded "
                   f"last page makes the file {r.bytes:,} bytes on disk", err=True)


@cli.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def inspect(path, as_json):
    """Show what is inside the cartridge at PATH."""
    info, _ = cartridge.open_cartridge(path, verify="header")
    d = inspect_dict(info, path)
    click.echo(json.dumps(d, indent=2) if as_json else inspect_table(d))


@cli.command()
@click.argument("path")
@click.argument("question")
@click.option("--max-tokens", default=256, show_default=True, help="Most tokens to generate.")
@click.option("--model", default=None, help="Model to answer with (default: the one the cartridge records).")
@click.option("--attention", default="auto", show_default=True,
              help="Attention path: auto, fused (CUDA), portable or dequantize-once.")
def ask(path, question, max_tokens, model, attention):
    """Answer QUESTION about the document in the cartridge at PATH (streams to stdout)."""
    import mlx_lm

    from cartridge.build import context_length

    if not question.strip():
        raise InputError("the question is empty")
    if max_tokens < 1:
        raise InputError(f"--max-tokens is {max_tokens}; it must be at least 1")
    t0 = time.perf_counter()
    lm = cartridge.load_model(_model_ref(model)) if model is not None else None
    cart = cartridge.load(path, model=lm, attention=attention)
    load_s = time.perf_counter() - t0
    prompt = cart.question_prompt(question)
    limit = context_length(cart.model)
    if limit is not None and len(cart.tokens) + len(prompt) + max_tokens > limit:
        room = limit - len(cart.tokens) - len(prompt)
        if room < 1:
            raise InputError(f"the question ({len(prompt):,} tokens) does not fit the model's context of "
                             f"{limit:,} tokens after the {len(cart.tokens):,} cached")
        raise InputError(f"--max-tokens {max_tokens} does not fit the model's context of {limit:,} tokens: "
                         f"{len(cart.tokens):,} cached + {len(prompt)} question tokens leave {room:,}")
    t1 = time.perf_counter()
    ttft, n = None, 0
    for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, prompt, max_tokens=max_tokens,
                                    prompt_cache=cart.prompt_cache()):
        if ttft is None:
            ttft = time.perf_counter() - t1
        n = r.generation_tokens
        click.echo(r.text, nl=False)
        sys.stdout.flush()
    click.echo()
    sys.stdout.flush()
    decode_s = time.perf_counter() - t1 - (ttft or 0)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    click.echo(f"load {load_s:.2f} s, TTFT {ttft or 0:.3f} s ({len(prompt)} question tokens over "
               f"{len(cart.tokens)} cached), decode {rate:.1f} tokens/s ({n} tokens), "
               f"attention {cart.attention}", err=True)


cli.add_command(bench_command, name="bench")
cli.add_command(verify)
cli.add_command(pack)
cli.add_command(unpack)
cli.add_command(eval_command)
cli.add_command(serve)


def main(argv=None):
    """Entry point: run the CLI, turning every expected error into one stderr line."""
    try:
        cli.main(args=argv, prog_name="cartridge", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except CartridgeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except OSError as e:
        click.echo(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
