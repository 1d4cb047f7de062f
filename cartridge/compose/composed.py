"""Several cartridges in one context: documents built separately, laid out one after another.

    a.tokens | separator + first N doc tokens of b (recomputed over a) | rest of b (stored) | question
    position 0 ..                                                        shift b by Δ_b

Stored keys carry their rotary positions (spec/FORMAT.md 5.1, `cache.rope = "post"`). Instead of
rewriting them, a later document's part is attended with the query rotated back by its shift Δ
(RoPE is a rotation: q·R(Δ)k = R(−Δ)q·k), one part per document, merged by log-sum-exp with the
recomputed tokens and the tail. Each later document was built without seeing the earlier ones and
opens with its own chat-template header: the header is skipped, and the separator plus its first N
document tokens are prefilled again over what precedes them (EPIC's LegoLink recomputes ~16-32 tokens
per chunk); N is `recompute`. Beyond them, `recompute_ratio` recomputes the stored tokens whose K/V moved
most (CacheBlend's selective recompute, `cartridge.compose.blend`): patches at their true positions (`BlendCache`),
their stored copies masked out of the part (`Part.skip`). The caches of a composed context, `ComposedCache` and
`BlendCache`, are in `cartridge.attention.caches`.
"""

import time
from dataclasses import replace

import mlx.core as mx

from . import blend
from ..attention import route
from ..attention.caches import BlendCache, ComposedCache, Part
from ..errors import InputError
from ..format.header import require_attention_layers
from ..models.prompt import SEPARATOR, encode_text, prompt_pieces, question_tokens

DEFAULT_RECOMPUTE = 16
DEFAULT_RECOMPUTE_RATIO = 0.0  # 0.2 raised BLEU on two pairs, on one within noise (docs/evaluation.md)
MAX_BOUNDARY_SHIFT = 64  # stored tokens a seam may move on to find ids that tokenize back unchanged


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
    ids = encode_text(tokenizer, tokenizer.decode(left) + separator + tokenizer.decode(right), False)
    if ids[: len(left)] == left and ids[len(ids) - len(right):] == right and len(ids) > len(left) + len(right):
        return ids[len(left): len(ids) - len(right)]
    return encode_text(tokenizer, separator, False)


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
        ids = encode_text(tokenizer, tokenizer.decode(left) + separator + text + tokenizer.decode(right), False)
        if ids[: len(left)] == left and ids[len(ids) - len(right):] == right and len(ids) > len(left) + len(right):
            return start, ids[len(left): len(ids) - len(right)]
    sep = separator_tokens(tokenizer, before, separator, stored[len(head):])
    text = tokenizer.decode(list(stored[common:first]))[len(header_text):]
    return first, sep + (stored[len(head):first] if common == len(head) else encode_text(tokenizer, text, False))


class ComposedCartridge:
    """Loaded cartridges laid out one after another; used like a `Cartridge`.

    Attributes:
        model, tokenizer: what to generate with. carts (list[Cartridge]): the parts.
        tokens (list[int]): the composed context's token ids. recompute (int): N.
        recompute_ratio (float): CacheBlend's recomputed fraction. select_layer (int): the layer whose deviation selects.
        selection (str): "attention" (deviation x the probe's attention mass) or "deviation" (`compose`).
        blended (list[dict]): per later document: "fresh" (separator + boundary tokens prefilled), "read"
            (tokens read from its pages), "selected" (of those, recomputed), "positions" (their composed
            positions), "select_s" / "recompute_s" (seconds of the selection pass and of the recompute).
    """

    def __init__(self, carts, recompute, separator, recompute_ratio=0.0, select_layer=blend.DEFAULT_SELECT_LAYER,
                 selection=blend.DEFAULT_SELECTION):
        self.carts, self.recompute, self.selection = carts, recompute, selection
        self.recompute_ratio, self.select_layer, self.blended = recompute_ratio, select_layer, []
        self.model, self.tokenizer = carts[0].model, carts[0].tokenizer
        self.info, self.attention, self.plan = carts[-1].info, carts[0].attention, carts[0].plan
        self._ropes = blend.ropes(self.model)
        self._layers = [[Part(p, 0, 0)] for p in carts[0].prefixes]
        self._patches = [[] for _ in self._layers]
        self.tokens = list(carts[0].tokens)
        for cart in carts[1:]:
            self._append(cart, separator)

    def _append(self, cart, separator):
        head = encode_text(self.tokenizer, prompt_pieces(self.tokenizer, cart.info.prompt_mode, cart.info.separator,
                                               cart.info.system)[0], True)
        start, fresh = boundary_tokens(self.tokenizer, head, self.tokens[len(head):], separator, cart.tokens,
                                       self.recompute)
        caches = self.prompt_cache()
        if fresh:
            self.model(mx.array(fresh)[None], cache=caches)  # recompute over everything before them
        shift = len(self.tokens) + len(fresh) - start  # true position - stored position of token `start`
        read = cart.tokens[start:]
        for layer, cache in enumerate(caches):  # the boundary-only composition first: selection probes it
            if fresh:
                self._patches[layer].append(cache.tail_kv())
            if read:  # a part with no token left would have no key at all
                self._layers[layer].append(Part(replace(cart.prefixes[layer], backend=None), shift, start))
        mx.eval(self._patches)  # the recompute happens here, not in the first question's TTFT
        self.tokens += fresh + read
        t0 = time.perf_counter()
        selected = self._select(caches, cart, Part(cart.prefixes[self.select_layer], shift, start),
                                blend.recompute_count(self.recompute_ratio, len(fresh), len(read)))
        select_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        positions = [start + shift + i for i in selected]
        if selected:
            for parts in self._layers:
                parts[-1] = replace(parts[-1], skip=blend.skip_mask(parts[-1].prefix, [start + i for i in selected]))
            self._recompute([read[i] for i in selected], positions)
        self.blended.append({"fresh": len(fresh), "read": len(read), "selected": len(selected), "positions":
                             positions, "select_s": select_s, "recompute_s": time.perf_counter() - t0})

    def _select(self, caches, cart, part, k):
        """Indices into the tokens read from `cart`'s pages of the `k` to recompute, ascending: the top of their K/V
        deviation at `select_layer` after `caches` (separator and boundary prefilled), x the probe's mass (`selection`)."""
        if k in (0, len(cart.tokens) - part.start):  # none, or every one: nothing to choose
            return list(range(k))
        fresh = blend.fresh_layer_kv(self.model, caches, cart.tokens[part.start:], self.select_layer)
        scores = blend.deviation(fresh, blend.stored_kv(part, self._ropes[self.select_layer]))
        if self.selection == "attention":
            scores = scores * blend.probe_mass(self.model, self.prompt_cache(), self.question_prompt(blend.PROBE))
        return blend.select(scores, k)

    def _recompute(self, ids, positions):
        """Run the selected tokens through every layer (`BlendCache`); their K/V become patches."""
        at = mx.array(positions, dtype=mx.int32)
        caches = [BlendCache(parts, patches, len(self.tokens), rope, at)
                  for parts, patches, rope in zip(self._layers, self._patches, self._ropes)]
        for i in range(0, len(ids), blend.CHUNK):
            self.model(mx.array(ids[i:i + blend.CHUNK])[None], cache=caches)
            mx.eval([c.fresh for c in caches])
        for patches, cache in zip(self._patches, caches):
            patches.append(cache.fresh_kv())
        mx.eval(self._patches)

    def question_prompt(self, question, cache=None):
        """Tokens to feed after the composed context (as `Cartridge.question_prompt`; `cache` unchecked)."""
        return question_tokens(self.tokenizer, question, self.info.prompt_mode, self.info.separator, self.info.system)

    def prompt_cache(self):
        """A fresh cache list over the composed context."""
        route.install()
        return [ComposedCache(list(parts), list(patches), len(self.tokens), rope)  # copies: parts are appended
                for parts, patches, rope in zip(self._layers, self._patches, self._ropes)]


