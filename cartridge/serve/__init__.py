"""`cartridge serve`: an OpenAI-compatible HTTP server where a model id names a cartridge.

    cartridge serve shelf/ --port 8080
    curl localhost:8080/v1/chat/completions -d '{"model": "gpl", "messages": [...]}'

`pool` finds and loads cartridges (an LRU under a byte budget, one shared model), `engine` runs every
request in arrival order on one thread, `protocol` checks request bodies, `app` holds the routes.
"""


from ..attention.policy import resolve
from ..errors import CartridgeError
from ..format.reader import open_cartridge
from ..models.hub import recorded_ref
from ..models.loader import DEFAULT_MODEL, load_model
from .pool import Pool, find_cartridges


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


def serve(paths, host="127.0.0.1", port=8080, model=None, max_bytes=None, verify="pages", attention="auto",
          default_max_tokens=512, log_level="info", ready=None, max_memory=None):
    """Serve the cartridges at `paths` until interrupted.

    Args:
        paths (list[str]): cartridge directories, .cartz files, or folders of them.
        host (str): interface to listen on. Default: "127.0.0.1". port (int): TCP port. Default: 8080.
        model (str | None): model reference; None uses the one the first cartridge records. Default: None.
        max_bytes (int | None): page bytes kept loaded (LRU); None: no limit. Default: None.
        verify (str): "pages" or "header" checks at load. attention (str): attention policy.
        default_max_tokens (int): max_tokens of a request that gives none. Default: 512.
        log_level (str): uvicorn's log level. Default: "info".
        ready (callable | None): called with the Pool once the model is loaded. Default: None.
        max_memory (int | None): `cartridge.load`'s max_memory for each cartridge. Default: None.

    Raises:
        InputError: a path that is no cartridge, two cartridges of one name, an unknown attention policy.
        ModelLoadError: the model cannot be loaded.
    """
    import uvicorn

    from .app import make_app
    from .engine import Engine

    resolve(attention)  # refuse an unknown policy now, not as every cartridge's refusal
    found = find_cartridges(paths)
    ref = model or recorded_model(found)
    engine = Engine(lambda: Pool(found, load_model(ref), max_bytes, verify, attention, max_memory), default_max_tokens)
    if ready is not None:
        ready(engine.pool)
    try:
        uvicorn.run(make_app(engine), host=host, port=port, log_level=log_level)
    finally:
        engine.close(wait=True)  # no MLX work left running when the caller exits
