"""Affine pages with their codes unpacked to bytes (cartridge/attention/unpacked.py): the same values as the
stored tier, and attention over them equals float64 attention over the decoded pages (the portable path's
bound, tests/attention/test_tier_attention.py), on odd lengths, page boundaries, GQA 1/3/4 and 1, 5 or 11 query tokens
(up to 32 query rows take block-diagonal queries, more the decoded values)."""

import itertools

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from helpers.page_cases import SHAPES, layer, reference

from cartridge.attention import unpacked
from cartridge.attention.kernels import merge, portable, prefix_partial
from cartridge.attention.prefix import LayerPrefix
from cartridge.tiers import TIERS

UNPACKABLE = ["int8", "mlx4g32", "int8+rot", "mlx4g32+rot"]
N_KV, HEAD_DIM = 2, 64


def test_which_tiers_unpack():
    assert [n for n, c in TIERS.items() if unpacked.can_unpack(c)] == UNPACKABLE


def _unpacked(prefix, sides):
    k_codec, k_parts, v_codec, v_parts = prefix.k_codec, prefix.k_parts, prefix.v_codec, prefix.v_parts
    if "k" in sides:
        k_codec, k_parts = unpacked.UnpackedCodec(prefix.k_codec), unpacked.unpack(prefix.k_codec, prefix.k_parts)
    if "v" in sides:
        v_codec, v_parts = unpacked.UnpackedCodec(prefix.v_codec), unpacked.unpack(prefix.v_codec, prefix.v_parts)
    return LayerPrefix(k_codec, k_parts, v_codec, v_parts, prefix.n_tokens, prefix.k_params, prefix.v_params)


@pytest.mark.parametrize("name", ["int8", "int6", "mlx4g32"])
def test_cpu_affine_decode_equals_mx_dequantize_exactly(name):
    """The CPU's decode by byte codes (`affine.byte_codes`, `affine_values`) against MLX's own dequantize."""
    from cartridge.tiers.quantized import GroupQuantCodec

    codec = TIERS[name]
    rng = np.random.default_rng(len(name))
    x = mx.array((rng.standard_normal((3, 77, 128)) * rng.uniform(0.1, 30, (3, 77, 1))).astype(np.float32))
    parts = codec.encode(x, codec.make_params(x, 0, "k"))
    with mx.stream(mx.cpu):
        got = np.array(codec.decode(parts, {}))
        want = np.array(GroupQuantCodec.decode(codec, parts, {}))
    assert got.dtype == np.float32 and got.shape == (3, 77, 128)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", UNPACKABLE)
def test_unpacked_pages_decode_to_the_stored_values_exactly(name):
    prefix = layer(name, 75, 32, seed=3)
    parts = unpacked.unpack(prefix.k_codec, prefix.k_parts)
    assert parts["codes"].dtype == mx.uint8 and parts["codes"].shape == (3, N_KV, 32, HEAD_DIM)
    assert parts["scales"].shape == parts["biases"].shape == (3, N_KV, 32, HEAD_DIM // 32)
    want = np.array(prefix.k_codec.decode(prefix.k_parts, prefix.k_params))
    got = np.array(unpacked.UnpackedCodec(prefix.k_codec).decode(parts, prefix.k_params))
    np.testing.assert_array_equal(got, want)
    assert sum(a.nbytes for a in parts.values()) == unpacked.sizes(prefix.k_codec, (3, N_KV, 32, HEAD_DIM))[0]


@pytest.mark.parametrize("name, shape, gqa, L, sides",
                         list(itertools.product(UNPACKABLE, SHAPES, [1, 3, 4], [1, 5, 11], ["k", "kv"])))
def test_attention_over_unpacked_pages_matches_float64(name, shape, gqa, L, sides):
    n_tokens, page_size = shape
    prefix = _unpacked(layer(name, n_tokens, page_size, seed=n_tokens * 10 + gqa), sides)
    rng = np.random.default_rng(L)
    q = mx.array(rng.standard_normal((N_KV, gqa * L, HEAD_DIM)).astype(np.float32) * HEAD_DIM ** -0.5)
    got = np.array(merge([prefix_partial(q, prefix, n_tokens)]))
    want = reference(q, prefix.k_codec.decode(prefix.k_parts, prefix.k_params),
                     prefix.v_codec.decode(prefix.v_parts, prefix.v_params), n_tokens)
    assert got.shape == (N_KV, gqa * L, HEAD_DIM)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-3


def test_unpacked_pages_split_over_cpu_streams_equal_one_pass():
    prefix = _unpacked(layer("mlx4g32", 1000, 64, seed=5), "k")  # 16 pages: the CPU split's case
    q = mx.array(np.random.default_rng(0).standard_normal((N_KV, 3, HEAD_DIM)).astype(np.float32) / 8)
    with mx.stream(mx.cpu):
        split = merge([portable._split_partial(q, prefix, 1000, 16)])
        whole = merge([portable._partial(q, prefix, 1000)])
    np.testing.assert_allclose(np.array(split), np.array(whole), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny64(smol_tokenizer):
    from helpers.tiny_models import make_tiny

    return make_tiny(smol_tokenizer, seed=0, head_dim=64)


def _unpacking_limit(cart):
    """The least max_memory that unpacks every K side of a portable-loaded cartridge: its stored pages,
    each K side's unpacked bytes more, and one decode step's float32 cast of the largest."""
    sizes = [(unpacked.sizes(p.k_codec, (*p.k_parts["codes"].shape[:3], HEAD_DIM)),  # tiny64: head_dim 64
              sum(a.nbytes for a in p.k_parts.values())) for p in cart.prefixes]
    return cart.plan["memory"]["stored_bytes"] + sum(u - k for (u, _, _), k in sizes) + max(s for (_, _, s), _ in sizes)


@pytest.mark.parametrize("options", [
    {"tier": "int8"}, {"tier": "mlx4g32"},
    {"k_tier": "mlx4g32+rot", "v_tier": "mxfp4", "protect_first": 4, "protect_last": 9},  # protected tokens
])
def test_a_budget_that_unpacks_generates_like_a_dense_cache(options, tiny64, tmp_path):
    from helpers.dense_caches import DOC, _decoded_kv_cache, _logits, dense_reference

    if mx.default_device() != mx.cpu:
        pytest.skip("K sides are unpacked on the CPU only")
    r = cartridge.build(DOC, tmp_path / "a.cart", model=tiny64, page_size=64, reserve=0, **options)
    ref = cartridge.load(r.path, model=tiny64, attention="portable")
    limit = _unpacking_limit(ref)
    cart = cartridge.load(r.path, model=tiny64, attention="dequantize-once", max_memory=limit, verify="header")
    assert {x["policy"] for x in cart.plan["layers"]} == {"portable (K unpacked)"}
    assert cart.plan["memory"]["planned_peak_bytes"] == limit
    less = cartridge.load(r.path, model=tiny64, attention="dequantize-once", max_memory=limit - 1, verify="header")
    assert "unpacked" not in less.attention
    q = cart.question_prompt("How long does the warranty last?")
    got = _logits(cart.model, q, cart.prompt_cache())
    want = _logits(cart.model, q, dense_reference(ref) if "protect_first" in options else _decoded_kv_cache(cart))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
