"""extend(): only the new text is prefilled; the result holds the tokens, pages and answers of a one-shot
build of the joined text; it is written atomically and records its parts."""

import hashlib
import json
import shutil

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers.cartfiles import forge_records
from helpers import ROOT
from helpers.tiny_models import make_tiny

from cartridge.errors import InputError, OutputExistsError
from cartridge.grow.extend import EXTEND_SEPARATOR, token_sha256
from cartridge.tiers import TIERS

OLD = "Section 1. The lessee may terminate the agreement with 30 days of written notice. " * 3 + "The end."
NEW = "Section 2. Rent is due on the first day of each month, payable to the lessor by bank transfer."
PAGE = 16


def _tokens_major(data, extent):
    """An extent's pages as (n_kv_heads, n_pages * page_size, width), stored dtype (bf16 as uint16)."""
    a = data.view(extent, "<u2" if extent.dtype == "bfloat16" else extent.dtype)
    # (n_pages, n_kv, P, W) -> (n_kv, n_pages * P, W)
    return a.transpose(1, 0, 2, 3).reshape(a.shape[1], -1, a.shape[-1])


def _last_logits(cart, question):
    cache = cart.prompt_cache()
    logits = cart.model(mx.array(cart.question_prompt(question))[None], cache=cache)
    return np.array(logits[0, -1].astype(mx.float32))


def _greedy(cart, question, n=12):
    return [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(question),
                                                    max_tokens=n, prompt_cache=cart.prompt_cache())]


@pytest.fixture(scope="module")
def carts(tiny, tmp_path_factory):
    """A cartridge of OLD, its extension by NEW, and a one-shot build of the joined text (fp16)."""
    d = tmp_path_factory.mktemp("extend")
    cartridge.build(OLD, d / "old.cart", model=tiny, page_size=PAGE)
    ext = cartridge.extend(d / "old.cart", NEW, output=d / "ext.cart", model=tiny)
    one = cartridge.build(OLD + EXTEND_SEPARATOR + NEW, d / "one.cart", model=tiny, page_size=PAGE)
    return d, ext, one


@pytest.mark.parametrize("tier", sorted(t for t in TIERS if not getattr(TIERS[t], "token_group", None)))
def test_encoding_is_per_token(tier):
    """What extend's page splice relies on: a token's codes do not depend on the other tokens."""
    x = mx.random.normal((2, 37, 64), key=mx.random.key(1)) * 3
    codec = TIERS[tier]
    params = codec.make_params(x, 0, "v")
    whole, part = codec.encode(x, params), codec.encode(x[:, 11:], params)
    for name in whole:
        a, b = whole[name][:, 11:], part[name]
        assert a.dtype == b.dtype and mx.array_equal(a, b).item(), name


def test_extend_tokens_are_the_one_shot_tokens_of_the_joined_text(carts):
    d, ext, one = carts
    old = cartridge.open_cartridge(d / "old.cart")[0]
    info = cartridge.open_cartridge(ext.path)[0]
    assert info.tokens.tolist() == cartridge.open_cartridge(one.path)[0].tokens.tolist()
    assert ext.tokens == one.tokens and ext.reused_tokens == len(old.tokens)
    assert ext.new_tokens == one.tokens - len(old.tokens) > 0
    assert len(old.tokens) % PAGE != 0  # the stored last page was partial: the splice was exercised
    assert info.format_version == "1.11" and info.document_tokens == one.tokens
    assert [(p["kind"], p["start"], p["end"]) for p in info.parts] == [
        ("build", 0, len(old.tokens)), ("extend", len(old.tokens), one.tokens)]
    assert info.parts[1]["tokens_sha256"] == token_sha256(info.tokens[len(old.tokens):])
    assert cartridge.verify_cartridge(ext.path).ok


