"""`cartridge serve`: parse options, start the server (cartridge.serve)."""

import json
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


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # mlx_lm.server's choices
# mlx_lm.server's options this server does not take: each refused in one line saying why.
UNSUPPORTED = {
    "--adapter-path": "LoRA adapters", "--draft-model": "speculative decoding",
    "--num-draft-tokens": "speculative decoding", "--trust-remote-code": "tokenizers with remote code",
    "--use-default-chat-template": "a tokenizer's default template (give --chat-template)",
    "--decode-concurrency": "batched decoding (requests run one at a time)",
    "--prompt-concurrency": "batched prompts (requests run one at a time)",
    "--kv-bits": "quantized KV caches (a cartridge's tier sets how its pages are stored)",
    "--kv-group-size": "quantized KV caches", "--quantized-kv-start": "quantized KV caches",
    "--pipeline": "pipeline parallelism",
}


def _refuse(ctx, param, value):
    if value is not None and value is not False:
        raise InputError(f"{param.opts[0]} (mlx_lm.server's {UNSUPPORTED[param.opts[0]]}) is not supported by "
                         f"cartridge serve")
    return value


def unsupported_options(command):
    """Add mlx_lm.server's options this server does not take, hidden, each refused when given."""
    for name in UNSUPPORTED:
        flag = name in ("--trust-remote-code", "--use-default-chat-template", "--pipeline")
        command = click.option(name, expose_value=False, hidden=True, callback=_refuse, is_flag=flag,
                               default=False if flag else None)(command)
    return command


def _origins(text):
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _template_args(text):
    try:
        args = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"--chat-template-args is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise InputError(f"--chat-template-args must be a JSON object, e.g. '{{\"enable_thinking\": false}}'; "
                         f"got {type(args).__name__}")
    return args


def _check_shelf(save_over, shelf_bytes):
    if save_over is not None and shelf_bytes is None:
        raise InputError("--save-prefixes-over needs --shelf-bytes, the most bytes saved prefixes may take (e.g. 10G)")
    if shelf_bytes is not None and save_over is None:
        raise InputError("--shelf-bytes bounds the prefixes --save-prefixes-over saves; give both")
    return None if shelf_bytes is None else parse_bytes(shelf_bytes, "--shelf-bytes")


def _say_ready(host, port, save_over, shelf_bytes):
    def ready(pool, shelf=None):
        refused = {name: e for name, e in pool.entries.items() if e.error is not None}
        for name, e in refused.items():  # one line each, so a shelf of broken files does not look served
            click.echo(f"warning: {name} ({e.path}) is refused: {e.error.message}", err=True)
        good = [name for name in pool.entries if name not in refused]
        n, names = len(good), ", ".join(good[:8]) + (f", ... ({len(good) - 8} more)" if len(good) > 8 else "")
        click.echo(f"serving {n} cartridge{'' if n == 1 else 's'} ({names or 'none'}) and the base model "
                   f"{pool.base_id!r} on http://{host}:{port}/v1"
                   + (f"; {len(refused)} refused (above)" if refused else ""), err=True)
        if shelf is not None:
            click.echo(f"saving the prefixes of prompts over {save_over:,} tokens into {shelf.folder} "
                       f"(at most {shelf_bytes:,} bytes; {shelf.saved_bytes:,} now)", err=True)
    return ready


@click.command()
@click.argument("paths", nargs=-1, metavar="[DIR|FILE.cart ...]")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="TCP port.")
@click.option("--model", default=None,
              help="Model to answer with (default: the one the cartridges record; needed when there are none).")
@click.option("--max-bytes", "--prompt-cache-bytes", "max_bytes", default=None,
              help="Page bytes of cartridges kept loaded (LRU), e.g. 4G; default: no limit.")
@click.option("--prompt-cache-size", default=10, show_default=True, type=click.IntRange(1),
              help="Most cartridges kept loaded (LRU).")
@click.option("--verify", default="pages", show_default=True, type=click.Choice(["pages", "header"]),
              help="Checks at load: every page checksum, or the header only.")
@click.option("--attention", default="auto", show_default=True,
              help="Attention path: auto, fused (CUDA), portable or dequantize-once.")
@click.option("--max-tokens", default=512, show_default=True, type=click.IntRange(1),
              help="max_tokens of a request that gives none (clipped to the context left).")
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(0, 2),
              help="Temperature of a request that gives none.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="top_p of a request that gives none.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0),
              help="top_k of a request that gives none (0: every token).")
@click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="min_p of a request that gives none (0: every token).")
@click.option("--chat-template", default=None, metavar="TEMPLATE", help="A chat template (Jinja text) to use "
              "instead of the tokenizer's; cartridges built under another template are then not used.")
@click.option("--chat-template-args", default=None, metavar="JSON",
              help="JSON object of more chat template arguments for the base model's prompts, e.g. "
                   "'{\"enable_thinking\": false}'.")
@click.option("--prefill-step-size", default=2048, show_default=True, type=click.IntRange(1),
              help="Prompt tokens per forward pass.")
@click.option("--log-level", default="INFO", show_default=True, type=click.Choice(LOG_LEVELS, case_sensitive=False))
@click.option("--allowed-origins", default="*", show_default=True,
              help="Comma-separated origins a browser page may call from (CORS); \"\" sends no CORS headers.")
@click.option("--save-prefixes-over", "save_over", default=None, type=click.IntRange(1), metavar="N",
              help="Save the prefix of a base-model prompt of more than N tokens that matched no cartridge as a "
                   "new cartridge in the first PATH, after its answer.")
@click.option("--shelf-bytes", default=None, metavar="SIZE",
              help="Most bytes of saved prefixes, e.g. 10G; the least recently used go first.")
@click.option("--max-memory", default=None, help=MAX_MEMORY_HELP + " Per cartridge loaded.")
@unsupported_options
def serve(paths, host, port, model, max_bytes, prompt_cache_size, verify, attention, max_tokens, temp, top_p, top_k,
          min_p, chat_template, chat_template_args, prefill_step_size, log_level, allowed_origins, save_over,
          shelf_bytes, max_memory):
    """Serve cartridges over the OpenAI API: each cartridge is a model id (its name), and a prompt to the base
    model that starts with a cartridge's tokens is answered from that cartridge.

    PATHS are cartridge directories, .cartz files, or folders holding them (default: the current folder).
    """
    from cartridge.serve import serve as run  # (loads mlx-lm and uvicorn: not at CLI start)
    from cartridge.serve.protocol import Sampling  # (loads mlx-lm: not at CLI start)

    if model is not None and not model.strip():
        raise InputError("--model is empty; give a GGUF file, an mlx-lm model folder or \"default\"")
    max_memory = None if max_memory is None else parse_bytes(max_memory, "--max-memory")
    shelf_bytes = _check_shelf(save_over, shelf_bytes)
    template_args = None if chat_template_args is None else _template_args(chat_template_args)
    _check_port(host, port)  # before the model load, and before anything says "serving"
    defaults = Sampling(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    run(list(paths) or ["."], host=host, port=port, model=model,
        max_bytes=None if max_bytes is None else parse_bytes(max_bytes), verify=verify, attention=attention,
        default_max_tokens=max_tokens, log_level=log_level, ready=_say_ready(host, port, save_over, shelf_bytes),
        max_memory=max_memory, max_count=prompt_cache_size, defaults=defaults, chat_template=chat_template,
        template_args=template_args, prefill_step=prefill_step_size, allowed_origins=_origins(allowed_origins),
        save_over=save_over, shelf_bytes=shelf_bytes)
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
