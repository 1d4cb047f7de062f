"""convert(): an fp16/bf16 cartridge re-encoded into other tiers equals a direct build in that tier,
byte for byte, when the model computes its K/V in the source's dtype; lossy sources are refused."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny_models import make_tiny

from cartridge.errors import InputError, OutputExistsError
from cartridge.format.layout import DATA_NAME, INDEX_NAME, MANIFEST_NAME
from cartridge.models.loader import LoadedModel, fingerprint

DOC = "Clause 7. The tenant shall return every key within 14 days of the end of the lease. " * 9
QUANTIZED = ["int8", "mlx4g32", "fp8", "mxfp4", "nvfp4", "turbo4", "turbo3", "turbo2"]


def _as_dtype(lm, dtype):
    """A tiny random model of head_dim 32 (the group-32 tiers need it) with its weights, and so its
    K/V, in `dtype`."""
    model = make_tiny(lm.tokenizer, seed=0, head_dim=32).model
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return LoadedModel(model, lm.tokenizer, f"tiny-{dtype}", fingerprint(model, lm.tokenizer))


@pytest.fixture(scope="module")
def tiny16(tiny):
    return _as_dtype(tiny, mx.float16)


@pytest.fixture(scope="module")
def tiny32(tiny):
    return _as_dtype(tiny, mx.float32)


def _files(path):
    return {name: (path / name).read_bytes() for name in (MANIFEST_NAME, INDEX_NAME, DATA_NAME)}


def _build_and_convert(lm, tmp_path, source_tier, **tiers):
    src = cartridge.build(DOC, tmp_path / "src.cart", model=lm, tier=source_tier, page_size=32,
                          source_name="lease.txt")
    # convert has no model to measure with: its presets are the fixed recipes, a build's with calibrate=False
    direct = cartridge.build(DOC, tmp_path / "direct.cart", model=lm, page_size=32, source_name="lease.txt",
                             calibrate=False, **tiers)
    conv = cartridge.convert(src.path, tmp_path / "conv.cart", **tiers)
    return direct, conv


@pytest.mark.parametrize("tier", QUANTIZED + ["bf16"])
def test_fp16_model_convert_equals_direct_build_bytes(tiny16, tmp_path, tier):
    direct, conv = _build_and_convert(tiny16, tmp_path, "fp16", tier=tier)
    assert conv.tokens == direct.tokens and conv.bytes == direct.bytes
    assert conv.bytes_per_token == direct.bytes_per_token and conv.schema == direct.schema
    assert _files(tmp_path / "conv.cart") == _files(tmp_path / "direct.cart")


@pytest.mark.parametrize("dtype, source, identical", [
    ("bfloat16", "bf16", True),
    ("bfloat16", "fp16", True),  # every bf16 value of this range is exact in fp16
    ("float16", "bf16", False),  # bf16 rounds away 3 mantissa bits of the fp16 K/V
    ("float32", "bf16", False),
])
def test_identical_exactly_when_the_source_holds_the_models_values(tiny, tmp_path, dtype, source, identical):
    lm = _as_dtype(tiny, getattr(mx, dtype))
    _build_and_convert(lm, tmp_path, source, tier="mlx4g32")
    assert (_files(tmp_path / "conv.cart") == _files(tmp_path / "direct.cart")) is identical


def test_schema_and_side_tiers_equal_direct_build(tiny16, tmp_path):
    schema = [{"layer": 0, "k": "fp16", "v": "turbo3"}, {"layer": 1, "k": "int8", "v": "mlx4g32"}]
    _build_and_convert(tiny16, tmp_path, "fp16", schema=schema)
    assert _files(tmp_path / "conv.cart") == _files(tmp_path / "direct.cart")
    cartridge.convert(tmp_path / "src.cart", tmp_path / "kv.cart", k_tier="int8", v_tier="mxfp4")
    info, _ = cartridge.open_cartridge(tmp_path / "kv.cart")
    assert info.tiers == [{"layer": i, "k": "int8", "v": "mxfp4"} for i in range(2)]


def test_float32_model_pages_differ_only_by_fp16_rounding(tiny32, tmp_path):
    """A float32 model: the direct build quantizes float32 K/V, convert their fp16 rounding. The
    header (and so the index) is the same; the pages are the encoding of two slightly different inputs."""
    direct, conv = _build_and_convert(tiny32, tmp_path, "fp16", tier="mlx4g32")
    d, c = _files(tmp_path / "direct.cart"), _files(tmp_path / "conv.cart")
    assert len(d[DATA_NAME]) == len(c[DATA_NAME])
    a, b = np.frombuffer(d[DATA_NAME], np.uint8), np.frombuffer(c[DATA_NAME], np.uint8)
    assert 0 < np.count_nonzero(a != b) < a.size // 4  # mostly equal, not identical
    di, _ = cartridge.open_cartridge(direct.path)
    ci, _ = cartridge.open_cartridge(conv.path)
    keys = set(di.records) - {k for k in di.records if k.endswith((".pages", ".head_sums"))}
    assert {k: di.records[k] for k in keys} == {k: ci.records[k] for k in keys}


def test_fp16_to_fp16_is_a_copy(tiny, tmp_path):
    src = cartridge.build(DOC, tmp_path / "src.cart", model=tiny, page_size=32)
    cartridge.convert(src.path, tmp_path / "same.cart")
    assert _files(tmp_path / "same.cart") == _files(tmp_path / "src.cart")


def test_converted_cartridge_loads_and_answers_like_direct(tiny16, tmp_path):
    _build_and_convert(tiny16, tmp_path, "fp16", tier="mlx4g32")
    cart = cartridge.load(tmp_path / "conv.cart", model=tiny16, attention="portable")
    assert cart.info.tiers[1] == {"layer": 1, "k": "mlx4g32", "v": "mlx4g32"}


@pytest.mark.parametrize("lossy", ["mlx4g32", "int8"])
def test_lossy_source_refused_in_one_line(tiny32, tmp_path, lossy):
    src = cartridge.build(DOC, tmp_path / "q.cart", model=tiny32, v_tier=lossy)
    with pytest.raises(InputError) as e:
        cartridge.convert(src.path, tmp_path / "out.cart", tier="turbo4")
    assert str(e.value) == (f"cartridge {src.path} stores layer 0 V as {lossy}; convert re-encodes fp16 or bf16 "
                            "pages only (rebuild from the document for another tier)")
    assert not (tmp_path / "out.cart").exists()


def test_output_exists_refused_before_reading(tiny32, tmp_path):
    src = cartridge.build(DOC, tmp_path / "src.cart", model=tiny32)
    other = cartridge.build(DOC, tmp_path / "other.cart", model=tiny32)
    with pytest.raises(OutputExistsError):
        cartridge.convert(src.path, other.path, tier="mlx4g32")
    r = cartridge.convert(src.path, other.path, tier="mlx4g32", force=True)
    assert cartridge.open_cartridge(r.path)[0].tiers[0]["k"] == "mlx4g32"


def test_output_naming_the_source_refused_even_with_force(tiny32, tmp_path):
    """A lossy result could never be converted back: the source is never replaced."""
    src = cartridge.build(DOC, tmp_path / "src.cart", model=tiny32)
    for out in (src.path, tmp_path / "x" / ".." / "src.cart"):
        with pytest.raises(InputError, match="is its source"):
            cartridge.convert(src.path, out, tier="mlx4g32", force=True)
    assert cartridge.open_cartridge(src.path)[0].tiers[0]["k"] == "fp16"


def test_bad_tier_options_refused(tiny32, tmp_path):
    src = cartridge.build(DOC, tmp_path / "src.cart", model=tiny32)
    with pytest.raises(InputError, match="unknown tier 'int3'"):
        cartridge.convert(src.path, tmp_path / "o.cart", tier="int3")
    with pytest.raises(InputError, match="boundary_protect 2 protects 4 layers; the model has 2"):
        cartridge.convert(src.path, tmp_path / "o.cart", tier="int8", boundary_protect=2)
    assert not (tmp_path / "o.cart").exists()


def test_cli_convert_and_one_line_refusal(tiny32, tmp_path):
    from helpers.clirun import run_inprocess, run_process

    def run(*args):
        return run_inprocess("convert", *args)

    src = cartridge.build(DOC, tmp_path / "src.cart", model=tiny32)
    r = run_process("convert", src.path, "-o", tmp_path / "q.cart", "--tier", "mlx4g32", "--boundary-protect", "1")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().startswith(f"converted {src.path} -> {tmp_path / 'q.cart'}: {src.tokens} tokens, ")
    assert "layers 0-1 K fp16 V fp16" in r.stdout.decode()  # 2 layers, N=1: both protected
    r = run(tmp_path / "q.cart", "-o", tmp_path / "r.cart", "--k-tier", "int8", "--v-tier", "int8")
    assert r.returncode == 0, r.stderr.decode()
    r = run(tmp_path / "r.cart", "-o", tmp_path / "s.cart", "--tier", "turbo4")
    assert r.returncode == 1 and not (tmp_path / "s.cart").exists()
    assert r.stderr.decode() == (f"error: cartridge {tmp_path / 'r.cart'} stores layer 0 K as int8; convert "
                                 "re-encodes fp16 or bf16 pages only (rebuild from the document for another tier)\n")


@pytest.mark.parametrize("preset", ["safe", "balanced", "compact"])
def test_preset_equals_direct_build_bytes_protected_copies_included(tiny16, tmp_path, preset):
    """An fp16 model: the fp16 pages hold the prefill's K/V exactly, so the preset's tiers and its fp16 copies
    of the first/last tokens are the direct build's, byte for byte."""
    direct, conv = _build_and_convert(tiny16, tmp_path, "fp16", preset=preset)
    assert _files(tmp_path / "conv.cart") == _files(tmp_path / "direct.cart")
    assert conv.bytes_per_token == direct.bytes_per_token and conv.schema == direct.schema
    info, _ = cartridge.open_cartridge(conv.path)
    want = cartridge.tiers.presets.resolve(preset)
    assert (conv.protect_first, conv.protect_last) == (info.protect_first, info.protect_last) == (
        want["protect_first"], want["protect_last"])
    assert info.tiers[0] == {"layer": 0, "k": want["k_tier"], "v": want["v_tier"]}


