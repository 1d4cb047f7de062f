"""Per-layer tier schemas: build options -> schema, JSON files, refusals before any prefill, inspect."""

import importlib
import json

import pytest
import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
from helpers.tiny_models import make_tiny
from helpers.clirun import run_inprocess as run

from cartridge.cli.report import inspect_dict, inspect_table
from cartridge.tiers.schema import check_layer_count, fold_tiers, tier_runs_text
from cartridge.errors import InputError
from cartridge.tiers import read_schema, schema_for

build_module = importlib.import_module("cartridge.write.build")
DOC = "Section 1. The lessee may terminate the agreement with 30 days of written notice. " * 4


def sides(schema):
    return [(r["k"], r["v"]) for r in schema]


def test_tier_sets_both_sides():
    assert sides(schema_for(3, "int8")) == [("int8", "int8")] * 3


def test_k_and_v_tier_override_one_side():
    assert sides(schema_for(2, "mlx4g32", k_tier="fp8")) == [("fp8", "mlx4g32")] * 2
    assert sides(schema_for(2, k_tier="turbo4", v_tier="turbo3")) == [("turbo4", "turbo3")] * 2


def test_boundary_protect_keeps_k_fp16_and_v_fp16_at_both_ends():
    s = schema_for(8, "mlx4g32", boundary_protect=2)
    assert [r["k"] for r in s] == ["fp16"] * 8
    assert [r["v"] for r in s] == ["fp16", "fp16"] + ["mlx4g32"] * 4 + ["fp16", "fp16"]
    assert [r["v"] for r in schema_for(4, "fp8", v_tier="turbo2", boundary_protect=1)] == \
        ["fp16", "turbo2", "turbo2", "fp16"]
    assert [r["v"] for r in schema_for(4, "turbo3", boundary_protect=2)] == ["fp16"] * 4


@pytest.mark.parametrize("kwargs, match", [
    ({"tier": "int4"}, "unknown tier 'int4'; known tiers: fp16, bf16, int8, int6, mlx4g32"),
    ({"v_tier": "q8"}, "unknown tier 'q8'"),
    ({"boundary_protect": -1}, "boundary_protect is -1; it must be an integer >= 0"),
    ({"boundary_protect": 2.5}, "boundary_protect is 2.5"),
    ({"boundary_protect": 3}, "boundary_protect 3 protects 6 layers; the model has 4"),
    ({"tier": "int8", "k_tier": "int8", "boundary_protect": 1}, "k_tier 'int8' conflicts with boundary_protect 1"),
])
def test_bad_options_refused(kwargs, match):
    with pytest.raises(InputError, match=match):
        schema_for(4, **kwargs)


def test_schema_from_list_and_file(tmp_path):
    rows = [{"layer": 1, "k": "fp8", "v": "turbo3"}, {"layer": 0, "k": "fp16", "v": "int8"}]
    assert read_schema(rows) == sorted(rows, key=lambda r: r["layer"])
    path = tmp_path / "s.json"
    path.write_text(json.dumps(rows))
    assert read_schema(path) == read_schema(str(path)) == read_schema(rows)


@pytest.mark.parametrize("content, match", [
    ("[{\"layer\": 0, \"k\": \"fp16\", \"v\": ", "is not valid JSON: Expecting value: line 1 column 33"),
    ("{\"layer\": 0}", "must be a non-empty JSON list"),
    ("[]", "must be a non-empty JSON list"),
    ("[{\"layer\": 0, \"k\": \"fp16\"}]", "schema row 0 must be an object with exactly the keys layer, k, v"),
    ("[{\"layer\": 0, \"k\": \"fp16\", \"v\": \"fp16\", \"x\": 1}]", "exactly the keys layer, k, v"),
    ("[{\"layer\": \"0\", \"k\": \"fp16\", \"v\": \"fp16\"}]", "schema row 0: layer is '0'; expected an integer"),
    ("[{\"layer\": 0, \"k\": 16, \"v\": \"fp16\"}]", "schema row 0: k is 16; expected a tier name"),
    ("[{\"layer\": 0, \"k\": \"fp16\", \"v\": \"int5\"}]", "unknown tier 'int5'"),
    ("[{\"layer\": 0, \"k\": \"fp16\", \"v\": \"fp16\"}, {\"layer\": 0, \"k\": \"fp16\", \"v\": \"fp16\"}]",
     "^schema names layer 0 more than once \\(one row a layer\\)$"),
])
def test_bad_schema_files_refused(tmp_path, content, match):
    path = tmp_path / "s.json"
    path.write_text(content)
    with pytest.raises(InputError, match=match):
        read_schema(path)


