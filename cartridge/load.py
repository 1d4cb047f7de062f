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
from .attention.cache import LayerPrefix
from .attention.layers import (DenseLayer, ListLayer, StateLayer, WindowLayer, cache_offset, fresh_cache, is_paged,
                               trimmable)
from .attention.policy import place, resolve
from .errors import InputError, ModelMismatchError
from .format import keys as K
from .format.header import SIDES
from .tiers import DTYPES
from .format.reader import open_cartridge
from .models.loader import DEFAULT_MODEL, LoadedModel, load_model, model_fingerprint
from .models.prompt import conversation_tokens, followup_tokens, question_tokens
from .tiers import TIERS, protect


def check_fingerprint(info, fp, path=None, model_ref=None):
    """Refuse a model whose fingerprint differs from the cartridge's, in one line that says what to do.

    Args:
        info (CartridgeInfo): the cartridge's header. fp (dict): the model's `fingerprint()`.
        path (str | Path | None): the cartridge, named in the message. Default: None.
        model_ref (str | None): how the model was given ("default", a path), named in the message.

    Raises:
        ModelMismatchError: naming the cartridge, the model it was built with, the parts that differ
            (config, weights, tokenizer, chat_template) and the two ways out.
    """
    if fp["id"] == info.fingerprint.get("id"):
        return
    differ = [k for k in ("config", "weights", "tokenizer", "chat_template") if fp.get(k) != info.fingerprint.get(k)]
    which = f"cartridge {path}" if path is not None else "the cartridge"
    given = f" {model_ref}" if model_ref else ""
    ref = info.model_ref
    raise ModelMismatchError(
        f"{which} was built with model {ref} (fingerprint {info.fingerprint.get('id', '')[:12]}); this "
        f"model{given} (fingerprint {fp['id'][:12]}) differs in {', '.join(differ) or 'id'}: answer with "
        f"--model {ref} (Python: model={ref!r}), or rebuild the cartridge with this model"
    )


def _array(data, extent):
    view = data.view(extent, "<u2" if extent.dtype == "bfloat16" else extent.dtype)
    arr = mx.asarray(view)  # zero-copy where MLX can wrap host memory, one copy otherwise
    return arr.view(mx.bfloat16) if extent.dtype == "bfloat16" else arr


def _layer_prefix(info, data, layer, meta=None):
    meta = meta or info.layers[layer]
    parts = {side: {e.component: _array(data, e) for e in info.extents[(layer, side)]} for side in SIDES}
    tier = info.unit_tiers[layer]
    return LayerPrefix(TIERS[tier["k"]], parts["k"], TIERS[tier["v"]], parts["v"], meta.count,
                       info.params[(layer, "k")], info.params[(layer, "v")],
                       protected=protect.layer_protected(info, layer))


