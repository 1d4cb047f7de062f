"""Several cartridges in one context: documents built separately, laid out one after another.

    a.tokens | separator + first N doc tokens of b (recomputed over a) | rest of b (stored) | question
    position 0 ..                                                        shift b by Δ_b

Stored keys carry their rotary positions (spec/FORMAT.md 5.1, `cache.rope = "post"`). Instead of
rewriting them, a later document's part is attended with the query rotated back by its shift Δ
(RoPE is a rotation: q·R(Δ)k = R(−Δ)q·k), one part per document, merged by log-sum-exp with the
recomputed tokens and the tail. Each later document was built without seeing the earlier ones and
opens with its own chat-template header: the header is skipped, and the separator plus its first N
document tokens are prefilled again over what precedes them (EPIC's LegoLink recomputes ~16-32 tokens
per chunk); N is `recompute`.
"""

from dataclasses import dataclass, replace

import mlx.core as mx

from .attention import route
from .attention.cache import CartridgeCache, sink_partial
from .attention.kernels import merge, tail_partial
from .errors import CartridgeError, InputError
from .format.header import require_attention_layers
from .models.prompt import SEPARATOR, _encode, _pieces, question_tokens

DEFAULT_RECOMPUTE = 16
MAX_BOUNDARY_SHIFT = 64  # stored tokens a seam may move on to find ids that tokenize back unchanged


@dataclass(frozen=True)
class Part:
    """A stored prefix attended in a composed context.

    Attributes:
        prefix (LayerPrefix): one layer's stored pages. shift (int): Δ, true position - stored position.
        start (int): first stored token attended (those before it are skipped or recomputed).
    """

    prefix: object
    shift: int
    start: int


def _part_partial(q, part):
    """Attention partial over stored tokens [start, n_tokens) of one part (`kernels.portable.prefix_partial`)."""
    p = part.prefix
    s = p.k_codec.scores(q, p.k_parts, p.k_params)  # (n_pages, n_kv, R, P)
    n_pages, _, _, page = s.shape
    pos = mx.arange(n_pages * page).reshape(n_pages, 1, 1, page)
    s = mx.where((pos >= part.start) & (pos < p.n_tokens), s, -mx.inf)
    m = s.max(axis=(0, 3))  # (n_kv, R)
    pr = mx.exp(s - m[None, :, :, None])
    return p.v_codec.weighted_values(pr, p.v_parts, p.v_params), m, pr.sum(axis=(0, 3))


class ComposedCache(CartridgeCache):
    """One layer's cache over several stored parts, recomputed dense K/V, and a dense tail.

    Args:
        parts (list[Part]): stored parts, each with its shift.
        patches (list[tuple]): recomputed (k, v), each (n_kv_heads, T, head_dim), at their true positions.
        length (int): tokens of the composed context before the tail.
        rope (callable): the layer's rotary embedding, called as rope(x, offset=...) (mlx-lm modules).
    """

    def __init__(self, parts, patches, length, rope, chunk_size=256):
        super().__init__(parts[0].prefix, chunk_size)
        self.parts, self.patches, self.length, self.rope = parts, patches, length, rope

    @property
    def offset(self):
        """Tokens held: composed context + tail (the position of the next token)."""
        return self.length + self.tail_len

    def _rotated(self, queries, shift):
        """Queries rotated by −shift, every row alike: (1, n_q, L, D) seen as (n_q * L, 1, D) positions."""
        if shift == 0:
            return queries
        _, n_q, L, D = queries.shape
        return self.rope(queries.reshape(n_q * L, 1, D), offset=-shift).reshape(1, n_q, L, D)

    def attention(self, queries, scale, mask=None, sinks=None):
        """Attention of `queries` over every part, patch and the tail (see `CartridgeCache.attention`;
        `sinks`, (n_q_heads,) sink logits, add one more logit per head).

        Raises:
            CartridgeError: for an array mask (composed contexts take None or "causal").
        """
        if mask is not None and not isinstance(mask, str):
            raise CartridgeError("array masks are not supported over composed cartridges")
        _, n_q, L, D = queries.shape
        n_kv = self.prefix.n_kv_heads
        group = n_q // n_kv

        def flat(x):  # (1, n_q, L, D) -> (n_kv, group * L, D), pre-scaled float32
            return (x.astype(mx.float32) * scale).reshape(n_kv, group * L, D)

        q = flat(queries)
        partials = [_part_partial(flat(self._rotated(queries.astype(mx.float32), p.shift)), p) for p in self.parts]
        partials += [tail_partial(q, k, v, True) for k, v in self.patches]
        keep = self._tail_keep(None, n_kv, group, L)
        start = 0
        for k, v in self._tail_parts():
            end = start + k.shape[1]
            partials.append(tail_partial(q, k, v, keep[..., start:end]))
            start = end
        if sinks is not None:
            partials.append(sink_partial(sinks, n_kv, L, D))
        # (n_kv, group * L, D) -> (1, n_q, L, D)
        return merge(partials).reshape(1, n_q, L, D).astype(queries.dtype)


