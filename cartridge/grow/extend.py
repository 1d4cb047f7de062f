"""Grow a cartridge: extend its document with more text, or save a conversation held in its cache.

    cartridge ──load──► stored prefix decoded once into mlx-lm KVCaches (`attention.prefill`; or read
              as pages, `CartridgeCache`) ──feed only the new tokens──► their K/V after the prefix
    old pages (copied as stored) + tail encoded in the cartridge's own tiers ──► new cartridge (atomic,
    verified before it is published)

Both write what a one-shot build of the same tokens would write, except for the values of the new
tokens' K/V: they were computed attending over the stored (possibly quantized) prefix. A sliding-window
layer (extend only) continues from its stored window in mlx-lm's RotatingKVCache and stores its new last
`window` tokens, encoded anew in its tiers as `build` encodes them.
"""

import os
import time
from dataclasses import replace

from ..write.append import (ExtendResult, destination, grown_header, require_per_token_tiers, save, token_sha256,
                            write_grown)
from ..attention import route
from ..attention.caches import CartridgeCache, PrefillCache
from ..attention.layers import WindowLayer
from ..write.options import DEFAULT_RESERVE, check_prefill_step, check_reserve, context_length, warn_context_left
from ..write.prefill import DEFAULT_PREFILL_STEP, prefill
from ..errors import InputError
from ..format.header import require_attention_layers
from ..format.source import source_entry
from ..read.load import load
from ..models.loader import load_model
from ..models.prompt import prompt_pieces, check_text, prefix_tokens
from ..read.stored import model_dtype

__all__ = ["EXTEND_SEPARATOR", "ExtendResult", "document_text", "extend", "extended_tokens", "save", "token_sha256"]

EXTEND_SEPARATOR = "\n\n"  # joins the stored document and the new text: a paragraph break


def document_text(cart):
    """The document as the cartridge's tokens spell it (the text after the chat template's opening).

    Raises:
        InputError: if the decoded tokens do not start with the template's opening.
    """
    tok, info = cart.tokenizer, cart.info
    head, _, _ = prompt_pieces(tok, info.prompt_mode, info.separator, info.system)
    text = tok.decode(cart.tokens[: info.document_tokens], skip_special_tokens=False,
                      clean_up_tokenization_spaces=False)
    bos = getattr(tok, "bos_token", None)
    if not text.startswith(head) and bos and text.startswith(bos + head):  # BOS added by encoding, not the template
        text = text[len(bos):]
    if not text.startswith(head):
        raise InputError("the cartridge's tokens do not decode to the chat template's opening; cannot extend it")
    return text[len(head):]


def extended_tokens(cart, text, separator=EXTEND_SEPARATOR):
    """Tokens of the extended document and how many of the stored tokens they keep.

    The extended document is `document + separator + text` with the document as the stored tokens
    decode (the original with trailing whitespace removed, as `build` stored it): its tokens are
    exactly what `build` makes of that text. Where the tokenizer merges across the seam, the last
    stored tokens differ; they are prefilled again.

    Returns:
        tuple: (ids list[int], reused int), ids[:reused] == the stored tokens[:reused].

    Raises:
        InputError: empty text, a conversation cartridge, or no stored token kept.
    """
    check_text(text, "the new text")
    if not isinstance(separator, str):
        raise InputError(f"separator must be text, got {type(separator).__name__}")
    info = cart.info
    if info.document_tokens != len(info.tokens):
        raise InputError(f"the cartridge holds a conversation after its document (tokens {info.document_tokens}.."
                         f"{len(info.tokens)}); extend the document's cartridge instead")
    ids = prefix_tokens(cart.tokenizer, document_text(cart) + separator + text, info.prompt_mode, info.separator,
                        info.system)
    old = cart.tokens
    reused = next((i for i, (a, b) in enumerate(zip(old, ids)) if a != b), min(len(old), len(ids)))
    if reused == 0 or len(ids) <= reused:
        raise InputError(f"the extended text's tokens keep {reused} of the {len(old)} stored tokens and add "
                         f"{len(ids) - reused}; nothing to extend")
    return ids, reused


DENSE_PREFILL = ("auto", "dequantize-once")  # extend's policies that prefill over the decoded prefix


def _caches(cart, keep, attention):
    """Caches over the first `keep` stored tokens (all of them unless the seam moved): the decoded
    prefix in `PrefillCache`s for a policy of `DENSE_PREFILL`, else the stored pages (`CartridgeCache`);
    a window layer's stored window in mlx-lm's RotatingKVCache (`_window_cache`)."""
    route.install()
    dtype = model_dtype(cart.model)
    out = []
    for p in cart.prefixes:
        if isinstance(p, WindowLayer):
            out.append(_window_cache(p, keep))
        elif attention in DENSE_PREFILL:
            out.append(PrefillCache(p, keep, dtype))
        else:  # the portable path masks page tokens at and beyond n_tokens
            out.append(CartridgeCache(p if keep == len(cart.tokens) else replace(p, n_tokens=keep, backend=None)))
    return out


