"""Write a cartridge as an mlx-lm prompt-cache file: what `mlx_lm.generate --prompt-cache-file` and mlx-lm's
`load_prompt_cache` load.

Each layer becomes the mlx-lm cache a fresh prefill of the cartridge's tokens leaves (spec/FORMAT.md 5.5, back
to mlx-lm's classes), written by mlx-lm's own `save_prompt_cache`:

    attention, dense   KVCache of the decoded K/V in float16 (bfloat16 for a bfloat16 model: `export_dtype`; fp16
                       and bf16 pages hold the model's own values, which both keep exactly), or
                       QuantizedKVCache where both sides are stored in a tier whose pages are MLX's own affine
                       layout (mlx4g32: 4 bits, int8: 8 bits; group 32, float16 scales and biases, codes packed
                       as `mx.quantize` packs them) and no token is protected: the stored codes as they are
    window             RotatingKVCache as mlx-lm's prefill leaves it (the last `size` tokens, in order), same dtype
    state              ArraysCache of the stored arrays
    list               CacheList of its caches, each as above

The metadata is mlx_lm.cache_prompt's ("model": the model's reference, "tokenizer_config": "{}"; mlx_lm.generate
reads both) and "cartridge": the token ids and prompt layout, so `cartridge import` of the file restores this
cartridge without --document. A QuantizedKVCache of group 32 needs `mlx_lm.generate --kv-group-size 32` (its
default, 64, is refused against the file's).
"""

import json
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

from ..attention.layers import DenseLayer, ListLayer, is_paged
from ..attention.pages import decode_prefix
from ..errors import InputError, OutputExistsError
from ..format.reader import open_cartridge
from ..format.writer import check_output_folder
from ..models.gguf import is_gguf
from ..models.hub import is_repo_id
from ..models.loader import PACKAGED_MODELS, LoadedModel, load_model
from .promptfile import RECORD, SUFFIX, write_prompt_file
from ..read.stored import check_fingerprint, stored_layer
from ..tiers.affine import AffineCodec

MLX_AFFINE_BITS = (4, 8)  # affine tiers mlx-lm's QuantizedKVCache takes as stored (mlx4g32, int8)


class MlxLoadWarning(UserWarning):
    """The model the exported file names is one mlx_lm.generate cannot load (a GGUF model, a path that is no
    mlx-lm model folder)."""


def mlx_lm_loads(ref):
    """True if mlx_lm.generate can load the model reference `ref`: an mlx-lm model folder (config.json) or, for a
    path that does not exist, a Hugging Face repo id (mlx-lm's loader tries a path first, then the hub)."""
    path = Path(ref).expanduser()
    return (path / "config.json").is_file() if path.exists() else is_repo_id(ref)


@dataclass
class ExportResult:
    """What `export_prompt_cache` wrote.

    Attributes:
        path (str): the file. tokens (int): tokens it holds. bytes (int): its size.
        model (str): the model its metadata names. classes (dict[str, int]): mlx-lm cache classes written,
            counted over every cache (a CacheList's included). group_size (int | None): the QuantizedKVCaches'
            group (None without one): mlx_lm.generate needs it as --kv-group-size.
    """

    path: str
    tokens: int
    bytes: int
    model: str
    classes: dict = field(default_factory=dict)
    group_size: int | None = None


def export_dtype(info):
    """The dtype of the exported K/V: bfloat16 for a cartridge of a bfloat16 model, else float16 (what mlx-lm's
    caches hold for a model of 16-bit weights; a float32 model's K/V in fp16 pages are float16 numbers)."""
    return mx.bfloat16 if info.source_dtype == "bfloat16" else mx.float16


def mlx_layout(prefix):
    """True if both sides of a page-attended prefix are stored in MLX's affine quantized layout with one bit
    width, no protected tokens and K not scaled (format 1.11: codes of K / s): they load into mlx-lm's
    QuantizedKVCache as stored."""
    codecs = (prefix.k_codec, prefix.v_codec)
    return (prefix.protected is None and prefix.key_scale is None
            and all(isinstance(c, AffineCodec) for c in codecs)  # +rot tiers are not
            and codecs[0].bits == codecs[1].bits and codecs[0].bits in MLX_AFFINE_BITS)


def _sequence(x, n_tokens):
    """Stored pages (n_pages, n_kv_heads, P, W) -> (1, n_kv_heads, n_tokens, W), a copy out of the mapped file."""
    n_pages, n_kv, page, width = x.shape
    return mx.contiguous(x.transpose(1, 0, 2, 3).reshape(1, n_kv, n_pages * page, width)[:, :, :n_tokens])


def quantized_cache(prefix):
    """mlx-lm's QuantizedKVCache holding a prefix's stored affine codes, scales and biases (`mlx_layout`)."""
    codec = prefix.k_codec
    c = QuantizedKVCache(group_size=codec.group_size, bits=codec.bits)
    c.keys, c.values = (tuple(_sequence(parts[name], prefix.n_tokens) for name in ("codes", "scales", "biases"))
                        for parts in (prefix.k_parts, prefix.v_parts))
    c.offset = prefix.n_tokens
    return c


