"""`cartridge serve`: an OpenAI-compatible HTTP server in which a model id names a cartridge, and a
persistent prompt cache for any client: a base-model prompt that starts with a cartridge's tokens is
answered from that cartridge's pages.

    cartridge serve shelf/ --port 8080
    curl localhost:8080/v1/chat/completions -d '{"model": "gpl", "messages": [...]}'

`pool` finds and loads cartridges (an LRU under a byte budget, one shared model) and matches prompts to
them, `shelf` saves the prefixes of new prompts, `engine` runs every request in arrival order on one
thread, `protocol` checks request bodies, `prompts` renders them, `sampling` samples, `app` holds the routes.
"""

import dataclasses
import logging
import sys
from pathlib import Path

import uvicorn

from ..attention.policy import resolve
from ..errors import CartridgeError, InputError
from ..format.reader import open_cartridge
from ..models.hub import recorded_ref
from ..models.loader import DEFAULT_MODEL, load_model, model_fingerprint
from .app import make_app
from .engine import Engine
from .pool import Pool, find_cartridges
from .protocol import Sampling
from .shelf import Shelf

# Seconds a Ctrl-C (or SIGTERM) waits for responses still streaming before uvicorn cancels them; uvicorn's default
# (None) waits for every connection, which a long answer or an idle client keeps open for minutes.
SHUTDOWN_GRACE_S = 3


def recorded_model(paths):
    """The model the first readable cartridge was built with, by its hub repo id where it records one
    ("default" if none can be read)."""
    for path in paths.values():
        try:
            info, data = open_cartridge(path, verify="header")
        except CartridgeError:
            continue
        data.close()
        return recorded_ref(info.model_ref, info.model_repo_id)
    return DEFAULT_MODEL


def with_chat_template(lm, template):
    """`lm` with its tokenizer's chat template replaced (mlx_lm.server's --chat-template) and its fingerprint
    taken again: the fingerprint covers the template, so cartridges built under another are not used.

    Returns:
        LoadedModel
    """
    lm.tokenizer.chat_template = template  # set on the Hugging Face tokenizer the wrapper forwards to
    vars(lm.tokenizer)["has_chat_template"] = True  # the wrapper's own flag, set once at its creation
    lm.model.cartridge_fingerprint_memo = None  # `model_fingerprint` computes it again
    return dataclasses.replace(lm, fingerprint=model_fingerprint(lm.model, lm.tokenizer))


def _shelf_folder(paths, save_over):
    """The folder saved prefixes go to (the first path, created if missing), or None without --save-prefixes-over."""
    if save_over is None:
        return None
    folder = Path(paths[0])
    if folder.name.endswith((".cart", ".cartz")) or (folder.exists() and not folder.is_dir()):
        raise InputError(f"--save-prefixes-over saves into the first PATH, a folder; {folder} is not one")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create the shelf folder {folder}: {e.strerror or e}") from None
    return folder


class _LevelFormatter(logging.Formatter):
    """uvicorn's line shape: "INFO:     message"."""

    def format(self, record):
        return f"{record.levelname + ':':<9} {record.getMessage()}"


def _log_to_stderr(level):
    logger = logging.getLogger("cartridge.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_LevelFormatter())
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level.upper())


def serve(paths, host="127.0.0.1", port=8080, model=None, max_bytes=None, verify="pages", attention="auto",
          default_max_tokens=512, log_level="info", ready=None, max_memory=None, max_count=10, defaults=None,
          chat_template=None, template_args=None, prefill_step=2048, allowed_origins=("*",), save_over=None,
          shelf_bytes=None):
    """Serve the cartridges at `paths` until interrupted.

    Args:
        paths (list[str]): cartridge directories, .cartz files, or folders of them.
        host (str): interface to listen on. Default: "127.0.0.1". port (int): TCP port. Default: 8080.
        model (str | None): model reference; None uses the one the first cartridge records. Default: None.
        max_bytes (int | None): page bytes kept loaded (LRU); None: no limit. Default: None.
        verify (str): "pages" or "header" checks at load. attention (str): attention policy.
        default_max_tokens (int): max_tokens of a request that gives none. Default: 512.
        log_level (str): uvicorn's and the server's log level (any case). Default: "info".
        ready (callable | None): called with the Pool and the Shelf (None without `save_over`) once the model
            is loaded. Default: None.
        max_memory (int | None): `cartridge.load`'s max_memory for each cartridge. Default: None.
        max_count (int | None): most cartridges kept loaded (--prompt-cache-size). Default: 10.
        defaults (Sampling | None): sampling of a request that sets none (--temp, --top-p, --top-k, --min-p).
        chat_template (str | None): a chat template replacing the tokenizer's. Default: None.
        template_args (dict | None): more arguments of the chat template (--chat-template-args). Default: None.
        prefill_step (int): prompt tokens per forward pass. Default: 2048.
        allowed_origins (tuple[str]): CORS origins ("*": any; empty: none). Default: ("*",).
        save_over (int | None): save the prefix of a base-model prompt of more than this many tokens that
            matched no cartridge into the first path (a folder); None: save nothing. Default: None.
        shelf_bytes (int | None): most bytes of saved prefixes (LRU); required with `save_over`.

    Raises:
        InputError: a path that is no cartridge, two cartridges of one name, an unknown attention policy,
            no cartridge and no model, a shelf that is not a folder or a model whose prefixes cannot be saved.
        WriteError: the shelf folder cannot be written.
        ModelLoadError: the model cannot be loaded.
    """
    resolve(attention)  # refuse an unknown policy now, not as every cartridge's refusal
    shelf_folder = _shelf_folder(paths, save_over)
    found = find_cartridges(paths)
    if not found and model is None:
        raise InputError(f"no cartridge in {', '.join(map(str, paths))}; give --model to serve a model (its prompts "
                         f"are then matched against the cartridges found here)")
    ref = model or recorded_model(found)

    def make_pool():
        lm = load_model(ref)
        if chat_template is not None:
            lm = with_chat_template(lm, chat_template)
        return Pool(found, lm, max_bytes, verify, attention, max_memory, max_count, model)

    def make_shelf(pool):
        return Shelf(shelf_folder, pool, save_over, shelf_bytes)

    _log_to_stderr(log_level)
    engine = Engine(make_pool, default_max_tokens, make_shelf if shelf_folder else None, template_args, prefill_step)
    if ready is not None:
        ready(engine.pool, engine.shelf)
    try:
        uvicorn.run(make_app(engine, defaults=defaults or Sampling(), allowed_origins=allowed_origins), host=host,
                    port=port, log_level=log_level.lower(), timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    finally:
        engine.close(wait=True)  # no MLX work left running when the caller exits; queued prefixes written
