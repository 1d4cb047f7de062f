"""`cartridge` command: build, inspect, ask, serve, import/export of mlx-lm prompt caches. Thin: parse options, call the library, print.

Every error the library raises on purpose (CartridgeError) and every usage error becomes one line on
stderr and exit status 1 (2 for usage errors).
"""

import json
import sys

import click

import cartridge
from cartridge.errors import CartridgeError, InputError
from cartridge.format.writer import check_output_path
from cartridge.tiers import check_tier_options, presets
from cartridge.tiers.schema import tier_runs_text

from .ask import ask
from .bench import bench as bench_command
from .chat import chat
from .common import (MODEL_FORMS, PARALLEL_HELP, launched_group, model_ref, progress_bar, read_corpus, read_target,
                     refuse_tier_clashes, target_options, tier_options, warnings_as_lines)
from .convert import convert as convert_command
from .eval import eval_command
from .extend import extend
from .integrity import pack, unpack, verify
from .interop import export_command, import_command
from .report import agreement, fp16_ratio, inspect_dict, inspect_table, per_token_text, prompt_format, window_text
from .serve import exit_if_served, serve


WRITERS = ("build", "extend", "convert", "pack", "unpack", "import", "export")  # commands whose Ctrl-C leaves nothing written
CALIBRATING = "calibrating: measuring each layer's K/V tiers on the document (--no-calibrate skips it)"


class Interrupted(Exception):
    """Ctrl-C during a command (`command`, e.g. "build"); main prints one line and exits 130."""

    def __init__(self, command):
        super().__init__(command)
        self.command = command


