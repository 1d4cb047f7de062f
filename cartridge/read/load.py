"""Open a cartridge for generation: verify, check the model's fingerprint, map the pages.

    cart = cartridge.load("doc.cart")
    mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("..."),
                    prompt_cache=cart.prompt_cache(), max_tokens=100)
"""

import sys
import time
import warnings
from pathlib import Path

import mlx.core as mx

from ..attention import budget
from ..attention.caches import PromptCache
from ..attention.policy import place, resolve
from ..attention.prefix import LayerPrefix
from ..errors import InputError
from ..format.reader import open_cartridge
from .loaded import Cartridge
from ..models.loader import LoadedModel, load_model, model_fingerprint
from .stored import check_fingerprint, load_recorded_model, model_dtype, stored_layer

__all__ = ["Cartridge", "PromptCache", "check_fingerprint", "check_max_memory", "load"]

PACKAGE_DIR = str(Path(__file__).parent.parent)  # cartridge/, as this package's frames name their files


def _caller_stacklevel():
    """The `stacklevel` of `warnings.warn`, called in the function that calls this, that names the first caller
    outside the cartridge package: the user's line whichever entry point (`cartridge.load`, `load_many`, this
    `load`) they called, as Python 3.12's `skip_file_prefixes` would."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _head_dims(meta):
    """(K head_dim, V head_dim) of a layer, (None, None) for a state, a list of them for a list layer."""
    if meta.parts:  # a list layer's caches
        return [_head_dims(u) for u in meta.parts]
    return (meta.k_shape[1], meta.v_shape[1]) if meta.k_shape else (None, None)


def _start_decodes(prefixes):
    """Schedule the decodes `place` left lazy (`mx.async_eval`): they run on MLX's stream thread while the
    caller goes on, and the first forward pass waits only for what is not done yet."""
    mx.async_eval([a for p in prefixes if isinstance(p, LayerPrefix) for a in (*p.k_parts.values(), *p.v_parts.values())])


def check_max_memory(max_memory):
    """Refuse a `max_memory` that is not None or a positive whole number of bytes (InputError)."""
    if max_memory is not None and (isinstance(max_memory, bool) or not isinstance(max_memory, int) or max_memory < 1):
        raise InputError(f"max_memory {max_memory!r}: give a positive whole number of bytes")


def load(path, model=None, tokenizer=None, verify="pages", attention="auto", max_memory=None):
    """Load one cartridge: verify it, check the model's fingerprint, map the pages. `cartridge.load` (a list,
    `group=`) forwards here for one cartridge in one process.

    Args:
        path (str | Path): cartridge directory (or .cartz).
        model (str | nn.Module | LoadedModel | None): the model to answer with: a model reference
            ("default", a GGUF file, an mlx-lm folder, a Hugging Face repo id "ORG/NAME"), a loaded model,
            or None for the one the cartridge records (by its repo id where it has one, format 1.10).
            Default: None.
        tokenizer: the model's tokenizer, required with an `nn.Module` model. Default: None.
        verify (str): "pages" checks every page checksum (default); "header" skips them.
        attention (str): "auto" (default), "fused", "portable" or "dequantize-once"
            (`cartridge.attention.policy`).
        max_memory (int | None): the most bytes the prefix may hold in memory, while loading and after
            (stored pages, pages decoded to dense, one decode's buffers). Layers whose policy is
            dequantize-once decode only the sides that fit; the rest read their stored pages. None: for
            "auto", the stored bytes x 1.25 + one decoded layer (fp16/bf16 pages: no limit); for a named
            policy, no limit. With no limit, dequantize-once sides are not decoded by `load`: their decode
            is scheduled to run in the background (`mx.async_eval`), and the first forward pass waits for
            what is left of it (`attention.pages.decode_pages`). Default: None.

    The model's fingerprint is computed once per loaded model (`models.loader.model_fingerprint`), so
    loading a second cartridge with the same model does not compute it again.

    Returns:
        Cartridge

    Raises:
        CartridgeError subclasses: a failed check, a model whose fingerprint differs
            (ModelMismatchError), a model that cannot be loaded (ModelLoadError); InputError: a bad
            `max_memory`, `attention` or `verify`.
    """
    check_max_memory(max_memory)
    t0 = time.perf_counter()
    policy = resolve(attention)
    info, data = open_cartridge(path, verify)
    if model is None:  # the model the cartridge records: by its hub repo id where it has one
        model = load_recorded_model(info, path)
    elif isinstance(model, str):
        model = load_model(model)
    ref = model.label if isinstance(model, LoadedModel) else None
    if isinstance(model, LoadedModel):
        model, tokenizer = model.model, model.tokenizer
    elif tokenizer is None:
        raise InputError("pass the model's tokenizer together with the model (or a LoadedModel, or a model "
                         "reference such as \"default\")")
    check_fingerprint(info, model_fingerprint(model, tokenizer), path, ref)
    prefixes = [stored_layer(info, data, i) for i in range(info.n_layers)]
    head_dims = [_head_dims(m) for m in info.layers]
    prefixes, plan = place(prefixes, policy, model_dtype(model), head_dims, max_memory)
    for line in budget.notes(plan, policy):
        warnings.warn(f"{Path(path).name}: {line}", budget.MemoryBudgetWarning, stacklevel=_caller_stacklevel())
    _start_decodes(prefixes)
    cart = Cartridge(Path(path), info, model, tokenizer, prefixes, time.perf_counter() - t0, plan["policy"], plan)
    cart.data = data  # keeps the mapping alive where MLX wrapped it without a copy
    return cart