def compose(carts, recompute=DEFAULT_RECOMPUTE, separator=SEPARATOR, recompute_ratio=DEFAULT_RECOMPUTE_RATIO,
            select_layer=None, selection=blend.DEFAULT_SELECTION):
    """Lay loaded cartridges of one model out one after another.

    Args:
        carts (list[Cartridge]): at least two, same model (checked at load).
        recompute (int): document tokens of each later cartridge prefilled again over what precedes
            them (after the separator, which always is). Default: 16.
        separator (str): text between documents. Default: "\\n\\n".
        recompute_ratio (float): in [0, 1]: the fraction of each later document's composed tokens (separator
            and the `recompute` boundary tokens counted in) recomputed; beyond the boundary, the stored tokens
            whose K/V at `select_layer` deviate most when prefilled after what precedes them (CacheBlend,
            arXiv:2405.16444 section 4; `cartridge.blend`). 0: the boundary only; 1: all (a fresh prefill).
            Default: DEFAULT_RECOMPUTE_RATIO.
        select_layer (int | None): the layer whose K/V deviation selects the tokens (the paper's is 1). Default:
            None, blend.DEFAULT_SELECT_LAYER or the model's last layer if it has fewer.
        selection (str): "attention": that deviation times the attention mass a generic probe question puts on
            each token over the boundary-only composition (`blend.probe_mass`); "deviation": the deviation alone
            (the paper's). Default: blend.DEFAULT_SELECTION.

    Returns:
        ComposedCartridge

    Raises:
        InputError: fewer than two cartridges, different models, a negative `recompute`, a
            `recompute_ratio` outside [0, 1] or NaN, a `select_layer` not a layer, an unknown `selection`, a conversation
            cartridge (`Cartridge.save`).
    """
    if len(carts) < 2:
        raise InputError("compose needs at least two cartridges")
    if isinstance(recompute, bool) or not isinstance(recompute, int) or recompute < 0:
        raise InputError(f"recompute is {recompute!r}; it must be a whole number of tokens >= 0")
    blend.check_ratio(recompute_ratio)
    n_layers = len(carts[0].prefixes)
    select_layer = min(blend.DEFAULT_SELECT_LAYER, n_layers - 1) if select_layer is None else select_layer
    if isinstance(select_layer, bool) or not isinstance(select_layer, int) or not 0 <= select_layer < n_layers:
        raise InputError(f"select_layer is {select_layer!r}; the model's layers are 0..{n_layers - 1}")
    if selection not in blend.SELECTIONS:
        raise InputError(f"selection is {selection!r}; it must be one of {', '.join(blend.SELECTIONS)}")
    for c in carts:
        require_attention_layers(c.info, "compose")  # K stored scaled: each part's queries carry its scale
        if c.info.document_tokens != len(c.info.tokens):  # its turns would be laid in as document text
            raise InputError(f"cartridge {c.path} holds a conversation after its document (tokens "
                             f"{c.info.document_tokens}..{len(c.info.tokens)}); compose the document's cartridge")
    ids = {c.info.fingerprint["id"] for c in carts}
    if len(ids) != 1:
        raise InputError(f"the cartridges were built with {len(ids)} different models; compose needs one")
    return ComposedCartridge(carts, recompute, separator, recompute_ratio, select_layer, selection)