@pytest.mark.parametrize("layers, message", [
    ([0, 1, 99], "schema names layer 99; the model has 30 layers (0..29)"),
    (list(range(29)) + [99], "schema names layer 99; the model has 30 layers (0..29)"),
    ([-1, 0], "schema names layer -1; the model has 30 layers (0..29)"),
    (list(range(30)) + [30, 31], "schema names layer 30-31; the model has 30 layers (0..29)"),
    ([0, 2], "schema has no row for layer 1, 3-29; the model has 30 layers (0..29)"),
    ([0, 1], "schema has 2 layer rows; the model has 30 layers"),
    ([0, 0, 1], "schema names layer 0 more than once (one row a layer)"),
])
def test_schema_layers_checked_against_the_model(layers, message):
    rows = [{"layer": n, "k": "fp16", "v": "fp16"} for n in layers]
    with pytest.raises(InputError) as e:
        check_layer_count(rows, 30)
    assert str(e.value) == message
    check_layer_count([{"layer": n, "k": "fp16", "v": "fp16"} for n in range(30)], 30)


def test_missing_schema_file_refused(tmp_path):
    with pytest.raises(InputError, match="schema file .*nope.json: No such file or directory"):
        read_schema(tmp_path / "nope.json")


@pytest.fixture(scope="module")
def tiny64(smol_tokenizer):
    return make_tiny(smol_tokenizer, seed=0, head_dim=64, num_hidden_layers=4)


@pytest.mark.parametrize("kwargs, match", [
    ({"tier": "mlx4g32"}, "tier mlx4g32: head_dim 16 is not a multiple of the group size 32"),
    ({"v_tier": "fp8"}, "tier fp8: head_dim 16 is not a multiple of the group size 32"),
    ({"tier": "turbo4"}, "tier turbo4: head_dim 16 is not a power of two >= 32"),
    ({"boundary_protect": 2, "tier": "nvfp4"}, "boundary_protect 2 protects 4 layers; the model has 2"),
    ({"schema": [{"layer": 0, "k": "fp16", "v": "fp16"}]}, "schema has 1 layer row; the model has 2 layers"),
    ({"schema": [{"layer": 0, "k": "fp16", "v": "fp16"}], "tier": "int8"}, "schema sets the tier of every .* cannot be combined with tier"),
    ({"schema": [{"layer": 0, "k": "fp16", "v": "fp16"}], "boundary_protect": 1, "v_tier": "fp8"},
     "cannot be combined with v_tier, boundary_protect"),
    ({"tier": "bf16", "boundary_protect": -2}, "boundary_protect is -2"),
])
def test_build_refuses_before_any_prefill(tiny, tmp_path, monkeypatch, kwargs, match):
    calls = []
    monkeypatch.setattr(build_module, "prefill", lambda *a, **k: calls.append(a))
    with pytest.raises(InputError, match=match):
        cartridge.build(DOC, tmp_path / "x.cart", model=tiny, **kwargs)
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_turbo_head_dim_not_power_of_two_refused(smol_tokenizer, tmp_path):
    odd = make_tiny(smol_tokenizer, seed=0, head_dim=96)
    with pytest.raises(InputError, match="tier turbo2: head_dim 96 is not a power of two"):
        cartridge.build(DOC, tmp_path / "x.cart", model=odd, v_tier="turbo2")
    cartridge.build(DOC, tmp_path / "ok.cart", model=odd, tier="mlx4g32")  # 96 = 3 groups of 32


