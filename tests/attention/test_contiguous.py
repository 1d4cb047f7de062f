"""The CUDA backend's path for dense pages (`kernels/contiguous.py`: MLX's SDPA over one buffer per layer with room
for the tail) gives what the portable path gives, through trims, caches taking turns on one layer's buffer, growth
of the room and sinks; it runs on any device, so these run on the CPU. Chunk boundaries and mlx-lm's generate loops
over it: tests/attention/test_tail_boundaries.py and tests/attention/test_generate_loop.py ("contiguous")."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from cartridge.attention.backends import cuda as cuda_backend
from cartridge.attention.cache import CartridgeCache
from cartridge.attention.kernels import contiguous
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
    return CartridgeCache(replace(prefix, kernel=contiguous.ContiguousAttention(prefix))), CartridgeCache(prefix)


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
    kernel = contiguous.ContiguousAttention(prefix)
    a, b = (CartridgeCache(replace(prefix, kernel=kernel)) for _ in range(2))
    ra, rb = CartridgeCache(prefix), CartridgeCache(prefix)
    for i, (L_a, L_b) in enumerate([(30, 2), (1, 1), (1, 290), (1, 1)]):
        got_a, want_a = _step([a, ra], L_a, 2 * i)
        got_b, want_b = _step([b, rb], L_b, 2 * i + 1)
        np.testing.assert_allclose(got_a, want_a, rtol=TOL, atol=TOL, err_msg=f"cache a, turn {i}")
        np.testing.assert_allclose(got_b, want_b, rtol=TOL, atol=TOL, err_msg=f"cache b, turn {i}")
    assert kernel.keys.shape[2] == 768  # made for a's first 30: ceil(330 / 256) steps + one; b's 294 fit in it


def test_sinks_match_portable(prefix):
    fast, ref = _pair(prefix)
    sinks = mx.array(np.linspace(-2.0, 3.0, N_Q), dtype=mx.float32)
    for i, L in enumerate([7, 1]):
        got, want = _step([fast, ref], L, 50 + i, sinks=sinks)
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_reads_dense_pages_only(prefix):
    k = mx.random.normal((N_KV, 64, D), key=mx.random.key(3)).astype(mx.float16)
    assert contiguous.reads(prefix)
    assert isinstance(cuda_backend.CUDA.build(prefix), contiguous.ContiguousAttention)
    for tier in ("int8", "mlx4g32+rot"):
        assert not contiguous.reads(make_prefix(TIERS[tier], k, TIERS[tier], k, 64)), tier
    assert not contiguous.reads(make_prefix(TIERS["fp16"], k, TIERS["int8"], k, 64))


def test_place_counts_the_copy_and_keeps_a_memory_budget(prefix, monkeypatch):
    from cartridge.attention import policy

    monkeypatch.setattr(policy, "kernel_for", lambda choice, q, head_dim: contiguous.ContiguousAttention(q))
    monkeypatch.setattr(contiguous.ContiguousAttention, "without_copy", lambda self: "flash kernel")
    need = contiguous.ContiguousAttention(prefix).held_bytes(mx.float16)
    assert need == 2 * N_KV * (300 + contiguous.ROOM_STEP) * D * 2  # K and V, prefix + one step of room, fp16
    out, report = policy.place([prefix], "fused", mx.float16, [(D, D)])
    assert isinstance(out[0].kernel, contiguous.ContiguousAttention)
    assert report["memory"]["resident_bytes"] == prefix.nbytes + need
    out, report = policy.place([prefix], "fused", mx.float16, [(D, D)], max_memory=prefix.nbytes + need - 1)
    assert out[0].kernel == "flash kernel"  # the copy would not fit: the flash kernel reads the pages as they are
    assert report["memory"]["resident_bytes"] == prefix.nbytes


def test_questions_in_the_kernels_rows_go_to_the_pages_and_later_steps_see_their_tokens(prefix, monkeypatch):
    """The route of item 1 (issue 34) on the CPU: with the prefill kernel's conditions met (tensor cores patched
    in), a question within `cuda_prefill.DENSE_ROWS` goes to `cuda.FusedAttention` over the pages, here answered
    by the portable path (the kernel returns None), and leaves the buffer alone; decode steps, and questions
    outside the rows, read the buffer, which then holds the routed question's tokens. `contiguous.QUESTION_ROWS`'
    lower end lies below the prefill kernel's rows: there the row-block kernel takes it."""
    from cartridge.attention.kernels import cuda, cuda_prefill

    monkeypatch.setattr(cuda, "has_tensor_cores", lambda: True)
    monkeypatch.setattr(contiguous, "QUESTIONS_ON_PAGES", True)  # the default; the test holds it on
    routed = []
    monkeypatch.setattr(cuda.FusedAttention, "__call__", lambda self, c, q, *a: routed.append(q.shape[2]))
    lo, hi = contiguous.QUESTION_ROWS
    group = N_Q // N_KV
    inside, outside = -(-lo // group), hi // group + 1  # question tokens within / past the rows
    assert inside * group < cuda_prefill.DENSE_ROWS[cuda_prefill.FP16][0]  # the row blocks, not the prefill kernel
    fast, ref = _pair(prefix)
    for i, L in enumerate([inside, 1, 1, outside, 1, inside, inside, 1]):
        got, want = _step16([fast, ref], L, 300 + i)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3, err_msg=f"step {i}, {L} tokens")
    assert routed == [inside] * 3
    on = fast.prefix.kernel
    q16 = mx.zeros((1, N_Q, inside, D), dtype=mx.float16)
    assert on.on_pages(fast, q16) is not None
    assert on.on_pages(fast, q16.astype(mx.float32)) is None  # float32 queries: the buffer (exact)
    assert on.on_pages(fast, q16[:, :, :1]) is None  # decode: the buffer
    zeros = mx.zeros((N_KV, 300, D), dtype=mx.bfloat16)
    bf16 = make_prefix(TIERS["bf16"], zeros, TIERS["bf16"], zeros, 64)
    slow = CartridgeCache(replace(bf16, kernel=contiguous.ContiguousAttention(bf16)))
    slow.update_and_fetch(*(mx.zeros((1, N_KV, inside, D), dtype=mx.bfloat16) for _ in range(2)))
    assert slow.prefix.kernel.on_pages(slow, q16.astype(mx.bfloat16)) is None  # bf16 pages: not measured, the buffer
    monkeypatch.setattr(contiguous, "QUESTIONS_ON_PAGES", False)
    assert on.on_pages(fast, q16) is None


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
