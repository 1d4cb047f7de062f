"""Several cartridges loaded with one model and composed: `cartridge.load_many`.

    carts = cartridge.load_many(["a.cart", "b.cart"], recompute=16)   # a ComposedCartridge
"""

from ..read.load import load
from .composed import DEFAULT_RECOMPUTE, DEFAULT_RECOMPUTE_RATIO, compose


def load_many(paths, model=None, tokenizer=None, verify="pages", attention="auto", recompute=DEFAULT_RECOMPUTE,
              max_memory=None, recompute_ratio=DEFAULT_RECOMPUTE_RATIO):
    """Load cartridges of one model and lay them out one after another (`compose`).

    Args:
        paths (list[str | Path]): cartridge directories (or .cartz), in document order.
        model, tokenizer, verify, attention, max_memory: as `cartridge.load`, for every cartridge; with no
            model, the first cartridge's recorded model is loaded once and the others are loaded with it.
        recompute (int): document tokens of each later cartridge prefilled again over the ones before it.
            Default: 16.
        recompute_ratio (float): CacheBlend's fraction of each later document's tokens recomputed
            (`cartridge.compose.blend`). Default: DEFAULT_RECOMPUTE_RATIO.

    Returns:
        ComposedCartridge

    Raises:
        CartridgeError subclasses: as `cartridge.load` for any cartridge; InputError: as `compose` (fewer
            than two cartridges, different models, a bad `recompute` or `recompute_ratio`).
    """
    carts = []
    if model is None and paths:  # the first cartridge names the model the others are loaded with
        carts.append(load(paths[0], verify=verify, attention=attention, max_memory=max_memory))
        model, tokenizer = carts[0].model, carts[0].tokenizer
    carts += [load(p, model, tokenizer, verify, attention, max_memory=max_memory) for p in paths[len(carts):]]
    return compose(carts, recompute, recompute_ratio=recompute_ratio)
