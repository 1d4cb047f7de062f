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
from .attention.policy import prepare, resolve
from .errors import InputError, ModelMismatchError
from .format.header import SIDES
from .format.reader import open_cartridge
from .models.loader import DEFAULT_MODEL, LoadedModel, fingerprint, load_model
from .models.prompt import conversation_tokens, question_tokens
from .tiers import TIERS, protect


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


def _layer_prefix(info, data, layer):
    parts = {}
    for side in SIDES:
        arrays = {}
        for extent in info.extents[(layer, side)]:
            view = data.view(extent, "<u2" if extent.dtype == "bfloat16" else extent.dtype)
            arr = mx.asarray(view)  # zero-copy where MLX can wrap host memory, one copy otherwise
            arrays[extent.component] = arr.view(mx.bfloat16) if extent.dtype == "bfloat16" else arr
        parts[side] = arrays
    tier = info.tiers[layer]
    return LayerPrefix(TIERS[tier["k"]], parts["k"], TIERS[tier["v"]], parts["v"], len(info.tokens),
                       info.params[(layer, "k")], info.params[(layer, "v")],
                       protected=protect.layer_protected(info, layer))


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

    def question_prompt(self, question, cache=None):
        """Tokens to feed after the prefix: separator, question, end of turn, assistant header.

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
        if cache is not None and cache[0].offset > len(self.info.tokens):
            held = cache[0].offset - len(self.info.tokens)
            raise InputError(f"this cache already holds {held} tokens after the document; call "
                             f"cart.reset(cache) or use cart.prompt_cache() for a new question, or "
                             f"cart.chat_prompt(messages, cache) to continue the conversation")
        return question_tokens(self.tokenizer, question, self.info.prompt_mode, self.info.separator)

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
            InputError: bad messages, a system message the template puts before the document, or a
                cache that did not come from this cartridge's `prompt_cache()`.

        Example:
            >>> cache = cart.prompt_cache()  # doctest: +SKIP
            >>> messages = [{"role": "user", "content": "Who is the shipping manager?"}]
            >>> answer = mlx_lm.generate(cart.model, cart.tokenizer, cart.chat_prompt(messages, cache),
            ...                          prompt_cache=cache)  # doctest: +SKIP
            >>> messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And..."}]
        """
        full = conversation_tokens(self.tokenizer, messages, self.info.prompt_mode, self.info.separator)
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
        cache.trim_tail(common)
        cache.tokens = list(full)
        return full[common:]

    def reset(self, cache):
        """Empty the tail of a cache from `prompt_cache()`: it holds the bare document again.

        Args:
            cache (list): a cache from `prompt_cache()`.
        """
        for c in cache:
            c.trim(max(0, c.offset - len(self.info.tokens)))
        if isinstance(cache, PromptCache):
            cache.tokens = []

    def prompt_cache(self):
        """A fresh mlx-lm cache list: the shared prefix (never mutated) plus an empty tail per layer.

        Returns:
            PromptCache: a list of one cache per layer, for `mlx_lm.generate(prompt_cache=...)`.
        """
        route.install()
        return PromptCache([CartridgeCache(p) for p in self._prefixes], len(self.info.tokens))


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
        for c in self:
            c.trim(max(0, c.offset - self.prefix_tokens - keep))


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
    prefixes = [_layer_prefix(info, data, i) for i in range(info.n_layers)]
    prefixes = prepare(prefixes, policy, _model_dtype(model), info.head_dim)
    cart = Cartridge(Path(path), info, model, tokenizer, prefixes, time.perf_counter() - t0, policy)
    cart._data = data  # keeps the mapping alive where MLX wrapped it without a copy
    return cart
