"""`cartridge import` and `cartridge export`: mlx-lm's prompt-cache files (mlx_lm.cache_prompt) to and from cartridges."""

import click

import cartridge
from cartridge.format.writer import check_output_path
from cartridge.promptcache.exporter import mlx_lm_loads
from cartridge.tiers.schema import tier_runs_text

from .common import (model_ref, progress_bar, read_corpus, read_target, refuse_tier_clashes, target_options,
                     tier_options, warnings_as_lines)

CALIBRATING = "calibrating: measuring each layer's K/V tiers on the document (--no-calibrate skips it)"


@click.command("import")
@click.argument("file")
@click.option("-o", "--output", required=True, help="Cartridge directory to create.")
@click.option("--model", default=None, help="The model (default: the one the file's metadata names).")
@click.option("--document", default=None, metavar="TEXT_FILE",
              help="The text given to mlx_lm.cache_prompt --prompt (- for stdin), re-tokenized and checked against "
                   "the file; needed unless the file holds its token ids (a `cartridge export` file).")
@tier_options
@target_options
@click.option("--page-size", default=256, show_default=True, help="Tokens per page.")
@click.option("--reserve", default=256, show_default=True, metavar="N",
              help="Warn when fewer than N tokens of the model's context are left for questions.")
@click.option("--force", is_flag=True, help="Replace an existing cartridge at OUTPUT.")
def import_command(file, output, model, document, tier, k_tier, v_tier, boundary_protect, schema, protect_first,
                   protect_last, preset, target_ratio, max_bytes_per_token, max_kl, no_calibrate, page_size, reserve,
                   force):
    """Turn FILE, an mlx-lm prompt cache (mlx_lm.cache_prompt, save_prompt_cache), into a cartridge: no prefill."""
    target = read_target(preset, target_ratio, max_bytes_per_token, max_kl, no_calibrate)
    refuse_tier_clashes(preset, schema)
    model_ref(model)
    check_output_path(output, force)
    text = None if document is None else read_corpus(document, "document")
    with progress_bar("layer", "calibrate", intro=CALIBRATING) as calibration_progress, warnings_as_lines():
        r = cartridge.import_prompt_cache(
            file, output, model=model, document=text, tier=tier, k_tier=k_tier, v_tier=v_tier,
            boundary_protect=boundary_protect, schema=schema, page_size=page_size, force=force,
            protect_first=protect_first, protect_last=protect_last, preset=preset, budget=target,
            calibrate=not no_calibrate, calibration_progress=calibration_progress, reserve=reserve)
    checked = f"K/V of {r.checked_tokens} tokens recomputed and matched" if r.checked_tokens else "K/V not checked"
    click.echo(f"imported {file} -> {r.path}: {r.tokens} tokens of model {r.model} (token ids from the "
               f"{r.tokens_from}; {checked}), {r.seconds:.1f} s, {r.bytes:,} bytes ({r.bytes_per_token:,} "
               f"bytes/token; {tier_runs_text(r.schema)})")


@click.command("export")
@click.argument("source", metavar="CARTRIDGE")
@click.option("-o", "--output", required=True, help="The .safetensors file to write.")
@click.option("--model", default=None,
              help="The mlx-lm model folder the file names for mlx_lm.generate (checked against the cartridge's "
                   "fingerprint; default: the model the cartridge records).")
@click.option("--dequantize", is_flag=True,
              help="Decoded K/V in every layer, also where the tier is mlx-lm's own quantized layout (mlx4g32, int8).")
@click.option("--force", is_flag=True, help="Replace an existing file at OUTPUT.")
def export_command(source, output, model, dequantize, force):
    """Write CARTRIDGE as an mlx-lm prompt-cache file for mlx_lm.generate --prompt-cache-file."""
    model_ref(model)
    with warnings_as_lines():
        r = cartridge.export_prompt_cache(source, output, model=model, quantized=not dequantize, force=force)
    classes = ", ".join(f"{n} {name}" for name, n in sorted(r.classes.items()))
    group = f" --kv-group-size {r.group_size}" if r.group_size else ""
    use = (f"; use: mlx_lm.generate --prompt-cache-file {r.path}{group} --prompt \"...\"" if mlx_lm_loads(r.model)
           else "")  # else the warning above says why mlx_lm.generate cannot load it
    click.echo(f"exported {source} -> {r.path}: {r.tokens} tokens, {r.bytes:,} bytes ({classes}){use}")
