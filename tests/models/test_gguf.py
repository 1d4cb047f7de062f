"""The default model's GGUF: llama config, tokenizer from metadata, weights loaded quantized; and the
structural check that refuses a damaged GGUF before MLX's reader (which can segfault on one) sees it."""

import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers.cartfiles import peak_bytes

import cartridge.models.gguf as gguf_module
from cartridge.errors import ModelLoadError
from cartridge.models.gguf import load_gguf, model_args
from cartridge.models.gguf_check import GGML_TYPES, check_gguf
from cartridge.models.loader import default_gguf_path


def test_smollm2_config():
    _, meta = mx.load(str(default_gguf_path()), return_metadata=True)
    args = model_args(meta)
    assert (args["num_hidden_layers"], args["num_attention_heads"], args["num_key_value_heads"]) == (30, 9, 3)
    assert (args["hidden_size"], args["head_dim"], args["vocab_size"]) == (576, 64, 49152)
    assert args["rope_traditional"] is True and args["rope_theta"] == 100000.0


def test_tokenizer_specials_digits_and_round_trip(smol_tokenizer):
    tok = smol_tokenizer
    assert tok.encode("<|im_start|>user\n", add_special_tokens=False)[0] == 1
    assert tok.eos_token_id == 2
    assert tok.encode(" 2024", add_special_tokens=False) == [216, 34, 32, 34, 36]  # digits one by one
    text = "Hello, naïve wörld — 東京!\n\n  indented\tTab"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_weights_stay_quantized_until_dequantized():
    model, _ = load_gguf(default_gguf_path())
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert model.layers[0].self_attn.q_proj.bits == 4
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8


# --- Structural check before mx.load: a damaged GGUF is refused with ModelLoadError, never a crash ---

ROOT = Path(__file__).resolve().parents[2]


def _s(text):
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key, vtype, payload):
    return _s(key) + struct.pack("<I", vtype) + payload


