"""`cartridge verify` and verify_cartridge: exit codes, one error line naming the first bad page, JSON,
and the checks only verify makes (schema against the tiers' formulas, padding, token ids)."""

import json
import os

import pytest
from helpers.cartfiles import flip, forge_records, write
from helpers.clirun import run_inprocess, run_process

import cartridge
from cartridge.errors import ChecksumError, FieldError
from cartridge.format import keys as K
from cartridge.format.layout import ALIGN, DATA_NAME
from cartridge.format.reader import verify_cartridge
from cartridge.tiers import TIERS

PAGE_BYTES = 2 * 4 * 8 * 2


def run(*args):
    return run_inprocess("verify", *args, text=True)


def test_cli_verify_good_bad_and_json(tmp_path):
    path = write(tmp_path / "a.cart")
    r = run_process("verify", path, text=True)  # as a process
    assert r.returncode == 0 and r.stdout.startswith(f"ok: {path}: manifest, index, header and page tables, schema, "
                                                     "page checksums, padding, token ids; 8 pages in 4 extents")
    doc = json.loads(run(path, "--json").stdout)
    assert doc["ok"] and doc["pages"] == 8 and doc["bytes_per_token"] == 128 and doc["error"] is None
    flip(path / DATA_NAME, 2 * ALIGN + PAGE_BYTES + 9)  # layer 1, k, page 1
    r = run(path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"error: cartridge {path}: page checksum mismatch: layer 1, side k, component values, page 1"]
    r = run(path, "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and not doc["ok"]
    assert {k: doc["error"][k] for k in ("type", "layer", "side", "component", "page")} == {
        "type": "ChecksumError", "layer": 1, "side": "k", "component": "values", "page": 1}
    flip(path / DATA_NAME, 3 * ALIGN + 3)  # layer 1, v, page 0 as well
    r = run(path)
    assert r.stderr.splitlines() == [
        f"error: cartridge {path}: page checksum mismatch: layer 1, side k, component values, page 1 "
        "(and 1 more bad pages)"]
    assert len(verify_cartridge(path).bad_pages) == 2


def test_cli_verify_not_a_cartridge(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    r = run(tmp_path / "x.txt")
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: {tmp_path / 'x.txt'} is a file, not a cartridge: a cartridge is a directory (holding MANIFEST, "
        "index.lmdb and pages.bin) or a packed .cartz file"]


def test_schema_checked_against_tier_formula(tmp_path, monkeypatch):
    path = write(tmp_path / "a.cart")
    monkeypatch.setattr(type(TIERS["fp16"]), "bytes_per_token", lambda self, h, d: 2 * h * d + 1)
    report = verify_cartridge(path)
    assert type(report.error) is FieldError
    assert "layer 0 k: pages hold 128 bytes per 4 tokens; tier fp16's formula gives 132" in str(report.error)


def test_token_ids_checked_against_vocab(tmp_path):
    path = write(tmp_path / "a.cart")
    forge_records(path, lambda r: {**r, K.MODEL_CONFIG: b'{"model_type":"llama","vocab_size":5}'})
    report = verify_cartridge(path)
    assert type(report.error) is FieldError and "tokens.ids holds id 6; model.config.vocab_size is 5" in str(report.error)


def test_load_verify_modes(tiny, tmp_path):
    doc = "The lessee may terminate the agreement with 30 days of written notice. " * 4
    r = cartridge.build(doc, tmp_path / "d.cart", model=tiny, page_size=16)
    flip(tmp_path / "d.cart" / DATA_NAME, 40)
    with pytest.raises(ChecksumError, match="layer 0, side k, component values, page 0"):
        cartridge.load(r.path, model=tiny)  # default verify="pages"
    cart = cartridge.load(r.path, model=tiny, verify="header")  # the caller chose to skip page checksums
    assert cart.info.n_layers == 2


def test_padding_damage_refused_at_load_as_by_verify(tmp_path):
    from cartridge.errors import LayoutError
    from cartridge.format.reader import open_cartridge

    path = write(tmp_path / "a.cart")
    flip(path / DATA_NAME, 2 * PAGE_BYTES + 5)  # after layer 0 k's two pages, before the next extent at ALIGN
    want = f"cartridge {path}: pages.bin byte {2 * PAGE_BYTES + 5} is padding but not zero (spec 3.2)"
    assert type(verify_cartridge(path).error) is LayoutError and str(verify_cartridge(path).error) == want
    with pytest.raises(LayoutError) as e:
        open_cartridge(path)  # default verify="pages": a cartridge verify refuses is never used to answer
    assert str(e.value) == want
    info, data = open_cartridge(path, verify="header")  # the caller chose to skip the page checks
    data.close()
    assert info.n_layers == 2


def test_verify_a_cartz(tmp_path):
    from cartridge.format.pack import pack

    path = write(tmp_path / "a.cart")
    pack(path, tmp_path / "a.cartz")
    r = run(tmp_path / "a.cartz")
    assert r.returncode == 0 and r.stdout.startswith(f"ok: {tmp_path / 'a.cartz'}: pack, manifest, index")
    os.truncate(tmp_path / "a.cartz", 100)
    r = run(tmp_path / "a.cartz")
    assert r.returncode == 1 and r.stderr.splitlines()[0].startswith(
        f"error: cartridge {tmp_path / 'a.cartz'}: packed cartridge is 100 bytes")
    assert sorted(os.listdir(tmp_path)) == ["a.cart", "a.cartz"]
