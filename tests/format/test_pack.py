""".cartz: pack/unpack round trip, refusal of every damaged or hostile pack (nothing left behind),
progress on stderr, and `load`/`open_cartridge` of a .cartz through a verified cache entry."""

import hashlib
import os
import resource
import struct
import subprocess
import sys

import pytest
import zstandard
from helpers.cartfiles import files, flip, write
from helpers.clirun import run_inprocess, run_process
from helpers import HELPERS, ROOT

import cartridge
from cartridge.errors import (
    CartridgeError,
    ChecksumError,
    DigestError,
    OutputExistsError,
    PackError,
    UnsupportedVersionError,
    WriteError,
)
from cartridge.format import pack as P
from cartridge.format.layout import DATA_NAME, INDEX_NAME, MANIFEST_NAME, MANIFEST_SIZE
from cartridge.format.reader import open_cartridge



@pytest.fixture
def packed(tmp_path):
    src = write(tmp_path / "a.cart", n_layers=3, n_tokens=30)
    P.pack(src, tmp_path / "a.cartz")
    return src, tmp_path / "a.cartz"


def test_round_trip_restores_identical_files(packed, tmp_path):
    src, cartz = packed
    seen = []
    dest = P.unpack(cartz, tmp_path / "b.cart", progress=lambda d, t: seen.append((d, t)))
    assert files(dest) == files(src)
    total = sum(len(v) for v in files(src).values())
    assert seen[-1] == (total, total)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cart", "a.cartz", "b.cart"]


def test_pack_refuses_a_damaged_cartridge(packed, tmp_path):
    src, _ = packed
    flip(src / DATA_NAME, 100)
    with pytest.raises(ChecksumError, match=f"^cartridge {src}: page checksum mismatch"):  # named, as verify names it
        P.pack(src, tmp_path / "c.cartz")
    assert not (tmp_path / "c.cartz").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_existing_outputs_need_force(packed, tmp_path):
    src, cartz = packed
    with pytest.raises(OutputExistsError):
        P.pack(src, cartz)
    P.pack(src, cartz, force=True, level=19)
    with pytest.raises(OutputExistsError):
        P.unpack(cartz, src)
    assert P.unpack(cartz, src, force=True) == src
    with pytest.raises(OutputExistsError, match="is a directory"):
        P.pack(src, src, force=True)


def _payload(cartz):
    return zstandard.ZstdDecompressor().decompressobj().decompress(cartz.read_bytes())


def _repack(cartz, edit):
    """Decompress, edit(bytearray), recompress with a valid zstd checksum."""
    raw = bytearray(_payload(cartz))
    edit(raw)
    cartz.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(bytes(raw)))


def _member_offsets(raw):
    """{name: (offset of its size field, offset of its bytes, size)} in a decompressed pack."""
    out, at = {}, P.PACK_HEADER.size
    for _ in P.MEMBERS:
        (n,) = struct.unpack_from("<H", raw, at)
        name = bytes(raw[at + 2:at + 2 + n]).decode()
        (size,) = struct.unpack_from("<Q", raw, at + 2 + n)
        out[name] = (at + 2 + n, at + 10 + n, size)
        at += 10 + n + size + 32
    return out


def _fix_member_sha(raw, name):
    _, start, size = _member_offsets(raw)[name]
    raw[start + size:start + size + 32] = hashlib.sha256(bytes(raw[start:start + size])).digest()


def _flip_page_and_fix(raw):
    _, start, _ = _member_offsets(raw)[DATA_NAME]
    raw[start + 3] ^= 1
    _fix_member_sha(raw, DATA_NAME)


def _index_byte_and_fix(raw):
    _, start, _ = _member_offsets(raw)[INDEX_NAME]
    raw[start + 5000] ^= 1
    _fix_member_sha(raw, INDEX_NAME)


