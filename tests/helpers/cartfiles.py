"""Helpers for the integrity tests: a small synthetic cartridge written without a model, and ways to
damage or forge one (re-digesting so a change gets past the digests, as a hostile author would)."""

import hashlib
import os
import tracemalloc
from pathlib import Path

import numpy as np

from cartridge.format import keys as K
from cartridge.format.container import read_index, read_manifest
from cartridge.format.layout import DATA_NAME, INDEX_NAME, MANIFEST_NAME
from cartridge.format.writer import CartridgeWriter, _write_index

FP = {k: "ab" * 32 for k in ("id", "config", "weights", "tokenizer", "chat_template")}


def header(n_layers=2, n_kv=2, head_dim=8, page=4, n_tokens=7, tier="fp16", **fields):
    """JSON-valued header records of a synthetic cartridge (spec 4.2).

    Args:
        fields: overrides by name: writer, ref, fingerprint, config, mode.
    """
    h = {
        K.FORMAT_MAJOR: 1, K.FORMAT_MINOR: 2, K.WRITER: fields.get("writer", "test"),
        K.MODEL_REF: fields.get("ref", "tiny"), K.MODEL_FINGERPRINT: fields.get("fingerprint", FP),
        K.MODEL_CONFIG: fields.get("config", {"model_type": "llama", "vocab_size": 100}),
        K.PROMPT_MODE: fields.get("mode", "plain"), K.PROMPT_SEPARATOR: "\n\n", K.TOKENS_COUNT: n_tokens,
        K.N_LAYERS: n_layers, K.N_KV_HEADS: n_kv, K.HEAD_DIM: head_dim, K.PAGE_SIZE: page,
        K.N_PAGES: -(-n_tokens // page), K.SOURCE_DTYPE: "float32", K.ROPE: "post",
    }
    dtype = {"fp16": "float16", "bf16": "bfloat16"}[tier]
    for layer in range(n_layers):
        for side in "kv":
            h[K.layer_tier(layer, side)] = tier
            h[K.layer_codec_version(layer, side)] = 1
            h[K.layer_params(layer, side)] = {}
            h[K.layer_components(layer, side)] = [{"name": "values", "dtype": dtype, "width": head_dim}]
    return h


def pages(layer, side, n_pages=2, n_kv=2, page=4, head_dim=8, seed=0):
    """Deterministic float16 pages (n_pages, n_kv, page, head_dim) of one (layer, side)."""
    rng = np.random.default_rng([seed, layer, side == "v"])
    return rng.standard_normal((n_pages, n_kv, page, head_dim)).astype(np.float16)


def write(path, force=False, n_layers=2, n_kv=2, head_dim=8, page=4, n_tokens=7, seed=0, extra=None):
    """Write a synthetic fp16 cartridge; `extra` adds JSON header records. Returns the path."""
    n_pages = -(-n_tokens // page)
    h = header(n_layers, n_kv, head_dim, page, n_tokens)
    h.update(extra or {})
    with CartridgeWriter(path, force=force) as w:
        for layer in range(n_layers):
            for side in "kv":
                w.add_extent(layer, side, "values", pages(layer, side, n_pages, n_kv, page, head_dim, seed))
        w.commit(h, np.arange(n_tokens, dtype=np.uint32) % 100)
    return Path(path)


def flip(path, offset, mask=0x01):
    """XOR one byte of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def redigest_manifest(folder, edit=None):
    """Apply `edit(bytearray)` to MANIFEST's first 64 bytes, then make its own SHA-256 match again."""
    m = Path(folder) / MANIFEST_NAME
    raw = bytearray(m.read_bytes())
    if edit:
        edit(raw)
    raw[64:96] = hashlib.sha256(bytes(raw[:64])).digest()
    m.write_bytes(bytes(raw))


def forge_index_bytes(folder, data):
    """Replace index.lmdb by `data` and rewrite MANIFEST's index size and digest to match (a forgery)."""
    folder = Path(folder)
    (folder / INDEX_NAME).write_bytes(data)

    def edit(raw):
        raw[16:24] = len(data).to_bytes(8, "little")
        raw[32:64] = hashlib.sha256(data).digest()

    redigest_manifest(folder, edit)


def forge_records(folder, transform):
    """Rewrite the index records through `transform(dict[str, bytes]) -> dict` with valid digests."""
    folder = Path(folder)
    records = transform(dict(read_index(folder, read_manifest(folder))))
    os.unlink(folder / INDEX_NAME)
    _write_index(folder, records)
    forge_index_bytes(folder, (folder / INDEX_NAME).read_bytes())


def files(folder):
    """{name: bytes} of the three files."""
    return {n: (Path(folder) / n).read_bytes() for n in (MANIFEST_NAME, INDEX_NAME, DATA_NAME)}


def peak_bytes(fn):
    """Peak bytes Python allocated while running fn() (tracemalloc), for the "refused before any
    allocation follows from it" tests."""
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak
