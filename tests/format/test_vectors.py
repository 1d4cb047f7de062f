"""Golden vectors (STYLE.md 9-10): the committed tests/helpers/vectors/tiny.cart pins the writer's exact bytes,
parses to known values, and is the base of a table of handcrafted corruptions, each expecting exactly
one exception class."""

import os
import random
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.cartfiles import files, flip, forge_index_bytes, forge_records, redigest_manifest
from helpers import VECTORS

from cartridge.errors import (
    CartridgeError,
    ChecksumError,
    DigestError,
    FieldError,
    IndexFormatError,
    LayoutError,
    ModelMismatchError,
    NotACartridgeError,
    TruncatedError,
    UnsupportedVersionError,
)
from cartridge.format import keys as K
from cartridge.format.container import read_index, read_manifest
from cartridge.format.pagefile import PageData
from cartridge.format.layout import ALIGN, DATA_NAME, INDEX_NAME, MANIFEST_NAME, PAGE_RECORD
from cartridge.format.reader import open_cartridge, verify_cartridge
from cartridge.read.load import check_fingerprint

sys.path.insert(0, str(VECTORS))
from make_vectors import (  # noqa: E402
    FINGERPRINT,
    KEY_SCALE,
    PROTECT,
    TOKENS,
    vector_header,
    vector_pages,
    vector_protected,
    write_vector,
)

TINY_10 = VECTORS / "tiny-1.0.cart"  # format 1.0, as written before any optional key: must keep loading
TINY = VECTORS / "tiny.cart"  # format 1.2 (per-head checksums), as written before per-layer keys: must keep loading
TINY_14 = VECTORS / "tiny-1.4.cart"  # format 1.4: per-layer kind and shapes, as written before 1.5: must keep loading
TINY_15 = VECTORS / "tiny-1.5.cart"  # format 1.5: protected tokens 0 and 2 (spec 4.5.4)
TINY_111 = VECTORS / "tiny-1.11.cart"  # format 1.11: the 1.5 vector with K stored divided by KEY_SCALE (spec 4.5.6)
PAGE_4K = os.sysconf("SC_PAGE_SIZE") == 4096  # liblmdb sizes index pages by the OS page: bytes pinned at 4 KiB


@pytest.mark.skipif(not PAGE_4K, reason="index.lmdb bytes depend on the OS page size (vector made at 4 KiB)")
def test_writer_produces_the_committed_bytes(tmp_path):
    out = write_vector(tmp_path / "v.cart")
    assert files(out) == files(TINY_15)
    assert files(write_vector(tmp_path / "s.cart", scaled=True)) == files(TINY_111)


def test_serialization_order_invariant(tmp_path):
    base = files(write_vector(tmp_path / "a.cart"))
    for seed in range(3):
        items = list(vector_header().items())
        random.Random(seed).shuffle(items)
        assert files(write_vector(tmp_path / f"s{seed}.cart", header=dict(items))) == base


@pytest.mark.parametrize("path,version", [(TINY_10, "1.0"), (TINY, "1.2"), (TINY_14, "1.4"), (TINY_15, "1.5"),
                                          (TINY_111, "1.11")])
def test_vector_parses_to_known_values(path, version):
    info, data = open_cartridge(path)
    assert info.tokens.tolist() == TOKENS
    assert (info.n_layers, info.n_kv_heads, info.head_dim, info.page_size, info.n_pages) == (1, 1, 4, 2, 2)
    assert info.fingerprint == FINGERPRINT and info.format_version == version
    assert [(m.kind, m.k_shape, m.v_shape, m.start, m.count) for m in info.layers] == [("attention", (1, 4), (1, 4), 0, 3)]
    assert [e.offset for side in "kv" for e in info.extents[(0, side)]] == [0, ALIGN]
    scale = {"k": KEY_SCALE[:, None, :] if version == "1.11" else 1, "v": 1}  # the pages hold K / s
    for side in "kv":
        (extent,) = info.extents[(0, side)]
        np.testing.assert_array_equal(data.view(extent, "float16") * scale[side], vector_pages(side))
    assert os.path.getsize(path / DATA_NAME) == 2 * ALIGN
    assert verify_cartridge(path).ok
    if version == "1.11":
        assert list(info.key_scales) == [0] and np.array_equal(info.key_scales[0], KEY_SCALE)
    else:
        assert info.key_scales == {}
    if version in ("1.5", "1.11"):
        assert (info.protect_first, info.protect_last) == PROTECT
        for side in "kv":
            np.testing.assert_array_equal(info.protected[(0, side)] * scale[side], vector_protected(side))
    else:  # before 1.5: no protection
        assert (info.protect_first, info.protect_last, info.protected) == (0, 0, {})


