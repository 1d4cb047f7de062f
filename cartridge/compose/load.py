"""Several cartridges loaded with one model and composed: `cartridge.load_many`.

    carts = cartridge.load_many(["a.cart", "b.cart"], recompute=16)   # a ComposedCartridge
"""

from ..errors import ModelMismatchError
from ..format.reader import open_cartridge
from ..read.load import load
from ..read.stored import built_with
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
        CartridgeError subclasses: as `cartridge.load` for any cartridge; ModelMismatchError: cartridges of
            different models (from their headers, before any model loads); InputError: as `compose` (fewer
            than two cartridges, different models, a bad `recompute` or `recompute_ratio`).
    """
    _check_one_model(paths)
    carts = []
    if model is None and paths:  # the first cartridge names the model the others are loaded with
        carts.append(load(paths[0], verify=verify, attention=attention, max_memory=max_memory))
        model, tokenizer = carts[0].model, carts[0].tokenizer
    carts += [load(p, model, tokenizer, verify, attention, max_memory=max_memory) for p in paths[len(carts):]]
    return compose(carts, recompute, recompute_ratio=recompute_ratio)


def _check_one_model(paths):
    """Refuse, from the headers and before any model loads, cartridges built with different models, naming
    each cartridge's model (its recorded reference) and fingerprint.

    Raises:
        ModelMismatchError: as described. CartridgeError: a header cannot be read.
    """
    infos = []
    for path in paths:
        info, data = open_cartridge(path, verify="header")
        data.close()
        infos.append((path, info))
    if len({info.fingerprint.get("id") for _, info in infos}) > 1:
        models = "; ".join(f"{path}: {built_with(info)} (fingerprint {info.fingerprint.get('id', '')[:12]})"
                           for path, info in infos)
        raise ModelMismatchError(f"the cartridges were built with different models ({models}); composing needs "
                                 f"cartridges of one model")
