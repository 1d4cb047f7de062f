"""One cache under mlx-lm's own generation loops (issue 31 item 0): `generate_step` builds step n+1 before step
n is evaluated, on its own stream, and feeds a prompt as (all but one token) + 1. Turn after turn on ONE cache,
every tail length from 0 to past 1,100 tokens (the 256-token tail chunks crossed by single- and multi-token steps),
the log-probabilities it yields equal a fresh mlx-lm prefill of the same tokens over the same prefix K/V.

The reference is the model with mlx-lm's own KVCaches holding the cartridge's decoded prefix (its stored fp16 or
quantized values), fed the whole token stream the cartridge cache saw in one teacher-forced pass. Two checks more:
generate_step gives the same bits as a loop of the same ops evaluated one step at a time (so its pipeline and
stream change nothing), and turns on worker threads and on the main thread share one cache.
"""

import threading
from dataclasses import replace

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers.tiny_models import make_tiny
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from cartridge.attention import contiguous

DOC = "The ferry to Inishmore leaves Rossaveal at 10:30 and returns at 17:00 daily in summer. " * 6
# (prompt tokens, generated tokens) per turn: single-token prompts, chunk-sized pastes, a 300-token question
TURNS = [(1, 9), (44, 12), (2, 30), (200, 12), (1, 40), (45, 12), (300, 5), (13, 60), (45, 12), (130, 40),
         (1, 12), (255, 12), (44, 12), (57, 20)]
PAGE = 16  # the document fills more pages than portable.CPU_SPLIT_PAGES: the prefix is split over CPU streams
TOL = 2e-4 if mx.default_device() == mx.cpu else 1e-2


@pytest.fixture(scope="module")
def model(smol_tokenizer):
    return make_tiny(smol_tokenizer, seed=5, max_position_embeddings=4096, head_dim=64)


CARTS = [("fp16", "auto"), ("fp16", "portable"), ("mlx4g32+rot", "auto"), ("fp16", "contiguous")]  # (tier, attention)


def _cart_id(param):
    return f"{param[0]}-{param[1]}"


@pytest.fixture(scope="module", params=CARTS, ids=_cart_id)
def cart(request, model, tmp_path_factory):
    tier, attention = request.param
    path = tmp_path_factory.mktemp("loop") / f"{tier}.cart"
    cartridge.build(DOC, path, model=model, tier=tier, page_size=PAGE)
    if attention != "contiguous":
        return cartridge.load(path, model=model, attention=attention)
    # the CUDA backend's path for dense pages (MLX's SDPA over one buffer with room), taken here on any device
    cart = cartridge.load(path, model=model, attention="portable")
    cart.prefixes = [replace(p, backend=contiguous.lay_out(p)) for p in cart.prefixes]
    return cart


def _reference_logprobs(cart, stream):
    """Log-probabilities after each token of `stream`, teacher-forced over mlx-lm KVCaches of the decoded prefix."""
    caches = []
    for p in cart.prefixes:
        c = KVCache()
        k, v = (codec.decode(parts, params) for codec, parts, params in
                ((p.k_codec, p.k_parts, p.k_params), (p.v_codec, p.v_parts, p.v_params)))
        # (n_pages, n_kv, P, D) -> (1, n_kv, n_pages * P, D), cut to the valid tokens
        k, v = (x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[None, :, : p.n_tokens] for x in (k, v))
        c.update_and_fetch(k.astype(mx.float32), v.astype(mx.float32))
        caches.append(c)
    logits = cart.model(mx.array(stream)[None], cache=caches)[0]
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def _run_turns(cart, loop, turns=TURNS):
    """Drive one cache through `turns` with `loop`; returns the token stream and {stream index: yielded logprobs}."""
    rng = np.random.default_rng(31)
    cache, stream, yielded = cart.prompt_cache(), [], {}
    for n_prompt, n_new in turns:
        prompt = rng.integers(100, 40000, size=n_prompt).tolist()
        stream += prompt
        for token, logprobs in loop(cart, prompt, cache, n_new):
            yielded[len(stream) - 1] = np.array(logprobs)  # the distribution of the token at len(stream)
            stream.append(token)
        assert cache[0].offset == len(cart.tokens) + len(stream)
    return stream, yielded


