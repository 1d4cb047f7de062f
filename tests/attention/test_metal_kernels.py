"""The Metal decode kernels (kernels/metal.py) against a float64 reference of attention over the decoded pages.

Marked `metal`: they run wherever `mx.metal.is_available()` (Apple silicon) and skip elsewhere. As in
test_kernels.py the reference decodes the stored pages with the tier's own `decode`, so only the kernels'
attention arithmetic and their reading of the stored bytes are compared; tail slots beyond the tail length hold
NaN, so a kernel that over-reads fails. Every tier of the registry (the +rot tiers included) x decode shapes of
GQA 1/3/4/8, head_dim 64/96/128/256, odd lengths and page boundaries +-1; sinks; protected tokens; float32 pages
beside a compressed side. The kernel is called directly, so a None (the portable fallback) fails the test.
The tests after them (not marked) check `supported` and run anywhere. The last ones RUN the same kernels on the
CPU by tests/helpers/metal_emulator.py, through the product's host code (`metal.attend`): what the compile check
(test_metal_source.py) cannot see (indexing, each tier's decode of its stored bytes, the online softmax, the
merges, rotation, sinks, protected tokens), on Linux; not Apple's Metal compiler or GPU.
"""

import itertools
import os
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from helpers import metal_emulator, metal_source
from helpers.kernel_cases import TOL, TOL_FP16, _cache, _case, _check, _seed, protected_reference, with_protected

from cartridge.attention.kernels import metal
from cartridge.attention.policy import dequantize
from cartridge.tiers import TIERS

HAS_METAL = mx.metal.is_available()
NO_METAL = "needs Apple silicon (mx.metal.is_available() is False)"

# (n_q_heads, n_kv_heads, head_dim, prefix tokens, page size, tail tokens, query tokens): R = GQA x L <= 8
SHAPES = [
    (4, 4, 64, 1, 32, 1, 1),         # GQA 1, one prefix token
    (9, 3, 64, 255, 256, 1, 1),      # GQA 3 (SmolLM2), page boundary - 1
    (9, 3, 96, 257, 256, 3, 1),      # head_dim 96, page boundary + 1
    (8, 2, 128, 256, 256, 3, 2),     # GQA 4 x 2 query tokens = 8 rows, exactly one page
    (16, 2, 128, 1001, 64, 300, 1),  # GQA 8, odd length, tail over two chunks
    (12, 4, 96, 511, 128, 5, 2),     # GQA 3 x 2 = 6 rows (rounded up to the 8-row variant)
    (8, 1, 128, 33, 32, 1, 1),       # GQA 8, one KV head, page boundary + 1
    (4, 2, 256, 129, 64, 2, 1),      # head_dim 256
]


def _kernel_out(prefix, q, tk, tv, dtype=mx.float32, sinks=None):
    """The Metal kernel's output for the case (it must answer: no portable fallback)."""
    record = metal.lay_out(prefix)
    cache = _cache(replace(prefix, backend=record), tk, tv, dtype)
    out = metal.attend(record, cache.prefix, mx.array(q).astype(dtype), cache.tail(), q.shape[-1] ** -0.5,
                       None if sinks is None else mx.array(sinks), cache.scratch)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    return np.array(out.astype(mx.float32))[0]


def _make(tier, shape, salt):
    try:
        prefix, q, tk, tv = _case(tier, shape, seed=_seed(tier, shape, salt))
    except Exception as e:  # a tier that cannot store this shape says so before encoding
        pytest.skip(f"{tier} cannot store {shape}: {e}")
    if not metal.supported(prefix, shape[2]):
        pytest.skip(f"no Metal kernel reads {tier} at head_dim {shape[2]}")
    return prefix, q, tk, tv


@pytest.mark.metal
@pytest.mark.skipif(not HAS_METAL, reason=NO_METAL)
@pytest.mark.parametrize("tier, shape", list(itertools.product(sorted(TIERS), SHAPES)))
def test_metal_matches_float64(tier, shape):
    prefix, q, tk, tv = _make(tier, shape, 1)
    _check(prefix, q, tk, tv, _kernel_out(prefix, q, tk, tv), f"metal {tier} {shape}")
    q16, tk16, tv16 = (np.array(mx.array(a).astype(mx.float16).astype(mx.float32)) for a in (q, tk, tv))
    _check(prefix, q16, tk16, tv16, _kernel_out(prefix, q, tk, tv, mx.float16), f"metal {tier} {shape} fp16",
           tol=TOL_FP16)