def _ropes(model):
    try:
        return [layer.self_attn.rope for layer in model.layers]
    except AttributeError:
        raise InputError("this model's attention has no `rope` module; cartridges cannot be composed for it") from None


def separator_tokens(tokenizer, before, separator, after, context=8):
    """The separator's token ids as the tokenizer splits it between two documents' text.

    A byte-level BPE may split whitespace by what follows it ("\n\n" alone is one token, before a
    word two): the separator is encoded between the decoded last `context` tokens of `before` and
    first `context` tokens of `after`, and kept when those come back unchanged around it.

    Args:
        tokenizer: mlx-lm TokenizerWrapper or HF tokenizer. before, after (list[int]): document tokens
            on either side (without chat-template header). separator (str): text between them.
        context (int): tokens of each side decoded. Default: 8.

    Returns:
        list[int]: the separator's tokens in context; its tokens alone where the sides do not
        tokenize back unchanged.
    """
    left, right = list(before[-context:]), list(after[:context])
    ids = _encode(tokenizer, tokenizer.decode(left) + separator + tokenizer.decode(right), False)
    if ids[: len(left)] == left and ids[len(ids) - len(right):] == right and len(ids) > len(left) + len(right):
        return ids[len(left): len(ids) - len(right)]
    return _encode(tokenizer, separator, False)


