"""Cartridges under MLX distributed (`mlx.launch`): every rank maps only its slice, the ranks agree.

    group = mx.distributed.init()
    lm = cartridge.distributed.load_sharded_model("model_dir", group, "tensor")   # or "pipeline"
    cart = cartridge.load("doc.cart", model=lm, group=group)
    mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("..."), prompt_cache=cart.prompt_cache())

A tensor-parallel rank (mlx-lm `Model.shard`) reads the bytes of its KV heads of every layer, a
pipeline rank (mlx-lm `pipeline`) the pages of its layers (`cartridge.storage.shard`). Before any
rank answers, one all_gather compares every rank's cartridge digest and model fingerprint and carries
any rank's local failure, so every rank refuses with the same one-line `RankMismatchError`.
`build_sharded` prefills on every rank; rank 0 gathers the K/V heads (or layers) and writes one
cartridge laid out exactly as a single-process build. docs/distributed.md has the details.
"""

import hashlib
import struct
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..attention.cache import CartridgeCache
from ..attention.policy import place, resolve
from ..storage.shard import SliceData, slice_for
from ..write.build import (DEFAULT_RESERVE, attention_plans, build_result, cartridge_bytes, check_options,
                           fit_page_size, header_extras, kv_caches, plan, prefill, write_layers)
from ..errors import CartridgeError, InputError, ModelMismatchError, RankMismatchError, name_cartridge
from ..format.container import check_index, open_snapshot
from ..format.header import parse_header, require_attention_layers
from ..format.pack import is_pack, open_packed
from ..format.writer import check_output_path, check_space
from ..read.loaded import Cartridge
from ..models.loader import DEFAULT_MODEL, LoadedModel, load_model, model_fingerprint
from ..read.stored import check_fingerprint, layer_prefix, model_dtype
from ..tiers import DEFAULT_TIER

MODES = ("tensor", "pipeline")
RECORD_BYTES = 1024  # one rank's agreement record: 2 x 32-byte digests, status, message
_HEAD = struct.Struct("<32s32sBH")


def _encode(digests, error):
    msg = (error or "").encode()[: RECORD_BYTES - _HEAD.size]
    raw = _HEAD.pack(digests[0], digests[1], 0 if error else 1, len(msg)) + msg
    return np.frombuffer(raw.ljust(RECORD_BYTES, b"\0"), dtype=np.uint8)


def _decode(row):
    a, b, ok, n = _HEAD.unpack_from(row)
    return (a, b), (None if ok else row[_HEAD.size:_HEAD.size + n].decode(errors="replace"))


def refusal(rows, names):
    """The one message every rank raises, from the gathered records (None when all agree)."""
    decoded = [_decode(bytes(r)) for r in rows]
    failed = [(rank, err) for rank, (_, err) in enumerate(decoded) if err is not None]
    if failed:
        others = f" (ranks {', '.join(str(r) for r, _ in failed[1:])} failed too)" if len(failed) > 1 else ""
        return f"rank {failed[0][0]} of {len(rows)} refused: {failed[0][1]}{others}"
    differ = []
    for i, name in enumerate(names):
        values = [d[i].hex()[:16] for d, _ in decoded]
        if len(set(values)) > 1:
            differ.append(f"{name} differs ({', '.join(f'rank {r} {v}' for r, v in enumerate(values))})")
    return f"ranks disagree: {'; '.join(differ)}" if differ else None


def agree(group, names, digests, error=None):
    """One all_gather: every rank's two digests and local error; all ranks raise the same error or none.

    Args:
        group (mx.distributed.Group): the ranks.
        names (tuple[str, str]): what the digests are, for the message (e.g. ("cartridge", "model")).
        digests (tuple[bytes, bytes]): 32 bytes each (zeros where unknown after a local failure).
        error (str | None): this rank's local failure, one line. Default: None.

    Raises:
        RankMismatchError: on every rank, with one identical message, if any rank failed or any digest
            differs between ranks.
    """
    mine = mx.array(_encode(digests, error))
    rows = np.array(mx.distributed.all_gather(mine, group=group)).reshape(group.size(), RECORD_BYTES)
    message = refusal(rows, names)
    if message:
        raise RankMismatchError(message)


def _digest_bytes(hex_or_none):
    return bytes.fromhex(hex_or_none) if hex_or_none else bytes(32)


