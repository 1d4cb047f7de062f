"""Grow a cartridge: extend its document with more text, or save a conversation held in its cache.

    cartridge ──load──► stored prefix decoded once into mlx-lm KVCaches (`attention.prefill`; or read
              as pages, `CartridgeCache`) ──feed only the new tokens──► their K/V after the prefix
    old pages (copied as stored) + tail encoded in the cartridge's own tiers ──► new cartridge (atomic,
    verified before it is published)

Both write what a one-shot build of the same tokens would write, except for the values of the new
tokens' K/V: they were computed attending over the stored (possibly quantized) prefix.
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from .attention import route
from .attention.cache import CartridgeCache
from .attention.pages import encode_pages
from .attention.prefill import PrefillCache
from .build import (DEFAULT_PREFILL_STEP, DEFAULT_RESERVE, _to_numpy, check_prefill_step, check_reserve,
                    context_length, prefill, warn_context_left)
from .errors import InputError
from .format import keys as K
from .format.container import check_index, open_snapshot
from .format.header import SIDES, require_attention_layers
from .format.layout import FORMAT_MINOR
from .format.pack import is_pack
from .format.source import FIELDS, source_entry
from .format.verify import verify_directory
from .format.writer import CartridgeWriter, check_output_path
from .load import _model_dtype, load
from .models.loader import load_model
from .models.prompt import _pieces, check_text, prefix_tokens
from .tiers import TIERS

WRITER = "cartridge 0.1.0"
EXTEND_SEPARATOR = "\n\n"  # joins the stored document and the new text: a paragraph break


@dataclass
class ExtendResult:
    """What `extend` (or `Cartridge.save`) wrote.

    Attributes:
        path (str): the cartridge written. tokens (int): its tokens (old + new).
        new_tokens (int): tokens prefilled. reused_tokens (int): stored tokens kept as they were (the
            old count, unless the seam re-tokenized the last few).
        prefill_seconds (float), seconds (float): prefill time; total (load, prefill, encode, write, verify).
        bytes (int): bytes on disk.
    """

    path: str
    tokens: int
    new_tokens: int
    reused_tokens: int
    prefill_seconds: float
    seconds: float
    bytes: int


def token_sha256(ids):
    """Hex SHA-256 of token ids as little-endian uint32 (the bytes of `tokens.ids`)."""
    return hashlib.sha256(np.asarray(ids, dtype="<u4").tobytes()).hexdigest()


def document_text(cart):
    """The document as the cartridge's tokens spell it (the text after the chat template's opening).

    Raises:
        InputError: if the decoded tokens do not start with the template's opening.
    """
    tok, info = cart.tokenizer, cart.info
    head, _, _ = _pieces(tok, info.prompt_mode, info.separator, info.system)
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
    prefix in `PrefillCache`s for a policy of `DENSE_PREFILL`, else the stored pages (`CartridgeCache`)."""
    route.install()
    if attention in DENSE_PREFILL:
        dtype = _model_dtype(cart.model)
        return [PrefillCache(p, keep, dtype) for p in cart._prefixes]
    prefixes = cart._prefixes
    if keep < len(cart.tokens):  # the portable path masks page tokens at and beyond n_tokens
        prefixes = [replace(p, n_tokens=keep, kernel=None) for p in prefixes]
    return [CartridgeCache(p) for p in prefixes]


def _source_records(cart):
    """The JSON header records of the loaded cartridge, and its MANIFEST digest (hex)."""
    snap = open_snapshot(cart.path)
    try:
        records = check_index(snap.index, snap.manifest)
    finally:
        snap.data.close()
    if records.get(K.TOKENS_IDS) != np.asarray(cart.tokens, dtype="<u4").tobytes():
        raise InputError(f"cartridge {cart.path} was replaced after it was loaded; load it again")
    header = {}
    for key, raw in records.items():
        if key == K.TOKENS_IDS or key.endswith((".pages", ".head_sums")):
            continue  # written anew
        try:
            header[key] = json.loads(raw)
        except (ValueError, UnicodeDecodeError):  # a binary key of a newer minor: its meaning is unknown here
            continue
    return header, hashlib.sha256(snap.manifest_raw).hexdigest()


