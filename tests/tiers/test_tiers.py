"""Tier codecs: exact byte formulas, deterministic bytes, the spec's encode rules, stated error bounds.

Bounds are on x ~ N(0, 1) of shape (n_kv_heads 3, 300 tokens, head_dim 64) with a fixed seed; the
relative RMSE is sqrt(mean (x_hat - x)^2 / mean x^2). The turbo bounds follow TurboQuant's MSE per
coordinate of a unit vector (d * C = 0.0091 / 0.0334 / 0.1145 at d = 64, b = 4 / 3 / 2, so relative
RMSE ~ 0.095 / 0.183 / 0.338) plus fp16 norm rounding.
"""

import mlx.core as mx
import numpy as np
import pytest
from helpers import tiers_reference as ref

from cartridge.errors import CorruptCartridgeError, InputError
from cartridge.tiers import TIERS, bitpack
from cartridge.tiers.affine import affine_encode
from cartridge.tiers.codebook import lloyd_max, mse

# tier -> bytes per token per layer-side, as a function of (n_kv_heads H, head_dim D): spec section 6
FORMULAS = {
    "fp16": lambda H, D: 2 * H * D,
    "bf16": lambda H, D: 2 * H * D,
    "int8": lambda H, D: H * D + H * D // 8,
    "int6": lambda H, D: 3 * H * D // 4 + H * D // 8,
    "mlx4g32": lambda H, D: H * D // 2 + H * D // 8,
    "fp8": lambda H, D: H * D + H * D // 32,
    "mxfp4": lambda H, D: H * D // 2 + H * D // 32,
    "nvfp4": lambda H, D: H * D // 2 + H * D // 16,
    "turbo4": lambda H, D: 4 * H * D // 8 + 2 * H,
    "turbo3": lambda H, D: 3 * H * D // 8 + 2 * H,
    "turbo2": lambda H, D: 2 * H * D // 8 + 2 * H,
    "kivi4": lambda H, D: H * D // 2 + H * D // 8,
}
FORMULAS.update({f"{name}+rot": FORMULAS[name] for name in ("int8", "int6", "mlx4g32", "mxfp4", "nvfp4")})
# default model (3 x 64, kv_dim 192) and a kv_dim 1024 config (8 x 128): exact numbers
BYTES = {
    (3, 64): {"fp16": 384, "bf16": 384, "int8": 216, "mlx4g32": 120, "fp8": 198, "mxfp4": 102, "nvfp4": 108,
              "turbo4": 102, "turbo3": 78, "turbo2": 54, "kivi4": 120, "int8+rot": 216, "mlx4g32+rot": 120,
              "mxfp4+rot": 102, "nvfp4+rot": 108, "int6": 168, "int6+rot": 168},
    (8, 128): {"fp16": 2048, "bf16": 2048, "int8": 1152, "mlx4g32": 640, "fp8": 1056, "mxfp4": 544, "nvfp4": 576,
               "turbo4": 528, "turbo3": 400, "turbo2": 272, "kivi4": 640, "int8+rot": 1152, "mlx4g32+rot": 640,
               "mxfp4+rot": 544, "nvfp4+rot": 576, "int6": 896, "int6+rot": 896},
}
# tier -> (relative RMSE bound, max |error| bound) on N(0, 1) data
GAUSSIAN_BOUNDS = {
    "fp16": (3e-4, 2e-3), "bf16": (2.5e-3, 1.6e-2), "int8": (6e-3, None), "mlx4g32": (0.09, None),
    "fp8": (0.03, 0.3), "mxfp4": (0.13, 0.8), "nvfp4": (0.11, 0.7),
    "turbo4": (0.10, 0.6), "turbo3": (0.19, 1.1), "turbo2": (0.35, 2.0),
    "int8+rot": (6e-3, None), "mlx4g32+rot": (0.09, None), "mxfp4+rot": (0.13, 0.8), "nvfp4+rot": (0.11, 0.7),
    "kivi4": (0.09, None), "int6": (0.025, None), "int6+rot": (0.025, None),
}


