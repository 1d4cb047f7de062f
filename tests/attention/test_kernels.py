"""Attention kernels against a float64 reference of attention over the dequantized pages.

Kernel error is tested here, apart from tier fidelity (like mlx's test_qmm): the reference decodes
the stored pages with the tier's own `decode`, so only the attention arithmetic is compared.
Every tier in the registry x every shape below x (portable path; fused CUDA kernel where available).
Outputs of the CUDA kernels are poisoned with NaN before each run, and tail chunk slots beyond the
tail length hold NaN, so a kernel that skips or over-reads elements fails.
"""

import itertools
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from helpers.kernel_cases import TOL, TOL_BF16, TOL_FP16, _cache, _case, _check, _seed, protected_reference, with_protected

from cartridge.attention.caches import CartridgeCache
from cartridge.attention.policy import DEQUANTIZED, dequantize
from cartridge.attention.prefix import LayerPrefix
from cartridge.tiers import TIERS

HAS_CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()


@pytest.fixture
def poisoned(monkeypatch):
    """`kernels.cuda`'s launches fill their outputs with NaN before the kernel runs (MLX's `init_value`), so a kernel
    that leaves an element unwritten fails."""
    from cartridge.attention.kernels import cuda

    made = cuda.kernel

    def kernel(*args, **kw):
        launch = made(*args, **kw)
        return lambda **call: launch(**call, init_value=float("nan"))
    monkeypatch.setattr(cuda, "kernel", kernel)


def tuned(**values):
    """The CUDA tuning in use with `values` changed (`CudaTuning`)."""
    from cartridge.attention.kernels.cuda_tuning import TUNING

    return replace(TUNING, **values)

# (n_q_heads, n_kv_heads, head_dim, prefix tokens, page size, tail tokens, query tokens)
SHAPES = [
    (4, 4, 64, 1, 16, 1, 1),        # GQA 1, one prefix token
    (9, 3, 64, 255, 256, 1, 1),     # GQA 3 (SmolLM2), page boundary - 1
    (9, 3, 64, 257, 256, 7, 7),     # page boundary + 1, multi-token query = whole tail
    (8, 2, 128, 256, 256, 3, 1),    # GQA 4, exactly one page
    (16, 2, 128, 1001, 64, 300, 2), # GQA 8, odd length, tail over two chunks
    (32, 8, 128, 777, 128, 20, 5),  # GQA 4, Llama-3 shape, multi-token
    (8, 1, 128, 33, 16, 1, 1),      # GQA 8, one KV head
]


def _run(prefix, q, tail_k, tail_v, dtype=mx.float32, sinks=None):
    cache = _cache(prefix, tail_k, tail_v, dtype)
    scale = q.shape[-1] ** -0.5
    out = cache.attention(mx.array(q).astype(dtype), scale, "causal" if q.shape[2] > 1 else None,
                          None if sinks is None else mx.array(sinks))
    return np.array(out.astype(mx.float32))[0]


@pytest.mark.parametrize("tier, shape", list(itertools.product(sorted(TIERS), SHAPES)))
def test_portable_matches_float64(tier, shape):
    try:
        prefix, q, tk, tv = _case(tier, shape, seed=_seed(tier, shape))
    except Exception as e:  # a tier that cannot store this shape says so before encoding
        pytest.skip(f"{tier} cannot store {shape}: {e}")
    _check(prefix, q, tk, tv, _run(prefix, q, tk, tv), f"portable {tier} {shape}")


def test_dequantize_once_matches_float64():
    prefix, q, tk, tv = _case("fp16", SHAPES[4], seed=7)
    dense = dequantize(prefix, mx.float32)
    assert dense.k_codec is DEQUANTIZED and dense.k_parts["values"].dtype == mx.float32
    _check(prefix, q, tk, tv, _run(dense, q, tk, tv), "dequantize-once")