def shard_model(lm, group, mode):
    """Shard a loaded model in place with mlx-lm (`Model.shard` or `model.model.pipeline`).

    The fingerprint is the whole model's, taken before sharding, so every rank matches the cartridge.

    Args:
        lm (LoadedModel): from `cartridge.load_model`. group (mx.distributed.Group): the ranks.
        mode (str): "tensor" (each rank n_kv_heads / N of every layer) or "pipeline" (a range of layers).

    Returns:
        LoadedModel: the same object, its model sharded.

    Raises:
        InputError: unknown mode, a model family mlx-lm cannot shard that way, or heads/layers that do
            not split in `group.size()`.
    """
    model, n = lm.model, group.size()
    family = getattr(model, "model_type", type(model).__name__)
    if mode not in MODES:
        raise InputError(f"parallel mode {mode!r} is unknown; choose one of {', '.join(MODES)}")
    model.cartridge_weights_digest = lm.fingerprint["weights"]  # the whole model's, as the cartridge records
    if mode == "tensor":
        n_kv = model.layers[0].self_attn.n_kv_heads
        if not hasattr(model, "shard") or n_kv % n:
            raise InputError(f"{family} with {n_kv} KV heads cannot be tensor-sharded over {n} ranks")
        model.shard(group)
    else:
        if not hasattr(getattr(model, "model", None), "pipeline") or len(model.layers) < n:
            raise InputError(f"{family} ({len(model.layers)} layers) has no mlx-lm pipeline over {n} ranks; "
                             f"use tensor parallel")
        model.model.pipeline(group)
    mx.eval(model.parameters())
    return lm


def load_sharded_model(ref, group, mode):
    """`cartridge.load_model(ref)` then `shard_model` (the full model is loaded on each rank first)."""
    return shard_model(load_model(ref), group, mode)


class _PipelineCache(CartridgeCache):
    """A CartridgeCache whose `keys` mlx-lm's pipeline models may chain a send onto (`mx.depends`),
    so evaluating the cache evaluates the send to the next rank."""

    def _last(self):
        return max(0, self.tail_len - 1) // self.chunk_size

    @property
    def keys(self):
        return self._k_chunks[self._last()] if self._k_chunks else mx.array(0)

    @keys.setter
    def keys(self, value):
        if self._k_chunks:
            self._k_chunks[self._last()] = value


class ShardedCartridge(Cartridge):
    """A `Cartridge` of one rank: the prefix of its layers / KV heads only.

    Attributes:
        part (Slice): what this rank holds. bytes_read (int): bytes of pages.bin it read.
        bytes_held (int): page bytes it holds. verified (str): how they were checked, one line.
    """

    def prompt_cache(self):
        """One cache per layer this rank runs (mlx-lm's pipeline models index it from their first layer)."""
        cache = super().prompt_cache()
        if self.part.mode == "pipeline":
            cache[:] = [_PipelineCache(c.prefix) for c in cache]
        return cache


def _open_header(path):
    def opener(folder):
        snap = open_snapshot(folder)
        try:
            return snap, parse_header(check_index(snap.index, snap.manifest), snap.manifest)
        except BaseException:
            snap.data.close()
            raise

    return open_packed(path, opener) if is_pack(path) else opener(Path(path))


def _open_slice(path, model, tokenizer, group, verify):
    """This rank's part: header, model, fingerprint check, its slice read and verified."""
    snap, info = _open_header(path)
    try:
        if model is None or isinstance(model, str):  # loaded whole: this rank then maps everything
            ref = info.model_ref if model is None else model
            lm = load_model(ref if ref != DEFAULT_MODEL else None)
            model, tokenizer = lm.model, lm.tokenizer
        elif tokenizer is None:
            raise InputError("pass the model's tokenizer together with the model")
        require_attention_layers(info, "sharded loading (load it with cartridge.load)")
        part = slice_for(model, info.n_layers, info.n_kv_heads, group.rank(), group.size())
        whole = bool(getattr(model, "cartridge_weights_digest", None))  # else: the digest of this shard only
        fp = model_fingerprint(model, tokenizer)
        try:
            check_fingerprint(info, fp, path)
        except ModelMismatchError as e:
            hint = ("; a sharded model must carry the whole model's fingerprint: shard it with "
                    "cartridge.distributed.shard_model") if part.mode != "replicated" and not whole else ""
            raise ModelMismatchError(f"{e}{hint}") from None
        return snap, info, model, tokenizer, SliceData(info, snap.data, part, verify), fp
    except BaseException:
        snap.data.close()
        raise


def _require_kv_caches(model):
    """Refuse a model whose cache is not mlx-lm's full-attention KVCache in every layer."""
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)} - {"KVCache"})
    if kinds:
        raise InputError(f"model uses {', '.join(kinds)}; a sharded build stores full-attention KVCache models "
                         f"only: build it with cartridge.build")


def load_sharded(path, model=None, tokenizer=None, group=None, verify="pages", attention="auto"):
    """`cartridge.load` for one rank of `group`: map its slice, then agree with every other rank.

    Args:
        path (str | Path): cartridge directory or .cartz (the same cartridge on every rank).
        model (nn.Module | LoadedModel | str | None): this rank's (sharded) model; a reference, or None
            for the recorded one, loads it unsharded (every rank then maps everything). Default: None.
        tokenizer: required with an `nn.Module` model. Default: None.
        group (mx.distributed.Group | None): the ranks; None means `mx.distributed.init()`.
        verify (str): "pages" checks every byte this rank reads (default); "header" skips that.
        attention (str): attention policy, as in `cartridge.load`. Default: "auto".

    Returns:
        ShardedCartridge

    Raises:
        RankMismatchError: on every rank, with one message, when any rank failed to open its slice
            (naming that rank and its error) or the ranks' cartridge digests or model fingerprints differ.
        InputError: a bad policy or verify mode (raised before the collective: same on every rank).
    """
    t0 = time.perf_counter()
    group = group or mx.distributed.init()
    policy = resolve(attention)
    if verify not in ("pages", "header"):
        raise InputError(f"verify must be one of ('pages', 'header'), got {verify!r}")
    if isinstance(model, LoadedModel):
        model, tokenizer = model.model, model.tokenizer
    opened, error, digests = None, None, (bytes(32), bytes(32))
    try:
        opened = _open_slice(path, model, tokenizer, group, verify)
        digests = (bytes.fromhex(opened[0].manifest["digest"]), _digest_bytes(opened[5]["id"]))
    except (CartridgeError, OSError) as e:  # reported through the agreement, so no rank waits for this one
        error = str(name_cartridge(e, path) if isinstance(e, CartridgeError) else e).splitlines()[0]
    try:
        agree(group, ("cartridge", "model fingerprint"), digests, error)
    except RankMismatchError:
        if opened is not None:
            opened[4].close()
        raise
    snap, info, model, tokenizer, data, _ = opened
    prefixes = [layer_prefix(info, data, i) for i in range(*data.part.layers)]
    prefixes, plan = place(prefixes, policy, model_dtype(model), [(info.head_dim, info.head_dim)] * len(prefixes))
    cart = ShardedCartridge(Path(path), info, model, tokenizer, prefixes, time.perf_counter() - t0, plan["policy"],
                            plan)
    cart.part, cart.verified = data.part, data.verified
    cart.bytes_read, cart.bytes_held = data.bytes_read, data.bytes_held
    cart.data = data  # MLX may wrap the slabs without a copy: keep them alive with the cartridge
    snap.data.close()
    return cart


def _global_geometry(model):
    """(n_layers, n_kv_heads, head_dim) of the whole model, from its args (a shard holds fewer)."""
    args = model.args
    attn = next(layer for layer in model.layers if layer is not None).self_attn
    head_dim = getattr(attn, "head_dim", None) or args.hidden_size // args.num_attention_heads
    n_kv = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    return int(args.num_hidden_layers), int(n_kv), int(head_dim)


def _owners(part, group):
    """Layer -> the rank that holds it, from every rank's [first, end) layer range (one all_gather)."""
    ranges = np.array(mx.distributed.all_gather(mx.array(list(part.layers), dtype=mx.int32), group=group))
    return {layer: r for r, (a, b) in enumerate(ranges.reshape(-1, 2)) for layer in range(a, b)}