@pytest.mark.metal
@pytest.mark.skipif(not HAS_METAL, reason=NO_METAL)
@pytest.mark.parametrize("tier, shape", list(itertools.product(
    ["fp16", "mlx4g32", "mlx4g32+rot", "turbo4", "nvfp4", "kivi4"], [SHAPES[1], SHAPES[3], SHAPES[4]])))
def test_metal_sinks_match_float64(tier, shape):
    """gpt-oss sinks: one more logit per query head with no value, merged by the finish."""
    prefix, q, tk, tv = _make(tier, shape, 2)
    sinks = np.random.default_rng(3).standard_normal(shape[0]).astype(np.float32) * 3
    got = _kernel_out(prefix, q, tk, tv, sinks=sinks)
    _check(prefix, q, tk, tv, got, f"metal {tier} {shape} sinks", sinks)
    assert not np.allclose(got, _kernel_out(prefix, q, tk, tv), atol=1e-3)  # the sinks did something


@pytest.mark.metal
@pytest.mark.skipif(not HAS_METAL, reason=NO_METAL)
@pytest.mark.parametrize("tier, shape, first, last", [
    ("mlx4g32", SHAPES[3], 4, 28), ("mlx4g32+rot", SHAPES[3], 0, 7), ("turbo3", SHAPES[1], 70, 0),
    ("nvfp4+rot", SHAPES[5], 17, 3), ("int8", SHAPES[4], 33, 40), ("kivi4", SHAPES[5], 2, 2),
])
def test_metal_protected_tokens_match_float64(tier, shape, first, last):
    """Protected tokens (format 1.5): pass 1 reads stored tokens first .. n - last - 1, the finish attends over
    the fp16 copies of the others, as over tail tokens every row sees."""
    prefix, q, tk, tv = _make(tier, shape, 3)
    prefix = with_protected(prefix, first, last, shape[2])
    got = _kernel_out(prefix, q, tk, tv)
    want = protected_reference(prefix, q, tk, tv)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.isfinite(got).all() and err < TOL, f"metal protected {tier} {shape}: relative error {err:.2e}"


@pytest.mark.metal
@pytest.mark.skipif(not HAS_METAL, reason=NO_METAL)
@pytest.mark.parametrize("tier", ["mxfp4", "turbo4", "kivi4"])
def test_metal_float32_pages_beside_a_compressed_side(tier):
    """K decoded to float32 within a budget, V stored (and the other way round)."""
    shape = SHAPES[3]
    prefix, q, tk, tv = _make(tier, shape, 5)
    dense = dequantize(prefix, mx.float32)
    for mixed in (replace(prefix, k_codec=dense.k_codec, k_parts=dense.k_parts, k_params=dense.k_params),
                  replace(prefix, v_codec=dense.v_codec, v_parts=dense.v_parts, v_params=dense.v_params)):
        assert metal.supported(mixed, shape[2])
        _check(mixed, q, tk, tv, _kernel_out(mixed, q, tk, tv), f"metal {tier} with float32 pages")


# ---- run anywhere: which layers the kernels read ----

def test_supported_reads_every_tier_at_its_head_dims():
    for tier in sorted(TIERS):
        prefix, *_ = _case(tier, (4, 2, 64, 64, 32, 1, 1), seed=1)
        assert metal.supported(prefix, 64), tier
        assert not metal.supported(prefix, 64, "prefill"), tier
        assert not metal.supported(prefix, 80), tier  # no such head_dim variant


def test_supported_refuses_rotations_at_head_dim_96_and_partial_blocks():
    prefix, *_ = _case("mlx4g32", (4, 2, 96, 64, 32, 1, 1), seed=1)
    assert metal.supported(prefix, 96)
    rotated, *_ = _case("mlx4g32+rot", (4, 2, 128, 64, 32, 1, 1), seed=1)
    assert metal.supported(rotated, 128)
    block = dict(rotated.k_params["rotation"], block=64)
    assert not metal.supported(replace(rotated, k_params={**rotated.k_params, "rotation": block}), 128)