@pytest.mark.parametrize("tier", ["fp16", "int8+rot", "mlx4g32", "turbo4", "nvfp4"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_dense_prefill_attention_matches_float64(tier, with_sinks):
    """The many-query-rows path (a question's prefill: pages decoded for the call, MLX's SDPA) on any
    backend: multi-token queries, tail over two chunks, odd prefix length, GQA 4, with and without sinks."""
    from cartridge.attention.kernels import dense

    shape = (8, 2, 64, 1001, 64, 300, 37)
    prefix, q, tk, tv = _case(tier, shape, seed=5)
    sinks = np.random.default_rng(3).standard_normal(shape[0]).astype(np.float32) * 3 if with_sinks else None
    cache = _cache(prefix, tk, tv, mx.float32)
    out = dense.prefill_attention(prefix, cache.tail(), mx.array(q), shape[2] ** -0.5,
                                  None if sinks is None else mx.array(sinks))
    _check(prefix, q, tk, tv, np.array(out)[0], f"dense prefill {tier}", sinks)


LOOKUP_TIERS = ("mxfp4", "mxfp4+rot", "nvfp4", "nvfp4+rot", "turbo2", "turbo3", "turbo4")


def _fused_cases():
    """(tier, shape, tensor cores, single launch, register lookups): every tier and shape; mlx4g32, int8, fp16 and
    turbo4 also without tensor cores (the plain pass 1), mlx4g32 and int8 also with the finish as a second kernel,
    the tiers that look codes up (FP4, TurboQuant) with the table in registers as well as in shared memory."""
    for tier, shape in itertools.product(sorted(TIERS), SHAPES):
        yield tier, shape, True, True, False
        if tier in ("mlx4g32", "int8", "fp16", "turbo4"):
            yield tier, shape, False, True, False
        if tier in ("mlx4g32", "int8"):
            yield tier, shape, True, False, False
        if tier in LOOKUP_TIERS:
            yield tier, shape, True, True, True


@pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend (run with DEVICE=gpu)")
@pytest.mark.parametrize("tier, shape, tensor_cores, single, regs", list(_fused_cases()))
def test_fused_cuda_matches_float64(tier, shape, tensor_cores, single, regs, monkeypatch, poisoned):
    from cartridge.attention.kernels import cuda, cuda_inputs

    if cuda.tier_spec(TIERS[tier], {}) is None:
        pytest.skip(f"no fused kernel for {tier}")
    has_tensor_cores = cuda.has_tensor_cores()
    if not tensor_cores:  # as on a GPU without them: the plain pass 1
        monkeypatch.setattr(cuda, "has_tensor_cores", lambda: False)
    tuning = tuned(**({} if single else {"single_max_rows": 0}),  # 0: the finish as a second kernel
                   register_lookup=frozenset((cuda.MXFP4, cuda.NVFP4, cuda.TURBO)) if regs else frozenset())
    try:
        prefix, q, tk, tv = _case(tier, shape, seed=_seed(tier, shape, 1))
    except Exception as e:
        pytest.skip(f"{tier} cannot store {shape}: {e}")
    fused = LayerPrefix(prefix.k_codec, prefix.k_parts, prefix.v_codec, prefix.v_parts, prefix.n_tokens,
                        prefix.k_params, prefix.v_params, cuda_inputs.lay_out(prefix, tuning))
    n_q, n_kv, D, _, _, _, L = shape
    # every shape's page is a multiple of 16 tokens; mxfp4, nvfp4, int6, kivi4 and the rotated tiers have only the
    # tensor-core pass 1 (and none of them is run without tensor cores)
    tc = tensor_cores and D in (64, 128) and has_tensor_cores
    assert cuda.uses_tensor_cores(fused.backend, n_q // n_kv * L, D) == tc
    for dtype in (mx.float32, mx.float16):
        got = _run(fused, q, tk, tv, dtype)
        if dtype == mx.float16:  # inputs rounded to fp16: compare against the same rounded inputs
            q16, tk16, tv16 = (np.array(mx.array(a).astype(mx.float16).astype(mx.float32)) for a in (q, tk, tv))
            _check(prefix, q16, tk16, tv16, got, f"fused {tier} {shape} fp16", tol=TOL_FP16)
        else:
            _check(prefix, q, tk, tv, got, f"fused {tier} {shape}")


@pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend (run with DEVICE=gpu)")
@pytest.mark.parametrize("tier, shape, first, last, tensor_cores", [
    ("mlx4g32", SHAPES[3], 4, 28, True),        # flash_pass1_mma (4 rows per KV head)
    ("mlx4g32+rot", SHAPES[3], 0, 7, True),     # flash_pass1_mma with a rotated K and V
    ("turbo3", SHAPES[2], 70, 0, True),         # flash_pass1_tc, protection past the first 16-token tile
    ("nvfp4+rot", SHAPES[5], 17, 3, True),      # flash_pass1_tc, multi-token
    ("int8", SHAPES[4], 33, 40, False),         # the plain pass 1, tail over two chunks
    ("kivi4", SHAPES[5], 2, 2, True),
])
def test_fused_cuda_protected_tokens_match_float64(tier, shape, first, last, tensor_cores, monkeypatch, poisoned):
    """Protected tokens (format 1.5): pass 1 reads the stored tokens first .. n - last - 1 only and the finish
    attends over the fp16 copies of the others, as over tail tokens every row sees."""
    from cartridge.attention.kernels import cuda, cuda_inputs

    if not tensor_cores:  # as on a GPU without them: the plain pass 1
        monkeypatch.setattr(cuda, "has_tensor_cores", lambda: False)
    prefix, q, tk, tv = _case(tier, shape, seed=_seed(tier, shape, 3))
    prefix = with_protected(prefix, first, last, shape[2])
    fused = replace(prefix, backend=cuda_inputs.lay_out(prefix))
    got = _run(fused, q, tk, tv)
    want = protected_reference(prefix, q, tk, tv)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.isfinite(got).all() and err < TOL, f"fused protected {tier} {shape}: relative error {err:.2e}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend (run with DEVICE=gpu)")
@pytest.mark.parametrize("tier", ["mlx4g32", "int8", "mlx4g32+rot", "int8+rot"])
def test_single_launch_repeats_and_matches_two_launches(tier):
    """The single launch keeps per-KV-head block counters in the cache's scratch and resets them itself: repeated
    decode steps on one cache give identical outputs, equal to the two-kernel finish up to rounding (a rotated V
    too: the last block rotates the prefix's merged output back, `rotate_back_lanes`)."""
    from cartridge.attention.kernels import cuda_inputs

    prefix, q, tk, tv = _case(tier, (32, 8, 128, 5003, 256, 1, 1), seed=11)
    fused = LayerPrefix(prefix.k_codec, prefix.k_parts, prefix.v_codec, prefix.v_parts, prefix.n_tokens,
                        prefix.k_params, prefix.v_params, cuda_inputs.lay_out(prefix))
    cache = CartridgeCache(fused, chunk_size=256)
    cache.update_and_fetch(mx.array(tk), mx.array(tv))
    qa = mx.array(q)
    outs = [np.array(cache.attention(qa, 128 ** -0.5)) for _ in range(3)]
    (work,) = cache.scratch.values()  # the work buffer ends with the 8 block counters, back at zero
    assert np.array_equal(np.array(work[-8:]).view(np.int32), np.zeros(8, dtype=np.int32))
    two_launches = CartridgeCache(replace(fused, backend=cuda_inputs.lay_out(prefix, tuned(single_max_rows=0))))
    two_launches.update_and_fetch(mx.array(tk), mx.array(tv))
    two = np.array(two_launches.attention(qa, 128 ** -0.5))
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])
    assert np.abs(two - outs[0]).max() <= 1e-5 * np.abs(two).max()


@pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend (run with DEVICE=gpu)")
@pytest.mark.parametrize("tier, shape", list(itertools.product(["fp16", "mlx4g32", "mlx4g32+rot", "turbo4", "nvfp4"],
                                                               [SHAPES[1], SHAPES[2], SHAPES[5]])))
def test_fused_cuda_sinks_match_float64(tier, shape, poisoned):
    """gpt-oss sinks on the fused path: the kernel itself answers (no portable fallback) with one more logit
    per head."""
    from cartridge.attention.kernels import cuda, cuda_inputs

    prefix, q, tk, tv = _case(tier, shape, seed=_seed(tier, shape, 2))
    sinks = np.random.default_rng(3).standard_normal(shape[0]).astype(np.float32) * 3
    record = cuda_inputs.lay_out(prefix)
    fused = LayerPrefix(prefix.k_codec, prefix.k_parts, prefix.v_codec, prefix.v_parts, prefix.n_tokens,
                        prefix.k_params, prefix.v_params, record)
    cache = _cache(fused, tk, tv, mx.float32)
    out = cuda.attend(record, fused, mx.array(q), cache.tail(), shape[2] ** -0.5, mx.array(sinks), cache.scratch)
    assert out is not None
    got = np.array(out)[0]
    _check(prefix, q, tk, tv, got, f"fused {tier} {shape} sinks", sinks)
    assert np.array_equal(got, _run(fused, q, tk, tv, sinks=sinks))  # cache.attention routes sinks to it
    assert not np.allclose(got, _run(fused, q, tk, tv), atol=1e-3)  # the sinks did something


@pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend (run with DEVICE=gpu)")
@pytest.mark.parametrize("tier, shape", list(itertools.product(
    ["int8", "int6+rot", "mlx4g32", "mlx4g32+rot", "kivi4", "fp8", "mxfp4", "nvfp4+rot", "turbo2", "turbo3", "turbo4"],
    [(8, 2, 64, 1001, 64, 300, 37), (32, 8, 128, 777, 128, 20, 5)])))
def test_question_prefill_cuda_decode_matches_float64(tier, shape, monkeypatch):
    """A question's prefill with the pages decoded by `cuda_decode` (one kernel: 16-token tiles, the last one
    partial; stored basis for the rotated tiers) and MLX's SDPA: every query row at once, tail over two chunks.
    fp16 queries only: float32 queries keep the MLX-op decode (the kernel rounds values to fp16; turbo2 at
    head_dim 64 was 1.07e-3 from float64 with float32 queries on an H200)."""
    from cartridge.attention.kernels import cuda, cuda_inputs

    # every call takes the question-prefill path and decodes the pages (the prefill kernel answers no rows)
    tuning = tuned(decoded_min_rows=1, prefill_min_rows=1 << 30)
    prefix, q, tk, tv = _case(tier, shape, seed=_seed(tier, shape, 5))
    record = cuda_inputs.lay_out(prefix, tuning)
    fused = replace(prefix, backend=record)
    D, N, T = shape[2], shape[3], shape[5]
    assert all(cuda.decoded(record, N, side, N + T, mx.float16, D) is not None for side in "kv")
    assert cuda.decoded(record, N, "k", N + T, mx.float32, D) is None
    q16, tk16, tv16 = (np.array(mx.array(a).astype(mx.float16).astype(mx.float32)) for a in (q, tk, tv))
    _check(prefix, q16, tk16, tv16, _run(fused, q, tk, tv, mx.float16), f"cuda decode {tier} {shape} fp16",
           tol=TOL_FP16)


def test_float32_pages_never_take_the_tensor_core_pass(monkeypatch):
    """flash_pass1_tc reads fp16, bf16 and the compressed tiers; float32 pages (dequantize-once under a float32
    model) take the plain pass 1 even where the GPU has tensor cores."""
    from cartridge.attention.kernels import cuda, cuda_inputs

    monkeypatch.setattr(cuda, "has_tensor_cores", lambda: True)
    prefix, *_ = _case("fp16", SHAPES[3], seed=1)
    assert cuda.uses_tensor_cores(cuda_inputs.lay_out(dequantize(prefix, mx.float16)), 4, 128)
    assert not cuda.uses_tensor_cores(cuda_inputs.lay_out(dequantize(prefix, mx.float32)), 4, 128)
    # a float32 K beside a side only the tensor-core pass reads (K decoded within a budget, V mxfp4): no kernel
    mixed, *_ = _case("mxfp4", SHAPES[3], seed=1)
    dense_k = dequantize(mixed, mx.float32)
    mixed = LayerPrefix(dense_k.k_codec, dense_k.k_parts, mixed.v_codec, mixed.v_parts, mixed.n_tokens, {},
                        mixed.v_params)
    assert not cuda.supported(mixed, 128) and cuda.supported(dequantize(mixed, mx.float16), 128)


def test_split_tokens_rounds_splits_to_the_granule():
    from cartridge.attention.kernels.cuda import split_tokens

    # 264 target blocks over 8 KV heads: 33 splits; 64-token rounding leaves the last split half the work
    assert split_tokens(131072, 8, 1, 64, 264) == (4032, 33)
    assert split_tokens(131072, 8, 1, 64, 264, granule=16) == (3984, 33)  # 32 x 3984 + 3584
    assert split_tokens(1000, 8, 1, 64, 264, granule=16) == (256, 4)  # at least 4 rounds of 64 tokens a split
    assert split_tokens(17, 1, 1, 64, 264, granule=16) == (32, 1)


