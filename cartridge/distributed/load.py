"""One rank's cartridge under MLX distributed (`mlx.launch`): the model sharded with mlx-lm, the rank's slice
mapped, and the ranks' agreement before any of them answers.

    group = mx.distributed.init()
    lm = cartridge.distributed.load_sharded_model("model_dir", group, "tensor")   # or "pipeline"
    cart = cartridge.load("doc.cart", model=lm, group=group)
    mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("..."), prompt_cache=cart.prompt_cache())

A tensor-parallel rank (mlx-lm `Model.shard`) reads the bytes of its KV heads of every layer, a
pipeline rank (mlx-lm `pipeline`) the pages of its layers (`cartridge.storage.shard`). Before any
rank answers, one all_gather compares every rank's cartridge digest and model fingerprint and carries
any rank's local failure, so every rank refuses with the same one-line `RankMismatchError`
(`agreement`). docs/distributed.md has the details.
"""

import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from ..attention.caches import PipelineCache
from ..attention.policy import place, resolve
from ..errors import CartridgeError, InputError, ModelMismatchError, RankMismatchError, name_cartridge
from ..format.container import check_index, open_snapshot
from ..format.header import parse_header, require_attention_layers
from ..format.pack import is_pack, open_packed
from ..models.hub import recorded_ref
from ..models.loader import DEFAULT_MODEL, LoadedModel, load_model, model_fingerprint
from ..read.loaded import Cartridge
from ..read.stored import check_fingerprint, layer_prefix, load_recorded_model, model_dtype
from ..storage.shard import SliceData, slice_for
from .agreement import agree, digest_bytes

MODES = ("tensor", "pipeline")


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
            cache[:] = [PipelineCache(c.prefix) for c in cache]
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
            lm = load_recorded_model(info, path) if model is None else load_model(model)
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
        digests = (bytes.fromhex(opened[0].manifest["digest"]), digest_bytes(opened[5]["id"]))
    except (CartridgeError, OSError) as e:  # reported through the agreement, so no rank waits for this one
        error = str(name_cartridge(e, path) if isinstance(e, CartridgeError) else e).splitlines()[0]
    try:
        agree(group, ("cartridge", "model fingerprint"), digests, error)
    except RankMismatchError:
        if opened is not None:
            opened[4].close()
        raise
    snap, info, model, tokenizer, data, _ = opened
    h0, h1 = data.part.heads  # a K scale (format 1.11) is per KV head: this rank's heads of it
    prefixes = [layer_prefix(info, data, i) for i in range(*data.part.layers)]
    prefixes = [p if p.key_scale is None else replace(p, key_scale=p.key_scale[h0:h1]) for p in prefixes]
    prefixes, plan = place(prefixes, policy, model_dtype(model), [(info.head_dim, info.head_dim)] * len(prefixes))
    cart = ShardedCartridge(Path(path), info, model, tokenizer, prefixes, time.perf_counter() - t0, plan["policy"],
                            plan)
    cart.part, cart.verified = data.part, data.verified
    cart.bytes_read, cart.bytes_held = data.bytes_read, data.bytes_held
    cart.data = data  # MLX may wrap the slabs without a copy: keep them alive with the cartridge
    snap.data.close()
    return cart


def recorded_model(path):
    """The model reference a cartridge records ("default" as None; its repo id where it records one), reading
    only its header."""
    snap, info = _open_header(path)
    snap.data.close()
    ref = recorded_ref(info.model_ref, info.model_repo_id)
    return None if ref == DEFAULT_MODEL else ref