def test_extend_pages_match_one_shot_build(carts):
    """Stored tokens keep their exact bytes, padding is what build writes, new tokens are within fp16
    rounding of a one-shot prefill (they attended over the fp16-rounded prefix)."""
    d, ext, one = carts
    n_old = len(cartridge.open_cartridge(d / "old.cart")[0].tokens)
    ie, de = cartridge.open_cartridge(ext.path)
    io, do = cartridge.open_cartridge(one.path)
    i0, d0 = cartridge.open_cartridge(d / "old.cart")
    for key, extents in ie.extents.items():
        a, b = _tokens_major(de, extents[0]), _tokens_major(do, io.extents[key][0])
        assert a.shape == b.shape
        np.testing.assert_array_equal(a[:, :n_old], _tokens_major(d0, i0.extents[key][0])[:, :n_old])  # copied
        # a one-shot prefill of the same tokens in other chunks: equal up to float rounding (OpenBLAS blocks by M)
        np.testing.assert_allclose(a[:, :n_old].astype(np.float32), b[:, :n_old], atol=4e-3)
        np.testing.assert_array_equal(a[:, one.tokens:], b[:, one.tokens:])
        np.testing.assert_allclose(a[:, n_old:one.tokens].astype(np.float32), b[:, n_old:one.tokens], atol=4e-3)


def test_extend_answers_like_one_shot_build(carts, tiny):
    _, ext, one = carts
    ce, co = cartridge.load(ext.path, model=tiny), cartridge.load(one.path, model=tiny)
    for q in ("When is rent due?", "How much notice does the lessee give?"):
        np.testing.assert_allclose(_last_logits(ce, q), _last_logits(co, q), atol=2e-3)
        assert _greedy(ce, q) == _greedy(co, q)


@pytest.fixture(scope="module")
def tiny64(smol_tokenizer):
    return make_tiny(smol_tokenizer, seed=0, head_dim=64)  # group-quantized tiers need head_dim % 32 == 0


@pytest.mark.parametrize("tier", ["fp16", "mlx4g32"])
def test_prefill_over_stored_pages_writes_what_the_decoded_prefill_writes(tiny64, tmp_path, tier):
    """attention="portable" (stored pages, `CartridgeCache`) and the default (decoded prefix,
    `PrefillCache`) attend over the same values: the same ids, new tokens' codes within rounding."""
    cartridge.build(OLD, tmp_path / "old.cart", model=tiny64, tier=tier, page_size=PAGE)
    a = cartridge.extend(tmp_path / "old.cart", NEW, output=tmp_path / "a.cart", model=tiny64)
    b = cartridge.extend(tmp_path / "old.cart", NEW, output=tmp_path / "b.cart", model=tiny64, attention="portable")
    (ia, da), (ib, db) = cartridge.open_cartridge(a.path), cartridge.open_cartridge(b.path)
    assert ia.tokens.tolist() == ib.tokens.tolist() and a.new_tokens == b.new_tokens > 0
    for key, extents in ia.extents.items():
        for ea, eb in zip(extents, ib.extents[key]):
            x, y = _tokens_major(da, ea), _tokens_major(db, eb)
            if ea.dtype == "float16":
                np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), atol=2e-3)
            else:  # codes: float rounding may move a value across a code boundary, rarely
                assert (x == y).mean() >= 0.999, (key, (x == y).mean())