def test_cuda_source_is_included_by_path_with_its_digest_in_every_kernel_name():
    """MLX hashes each kernel's source on every call and caches compiled kernels by name: the source it
    gets is a short body after an #include of the .cuh, and the .cuh's digest is in every name."""
    import hashlib

    from cartridge.attention.kernels import cuda, cuda_source

    header, digest = cuda_source.source_header()
    assert header == f'#include "{cuda_source.SOURCE.resolve()}"\n'
    assert digest == hashlib.sha256(cuda_source.SOURCE.read_text().encode()).hexdigest()[:16]
    names = set()
    for kind in ("pass1", "mma", "finish", "pass1+finish", "mma+finish"):
        for consts in ((("HD", 64), ("SCALE", 0.125)), (("HD", 128), ("SCALE", 0.125))):
            name, inputs, outputs, body = cuda_source.kernel_spec(kind, 2, consts)
            assert digest in name and len(body) < 1000 and f"constexpr int HD = {consts[0][1]};" in body
            assert "constexpr float SCALE = 0x1.0000000000000p-3f;" in body
            assert ("out" in outputs) == ("finish" in kind) and ("work" in inputs) == ("+" in kind)
            names.add(name)
    assert len(names) == 10  # the constants are part of the name: one compiled kernel per shape
    from cartridge.attention.kernels import cuda_decode

    consts = (("T", mx.float16), ("TIER", cuda.TURBO), ("BITS", 3), ("HD", 128), ("NKV", 8), ("PAGE", 256),
              ("WARPS", 4))
    name, inputs, outputs, body = cuda_decode.kernel_spec(consts, digest)
    assert digest in name and "using T = __half;" in body and "constexpr int BITS = 3;" in body
    assert inputs == ["c0", "c1", "c2", "cb", "prm"] and outputs == ["out"] and "cart::decode_tiles<" in body


PREFILL_TIERS = ["fp16", "bf16", "int8", "int6+rot", "mlx4g32", "mlx4g32+rot", "kivi4", "fp8", "mxfp4", "nvfp4+rot",
                 "turbo2", "turbo3", "turbo4"]
FROM_ONE_ROW = tuned(prefill_min_rows=1, prefill_dense_rows={})  # the prefill kernel from one row, fp16/bf16 pages too


@pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend (run with DEVICE=gpu)")
@pytest.mark.parametrize("tier, shape, dtype", [
    *((t, s, mx.float16) for t, s in itertools.product(PREFILL_TIERS, [(8, 2, 64, 1001, 64, 300, 37),
                                                                      (32, 8, 128, 777, 128, 20, 5)])),
    ("mlx4g32", (32, 8, 128, 5003, 256, 40, 40), mx.float16),  # 10 splits, 3 row blocks, the last partial
    ("fp16", (32, 8, 128, 5003, 256, 40, 40), mx.bfloat16),
    ("int8", (8, 2, 64, 1001, 64, 300, 37), mx.bfloat16),
])
def test_question_prefill_kernel_matches_float64(tier, shape, dtype, monkeypatch, poisoned):
    """A question's prefill by `cuda_prefill` (tensor cores over the stored tiles, 64-token tiles, the last one
    partial; splits merged by the finish with the tail over one or two chunks): every query row against float64
    over the same rounded inputs; the kernel, not another path, answers."""
    from cartridge.attention.kernels import cuda, cuda_inputs, cuda_prefill

    prefix, q, tk, tv = _case(tier, shape, seed=_seed(tier, shape, 6))
    record = cuda_inputs.lay_out(prefix, FROM_ONE_ROW)
    n_q, n_kv, D, _, _, _, L = shape
    assert cuda._prefills(record, n_q // n_kv * L, dtype, D) and not cuda._prefills(record, n_q // n_kv * L,
                                                                                     mx.float32, D)
    calls = []
    monkeypatch.setattr(cuda_prefill, "pass1", lambda *a, _f=cuda_prefill.pass1: calls.append(1) or _f(*a))
    got = _run(replace(prefix, backend=record), q, tk, tv, dtype)
    assert calls == [1]
    q16, tk16, tv16 = (np.array(mx.array(a).astype(dtype).astype(mx.float32)) for a in (q, tk, tv))
    _check(prefix, q16, tk16, tv16, got, f"prefill kernel {tier} {shape} {dtype}",
           tol=TOL_FP16 if dtype == mx.float16 else TOL_BF16)


@pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend (run with DEVICE=gpu)")
@pytest.mark.parametrize("tier, shape, first, last", [
    ("turbo3", (9, 3, 64, 257, 256, 7, 7), 70, 0),  # protection past the first 64-token tile
    ("nvfp4+rot", (32, 8, 128, 777, 128, 20, 5), 17, 3),
    ("kivi4", (32, 8, 128, 777, 128, 20, 5), 2, 2),
])
def test_question_prefill_kernel_protected_tokens_match_float64(tier, shape, first, last, poisoned):
    """Protected tokens (format 1.5) with the prefill kernel: it reads stored tokens first .. n - last - 1 only."""
    from cartridge.attention.kernels import cuda_inputs

    prefix, q, tk, tv = _case(tier, shape, seed=_seed(tier, shape, 7))
    prefix = with_protected(prefix, first, last, shape[2])
    got = _run(replace(prefix, backend=cuda_inputs.lay_out(prefix, FROM_ONE_ROW)), q, tk, tv, mx.float16)
    q16, tk16, tv16 = (np.array(mx.array(a).astype(mx.float16).astype(mx.float32)) for a in (q, tk, tv))
    want = protected_reference(prefix, q16, tk16, tv16)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.isfinite(got).all() and err < TOL_FP16, f"prefill kernel protected {tier}: relative error {err:.2e}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend (run with DEVICE=gpu)")
@pytest.mark.parametrize("tier", ["fp16", "mlx4g32+rot", "turbo4"])
def test_question_prefill_kernel_sinks_match_float64(tier, poisoned):
    from cartridge.attention.kernels import cuda_inputs

    shape = (32, 8, 128, 777, 128, 20, 5)
    prefix, q, tk, tv = _case(tier, shape, seed=_seed(tier, shape, 8))
    sinks = np.random.default_rng(3).standard_normal(shape[0]).astype(np.float32) * 3
    got = _run(replace(prefix, backend=cuda_inputs.lay_out(prefix, FROM_ONE_ROW)), q, tk, tv, mx.float16, sinks=sinks)
    q16, tk16, tv16 = (np.array(mx.array(a).astype(mx.float16).astype(mx.float32)) for a in (q, tk, tv))
    _check(prefix, q16, tk16, tv16, got, f"prefill kernel {tier} sinks", sinks, tol=TOL_FP16)


def test_question_prefill_kernel_splits_whole_tiles():
    from cartridge.attention.kernels import cuda_prefill

    # 256 query tokens x GQA 4 = 16 row blocks of 64 over 8 KV heads: 3 splits of 43,712 tokens (683 tiles)
    assert cuda_prefill.split_tokens(131072, 8, 16, 264) == (43712, 3)
    assert cuda_prefill.split_tokens(1000, 8, 1, 264) == (256, 4)  # at least 4 tiles a split
    assert cuda_prefill.split_tokens(20, 1, 1, 264) == (64, 1)
    # shared memory: two stages of 4 + 4 TcSide tiles, and a decoded tile per side not stored as fp16
    assert cuda_prefill.smem_bytes((cuda_prefill.FP16, 0), (cuda_prefill.FP16, 0), 128) == 2 * 8 * 16 * 272
    assert cuda_prefill.smem_bytes((cuda_prefill.AFF4, 0), (cuda_prefill.AFF4, 0), 128) == \
        2 * 8 * (16 * 80 + 128 + 128) + 2 * 64 * 136 * 2


@pytest.mark.parametrize("tier", ["fp16", "mlx4g32+rot", "turbo4", "nvfp4"])
def test_fused_inputs_made_at_load_evaluate_on_another_thread(tier):
    """MLX 0.32 evaluates a lazy array on the stream of the thread that made it: the kernel's fixed inputs (made
    when a cartridge loads) must hold their data, so a server's worker thread can launch it (a lazy `mx.zeros`
    codebook raised 'There is no Stream(gpu, 0) in current thread' there on an H200)."""
    import threading

    from cartridge.attention.kernels import cuda_inputs

    prefix, *_ = _case(tier, SHAPES[3], seed=1)
    record = cuda_inputs.lay_out(prefix)
    fixed = [*record.k_in[len(prefix.k_parts):], *record.v_in[len(prefix.v_parts):], record.cbk, record.cbv,
             record.sgk, record.sgv, record.no_sinks]
    errors = []

    def attend():
        try:
            mx.eval([a + 0 for a in fixed])
        except RuntimeError as e:
            errors.append(str(e))

    worker = threading.Thread(target=attend)
    worker.start()
    worker.join()
    assert errors == []


@pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend (run with DEVICE=gpu)")
@pytest.mark.parametrize("tier, dtype, L", [("fp16", mx.float16, 40), ("fp16", mx.bfloat16, 40),
                                            ("fp16", mx.float16, 2)])
def test_contiguous_question_on_the_pages_then_decode_match_float64(tier, dtype, L, monkeypatch, poisoned):
    """An fp16 cartridge's question within `CudaTuning.question_rows` is answered over the pages (the contiguous
    buffer untouched): by the prefill kernel within `prefill_dense_rows` (40 tokens, 160 rows per KV head),
    by the row-block kernel below them (2 tokens, 8 rows); the decode steps after it, from the buffer, see its
    tokens."""
    from cartridge.attention import contiguous
    from cartridge.attention.kernels import cuda_prefill
    from cartridge.attention.kernels.cuda_tuning import TUNING

    shape = (32, 8, 128, 5003, 256, 40, L)
    lo, hi = TUNING.prefill_dense_rows[cuda_prefill.FP16]
    prefill = lo <= 4 * L <= hi
    assert TUNING.question_rows[0] <= 4 * L <= TUNING.question_rows[1] and prefill == (L == 40)
    prefix, q, tk, tv = _case(tier, shape, seed=_seed(tier, shape, 9))
    record = contiguous.lay_out(prefix)
    calls = []
    monkeypatch.setattr(cuda_prefill, "pass1", lambda *a, _f=cuda_prefill.pass1: calls.append(1) or _f(*a))
    cache = _cache(replace(prefix, backend=record), tk, tv, dtype)
    got = np.array(cache.attention(mx.array(q).astype(dtype), shape[2] ** -0.5,
                                   "causal").astype(mx.float32))[0]
    assert calls == [1] * prefill and record.buffer.keys is None
    r16 = [np.array(mx.array(a).astype(dtype).astype(mx.float32)) for a in (q, tk, tv)]
    tol = TOL_FP16 if dtype == mx.float16 else TOL_BF16
    _check(prefix, *r16, got, f"question on the pages {tier} {dtype}", tol=tol)
    rng = np.random.default_rng(5)
    for step in range(2):
        q1, k1, v1 = (rng.standard_normal((1, n, 1, shape[2])).astype(np.float32) for n in (32, 8, 8))
        cache.update_and_fetch(mx.array(k1).astype(dtype), mx.array(v1).astype(dtype))
        r16[1], r16[2] = (np.concatenate([t, np.array(mx.array(a).astype(dtype).astype(mx.float32))], axis=2)
                          for t, a in ((r16[1], k1), (r16[2], v1)))
        q16 = np.array(mx.array(q1).astype(dtype).astype(mx.float32))
        got = np.array(cache.attention(mx.array(q1).astype(dtype), shape[2] ** -0.5).astype(mx.float32))[0]
        _check(prefix, q16, r16[1], r16[2], got, f"decode step {step} after the question", tol=tol)
    assert calls == [1] * prefill and record.buffer.keys is not None


def test_question_prefill_kernel_takes_the_rows_where_it_was_measured_faster():
    from cartridge.attention.kernels import cuda_prefill as cp
    from cartridge.attention.kernels.cuda_tuning import TUNING

    aff4, int8, turbo3, turbo4 = (cp.AFF4, 0, ()), (cp.AFF8, 0, ()), (cp.TURBO, 3, ()), (cp.TURBO, 4, ())
    f16 = mx.float16
    assert [cp.reads(int8, int8, 256, 128, f16, r) for r in (127, 128, 255, 256)] == [False, True, True, False]
    assert [cp.reads(s, s, 256, 128, f16, 256) for s in (aff4, turbo3, turbo4)] == [True, True, False]
    assert not cp.reads(aff4, aff4, 256, 128, f16, 256, rotated=True) and cp.reads(aff4, aff4, 256, 128, f16, 255, True)
    assert not cp.reads(aff4, aff4, 256, 128, mx.float32, 128)  # float32 queries: the exact paths
    fp16 = (cp.FP16, 0, ())
    lo, hi = TUNING.prefill_dense_rows[cp.FP16]  # fp16 pages: their own range
    assert [cp.reads(fp16, fp16, 256, 128, f16, r) for r in (lo - 1, lo, hi, hi + 1)] == [False, True, True, False]
    assert not cp.reads(aff4, aff4, 8, 128, f16, 128) and not cp.reads(aff4, aff4, 256, 256, f16, 128)