def _huge_data_claim(raw):
    """A hostile MANIFEST (self-digest fixed) claiming 2^50 bytes of pages, and a matching member size."""
    _, start, _ = _member_offsets(raw)[MANIFEST_NAME]
    struct.pack_into("<Q", raw, start + 24, 1 << 50)
    raw[start + 64:start + 96] = hashlib.sha256(bytes(raw[start:start + 64])).digest()
    _fix_member_sha(raw, MANIFEST_NAME)
    struct.pack_into("<Q", raw, _member_offsets(raw)[DATA_NAME][0], 1 << 50)


HOSTILE = {  # name -> (damage(cartz path), exact exception class)
    "truncated to 10 bytes": (lambda c: os.truncate(c, 10), PackError),
    "truncated at half": (lambda c: os.truncate(c, c.stat().st_size // 2), PackError),
    "truncated by 1 byte": (lambda c: os.truncate(c, c.stat().st_size - 1), PackError),
    "flipped compressed byte": (lambda c: flip(c, c.stat().st_size // 2), PackError),
    "not zstandard": (lambda c: c.write_bytes(b"PK\x03\x04" + bytes(100)), PackError),
    "bad pack magic": (lambda c: _repack(c, lambda r: r.__setitem__(slice(0, 8), b"CARTPACX")), PackError),
    "future pack major": (lambda c: _repack(c, lambda r: struct.pack_into("<H", r, 8, 2)), UnsupportedVersionError),
    "four members": (lambda c: _repack(c, lambda r: struct.pack_into("<I", r, 12, 4)), PackError),
    "member SHA-256 wrong": (lambda c: _repack(c, lambda r: r.__setitem__(-1, r[-1] ^ 1)), PackError),
    "member renamed": (lambda c: _repack(c, lambda r: r.__setitem__(slice(18, 26), b"MANIFESX")), PackError),
    "member size differs from manifest": (lambda c: _repack(c, lambda r: struct.pack_into(
        "<Q", r, _member_offsets(r)[INDEX_NAME][0], _member_offsets(r)[INDEX_NAME][2] - 1)), PackError),
    "index differs from manifest digest": (lambda c: _repack(c, _index_byte_and_fix), DigestError),
    "page byte flipped, member SHA-256 recomputed": (lambda c: _repack(c, _flip_page_and_fix), ChecksumError),
    "bytes after the last member": (lambda c: _repack(c, lambda r: r.extend(b"\0")), PackError),
    "manifest claims 2^50 bytes of pages": (lambda c: _repack(c, _huge_data_claim), WriteError),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_pack_refused_and_nothing_left(packed, tmp_path, case):
    _, cartz = packed
    damage, expected = HOSTILE[case]
    damage(cartz)
    with pytest.raises(CartridgeError) as e:
        P.unpack(cartz, tmp_path / "b.cart")
    assert type(e.value) is expected, repr(e.value)
    assert expected is not PackError or str(e.value).startswith(f"cartridge {cartz}: "), str(e.value)  # the line names the pack
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.cart", "a.cartz"]


def run_cli(*args, **kw):
    return run_process(*args, text=True, **kw)


def test_cli_pack_unpack_progress_and_errors(packed, tmp_path):
    src, _ = packed
    r = run_cli("pack", src, "-o", tmp_path / "c.cartz")
    assert r.returncode == 0 and r.stdout.startswith(f"packed {src} -> {tmp_path / 'c.cartz'}: ")
    assert "pack: 100%" in r.stderr  # tqdm on stderr
    r = run_inprocess("unpack", tmp_path / "c.cartz", "-o", tmp_path / "c.cart", text=True)
    assert r.returncode == 0 and "unpack: 100%" in r.stderr and "(verified)" in r.stdout
    assert files(tmp_path / "c.cart") == files(src)
    os.truncate(tmp_path / "c.cartz", 200)
    r = run_inprocess("unpack", tmp_path / "c.cartz", "-o", tmp_path / "d.cart", text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: cartridge {tmp_path / 'c.cartz'}: packed cartridge is 200 bytes; its zstandard frame ends at ")
    assert lines[0].endswith(" (truncated)")
    limit = 30000  # RLIMIT_FSIZE below pages.bin's size: one clear error, nothing left
    r = run_cli("unpack", tmp_path / "a.cartz", "-o", tmp_path / "e.cart",
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        f"error: could not write {tmp_path / 'e.cart'}: File too large; nothing was left behind")
    assert not (tmp_path / "d.cart").exists() and not (tmp_path / "e.cart").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


# ---------------------------------------------------------------------------------------- load via cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "cartridge"


def test_open_cartz_unpacks_once_and_reverifies(packed, cache, monkeypatch):
    src, cartz = packed
    calls = []
    real = P.unpack
    monkeypatch.setattr(P, "unpack", lambda *a, **k: calls.append(a) or real(*a, **k))
    info, data = open_cartridge(cartz)
    data.close()
    (entry,) = cache.glob("*.cart")  # beside it NAME.packs: the digests of the packs unpacked into it
    assert entry.name == f"{P.read_pack_manifest(cartz)['digest']}.cart" and files(entry) == files(src)
    info2, data2 = open_cartridge(cartz)
    data2.close()
    assert len(calls) == 1 and info2.tokens.tolist() == info.tokens.tolist()  # reused, not unpacked again
    flip(entry / DATA_NAME, 100)  # the cache entry is damaged: detected on open, unpacked again
    _, data3 = open_cartridge(cartz)
    data3.close()
    assert len(calls) == 2 and files(entry) == files(src)


def test_a_damaged_copy_of_a_cached_pack_is_refused_not_answered_from_the_cache(packed, cache, tmp_path):
    src, cartz = packed
    _, data = open_cartridge(cartz)  # the good pack fills the cache entry
    data.close()
    bad = tmp_path / "bad.cartz"
    raw = bytearray(cartz.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the compressed pages: the MANIFEST (the cache key) is unchanged
    bad.write_bytes(bytes(raw))
    assert P.read_pack_manifest(bad) == P.read_pack_manifest(cartz)
    with pytest.raises(CartridgeError):
        open_cartridge(bad)
    _, data = open_cartridge(cartz)  # the good pack still opens (its entry unpacked again, verified)
    data.close()


def test_load_cartz_answers_like_the_directory(tiny, tmp_path, cache):
    import mlx_lm

    from cartridge.format.pack import pack

    doc = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month. " * 3
    r = cartridge.build(doc, tmp_path / "d.cart", model=tiny, page_size=16)
    pack(r.path, tmp_path / "d.cartz")

    def answer(path):
        cart = cartridge.load(path, model=tiny)
        return mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("How much is the rent?"),
                               prompt_cache=cart.prompt_cache(), max_tokens=8)

    assert answer(tmp_path / "d.cartz") == answer(r.path)


CONCURRENT_OPEN = """
import sys, types
sys.path.insert(0, {tests!r})
pkg = types.ModuleType("cartridge"); pkg.__path__ = [{pkg!r}]; sys.modules["cartridge"] = pkg
from cartridge.format.pack import open_packed
from cartridge.format.reader import _open_dir
info, data = open_packed({cartz!r}, lambda d: _open_dir(d, "pages"))
print(len(info.tokens))
"""


def test_concurrent_first_opens_share_one_cache_entry(packed, cache):
    _, cartz = packed
    code = CONCURRENT_OPEN.format(tests=str(HELPERS.parent), pkg=str(ROOT / "cartridge"), cartz=str(cartz))
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1][-500:] for o in outs]
    assert [o[0].strip() for o in outs] == ["30"] * 4
    assert [p.name for p in cache.glob("*.cart")] == [f"{P.read_pack_manifest(cartz)['digest']}.cart"]


def test_is_pack_only_for_zstd_files(packed, tmp_path):
    src, cartz = packed
    (tmp_path / "t.txt").write_text("hello")
    assert P.is_pack(cartz) and not P.is_pack(src) and not P.is_pack(tmp_path / "t.txt")
    assert MANIFEST_SIZE == 96
