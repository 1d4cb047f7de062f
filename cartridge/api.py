"""`cartridge.load` in each of its forms: one cartridge (`read.load`), a list of them (`load_many`), one rank's
slice under `mlx.launch` (`group=`: `load_sharded`). The three entry points are also public on their own."""

from .compose.load import load_many
from .distributed.load import load_sharded
from .read.load import check_max_memory
from .read.load import load as load_one

__all__ = ["load", "load_many", "load_sharded"]


def load(path, model=None, tokenizer=None, verify="pages", attention="auto", group=None, recompute=16,
         max_memory=None, recompute_ratio=None):
    """Load a cartridge; a list composes several (`load_many`); `group=` loads one rank's slice (`load_sharded`).

    Args:
        path (str | Path | list): cartridge directory (or .cartz); a list of them composes the documents in order.
        model (str | nn.Module | LoadedModel | None): the model to answer with: a model reference
            ("default", a GGUF file, an mlx-lm folder), a loaded model, or None for the one the
            cartridge records. Default: None.
        tokenizer: the model's tokenizer, required with an `nn.Module` model. Default: None.
        verify (str): "pages" checks every page checksum (default); "header" skips them.
        attention (str): "auto" (default), "fused", "portable" or "dequantize-once"
            (`cartridge.attention.policy`).
        group (mx.distributed.Group | None): under `mlx.launch`, the ranks; each maps only the KV heads
            or layers its sharded model runs and all agree before answering
            (`cartridge.load_sharded`, docs/distributed.md). Default: None (one process).
        recompute (int): with a list: document tokens of each later cartridge prefilled again over
            the ones before it. Default: 16.
        recompute_ratio (float | None): with a list: the fraction of each later document's
            tokens recomputed (`cartridge.compose`); None: compose's default. Default: None.
        max_memory (int | None): the most bytes the prefix may hold in memory, while loading and after
            (`cartridge.read.load.load`). Default: None.

    Returns:
        Cartridge (ComposedCartridge for a list, ShardedCartridge with a group)

    Raises:
        CartridgeError subclasses: a failed check, a model whose fingerprint differs
            (ModelMismatchError), a model that cannot be loaded (ModelLoadError).

    Example:
        >>> cart = cartridge.load("gpl.cart")  # doctest: +SKIP
        >>> mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("Who may copy it?"),
        ...                 prompt_cache=cart.prompt_cache(), max_tokens=50)  # doctest: +SKIP
    """
    check_max_memory(max_memory)
    if isinstance(path, (list, tuple)):
        ratio = {} if recompute_ratio is None else {"recompute_ratio": recompute_ratio}
        return load_many(path, model, tokenizer, verify, attention, recompute, max_memory, **ratio)
    if group is not None:
        return load_sharded(path, model, tokenizer, group, verify, attention)
    return load_one(path, model, tokenizer, verify, attention, max_memory)
