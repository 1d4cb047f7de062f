"""`PromptCache`: the per-layer caches of one conversation over a loaded cartridge (an mlx-lm prompt cache: a
list of caches, one per layer, each of its layer's kind), made by `Cartridge.prompt_cache()`."""


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