def test_protect_options_copy_the_source_tokens(tiny16, tmp_path):
    direct, conv = _build_and_convert(tiny16, tmp_path, "fp16", tier="mlx4g32", protect_first=3, protect_last=5)
    assert _files(tmp_path / "conv.cart") == _files(tmp_path / "direct.cart")
    src, data = cartridge.open_cartridge(tmp_path / "src.cart")
    (extent,) = src.extents[(1, "v")]
    pages = np.array(data.view(extent, "float16"))  # (n_pages, n_kv, P, D)
    data.close()
    v = pages.transpose(1, 0, 2, 3).reshape(pages.shape[1], -1, pages.shape[3])[:, : conv.tokens]  # (n_kv, T, D)
    info, _ = cartridge.open_cartridge(conv.path)
    np.testing.assert_array_equal(info.protected[(1, "v")], np.concatenate([v[:, :3], v[:, -5:]], axis=1))


@pytest.mark.parametrize("extra, flag", [({"tier": "int8"}, "tier"), ({"protect_last": 2}, "protect_last")])
def test_preset_beside_an_option_it_sets_refused(tiny16, tmp_path, extra, flag):
    src = cartridge.build(DOC, tmp_path / "src.cart", model=tiny16, page_size=32)
    with pytest.raises(InputError) as e:
        cartridge.convert(src.path, tmp_path / "o.cart", preset="safe", **extra)
    assert str(e.value) == f"preset 'safe' sets the tiers and protection; it cannot be combined with {flag}"
    with pytest.raises(InputError, match="unknown preset 'tiny'; known presets: exact, safe, balanced, compact"):
        cartridge.convert(src.path, tmp_path / "o.cart", preset="tiny")
    assert not (tmp_path / "o.cart").exists()


