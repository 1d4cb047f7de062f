"""Portable attention over compressed pages equals float64 attention over the decoded pages, for every tier.

This separates the attention path's error (tight: rel err < 1e-3) from the tier's quantization error
(tests/tiers/test_tiers.py), as mlx's test_qmm separates kernel error from quantization error. Then every
tier, built by `cartridge.build` on a tiny model, generates like a dense mlx-lm cache of its decoded
pages.
"""

import itertools

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny_models import make_tiny
from helpers.dense_caches import DOC, _decoded_kv_cache, _logits
from helpers.page_cases import HEAD_DIM, N_KV, SHAPES, layer, reference

from cartridge.attention.kernels import merge, prefix_partial
from cartridge.tiers import TIERS

GQA = [1, 3, 4]
QUERY_TOKENS = [1, 5]


@pytest.mark.parametrize("name, shape, gqa, L", list(itertools.product(TIERS, SHAPES, GQA, QUERY_TOKENS)))
def test_portable_attention_over_pages_matches_float64(name, shape, gqa, L):
    n_tokens, page_size = shape
    page_size = max(page_size, getattr(TIERS[name], "token_group", 1))  # kivi4: pages of whole token groups
    prefix = layer(name, n_tokens, page_size, seed=n_tokens * 10 + gqa)
    rng = np.random.default_rng(L)
    q = mx.array(rng.standard_normal((N_KV, gqa * L, HEAD_DIM)).astype(np.float32) * HEAD_DIM ** -0.5)
    got = np.array(merge([prefix_partial(q, prefix, n_tokens)]))
    codec = prefix.k_codec
    want = reference(q, codec.decode(prefix.k_parts, prefix.k_params),
                     codec.decode(prefix.v_parts, prefix.v_params), n_tokens)
    assert got.shape == (N_KV, gqa * L, HEAD_DIM)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-3


@pytest.mark.parametrize("name", ["turbo3", "turbo4"])
def test_turbo_pages_are_processed_in_bounded_blocks(name, monkeypatch):
    """With blocks of one page the result is the same: the block loop covers every page once."""
    from cartridge.tiers import turbo

    prefix = layer(name, 75, 16, seed=9)
    q = mx.array(np.random.default_rng(0).standard_normal((N_KV, 3, HEAD_DIM)).astype(np.float32) / 8)
    whole = np.array(merge([prefix_partial(q, prefix, 75)]))
    monkeypatch.setattr(turbo, "BLOCK_ELEMENTS", 1)
    assert len(prefix.k_codec._blocks(prefix.k_parts)) == 5
    blocked = np.array(merge([prefix_partial(q, prefix, 75)]))
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny64(smol_tokenizer):
    """A tiny llama with head_dim 64 (GQA 2): every tier can store it."""
    return make_tiny(smol_tokenizer, seed=0, head_dim=64)


@pytest.mark.parametrize("policy", ["portable", "dequantize-once"])
@pytest.mark.parametrize("name", list(TIERS))
def test_every_tier_generates_like_a_dense_cache_of_its_decoded_pages(name, policy, tiny64, tmp_path):
    r = cartridge.build(DOC, tmp_path / f"{name}.cart", model=tiny64, tier=name, page_size=64)
    cart = cartridge.load(r.path, model=tiny64, attention=policy)
    assert cart.attention == policy
    assert {row["k"] for row in cart.info.tiers} == {name}
    q = cart.question_prompt("How long does the warranty last?")
    got = _logits(cart.model, q, cart.prompt_cache())
    want = _logits(cart.model, q, _decoded_kv_cache(cart))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