def _gather_layers(caches, part, geometry, n_tokens, group):
    """Yield every layer's whole (keys, values), (1, n_kv_heads, T, head_dim), on every rank, in layer order.

    Tensor: all_gather of each rank's heads (rank order is head order). Pipeline: all_gather of the
    owner's K/V and zeros elsewhere, keeping the owner's row. Every rank evaluates each gather, so the
    collectives stay in step whether or not the rank writes.
    """
    n_layers, n_kv, head_dim = geometry
    owners = _owners(part, group) if part.mode == "pipeline" else None
    dtype = caches[0].keys.dtype
    for layer in range(n_layers):
        local = layer - part.layers[0]
        if part.mode == "pipeline":
            held = 0 <= local < len(caches)
            xs = ((caches[local].keys, caches[local].values) if held
                  else (mx.zeros((1, n_kv, n_tokens, head_dim), dtype),) * 2)
            # (N, n_kv, T, D) -> the owner's (1, n_kv, T, D)
            out = [mx.distributed.all_gather(x[0, :, :n_tokens], group=group)
                   .reshape(group.size(), n_kv, n_tokens, head_dim)[owners[layer]][None] for x in xs]
        elif part.mode == "tensor":
            c = caches[layer]
            # (h, T, D) per rank -> (N * h, T, D): heads in rank order
            out = [mx.distributed.all_gather(x[0, :, :n_tokens], group=group)[None] for x in (c.keys, c.values)]
        else:
            out = [caches[layer].keys[:, :, :n_tokens], caches[layer].values[:, :, :n_tokens]]
        mx.eval(out)
        if 0 <= local < len(caches):
            caches[local] = None  # free this layer's dense K/V before the next
        yield out[0], out[1]


def build_sharded(document, output, model, group=None, tier=DEFAULT_TIER, k_tier=None, v_tier=None,
                  boundary_protect=0, schema=None, page_size=256, prefill_step=512, force=False, progress=None,
                  source_name=None, reserve=DEFAULT_RESERVE, system=None):
    """`cartridge.build` on every rank of `group` with a sharded model; rank 0 writes the cartridge.

    Every rank prefills its shard (mlx-lm's sharded forward); rank 0 gathers all K/V heads (tensor) or
    layers (pipeline), one layer at a time, and writes one cartridge with the single-process layout.

    Args:
        document (str): the corpus text (the same on every rank).
        output (str | Path): cartridge directory rank 0 creates.
        model (LoadedModel): this rank's model, sharded with `shard_model` (or whole).
        group (mx.distributed.Group | None): the ranks; None means `mx.distributed.init()`.
        tier, k_tier, v_tier, boundary_protect, schema, page_size, prefill_step, force, progress,
            source_name, reserve, system: as `cartridge.build`.

    Returns:
        BuildResult | None: on rank 0; None on the other ranks.

    Raises:
        RankMismatchError: on every rank, with one message, when any rank refused the inputs (an
            output that exists on rank 0, a bad tier ...) or the ranks' models or documents differ.
    """
    group = group or mx.distributed.init()
    options = (tier, k_tier, v_tier, boundary_protect, schema)
    error, tokens, fp = None, [], None
    try:
        if not isinstance(model, LoadedModel):
            raise InputError("pass the model as a LoadedModel (cartridge.distributed.load_sharded_model)")
        fp = model.fingerprint["id"]
        if group.rank() == 0:
            check_output_path(output, force)
        check_options(document, options, page_size, prefill_step, reserve)
        _require_kv_caches(model.model)
        geometry = _global_geometry(model.model)
        schema, mode, tokens, left = plan(document, model, geometry, options, reserve, system, page_size)
        page_size = fit_page_size(page_size, len(tokens))
        if group.rank() == 0:
            check_space(output, cartridge_bytes(schema, geometry[1], geometry[2], len(tokens), page_size))
        part = slice_for(model.model, geometry[0], geometry[1], group.rank(), group.size())
    except CartridgeError as e:
        error = str(e).splitlines()[0] if str(e) else type(e).__name__
    token_digest = hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).digest()
    agree(group, ("model fingerprint", "document tokens"), (_digest_bytes(fp), token_digest), error)
    t0 = time.perf_counter()
    caches = prefill(model.model, tokens, prefill_step, progress)
    t1 = time.perf_counter()
    layers = _gather_layers(caches, part, geometry, len(tokens), group)
    if group.rank() != 0:
        for _ in layers:
            pass
        return None
    try:
        path = write_layers(output, model, tokens, kv_caches(layers), schema, attention_plans(geometry), page_size,
                            mode, force, header_extras(document, source_name, system))
    finally:
        for _ in layers:  # a failed write still takes part in the remaining gathers
            pass
    return build_result(path, tokens, t1 - t0, time.perf_counter() - t0, schema, attention_plans(geometry), left)


def recorded_model(path):
    """The model reference a cartridge records ("default" as None), reading only its header."""
    snap, info = _open_header(path)
    snap.data.close()
    return None if info.model_ref == DEFAULT_MODEL else info.model_ref