class _Group(click.Group):
    def invoke(self, ctx):
        """Run the subcommand; a Ctrl-C is caught here, before click turns it into an "Aborted!" with a blank line."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted(ctx.invoked_subcommand) from None


@click.group(cls=_Group)
@click.version_option(cartridge.__version__, prog_name="cartridge")
def cli():
    """Persistent, memory-mappable KV caches for MLX language models."""


@cli.command()
@click.argument("corpus")
@click.option("-o", "--output", required=True, help="Cartridge directory to create.")
@click.option("--model", default=None, help=f"The model: {MODEL_FORMS}.")
@tier_options
@target_options
@click.option("--k-encoder", type=click.Choice(["nearest", "score"]), default=None,
              help="How K's codes are chosen: nearest rounding, or for the scores of the document's own queries "
                   "(same format). Default: score with a calibrated --preset balanced/compact, else nearest.")
@click.option("--k-scale/--no-k-scale", default=None,
              help="Store K divided by a per-channel scale chosen from the document's keys and queries, the query "
                   "multiplied by it (format 1.11). Default: on with a calibrated --preset balanced/compact, else off.")
@click.option("--v-encoder", type=click.Choice(["nearest", "output"]), default=None,
              help="How V's codes are chosen: nearest rounding, or for the attention output through o_proj "
                   "(same format). Default: nearest.")
@click.option("--prefill-step", default=512, show_default=True, help="Tokens per forward pass.")
@click.option("--page-size", default=256, show_default=True, help="Tokens per page.")
@click.option("--reserve", default=256, show_default=True, metavar="N",
              help="Warn when fewer than N tokens of the model's context are left for questions.")
@click.option("--system", "--system-prompt", "system", default=None, metavar="TEXT",
              help="A system message rendered before the document (chat clients that send it are then served "
                   "from the cartridge).")
@click.option("--force", is_flag=True, help="Replace an existing cartridge at OUTPUT.")
@click.option("--parallel", type=click.Choice(["tensor", "pipeline"]), default=None,
              help=PARALLEL_HELP + " Rank 0 writes the cartridge.")
def build(corpus, output, model, tier, k_tier, v_tier, boundary_protect, schema, protect_first, protect_last, preset,
          target_ratio, max_bytes_per_token, max_kl, no_calibrate, k_encoder, k_scale, v_encoder, prefill_step, page_size,
          reserve, system, force, parallel):
    """Prefill CORPUS (a UTF-8 text file, or - for stdin) once and write a cartridge."""
    target = read_target(preset, target_ratio, max_bytes_per_token, max_kl, no_calibrate)
    refuse_tier_clashes(preset, schema)
    o = presets.apply(preset, tier, k_tier, v_tier, boundary_protect, schema, protect_first, protect_last)
    check_tier_options(o["tier"], o["k_tier"], o["v_tier"], o["boundary_protect"])
    model_ref(model)
    if parallel and (preset or target or protect_first or protect_last or k_encoder not in (None, "nearest")
                     or k_scale or v_encoder not in (None, "nearest")):
        raise InputError("--parallel builds take tier options only, not --preset, --protect-first/--protect-last, "
                         "--k-encoder score, --k-scale or --v-encoder output")
    group = launched_group(parallel)
    if group is None:  # under --parallel rank 0 checks it, and every rank refuses together
        check_output_path(output, force)
    text = read_corpus(corpus)
    options = dict(tier=tier, k_tier=k_tier, v_tier=v_tier, boundary_protect=boundary_protect, schema=schema,
                   page_size=page_size, prefill_step=prefill_step, force=force,
                   source_name="stdin" if corpus == "-" else corpus, reserve=reserve, system=system)
    with progress_bar("tok", "prefill") as progress, \
            progress_bar("layer", "calibrate", intro=CALIBRATING) as calibration_progress, warnings_as_lines():
        if group is None:
            r = cartridge.build(text, output, model=model, progress=progress, protect_first=protect_first,
                                protect_last=protect_last, preset=preset, budget=target,
                                calibrate=not no_calibrate, calibration_progress=calibration_progress,
                                k_encoder=k_encoder, k_scale=k_scale, v_encoder=v_encoder, **options)
        else:
            from cartridge.distributed import build_sharded, load_sharded_model  # (loads mlx-lm: not at CLI start)

            lm = load_sharded_model(model, group, parallel)
            r = build_sharded(text, output, lm, group, progress=progress if group.rank() == 0 else None,
                              **options)
    if r is None:  # a rank other than 0 under --parallel: rank 0 wrote and reports
        return
    tiers = tier_runs_text(r.schema)
    info, data = cartridge.open_cartridge(r.path, verify="header")  # which layers bytes/token counts
    data.close()
    per_token = per_token_text(r.bytes_per_token, info.per_token_split())
    click.echo(f"built {r.path}: {r.tokens} tokens, {r.seconds:.1f} s (prefill {r.prefill_seconds:.1f} s, "
               f"{r.tokens_per_second:.0f} tokens/s prefill), {r.bytes:,} bytes ({per_token}; {tiers})")
    if r.calibration:
        c = r.calibration
        click.echo(f"calibrated in {c['seconds']:.1f} s: {fp16_ratio(c)} smaller than fp16{window_text(c)}, predicted KL "
                   f"{c['predicted_kl']:.4f}, measured KL {c['measured_kl']:.4f} nats/token, {agreement(c)}")
    click.echo(f"prompt format: {prompt_format(r.prompt_mode)}")


@cli.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def inspect(path, as_json):
    """Show what is inside the cartridge at PATH (header only: `cartridge verify` checks every page)."""
    info, _ = cartridge.open_cartridge(path, verify="header")
    d = inspect_dict(info, path)
    click.echo(json.dumps(d, indent=2) if as_json else inspect_table(d))


cli.add_command(ask)
cli.add_command(chat)
cli.add_command(extend)
cli.add_command(bench_command, name="bench")
cli.add_command(verify)
cli.add_command(pack)
cli.add_command(unpack)
cli.add_command(eval_command)
cli.add_command(convert_command)
cli.add_command(serve)
cli.add_command(import_command)
cli.add_command(export_command)


def main(argv=None):
    """Entry point: run the CLI, turning every expected error into one stderr line."""
    try:
        cli.main(args=argv, prog_name="cartridge", standalone_mode=False)
    except (Interrupted, click.exceptions.Abort) as e:  # writers remove their temporaries as the interrupt unwinds
        written = "; nothing was written" if getattr(e, "command", None) in WRITERS else ""
        click.echo(f"error: interrupted{written}", err=True)
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
    exit_if_served()
