"""Reading and writing mlx-lm prompt-cache files: what mlx-lm writes reads back as mlx-lm reads it; every file that
is not one cartridge can take is refused with one InputError line naming what is wrong."""

import json

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache,
                                 load_prompt_cache, save_prompt_cache)

from cartridge.errors import InputError
from cartridge.promptcache.promptfile import RECORD, read_prompt_file, read_record, write_prompt_file


def _kv(tokens=5, batch=1, heads=2, dim=8, cls=KVCache, **kw):
    c = cls(**kw)
    c.update_and_fetch(mx.ones((batch, heads, tokens, dim)), mx.ones((batch, heads, tokens, dim)))
    return c


def _arrays():
    c = ArraysCache(2)
    c[1] = mx.ones((1, 3, 4))
    return c


def _quantized():
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, 5, 32)), mx.ones((1, 2, 5, 32)))
    return c.to_quantized(group_size=32, bits=4)


def _save(path, caches, metadata=None):
    save_prompt_cache(str(path), caches, metadata or {"model": "m", "tokenizer_config": "{}"})
    return path


def test_every_kind_mlx_lm_writes_reads_back_as_mlx_lm_reads_it(tmp_path):
    caches = [_kv(), _kv(cls=RotatingKVCache, max_size=4), _quantized(), _arrays(), CacheList(_kv(), _arrays())]
    path = _save(tmp_path / "a.safetensors", caches)
    f = read_prompt_file(path)
    want = load_prompt_cache(str(path))
    assert [type(c) for c in f.caches] == [type(c) for c in want]
    assert (f.tokens, f.metadata) == (5, {"model": "m", "tokenizer_config": "{}"})
    np.testing.assert_array_equal(np.array(f.caches[0].keys), np.array(want[0].keys))
    assert [type(c) for c in f.caches[4].caches] == [KVCache, ArraysCache]
    assert (f.caches[2].bits, f.caches[2].group_size) == (4, 32) and isinstance(f.caches[2], QuantizedKVCache)


BAD = [  # (name, caches or raw bytes, message)
    ("chunked", lambda: [_kv(cls=ChunkedKVCache, chunk_size=8)],
     "layer 0 is a ChunkedKVCache; cartridge import takes KVCache, RotatingKVCache, QuantizedKVCache"),
    ("list of chunked", lambda: [CacheList(_kv(), _kv(cls=ChunkedKVCache, chunk_size=8))],
     r"layer 0 \(CacheList\): holds a ChunkedKVCache"),
    ("batch", lambda: [_kv(batch=2)], r"layer 0 \(KVCache\): a batch of 2 sequences; a cartridge holds one"),
    ("counts differ", lambda: [_kv(5), _kv(7)], "layer 1 holds 7 tokens and layer 0 5"),
    ("recurrent only", lambda: [_arrays()], "no layer holds K/V"),
    ("empty", lambda: [KVCache()], r"layer 0 \(KVCache\) does not hold a KVCache state"),
]


@pytest.mark.parametrize("name,make,message", BAD, ids=[b[0] for b in BAD])
def test_a_prompt_cache_cartridge_cannot_take_is_refused_in_one_line(tmp_path, name, make, message):
    path = _save(tmp_path / "bad.safetensors", make())
    with pytest.raises(InputError, match=message) as e:
        read_prompt_file(path)
    assert "\n" not in str(e.value)


def test_files_that_are_no_prompt_cache_are_refused(tmp_path):
    (tmp_path / "t.safetensors").write_text("just text")
    mx.save_safetensors(str(tmp_path / "w.safetensors"), {"model.embed.weight": mx.ones((2, 2))}, {"format": "mlx"})
    bad_offset = _kv()
    bad_offset.offset = 300  # beyond the 256 token slots its arrays hold
    _save(tmp_path / "o.safetensors", [bad_offset])
    for name, message in (("nothing.safetensors", "does not exist or is not a file"),
                          ("t.safetensors", "is not a safetensors file"),
                          ("w.safetensors", "is a safetensors file but not an mlx-lm prompt cache"),
                          ("o.safetensors", r"layer 0 \(KVCache\) does not hold a KVCache state: offset 300; "
                                            r"allowed 1 \.\. 256")):
        with pytest.raises(InputError, match=message):
            read_prompt_file(tmp_path / name)


def test_the_export_record_is_checked_against_the_caches(tmp_path):
    record = {"tokens": [1, 2, 3, 4, 5], "prompt_mode": "chat_template", "separator": "\n\n", "system": None,
              "document_tokens": 5}
    f = read_prompt_file(_save(tmp_path / "r.safetensors", [_kv()], {RECORD: json.dumps(record)}))
    assert read_record(f) == record
    assert read_record(read_prompt_file(_save(tmp_path / "n.safetensors", [_kv()]))) is None
    for bad, message in ((dict(record, tokens=[1, 2]), "lists 2 tokens .* its caches hold 5"),
                         (dict(record, prompt_mode="poem"), "is not a cartridge export record"),
                         ("[1, 2", "is not a cartridge export record")):
        raw = bad if isinstance(bad, str) else json.dumps(bad)
        with pytest.raises(InputError, match=message):
            read_record(read_prompt_file(_save(tmp_path / "b.safetensors", [_kv()], {RECORD: raw})))


def test_write_prompt_file_is_mlx_lms_file_written_atomically(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"old")
    write_prompt_file(path, [_kv(3)], {"model": "m", "tokenizer_config": "{}"})
    assert load_prompt_cache(str(path))[0].offset == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no temporary left
    with pytest.raises(InputError, match=r"must end in \.safetensors"):
        write_prompt_file(tmp_path / "w.bin", [_kv(3)], {})
    assert not (tmp_path / "w.bin").exists()
