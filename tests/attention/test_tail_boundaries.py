"""Inputs that cross the tail's 256-token chunks (issue 15): any query length over any tail length gives
the logits of an mlx-lm prefill of the same tokens, on every attention path (fused: CUDA only), and never NaN.

The tail is attended chunk by chunk; a query row that the causal mask hides from every key of a later
chunk used to give exp(-inf + inf) = NaN there, which the merge spread to every row.
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny_models import make_tiny
from mlx_lm.models.cache import KVCache

from cartridge.attention.backends import device

DOC = "The ferry to Inishmore leaves Rossaveal at 10:30 and returns at 17:00 daily in summer. " * 6
CHUNK = 256  # CartridgeCache's default chunk_size
# (tokens already in the tail, query length): chunk boundaries +-1, a long pasted question, a chat turn
CASES = [(0, 1), (0, 255), (0, 256), (0, 257), (0, 511), (0, 513), (0, 1000),
         (255, 1), (255, 2), (256, 1), (200, 57), (250, 300), (1, 511), (700, 300)]
# logits against the mlx-lm reference: float32 on the CPU; the GPU's float32 matmuls round more (TF32)
TOL = 2e-4 if mx.default_device() == mx.cpu else 1e-2


@pytest.fixture(scope="module")
def model(smol_tokenizer):
    return make_tiny(smol_tokenizer, seed=3, max_position_embeddings=4096, head_dim=64)  # a fused kernel's head_dim


PATHS = ["portable", "dequantize-once", "fused", "question-prefill", "contiguous"]
# the 300- and 1,000-token queries (each ~1,000 rows of 49,152 logits compared) run on every path under slow; make
# test runs them on portable and fused, and on every path the chunk boundaries +-1 and the 511/513-token queries
SLOW_IDS = {f"test_query_across_tail_chunks_matches_mlx_lm[{path}-{before}-{length}]"
            for path in ("dequantize-once", "question-prefill", "contiguous")
            for before, length in [(0, 1000), (250, 300), (700, 300)]}


@pytest.fixture(scope="module", params=PATHS)
def cart(request, model, tmp_path_factory):
    if request.param == "fused" and device() != "cuda":
        pytest.skip("the fused kernels need the CUDA backend (run with DEVICE=gpu on an NVIDIA GPU)")
    path = tmp_path_factory.mktemp("tail") / "doc.cart"
    if not path.exists():
        cartridge.build(DOC, path, model=model, page_size=64)
    if request.param == "contiguous":  # the CUDA backend's path for dense pages, taken here on any device
        from cartridge.attention import contiguous

        cart = cartridge.load(path, model=model, attention="portable")
        cart.prefixes = [replace(p, backend=contiguous.lay_out(p)) for p in cart.prefixes]
        yield cart
        return
    if request.param != "question-prefill":
        cart = cartridge.load(path, model=model, attention=request.param)
        if request.param != "dequantize-once":  # which runs the fused kernel over its dense pages on CUDA
            assert (cart.prefixes[0].backend is not None) == (request.param == "fused")
        yield cart
        return
    # the fused layer's path for many query rows (pages decoded for the call, MLX's SDPA; kernels/dense.py),
    # taken here for every call, so it runs on any backend
    from cartridge.attention.kernels import cuda_inputs
    from cartridge.attention.kernels.cuda_tuning import TUNING

    cart = cartridge.load(path, model=model, attention="portable")
    every_call = replace(TUNING, dense_min_rows={}, dense_min_rows_other=1, decoded_min_rows=1)
    cart.prefixes = [replace(p, backend=cuda_inputs.lay_out(p, every_call)) for p in cart.prefixes]
    yield cart


def _dense_prefix_cache(cart):
    """mlx-lm KVCaches holding exactly the decoded prefix pages: a fresh mlx-lm prefill of the tail
    over them is the reference for the cartridge's attention path."""
    caches = []
    for p in cart.prefixes:
        c = KVCache()
        k = p.k_codec.decode(p.k_parts, p.k_params)  # (n_pages, n_kv, P, D)
        v = p.v_codec.decode(p.v_parts, p.v_params)
        # (n_pages, n_kv, P, D) -> (1, n_kv, n_pages * P, D), cut to the valid tokens
        k, v = (x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[None, :, : p.n_tokens] for x in (k, v))
        c.update_and_fetch(k.astype(mx.float32), v.astype(mx.float32))
        caches.append(c)
    return caches


@pytest.mark.parametrize("before,length", CASES)
def test_query_across_tail_chunks_matches_mlx_lm(cart, before, length):
    rng = np.random.default_rng(before * 7919 + length)
    ids = rng.integers(100, 40000, size=before + length).tolist()
    got_cache, want_cache = cart.prompt_cache(), _dense_prefix_cache(cart)
    if before:
        cart.model(mx.array(ids[:before])[None], cache=got_cache)
        cart.model(mx.array(ids[:before])[None], cache=want_cache)
    got = cart.model(mx.array(ids[before:])[None], cache=got_cache)[0]
    want = cart.model(mx.array(ids[before:])[None], cache=want_cache)[0]
    assert not np.isnan(np.array(got)).any()
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=TOL, atol=TOL)
    assert got_cache[0].tail_len == before + length


def test_twenty_turns_on_one_cache_stay_finite(cart):
    """A chat loop: 20 turns of 60 tokens each cross several tail chunks; each turn's logits match."""
    rng = np.random.default_rng(20)
    got_cache, want_cache = cart.prompt_cache(), _dense_prefix_cache(cart)
    for _ in range(20):
        ids = mx.array(rng.integers(100, 40000, size=60).tolist())[None]
        got, want = cart.model(ids, cache=got_cache)[0], cart.model(ids, cache=want_cache)[0]
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=TOL, atol=TOL)
    assert got_cache[0].tail_len == 20 * 60 > 4 * CHUNK
