"""The CUDA backend's path for dense pages (`attention/contiguous.py`: MLX's SDPA over one buffer per layer with room
for the tail) gives what the portable path gives, through trims, caches taking turns on one layer's buffer, growth
of the room and sinks; it runs on any device, so these run on the CPU. Chunk boundaries and mlx-lm's generate loops
over it: tests/attention/test_tail_boundaries.py and tests/attention/test_generate_loop.py ("contiguous")."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from cartridge.attention import contiguous
from cartridge.attention.backends import cuda as cuda_backend
from cartridge.attention.caches import CartridgeCache
from cartridge.attention.kernels.cuda_tuning import TUNING
from cartridge.attention.pages import make_prefix
from cartridge.tiers import TIERS

TOL = 2e-5 if mx.default_device() == mx.cpu else 2e-3  # the GPU's float32 matmuls round more (TF32)
N_Q, N_KV, D = 8, 2, 64


@pytest.fixture(scope="module")
def prefix():
    k, v = (mx.random.normal((N_KV, 300, D), key=mx.random.key(s)).astype(mx.float16) for s in (1, 2))
    return make_prefix(TIERS["fp16"], k, TIERS["fp16"], v, 64)


def _pair(prefix):
    """(contiguous cache, portable cache) over one prefix."""
    return CartridgeCache(replace(prefix, backend=contiguous.lay_out(prefix))), CartridgeCache(prefix)


def _step(caches, L, seed, sinks=None):
    """Feed L random tokens to every cache; return each one's attention (float32 numpy)."""
    key = mx.random.key(seed)
    kq, kk, kv = mx.random.split(key, 3)
    q = mx.random.normal((1, N_Q, L, D), key=kq)
    k, v = mx.random.normal((1, N_KV, L, D), key=kk), mx.random.normal((1, N_KV, L, D), key=kv)
    outs = []
    for c in caches:
        c.update_and_fetch(k, v)
        outs.append(np.array(c.attention(q, D ** -0.5, mask="causal" if L > 1 else None, sinks=sinks)))
    return outs


def test_decode_prefill_and_trim_match_portable(prefix):
    fast, ref = _pair(prefix)
    for i, L in enumerate([1, 40, 1, 1, 300, 1]):  # 300: past the first ROOM_STEP of room
        got, want = _step([fast, ref], L, i)
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL, err_msg=f"step {i}")
    for n, L in ((5, 3), (200, 1), (1, 1)):  # trimmed tokens are overwritten by new ones
        assert fast.trim(n) == ref.trim(n) == n
        got, want = _step([fast, ref], L, 100 + n)
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL, err_msg=f"after trim {n}")
    assert fast.offset == ref.offset == 300 + 143  # 344 fed, then -5 +3, -200 +1, -1 +1


def test_caches_taking_turns_on_one_buffer_match_portable(prefix):
    record = contiguous.lay_out(prefix)
    a, b = (CartridgeCache(replace(prefix, backend=record)) for _ in range(2))
    ra, rb = CartridgeCache(prefix), CartridgeCache(prefix)
    for i, (L_a, L_b) in enumerate([(30, 2), (1, 1), (1, 290), (1, 1)]):
        got_a, want_a = _step([a, ra], L_a, 2 * i)
        got_b, want_b = _step([b, rb], L_b, 2 * i + 1)
        np.testing.assert_allclose(got_a, want_a, rtol=TOL, atol=TOL, err_msg=f"cache a, turn {i}")
        np.testing.assert_allclose(got_b, want_b, rtol=TOL, atol=TOL, err_msg=f"cache b, turn {i}")
    assert record.buffer.keys.shape[2] == 768  # made for a's first 30: ceil(330 / 256) steps + one; b's 294 fit in it


def test_sinks_match_portable(prefix):
    fast, ref = _pair(prefix)
    sinks = mx.array(np.linspace(-2.0, 3.0, N_Q), dtype=mx.float32)
    for i, L in enumerate([7, 1]):
        got, want = _step([fast, ref], L, 50 + i, sinks=sinks)
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_reads_dense_pages_only(prefix):
    k = mx.random.normal((N_KV, 64, D), key=mx.random.key(3)).astype(mx.float16)
    assert contiguous.reads(prefix)
    assert isinstance(cuda_backend.CUDA.build(prefix), contiguous.Contiguous)
    for tier in ("int8", "mlx4g32+rot"):
        assert not contiguous.reads(make_prefix(TIERS[tier], k, TIERS[tier], k, 64)), tier
    assert not contiguous.reads(make_prefix(TIERS["fp16"], k, TIERS["int8"], k, 64))