def _common_length(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def boundary_tokens(tokenizer, head, before, separator, stored, recompute, context=8):
    """Where a later document's stored tokens start to be read, and the token ids prefilled before them.

    The stored cartridge opens with the chat template's header `head`, except that a document starting
    with whitespace merges into the header's last token(s) (byte-level BPE joins "\n" + "\n"). The
    document's first tokens are recomputed anyway: their text, without the header's, is re-tokenized with
    the separator between the decoded last `context` tokens before it and the first `context` stored tokens
    kept after it, so that the composed ids are those of the joined text. Where that context does not come
    back unchanged (the joined whitespace splits otherwise), the seam moves on one stored token at a time (at
    most `MAX_BOUNDARY_SHIFT`), and failing that the separator alone and the document's own tokens are used
    (or their text re-encoded, where the header merged into them).

    Args:
        tokenizer: mlx-lm TokenizerWrapper or HF tokenizer. head (list[int]): the header's token ids.
        before (list[int]): document tokens before the separator (without header).
        separator (str): text between documents. stored (list[int]): the later cartridge's token ids.
        recompute (int): document tokens after the header to prefill again. context (int): Default: 8.

    Returns:
        tuple: (start int: first stored token read from the pages, fresh list[int]: the separator's and the
        document's ids to prefill in place of stored[:start] after `before`).

    Raises:
        InputError: the stored ids do not decode to the header's text followed by the document's.
    """
    common = _common_length(head, stored)
    opened = len(head) if common == len(head) else common + 1  # a merged token holds header and document text
    first = min(opened + recompute, len(stored))
    header_text = tokenizer.decode(list(head[common:]))
    left = list(before[-context:])
    for start in range(first, min(first + MAX_BOUNDARY_SHIFT, len(stored)) + 1):  # until the seam is stable
        text = tokenizer.decode(list(stored[common:start]))
        if common == len(stored) or not text.startswith(header_text):
            raise InputError("the cartridge's token ids do not open with the chat template's header followed by "
                             "its document; cannot compose it")
        text, right = text[len(header_text):], list(stored[start:start + context])
        ids = _encode(tokenizer, tokenizer.decode(left) + separator + text + tokenizer.decode(right), False)
        if ids[: len(left)] == left and ids[len(ids) - len(right):] == right and len(ids) > len(left) + len(right):
            return start, ids[len(left): len(ids) - len(right)]
    sep = separator_tokens(tokenizer, before, separator, stored[len(head):])
    text = tokenizer.decode(list(stored[common:first]))[len(header_text):]
    return first, sep + (stored[len(head):first] if common == len(head) else _encode(tokenizer, text, False))


class ComposedCartridge:
    """Loaded cartridges laid out one after another; used like a `Cartridge`.

    Attributes:
        model, tokenizer: what to generate with. carts (list[Cartridge]): the parts.
        tokens (list[int]): the composed context's token ids. recompute (int): N.
    """

    def __init__(self, carts, recompute, separator):
        self.carts, self.recompute = carts, recompute
        self.model, self.tokenizer = carts[0].model, carts[0].tokenizer
        self.info, self.attention, self.plan = carts[-1].info, carts[0].attention, carts[0].plan
        self._ropes = _ropes(self.model)
        self._layers = [[Part(p, 0, 0)] for p in carts[0]._prefixes]
        self._patches = [[] for _ in self._layers]
        self.tokens = list(carts[0].tokens)
        for cart in carts[1:]:
            self._append(cart, separator)

    def _append(self, cart, separator):
        head = _encode(self.tokenizer, _pieces(self.tokenizer, cart.info.prompt_mode, cart.info.separator,
                                               cart.info.system)[0], True)
        start, fresh = boundary_tokens(self.tokenizer, head, self.tokens[len(head):], separator, cart.tokens,
                                       self.recompute)
        caches = self.prompt_cache()
        if fresh:
            self.model(mx.array(fresh)[None], cache=caches)  # recompute over everything before them
        shift = len(self.tokens) + len(fresh) - start  # true position - stored position of token `start`
        for layer, cache in enumerate(caches):
            if fresh:
                self._patches[layer].append(cache.tail_kv())
            if start < len(cart.tokens):  # a part with no token left would have no key at all
                self._layers[layer].append(Part(replace(cart._prefixes[layer], kernel=None), shift, start))
        self.tokens += fresh + cart.tokens[start:]
        mx.eval(self._patches)  # the recompute happens here, not in the first question's TTFT

    def question_prompt(self, question, cache=None):
        """Tokens to feed after the composed context (as `Cartridge.question_prompt`; `cache` unchecked)."""
        return question_tokens(self.tokenizer, question, self.info.prompt_mode, self.info.separator, self.info.system)

    def prompt_cache(self):
        """A fresh cache list over the composed context."""
        route.install()
        return [ComposedCache(parts, patches, len(self.tokens), rope)
                for parts, patches, rope in zip(self._layers, self._patches, self._ropes)]


def compose(carts, recompute=DEFAULT_RECOMPUTE, separator=SEPARATOR):
    """Lay loaded cartridges of one model out one after another.

    Args:
        carts (list[Cartridge]): at least two, same model (checked at load).
        recompute (int): document tokens of each later cartridge prefilled again over what precedes
            them (after the separator, which always is). Default: 16.
        separator (str): text between documents. Default: "\\n\\n".

    Returns:
        ComposedCartridge

    Raises:
        InputError: fewer than two cartridges, different models, a negative `recompute`, a conversation
            cartridge (`Cartridge.save`).
    """
    if len(carts) < 2:
        raise InputError("compose needs at least two cartridges")
    if isinstance(recompute, bool) or not isinstance(recompute, int) or recompute < 0:
        raise InputError(f"recompute is {recompute!r}; it must be a whole number of tokens >= 0")
    for c in carts:
        require_attention_layers(c.info, "compose")
        if c.info.document_tokens != len(c.info.tokens):  # its turns would be laid in as document text
            raise InputError(f"cartridge {c.path} holds a conversation after its document (tokens "
                             f"{c.info.document_tokens}..{len(c.info.tokens)}); compose the document's cartridge")
    ids = {c.info.fingerprint["id"] for c in carts}
    if len(ids) != 1:
        raise InputError(f"the cartridges were built with {len(ids)} different models; compose needs one")
    return ComposedCartridge(carts, recompute, separator)
