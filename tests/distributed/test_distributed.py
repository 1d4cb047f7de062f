"""Sharded cartridges (issue 22): per-head checksums, one rank's slice, the agreement, and two ranks under
`mlx.launch --backend ring` on 127.0.0.1 (CPU) against one process with the same cartridge."""

import hashlib
import json
import os
import socket
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from helpers.cartfiles import flip, forge_records, write
from helpers import HELPERS
from helpers.tiny_models import TINY_CONFIG, make_tiny
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2

from cartridge.storage.shard import Slice, SliceData, slice_for
from cartridge.distributed.agreement import RECORD_BYTES, _encode, agree, refusal
from cartridge.attention.caches import PipelineCache
from cartridge.errors import ChecksumError, RankMismatchError
from cartridge.format import keys as K
from cartridge.format.container import check_index, open_snapshot
from cartridge.format.header import parse_header
from cartridge.format.layout import DATA_NAME
from cartridge.format.reader import open_cartridge

ROOT = Path(__file__).resolve().parents[2]
WORKER = HELPERS / "distributed_worker.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
# qwen2: mlx-lm shards it both ways (Model.shard and PipelineMixin); untied head, so greedy answers vary
QWEN = {**{k: v for k, v in TINY_CONFIG.items() if k != "head_dim"}, "model_type": "qwen2",
        "tie_word_embeddings": False}


def _open(path, part, verify="pages"):
    snap = open_snapshot(path)
    info = parse_header(check_index(snap.index, snap.manifest), snap.manifest)
    return info, SliceData(info, snap.data, part, verify)


def _heads(n_layers, h0, h1):
    return Slice("tensor", 0, 1, (0, n_layers), (h0, h1))


def test_head_tables_hold_one_sha256_per_page_and_head(tmp_path):
    path = write(tmp_path / "a.cart", n_kv=4)
    info, data = open_cartridge(path)
    (extent,) = info.extents[(1, "v")]
    assert len(extent.head_checksums) == extent.shape[0] * 4
    slab = data.slabs(extent)[1, 3]  # page 1, head 3
    assert extent.head_checksums[1 * 4 + 3] == hashlib.sha256(slab.data).digest()
    del slab
    data.close()


def test_a_slice_reads_exactly_its_heads(tmp_path):
    path = write(tmp_path / "a.cart", n_kv=4)
    info, full = open_cartridge(path)
    _, part = _open(path, _heads(2, 2, 4))
    for (layer, side), extents in info.extents.items():
        for e in extents:
            np.testing.assert_array_equal(part.view(e, "float16"), full.view(e, "float16")[:, 2:4])
    pages = sum(e.shape[0] * e.page_bytes for ex in info.extents.values() for e in ex)
    assert part.bytes_read == part.bytes_held == pages // 2
    assert part.verified == "own heads verified (per-head checksums)"
    full.close()
    part.close()


def test_a_damaged_head_is_found_only_by_the_rank_that_holds_it(tmp_path):
    path = write(tmp_path / "a.cart", n_kv=4)
    info, full = open_cartridge(path, verify="header")
    (extent,) = info.extents[(0, "k")]
    full.close()
    flip(path / DATA_NAME, extent.offset + extent.page_bytes + 3 * extent.head_bytes + 5)  # page 1, head 3
    _, other = _open(path, _heads(2, 0, 2))  # heads 0-1 never read the damaged byte
    other.close()
    with pytest.raises(ChecksumError, match="layer 0, side k, component values, page 1, head 3"):
        _open(path, _heads(2, 2, 4))


