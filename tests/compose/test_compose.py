"""Composed cartridges: a later document attended with the query rotated back by its shift equals
attention over its keys moved to their true positions; recomputing all of it equals a fresh prefill."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from helpers.compose_cases import DOC_A, DOC_B, Q, _logits
from mlx_lm.models.cache import KVCache, make_prompt_cache

from cartridge.compose.composed import compose, separator_tokens
from cartridge.errors import InputError
from cartridge.models.prompt import SEPARATOR, encode_text, prompt_pieces, prefix_tokens


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("compose")
    cartridge.build(DOC_A, d / "a.cart", model=tiny, page_size=16)
    cartridge.build(DOC_B, d / "b.cart", model=tiny, page_size=16)
    return [cartridge.load(d / n, model=tiny) for n in ("a.cart", "b.cart")]


def _stored(prefix, side):
    """(n_kv, n_tokens, D) float32 of a loaded prefix."""
    codec, parts, params = ((prefix.k_codec, prefix.k_parts, prefix.k_params) if side == "k"
                            else (prefix.v_codec, prefix.v_parts, prefix.v_params))
    x = codec.decode(parts, params)  # (n_pages, n_kv, P, D)
    return x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[:, : prefix.n_tokens]


def test_composed_tokens(pair, tiny):
    """The layout is the token ids of the one-shot text a + separator + b: "\n\n" before a word is
    two tokens ("\n", "\n") there, not the one token it is alone."""
    a, b = pair
    tok = tiny.tokenizer
    head = encode_text(tok, prompt_pieces(tok, b.info.prompt_mode, b.info.separator)[0], True)
    sep = separator_tokens(tok, a.tokens[len(head):], SEPARATOR, b.tokens[len(head):])
    assert sep == encode_text(tok, "\n", False) * 2 and encode_text(tok, SEPARATOR, False) != sep
    for n in (0, 5):
        c = compose(pair, recompute=n)
        assert c.tokens == a.tokens + sep + b.tokens[len(head):]
        assert c.tokens == prefix_tokens(tok, DOC_A.rstrip() + SEPARATOR + DOC_B)
        assert c._patches[0][0][0].shape[1] == len(sep) + n
        assert c._layers[0][1].start == len(head) + n and c._layers[0][1].shift == len(a.tokens) + len(sep) - len(head)


def test_separator_tokens_in_context(tiny):
    tok = tiny.tokenizer
    four, word = encode_text(tok, "4. Combined", False), encode_text(tok, "Annex B.", False)
    end = encode_text(tok, "the end.", False)
    assert separator_tokens(tok, end, SEPARATOR, four) == encode_text(tok, SEPARATOR, False)  # one token before a digit
    assert separator_tokens(tok, end, SEPARATOR, word) == encode_text(tok, "\n", False) * 2
    assert separator_tokens(tok, [], SEPARATOR, []) == encode_text(tok, SEPARATOR, False)


def test_rotated_query_equals_keys_moved_to_their_positions(pair, tiny):
    """recompute=0: the reference is mlx-lm's own KVCache holding a's keys, the separator's and b's
    stored keys rotated forward by b's shift; the question's logits agree."""
    a, b = pair
    c = compose(pair, recompute=0)
    ref = []
    for layer, rope in enumerate(c._ropes):
        pb = c._layers[layer][1]
        kb = _stored(pb.prefix, "k")[:, pb.start:]
        n_kv, T, D = kb.shape
        kb = rope(kb.reshape(n_kv * T, 1, D), offset=pb.shift).reshape(n_kv, T, D)  # (n_kv, T, D) moved by Δ
        pk, pv = c._patches[layer][0]
        k = mx.concatenate([_stored(a.prefixes[layer], "k"), pk.astype(mx.float32), kb], axis=1)
        v = mx.concatenate([_stored(a.prefixes[layer], "v"), pv.astype(mx.float32), _stored(pb.prefix, "v")[:, pb.start:]], axis=1)
        cache = KVCache()
        cache.update_and_fetch(k[None], v[None])
        ref.append(cache)
    q = c.question_prompt(Q)
    np.testing.assert_allclose(_logits(tiny.model, q, c.prompt_cache()), _logits(tiny.model, q, ref), atol=1e-4)


def test_recomputing_all_of_b_equals_a_fresh_prefill(pair, tiny):
    c = compose(pair, recompute=10_000)
    assert len(c._layers[0]) == 1  # nothing of b is read from its pages
    q = c.question_prompt(Q)
    got = _logits(tiny.model, q, c.prompt_cache())
    want = _logits(tiny.model, c.tokens + q, make_prompt_cache(tiny.model))
    np.testing.assert_allclose(got, want, atol=2e-3)


def test_load_list_composes(pair, tiny):
    a, b = pair
    c = cartridge.load([a.path, b.path], model=tiny, recompute=4)
    assert c.tokens == compose(pair, recompute=4).tokens


def test_load_list_without_model_opens_each_cartridge_once(tiny_dir, tmp_path, monkeypatch):
    import importlib

    load_module = importlib.import_module("cartridge.read.load")
    for name, doc in (("a", DOC_A), ("b", DOC_B)):
        cartridge.build(doc, tmp_path / f"{name}.cart", model=str(tiny_dir), page_size=16)
    opened, models = [], []
    real_open, real_model = load_module.open_cartridge, load_module.load_recorded_model
    monkeypatch.setattr(load_module, "open_cartridge", lambda p, *a: opened.append(p) or real_open(p, *a))
    monkeypatch.setattr(load_module, "load_recorded_model", lambda *a: models.append(a) or real_model(*a))
    c = cartridge.load([tmp_path / "a.cart", tmp_path / "b.cart"], recompute=4)
    assert opened == [tmp_path / "a.cart", tmp_path / "b.cart"] and len(models) == 1
    assert [cart.path for cart in c.carts] == [tmp_path / "a.cart", tmp_path / "b.cart"]


def test_bad_compose_refused(pair):
    with pytest.raises(InputError, match="at least two"):
        compose(pair[:1])
    with pytest.raises(InputError, match="recompute is -1"):
        compose(pair, recompute=-1)


def test_conversation_cartridge_is_not_composed(pair, tiny, tmp_path):
    """A saved conversation's turns would be laid in as document text: refused in one line."""
    a = pair[0]
    cache = a.prompt_cache()
    prompt = a.question_prompt(Q)
    a.model(mx.array(prompt)[None], cache=cache)
    chat = cartridge.load(a.save(tmp_path / "chat.cart", cache, tokens=prompt).path, model=tiny)
    for carts in ([pair[0], chat], [chat, pair[1]]):
        with pytest.raises(InputError, match="holds a conversation after its document") as e:
            compose(carts)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("lead", ["\n", "  ", "\n\n  "])