def mlx_cache(layer, dtype, quantized=True):
    """The mlx-lm cache of one stored layer (`stored.stored_layer`), as a fresh prefill leaves it.

    Args:
        layer (LayerPrefix | DenseLayer | WindowLayer | StateLayer | ListLayer): as stored.
        dtype (mx.Dtype): the K/V dtype to write (`export_dtype`). quantized (bool): QuantizedKVCache for a prefix
            in MLX's affine layout (`mlx_layout`); False decodes it. Default: True.

    Returns:
        KVCache | QuantizedKVCache | RotatingKVCache | ArraysCache | CacheList
    """
    if is_paged(layer):
        if quantized and mlx_layout(layer):
            return quantized_cache(layer)
        c = KVCache()
        c.keys, c.values = decode_prefix(layer, dtype)
        c.offset = layer.n_tokens
        return c
    if isinstance(layer, ListLayer):
        return CacheList(*(mlx_cache(p, dtype, quantized) for p in layer.parts))
    if type(layer) is DenseLayer:  # mlx-lm's KVCache, not the cartridge's PrefixKVCache
        c = KVCache()
        c.offset = layer.keys.shape[2]
    else:
        c = layer.cache()  # a window's RotatingKVCache, a state's ArraysCache: mlx-lm's own classes
    if hasattr(c, "keys"):
        c.keys, c.values = layer.keys.astype(dtype), layer.values.astype(dtype)
    return c


def _check_output(output, force):
    output = Path(output)
    if output.suffix != SUFFIX:
        raise InputError(f"output {output} must end in {SUFFIX}: mlx_lm.generate --prompt-cache-file reads the file "
                         f"by that extension")
    if output.is_dir():
        raise InputError(f"output {output} is a directory; give a file name")
    if (output.exists() or output.is_symlink()) and not force:
        raise OutputExistsError(f"output {output} exists; pass --force (Python: force=True) to replace it")
    check_output_folder(output)


def _model_ref(info, source, model):
    """The model reference the file names: `model` (checked against the cartridge's fingerprint) or the recorded one."""
    if model is None:
        ref = info.model_ref
    else:
        lm = model if isinstance(model, LoadedModel) else load_model(model)
        check_fingerprint(info, lm.fingerprint, source, lm.ref)
        ref = lm.ref
    if ref in PACKAGED_MODELS or is_gguf(ref):
        warnings.warn(MlxLoadWarning(f"the file names model {ref}, a GGUF model, which mlx_lm.generate cannot load "
                                     f"(cartridge makes no mlx-lm folder of its weights); use the file from Python: "
                                     f"mlx_lm's load_prompt_cache with cartridge.load_model({ref!r})"), stacklevel=3)
    elif not mlx_lm_loads(ref):
        warnings.warn(MlxLoadWarning(f"the file names model {ref}, neither an mlx-lm model folder nor a Hugging Face "
                                     f"repo id, which mlx_lm.generate cannot load; pass the mlx-lm folder of the same "
                                     f"weights as --model (Python: model=)"), stacklevel=3)
    return ref


def export_prompt_cache(source, output, model=None, quantized=True, force=False, verify="pages"):
    """Write a cartridge as an mlx-lm prompt-cache file (module docstring), without the model.

    Args:
        source (str | Path): the cartridge (directory or .cartz).
        output (str | Path): the file to write, ending in ".safetensors".
        model (str | LoadedModel | None): the model reference the file names for mlx_lm.generate (an mlx-lm
            folder); checked against the cartridge's fingerprint. Default: None (the reference the cartridge
            records).
        quantized (bool): write QuantizedKVCaches for layers stored in MLX's affine layout (mlx4g32, int8);
            False decodes every layer to the model's dtype. Default: True.
        force (bool): replace an existing file at `output`. Default: False.
        verify (str): "pages" checks every page checksum first (default); "header" skips them.

    Returns:
        ExportResult

    Raises:
        InputError: an output not ending in ".safetensors", or a directory. OutputExistsError: `output` exists and
            `force` is False. ModelMismatchError: `model` is not the cartridge's. CartridgeError subclasses from
            reading the cartridge. Nothing is written on any of them.

    Example:
        >>> cartridge.export_prompt_cache("doc.cart", "doc.safetensors")  # doctest: +SKIP
        $ mlx_lm.generate --prompt-cache-file doc.safetensors --prompt "Who may copy it?"
    """
    _check_output(output, force)
    info, data = open_cartridge(source, verify)
    try:
        ref = _model_ref(info, source, model)
        caches = [mlx_cache(stored_layer(info, data, i), export_dtype(info), quantized) for i in range(info.n_layers)]
        record = {"tokens": info.tokens.tolist(), "prompt_mode": info.prompt_mode, "separator": info.separator,
                  "system": info.system, "document_tokens": info.document_tokens}
        metadata = {"model": ref, "tokenizer_config": "{}", RECORD: json.dumps(record, separators=(",", ":"))}
        path = write_prompt_file(output, caches, metadata)
    finally:
        data.close()
    leaves = [leaf for c in caches for leaf in (c.caches if isinstance(c, CacheList) else (c,))]
    groups = {c.group_size for c in leaves if isinstance(c, QuantizedKVCache)}
    return ExportResult(str(path), len(info.tokens), path.stat().st_size, ref,
                        dict(Counter(type(c).__name__ for c in leaves)), min(groups) if groups else None)
