"""Gemma 3 270M's sliding-window layers (issue 47 item 2): 15 of its 18 layers attend to the last 512 tokens
only (full attention on layers 5, 11 and 17). A cartridge stores such a layer as its window and loads it back
into mlx-lm's own RotatingKVCache; these tests read that back across the window boundary.

Documents shorter than the window (300 tokens), one token either side of it (511, 512, 513) and longer than it
(1,400 tokens); questions that cross the boundary while they are prefilled (a 490-token document and a 40-token
question) and answers that cross it while they are generated (495 tokens, a short question, 30 answer
tokens). Each answer of an fp16 cartridge is token for token a fresh mlx-lm prefill's of the whole prompt; so
is the answer of mlx-lm's own caches filled with the same document (the harness's check). The header and
`cartridge inspect` say that each window layer stores exactly its window, and the loaded cache holds the
window's K/V of mlx-lm's own prefill.
"""

import json

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import numpy as np
import pytest
from helpers.clirun import run_inprocess
from helpers.samples import SAMPLE
from helpers.fresh_prefill import document_of, greedy, mlx_cache
from mlx_lm.models.cache import KVCache, RotatingKVCache

from cartridge.models.prompt import full_prompt_tokens

pytestmark = pytest.mark.slow

WINDOW, FULL_LAYERS = 512, (5, 11, 17)
SHORT_Q = "Who publishes revised versions of the license?"
# about 40 tokens: prefilled over a document of 490 tokens, the question crosses the window's end
LONG_Q = ("If I convey a combined work that uses the Library, which notices, copies of the license and source "
          "code must I give to the people who receive it, and in which form may they relink it?")
# (document tokens, question, answer tokens)
CASES = {"shorter": (300, SHORT_Q, 30), "window-1": (511, SHORT_Q, 8), "window": (512, SHORT_Q, 8),
         "window+1": (513, SHORT_Q, 8), "longer": (1400, SHORT_Q, 30), "question-crosses": (490, LONG_Q, 30),
         "answer-crosses": (495, SHORT_Q, 30)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, gemma_model, tmp_path_factory):
    """(case name, document, its fp16 cartridge loaded, question, answer tokens)."""
    n, question, answer = CASES[request.param]
    document = document_of(gemma_model.tokenizer, SAMPLE.read_text(), n)
    r = cartridge.build(document, tmp_path_factory.mktemp("win") / f"{request.param}.cart", model=gemma_model)
    assert r.tokens == n
    return request.param, document, cartridge.load(r.path, model=gemma_model), question, answer


def test_the_case_crosses_the_window_where_it_says(case, gemma_model):
    name, _, cart, question, answer = case
    n, q = len(cart.tokens), len(cart.question_prompt(question))
    where = {"question-crosses": n < WINDOW < n + q, "answer-crosses": n + q < WINDOW < n + q + answer,
             "shorter": n + q + answer < WINDOW, "longer": n > 2 * WINDOW}
    assert where.get(name, abs(n - WINDOW) <= 1)


def test_window_layers_store_their_window_and_the_others_every_token(case):
    _, _, cart, _, _ = case
    n = len(cart.tokens)
    for i, layer in enumerate(cart.info.layers):
        if i in FULL_LAYERS:
            assert (layer.kind, layer.start, layer.count) == ("attention", 0, n)
        else:
            assert (layer.kind, layer.window, layer.start, layer.count) == ("window", WINDOW, n - min(n, WINDOW),
                                                                             min(n, WINDOW))


def test_inspect_says_what_each_layer_stores(case):
    _, _, cart, _, _ = case
    r = run_inprocess("inspect", cart.path, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["layers"]
    n = len(cart.tokens)
    assert [(row["kind"], row["tokens"], row.get("start")) for row in rows] == [
        ("attention", n, None) if i in FULL_LAYERS else ("window", min(n, WINDOW), n - min(n, WINDOW))
        for i in range(18)]


def test_loaded_window_is_mlx_lm_s_own_prefill_window(case, gemma_model):
    """Each window layer's fresh cache is a RotatingKVCache of the window at offset n in temporal order, holding
    the K/V of mlx-lm's own prefill of the document (to fp16 rounding; the build prefilled 512 tokens at a time)."""
    _, _, cart, _, _ = case
    n = len(cart.tokens)
    fresh = mlx_cache(gemma_model.model, cart.tokens)
    for i, (got, want) in enumerate(zip(cart.prompt_cache(), fresh)):
        if i in FULL_LAYERS:
            assert isinstance(want, KVCache) and got.offset == n
            continue
        assert isinstance(got, RotatingKVCache) and (got.max_size, got.offset, got.keep) == (WINDOW, n, 0)
        kept = min(n, WINDOW)
        assert got.keys.shape[2] == got._idx == kept
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            b = np.array(b[:, :, -kept:])  # mlx-lm keeps every token of a one-pass prefill, the window last
            np.testing.assert_allclose(np.array(a), b, rtol=2e-3, atol=2e-3 * np.abs(b).max(), err_msg=f"layer {i}")


@pytest.mark.parametrize("source", ["mlx-lm-cache", "cartridge"])
def test_fp16_answer_is_a_fresh_prefill_s(case, gemma_model, source):
    """The answer after the document's cache equals mlx-lm's greedy answer from the whole prompt, first with
    mlx-lm's own caches filled with the document (the harness), then with the cartridge's."""
    _, document, cart, question, n = case
    tok = gemma_model.tokenizer
    full = full_prompt_tokens(tok, document, question)
    prompt = cart.question_prompt(question)
    assert cart.tokens + prompt == full
    cache = mlx_cache(gemma_model.model, cart.tokens) if source == "mlx-lm-cache" else cart.prompt_cache()
    got = greedy(cart.model, tok, prompt, n, cache)
    assert got == _fresh_answer(gemma_model, full, n) and len(got) == n


_ANSWERS = {}


def _fresh_answer(lm, full, n):
    """mlx-lm's greedy answer from the whole prompt, computed once per prompt."""
    key = (tuple(full), n)
    if key not in _ANSWERS:
        _ANSWERS[key] = greedy(lm.model, lm.tokenizer, full, n)
    return _ANSWERS[key]