def _window_cache(layer, keep):
    """A window layer's RotatingKVCache as mlx-lm's prefill leaves it (`WindowLayer.cache`), cut to the stored
    tokens before `keep`. Those cut are prefilled again; each of them attends to at most `window` tokens before
    it, and the window stored after the whole document holds all of those."""
    cache = layer.cache()
    drop = layer.total - keep
    if drop:  # the window is in temporal order: its last tokens are the last positions
        cache.keys, cache.values = cache.keys[:, :, :-drop], cache.values[:, :, :-drop]
        cache.offset, cache._idx = keep, cache.keys.shape[2]
    return cache


def extend(path, text, output=None, model=None, separator=EXTEND_SEPARATOR, prefill_step=DEFAULT_PREFILL_STEP,
           force=False, attention="auto", progress=None, source_name=None,
           reserve=DEFAULT_RESERVE):
    """Extend the document of the cartridge at `path` with `text`, prefilling only the new tokens.

    The new tokens attend over the stored prefix (the cartridge is the prompt cache of their
    prefill); their K/V are encoded in the cartridge's own tier of each (layer, side) with its stored
    parameters (nvfp4 keeps its global scale: larger new values saturate). Stored pages are copied
    as they are; a partial last page gets the new tokens after its stored ones.

    Args:
        path (str | Path): the cartridge directory to extend.
        text (str): the text to append.
        output (str | Path | None): where to write; None replaces `path` (atomically, once the new
            cartridge is complete and verified). Default: None.
        model (str | LoadedModel | None): as in `cartridge.load`. Default: None (the recorded model).
        separator (str): text between the stored document and `text`. Default: "\\n\\n".
        prefill_step (int): tokens per forward pass. Default: 512.
        force (bool): replace an existing cartridge at `output`. Default: False.
        attention (str): how the new tokens attend over the stored prefix: "auto" (default) or
            "dequantize-once" decode it once into mlx-lm KVCaches (`cartridge.attention.prefill`: a
            normal chunked prefill over cached tokens; memory as a build of the whole document);
            "portable" or "fused" read the stored pages (`cartridge.load`'s policies; less memory).
        progress (callable | None): progress(done_tokens, total_new_tokens) during prefill.
        source_name (str | None): the file `text` came from, recorded (its last component) with the text's
            bytes and SHA-256 as one more source (`source.documents`, spec/FORMAT.md 4.5.1). Default: None.
        reserve (int): warn (`cartridge.write.options.ContextWarning`) when fewer tokens than this are left of
            the model's context after the extended document, as `build` does. Default: 256.

    Returns:
        ExtendResult

    Raises:
        InputError: empty text, a conversation or packed cartridge, a layer other than attention or
            window, a result longer than the model's context. OutputExistsError: `output` exists and `force` is False. Any `cartridge.load` error.

    Example:
        >>> cartridge.extend("log.cart", open("today.txt").read())  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    check_prefill_step(prefill_step)
    check_reserve(reserve)
    dest, force = destination(path, output, force)
    if isinstance(model, (str, os.PathLike)):
        model = load_model(model)
    # the dense prefill decodes the stored pages itself: loaded as stored, nothing is decoded twice
    cart = load(path, model=model, attention="portable" if attention in DENSE_PREFILL else attention)
    require_attention_layers(cart.info, "extend", kinds=("attention", "window"))
    require_per_token_tiers(cart.info, "extend")
    ids, keep = extended_tokens(cart, text, separator)
    limit = context_length(cart.model)
    if limit and len(ids) >= limit:
        raise InputError(f"the extended document is {len(ids)} tokens; the model's context is {limit} tokens")
    if limit:
        warn_context_left(len(ids), limit, reserve, stacklevel=3)
    t1 = time.perf_counter()
    caches = prefill(cart.model, ids[keep:], prefill_step, progress, caches=_caches(cart, keep, attention))
    t2 = time.perf_counter()
    out = write_grown(cart, caches, ids, keep, dest, force,
                      grown_header(cart, ids, keep, "extend", len(ids), source_entry(text, source_name)))
    total = sum(f.stat().st_size for f in out.iterdir())
    return ExtendResult(str(out), len(ids), len(ids) - keep, keep, t2 - t1, time.perf_counter() - t0, total)


