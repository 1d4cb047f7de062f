"""Load a GGUF file (llama, qwen2, qwen3, gemma3; any ggml tensor type) as an mlx-lm model and a Hugging
Face tokenizer.

The header is read and checked first (`gguf_check.check_gguf`: bounds, before any tensor is touched). Then
the tensors come one of two ways:
- every tensor F32, F16, Q4_0, Q4_1 or Q8_0: `mx.load`, which returns the quantized ones as MLX affine
  triples (weight, scales, biases; group size 32), loaded into `nn.QuantizedLinear`/`QuantizedEmbedding`;
- anything else (the k-quants Q4_K, Q5_K, Q6_K ..., Q5_0, BF16, the i-quants): `mx.load` cannot read the file
  ("[load_gguf] gguf_tensor_to_f16 failed"), so llama.cpp's `gguf` package dequantizes every tensor to
  float32 in numpy (`gguf.quants.dequantize`). On a CPU the loader would dequantize MLX-quantized weights
  to float32 anyway (`loader.load_model`: float32 matmul is ~100x MLX's quantized matmul there), so
  re-quantizing them to MLX's affine form would only add time and error (Q6_K's 16-element groups have no
  exact MLX form).

The model is mlx-lm's class for the architecture (`gguf_arch`), with GGUF's conventions undone there.
"""

import importlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from mlx.utils import tree_unflatten

from ..errors import ModelLoadError
from .gguf_arch import architecture, model_args
from .gguf_check import GGML_TYPES, check_gguf
from .gguf_tokenizer import tokenizer_from_metadata

__all__ = ["load_gguf", "model_args", "tokenizer_from_metadata", "is_gguf", "MLX_READS"]

MLX_READS = frozenset({0, 1, 2, 3, 8})  # F32, F16, Q4_0, Q4_1, Q8_0: the ggml types `mx.load` reads
MLX_GROUP_SIZE = 32  # the group size of the affine triples `mx.load` makes of Q4_0/Q4_1/Q8_0 blocks


def load_gguf(path):
    """Load a GGUF model.

    Args:
        path (str | Path): the .gguf file.

    Returns:
        tuple: (model, tokenizer). model is the mlx-lm `Model` of the file's architecture: with MLX-readable
        tensors, its quantized ones are `nn.QuantizedLinear`/`nn.QuantizedEmbedding` (group 32); otherwise
        every weight is float32. tokenizer is an `mlx_lm.tokenizer_utils.TokenizerWrapper`.

    Raises:
        ModelLoadError: the file cannot be read, fails `check_gguf`, has an architecture, tensor or
            tokenizer cartridge does not read, or its tensors do not fit the model.
    """
    header = check_gguf(path)  # MLX's reader trusts the file's lengths and offsets; a damaged file can crash it
    arch = architecture(header.metadata)
    args = model_args(header.metadata)
    if all(t.ggml_type in MLX_READS for t in header.tensors):
        tensors = _mlx_tensors(path)
    else:
        tensors = _dequantized_tensors(path, header)
    weights = {}
    for gguf_name, array in tensors.items():
        if arch.is_offset_norm(gguf_name):
            array = array.astype(mx.float32) - arch.norm_offset
        weights[arch.mlx_name(gguf_name)] = array
    args["tie_word_embeddings"] = "lm_head.weight" not in weights
    module = importlib.import_module(f"mlx_lm.models.{args['model_type']}")  # a name from gguf_arch's table
    model = module.Model(module.ModelArgs.from_dict(args))
    weights = model.sanitize(weights)
    _quantize_modules(model, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"GGUF tensors do not match mlx-lm's {arch.name} model: {e}") from e
    model.eval()
    return model, tokenizer_from_metadata(header.metadata)


def _mlx_tensors(path):
    """{GGUF name: array} by `mx.load`; a Q4_0/Q4_1/Q8_0 tensor "x.weight" comes as the uint32 codes "x.weight"
    with "x.scales" and "x.biases" beside it."""
    try:
        return mx.load(str(path))
    except Exception as e:  # mx.load raises RuntimeError/ValueError for unreadable files
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def _dequantized_tensors(path, header):
    """{GGUF name: float32 array of the tensor's shape} by `gguf.quants.dequantize` over a memory map."""
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for t in header.tensors:
        rows = blob[t.offset : t.offset + t.nbytes].reshape(*t.shape[:-1], -1)  # (..., bytes per row)
        try:
            values = dequantize(rows, GGMLQuantizationType(t.ggml_type))
        except NotImplementedError:
            raise ModelLoadError(f"GGUF tensor {t.name!r} is {GGML_TYPES[t.ggml_type][0]}, which llama.cpp's "
                                 "gguf package cannot dequantize") from None
        out[t.name] = mx.array(values.astype(np.float32, copy=False))  # copied out of the map
    del blob
    return out


def _quantize_modules(model, weights):
    """Swap Linear/Embedding modules for quantized ones wherever the GGUF tensor is quantized."""
    swaps = []
    for name, module in model.named_modules():
        if f"{name}.scales" not in weights:
            continue
        w, scales = weights[f"{name}.weight"], weights[f"{name}.scales"]
        in_features = scales.shape[-1] * MLX_GROUP_SIZE
        bits = w.shape[-1] * 32 // in_features
        if isinstance(module, nn.Linear):
            q = nn.QuantizedLinear(in_features, w.shape[0], bias="bias" in module, group_size=MLX_GROUP_SIZE,
                                   bits=bits)
        elif isinstance(module, nn.Embedding):
            q = nn.QuantizedEmbedding(w.shape[0], in_features, group_size=MLX_GROUP_SIZE, bits=bits)
        else:
            raise ModelLoadError(f"GGUF tensor {name} is quantized but {type(module).__name__} is not")
        swaps.append((name, q))
    model.update_modules(tree_unflatten(swaps))


def is_gguf(path):
    """True if `path` is a file whose first four bytes are the GGUF magic b"GGUF"."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"