def _parts(info, keep, end, kind):
    """lineage.parts of the result: the stored parts cut at `keep`, then [keep, end) of `kind`."""
    parts = info.parts or [{"kind": "build", "start": 0, "end": len(info.tokens)}]
    kept = [dict(p, end=min(p["end"], keep)) for p in parts if p["start"] < keep]
    return kept + [{"kind": kind, "start": keep, "end": end}]


def _header(cart, ids, keep, kind, document_tokens, added=None):
    """The new cartridge's JSON header; `added` (a `source_entry`) is the source an extend appends."""
    header, source = _source_records(cart)
    if added is not None:  # the single keys describe the text first prefilled, no longer the whole document
        header.pop(K.SOURCE_BYTES, None)
        header.pop(K.SOURCE_SHA256, None)
        header[K.SOURCE_DOCUMENTS] = (cart.info.sources or [dict.fromkeys(FIELDS)]) + [added]
    parts = _parts(cart.info, keep, len(ids), kind)
    for p in parts:
        p["tokens_sha256"] = token_sha256(ids[p["start"]:p["end"]])
    header.update({
        K.FORMAT_MINOR: max(FORMAT_MINOR, header.get(K.FORMAT_MINOR, 0)),
        K.WRITER: WRITER,
        K.TOKENS_COUNT: len(ids),
        K.N_PAGES: -(-len(ids) // cart.info.page_size),
        K.DOCUMENT_TOKENS: document_tokens,
        K.LINEAGE_PARTS: parts,
        K.LINEAGE_SOURCE: source,
    })
    return header


def _new_pages(codec, x, params, lead, page_size):
    """Encode tail K or V (n_kv_heads, T, head_dim) into pages starting `lead` tokens into a page.

    The first `lead` slots of the first page are placeholders (zeros) for the stored tokens spliced
    in by the caller; padding after the last token is encoded zeros, as `build` writes it.
    """
    if lead:
        x = mx.pad(x, [(0, 0), (lead, 0), (0, 0)])
    return {name: _to_numpy(a) for name, a in encode_pages(codec, x, params, page_size).items()}


def _write(cart, caches, ids, keep, dest, force, header):
    """Write stored pages [0, keep) + every cache's tail as a cartridge at `dest`; verify, then publish."""
    info, data = cart.info, cart._data
    full, lead = divmod(keep, info.page_size)
    with CartridgeWriter(dest, force) as writer:
        for layer, cache in enumerate(caches):
            tail = dict(zip(SIDES, cache.tail_kv()))  # side -> (n_kv_heads, T_new, head_dim)
            for side in SIDES:
                codec, params = TIERS[info.tiers[layer][side]], info.params[(layer, side)]
                new = _new_pages(codec, tail[side], params, lead, info.page_size)
                for extent in info.extents[(layer, side)]:
                    old = data.view(extent, "<u2" if extent.dtype == "bfloat16" else extent.dtype)
                    pages = new[extent.component]  # (n_new_pages, n_kv_heads, page_size, width)
                    # encoding is per token (tests/test_extend.py): stored tokens of a partial page keep their codes
                    pages[0, :, :lead] = old[full, :, :lead]
                    writer.add_extent(layer, side, extent.component, np.concatenate([old[:full], pages]))
        return writer.commit(header, np.asarray(ids, dtype=np.uint32),
                             check=lambda tmp: verify_directory(tmp).raise_for_error())


def _destination(path, output, force):
    if is_pack(path):
        raise InputError(f"{path} is a packed .cartz; unpack it first (cartridge unpack)")
    if output is None:
        return path, True  # replace in place, atomically, once the new one is verified
    check_output_path(output, force)
    return output, force


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
        reserve (int): warn (`cartridge.build.ContextWarning`) when fewer tokens than this are left of
            the model's context after the extended document, as `build` does. Default: 256.

    Returns:
        ExtendResult

    Raises:
        InputError: empty text, a conversation or packed cartridge, a layer other than attention, a
            result longer than the model's context. OutputExistsError: `output` exists and `force` is False. Any `cartridge.load` error.

    Example:
        >>> cartridge.extend("log.cart", open("today.txt").read())  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    check_prefill_step(prefill_step)
    check_reserve(reserve)
    dest, force = _destination(path, output, force)
    if isinstance(model, (str, os.PathLike)):
        model = load_model(model)
    # the dense prefill decodes the stored pages itself: loaded as stored, nothing is decoded twice
    cart = load(path, model=model, attention="portable" if attention in DENSE_PREFILL else attention)
    require_attention_layers(cart.info, "extend")
    _require_per_token_tiers(cart.info, "extend")
    ids, keep = extended_tokens(cart, text, separator)
    limit = context_length(cart.model)
    if limit and len(ids) >= limit:
        raise InputError(f"the extended document is {len(ids)} tokens; the model's context is {limit} tokens")
    if limit:
        warn_context_left(len(ids), limit, reserve, stacklevel=3)
    t1 = time.perf_counter()
    caches = prefill(cart.model, ids[keep:], prefill_step, progress, caches=_caches(cart, keep, attention))
    t2 = time.perf_counter()
    out = _write(cart, caches, ids, keep, dest, force, _header(cart, ids, keep, "extend", len(ids),
                                                                 source_entry(text, source_name)))
    total = sum(f.stat().st_size for f in out.iterdir())
    return ExtendResult(str(out), len(ids), len(ids) - keep, keep, t2 - t1, time.perf_counter() - t0, total)


def _require_per_token_tiers(info, what):
    """Refuse a tier whose codes depend on other tokens (kivi4's token groups): the page splice needs
    a token's codes to be the same whatever follows it."""
    for row in info.tiers:
        for side in SIDES:
            if getattr(TIERS[row[side]], "token_group", None):
                raise InputError(f"layer {row['layer']} {side} is {row[side]}, whose scales span groups of tokens; "
                                 f"{what} takes tiers that encode each token alone")


def save(cart, path, cache, tokens=None, force=False):
    """Write the cartridge's prefix + what `cache` holds after it (a conversation) as a new cartridge.

    Args:
        cart (Cartridge): the loaded cartridge `cache` was made from (`cart.prompt_cache()`).
        path (str | Path): the cartridge directory to create.
        cache (list[CartridgeCache]): the prompt cache after questions and answers were fed.
        tokens (list[int] | None): every token after the prefix, in order: those the cache holds, then
            any not fed yet (mlx-lm does not feed the last generated token), which are fed here, so
            `cache` grows by them. None: the ids `cache` carries (its `tokens` attribute). Default: None.
        force (bool): replace an existing cartridge at `path`. Default: False.

    Returns:
        ExtendResult: `new_tokens` is the conversation's length.

    Raises:
        InputError: a cache not made from `cart`, a layer other than attention, an empty or too short
            `tokens`, a packed cartridge.
        OutputExistsError: `path` exists and `force` is False.
    """
    t0 = time.perf_counter()
    require_attention_layers(cart.info, "save")
    _require_per_token_tiers(cart.info, "save")
    dest, force = _destination(cart.path, path, force)
    tail = _conversation_tokens(cart, cache, tokens)
    held = cache[0].tail_len
    t1 = time.perf_counter()
    if len(tail) > held:
        prefill(cart.model, tail[held:], DEFAULT_PREFILL_STEP, None, caches=cache)
    ids, n = cart.tokens + tail, len(cart.tokens)
    header = _header(cart, ids, n, "conversation", cart.info.document_tokens)
    out = _write(cart, cache, ids, n, dest, force, header)
    total = sum(f.stat().st_size for f in out.iterdir())
    return ExtendResult(str(out), len(ids), len(tail), n, time.perf_counter() - t1, time.perf_counter() - t0, total)


def _conversation_tokens(cart, cache, tokens):
    if len(cache) != len(cart._prefixes) or any(not isinstance(c, CartridgeCache) or c.prefix is not p
                                                 for c, p in zip(cache, cart._prefixes)):
        raise InputError("the cache was not made by this cartridge's prompt_cache()")
    if tokens is None:
        tokens = getattr(cache, "tokens", None)
        if tokens is None:
            raise InputError("pass the token ids fed after the prefix (tokens=): this cache does not carry them")
    tokens = [int(t) for t in tokens]
    held = {c.tail_len for c in cache}
    if len(held) != 1:
        raise InputError(f"the cache's layers hold different numbers of tokens: {sorted(held)}")
    if not tokens or len(tokens) < held.pop():
        raise InputError(f"tokens gives {len(tokens)} ids; the cache holds {cache[0].tail_len} after the prefix")
    return tokens