def test_preset_the_geometry_cannot_store_refused_naming_it(tiny, tmp_path):
    """The tiny model's head_dim 16 is not a whole group of mlx4g32's 32."""
    src = cartridge.build(DOC, tmp_path / "src.cart", model=tiny, page_size=32)
    with pytest.raises(InputError) as e:
        cartridge.convert(src.path, tmp_path / "o.cart", preset="balanced")
    assert str(e.value).startswith(f"preset 'balanced' cannot be applied to {src.path}: tier mlx4g32")
    assert not (tmp_path / "o.cart").exists()


def test_cli_convert_preset(tiny16, tmp_path):
    from click.testing import CliRunner

    from cartridge.cli.main import cli

    src = cartridge.build(DOC, tmp_path / "src.cart", model=tiny16, page_size=32)
    r = CliRunner().invoke(cli, ["convert", src.path, "-o", str(tmp_path / "b.cart"), "--preset", "balanced"])
    assert r.exit_code == 0, r.output
    assert r.output.rstrip().endswith("layers 0-1 K mlx4g32+rot V mlx4g32+rot; first 4 and last 28 tokens also fp16)")
    info, _ = cartridge.open_cartridge(tmp_path / "b.cart")
    assert (info.protect_first, info.protect_last) == (4, 28)
    shown = CliRunner().invoke(cli, ["inspect", str(tmp_path / "b.cart")]).output.splitlines()
    assert [line for line in shown if line.startswith("preset")] == ["preset        balanced"]


def test_preset_is_recorded_by_build_and_convert_and_never_copied(tiny16, tmp_path):
    from cartridge.cli.report import preset

    exact = cartridge.build(DOC, tmp_path / "exact.cart", model=tiny16, page_size=32, preset="exact",
                            calibrate=False)
    plain = cartridge.convert(exact.path, tmp_path / "int8.cart", tier="int8")
    safe = cartridge.convert(exact.path, tmp_path / "safe.cart", preset="safe")
    shown = [preset(cartridge.open_cartridge(p)[0]) for p in (exact.path, plain.path, safe.path)]
    assert shown == ["exact", None, "safe"]
