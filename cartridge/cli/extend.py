"""`cartridge extend`: append text to a cartridge's document, prefilling only the new text."""

import click

import cartridge

from .common import model_ref, progress_bar, read_corpus, warnings_as_lines


@click.command()
@click.argument("path")
@click.argument("more")
@click.option("-o", "--output", default=None,
              help="Cartridge directory to create; without it PATH is replaced once the new one is verified.")
@click.option("--model", default=None, help="Model to prefill with (default: the one the cartridge records).")
@click.option("--separator", default="\\n\\n", show_default=True,
              help="Text between the stored document and MORE (backslash escapes \\n and \\t are read).")
@click.option("--prefill-step", default=512, show_default=True, help="Tokens per forward pass.")
@click.option("--reserve", default=256, show_default=True, metavar="N",
              help="Warn when fewer than N tokens of the model's context are left for questions.")
@click.option("--force", is_flag=True, help="Replace an existing cartridge at OUTPUT.")
def extend(path, more, output, model, separator, prefill_step, reserve, force):
    """Extend the document of the cartridge at PATH with MORE (a UTF-8 text file, or - for stdin)."""
    model_ref(model)
    text = read_corpus(more, "text")
    sep = separator.replace("\\n", "\n").replace("\\t", "\t")
    with progress_bar("tok", "prefill") as progress, warnings_as_lines():
        r = cartridge.extend(path, text, output=output, model=model, separator=sep, prefill_step=prefill_step,
                             force=force, progress=progress, source_name="stdin" if more == "-" else more,
                             reserve=reserve)
    click.echo(f"extended {r.path}: {r.tokens} tokens ({r.reused_tokens} stored kept, {r.new_tokens} prefilled), "
               f"{r.seconds:.1f} s (prefill {r.prefill_seconds:.1f} s), {r.bytes:,} bytes")