def _layer(info, data, layer, meta=None):
    """One layer as stored: a LayerPrefix ("attention") or a Dense/Window/State/List layer
    (`attention.layers`). `layer` is a layer index, or "i.j" for cache j of a list layer (with its `meta`)."""
    meta = meta or info.layers[layer]
    if meta.kind == "list":
        return ListLayer([_layer(info, data, K.part(layer, j), u) for j, u in enumerate(meta.parts)])
    if meta.kind == "state":
        arrays = {i: _array(data, e)[0] for i, e in zip((a[0] for a in meta.arrays), info.extents[(layer, K.STATE_SIDE)])}
        return StateLayer(meta.state_size, arrays)
    prefix = _layer_prefix(info, data, layer, meta)
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
            "dequantize-once"; "mixed" where `auto` chose per layer; see `cartridge.attention.policy`).
        plan (dict): how the prefix was placed: "reason" (why this policy: the measurement, the budget),
            per-layer "layers", and "memory" (budget, stored, resident and planned peak bytes;
            `cartridge.attention.policy.place`).
    """

    def __init__(self, path, info, model, tokenizer, prefixes, load_seconds, attention="portable", plan=None):
        self.path, self.info, self.model, self.tokenizer = path, info, model, tokenizer
        self._prefixes = prefixes
        self.load_seconds = load_seconds
        self.attention = attention
        self.plan = plan or {"policy": attention, "reason": attention, "layers": [], "memory": {}}

    @property
    def tokens(self):
        """Prefix token ids, list[int]."""
        return self.info.tokens.tolist()

    def question_prompt(self, question, cache=None):
        """Tokens to feed after the prefix: separator, question, end of turn, assistant header. After a
        saved conversation (`save`; info.document_tokens < tokens): the end of the assistant's turn, a
        new user turn with the question, the assistant header.

        A question is one user turn right after the document, so it needs a cache whose tail is empty:
        a fresh `prompt_cache()`, or one emptied by `reset(cache)`. For a conversation use `chat_prompt`.

        Args:
            question (str): the question.
            cache (list | None): the cache the tokens will be fed into; given, it is checked to be
                empty after the document. Default: None (not checked).

        Returns:
            list[int]: pass as `prompt` to `mlx_lm.generate` together with the cache.

        Raises:
            InputError: if the question is empty, or `cache` already holds tokens after the document
                (its answer would follow the earlier turns and a malformed second document turn).
        """
        offset = cache_offset(cache)  # recurrent states only: none
        if offset is not None and offset > len(self.info.tokens):
            held = offset - len(self.info.tokens)
            raise InputError(f"this cache already holds {held} tokens after the document; call "
                             f"cart.reset(cache) or use cart.prompt_cache() for a new question, or "
                             f"cart.chat_prompt(messages, cache) to continue the conversation")
        if self.info.document_tokens < len(self.info.tokens):  # a saved conversation: a new user turn
            return followup_tokens(self.tokenizer, question, self.info.prompt_mode, self.info.separator,
                                   int(self.info.tokens[-1]))
        return question_tokens(self.tokenizer, question, self.info.prompt_mode, self.info.separator, self.info.system)

    def chat_prompt(self, messages, cache=None):
        """Tokens that continue a conversation about the document in `cache`.

        The conversation is rendered whole by the model's chat template (the first user turn follows
        the document as in `question_prompt`). With a cache that already holds earlier turns, the cache
        is trimmed back to what this rendering shares with the tokens fed before (dropping the tokens
        generated since, whose text comes back as the assistant turn), and only the rest is returned.
        So a multi-turn chat on one cache holds exactly the tokens of a fresh prefill of the whole
        rendered conversation.

        Args:
            messages (list[dict]): OpenAI-style {"role", "content"} turns after the document, ending
                with a user turn.
            cache (PromptCache | None): a cache from `prompt_cache()` to continue; None means a fresh
                one (the returned tokens then follow the document). Default: None.

        Returns:
            list[int]: pass as `prompt` to `mlx_lm.generate` / `stream_generate` with `cache`.

        Raises:
            InputError: bad messages, a system message the template puts before the document that is not
                the one the cartridge was built with (`info.system`; a conversation without one is
                answered under it), or a cache that did not come from this cartridge's `prompt_cache()`.

        Example:
            >>> cache = cart.prompt_cache()  # doctest: +SKIP
            >>> messages = [{"role": "user", "content": "Who is the shipping manager?"}]
            >>> answer = mlx_lm.generate(cart.model, cart.tokenizer, cart.chat_prompt(messages, cache),
            ...                          prompt_cache=cache)  # doctest: +SKIP
            >>> messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And..."}]
        """
        if self.info.document_tokens < len(self.info.tokens):
            raise InputError(f"{self.path} holds a saved conversation: continue it one turn at a time with "
                             f"question_prompt (chat_prompt renders conversations from the bare document)")
        full = conversation_tokens(self.tokenizer, messages, self.info.prompt_mode, self.info.separator,
                                   self.info.system)
        if cache is None:
            return full
        if not isinstance(cache, PromptCache) or cache.prefix_tokens != len(self.info.tokens):
            raise InputError("chat_prompt needs a cache made by this cartridge's prompt_cache()")
        common = 0
        for a, b in zip(cache.tokens, full):
            if a != b:
                break
            common += 1
        common = min(common, len(full) - 1)  # feed at least one token: its logits start the answer
        if not self._trimmable():  # a window or recurrent state cannot step back: start again
            common = 0
            self.reset(cache)
        cache.trim_tail(common)
        cache.tokens = list(full)
        return full[common:]

    def _trimmable(self):
        """True if every layer's tail can be trimmed back (page-attended and dense layers)."""
        return all(trimmable(p) for p in self._prefixes)

    def reset(self, cache):
        """Empty the tail of a cache from `prompt_cache()`: it holds the bare document again.

        Args:
            cache (list): a cache from `prompt_cache()`.
        """
        for i, (c, layer) in enumerate(zip(cache, self._prefixes)):
            if is_paged(layer) or layer.kind == "dense":
                c.trim(max(0, c.offset - len(self.info.tokens)))
            else:  # a window, recurrent state or list of caches: a fresh copy of the stored one
                cache[i] = layer.cache()
        if isinstance(cache, PromptCache):
            cache.tokens = []

    def save(self, path, cache, tokens=None, force=False):
        """Write this cartridge's prefix + the turns `cache` holds as a new cartridge (`cartridge.extend.save`).

        Example:
            >>> cache = cart.prompt_cache()  # doctest: +SKIP
            >>> answer = [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, prompt,
            ...                                                  prompt_cache=cache)]  # doctest: +SKIP
            >>> cart.save("chat.cart", cache, tokens=prompt + answer)  # doctest: +SKIP
        """
        from .extend import save  # extend builds on load

        return save(self, path, cache, tokens, force)

    def prompt_cache(self):
        """A fresh mlx-lm cache list: the shared prefix (never mutated) plus an empty tail per layer.

        Returns:
            PromptCache: a list of one cache per layer, for `mlx_lm.generate(prompt_cache=...)`.
        """
        route.install()
        return PromptCache([fresh_cache(p) for p in self._prefixes], len(self.info.tokens))


