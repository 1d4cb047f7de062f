"""`cartridge convert`: re-encode an fp16/bf16 cartridge into other tiers without prefill."""

import click

import cartridge
from cartridge.tiers.schema import tier_runs_text

from .common import progress_bar, refuse_tier_clashes, tier_options


@click.command()
@click.argument("source")
@click.option("-o", "--output", required=True, help="Cartridge directory to create.")
@tier_options
@click.option("--force", is_flag=True, help="Replace an existing cartridge at OUTPUT.")
def convert(source, output, tier, k_tier, v_tier, boundary_protect, schema, protect_first, protect_last, preset,
            force):
    """Re-encode the fp16 or bf16 cartridge SOURCE into other tiers (no model, no prefill)."""
    refuse_tier_clashes(preset, schema)
    with progress_bar("layer", "convert") as progress:
        r = cartridge.convert(source, output, tier=tier, k_tier=k_tier, v_tier=v_tier,
                              boundary_protect=boundary_protect, schema=schema, protect_first=protect_first,
                              protect_last=protect_last, preset=preset, force=force, progress=progress)
    tiers = tier_runs_text(r.schema)
    kept = f"; first {r.protect_first} and last {r.protect_last} tokens also fp16" if r.protect_first + r.protect_last else ""
    click.echo(f"converted {source} -> {r.path}: {r.tokens} tokens, {r.seconds:.1f} s, {r.bytes:,} bytes "
               f"({r.bytes_per_token:,} bytes/token; {tiers}{kept})")