PROTECT_CORRUPTIONS = {  # format 1.5 protected tokens (spec 4.5.4) -> FieldError
    "protected record too short": lambda r: {**r, K.layer_protected(0, "v"): r[K.layer_protected(0, "v")][:-2]},
    "protected record missing": lambda r: {k: v for k, v in r.items() if k != K.layer_protected(0, "k")},
    "protected counts cover every token": lambda r: {**r, K.PROTECT_LAST: b"2"},
    "protected count not an integer": lambda r: {**r, K.PROTECT_FIRST: b'"1"'},
}


@pytest.mark.parametrize("case", sorted(PROTECT_CORRUPTIONS))
def test_protected_record_corruption_raises_field_error(tmp_path, case):
    path = Path(shutil.copytree(TINY_15, tmp_path / "v.cart"))
    forge_records(path, PROTECT_CORRUPTIONS[case])
    with pytest.raises(CartridgeError) as e:
        open_cartridge(path)
    assert type(e.value) is FieldError, (case, repr(e.value))


SCALE_CORRUPTIONS = {  # format 1.11 K scale (spec 4.5.6) -> exact exception class
    "scale record too short": (lambda r: {**r, K.layer_key_scale(0): r[K.layer_key_scale(0)][:-4]}, FieldError),
    "scale record missing": (lambda r: {k: v for k, v in r.items() if k != K.layer_key_scale(0)}, FieldError),
    "scale with codec_version 1": (lambda r: {**r, K.layer_codec_version(0, "k"): b"1"}, FieldError),
    "zero scale": (lambda r: {**r, K.layer_key_scale(0): np.array([1, 0, 1, 1], "<f4").tobytes()}, FieldError),
    "NaN scale": (lambda r: {**r, K.layer_key_scale(0): np.array([1, np.nan, 1, 1], "<f4").tobytes()}, FieldError),
    "subnormal scale": (lambda r: {**r, K.layer_key_scale(0): np.array([1, 1e-45, 1, 1], "<f4").tobytes()}, FieldError),
    "huge scale": (lambda r: {**r, K.layer_key_scale(0): np.array([1, 1e30, 1, 1], "<f4").tobytes()}, FieldError),
    "scale on V's codec_version": (lambda r: {**r, K.layer_codec_version(0, "v"): b"2"}, UnsupportedVersionError),
    "K codec_version beyond 2": (lambda r: {**r, K.layer_codec_version(0, "k"): b"3"}, UnsupportedVersionError),
    "scale on a dense layer": (lambda r: {**r, K.layer_kind(0): b'"dense"'}, FieldError),
    "header minor other than the MANIFEST's": (lambda r: {**r, K.FORMAT_MINOR: b"10"}, FieldError),
}


@pytest.mark.parametrize("case", sorted(SCALE_CORRUPTIONS))
def test_key_scale_corruption_raises_one_exact_class(tmp_path, case):
    path = Path(shutil.copytree(TINY_111, tmp_path / "v.cart"))
    transform, error = SCALE_CORRUPTIONS[case]
    forge_records(path, transform)
    with pytest.raises(CartridgeError) as e:
        open_cartridge(path)
    assert type(e.value) is error, (case, repr(e.value))


