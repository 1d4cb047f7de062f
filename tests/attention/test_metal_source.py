"""Every Metal kernel source cartridge hands to mx.fast.metal_kernel compiles (on Linux, no Mac needed).

Each variant of `metal.sources()` (tiers x head_dims x rotation x query dtypes x query rows, and the finish) is
assembled exactly as MLX assembles a custom kernel (tests/helpers/metal_source.py) and compiled with the system C++
compiler against tests/helpers/metal_shim.h, which declares only the Metal Shading Language names the kernels use: an
undeclared name, a type mismatch or a syntax error fails. What this cannot show: that the kernels run, or run
correctly, on Apple silicon (tests/attention/test_metal_kernels.py does that there).
"""

import concurrent.futures
import itertools
import os

import pytest

from cartridge.attention.kernels import metal
from helpers import metal_source

pytestmark = pytest.mark.skipif(metal_source.compiler() is None, reason="no C++ compiler (g++, clang++ or c++)")


def _full(variant):
    _, name, ins, outs, header, body = variant
    # every input has at least 8 elements (metal.sources), so MLX declares each in device memory
    return metal_source.assemble(name, [n for n, _ in ins], [(d, 8, 1) for _, d in ins], [n for n, _ in outs],
                                 [d for _, d in outs], header, body)


def _compile_all(texts, tmp_path, jobs=2):
    """(returncode, diagnostics) of compiling `texts` in `jobs` compiler processes."""
    chunks = [texts[i::jobs] for i in range(jobs)]
    dirs = [tmp_path / f"j{i}" for i in range(jobs)]
    for d in dirs:
        d.mkdir()
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(metal_source.compile_sources, chunks, dirs))
    return max(rc for rc, _ in results), "".join(err for _, err in results)


def test_sources_cover_every_tier_head_dim_rotation_and_dtype():
    labels = [v[0] for v in metal.sources()]
    assert len(labels) == len(set(labels)) == 1232
    for tier in ("fp16", "bf16", "f32", "int8", "int6", "mlx4g32", "fp8", "turbo4", "turbo3", "turbo2", "mxfp4",
                 "nvfp4", "kivi4", "int8+rot", "int6+rot", "mlx4g32+rot", "mxfp4+rot", "nvfp4+rot"):
        for D in (64, 128, 256) + (() if tier.startswith("turbo") or tier.endswith("+rot") else (96,)):
            for dtype in ("float16", "bfloat16", "float32"):
                assert f"pass1 {tier} D{D} {dtype} rows8" in labels, (tier, D, dtype)
    assert "pass1 turbo4 D96 float32 rows1" not in labels  # the rotation needs a power-of-two head_dim
    # any K tier beside any other V tier (a schema, a preset such as safe: K int8+rot, V int6+rot)
    for k, v in (("int8+rot", "int6+rot"), ("kivi4", "mlx4g32+rot"), ("mxfp4+rot", "turbo2"), ("turbo3", "fp16")):
        assert f"pass1 {k}/{v} D128 float32 rows1" in labels, (k, v)
    assert {f"finish D{D} {t}" for D in (64, 96, 128, 256) for t in ("float16", "bfloat16", "float32")} <= set(labels)


def test_assembled_source_matches_mlx_signature():
    variant = next(v for v in metal.sources() if v[0] == "pass1 mlx4g32 D128 float16 rows4")
    text = _full(variant)
    assert text.startswith(metal.header())
    assert f"[[kernel]] void {variant[1]}(\n  const device float16_t* q [[buffer(0)]],\n" in text
    assert "  const device uint32_t* k0 [[buffer(2)]],\n  const device float16_t* k1 [[buffer(3)]]," in text
    assert "  device float* L [[buffer(13)]],\n  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]]" in text
    assert "  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]) {\n" in text
    assert "thread_position_in_grid [[" not in text.replace("threadgroup_position_in_grid", "")


def _fields(label):
    """('pass1', 'Kint8', 'Vint6+rot', 'D128', 'float32', 'rows1') for 'pass1 int8/int6+rot D128 float32 rows1'."""
    kind, tiers, *rest = label.split()
    if kind == "finish":  # 'finish D128 float16'
        return kind, "-", "-", tiers, rest[0], "-"
    k, _, v = tiers.partition("/")
    return (kind, "K" + k, "V" + (v or k), *rest)


def _pairs(label):
    f = _fields(label)
    return {(i, f[i], j, f[j]) for i, j in itertools.combinations(range(len(f)), 2)}


def pairwise_subset(variants):
    """Variants such that every pair of field values (K tier, V tier, head_dim, dtype, query rows) found
    together in `variants` is found together in one of them (all-pairs testing; greedy, deterministic)."""
    covers = [_pairs(v[0]) for v in variants]
    left, chosen = set().union(*covers), []
    while left:
        i = max(range(len(variants)), key=lambda i: len(covers[i] & left))
        chosen.append(variants[i])
        left -= covers[i]
    return chosen


def _compiles(variants, tmp_path):
    rc, err = _compile_all([_full(v) for v in variants], tmp_path, jobs=min(2, os.cpu_count() or 1))
    assert rc == 0, err[:4000]


def test_a_pairwise_subset_of_the_sources_compiles(tmp_path):
    """make test: 364 of the 1,232 variants, every pair of field values among them (all: make test-slow)."""
    everything = metal.sources()
    subset = pairwise_subset(everything)
    assert len(subset) == 364
    for field in range(6):
        assert {_fields(v[0])[field] for v in subset} == {_fields(v[0])[field] for v in everything}
    _compiles(subset, tmp_path)


@pytest.mark.slow
def test_every_generated_source_compiles(tmp_path):
    _compiles(metal.sources(), tmp_path)


@pytest.mark.parametrize("breakage, message", [
    (("simd_sum(s)", "simd_sum_typo(s)"), "simd_sum_typo"),       # an undeclared MSL name
    (("m[r] = mn;\n", "m[r] = mn\n"), "expected"),                  # a syntax error
    (("float kx[EPL]", "half3 kx[EPL]"), "half3"),                  # a type the shim does not declare
])
def test_a_broken_source_fails_the_compile(tmp_path, breakage, message):
    variant = next(v for v in metal.sources() if v[0] == "pass1 turbo4 D128 float16 rows1")
    text = _full(variant)
    assert breakage[0] in text
    rc, err = metal_source.compile_sources([text.replace(*breakage, 1)], tmp_path)
    assert rc != 0 and message in err
    rc, err = metal_source.compile_sources([text], tmp_path)
    assert rc == 0, err


def test_float_constants_are_msl_literals_that_round_trip_float32():
    """Decimal literals with a point or an exponent (`1f` is no literal; hex floats are C++17, MSL C++14-based)."""
    import numpy as np

    assert metal._constants([("SCALE", 1.0)]) == "constexpr float SCALE = 1.0f;\n"
    for x in (128 ** -0.5, 96 ** -0.5, 1e-5, 3.0):
        text = metal._constants([("S", x)]).split("= ")[1].rstrip(";\nf")
        assert "." in text or "e" in text
        assert np.float32(float(text)) == np.float32(x)