def test_cartridge_without_head_tables_verifies_whole_pages_and_says_so(tmp_path):
    path = write(tmp_path / "a.cart", n_kv=4)
    forge_records(path, lambda r: {k: v for k, v in r.items() if not k.endswith(".head_sums")})
    info, data = _open(path, _heads(2, 0, 2))
    assert data.verified.startswith("whole pages verified: the cartridge (format < 1.2) has no per-head checksums")
    pages = sum(e.shape[0] * e.page_bytes for ex in info.extents.values() for e in ex)
    assert (data.bytes_read, data.bytes_held) == (pages, pages // 2)
    data.close()
    (extent,) = info.extents[(1, "v")]
    flip(path / DATA_NAME, extent.offset + 3 * extent.head_bytes)  # page 0, head 3: another rank's bytes
    with pytest.raises(ChecksumError, match="page checksum mismatch: layer 1, side v, component values, page 0"):
        _open(path, _heads(2, 0, 2))


def test_verify_refuses_a_forged_head_table(tmp_path):
    path = write(tmp_path / "a.cart", n_kv=2)
    key = K.head_table(0, "v", "values")
    forge_records(path, lambda r: {**r, key: bytes(len(r[key]))})
    report = cartridge.verify_cartridge(path)
    assert not report.ok and isinstance(report.error, ChecksumError)
    assert str(report.error) == (f"cartridge {path}: head checksum mismatch: layer 0, side v, component values, "
                                 f"page 0, head 0")


def test_refusal_is_one_message_from_the_gathered_rows():
    a, b = bytes([1]) * 32, bytes([2]) * 32
    rows = np.stack([_encode((a, a), None), _encode((a, b), None)])
    assert refusal(rows, ("cartridge", "model")) == (
        f"ranks disagree: model differs (rank 0 {a.hex()[:16]}, rank 1 {b.hex()[:16]})")
    rows = np.stack([_encode((a, a), None), _encode((bytes(32), bytes(32)), "no such file")])
    assert refusal(rows, ("cartridge", "model")) == "rank 1 of 2 refused: no such file"
    assert refusal(np.stack([_encode((a, b), None)] * 2), ("cartridge", "model")) is None
    assert rows.shape == (2, RECORD_BYTES)


def test_agree_on_one_rank_raises_its_own_error():
    group = mx.distributed.init()
    agree(group, ("cartridge", "model"), (bytes(32), bytes(32)))
    with pytest.raises(RankMismatchError, match="^rank 0 of 1 refused: bad$"):
        agree(group, ("cartridge", "model"), (bytes(32), bytes(32)), "bad")


def test_slice_for_reads_the_sharding_off_the_model(smol_tokenizer):
    model = make_tiny(smol_tokenizer).model
    assert slice_for(model, 2, 2, 0, 2) == Slice("replicated", 0, 2, (0, 2), (0, 2))
    for layer in model.layers:
        layer.self_attn.n_kv_heads = 1  # what mlx-lm's Model.shard leaves on each of 2 ranks
    assert slice_for(model, 2, 2, 1, 2) == Slice("tensor", 1, 2, (0, 2), (1, 2))


def test_pipeline_cache_keys_chain_onto_the_newest_tail_chunk(tmp_path):
    info, data = open_cartridge(write(tmp_path / "b.cart"))
    from cartridge.read.stored import layer_prefix

    c = PipelineCache(layer_prefix(info, data, 0), chunk_size=4)
    k = mx.ones((1, 2, 5, 8))
    c.update_and_fetch(k, k)
    assert c.keys is c._k_chunks[1]
    c.keys = mx.depends(c.keys, mx.array(1.0))
    assert mx.array_equal(c._k_chunks[1][..., :1, :], k[..., 4:, :]).item()


# ---- two ranks under mlx.launch (ring backend, 127.0.0.1, CPU) -----------------------------------------

def _save_qwen(path, tokenizer, seed):
    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(QWEN))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    path.mkdir()
    (path / "config.json").write_text(json.dumps(QWEN))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    tokenizer._tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def setup(smol_tokenizer, tmp_path_factory):
    """Two tiny qwen2 dirs (seeds 0, 1), a document, and two cartridges of it built in one process."""
    root = tmp_path_factory.mktemp("dist")
    models = [_save_qwen(root / f"qwen{s}", smol_tokenizer, s) for s in (0, 1)]
    text = (ROOT / "cartridge" / "samples" / "lgpl-3.0.txt").read_text()
    (root / "doc.txt").write_text(text[:1200])
    lm = cartridge.load_model(str(models[0]))
    cartridge.build(text[:1200], root / "one.cart", model=lm, page_size=8, reserve=0)
    cartridge.build(text[300:1000], root / "other.cart", model=lm, page_size=8, reserve=0)
    return root, models


def _free_port():
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))  # rank 1 listens on the next port
                return port
            except OSError:
                continue
    raise RuntimeError("no two free ports")


