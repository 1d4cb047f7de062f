"""The Metal kernels RUN on the CPU by tests/metal_emulator.py, through the product's host code (`metal.attend`),
against the float64 reference of test_kernels.py. This checks what the compile check cannot (indexing, each tier's
decode of its stored bytes, the online softmax, the merges, rotation, sinks, protected tokens), on Linux; it does
not check Apple's Metal compiler or GPU (tests/test_metal_kernels.py runs there)."""

import itertools
import os

import mlx.core as mx
import numpy as np
import pytest

from cartridge.attention.kernels import metal
from cartridge.tiers import TIERS
import metal_emulator
import metal_source
import test_metal_kernels as tm
from test_kernels import _check

pytestmark = pytest.mark.skipif(metal_source.compiler() is None, reason="no C++ compiler (g++, clang++ or c++)")


def _emulated(kind, consts):
    name, inputs, outputs, body = metal.kernel_spec(kind, consts)
    return metal_emulator.EmulatedKernel(name, inputs, outputs, body, metal.header())


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setattr(metal, "_kernel", _emulated)


# Each variant takes seconds to build (cached in /tmp/cartridge-metal-emu): by default one shape per tier family and
# a few more; CARTRIDGE_METAL_EMULATE=all runs every tier at two shapes (GQA 3 / head_dim 64 at a page boundary - 1, and
# GQA 3 x 2 query tokens / head_dim 96 / 511 tokens) and each shape of test_metal_kernels.py for mlx4g32.
ALL = os.environ.get("CARTRIDGE_METAL_EMULATE") == "all"
# by default one tier of each decode family (fp16/bf16 pages, affine 8/6/4-bit, FP8, block FP4, TurboQuant, kivi,
# rotation), keeping `make test` short; every tier with CARTRIDGE_METAL_EMULATE=all
DEFAULT_TIERS = ("bf16", "int8", "int6+rot", "mlx4g32+rot", "fp8", "nvfp4", "mxfp4+rot", "turbo3", "kivi4")
CASES = (list(itertools.product(sorted(TIERS), [tm.SHAPES[1], tm.SHAPES[5]])) +
         [("mlx4g32", s) for s in tm.SHAPES] if ALL else [(t, tm.SHAPES[1]) for t in DEFAULT_TIERS])


@pytest.mark.parametrize("tier, shape", CASES)
def test_emulated_metal_matches_float64(tier, shape, emulate):
    prefix, q, tk, tv = tm._make(tier, shape, 1)
    _check(prefix, q, tk, tv, tm._kernel_out(prefix, q, tk, tv), f"emulated metal {tier} {shape}")


# the queries are read into float registers before, and the sinks merged after, the per-tier decode (which the test
# above runs for every decode family): make test runs each for one tier, ~7 s an emulated case; the others under slow
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("tier, shape", [("mlx4g32+rot", tm.SHAPES[3]),
                                         pytest.param("turbo4", tm.SHAPES[1], marks=_SLOW)])
def test_emulated_metal_sinks_match_float64(tier, shape, emulate):
    tm.test_metal_sinks_match_float64(tier, shape)  # the marked test's body, on the emulator


@pytest.mark.parametrize("tier, shape, first, last", [("int8", tm.SHAPES[4], 33, 40), ("kivi4", tm.SHAPES[5], 2, 2)])
def test_emulated_metal_protected_tokens_match_float64(tier, shape, first, last, emulate):
    tm.test_metal_protected_tokens_match_float64(tier, shape, first, last)  # on the emulator


def test_emulated_metal_float32_pages_beside_mxfp4(emulate):
    tm.test_metal_float32_pages_beside_a_compressed_side("mxfp4")


@pytest.mark.parametrize("tier", ["mlx4g32", pytest.param("turbo4", marks=_SLOW),
                                  pytest.param("nvfp4+rot", marks=_SLOW)])
def test_emulated_metal_fp16_queries_match_float64(tier, emulate):
    tm.test_metal_matches_float64(tier, tm.SHAPES[3])  # float32 and fp16 queries, 8 rows, on the emulator
