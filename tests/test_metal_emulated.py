"""The Metal kernels RUN on the CPU by tests/metal_emulator.py, through the product's host code (MetalAttention),
against the float64 reference of test_kernels.py. This checks what the compile check cannot (indexing, each tier's
decode of its stored bytes, the online softmax, the merges, rotation, sinks, protected tokens), on Linux; it does
not check Apple's Metal compiler or GPU (tests/test_metal_kernels.py runs there)."""

import itertools
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from cartridge.attention.kernels import metal
from cartridge.tiers import TIERS
import metal_emulator
import metal_source
import test_metal_kernels as tm
from test_kernels import TOL, _check

pytestmark = pytest.mark.skipif(metal_source.compiler() is None, reason="no C++ compiler (g++, clang++ or c++)")


def _emulated(kind, consts):
    name, inputs, outputs, body = metal.kernel_spec(kind, consts)
    return metal_emulator.EmulatedKernel(name, inputs, outputs, body, metal.header())


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setattr(metal, "_kernel", _emulated)


@pytest.mark.parametrize("tier, shape", list(itertools.product(sorted(TIERS), [tm.SHAPES[1], tm.SHAPES[5]])))
def test_emulated_metal_matches_float64(tier, shape, emulate):
    prefix, q, tk, tv = tm._make(tier, shape, 1)
    _check(prefix, q, tk, tv, tm._kernel_out(prefix, q, tk, tv), f"emulated metal {tier} {shape}")