def _launch(out, *args, timeout=300):
    """Run the worker on 2 ranks; returns both ranks' JSON rows."""
    out.mkdir()
    cmd = [str(LAUNCH), "--hosts", "127.0.0.1", "-n", "2", "--backend", "ring", "--starting-port",
           str(_free_port()), sys.executable, str(WORKER), args[0], str(out), *map(str, args[1:])]
    r = subprocess.run(cmd, capture_output=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = [out / f"rank{i}.json" for i in range(2)]
    assert all(p.exists() for p in rows), r.stdout.decode()[-2000:] + r.stderr.decode()[-2000:]
    return [json.loads(p.read_text()) for p in rows]


def _one_process(cart, model_dir):
    from helpers.distributed_worker import _answer

    args = Namespace(cart=str(cart), model=str(model_dir), mode="single", other_cart=None, other_model=None,
                     max_tokens=12)
    return _answer(args, mx.distributed.init())["tokens"]


@pytest.mark.slow  # each launch is ~50 s on the shared 2-core machine
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_two_ranks_answer_token_identical_to_one_process(setup, tmp_path, mode):
    root, models = setup
    want = _one_process(root / "one.cart", models[0])
    rows = _launch(tmp_path / "out", "answer", root / "one.cart", models[0], mode)
    info, _ = open_cartridge(root / "one.cart")
    pages = sum(e.shape[0] * e.page_bytes for ex in info.extents.values() for e in ex)
    for rank, row in enumerate(rows):
        assert row["tokens"] == want, row
        assert row["bytes_read"] == row["bytes_held"] == pages // 2  # each rank: half the pages, no more
        assert row["verified"] == "own heads verified (per-head checksums)"
    if mode == "tensor":
        assert [r["slice"] for r in rows] == ["rank 0/2 (tensor): layers 0..1, KV heads 0..0",
                                              "rank 1/2 (tensor): layers 0..1, KV heads 1..1"]
    else:  # mlx-lm gives rank 0 the last layers
        assert [r["slice"] for r in rows] == ["rank 0/2 (pipeline): layers 1..1, KV heads 0..1",
                                              "rank 1/2 (pipeline): layers 0..0, KV heads 0..1"]


@pytest.mark.slow
@pytest.mark.parametrize("mode, other, expect", [
    ("tensor", "cart", "RankMismatchError: ranks disagree: cartridge differs (rank 0 "),
    ("pipeline", "model", "RankMismatchError: rank 1 of 2 refused: cartridge {cart} was built with model "),
])
def test_a_rank_with_another_cartridge_or_model_makes_both_refuse(setup, tmp_path, mode, other, expect):
    root, models = setup
    extra = ["--other-cart", root / "other.cart"] if other == "cart" else ["--other-model", models[1]]
    rows = _launch(tmp_path / "out", "answer", root / "one.cart", models[0], mode, *extra)
    assert rows[0]["error"] == rows[1]["error"]
    assert rows[0]["error"].startswith(expect.format(cart=root / "one.cart"))
    assert "\n" not in rows[0]["error"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_a_cartridge_built_on_two_ranks_loads_on_one(setup, tmp_path, mode):
    root, models = setup
    out = tmp_path / f"{mode}.cart"
    rows = _launch(tmp_path / "out", "build", root / "doc.txt", models[0], mode, out)
    assert rows == [{"path": str(out)}, {"path": None}]
    one, data_one = open_cartridge(root / "one.cart")
    two, data_two = open_cartridge(out)  # every check, page and head checksums included
    assert [(k, [(e.offset, e.shape) for e in v]) for k, v in one.extents.items()] == \
           [(k, [(e.offset, e.shape) for e in v]) for k, v in two.extents.items()]
    if mode == "pipeline":  # send/recv move activations exactly: the same bytes as one process
        for name in ("MANIFEST", "index.lmdb", "pages.bin"):
            assert (out / name).read_bytes() == (root / "one.cart" / name).read_bytes(), name
    for key, extents in one.extents.items():  # tensor: all_sum reorders float additions in later layers
        for a, b in zip(extents, two.extents[key]):
            np.testing.assert_allclose(data_two.view(b, "float16"), data_one.view(a, "float16"), atol=2e-3, rtol=1e-3)
    assert _one_process(out, models[0]) == _one_process(root / "one.cart", models[0])


@pytest.mark.slow
def test_cli_ask_under_mlx_launch_prints_the_one_process_answer_once(setup):
    root, models = setup
    cli = [sys.executable, "-m", "cartridge.cli.main", "ask", str(root / "one.cart"), "Who may copy it?",
           "--max-tokens", "8"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    one = subprocess.run(cli, capture_output=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr.decode()[-2000:]
    two = subprocess.run([str(LAUNCH), "--hosts", "127.0.0.1", "-n", "2", "--backend", "ring", "--starting-port",
                          str(_free_port()), *cli, "--parallel", "tensor"], capture_output=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr.decode()[-2000:]
    assert one.stdout.decode().strip() and two.stdout == one.stdout