def test_a_reader_knowing_codec_version_1_only_refuses_a_scaled_k(monkeypatch):
    """What keeps a reader before 1.11 from reading K / s as K: the K codec_version it does not know."""
    from cartridge.tiers import key_scale
    monkeypatch.setattr(key_scale, "SCALED_VERSION", 1)
    with pytest.raises(UnsupportedVersionError, match="layer 0 k: tier fp16 codec version 2; this reader knows up to 1"):
        open_cartridge(TINY_111)


def test_scaled_vector_attends_and_decodes_as_the_unscaled_one():
    """(q * s) . (k / s) = q . k: the portable path over the 1.11 vector gives the 1.5 vector's attention output for
    the same queries and tail, and its decoded prefix is the 1.5 vector's K (spec 4.5.6)."""
    import mlx.core as mx

    from cartridge.attention.caches import CartridgeCache
    from cartridge.attention.pages import decode_prefix
    from cartridge.read.stored import layer_prefix

    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 2, 1, 4)).astype(np.float32))  # 2 query heads over the 1 KV head
    new_k, new_v = (mx.array(rng.standard_normal((1, 1, 1, 4)).astype(np.float32)) for _ in range(2))
    outs, keys = [], []
    for path in (TINY_15, TINY_111):
        info, data = open_cartridge(path)
        prefix = layer_prefix(info, data, 0)
        cache = CartridgeCache(prefix)
        cache.update_and_fetch(new_k, new_v)
        outs.append(np.array(cache.attention(q, 0.5)))
        keys.append((np.array(decode_prefix(prefix, mx.float32)[0]), np.array(cache.tail_kv()[0])))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    for got, want in zip(keys[1], keys[0]):
        np.testing.assert_allclose(got, want, rtol=1e-6)


LAYER_CORRUPTIONS = {  # format 1.4 per-layer records (spec section 5.5) -> exact exception class
    "layer shape disagrees with pages": (_set := lambda key, value: lambda r: {**r, key: value})(
        K.layer_shape(0, "k"), b"[1,8]"),
    "layer shape not two integers": _set(K.layer_shape(0, "v"), b"[1]"),
    "unknown layer kind": _set(K.layer_kind(0), b'"latent"'),
    "window count disagrees with tokens": lambda r: {**r, K.layer_kind(0): b'"window"',
                                                     K.layer_window(0): b'{"size":2,"start":0,"count":3}'},
    "state with too many arrays": lambda r: {**r, K.layer_kind(0): b'"state"',
                                             K.layer_state(0): b'{"size":1,"arrays":[{},{}]}'},
}


@pytest.mark.parametrize("case", sorted(LAYER_CORRUPTIONS))
def test_layer_record_corruption_raises_field_error(tmp_path, case):
    path = Path(shutil.copytree(TINY_14, tmp_path / "v.cart"))
    forge_records(path, LAYER_CORRUPTIONS[case])
    with pytest.raises(CartridgeError) as e:
        open_cartridge(path)
    assert type(e.value) is FieldError, (case, repr(e.value))


def _as_list(count=1, kind=b'"attention"'):
    """Layer 0 of the 1.4 vector re-described as a format 1.5 "list" layer whose cache 0 is that layer."""
    def transform(records):
        out = {k: v for k, v in records.items() if not k.startswith("layer.0.")}
        out.update({"layer.0.0." + k[len("layer.0."):]: v for k, v in records.items() if k.startswith("layer.0.")})
        out.update({K.layer_kind(0): b'"list"', K.layer_caches(0): str(count).encode(),
                    K.layer_kind(K.part(0, 0)): kind, K.FORMAT_MINOR: b"5"})
        return out
    return transform


def test_list_layer_reads_each_cache_as_its_kind(tmp_path):
    path = Path(shutil.copytree(TINY_14, tmp_path / "v.cart"))
    forge_records(path, _as_list())
    redigest_manifest(path, lambda m: struct.pack_into("<H", m, 10, 5))  # the MANIFEST says the header's minor
    info, data = open_cartridge(path)
    (layer,) = info.layers
    assert layer.kind == "list" and info.format_version == "1.5"
    assert [(m.kind, m.k_shape, m.v_shape, m.count) for m in layer.parts] == [("attention", (1, 4), (1, 4), 3)]
    assert info.units() == [("0.0", layer.parts[0])] and info.unit_tiers == {"0.0": {"k": "fp16", "v": "fp16"}}
    for side in "kv":
        (extent,) = info.extents[("0.0", side)]
        np.testing.assert_array_equal(data.view(extent, "float16"), vector_pages(side))
    assert verify_cartridge(path).ok


LIST_CORRUPTIONS = {  # a "list" layer's records (spec section 5.5, format 1.5) -> FieldError
    "no caches": _as_list(count=0),
    "more caches than described": _as_list(count=2),
    "a list in a list": _as_list(kind=b'"list"'),
    "caches not an integer": lambda r: {**_as_list()(r), K.layer_caches(0): b'"1"'},
}


@pytest.mark.parametrize("case", sorted(LIST_CORRUPTIONS))
def test_list_layer_corruption_raises_field_error(tmp_path, case):
    path = Path(shutil.copytree(TINY_14, tmp_path / "v.cart"))
    forge_records(path, LIST_CORRUPTIONS[case])
    redigest_manifest(path, lambda m: struct.pack_into("<H", m, 10, 5))
    with pytest.raises(CartridgeError) as e:
        open_cartridge(path)
    assert type(e.value) is FieldError, (case, repr(e.value))


