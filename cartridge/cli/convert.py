"""`cartridge convert`: re-encode an fp16/bf16 cartridge into other tiers without prefill."""

import sys

import click

from .common import refuse_beside


@click.command()
@click.argument("source")
@click.option("-o", "--output", required=True, help="Cartridge directory to create.")
@click.option("--tier", default="fp16", show_default=True, help="Storage tier of every layer's K and V.")
@click.option("--k-tier", default=None, help="Tier of K (overrides --tier for keys).")
@click.option("--v-tier", default=None, help="Tier of V (overrides --tier for values).")
@click.option("--boundary-protect", default=0, show_default=True, metavar="N", type=click.IntRange(0),
              help="Keep K fp16 on every layer and V fp16 on the first N and last N layers.")
@click.option("--schema", "schema", default=None, metavar="FILE.json",
              help='Per-layer tiers: a JSON list of {"layer": i, "k": tier, "v": tier}; excludes the tier options.')
@click.option("--force", is_flag=True, help="Replace an existing cartridge at OUTPUT.")
def convert(source, output, tier, k_tier, v_tier, boundary_protect, schema, force):
    """Re-encode the fp16 or bf16 cartridge SOURCE into other tiers (no model, no prefill)."""
    from tqdm import tqdm

    import cartridge

    from .report import fold_tiers

    if schema:
        refuse_beside("--schema sets the tier of every (layer, side)", ("tier", "k_tier", "v_tier", "boundary_protect"))
    bars = []

    def progress(done, total):
        if not bars:
            bars.append(tqdm(total=total, unit="layer", desc="convert", file=sys.stderr, dynamic_ncols=True))
        bars[0].update(done - bars[0].n)

    try:
        r = cartridge.convert(source, output, tier=tier, k_tier=k_tier, v_tier=v_tier,
                              boundary_protect=boundary_protect, schema=schema, force=force, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    tiers = "; ".join(f"layers {run['layers']} K {run['k']} V {run['v']}" for run in fold_tiers(r.schema))
    click.echo(f"converted {source} -> {r.path}: {r.tokens} tokens, {r.seconds:.1f} s, {r.bytes:,} bytes "
               f"({r.bytes_per_token:,} bytes/token; {tiers})")
