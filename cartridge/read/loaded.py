"""A loaded cartridge (`Cartridge`: model, tokenizer, the shared read-only prefix) and the caches of one
conversation over it (a `PromptCache`, `cartridge.attention.caches`). `cartridge.load` makes them; `distributed`
subclasses `Cartridge`.
"""

from ..write.append import save
from ..attention import route
from ..attention.caches import PromptCache
from ..attention.layers import cache_offset, fresh_cache, trimmable, trims
from ..errors import InputError
from ..models.prompt import conversation_tokens, followup_tokens, question_tokens


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
        prefixes (list[LayerPrefix | layer]): the stored prefix of every layer, in layer order, as `place`
            made it: what each conversation's caches (`prompt_cache`) share, read-only.
        data (PageData | None): the opened page data the prefixes were read from (`load` sets it): kept
            alive with the cartridge, since MLX may wrap the mapped bytes without a copy, and read by
            `append.save` for the stored pages it copies.
    """

    def __init__(self, path, info, model, tokenizer, prefixes, load_seconds, attention="portable", plan=None):
        self.path, self.info, self.model, self.tokenizer = path, info, model, tokenizer
        self.prefixes = prefixes
        self.data = None
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
        return all(trimmable(p) for p in self.prefixes)

    def reset(self, cache):
        """Empty the tail of a cache from `prompt_cache()`: it holds the bare document again.

        Args:
            cache (list): a cache from `prompt_cache()`.
        """
        for i, (c, layer) in enumerate(zip(cache, self.prefixes)):
            if trims(layer):
                c.trim(max(0, c.offset - len(self.info.tokens)))
            else:  # a window, recurrent state or list of caches: a fresh copy of the stored one
                cache[i] = layer.cache()
        if isinstance(cache, PromptCache):
            cache.tokens = []

    def save(self, path, cache, tokens=None, force=False):
        """Write this cartridge's prefix + the turns `cache` holds as a new cartridge (`cartridge.write.append.save`).

        Example:
            >>> cache = cart.prompt_cache()  # doctest: +SKIP
            >>> answer = [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, prompt,
            ...                                                  prompt_cache=cache)]  # doctest: +SKIP
            >>> cart.save("chat.cart", cache, tokens=prompt + answer)  # doctest: +SKIP
        """
        return save(self, path, cache, tokens, force)

    def prompt_cache(self):
        """A fresh mlx-lm cache list: the shared prefix (never mutated) plus an empty tail per layer.

        Returns:
            PromptCache: a list of one cache per layer, for `mlx_lm.generate(prompt_cache=...)`.
        """
        route.install()
        return PromptCache([fresh_cache(p) for p in self.prefixes], len(self.info.tokens))