@pytest.mark.parametrize("seed", range(6))
def test_seeded_round_trip_through_every_read_path(tmp_path, seed):
    """Random geometry -> write -> read back through the mmap view, copied bytes, and a .cartz trip."""
    from helpers.cartfiles import pages, write

    from cartridge.format.pack import pack, unpack

    rng = random.Random(seed)
    geo = dict(n_layers=rng.randint(1, 3), n_kv=rng.randint(1, 3), head_dim=rng.randint(1, 9),
               page=rng.randint(1, 5), n_tokens=rng.randint(1, 20))
    path = write(tmp_path / "r.cart", seed=seed, **geo)
    pack(path, tmp_path / "r.cartz")
    moved = unpack(tmp_path / "r.cartz", tmp_path / "u.cart")
    raw = (path / DATA_NAME).read_bytes()
    n_pages = -(-geo["n_tokens"] // geo["page"])
    for folder in (path, moved):
        info, data = open_cartridge(folder)
        for (layer, side), (extent,) in info.extents.items():
            want = pages(layer, side, n_pages, geo["n_kv"], geo["page"], geo["head_dim"], seed)
            np.testing.assert_array_equal(data.view(extent, "float16"), want)  # mmap
            copied = np.frombuffer(raw, "<f2", want.size, extent.offset).reshape(want.shape)  # copied bytes
            np.testing.assert_array_equal(copied, want)
        data.close()
    assert files(moved) == files(path)


# ---------------------------------------------------------------------------------------- corruptions


def _table(records, layer, side, edit):
    """Rewrite one page table's records with edit(list of [offset, length, sha])."""
    key = K.page_table(layer, side, "values")
    rows = [list(r) for r in PAGE_RECORD.iter_unpack(records[key])]
    edit(rows)
    return {**records, key: b"".join(PAGE_RECORD.pack(*r) for r in rows)}


def _set(key, value):
    return lambda r: {**r, key: value}


def _manifest_field(offset, fmt, value):
    return lambda p: redigest_manifest(p, lambda raw: struct.pack_into(fmt, raw, offset, value))


CORRUPTIONS = {  # name -> (damage(path), exact exception class)
    "missing manifest": (lambda p: os.unlink(p / MANIFEST_NAME), NotACartridgeError),
    "bad magic": (lambda p: flip(p / MANIFEST_NAME, 0), NotACartridgeError),
    "future major version": (_manifest_field(8, "<H", 2), UnsupportedVersionError),
    "flipped manifest byte": (lambda p: flip(p / MANIFEST_NAME, 20), DigestError),
    "flipped manifest digest byte": (lambda p: flip(p / MANIFEST_NAME, 90), DigestError),
    "truncated manifest": (lambda p: os.truncate(p / MANIFEST_NAME, 50), TruncatedError),
    "oversized header (index_size 2^40)": (_manifest_field(16, "<Q", 1 << 40), FieldError),
    "data_size not aligned": (_manifest_field(24, "<Q", 3 * ALIGN + 1), FieldError),
    "data_size claims 2^60": (_manifest_field(24, "<Q", 1 << 60), TruncatedError),
    "truncated index": (lambda p: os.truncate(p / INDEX_NAME, 4096), TruncatedError),
    "truncated data file": (lambda p: os.truncate(p / DATA_NAME, ALIGN), TruncatedError),
    "extended data file": (lambda p: open(p / DATA_NAME, "ab").write(b"\0" * ALIGN), TruncatedError),
    "missing data file": (lambda p: os.unlink(p / DATA_NAME), TruncatedError),
    "flipped index byte": (lambda p: flip(p / INDEX_NAME, 8200), DigestError),
    "index not LMDB (forged digest)": (lambda p: forge_index_bytes(p, bytes(range(256)) * 48), IndexFormatError),
    "index future major": (lambda p: forge_records(p, _set(K.FORMAT_MAJOR, b"2")), UnsupportedVersionError),
    "required key missing": (lambda p: forge_records(p, lambda r: {k: v for k, v in r.items() if k != K.ROPE}), FieldError),
    "key not JSON": (lambda p: forge_records(p, _set(K.N_LAYERS, b"{1")), FieldError),
    "JSON nested 100000 deep": (lambda p: forge_records(p, _set(K.MODEL_CONFIG, b"[" * 100000)), FieldError),
    "oversized header (tokens.count 2^31-1)": (lambda p: forge_records(p, _set(K.TOKENS_COUNT, b"2147483647")), FieldError),
    "n_kv_heads out of range": (lambda p: forge_records(p, _set(K.N_KV_HEADS, b"100000")), FieldError),
    "n_pages inconsistent": (lambda p: forge_records(p, _set(K.N_PAGES, b"3")), FieldError),
    "unknown tier": (lambda p: forge_records(p, _set(K.layer_tier(0, "v"), b'"int3"')), FieldError),
    "future codec version": (lambda p: forge_records(p, _set(K.layer_codec_version(0, "k"), b"3")), UnsupportedVersionError),
    "rope not post": (lambda p: forge_records(p, _set(K.ROPE, b'"pre"')), FieldError),
    "fingerprint not hex": (lambda p: forge_records(p, _set(K.MODEL_FINGERPRINT, b'{"id":"x"}')), FieldError),
    "components differ from tier": (lambda p: forge_records(p, _set(K.layer_components(0, "k"), b'[{"name":"values","dtype":"float16","width":5}]')), FieldError),
    "misaligned page": (lambda p: forge_records(p, lambda r: _table(r, 0, "v", lambda t: t[0].__setitem__(0, ALIGN + 1))), LayoutError),
    "overlapping offsets": (lambda p: forge_records(p, lambda r: _table(r, 0, "v", lambda t: [row.__setitem__(0, i * 16) for i, row in enumerate(t)])), LayoutError),
    "page length wrong": (lambda p: forge_records(p, lambda r: _table(r, 0, "k", lambda t: t[1].__setitem__(1, 17))), LayoutError),
    "page table truncated": (lambda p: forge_records(p, lambda r: _table(r, 0, "k", lambda t: t.pop())), LayoutError),
    "extent beyond data file": (lambda p: forge_records(p, _set(K.N_KV_HEADS, b"1024")), LayoutError),
    "flipped page byte": (lambda p: flip(p / DATA_NAME, ALIGN + 16 + 3), ChecksumError),
    "flipped checksum byte (forged)": (lambda p: forge_records(p, lambda r: _table(r, 0, "k", lambda t: t[1].__setitem__(2, bytes(32)))), ChecksumError),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_handcrafted_corruption_raises_one_exact_class(tmp_path, case):
    path = Path(shutil.copytree(TINY, tmp_path / "v.cart"))
    damage, expected = CORRUPTIONS[case]
    damage(path)
    with pytest.raises(CartridgeError) as e:
        open_cartridge(path)
    assert type(e.value) is expected, (case, repr(e.value))
    assert str(path) in str(e.value), (case, str(e.value))  # every error names the cartridge
    report = verify_cartridge(path)
    assert str(path) in str(report.error), (case, str(report.error))
    assert not report.ok and type(report.error) is expected


def test_nonzero_padding_found_by_verify_and_by_load(tmp_path):
    path = Path(shutil.copytree(TINY, tmp_path / "v.cart"))
    flip(path / DATA_NAME, 2 * 16 + 5)  # after the k extent's two 16-byte pages: alignment padding
    with pytest.raises(LayoutError, match="byte 37 is padding but not zero"):
        open_cartridge(path)  # verify="pages" checks the padding too: what verify refuses is not used
    open_cartridge(path, verify="header")[1].close()  # padding is never read by attention: the caller may skip the checks
    report = verify_cartridge(path)
    assert type(report.error) is LayoutError and "byte 37 is padding but not zero" in str(report.error)


def test_wrong_model_fingerprint_raises_model_mismatch():
    info, _ = open_cartridge(TINY)
    other = dict(FINGERPRINT, weights="6" * 64, id="7" * 64)
    with pytest.raises(ModelMismatchError) as e:
        check_fingerprint(info, other)
    assert type(e.value) is ModelMismatchError
    assert str(e.value) == ("the cartridge was built with model vector (fingerprint 111111111111); this model "
                            "(fingerprint 777777777777) differs in weights: answer with --model vector (Python: "
                            "model='vector'), or rebuild the cartridge with this model")
    with pytest.raises(ModelMismatchError, match=f"^cartridge {TINY} was built with model vector .*; this model "
                       "other.gguf \\(fingerprint"):
        check_fingerprint(info, other, TINY, "other.gguf")


def test_checksum_error_names_the_cartridge_and_keeps_its_page(tmp_path):
    path = Path(shutil.copytree(TINY, tmp_path / "v.cart"))
    flip(path / DATA_NAME, ALIGN + 16 + 3)  # V, page 1
    with pytest.raises(ChecksumError) as e:
        open_cartridge(path)
    assert str(e.value) == f"cartridge {path}: page checksum mismatch: layer 0, side v, component values, page 1"
    assert (e.value.layer, e.value.side, e.value.page) == (0, "v", 1)


def test_vector_page_data_path_reads_committed_file():
    data = PageData(TINY)
    assert data.size == 2 * ALIGN
    data.close()
    assert read_index(TINY, read_manifest(TINY))[K.TOKENS_IDS] == np.asarray(TOKENS, "<u4").tobytes()


def test_dense_layer_refused_by_attention_only_operations(tmp_path):
    """Extend, save, compose, convert and sharded loading take paged attention layers only: one line."""
    from cartridge.errors import InputError
    from cartridge.format.header import require_attention_layers

    require_attention_layers(open_cartridge(TINY_10)[0], "extend")  # a 1.0 file: every layer "attention"
    path = Path(shutil.copytree(TINY_14, tmp_path / "v.cart"))
    forge_records(path, lambda r: {**r, K.layer_kind(0): b'"dense"'})
    info, _ = open_cartridge(path)
    with pytest.raises(InputError) as e:
        require_attention_layers(info, "sharded loading")
    assert str(e.value) == "layer 0 is a dense layer; sharded loading takes attention layers only"