def test_place_counts_the_copy_and_keeps_a_memory_budget(prefix, monkeypatch):
    from cartridge.attention import policy
    from cartridge.attention.kernels import cuda_inputs

    monkeypatch.setattr(policy, "backend_for", lambda choice, q, head_dim: contiguous.lay_out(q))
    need = contiguous.lay_out(prefix).held_bytes(mx.float16)
    assert need == 2 * N_KV * (300 + contiguous.ROOM_STEP) * D * 2  # K and V, prefix + one step of room, fp16
    out, report = policy.place([prefix], "fused", mx.float16, [(D, D)])
    assert isinstance(out[0].backend, contiguous.Contiguous)
    assert report["memory"]["resident_bytes"] == prefix.nbytes + need
    out, report = policy.place([prefix], "fused", mx.float16, [(D, D)], max_memory=prefix.nbytes + need - 1)
    # the copy would not fit: the flash kernels' record, reading the pages as they are
    assert isinstance(out[0].backend, cuda_inputs.CudaInputs)
    assert report["memory"]["resident_bytes"] == prefix.nbytes


def test_questions_in_the_kernels_rows_go_to_the_pages_and_later_steps_see_their_tokens(prefix, monkeypatch):
    """The route of item 1 (issue 34) on the CPU: with the prefill kernel's conditions met (tensor cores patched
    in), a question within `prefill_dense_rows` goes to `kernels.cuda.attend` over the pages, here answered
    by the portable path (the kernel returns None), and leaves the buffer alone; decode steps, and questions
    outside the rows, read the buffer, which then holds the routed question's tokens. `question_rows`'
    lower end lies below the prefill kernel's rows: there the row-block kernel takes it."""
    from cartridge.attention.kernels import cuda, cuda_prefill

    monkeypatch.setattr(cuda, "has_tensor_cores", lambda: True)
    routed = []
    monkeypatch.setattr(cuda, "attend", lambda record, prefix, q, *a: routed.append(q.shape[2]))
    lo, hi = TUNING.question_rows
    group = N_Q // N_KV
    inside, outside = -(-lo // group), hi // group + 1  # question tokens within / past the rows
    assert inside * group < TUNING.prefill_dense_rows[cuda_prefill.FP16][0]  # the row blocks, not the prefill kernel
    fast, ref = _pair(prefix)
    for i, L in enumerate([inside, 1, 1, outside, 1, inside, inside, 1]):
        got, want = _step16([fast, ref], L, 300 + i)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3, err_msg=f"step {i}, {L} tokens")
    assert routed == [inside] * 3
    assert fast.trim(inside + 3) == ref.trim(inside + 3) == inside + 3  # positions the buffer holds, rewritten by a
    for i, L in enumerate([inside, 1]):  # question on the pages: the decode step after it copies them in again
        got, want = _step16([fast, ref], L, 400 + i)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3, err_msg=f"after a trim, step {i}, {L} tokens")
    assert routed == [inside] * 4
    on = fast.prefix.backend
    q16 = mx.zeros((1, N_Q, inside, D), dtype=mx.float16)
    assert contiguous.on_pages(on, q16, fast.tail())
    assert not contiguous.on_pages(on, q16.astype(mx.float32), fast.tail())  # float32 queries: the buffer (exact)
    assert not contiguous.on_pages(on, q16[:, :, :1], fast.tail())  # decode: the buffer
    zeros = mx.zeros((N_KV, 300, D), dtype=mx.bfloat16)
    bf16 = make_prefix(TIERS["bf16"], zeros, TIERS["bf16"], zeros, 64)
    slow = CartridgeCache(replace(bf16, backend=contiguous.lay_out(bf16)))
    slow.update_and_fetch(*(mx.zeros((1, N_KV, inside, D), dtype=mx.bfloat16) for _ in range(2)))
    assert not contiguous.on_pages(slow.prefix.backend, q16.astype(mx.bfloat16), slow.tail())  # bf16 pages: the buffer
    never = contiguous.lay_out(prefix, replace(TUNING, question_rows=(1, 0)))  # no rows on the pages
    assert not contiguous.on_pages(never, q16, fast.tail())


def _step16(caches, L, seed):
    """`_step` with float16 queries, keys and values (the prefill kernel takes fp16/bf16 queries only)."""
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, N_Q, L, D), key=kq).astype(mx.float16)
    k, v = (mx.random.normal((1, N_KV, L, D), key=x).astype(mx.float16) for x in (kk, kv))
    outs = []
    for c in caches:
        c.update_and_fetch(k, v)
        outs.append(np.array(c.attention(q, D ** -0.5, mask="causal" if L > 1 else None).astype(mx.float32)))
    return outs