def test_mixed_schema_builds_and_inspect_folds_runs(tiny64, tmp_path):
    rows = [{"layer": 0, "k": "fp16", "v": "fp16"}, {"layer": 1, "k": "fp8", "v": "turbo3"},
            {"layer": 2, "k": "fp8", "v": "turbo3"}, {"layer": 3, "k": "int8", "v": "nvfp4"}]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(rows))
    r = cartridge.build(DOC, tmp_path / "m.cart", model=tiny64, schema=path, page_size=32)
    info, _ = cartridge.open_cartridge(r.path)
    assert info.tiers == rows == r.schema
    d = inspect_dict(info, r.path)
    assert d["tier_runs"] == [{"layers": "0", "k": "fp16", "v": "fp16"}, {"layers": "1-2", "k": "fp8", "v": "turbo3"},
                              {"layers": "3", "k": "int8", "v": "nvfp4"}]
    kv = 2 * 64  # n_kv_heads 2 x head_dim 64
    per_layer = [4 * kv, (kv + kv // 32) + (3 * kv // 8 + 4), (kv + kv // 32) + (3 * kv // 8 + 4),
                 (kv + kv // 8) + (kv // 2 + kv // 16)]
    assert d["bytes_per_token"] == r.bytes_per_token == sum(per_layer)
    assert d["tier_formulas"] == {
        "fp16": {"formula": "2 * kv_dim", "bytes_per_token_per_layer_side": 256},
        "fp8": {"formula": "kv_dim + kv_dim/32", "bytes_per_token_per_layer_side": 132},
        "turbo3": {"formula": "3 * kv_dim/8 + 2 * H", "bytes_per_token_per_layer_side": 52},
        "int8": {"formula": "kv_dim + kv_dim/8", "bytes_per_token_per_layer_side": 144},
        "nvfp4": {"formula": "kv_dim/2 + kv_dim/16", "bytes_per_token_per_layer_side": 72},
    }
    table = inspect_table(d)
    assert "1-2     fp8      turbo3   " + f"{per_layer[1]:,}" in table
    assert "turbo3   3 * kv_dim/8 + 2 * H = 52" in table
    assert info.params[(1, "v")]["bits"] == 3 and info.params[(3, "v")]["global_scale"] > 0


def test_boundary_protect_build_and_inspect(tiny64, tmp_path):
    r = cartridge.build(DOC, tmp_path / "b.cart", model=tiny64, tier="mlx4g32", boundary_protect=1)
    info, _ = cartridge.open_cartridge(r.path)
    assert fold_tiers(info.tiers) == [{"layers": "0", "k": "fp16", "v": "fp16"},
                                      {"layers": "1-2", "k": "fp16", "v": "mlx4g32"},
                                      {"layers": "3", "k": "fp16", "v": "fp16"}]
    assert tier_runs_text(info.tiers) == "layer 0 K fp16 V fp16; layers 1-2 K fp16 V mlx4g32; layer 3 K fp16 V fp16"


def test_builds_are_byte_identical(tiny64, tmp_path):
    """Same document, model and schema: the same pages.bin and index.lmdb, for quantized tiers too."""
    a = cartridge.build(DOC, tmp_path / "a.cart", model=tiny64, k_tier="turbo3", v_tier="mxfp4")
    b = cartridge.build(DOC, tmp_path / "b.cart", model=tiny64, k_tier="turbo3", v_tier="mxfp4")
    for name in ("pages.bin", "index.lmdb", "MANIFEST"):
        assert (tmp_path / "a.cart" / name).read_bytes() == (tmp_path / "b.cart" / name).read_bytes()
    assert a.bytes_per_token == b.bytes_per_token


def test_cli_tier_options_and_schema(tiny_dir, tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text(DOC)
    out = tmp_path / "bp.cart"
    r = run("build", corpus, "-o", out, "--model", tiny_dir, "--tier", "bf16", "--boundary-protect", "1",
            "--page-size", "16")
    assert r.returncode == 0, r.stderr.decode()
    assert "layers 0-1 K fp16 V fp16" in r.stdout.decode()  # 2 layers, both protected
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps([{"layer": 0, "k": "bf16", "v": "fp16"}, {"layer": 1, "k": "fp16", "v": "bf16"}]))
    r = run("build", corpus, "-o", tmp_path / "s.cart", "--model", tiny_dir, "--schema", schema)
    assert r.returncode == 0, r.stderr.decode()
    table = run("inspect", tmp_path / "s.cart").stdout.decode()
    assert "0       bf16     fp16" in table and "1       fp16     bf16" in table
    r = run("ask", tmp_path / "s.cart", "Who may terminate?", "--max-tokens", "3")
    assert r.returncode == 0, r.stderr.decode()


@pytest.mark.parametrize("args, expect", [
    (["--tier", "q4"], "error: unknown tier 'q4'"),
    (["--k-tier", "mlx4g32"], "error: layer 0 k (attention, 2 kv heads x head_dim 16): tier mlx4g32: head_dim 16 is not a multiple of the group size 32"),
    (["--boundary-protect", "-1"], "error: Invalid value for '--boundary-protect': -1 is not in the range x>=0"),
    (["--boundary-protect", "2"], "error: boundary_protect 2 protects 4 layers; the model has 2"),
    (["--schema", "missing.json"], "error: schema file missing.json: No such file or directory"),
    (["--schema", "bad.json"], "error: schema file bad.json is not valid JSON"),
    (["--schema", "short.json"], "error: schema has 1 layer row; the model has 2 layers"),
    (["--schema", "beyond.json"], "error: schema names layer 99; the model has 2 layers (0..1)"),
    (["--schema", "short.json", "--v-tier", "fp16"], "error: --schema sets the tier of every (layer, side); it cannot be combined with --v-tier"),
])
def test_cli_bad_tier_options_one_line(tiny_dir, tmp_path, monkeypatch, args, expect):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text(DOC)
    (tmp_path / "bad.json").write_text("[{")
    (tmp_path / "short.json").write_text(json.dumps([{"layer": 0, "k": "fp16", "v": "fp16"}]))
    (tmp_path / "beyond.json").write_text(json.dumps([{"layer": n, "k": "fp16", "v": "fp16"} for n in (0, 1, 99)]))
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run("build", "doc.txt", "-o", "x.cart", "--model", tiny_dir, *args)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode != 0 and len(err) == 1, err
    assert err[0].startswith(expect), err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _records(path):
    from cartridge.format.container import read_index, read_manifest

    manifest = read_manifest(path)
    return read_index(path, manifest), manifest


def test_quantized_headers_match_the_json_schema(tiny64, tmp_path):
    import jsonschema
    from helpers import ROOT

    spec = json.loads((ROOT / "spec" / "header.schema.json").read_text())
    rows = [{"layer": 0, "k": "turbo4", "v": "turbo2"}, {"layer": 1, "k": "nvfp4", "v": "mxfp4"},
            {"layer": 2, "k": "fp8", "v": "int8"}, {"layer": 3, "k": "mlx4g32", "v": "turbo3"}]
    r = cartridge.build(DOC, tmp_path / "h.cart", model=tiny64, schema=rows)
    records, _ = _records(r.path)
    header = {k: json.loads(v) for k, v in records.items() if k != "tokens.ids" and not k.endswith((".pages", ".head_sums", ".protected"))}
    jsonschema.validate(header, spec)
    header["layer.0.k.params"]["norm"] = "rms"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(header, spec)


@pytest.mark.parametrize("key, change, match", [
    ("layer.1.v.params", {"signs": None}, "layer 1 v: tier turbo3: params.signs must be 2 x 64 values"),
    ("layer.0.k.params", {"global_scale": 0}, "layer 0 k: tier nvfp4: params.global_scale is 0"),
    ("layer.0.v.params", {"group_size": 64}, "layer 0 v: tier mlx4g32: params.group_size is 64; expected 32"),
])
def test_reader_refuses_params_its_tier_cannot_use(tiny64, tmp_path, key, change, match):
    from cartridge.errors import CorruptCartridgeError
    from cartridge.format.header import parse_header

    rows = [{"layer": i, "k": "nvfp4", "v": "mlx4g32" if i == 0 else "turbo3"} for i in range(4)]
    r = cartridge.build(DOC, tmp_path / "p.cart", model=tiny64, schema=rows)
    records, manifest = _records(r.path)
    assert parse_header(records, manifest).params[(1, "v")]["norm"] in ("raw", "corrected")
    bad = dict(records, **{key: json.dumps({**json.loads(records[key]), **change}).encode()})
    with pytest.raises(CorruptCartridgeError, match=match):
        parse_header(bad, manifest)


def test_inspect_tier_columns_fit_the_longest_tier_name(tiny64, tmp_path):
    r = cartridge.build(DOC, tmp_path / "m.cart", model=tiny64, k_tier="mlx4g32+rot", v_tier="int8")
    info, _ = cartridge.open_cartridge(r.path)
    lines = inspect_table(inspect_dict(info, r.path)).splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("tiers "))
    row = lines[head + 1]
    assert row.split()[1:3] == ["mlx4g32+rot", "int8"]
    assert lines[head].index(" V ") + 1 == row.index("int8")  # the V column starts where its header does
