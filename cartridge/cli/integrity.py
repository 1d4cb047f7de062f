"""`cartridge verify`, `cartridge pack`, `cartridge unpack`: check cartridges and move them as one file.

Thin: parse options, call `cartridge.format.verify` / `cartridge.format.pack`, print. Progress goes to stderr (tqdm).
"""

import json
import sys

import click

from cartridge.format.pack import pack as pack_cartridge
from cartridge.format.pack import unpack as unpack_cartridge
from cartridge.format.reader import verify_cartridge

from .common import progress_bar


def _progress(desc):
    """A progress(done, total) callback drawing one tqdm bar in bytes on stderr (a context manager)."""
    return progress_bar("B", desc, unit_scale=True, unit_divisor=1024)


@click.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def verify(path, as_json):
    """Check everything in the cartridge at PATH: manifest, index, every page checksum, layout, schema.

    Exits 1 naming the first bad page (layer, side, component, page) or check.
    """
    report = verify_cartridge(path)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    elif report.ok:
        click.echo(f"ok: {path}: {', '.join(report.checks)}; {report.pages:,} pages in {report.extents} extents, "
                   f"{report.bytes_hashed:,} bytes hashed, {report.bytes_per_token:,} bytes/token, "
                   f"{report.seconds:.2f} s")
    if not report.ok:
        if len(report.bad_pages) > 1:
            click.echo(f"error: {report.error} (and {len(report.bad_pages) - 1} more bad pages)", err=True)
            sys.exit(1)
        report.raise_for_error()


@click.command()
@click.argument("path")
@click.option("-o", "--output", required=True, help="The .cartz file to write.")
@click.option("--level", default=3, show_default=True, type=click.IntRange(1, 19), help="zstandard level.")
@click.option("--force", is_flag=True, help="Replace an existing OUTPUT file.")
def pack(path, output, level, force):
    """Verify the cartridge at PATH and write it as one streamable .cartz file."""
    with _progress("pack") as progress:
        r = pack_cartridge(path, output, level=level, force=force, progress=progress)
    click.echo(f"packed {path} -> {r['path']}: {r['bytes_in']:,} -> {r['bytes_out']:,} bytes "
               f"({r['bytes_in'] / r['bytes_out']:.3f}x)")


@click.command()
@click.argument("file")
@click.option("-o", "--output", required=True, help="Cartridge directory to create.")
@click.option("--force", is_flag=True, help="Replace an existing cartridge at OUTPUT.")
def unpack(file, output, force):
    """Restore the packed cartridge FILE to a directory, verify it, and move it into place."""
    with _progress("unpack") as progress:
        dest = unpack_cartridge(file, output, force=force, progress=progress)
    click.echo(f"unpacked {file} -> {dest} (verified)")