def test_decode_rows_beyond_eight_per_kv_head_are_not_taken():
    """More than MAX_ROWS query rows per KV head (a question's prefill): None, so the caller takes another path;
    decided before any kernel is built."""
    prefix, q, tk, tv = _case("fp16", (16, 2, 64, 64, 32, 2, 2), seed=1)  # GQA 8 x 2 tokens = 16 rows
    record = metal.lay_out(prefix)
    cache = _cache(prefix, tk, tv, mx.float32)
    assert metal.attend(record, prefix, mx.array(q), cache.tail(), 0.125, None, cache.scratch) is None
    assert record.launches == {}


# ---- on the CPU: the same kernels run by tests/helpers/metal_emulator.py (no Mac needed) ----

NEEDS_COMPILER = pytest.mark.skipif(metal_source.compiler() is None, reason="no C++ compiler (g++, clang++ or c++)")


def _emulated(kind, consts):
    name, inputs, outputs, body = metal.kernel_spec(kind, consts)
    return metal_emulator.EmulatedKernel(name, inputs, outputs, body, metal.header())


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setattr(metal, "_kernel", _emulated)


# Each variant takes seconds to build (cached in /tmp/cartridge-metal-emu): by default one shape per tier family and
# a few more; CARTRIDGE_METAL_EMULATE=all runs every tier at two shapes (GQA 3 / head_dim 64 at a page boundary - 1, and
# GQA 3 x 2 query tokens / head_dim 96 / 511 tokens) and each shape of SHAPES for mlx4g32.
ALL = os.environ.get("CARTRIDGE_METAL_EMULATE") == "all"
# by default one tier of each decode family (fp16/bf16 pages, affine 8/6/4-bit, FP8, block FP4, TurboQuant, kivi,
# rotation), keeping `make test` short; every tier with CARTRIDGE_METAL_EMULATE=all
DEFAULT_TIERS = ("bf16", "int8", "int6+rot", "mlx4g32+rot", "fp8", "nvfp4", "mxfp4+rot", "turbo3", "kivi4")
CASES = (list(itertools.product(sorted(TIERS), [SHAPES[1], SHAPES[5]])) +
         [("mlx4g32", s) for s in SHAPES] if ALL else [(t, SHAPES[1]) for t in DEFAULT_TIERS])


@NEEDS_COMPILER
@pytest.mark.parametrize("tier, shape", CASES)
def test_emulated_metal_matches_float64(tier, shape, emulate):
    prefix, q, tk, tv = _make(tier, shape, 1)
    _check(prefix, q, tk, tv, _kernel_out(prefix, q, tk, tv), f"emulated metal {tier} {shape}")


# the queries are read into float registers before, and the sinks merged after, the per-tier decode (which the test
# above runs for every decode family): make test runs each for one tier, ~7 s an emulated case; the others under slow
_SLOW = pytest.mark.slow


@NEEDS_COMPILER
@pytest.mark.parametrize("tier, shape", [("mlx4g32+rot", SHAPES[3]),
                                         pytest.param("turbo4", SHAPES[1], marks=_SLOW)])
def test_emulated_metal_sinks_match_float64(tier, shape, emulate):
    test_metal_sinks_match_float64(tier, shape)  # the marked test's body, on the emulator


@NEEDS_COMPILER
@pytest.mark.parametrize("tier, shape, first, last", [("int8", SHAPES[4], 33, 40), ("kivi4", SHAPES[5], 2, 2)])
def test_emulated_metal_protected_tokens_match_float64(tier, shape, first, last, emulate):
    test_metal_protected_tokens_match_float64(tier, shape, first, last)  # on the emulator


@NEEDS_COMPILER
def test_emulated_metal_float32_pages_beside_mxfp4(emulate):
    test_metal_float32_pages_beside_a_compressed_side("mxfp4")


@NEEDS_COMPILER
@pytest.mark.parametrize("tier", ["mlx4g32", pytest.param("turbo4", marks=_SLOW),
                                  pytest.param("nvfp4+rot", marks=_SLOW)])
def test_emulated_metal_fp16_queries_match_float64(tier, emulate):
    test_metal_matches_float64(tier, SHAPES[3])  # float32 and fp16 queries, 8 rows, on the emulator