def _tensor_info(name, dims, ggml_type, offset):
    return (_s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", ggml_type, offset))


def _head(n_tensors, n_kv):
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _gguf(kvs=(), infos=(), data=b"", n_tensors=None, n_kv=None, alignment=32):
    """A GGUF v3 file from encoded key/values and tensor infos; the data section is aligned."""
    head = _head(len(infos) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    return body + b"\0" * (-len(body) % alignment) + data


def _small_gguf(**overrides):
    """A valid GGUF: a few metadata types (string, string array, int array, u32) and F32 + Q8_0 tensors."""
    kvs = [_kv("general.architecture", 8, _s("llama")),
           _kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + _s("a") + _s("bb") + _s("ccc")),
           _kv("tokenizer.ggml.token_type", 9, struct.pack("<IQ", 5, 2) + struct.pack("<2i", 1, 3)),
           _kv("llama.block_count", 4, struct.pack("<I", 1))]
    f32 = struct.pack("<8f", *range(8))
    q8 = (struct.pack("<e", 0.5) + bytes(range(32))) * 2
    infos = [_tensor_info("a.weight", [8], 0, 0), _tensor_info("b.weight", [32, 2], 8, 32)]
    return _gguf(**{"kvs": kvs, "infos": infos, "data": f32 + q8, **overrides})


def _refused(path, match):
    with pytest.raises(ModelLoadError, match=match) as info:
        check_gguf(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    return msg


@pytest.fixture(scope="module")
def real_gguf():
    try:
        return default_gguf_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture
def no_mx_load(monkeypatch):
    """Fail the test if load_gguf ever reaches mx.load."""
    def boom(*a, **k):
        raise AssertionError("mx.load reached on a file the check should have refused")
    monkeypatch.setattr(gguf_module.mx, "load", boom)


def test_default_model_passes_the_check_quickly(real_gguf):
    start = time.perf_counter()
    check_gguf(real_gguf)
    assert time.perf_counter() - start < 2.0


def test_small_synthetic_gguf_passes_and_mlx_reads_it(tmp_path):
    p = tmp_path / "ok.gguf"
    p.write_bytes(_small_gguf())
    check_gguf(p)
    tensors, meta = mx.load(str(p), return_metadata=True)  # the writer above makes files MLX agrees with
    assert tensors["a.weight"].tolist() == list(range(8)) and meta["tokenizer.ggml.tokens"] == ["a", "bb", "ccc"]


def test_random_bytes_after_magic_refused_before_mx_load(tmp_path, no_mx_load):
    rng = random.Random(7)
    for i in range(40):
        p = tmp_path / f"r{i}.gguf"
        # half of them declare plausible counts, so the key/value and tensor-info parsing is reached
        head = b"GGUF\x03\x00\x00\x00" + (struct.pack("<QQ", rng.randrange(1, 4), rng.randrange(1, 4)) if i % 2 else b"")
        p.write_bytes(head + rng.randbytes(5000))
        with pytest.raises(ModelLoadError, match=r"cannot read GGUF file .*r\d+\.gguf: "):
            gguf_module.load_gguf(p)


def test_random_bytes_do_not_kill_the_process(tmp_path):
    """The reported crash: mx.load segfaults on this file; load_gguf must exit with a Python error."""
    p = tmp_path / "trunc.gguf"
    p.write_bytes(b"GGUF\x03\x00\x00\x00" + random.Random(0).randbytes(5000))
    code = ("import sys\nfrom cartridge.errors import ModelLoadError\nfrom cartridge.models.gguf import load_gguf\n"
            "try:\n    load_gguf(sys.argv[1])\nexcept ModelLoadError as e:\n    print(e, file=sys.stderr)\n"
            "    sys.exit(1)\n")
    r = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().startswith(f"cannot read GGUF file {p}: ")


def _header_copy(real, dst):
    """A sparse copy of the real GGUF: its header bytes, then zeros to the same size (the data is never read)."""
    size = real.stat().st_size
    with open(real, "rb") as f:
        head = f.read(4 << 20)
    with open(dst, "wb") as f:
        f.write(head)
        f.truncate(size)
    return bytearray(head)


def _tensor_offset_field(head, name):
    """Byte position of the offset field of tensor `name` in a GGUF header."""
    raw = name.encode()
    at = head.find(struct.pack("<Q", len(raw)) + raw)
    assert at > 0, name
    pos = at + 8 + len(raw)
    n_dims = struct.unpack_from("<I", head, pos)[0]
    return pos + 4 + 8 * n_dims + 4


def test_real_gguf_with_tensor_offset_past_end_refused(real_gguf, tmp_path):
    p = tmp_path / "patched.gguf"
    head = _header_copy(real_gguf, p)
    check_gguf(p)  # the unpatched header passes
    field = _tensor_offset_field(head, "blk.0.attn_q.weight")
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.seek(field)
        f.write(struct.pack("<Q", size // 32 * 32))  # aligned, but the tensor now starts near the end
    _refused(p, r"tensor 'blk\.0\.attn_q\.weight' \(Q4_1 .*\) spans bytes .* but the file is")
    with open(p, "r+b") as f:
        f.seek(field)
        f.write(struct.pack("<Q", 2**64 - 32))
    _refused(p, "blk.0.attn_q.weight")


def test_real_gguf_truncated_inside_its_header_refused(real_gguf, tmp_path):
    head = _header_copy(real_gguf, tmp_path / "full.gguf")
    for keep in (9, 24, 100, 5000, 1_000_000, len(head) - 3):
        p = tmp_path / f"cut{keep}.gguf"
        p.write_bytes(head[:keep])
        _refused(p, "cannot read GGUF file")


HUGE = {  # a claim that would allocate or loop without bound if believed -> message
    "tensor_count 2^63": (lambda: _gguf(n_tensors=2**63), "tensor_count 9223372036854775808 cannot fit"),
    "kv_count 2^64-1": (lambda: _gguf(n_kv=2**64 - 1), "metadata_kv_count .* cannot fit"),
    "key length 2^62": (lambda: _head(0, 1) + struct.pack("<Q", 2**62) + b"x" * 64, r"declares \d+ bytes \(limit"),
    "tensor name 2^62": (lambda: _head(1, 0) + struct.pack("<Q", 2**62) + b"x" * 64, "tensor 0 name"),
    "string value 2^60": (lambda: _gguf([_kv("k", 8, struct.pack("<Q", 2**60))]) + b"x" * 64, r"string value of 'k'"),
    "string value past end": (lambda: _gguf([_kv("k", 8, struct.pack("<Q", 1000) + b"abc")]), "file ends at"),
    "array of 2^62 strings": (lambda: _gguf([_kv("k", 9, struct.pack("<IQ", 8, 2**62))]), r"declares \d+ elements"),
    "array of 2^30 strings": (lambda: _gguf([_kv("k", 9, struct.pack("<IQ", 8, 2**30))]), "strings but only"),
    "array of 2^31-1 uint64": (lambda: _gguf([_kv("k", 9, struct.pack("<IQ", 10, 2**31 - 1))]), "uint64 array 'k'"),
    "tensor dims 2^62": (lambda: _gguf(infos=[_tensor_info("t", [2**62, 2**62], 0, 0)]), "has dimension"),
    "tensor of 2^40 elements": (lambda: _gguf(infos=[_tensor_info("t", [2**20, 2**20], 0, 0)]), "elements"),
}


@pytest.mark.parametrize("claim", sorted(HUGE))
def test_absurd_lengths_and_counts_refused_quickly_without_allocating(tmp_path, claim):
    build, match = HUGE[claim]
    p = tmp_path / "huge.gguf"
    p.write_bytes(build())
    start = time.perf_counter()
    _refused(p, match)
    assert time.perf_counter() - start < 0.5
    peak = peak_bytes(lambda: pytest.raises(ModelLoadError, check_gguf, p))
    assert peak < 1 << 20, f"{claim}: {peak:,} bytes allocated before refusing"


BAD = {  # damage to a valid small GGUF -> message
    "bad magic": (lambda: b"GGUX" + _small_gguf()[4:], "bad magic"),
    "version 1": (lambda: _small_gguf()[:4] + struct.pack("<I", 1) + _small_gguf()[8:], "unsupported GGUF version 1"),
    "big-endian version": (lambda: _small_gguf()[:4] + struct.pack(">I", 3) + _small_gguf()[8:], "version 50331648"),
    "short file": (lambda: b"GGUF\x03\x00\x00\x00\x00", "shorter than the 24-byte GGUF header"),
    "unknown value type": (lambda: _gguf([_kv("k", 13, b"\0" * 8)]), "'k' has unknown value type 13"),
    "unknown array element type": (lambda: _gguf([_kv("k", 9, struct.pack("<IQ", 77, 1) + b"\0" * 8)]),
                                   "unknown element type 77"),
    "float64 value (crashes MLX 0.32)": (lambda: _gguf([_kv("k", 12, struct.pack("<d", 1.5))]), "float64"),
    "float64 array (crashes MLX 0.32)": (lambda: _gguf([_kv("k", 9, struct.pack("<IQd", 12, 1, 1.5))]), "float64 array"),
    "array of arrays": (lambda: _gguf([_kv("k", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 0))]),
                        "array of arrays"),
    "duplicate key": (lambda: _gguf([_kv("k", 4, b"\0" * 4)] * 2), "'k' appears twice"),
    "alignment 0 (SIGFPE in gguflib)": (lambda: _gguf([_kv("general.alignment", 4, struct.pack("<I", 0))]),
                                        "power of two"),
    "alignment as uint64": (lambda: _gguf([_kv("general.alignment", 10, struct.pack("<Q", 32))]), "requires uint32"),
    "unknown ggml type": (lambda: _small_gguf(infos=[_tensor_info("a.weight", [8], 77, 0)]),
                          "'a.weight' has unknown ggml type 77"),
    "removed ggml type Q4_2": (lambda: _small_gguf(infos=[_tensor_info("a.weight", [32], 4, 0)]), "ggml type 4"),
    "5 dimensions": (lambda: _small_gguf(infos=[_tensor_info("a.weight", [1] * 5, 0, 0)]), "5 dimensions"),
    "0 dimensions": (lambda: _small_gguf(infos=[_tensor_info("a.weight", [], 8, 0)]), "0 dimensions"),
    "misaligned offset": (lambda: _small_gguf(infos=[_tensor_info("a.weight", [4], 0, 4)]),
                          "offset 4 is not a multiple of the alignment 32"),
    "Q8_0 row not a block multiple": (lambda: _small_gguf(infos=[_tensor_info("a.weight", [16], 8, 0)]),
                                      "not a multiple of its block size 32"),
    "data past end": (lambda: _small_gguf(infos=[_tensor_info("a.weight", [4096], 0, 0)]), "spans bytes"),
    "duplicate tensor": (lambda: _small_gguf(infos=[_tensor_info("a.weight", [8], 0, 0)] * 2), "appears twice"),
    "tensor infos cut off": (lambda: _small_gguf(data=b"")[:-40], "needs"),
}


@pytest.mark.parametrize("damage", sorted(BAD))
def test_malformed_structures_refused(tmp_path, damage, no_mx_load):
    build, match = BAD[damage]
    p = tmp_path / "bad.gguf"
    p.write_bytes(build())
    _refused(p, match)
    with pytest.raises(ModelLoadError, match=match):
        gguf_module.load_gguf(p)  # refused before mx.load (no_mx_load would raise AssertionError)


def test_known_block_sizes_accept_exact_extents(tmp_path):
    """Each supported ggml type: a tensor whose data ends exactly at the end of the file passes, one byte
    less is refused."""
    for type_id, (name, block, block_bytes) in GGML_TYPES.items():
        data = b"\0" * (2 * block_bytes)
        infos = [_tensor_info("t", [block, 2], type_id, 0)]
        ok, short = tmp_path / f"{name}.gguf", tmp_path / f"{name}-short.gguf"
        ok.write_bytes(_gguf(infos=infos, data=data))
        short.write_bytes(_gguf(infos=infos, data=data)[:-1])
        check_gguf(ok)
        _refused(short, f"'t' \\({name} ")
    assert {GGML_TYPES[i][0] for i in (0, 1, 30, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)} == {
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"}
