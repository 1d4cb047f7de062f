"""Open a cartridge for generation: verify, check the model's fingerprint, map the pages.

    cart = cartridge.load("doc.cart")
    mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("..."),
                    prompt_cache=cart.prompt_cache(), max_tokens=100)
"""

import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .attention import route
from .attention.cache import CartridgeCache, LayerPrefix
from .attention.layers import DenseLayer, StateLayer, WindowLayer, is_paged
from .attention.policy import prepare, resolve
from .errors import InputError, ModelMismatchError
from .format import keys as K
from .format.header import SIDES
from .tiers import DTYPES
from .format.reader import open_cartridge
from .models.loader import DEFAULT_MODEL, LoadedModel, fingerprint, load_model
from .models.prompt import question_tokens
from .tiers import TIERS


def check_fingerprint(info, fp):
    """Refuse a model whose fingerprint differs from the cartridge's.

    Raises:
        ModelMismatchError: naming both full fingerprint ids and, for each differing part, both digests.
    """
    if fp["id"] == info.fingerprint.get("id"):
        return
    differ = [k for k in ("config", "weights", "tokenizer", "chat_template") if fp.get(k) != info.fingerprint.get(k)]
    parts = ", ".join(f"{k} (cartridge {info.fingerprint.get(k)}, model {fp.get(k)})" for k in differ)
    raise ModelMismatchError(
        f"model fingerprint {fp['id']} differs from the cartridge's {info.fingerprint.get('id')} "
        f"(built with {info.model_ref}); differing: {parts or 'id'}"
    )


def _array(data, extent):
    view = data.view(extent, "<u2" if extent.dtype == "bfloat16" else extent.dtype)
    arr = mx.asarray(view)  # zero-copy where MLX can wrap host memory, one copy otherwise
    return arr.view(mx.bfloat16) if extent.dtype == "bfloat16" else arr


def _layer_prefix(info, data, layer):
    parts = {side: {e.component: _array(data, e) for e in info.extents[(layer, side)]} for side in SIDES}
    tier = info.tiers[layer]
    return LayerPrefix(TIERS[tier["k"]], parts["k"], TIERS[tier["v"]], parts["v"], info.layers[layer].count,
                       info.params[(layer, "k")], info.params[(layer, "v")])


def _layer(info, data, layer):
    """One layer as stored: a LayerPrefix ("attention") or a Dense/Window/State layer (`attention.layers`)."""
    meta = info.layers[layer]
    if meta.kind == "state":
        arrays = {i: _array(data, e)[0] for i, e in zip((a[0] for a in meta.arrays), info.extents[(layer, K.STATE_SIDE)])}
        return StateLayer(meta.state_size, arrays)
    prefix = _layer_prefix(info, data, layer)
    dtype = DTYPES[info.source_dtype]
    if meta.kind == "window":
        return WindowLayer(prefix, dtype, meta.window, len(info.tokens))
    return DenseLayer(prefix, dtype) if meta.kind == "dense" else prefix


class Cartridge:
    """A loaded cartridge: model, tokenizer and the shared, read-only prefix pages.

    Attributes:
        model (nn.Module), tokenizer (TokenizerWrapper): what to generate with.
        info (CartridgeInfo): header contents. path (Path): the cartridge directory.
        load_seconds (float): seconds spent in `load`, model loading included.
        attention (str): the concrete attention policy in use ("fused", "portable",
            "dequantize-once"; see `cartridge.attention.policy`).
    """

    def __init__(self, path, info, model, tokenizer, prefixes, load_seconds, attention="portable"):
        self.path, self.info, self.model, self.tokenizer = path, info, model, tokenizer
        self._prefixes = prefixes
        self.load_seconds = load_seconds
        self.attention = attention

    @property
    def tokens(self):
        """Prefix token ids, list[int]."""
        return self.info.tokens.tolist()

    def question_prompt(self, question):
        """Tokens to feed after the prefix: separator, question, end of turn, assistant header.

        Returns:
            list[int]: pass as `prompt` to `mlx_lm.generate` together with `prompt_cache()`.

        Raises:
            InputError: if the question is empty.
        """
        return question_tokens(self.tokenizer, question, self.info.prompt_mode, self.info.separator)

    def prompt_cache(self):
        """A fresh mlx-lm cache list: the shared prefix (never mutated) plus an empty tail per layer."""
        route.install()
        return [CartridgeCache(p) if is_paged(p) else p.cache() for p in self._prefixes]


def _model_dtype(model):
    """Activation dtype of an mlx-lm model: the dtype of its first norm weight (float32 if none)."""
    for _, w in tree_flatten(model.parameters()):
        if w.dtype in (mx.float32, mx.float16, mx.bfloat16):
            return w.dtype
    return mx.float32


def load(path, model=None, tokenizer=None, verify="pages", attention="auto"):
    """Load a cartridge.

    Args:
        path (str | Path): cartridge directory.
        model (nn.Module | LoadedModel | None): the model to answer with; None loads the one the
            cartridge records ("default" or its path). Default: None.
        tokenizer: the model's tokenizer, required with an `nn.Module` model. Default: None.
        verify (str): "pages" checks every page checksum (default); "header" skips them.
        attention (str): "auto" (default), "fused", "portable" or "dequantize-once"
            (`cartridge.attention.policy`).

    Returns:
        Cartridge

    Raises:
        CartridgeError subclasses: a failed check, a model whose fingerprint differs
        (ModelMismatchError), a model that cannot be loaded (ModelLoadError).

    Example:
        >>> cart = cartridge.load("gpl.cart")  # doctest: +SKIP
        >>> mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("Who may copy it?"),
        ...                 prompt_cache=cart.prompt_cache(), max_tokens=50)  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    policy = resolve(attention)
    info, data = open_cartridge(path, verify)
    if isinstance(model, LoadedModel):
        model, tokenizer = model.model, model.tokenizer
    if model is None:
        lm = load_model(info.model_ref if info.model_ref != DEFAULT_MODEL else None)
        model, tokenizer = lm.model, lm.tokenizer
    elif tokenizer is None:
        raise InputError("pass the model's tokenizer together with the model")
    check_fingerprint(info, fingerprint(model, tokenizer))
    prefixes = [_layer(info, data, i) for i in range(info.n_layers)]
    head_dims = [(m.k_shape[1], m.v_shape[1]) if m.k_shape else (None, None) for m in info.layers]
    prefixes = prepare(prefixes, policy, _model_dtype(model), head_dims)
    cart = Cartridge(Path(path), info, model, tokenizer, prefixes, time.perf_counter() - t0, policy)
    cart._data = data  # keeps the mapping alive where MLX wrapped it without a copy
    return cart