def gaussian(shape=(3, 300, 64), seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def raw(a):
    """The bytes of an MLX array (bfloat16 viewed as its 16 bits: numpy has no bfloat16)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def roundtrip(name, x, layer=0, side="k"):
    codec = TIERS[name]
    params = codec.make_params(x, layer, side)
    parts = codec.encode(x, params)
    return codec, params, parts, codec.decode(parts, params)


def test_every_tier_has_a_formula():
    assert set(TIERS) == set(FORMULAS)


@pytest.mark.parametrize("geometry", list(BYTES))
@pytest.mark.parametrize("name", list(FORMULAS))
def test_bytes_per_token_exact(name, geometry):
    H, D = geometry
    codec = TIERS[name]
    assert codec.bytes_per_token(H, D) == FORMULAS[name](H, D) == BYTES[geometry][name]
    n = getattr(codec, "token_group", 5)  # kivi4 encodes whole groups of 32 tokens
    x = gaussian((H, n, D))
    parts = codec.encode(x, codec.make_params(x, 0, "v"))
    stored = sum(parts[c.name].nbytes for c in codec.components(D)) // n
    assert stored == BYTES[geometry][name]


def test_mlx4g32_is_640_bytes_at_kv_dim_1024():
    assert TIERS["mlx4g32"].bytes_per_token(8, 128) == 640
    assert TIERS["mlx4g32"].bytes_per_token(16, 64) == 640


@pytest.mark.parametrize("name", list(FORMULAS))
def test_components_match_encoded_arrays(name):
    n = getattr(TIERS[name], "token_group", 7)  # kivi4 encodes whole groups of 32 tokens
    x = gaussian((3, n, 64))
    codec, _, parts, decoded = roundtrip(name, x)
    comps = codec.components(64)
    assert list(parts) == [c.name for c in comps]
    for c in comps:
        assert parts[c.name].shape == (3, n, c.width)
        assert parts[c.name].dtype == getattr(mx, c.dtype)
    assert decoded.shape == x.shape and decoded.dtype == mx.float32


@pytest.mark.parametrize("name", list(FORMULAS))
def test_encoding_is_deterministic(name):
    x = gaussian(seed=3)[:, :288]  # whole groups of 32 tokens for kivi4
    a = TIERS[name].encode(x, TIERS[name].make_params(x, 4, "v"))
    b = TIERS[name].encode(mx.array(np.array(x)), TIERS[name].make_params(mx.array(np.array(x)), 4, "v"))
    for key in a:
        assert raw(a[key]) == raw(b[key])


@pytest.mark.parametrize("name", list(FORMULAS))
def test_gaussian_round_trip_error_within_bound(name):
    x = gaussian()[:, :288] if name == "kivi4" else gaussian()  # kivi4: whole groups of 32 tokens
    *_, d = roundtrip(name, x)
    err = np.array(d) - np.array(x)
    rel_rmse = np.sqrt((err ** 2).mean() / (np.array(x) ** 2).mean())
    bound, max_bound = GAUSSIAN_BOUNDS[name]
    assert rel_rmse < bound
    if max_bound is not None:
        assert np.abs(err).max() < max_bound


@pytest.mark.parametrize("name", ["int8", "mlx4g32"])
def test_affine_error_at_most_half_a_step(name):
    """Bias rounded down and scale up through fp16: no clipping, |x_hat - x| <= scale/2 everywhere."""
    x = gaussian() * 7 + 3
    _, _, parts, d = roundtrip(name, x)
    scale = np.repeat(np.array(parts["scales"]).astype(np.float32), 32, axis=-1)
    err = np.abs(np.array(d) - np.array(x))
    assert np.all(err <= scale / 2 * (1 + 1e-5) + 1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_affine_codes_target_the_stored_fp16_scale_exactly(bits):
    """Every code is round((x - bias) / scale) with the *stored* fp16 scale and bias, computed in float32,
    and so a nearest level of the grid a reader sees; mx.quantize (codes against the unrounded scale)
    misses that grid on some elements."""
    x = np.random.default_rng(1).standard_normal((4, 200, 64)).astype(np.float32) * 3
    parts = affine_encode(mx.array(x), bits)
    s = np.repeat(np.array(parts["scales"]).astype(np.float32), 32, axis=-1)
    b = np.repeat(np.array(parts["biases"]).astype(np.float32), 32, axis=-1)
    codes = ref.unpack_elements(np.array(parts["codes"]), bits)
    want = np.clip(np.rint((x - b) / s), 0, (1 << bits) - 1)
    assert np.array_equal(codes, want)
    # nearest level, in float64, under the stored grid (ties either way)
    levels = s[..., None].astype(np.float64) * np.arange(1 << bits) + b[..., None]
    best = np.abs(levels - x[..., None]).min(-1)
    got = np.abs(s.astype(np.float64) * codes + b - x)
    assert np.all(got <= best + 1e-6 * s)
    # the stored scale and bias are fp16 values with bias <= min and bias + (2^b - 1) scale >= max
    g = x.reshape(4, 200, 2, 32)
    sb = np.array(parts["biases"]).astype(np.float64)
    ss = np.array(parts["scales"]).astype(np.float64)
    assert np.all(sb <= g.min(-1)) and np.all(sb + ((1 << bits) - 1) * ss >= g.max(-1))
    # mx.quantize chooses codes against its float32 scale: they are not all nearest under fp16 scales
    wq, sq, bq = mx.quantize(mx.array(x), group_size=32, bits=bits)
    sq16 = np.repeat(np.array(sq.astype(mx.float16)).astype(np.float64), 32, axis=-1)
    bq16 = np.repeat(np.array(bq.astype(mx.float16)).astype(np.float64), 32, axis=-1)
    mlx_codes = ref.unpack_elements(np.array(wq), bits)
    levels = sq16[..., None] * np.arange(1 << bits) + bq16[..., None]
    mlx_best = np.abs(levels - x[..., None]).min(-1)
    assert np.any(np.abs(sq16 * mlx_codes + bq16 - x) > mlx_best + 1e-6 * sq16)


def test_affine_constant_and_zero_groups_decode_exactly():
    x = mx.concatenate([mx.zeros((1, 2, 64)), mx.full((1, 2, 64), 0.5)], axis=1)
    for name in ("int8", "mlx4g32"):
        *_, d = roundtrip(name, x)
        assert np.array_equal(np.array(d), np.array(x))


@pytest.mark.parametrize("mode, name", [("mxfp8", "fp8"), ("mxfp4", "mxfp4")])
def test_mx_tiers_follow_the_spec_rule_exactly(mode, name):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 100, 64)) * np.exp(rng.uniform(-8, 8, (3, 100, 1)))).astype(np.float32)
    x[0, 0, :32] = 0  # an all-zero group: scale byte 127
    x[0, 1, :32] = 448.0 if mode == "mxfp8" else 6.0  # exactly emax: scale 2^0
    parts = TIERS[name].encode(mx.array(x), TIERS[name].make_params(mx.array(x), 0, "k"))
    codes, scales = ref.mx_reference(x, mode)
    assert np.array_equal(ref.unpack_elements(np.array(parts["codes"]), TIERS[name].bits), codes)
    assert np.array_equal(np.array(parts["scales"]).astype(np.int64), scales)
    assert scales[0, 0, 0] == 127 and scales[0, 1, 0] == 127


def test_nvfp4_follows_the_spec_rule_exactly():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 100, 64)) * np.exp(rng.uniform(-3, 3, (3, 100, 1)))).astype(np.float32)
    codec = TIERS["nvfp4"]
    params = codec.make_params(mx.array(x), 0, "v")
    assert params["global_scale"] == float(np.abs(x).max())
    parts = codec.encode(mx.array(x), params)
    codes, scales = ref.nvfp4_reference(x, params["global_scale"])
    assert np.array_equal(ref.unpack_elements(np.array(parts["codes"]), 4), codes)
    assert np.array_equal(np.array(parts["scales"]).astype(np.int64), scales)
    # decode = e2m1 * e4m3(scale) * global_scale / (448 * 6)
    sign = np.where(codes & 8, -1.0, 1.0)
    want = sign * ref.E2M1[codes & 7] * np.repeat(ref.E4M3[scales], 16, axis=-1) * np.float32(params["global_scale"]) / 2688
    np.testing.assert_allclose(np.array(codec.decode(parts, params)), want, rtol=1e-6, atol=1e-30)


def test_nvfp4_all_zero_tensor_has_a_finite_global_scale():
    x = mx.zeros((2, 3, 64))
    _, params, _, d = roundtrip("nvfp4", x)
    assert params["global_scale"] == 1.0
    assert np.array_equal(np.array(d), np.zeros((2, 3, 64)))


@pytest.mark.parametrize("name", ["turbo4", "turbo3", "turbo2"])
def test_turbo_follows_the_spec_rule(name):
    x = gaussian((3, 200, 64), seed=5)
    codec, params, parts, _ = roundtrip(name, x, layer=3, side="v")
    idx, norm, u = ref.turbo_reference(np.array(x), params)
    got = np.array(bitpack.unpack(parts["codes"], codec.bits, 64))
    # float32 (MLX) and float64 (reference) may disagree only within float32 rounding of a threshold
    near = ref.threshold_distance(u, params["codebook"]) < 1e-5
    assert np.array_equal(got[~near], idx[~near]) and near.mean() < 1e-3
    np.testing.assert_allclose(np.array(parts["norms"])[..., 0], norm.astype(np.float16), rtol=1e-3)


def test_turbo_params_record_every_choice():
    x = gaussian((3, 10, 64))
    params = TIERS["turbo3"].make_params(x, 7, "k")
    assert params["rotation"] == "hadamard_signs" and params["packing"] == "lsb_first"
    assert params["bits"] == 3 and params["norm"] in ("raw", "corrected")
    assert params["seed"] == 14 and np.array(params["signs"]).shape == (3, 64)
    assert set(np.unique(params["signs"])) == {-1, 1}
    assert params["codebook"] == list(lloyd_max(64, 3))
    assert TIERS["turbo3"].make_params(x, 7, "v")["signs"] != params["signs"]


def test_zero_vectors_decode_to_zero():
    x = mx.zeros((3, 32, 64))  # 32 tokens: one whole token group of kivi4
    for name in FORMULAS:
        *_, d = roundtrip(name, x)
        assert np.array_equal(np.array(d), np.zeros((3, 32, 64))), name


@pytest.mark.parametrize("d, bits, want", [
    (64, 2, [0.4521, 1.5000]),
    (64, 3, [0.2438, 0.7507, 1.3293, 2.1113]),
    (128, 4, [0.1279, 0.3864, 0.6536, 0.9371, 1.2478, 1.6043, 2.0459, 2.6889]),
])
def test_codebook_matches_reference_table(d, bits, want):
    """shared/reference/kv-quant-algorithms.md section 1.2, Beta column, values * sqrt(d)."""
    c = np.array(lloyd_max(d, bits))
    np.testing.assert_allclose(c[len(c) // 2:] * np.sqrt(d), want, atol=1.5e-4)
    np.testing.assert_array_equal(c, -c[::-1])


def test_codebook_distortion_matches_reference():
    """Exact-Beta d * C at d = 128: 0.3609 / 0.1160 / 0.0340 / 0.0093 for b = 1..4."""
    got = [128 * mse(lloyd_max(128, b), 128) for b in (1, 2, 3, 4)]
    np.testing.assert_allclose(got, [0.3609, 0.1160, 0.0340, 0.0093], atol=1e-4)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 12])
def test_bitpack_is_an_lsb_first_stream(bits):
    c = np.random.default_rng(bits).integers(0, 1 << bits, size=(2, 5, 64)).astype(np.uint32)
    words = np.array(bitpack.pack(mx.array(c), bits))
    stream = ((c[..., None] >> np.arange(bits)) & 1).reshape(2, 5, -1, 32).astype(np.uint64)
    want = (stream << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    assert np.array_equal(words, want)
    assert np.array_equal(np.array(bitpack.unpack(mx.array(words), bits, 64)), c)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_grouped_codebook_lookup_equals_per_code_lookup(bits):
    c = np.random.default_rng(bits).integers(0, 1 << bits, size=(2, 3, 5, 64)).astype(np.uint32)
    codebook = np.random.default_rng(0).standard_normal(1 << bits).astype(np.float32)
    words = bitpack.pack(mx.array(c), bits)
    got = np.array(bitpack.lookup(words, bits, 64, codebook))
    assert got.shape == c.shape and np.array_equal(got, codebook[c])


@pytest.mark.parametrize("name, n_kv, head_dim, match", [
    ("int8", 2, 16, "head_dim 16 is not a multiple of the group size 32"),
    ("mlx4g32", 4, 48, "head_dim 48 is not a multiple of the group size 32"),
    ("fp8", 2, 80, "head_dim 80 is not a multiple of the group size 32"),
    ("mxfp4", 2, 16, "group size 32"),
    ("nvfp4", 2, 24, "head_dim 24 is not a multiple of the group size 16"),
    ("turbo4", 2, 96, "head_dim 96 is not a power of two"),
    ("turbo3", 2, 16, "head_dim 16 is not a power of two >= 32"),
])
def test_check_refuses_shapes_a_tier_cannot_store(name, n_kv, head_dim, match):
    with pytest.raises(InputError, match=match):
        TIERS[name].check(n_kv, head_dim)


@pytest.mark.parametrize("name", list(FORMULAS))
def test_check_accepts_the_default_model_shape(name):
    TIERS[name].check(3, 64)
    TIERS[name].check(8, 128)


@pytest.mark.parametrize("name, change, match", [
    ("mlx4g32", {"bits": 8}, "params.bits is 8; expected 4"),
    ("fp8", {"mode": "affine"}, "params.mode is 'affine'; expected 'mxfp8'"),
    ("int8", {"scale_rule": "mlx"}, "params.scale_rule is 'mlx'; expected 'fp16_bias_down_scale_up'"),
    ("mxfp4", {"packing": None}, "params.packing is None; expected 'lsb_first'"),
    ("nvfp4", {"global_scale": None}, "global_scale is None"),
    ("nvfp4", {"global_scale": -1.0}, "positive finite"),
    ("turbo4", {"norm": "rms"}, "params.norm is 'rms'"),
    ("turbo4", {"codebook": [0.0] * 16}, "16 increasing finite numbers"),
    ("turbo3", {"codebook": [0.1] * 4}, "8 increasing"),
    ("turbo2", {"signs": [[1] * 64] * 2}, "3 x 64 values of \\+1/-1; found shape \\(2, 64\\)"),
    ("turbo2", {"signs": [[2] * 64] * 3}, "values of \\+1/-1"),
    ("turbo2", {"rotation": "haar"}, "params.rotation is 'haar'"),
])
def test_check_params_refuses_unusable_params(name, change, match):
    codec = TIERS[name]
    params = {**codec.make_params(gaussian((3, 4, 64)), 0, "k"), **change}
    with pytest.raises(CorruptCartridgeError, match=match):
        codec.check_params(params, 3, 64)


@pytest.mark.parametrize("name", list(FORMULAS))
def test_check_params_accepts_what_make_params_writes(name):
    codec = TIERS[name]
    codec.check_params(codec.make_params(gaussian((3, 4, 64)), 2, "v"), 3, 64)


@pytest.mark.parametrize("name", list(FORMULAS))
def test_formula_string_is_the_spec_row_and_evaluates_exactly(name):
    """`inspect` prints codec.formula: it must be spec/FORMAT.md's and give bytes_per_token."""
    from helpers import ROOT

    codec = TIERS[name]
    row = next(line for line in (ROOT / "spec" / "FORMAT.md").read_text().splitlines()
               if line.startswith(f"| `{name}` |"))
    assert f"| {codec.formula} |" in row
    for H, D in BYTES:
        # our own constant strings, evaluated on numbers only
        assert eval(codec.formula, {"__builtins__": {}}, {"kv_dim": H * D, "H": H}) == codec.bytes_per_token(H, D)
