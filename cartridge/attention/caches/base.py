"""What every cache kind shares: mlx-lm's cache protocol (`PROTOCOL`) and the `state` marker that stops mlx-lm's
`save_prompt_cache` at a cache over a cartridge's shared prefix (`NOT_SAVED`)."""

from ...errors import CartridgeError

# mlx-lm's cache protocol (mlx_lm/models/cache.py: `_BaseCache`, `KVCache`): models touch a cache through `offset`
# and `update_and_fetch` (and `make_mask`, mlx_lm.models.base.create_attention_mask); mlx-lm's prompt-cache helpers
# through `state`, `is_trimmable`, `trim`, `size`, `empty`, `nbytes` and `from_state`; `meta_state` (strings) is
# the protocol's metadata, which mlx-lm before 0.25 saved with the state. Every kind of `caches.KINDS` has them all.
PROTOCOL = ("update_and_fetch", "offset", "make_mask", "state", "meta_state", "from_state", "is_trimmable", "trim",
            "size", "empty", "nbytes")

SAVE_HINT = ("a cache over a cartridge's shared prefix cannot go in an mlx-lm prompt-cache file (load_prompt_cache "
             "knows only mlx-lm's own cache classes): save it with cart.save(path, cache), and write a file for "
             "mlx_lm.generate --prompt-cache-file with `cartridge export` (Python: cartridge.export_prompt_cache)")


class NotSaved:
    """The last leaf of the `state` of a cache over a cartridge's shared prefix: mlx-lm's `save_prompt_cache`
    cannot serialize it, so it fails at once, before any file is written, with ValueError("Model state is not
    serializable: " + SAVE_HINT). A file it wrote would name a class mlx-lm's `load_prompt_cache` cannot
    resolve (it looks class names up in its own module). `mx.eval` skips leaves that are not arrays."""

    def __str__(self):
        return SAVE_HINT

    __repr__ = __str__


NOT_SAVED = NotSaved()


def refuse_state(kind, maker):
    """What the `state` setter (so mlx-lm's `from_state`) of a kind that is never made from saved state does.

    Args:
        kind (str): the cache class. maker (str): what makes one, e.g. "a loaded cartridge's prompt_cache()".

    Raises:
        CartridgeError: always: "a {kind} is made by {maker}, not from saved state".
    """
    raise CartridgeError(f"a {kind} is made by {maker}, not from saved state")


def refuse_trim(kind, why):
    """What `trim` of a kind that cannot step back does (its `is_trimmable()` is False, so mlx-lm's
    `trim_prompt_cache` never calls it).

    Raises:
        CartridgeError: always: "a {kind} cannot be trimmed: {why}".
    """
    raise CartridgeError(f"a {kind} cannot be trimmed: {why}")