class PromptCache(list):
    """The per-layer caches of one conversation (an mlx-lm prompt cache: a list), plus the token ids fed
    after the document by `Cartridge.chat_prompt` (the tail also holds the tokens generated since).

    Attributes:
        tokens (list[int]): tokens known to follow the document in every layer's tail, in order.
        prefix_tokens (int): tokens of the document prefix.
    """

    def __init__(self, caches, prefix_tokens):
        super().__init__(caches)
        self.tokens = []
        self.prefix_tokens = prefix_tokens

    def trim_tail(self, keep):
        """Drop every tail token after the first `keep` (generated ones included)."""
        for c in (leaf for layer in self for leaf in getattr(layer, "caches", (layer,))):
            if keep or hasattr(c, "offset"):  # a fresh recurrent state (reset) holds nothing to trim
                c.trim(max(0, c.offset - self.prefix_tokens - keep))


def _head_dims(meta):
    """(K head_dim, V head_dim) of a layer, (None, None) for a state, a list of them for a list layer."""
    if meta.kind == "list":
        return [_head_dims(u) for u in meta.parts]
    return (meta.k_shape[1], meta.v_shape[1]) if meta.k_shape else (None, None)


def _model_dtype(model):
    """Activation dtype of an mlx-lm model: the dtype of its first norm weight (float32 if none)."""
    for _, w in tree_flatten(model.parameters()):
        if w.dtype in (mx.float32, mx.float16, mx.bfloat16):
            return w.dtype
    return mx.float32


def load(path, model=None, tokenizer=None, verify="pages", attention="auto", group=None, recompute=16,
         max_memory=None):
    """Load a cartridge, or several laid out one after another (`cartridge.compose`).

    Args:
        path (str | Path | list): cartridge directory; a list of them composes the documents in order.
        model (str | nn.Module | LoadedModel | None): the model to answer with: a model reference
            ("default", a GGUF file, an mlx-lm folder), a loaded model, or None for the one the
            cartridge records. Default: None.
        tokenizer: the model's tokenizer, required with an `nn.Module` model. Default: None.
        verify (str): "pages" checks every page checksum (default); "header" skips them.
        attention (str): "auto" (default), "fused", "portable" or "dequantize-once"
            (`cartridge.attention.policy`).
        group (mx.distributed.Group | None): under `mlx.launch`, the ranks; each maps only the KV heads
            or layers its sharded model runs and all agree before answering
            (`cartridge.distributed.load_sharded`, docs/distributed.md). Default: None (one process).
        recompute (int): with a list: document tokens of each later cartridge prefilled again over
            the ones before it. Default: 16.
        max_memory (int | None): the most bytes the prefix may hold in memory, while loading and after
            (stored pages, pages decoded to dense, one decode's buffers). Layers whose policy is
            dequantize-once decode only the sides that fit; the rest read their stored pages. None: for
            "auto", the stored bytes x 1.25 + one decoded layer; for a named policy, no limit.
            Default: None.

    Returns:
        Cartridge (ComposedCartridge for a list)

    Raises:
        CartridgeError subclasses: a failed check, a model whose fingerprint differs
        (ModelMismatchError), a model that cannot be loaded (ModelLoadError).

    Example:
        >>> cart = cartridge.load("gpl.cart")  # doctest: +SKIP
        >>> mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("Who may copy it?"),
        ...                 prompt_cache=cart.prompt_cache(), max_tokens=50)  # doctest: +SKIP
    """
    if max_memory is not None and (isinstance(max_memory, bool) or not isinstance(max_memory, int) or max_memory < 1):
        raise InputError(f"max_memory {max_memory!r}: give a positive whole number of bytes")
    if isinstance(path, (list, tuple)):
        from .compose import compose  # compose builds on load

        if model is None and path:
            first = load(path[0], verify=verify, attention=attention, max_memory=max_memory)
            model, tokenizer = first.model, first.tokenizer
        carts = [load(p, model, tokenizer, verify, attention, max_memory=max_memory) for p in path]
        return compose(carts, recompute)
    if group is not None:
        from .distributed import load_sharded

        return load_sharded(path, model, tokenizer, group, verify, attention)
    t0 = time.perf_counter()
    policy = resolve(attention)
    info, data = open_cartridge(path, verify)
    if model is None or isinstance(model, str):  # None: the model the cartridge records
        ref = info.model_ref if model is None else model
        model = load_model(ref if ref != DEFAULT_MODEL else None)
    ref = model.ref if isinstance(model, LoadedModel) else None
    if isinstance(model, LoadedModel):
        model, tokenizer = model.model, model.tokenizer
    elif tokenizer is None:
        raise InputError("pass the model's tokenizer together with the model (or a LoadedModel, or a model "
                         "reference such as \"default\")")
    check_fingerprint(info, model_fingerprint(model, tokenizer), path, ref)
    prefixes = [_layer(info, data, i) for i in range(info.n_layers)]
    head_dims = [_head_dims(m) for m in info.layers]
    prefixes, plan = place(prefixes, policy, _model_dtype(model), head_dims, max_memory)
    cart = Cartridge(Path(path), info, model, tokenizer, prefixes, time.perf_counter() - t0, plan["policy"], plan)
    cart._data = data  # keeps the mapping alive where MLX wrapped it without a copy
    return cart
