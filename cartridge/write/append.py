"""Write a loaded cartridge's stored pages plus what a cache holds after them as a new cartridge: the writer
`extend` and `Cartridge.save` share (below both: it imports neither `load` nor `extend`).

    old pages (copied as stored) + tail encoded in the cartridge's own tiers ──► new cartridge (atomic,
    verified before it is published)
"""

import hashlib
import json
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..attention.caches import CartridgeCache
from ..attention.pages import encode_pages
from ..storage.kinds import KINDS, LayerPlan
from ..storage.store import to_numpy
from .prefill import DEFAULT_PREFILL_STEP, prefill
from ..errors import InputError
from ..format import keys as K
from ..format.source import FIELDS
from ..format.container import check_index, open_snapshot
from ..format.header import SIDES, require_attention_layers
from ..format.layout import FORMAT_MINOR
from ..format.pack import is_pack
from ..format.verify import verify_directory
from ..format.writer import CartridgeWriter, check_output_path
from ..tiers import TIERS, key_scale

WRITER = "cartridge 0.1.0"


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


def grown_header(cart, ids, keep, kind, document_tokens, added=None):
    """The header records of the grown cartridge: the loaded one's, with its counts and lineage updated.

    Args:
        cart (Cartridge): the loaded cartridge. ids (list[int]): every token of the result.
        keep (int): stored tokens kept. kind (str): "extend" or "conversation" (the new lineage part).
        document_tokens (int): tokens of the document in the result.
        added (dict | None): the source an extend appends (`format.source.source_entry`), after the stored
            ones in `source.documents`. Default: None.

    Returns:
        dict: key -> JSON value, for `CartridgeWriter.commit`.

    Raises:
        InputError: the cartridge at `cart.path` was replaced after it was loaded.
    """
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
    return {name: to_numpy(a) for name, a in encode_pages(codec, x, params, page_size).items()}


def write_grown(cart, caches, ids, keep, dest, force, header):
    """Write stored pages [0, keep) + every cache's tail as a cartridge at `dest`; verify, then publish. A window
    layer's cache (mlx-lm's RotatingKVCache, extend) is written whole: its last `window` tokens, as `build` does.

    Args:
        cart (Cartridge): the loaded cartridge. caches (list): one per layer, with `tail_kv()` (a window
            layer's: its RotatingKVCache).
        ids (list[int]): every token of the result. keep (int): stored tokens kept.
        dest (str | Path): where. force (bool): replace an existing cartridge. header (dict): `grown_header`.

    Returns:
        Path: the published cartridge.
    """
    info, data, header = cart.info, cart.data, dict(header)
    full, lead = divmod(keep, info.page_size)
    with CartridgeWriter(dest, force) as writer:
        for layer, cache in enumerate(caches):
            meta = info.layers[layer]
            if meta.kind == "window":  # its records (window start and count, params) replace the stored ones
                plan = LayerPlan("window", meta.k_shape, meta.v_shape, window=meta.window)
                header.update(KINDS["window"].write(writer, layer, plan, cache, info.tiers[layer], info.page_size,
                                                    len(ids)))
                continue
            tail = dict(zip(SIDES, cache.tail_kv()))  # side -> (n_kv_heads, T_new, head_dim), the model's own
            scale = info.key_scales.get(layer)
            if scale is not None:  # K stored as K / s (format 1.11): the new tokens' too, under the same s
                tail["k"] = key_scale.divided(tail["k"], scale)
                writer.add_record(K.layer_key_scale(layer), key_scale.record(scale))
            for side in SIDES:
                codec, params = TIERS[info.tiers[layer][side]], info.params[(layer, side)]
                new = _new_pages(codec, tail[side], params, lead, info.page_size)
                for extent in info.extents[(layer, side)]:
                    old = data.view(extent, "<u2" if extent.dtype == "bfloat16" else extent.dtype)
                    pages = new[extent.component]  # (n_new_pages, n_kv_heads, page_size, width)
                    # encoding is per token (tests/write/test_extend.py): stored tokens of a partial page keep their codes
                    pages[0, :, :lead] = old[full, :, :lead]
                    writer.add_extent(layer, side, extent.component, np.concatenate([old[:full], pages]))
        return writer.commit(header, np.asarray(ids, dtype=np.uint32),
                             check=lambda tmp: verify_directory(tmp).raise_for_error())


def destination(path, output, force):
    """Where a grown cartridge goes: (`output`, force), or (`path`, True) to replace it in place once verified.

    Raises:
        InputError: `path` is a packed .cartz. OutputExistsError: `output` exists and `force` is False.
    """
    if is_pack(path):
        raise InputError(f"{path} is a packed .cartz; unpack it first (cartridge unpack)")
    if output is None:
        return path, True  # replace in place, atomically, once the new one is verified
    check_output_path(output, force)
    return output, force


def require_per_token_tiers(info, what):
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
            any not fed yet (a plain loop does not feed its last generated token; generate_step does), which are fed here, so
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
    require_per_token_tiers(cart.info, "save")
    dest, force = destination(cart.path, path, force)
    tail = _conversation_tokens(cart, cache, tokens)
    held = cache[0].tail_len
    t1 = time.perf_counter()
    if len(tail) > held:
        prefill(cart.model, tail[held:], DEFAULT_PREFILL_STEP, None, caches=cache)
    ids, n = cart.tokens + tail, len(cart.tokens)
    header = grown_header(cart, ids, n, "conversation", cart.info.document_tokens)
    out = write_grown(cart, cache, ids, n, dest, force, header)
    total = sum(f.stat().st_size for f in out.iterdir())
    return ExtendResult(str(out), len(ids), len(tail), n, time.perf_counter() - t1, time.perf_counter() - t0, total)


def _conversation_tokens(cart, cache, tokens):
    if len(cache) != len(cart.prefixes) or any(not isinstance(c, CartridgeCache) or c.prefix is not p
                                                 for c, p in zip(cache, cart.prefixes)):
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
