"""`--tiers` entries, `--schemas` files, and the keyed build cache of `cartridge eval`."""

import json

import pytest

from cartridge.errors import InputError
from cartridge.eval.spec import (
    REFERENCE,
    Spec,
    build_or_reuse,
    cache_key,
    cartridge_path,
    check_supported,
    load_schemas,
    parse_entry,
    parse_tiers,
)

DOC = "The deposit is 1,200 euros.\n\nThe lease ends on 30 June 2031.\n"


def test_parse_entries():
    assert parse_entry("fp16") == Spec("fp16", {"tier": "fp16"})
    assert parse_entry("bf16:bp2") == Spec("bf16:bp2", {"tier": "bf16", "boundary_protect": 2})
    assert parse_entry(" k=fp16:v=bf16 ") == Spec("k=fp16:v=bf16", {"k_tier": "fp16", "v_tier": "bf16"})
    assert parse_entry("k=fp16:v=bf16:bp0").options == {"k_tier": "fp16", "v_tier": "bf16", "boundary_protect": 0}
    assert [s.label for s in parse_tiers("fp16,bf16:bp1")] == ["fp16", "bf16:bp1"]
    assert parse_entry("preset=balanced:kenc=score").options == {"preset": "balanced", "k_encoder": "score"}
    assert parse_entry("preset=compact:kenc=score:kscale:venc=output").options == {
        "preset": "compact", "k_encoder": "score", "k_scale": True, "v_encoder": "output"}
    assert parse_entry("preset=balanced:kenc=nearest:nokscale").options == {
        "preset": "balanced", "k_encoder": "nearest", "k_scale": False}


@pytest.mark.parametrize("text, expect", [
    ("int3", "--tiers entry 'int3': unknown tier 'int3'; known tiers: "),
    ("fp16:bpx", "field 'bpx' must be bp followed by a whole number of layers"),
    ("fp16:x+y", "field 'x\\+y' is not TIER, k=TIER, v=TIER, bpN, pfN, plN, preset=NAME, kenc=NAME, kscale, "
                 "nokscale or venc=NAME \\(known tiers: fp16, "),
    ("preset=balanced:venc=gptq", "V encoder 'gptq' is not one of nearest, output"),
    ("fp16:kscale:kscale", "k_scale given twice"),
    ("preset=balanced:kenc=gptq", "K encoder 'gptq' is not one of nearest, score"),
    ("fp16:bf16", "tier given twice"),
    ("k=fp16:k=bf16", "k_tier given twice"),
    ("k=:v=fp16", "empty tier name"),
    ("fp16,,bf16", "empty entry"),
    ("fp16,fp16", "lists fp16 more than once"),
])
def test_bad_tiers(text, expect):
    with pytest.raises(InputError, match=expect):
        parse_tiers(text)


def test_load_schemas_lists_keywords_and_schema_files(tmp_path):
    rows = [{"layer": 0, "k": "fp16", "v": "bf16"}, {"layer": 1, "k": "bf16", "v": "bf16"}]
    (tmp_path / "s.json").write_text(json.dumps(rows))
    (tmp_path / "schemas.json").write_text(json.dumps({
        "mixed": rows, "keywords": {"tier": "bf16", "boundary_protect": 1}, "from-file": {"schema": "s.json"}}))
    specs = load_schemas(tmp_path / "schemas.json")
    assert specs == [Spec("mixed", {"schema": rows}), Spec("keywords", {"tier": "bf16", "boundary_protect": 1}),
                     Spec("from-file", {"schema": rows})]


@pytest.mark.parametrize("doc, expect", [
    ({}, "non-empty JSON object"),
    ({"x": 3}, "expected a schema list or a dict of build keywords"),
    ({"x": {"tier": "fp16", "bits": 4}}, "unknown build keyword\\(s\\) bits"),
    ({"x": {"tier": "fp16", "boundary_protect": -1}}, "boundary_protect must be an integer >= 0, found -1"),
    ({"x": [{"layer": 0, "k": "fp16"}]}, "schema row 0 must be"),
    ({"x": [{"layer": 0, "k": "fp16", "v": "q9"}]}, "unknown tier 'q9'"),
    ({"x": {"schema": "missing.json"}}, "schema file .*missing.json cannot be read"),
    ({"x": {"tier": "mlx4g32", "k_encoder": "gptq"}}, "label 'x': K encoder 'gptq' is not one of nearest, score"),
])
def test_bad_schemas(tmp_path, doc, expect):
    path = tmp_path / "schemas.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=expect):
        load_schemas(path)


def test_check_supported_refuses_before_building():
    with pytest.raises(InputError, match="'x' needs build option\\(s\\) no_such_option"):
        check_supported(Spec("x", {"tier": "fp16", "no_such_option": 1}), 2)
    with pytest.raises(InputError, match="schema has 1 layer row; the model has 2 layers"):
        check_supported(Spec("x", {"schema": [{"layer": 0, "k": "fp16", "v": "fp16"}]}), 2)
    check_supported(REFERENCE, 2)


def test_cache_key_changes_with_what_decides_the_bytes():
    base = cache_key(DOC, "fp-a", REFERENCE, 256)
    assert base == cache_key(DOC, "fp-a", Spec("another label", {"tier": "fp16"}), 256)  # label is not content
    others = {cache_key(DOC + " ", "fp-a", REFERENCE, 256), cache_key(DOC, "fp-b", REFERENCE, 256),
              cache_key(DOC, "fp-a", parse_entry("bf16"), 256), cache_key(DOC, "fp-a", REFERENCE, 128)}
    assert base not in others and len(others) == 4
    assert cache_key(DOC, "fp-a", parse_entry("mlx4g32:kenc=score"), 256) != \
        cache_key(DOC, "fp-a", parse_entry("mlx4g32"), 256)
    # a preset's default encoders are part of what it builds (issue 49): not the key of the nearest encoding
    assert cache_key(DOC, "fp-a", parse_entry("preset=balanced"), 256) != \
        cache_key(DOC, "fp-a", parse_entry("preset=balanced:kenc=nearest:nokscale"), 256)


def test_build_then_reuse_then_rebuild(tiny, tmp_path):
    spec = parse_entry("bf16")
    path = cartridge_path(tmp_path / "work", "qa", spec, cache_key(DOC, tiny.fingerprint["id"], spec, 16))
    assert path.name.startswith("bf16-qa-") and path.name.endswith(".cart")
    p1, built1 = build_or_reuse(DOC, spec, tiny, path, 16)
    mtime = (p1 / "MANIFEST").stat().st_mtime_ns
    p2, built2 = build_or_reuse(DOC, spec, tiny, path, 16)
    assert (p1, built1, built2) == (path, True, False)
    assert (p2 / "MANIFEST").stat().st_mtime_ns == mtime
    _, built3 = build_or_reuse(DOC, spec, tiny, path, 16, rebuild=True)
    assert built3


@pytest.mark.parametrize("given", ["", " ", ","])
def test_an_empty_tiers_option_is_refused_not_read_as_every_tier(given):
    from cartridge.cli.eval import _specs

    with pytest.raises(InputError, match="--tiers is empty"):
        _specs(given, None)
    assert len(_specs(None, None)) > 10  # left out: every tier