@pytest.mark.parametrize("tier", ["mlx4g32", "turbo3", "nvfp4", "bf16"])
def test_quantized_extend_keeps_stored_codes(tiny64, tmp_path, tier):
    """A quantized cartridge: stored tokens' codes are copied, new tokens encoded in its tier."""
    tiny = tiny64
    cartridge.build(OLD, tmp_path / "old.cart", model=tiny, tier=tier, page_size=PAGE)
    ext = cartridge.extend(tmp_path / "old.cart", NEW, output=tmp_path / "ext.cart", model=tiny)
    one = cartridge.build(OLD + EXTEND_SEPARATOR + NEW, tmp_path / "one.cart", model=tiny, tier=tier, page_size=PAGE)
    io, do = cartridge.open_cartridge(tmp_path / "old.cart")
    ie, de = cartridge.open_cartridge(ext.path)
    i1, d1 = cartridge.open_cartridge(one.path)
    n = len(io.tokens)
    assert ie.tiers == io.tiers and ie.params == io.params
    for key, extents in ie.extents.items():
        for old_e, new_e, one_e in zip(io.extents[key], extents, i1.extents[key]):
            np.testing.assert_array_equal(_tokens_major(de, new_e)[:, :n], _tokens_major(do, old_e)[:, :n])
            if tier != "nvfp4":  # nvfp4's global scale is the amax of what was built: the joined text's differs
                # the one-shot build prefilled these tokens in other chunks: its float rounding may move a
                # value across a code boundary (seen: 1 of 11,136 bf16 values) or a scale/bias by an ulp
                # (seen: 1 of 348 fp16 biases), nothing more
                got, want = _tokens_major(de, new_e)[:, :n], _tokens_major(d1, one_e)[:, :n]
                if got.dtype.kind == "f":
                    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=1e-6)
                else:
                    assert (got != want).sum() <= max(1, got.size // 1000), (key, (got != want).sum(), got.size)
    assert cartridge.verify_cartridge(ext.path).ok


def test_extend_in_place_replaces_only_the_finished_cartridge(tiny, tmp_path):
    path = tmp_path / "doc.cart"
    cartridge.build(OLD, path, model=tiny, page_size=PAGE)
    before = cartridge.open_cartridge(path)[0]
    r = cartridge.extend(path, NEW, model=tiny)
    after = cartridge.open_cartridge(path)[0]
    assert r.path == str(path) and len(after.tokens) == r.tokens > len(before.tokens)
    assert after.tokens[: len(before.tokens)].tolist() == before.tokens.tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.cart"]  # no temporaries left
    assert len(after.lineage_source) == 64


def test_extend_twice_records_three_parts(tiny, tmp_path):
    path = tmp_path / "doc.cart"
    cartridge.build(OLD, path, model=tiny, page_size=PAGE)
    cartridge.extend(path, NEW, model=tiny)
    cartridge.extend(path, "Section 3. Pets are allowed.", model=tiny)
    info = cartridge.open_cartridge(path)[0]
    one = cartridge.build(OLD + "\n\n" + NEW + "\n\nSection 3. Pets are allowed.", tmp_path / "one.cart", model=tiny)
    assert info.tokens.tolist() == cartridge.open_cartridge(one.path)[0].tokens.tolist()
    assert [p["kind"] for p in info.parts] == ["build", "extend", "extend"]


def _entry(text, name):
    raw = text.encode()
    first = next(line.strip() for line in text.splitlines() if line.strip())
    return {"name": name, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(), "first_line": first[:120]}


def test_every_source_kept_in_order_and_shown_by_inspect(tiny, tmp_path):
    """source.documents (format 1.7): build writes one source, each extend appends one; inspect shows each."""
    from cartridge.cli.report import inspect_dict, inspect_table

    path, third = tmp_path / "doc.cart", "Section 3. Pets are allowed."
    cartridge.build(OLD, path, model=tiny, page_size=PAGE, source_name="dir/lease.txt")
    cartridge.extend(path, NEW, model=tiny, source_name="rent.txt")
    cartridge.extend(path, third, model=tiny)
    info = cartridge.open_cartridge(path)[0]
    want = [_entry(OLD, "lease.txt"), _entry(NEW, "rent.txt"), _entry(third, "")]
    assert info.sources == want
    assert info.source == {"name": "lease.txt", "bytes": None, "sha256": None, "first_line": want[0]["first_line"]}
    table = inspect_table(inspect_dict(info, path))
    assert (f"document      lease.txt, {want[0]['bytes']:,} bytes, sha256 {want[0]['sha256']}\n"
            f"first line    {want[0]['first_line']!r}\n"
            f"document 2    rent.txt, {want[1]['bytes']:,} bytes, sha256 {want[1]['sha256']}\n"
            f"first line    {want[1]['first_line']!r}\n"
            f"document 3    -, {want[2]['bytes']:,} bytes, sha256 {want[2]['sha256']}\n") in table
    assert inspect_dict(info, path)["sources"] == want


def test_cartridge_without_the_sources_list_shows_its_one_source(tiny, tmp_path):
    """A 1.6 cartridge (single source keys only) keeps loading; extended, its first source keeps what it recorded."""
    path = tmp_path / "old.cart"
    cartridge.build(OLD, path, model=tiny, page_size=PAGE, source_name="lease.txt")
    forge_records(path, lambda r: {k: v for k, v in r.items() if k != "source.documents"})
    assert cartridge.open_cartridge(path)[0].sources == [_entry(OLD, "lease.txt")]
    forge_records(path, lambda r: {k: v for k, v in r.items() if k not in ("source.bytes", "source.sha256")})
    cartridge.extend(path, NEW, model=tiny, source_name="rent.txt")  # as a 1.6 extend left it, extended again
    first = {"name": "lease.txt", "bytes": None, "sha256": None, "first_line": _entry(OLD, "")["first_line"]}
    assert cartridge.open_cartridge(path)[0].sources == [first, _entry(NEW, "rent.txt")]


@pytest.mark.parametrize("value", [b"[1, 2]", b"{}", b"[]", b"not json"])
def test_malformed_sources_list_reads_as_the_single_keys(tiny, tmp_path, value):
    path = tmp_path / "doc.cart"
    cartridge.build(OLD, path, model=tiny, page_size=PAGE, source_name="lease.txt")
    forge_records(path, lambda r: {**r, "source.documents": value})
    assert cartridge.open_cartridge(path)[0].sources == [_entry(OLD, "lease.txt")]


def test_conversation_keeps_the_documents_sources(tiny, tmp_path):
    path = tmp_path / "doc.cart"
    cartridge.build(OLD, path, model=tiny, page_size=PAGE, source_name="lease.txt")
    cart = cartridge.load(path, model=tiny)
    cache = cart.prompt_cache()
    prompt = cart.question_prompt("When may the lessee terminate?")
    cart.model(mx.array(prompt)[None], cache=cache)
    cart.save(tmp_path / "conv.cart", cache, tokens=prompt)
    assert cartridge.open_cartridge(tmp_path / "conv.cart")[0].sources == [_entry(OLD, "lease.txt")]


def test_seam_that_retokenizes_reprefills_the_changed_tokens(tiny, tmp_path):
    """Joined with no separator, the last stored word and the new text merge into other tokens: the
    stored tokens up to the seam are kept, the rest are prefilled again."""
    cartridge.build("The lessee may termin", tmp_path / "a.cart", model=tiny, page_size=4)
    r = cartridge.extend(tmp_path / "a.cart", "ate the agreement.", output=tmp_path / "b.cart", model=tiny,
                         separator="")
    n_old = len(cartridge.open_cartridge(tmp_path / "a.cart")[0].tokens)
    one = cartridge.build("The lessee may terminate the agreement.", tmp_path / "one.cart", model=tiny, page_size=4)
    assert cartridge.open_cartridge(r.path)[0].tokens.tolist() == cartridge.open_cartridge(one.path)[0].tokens.tolist()
    assert r.reused_tokens < n_old and r.new_tokens == r.tokens - r.reused_tokens
    ce, co = cartridge.load(r.path, model=tiny), cartridge.load(one.path, model=tiny)
    np.testing.assert_allclose(_last_logits(ce, "Who?"), _last_logits(co, "Who?"), atol=2e-3)


@pytest.mark.parametrize("text, match, options", [
    ("", "the new text is empty", {}), ("  \n", "the new text is empty", {}),
    ("More.", "prefill step 0 must be 1 to 2,147,483,647 tokens", {"prefill_step": 0}),
    ("More.", "prefill step -5 must be 1 to 2,147,483,647 tokens", {"prefill_step": -5}),
    ("More.", "prefill step 2147483648 must be 1 to 2,147,483,647 tokens", {"prefill_step": 2**31}),
    ("More.", "prefill step must be an integer number of tokens, got 2.5", {"prefill_step": 2.5}),
    ("More.", "separator must be text, got NoneType", {"separator": None}),
])
def test_bad_text_refused_and_nothing_written(tiny, tmp_path, text, match, options):
    cartridge.build(OLD, tmp_path / "a.cart", model=tiny)
    with pytest.raises(InputError, match=match):
        cartridge.extend(tmp_path / "a.cart", text, output=tmp_path / "b.cart", model=tiny, **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cart"]


def test_kivi4_cartridge_refused_in_one_line(tiny64, tmp_path):
    """kivi4's scales span 32 tokens, so appending to its last page would change stored tokens' codes."""
    cartridge.build(OLD, tmp_path / "a.cart", model=tiny64, k_tier="kivi4", page_size=64)
    with pytest.raises(InputError, match="layer 0 k is kivi4, whose scales span groups of tokens; extend takes"):
        cartridge.extend(tmp_path / "a.cart", NEW, output=tmp_path / "b.cart", model=tiny64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cart"]


def test_existing_output_refused(tiny, tmp_path):
    cartridge.build(OLD, tmp_path / "a.cart", model=tiny)
    cartridge.build(OLD, tmp_path / "b.cart", model=tiny)
    with pytest.raises(OutputExistsError):
        cartridge.extend(tmp_path / "a.cart", NEW, output=tmp_path / "b.cart", model=tiny)


def test_extend_beyond_context_refused(tiny, tmp_path):
    cartridge.build(OLD, tmp_path / "a.cart", model=tiny)
    with pytest.raises(InputError, match="the model's context is 512 tokens"):
        cartridge.extend(tmp_path / "a.cart", NEW * 40, model=tiny)
    assert cartridge.open_cartridge(tmp_path / "a.cart")[0].parts == []


def test_extended_header_follows_the_schema(carts):
    import jsonschema

    from cartridge.format.container import read_index, read_manifest
    from cartridge.format.keys import TOKENS_IDS
    from cartridge.format.layout import FORMAT_MINOR

    _, ext, _ = carts
    records = read_index(ext.path, read_manifest(ext.path))
    header = {k: json.loads(v) for k, v in records.items() if k != TOKENS_IDS and not k.endswith((".pages", ".head_sums"))}
    jsonschema.validate(header, json.loads((ROOT / "spec" / "header.schema.json").read_text()))
    assert read_manifest(ext.path)["minor"] == header["cartridge.format_minor"] == FORMAT_MINOR


def _forged(path, tmp_path, change):
    out = tmp_path / "forged.cart"
    shutil.copytree(path, out)
    forge_records(out, lambda r: {**r, **{k: json.dumps(v).encode() for k, v in change(r).items()}})
    return out


def _parts(records):
    return json.loads(records["lineage.parts"])


@pytest.mark.parametrize("name, change, match", [
    ("document end 0", lambda r: {"prompt.document_tokens": 0}, "prompt.document_tokens' is 0"),
    ("parts with a hole", lambda r: {"lineage.parts": [dict(p, start=p["start"] + 1) if i else p for i, p in
                                                        enumerate(_parts(r))]},
     r"lineage.parts\[1\]"),
    ("part digest wrong", lambda r: {"lineage.parts": [dict(p, tokens_sha256="0" * 64) for p in
                                                        _parts(r)]},
     r"lineage.parts\[0\]: tokens_sha256 does not match"),
    ("unknown kind", lambda r: {"lineage.parts": [dict(p, kind="merge") for p in
                                                   _parts(r)]},
     r"lineage.parts\[0\] is"),
    ("short cover", lambda r: {"lineage.parts": _parts(r)[:1]},
     "lineage.parts cover tokens 0.."),
    ("bad source", lambda r: {"lineage.source": "XYZ"}, "lineage.source' is 'XYZ'"),
])
def test_bad_lineage_keys_refused(carts, tmp_path, name, change, match):
    from cartridge.errors import FieldError

    _, ext, _ = carts
    with pytest.raises(FieldError, match=match):
        cartridge.open_cartridge(_forged(ext.path, tmp_path, change))


@pytest.mark.parametrize("stage", ["before-publish", "after-exchange"])  # every stage: tests/system/test_crash.py
def test_extend_in_place_killed_at_stage_leaves_a_whole_cartridge(tiny_dir, tmp_path, stage):
    """SIGKILL during an in-place extend: the path holds the old cartridge (byte for byte) before the
    swap and the verified extended one after it; the next extend removes the dead writer's temporary."""
    import os
    import signal
    import subprocess
    import sys

    from helpers.cartfiles import files

    from cartridge.format.atomic import CRASH_ENV

    path = tmp_path / "doc.cart"
    cartridge.build(OLD, path, model=str(tiny_dir), page_size=PAGE)
    old = files(path)
    code = f"import cartridge; cartridge.extend({str(path)!r}, {NEW!r})"
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, CRASH_ENV: stage}, capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert cartridge.verify_cartridge(path).ok
    info = cartridge.open_cartridge(path)[0]
    if stage in ("after-exchange", "published"):
        assert [p["kind"] for p in info.parts] == ["build", "extend"]
        assert info.parts[0]["end"] < len(info.tokens)
    else:
        assert files(path) == old
    cartridge.extend(path, "Section 9. Notices are written.", model=str(tiny_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.cart"]