def _generate_step(cart, prompt, cache, n):
    for _, (y, logprobs) in zip(range(n), generate_step(mx.array(prompt), cart.model, prompt_cache=cache)):
        yield int(y), logprobs


def _synchronous(cart, prompt, cache, n):
    """`generate_step`'s ops without its pipeline: prompt[:-1], then one token at a time on the default stream,
    each step evaluated before the next is built; like `generate_step` it feeds the last token it returns."""
    if len(prompt) > 1:
        cart.model(mx.array(prompt[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
    y = mx.array(prompt[-1:])
    for _ in range(n):
        logits = cart.model(y[None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        y = mx.argmax(logprobs, axis=-1)
        mx.eval(y, logprobs)
        yield int(y.item()), logprobs.squeeze(0)
    cart.model(y[None], cache=cache)
    mx.eval([c.state for c in cache])


def _stream_generate(cart, prompt, cache, n):
    for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, prompt, max_tokens=n, prompt_cache=cache):
        yield r.token, r.logprobs


def test_turns_on_one_cache_match_a_fresh_prefill(cart):
    _check_turns(cart, _generate_step)


# stream_generate drives the cache through generate_step (above, every cartridge): make test runs it on one
@pytest.mark.parametrize("cart", [pytest.param(p, id=_cart_id(p), marks=() if p == CARTS[0] else pytest.mark.slow)
                                  for p in CARTS], indirect=True)
def test_turns_under_stream_generate_match_a_fresh_prefill(cart):
    _check_turns(cart, _stream_generate)


def _check_turns(cart, loop):
    stream, yielded = _run_turns(cart, loop)
    assert len(stream) > 1100
    want = _reference_logprobs(cart, stream)
    for i, got in yielded.items():
        np.testing.assert_allclose(got, want[i], rtol=TOL, atol=TOL, err_msg=f"tail position {i}")
        assert stream[i + 1] == int(np.argmax(got))


def test_generate_step_computes_what_a_synchronous_loop_does(cart):
    # issue 31 item 0 suspected the cache under generate_step's pipeline (step n+1 built before step n is
    # evaluated, on its own stream); the same ops run one step at a time give the same bits on the CPU
    pipelined, synchronous = (_run_turns(cart, loop, TURNS[:4]) for loop in (_generate_step, _synchronous))
    assert pipelined[0] == synchronous[0]
    for i, got in pipelined[1].items():
        want = synchronous[1][i]
        if mx.default_device() == mx.cpu:
            np.testing.assert_array_equal(got, want, err_msg=f"tail position {i}")
        else:
            np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL, err_msg=f"tail position {i}")


def _on_new_thread(cart, prompt, cache, n):
    """`_generate_step` run to the end on a thread of its own (as a server's worker runs it)."""
    out = []
    worker = threading.Thread(target=lambda: out.extend(_generate_step(cart, prompt, cache, n)))
    worker.start()
    worker.join()
    assert len(out) == n, "the generation thread failed"
    return out


def test_turns_on_worker_threads_and_the_main_thread_match_a_fresh_prefill(cart):
    # MLX streams belong to the thread that made them: the CPU streams the prefix is split over (page 16) are
    # made per thread, so turns on a new thread, then on this one, then on another, all run and stay exact
    turns = iter([_on_new_thread, _generate_step, _on_new_thread, _generate_step])
    stream, yielded = _run_turns(cart, lambda *a: next(turns)(*a), [(45, 12), (1, 9), (44, 12), (3, 5)])
    want = _reference_logprobs(cart, stream)
    for i, got in yielded.items():
        np.testing.assert_allclose(got, want[i], rtol=TOL, atol=TOL, err_msg=f"tail position {i}")
        assert stream[i + 1] == int(np.argmax(got))
