"""`cartridge serve`: parse options, start the server (cartridge.serve)."""

import os
import re
import socket
import sys

import click

from cartridge.errors import InputError

MAX_MEMORY_HELP = ("Most bytes a cartridge's prefix may hold in memory, e.g. 512M (K/M/G/T: powers of 1024; the "
                   "reports print decimal MB). The stored pages are always held; the budget decides which layers "
                   "are also decoded (default: the stored bytes x 1.25 + one layer decoded, under --attention "
                   "auto); layers that do not fit read their stored pages.")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_SIZE = 1 << 50  # 1,024T: more than any machine's memory, so a larger size is a typo


def parse_bytes(text, option="--max-bytes"):
    """"4G", "512M", "1000000" -> bytes (K/M/G/T are powers of 1024; a trailing "B" or "iB" is allowed);
    `option` names the option in the error.

    Raises:
        InputError: for anything else, zero, or more than MAX_SIZE.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise InputError(f"{option} {text!r} is not a size; give bytes, e.g. 4G, 512M or 1000000")
    if float(m.group(1)) * _UNITS[m.group(2).upper()] < 1:
        raise InputError(f"{option} {text!r} is less than one byte; give at least 1 (e.g. 4G, 512M or 1000000)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n > MAX_SIZE:
        raise InputError(f"{option} {text!r} is more than {MAX_SIZE // _UNITS['T']:,}T; give the bytes this machine has")
    return n


def _check_port(host, port):
    """Refuse, in one line, a host/port this process cannot listen on (busy, or not an address here)."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


@click.command()
@click.argument("paths", nargs=-1, metavar="[DIR|FILE.cart ...]")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="TCP port.")
@click.option("--model", default=None, help="Model to answer with (default: the one the cartridges record).")
@click.option("--max-bytes", default=None,
              help="Page bytes of cartridges kept loaded (LRU), e.g. 4G; default: no limit.")
@click.option("--verify", default="pages", show_default=True, type=click.Choice(["pages", "header"]),
              help="Checks at load: every page checksum, or the header only.")
@click.option("--attention", default="auto", show_default=True,
              help="Attention path: auto, fused (CUDA), portable or dequantize-once.")
@click.option("--max-tokens", default=512, show_default=True, type=click.IntRange(1),
              help="max_tokens of a request that gives none (clipped to the context left).")
@click.option("--max-memory", default=None, help=MAX_MEMORY_HELP + " Per cartridge loaded.")
def serve(paths, host, port, model, max_bytes, verify, attention, max_tokens, max_memory):
    """Serve cartridges over the OpenAI API: each cartridge is a model id (its name).

    PATHS are cartridge directories, .cartz files, or folders holding them (default: the current folder).
    """
    from cartridge.serve import serve as run  # (loads mlx-lm and uvicorn: not at CLI start)

    if model is not None and not model.strip():
        raise InputError("--model is empty; give a GGUF file, an mlx-lm model folder or \"default\"")
    max_memory = None if max_memory is None else parse_bytes(max_memory, "--max-memory")
    _check_port(host, port)  # before the model load, and before anything says "serving"

    def ready(pool):
        refused = {name: e for name, e in pool.entries.items() if e.error is not None}
        for name, e in refused.items():  # one line each, so a shelf of broken files does not look served
            click.echo(f"warning: {name} ({e.path}) is refused: {e.error.message}", err=True)
        good = [name for name in pool.entries if name not in refused]
        n, names = len(good), ", ".join(good) or "none"
        click.echo(f"serving {n} cartridge{'' if n == 1 else 's'} ({names}) and the base model {pool.base_id!r} "
                   f"on http://{host}:{port}/v1" + (f"; {len(refused)} refused (above)" if refused else ""), err=True)

    run(list(paths) or ["."], host=host, port=port, model=model,
        max_bytes=None if max_bytes is None else parse_bytes(max_bytes), verify=verify, attention=attention,
        default_max_tokens=max_tokens, ready=ready, max_memory=max_memory)
    _served.append(True)


_served = []  # set once the server ran and shut down, for `exit_if_served`


def exit_if_served():
    """End the process with status 0, skipping the C++ static destructors, if `serve` ran in it.

    Called by the console entry points only (a test calling `main` in-process goes on). By then uvicorn has
    shut down and the generation thread is joined, but the destructors at interpreter exit can still abort
    ("terminate called without an active exception": a std::thread of MLX's scheduler destroyed while
    joinable, 1 run in 2 of a new-user trial), so the process ends here with everything flushed.
    """
    if _served:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