def test_later_document_opening_with_whitespace_is_retokenized(pair, tiny, tmp_path, lead):
    """A document split off at a newline or an indent merges its whitespace into the chat template's last
    header token when built alone; composed, the boundary is re-tokenized: the ids are the joined text's."""
    a = pair[0]
    tok = tiny.tokenizer
    cartridge.build(lead + DOC_B, tmp_path / "b.cart", model=tiny, page_size=16)
    b = cartridge.load(tmp_path / "b.cart", model=tiny)
    joined = prefix_tokens(tok, DOC_A.rstrip() + SEPARATOR + lead + DOC_B)
    for n in (0, 5, 10_000):
        c = compose([a, b], recompute=n)
        assert c.tokens == joined
        assert c.tokens[30 - len(b.tokens):] == b.tokens[30:]  # after the boundary, b's own stored ids
    assert len(c._layers[0]) == 1  # recompute 10_000: nothing of b read from its pages
    q = c.question_prompt(Q)
    np.testing.assert_allclose(_logits(tiny.model, q, c.prompt_cache()),
                               _logits(tiny.model, c.tokens + q, make_prompt_cache(tiny.model)), atol=2e-3)


@pytest.mark.parametrize("lead", ["  ", "\n\n  "])
def test_whitespace_merge_the_stored_header_shows(pair, tiny, tmp_path, lead):
    """What made compose refuse before: the stored ids do not open with the header's own ids (its last token,
    "\n", and the indent are one token; a lone "\n" before a word is not merged)."""
    tok = tiny.tokenizer
    head = encode_text(tok, prompt_pieces(tok, pair[1].info.prompt_mode, pair[1].info.separator)[0], True)
    cartridge.build(lead + DOC_B, tmp_path / "b.cart", model=tiny, page_size=16)
    b = cartridge.load(tmp_path / "b.cart", model=tiny)
    assert b.tokens[: len(head)] != head


def test_recompute_zero_with_merged_header_reads_b_shifted(pair, tiny, tmp_path):
    """recompute 0: only the merged token(s) and the separator are prefilled; b's stored tokens after them are
    attended at their true positions (shift = composed position - stored position)."""
    a = pair[0]
    cartridge.build("  " + DOC_B, tmp_path / "b.cart", model=tiny, page_size=16)
    b = cartridge.load(tmp_path / "b.cart", model=tiny)
    c = compose([a, b], recompute=0)
    part = c._layers[0][1]
    fresh = c._patches[0][0][0].shape[1]
    assert c.tokens[len(a.tokens) + fresh:] == b.tokens[part.start:]
    assert part.shift == len(a.tokens) + fresh - part.start
