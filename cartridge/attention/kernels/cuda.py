"""Fused flash-decoding attention over compressed pages on MLX's CUDA backend (`mx.fast.cuda_kernel`).

`attend` computes one call from its arguments: the layer's `CudaInputs` (its pages as the kernels take them, laid
out at load: `cuda_inputs`), the queries, the cache's tail (`state.Tail`) and its scratch. Pass 1 reads the stored
pages of every tier with a `kernel_layout` (`cartridge.tiers.layout`) directly and dequantizes in registers, split
over tokens; the finish merges the splits, attends over the dense tail and writes the output in the queries' dtype.
For decode (at most `single_max_rows` query rows per KV head, a tail of at most `single_max_tail` tokens, a pass 1 of
4 warps) both run in one launch: the block of the last split also attends over the tail, as one more partial, and
the last block of each KV head to finish merges them (rotating a rotated V's prefix output back first), in a work
buffer of the cache's scratch; otherwise the finish is a second kernel. When both sides are mlx4g32, a block holds
at most 4 query rows per KV head and the GPU has tensor cores (sm_80 or newer), pass 1 is the tensor-core variant
`flash_pass1_mma`. A question of many query rows per KV head takes `cuda_prefill`'s kernel as pass 1 (the rows in
`cuda_prefill.reads`) or, from `decoded_min_rows` rows, the pages decoded for MLX's SDPA (`dense`). The launch shapes
and crossovers are the layer's `CudaTuning` (docs/performance.md "CUDA tuning constants"). The plain reference for
all of them is `cartridge.attention.kernels.portable` (tests compare them against float64).

Host cost matters as much as the kernels here: a decode step calls this once per layer, and MLX builds and hashes
the kernel source on every call. The source handed to MLX is a few lines (`cuda_source`), and kernels, grids,
output shapes and decode parameters are made once per shape (`Launch`, `_params`, memoized in the `CudaInputs`).
"""

import functools
import math
import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

# the kernel tier ids are the codecs' (`KernelLayout.tier_id`); re-exported for tests and benchmarks
from ...tiers.layout import AFF4, AFF6, AFF8, BF16, F32, FP16, KIVI4, MXFP4, MXFP8, NVFP4, TURBO  # noqa: F401
from . import cuda_decode, cuda_prefill, dense
from .cuda_inputs import rotation, tier_spec
from .cuda_source import kernel

TC_ONLY = (MXFP4, NVFP4, AFF6, KIVI4)  # tiers only `flash_pass1_tc` reads (no plain pass 1)
HEAD_DIMS = (64, 128, 256)
MMA_HEAD_DIMS = (64, 128)  # the tensor-core passes'
MAX_CHUNKS = 8  # tail chunks the finish reads directly; more falls back to the portable path
PREFILL, DECODED = "prefill", "decoded"  # `route`'s answers besides a launch


def _lut_bytes(tid, bits):
    """Bytes of one side's shared-memory code-pair table (TcSide::LUT_BYTES): 0 for a tier without lookups."""
    if tid not in (MXFP4, NVFP4, TURBO):
        return 0
    entries = 1 << (2 * (bits if tid == TURBO else 4))
    return entries * (32 if entries * 128 <= 8192 else 8192 // (4 * entries)) * 4


def tc_smem_bytes(k_spec, v_spec, D, lreg, warps, stages):
    """Dynamic shared memory of flash_pass1_tc (tc_smem_bytes in flash_decode.cuh): the code-pair tables (unless
    `lreg`, lookups in registers), then the stages or the warps' outputs, whichever is larger."""
    tk, tv = (cuda_prefill.tc_side_bytes(s[0], s[1], D) for s in (k_spec, v_spec))
    tables = 0 if lreg else _lut_bytes(k_spec[0], k_spec[1]) + _lut_bytes(v_spec[0], v_spec[1])
    return tables + max(warps * stages * (tk + tv), warps * 8 * D * 4)


@functools.cache
def has_tensor_cores():
    """True if the default device is an NVIDIA GPU of compute capability 8.0 or newer (mma.m16n8k16
    with fp16 operands, mma.m16n8k32 with 8-bit integers and cp.async need sm_80)."""
    found = re.fullmatch(r"sm_(\d+)\w*", str(mx.device_info().get("architecture", "")))
    return found is not None and int(found.group(1)) >= 80


def supported(prefix, head_dim):
    """True if both sides' tiers and the head_dim have a fused kernel (mxfp4, nvfp4 and the rotated tiers: only
    the tensor-core pass 1, so head_dim 64 or 128, pages of a multiple of 16 tokens and a GPU with tensor
    cores; a rotation's block must be the whole head, as it is by default at 64 and 128)."""
    specs = [tier_spec(prefix.k_codec, prefix.k_parts), tier_spec(prefix.v_codec, prefix.v_parts)]
    if head_dim not in HEAD_DIMS or None in specs:
        return False
    rots = [rotation(prefix.k_codec, prefix.k_params), rotation(prefix.v_codec, prefix.v_params)]
    if any(r is not None and r["block"] != head_dim for r in rots):  # whole heads only
        return False
    if any(s[0] in TC_ONLY for s in specs) or any(r is not None for r in rots):  # beside float32 pages: none
        page = prefix.k_parts[next(iter(prefix.k_parts))].shape[2]
        return F32 not in (specs[0][0], specs[1][0]) and head_dim in MMA_HEAD_DIMS and page % 16 == 0 and \
            has_tensor_cores()
    return True


def split_tokens(n_tokens, n_kv, row_blocks, slots, target_blocks, granule=None):
    """(tokens per split, number of splits): about `target_blocks` blocks, each split at least 4 rounds of
    `slots` tokens and a multiple of `granule` tokens (default `slots`)."""
    granule = granule or slots
    n_splits = max(1, min(math.ceil(target_blocks / (n_kv * row_blocks)), math.ceil(n_tokens / (4 * slots))))
    per = math.ceil(math.ceil(n_tokens / n_splits) / granule) * granule
    return per, math.ceil(n_tokens / per)


@dataclass(frozen=True, eq=False)  # hashed by identity: a key of the cache's scratch
class Launch:
    """Everything about one call that depends only on its shape: kernels, fixed inputs, grids, sizes."""

    kernel: object  # pass 1; with the finish when `single`
    consts: tuple  # its compile-time constants (kernel_spec)
    inputs: list  # fixed pass-1 inputs between the queries and `prm`
    grid: tuple
    threads: int  # per pass-1 block
    single: bool
    finish: object  # the finish kernel when not `single`
    R: int
    per: int
    n_splits: int
    work_size: int  # float32 elements of the single launch's scratch: partials and block counters


def _params(inputs, launch, L, tail_len, chunk_size):
    """Kernel parameters [end of the stored tokens read, R, per split, splits, tail length, query tokens, first
    split's start, first stored token read] (int32 (8,)) on the device. Decode steps (L = 1) take a row made
    and evaluated once per tail length, so a step adds no operation for them."""
    head = [inputs.end, launch.R, launch.per, launch.n_splits]
    if L > 1:
        return mx.array([*head, tail_len, L, inputs.start, inputs.first], dtype=mx.int32)
    key = (launch.R, launch.per, launch.n_splits, chunk_size)
    rows = inputs.rows.get(key)
    if rows is None:
        table = np.zeros((MAX_CHUNKS * chunk_size + 1, 8), dtype=np.int32)
        table[:] = [*head, 0, 1, inputs.start, inputs.first]
        table[:, 4] = np.arange(len(table))
        rows = inputs.rows[key] = list(mx.array(table))
        mx.eval(rows)
    return rows[tail_len]


def _protected(inputs, dtype):
    """The finish's pk, pv: the protected tokens' fp16 copies (n_kv, NP, D) in `dtype`, or one-element dummies."""
    kept = inputs.kept_as.get(dtype)
    if kept is None:
        kept = [mx.zeros((1,), dtype=dtype)] * 2 if inputs.kept is None else [a.astype(dtype) for a in inputs.kept]
        mx.eval(kept)
        inputs.kept_as[dtype] = kept
    return kept


def _cuda_decodes(inputs, spec, dtype, D):
    """True if `cuda_decode` decodes a side of `spec` for queries of `dtype`: fp16/bf16 queries only (it rounds the
    values to fp16 on the way, as flash_pass1_tc reads them: a float32 model keeps the exact MLX-op decode)."""
    return dtype in (mx.float16, mx.bfloat16) and inputs.table_ok and cuda_decode.reads(spec, inputs.page, D)


def _dense_min_rows(inputs, dtype, D):
    """Query rows per KV head from which a call takes `dense.prefill_attention`: `decoded_min_rows` where
    `cuda_decode` decodes both sides, else `dense_min_rows` (the MLX-op decode's crossover)."""
    t = inputs.tuning
    if all(_cuda_decodes(inputs, s, dtype, D) for s in (inputs.k_spec, inputs.v_spec)):
        return t.decoded_min_rows
    return t.dense_min_rows.get(inputs.k_spec[0], t.dense_min_rows_other)


def decoded(inputs, n_tokens, side, n_out, dtype, D):
    """A side's `n_tokens` stored tokens decoded by `cuda_decode.decode_side` as (1, n_kv, n_out, D) of `dtype`
    (stored basis), or None where that kernel does not read the side (`dense.prefill_attention` decodes by MLX ops)."""
    spec, arrays, cb = (inputs.k_spec, inputs.k_in, inputs.cbk) if side == "k" else \
        (inputs.v_spec, inputs.v_in, inputs.cbv)
    if not _cuda_decodes(inputs, spec, dtype, D):
        return None
    return cuda_decode.decode_side(spec, arrays, cb, n_tokens, n_out, D, dtype, inputs.tuning.decode_warps)


def uses_mma(inputs, R, D):
    """True if pass 1 runs `flash_pass1_mma` (mlx4g32 K and V) for R query rows per KV head and head_dim D."""
    return inputs.mma and R <= 4 and D in MMA_HEAD_DIMS and has_tensor_cores()


def uses_tensor_cores(inputs, R, D):
    """True if pass 1 runs on tensor cores (`flash_pass1_mma` or `flash_pass1_tc`) for R query rows per KV head
    and head_dim D: on a GPU with tensor cores, for every tier but float32 pages, in whole 16-token tiles."""
    return inputs.tc_reads and D in MMA_HEAD_DIMS and inputs.page % 16 == 0 and has_tensor_cores()


def _launch(inputs, n_q, L, D, dtype, n_chunks, chunk_size, scale, single, sinks):
    t = inputs.tuning
    R = (n_q // inputs.n_kv) * L  # query rows per KV head: GQA group x query tokens
    smem = 0
    n_kv, page = inputs.n_kv, inputs.page
    if uses_mma(inputs, R, D):
        target = t.mma_target_blocks_d64 if D == 64 else t.mma_target_blocks
        # splits of whole 16-token tiles, equal within a tile: at 131072 tokens, 32 x 3984 + 3584 tokens
        # rather than 32 x 4032 + 2048 (a block with half the work, and the others longer)
        per, n_splits = split_tokens(inputs.end - inputs.start, n_kv, 1, 16 * t.mma_warps, target, granule=16)
        kind, fixed, threads = "mma", [inputs.sgk, *inputs.k_in, *inputs.v_in], t.mma_warps * 32
        consts = [("T", dtype), ("HD", D), ("NKV", n_kv), ("PAGE", page), ("WARPS", t.mma_warps),
                  ("STAGES", t.mma_stages), ("RK", inputs.k_rot)]
        grid = (n_splits * threads, n_kv, 1)
    elif uses_tensor_cores(inputs, R, D):
        target = t.tc_target_blocks_d64 if D == 64 else t.tc_target_blocks
        row_blocks = -(-R // 8)
        warps = t.tc_warps_turbo if inputs.v_spec[0] == TURBO else t.tc_warps
        per, n_splits = split_tokens(inputs.end - inputs.start, n_kv, row_blocks, 16 * warps, target, granule=16)
        (tk, bk, _), (tv, bv, _) = inputs.k_spec, inputs.v_spec
        lreg = bool(t.register_lookup & {tk, tv}) and inputs.table_ok
        kind, threads = "tc", warps * 32
        fixed = [inputs.sgk, *inputs.k_in, *inputs.v_in, inputs.cbk, inputs.cbv]
        consts = [("T", dtype), ("TK", tk), ("BK", bk), ("TV", tv), ("BV", bv), ("HD", D), ("NKV", n_kv),
                  ("PAGE", page), ("WARPS", warps), ("STAGES", t.tc_stages), ("RK", inputs.k_rot),
                  ("LREG", lreg)]
        grid = (n_splits * threads, n_kv, row_blocks)
        smem = tc_smem_bytes(inputs.k_spec, inputs.v_spec, D, lreg, warps, t.tc_stages)
        # MLX raises a kernel's shared-memory limit only for more than 48000 dynamic bytes; with the static
        # arrays (about 6 KB) a smaller request could still pass the default 48 KiB
        smem = smem if smem <= 48 * 1024 - 8192 else max(smem, 48004)
    else:
        rows, epl = (R, t.decode_epl) if R <= 4 else (8, 8)
        slots = (32 // (D // epl)) * t.warps * t.unroll  # tokens a block consumes per round
        row_blocks = -(-R // rows)
        per, n_splits = split_tokens(inputs.end - inputs.start, n_kv, row_blocks, slots, t.target_blocks)
        (tk, bk, _), (tv, bv, _) = inputs.k_spec, inputs.v_spec
        kind, threads = "pass1", t.warps * 32
        fixed = [inputs.sgk, *inputs.k_in, *inputs.v_in, inputs.cbk, inputs.cbv]
        consts = [("T", dtype), ("TK", tk), ("TV", tv), ("BK", bk), ("BV", bv), ("HD", D), ("EPL", epl),
                  ("ROWS", rows), ("NKV", n_kv), ("PAGE", page), ("WARPS", t.warps), ("UNR", t.unroll)]
        grid = (n_splits * threads, n_kv, row_blocks)
    consts.append(("SCALE", float(scale)))
    if single and threads == 128:
        consts = (*consts, ("CH", chunk_size), ("VROT", inputs.v_back))
        work = (n_splits + 1) * n_kv * R * (D + 2) + n_kv
        return Launch(kernel(kind + "+finish", 1, consts, smem), consts, fixed, grid, threads, True, None, R, per,
                    n_splits, work)
    consts = tuple(consts)
    return Launch(kernel(kind, 0, consts, smem), consts, fixed, grid, threads, False,
                _finish_kernel(inputs, dtype, D, n_chunks, chunk_size, scale, sinks), R, per, n_splits, 0)


def _finish_kernel(inputs, dtype, D, n_chunks, chunk_size, scale, sinks):
    """The two-kernel finish (`finish_row`) for this layer: tail chunks, rotated V, sinks, protected tokens."""
    return kernel("finish", n_chunks, (
        ("T", dtype), ("HD", D), ("NKV", inputs.n_kv), ("NCH", n_chunks), ("CH", chunk_size), ("VROT", inputs.v_back),
        ("SINKS", sinks), ("NP", 0 if inputs.kept is None else inputs.kept[0].shape[1]), ("SCALE", float(scale))))


def _finish(inputs, finish, partials, R, queries, prm, sinks, tail):
    """Launch `finish` over pass 1's `partials` (O, M, L) of R query rows per KV head: the output."""
    n_chunks = tail.n_chunks
    tails = [c for pair in zip(tail.k_chunks[:n_chunks], tail.v_chunks[:n_chunks]) for c in pair]
    return finish(
        inputs=[*partials, queries, prm, inputs.sgv, inputs.no_sinks if sinks is None else sinks.astype(mx.float32),
                *_protected(inputs, queries.dtype), *tails], grid=(128, inputs.n_kv, R),
        threadgroup=(128, 1, 1), output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]


def _prefills(inputs, R, dtype, D):
    """True if `cuda_prefill` answers R query rows per KV head of `dtype` (both sides read there, the TurboQuant
    codebooks symmetric, a GPU with tensor cores)."""
    return (cuda_prefill.reads(inputs.k_spec, inputs.v_spec, inputs.page, D, dtype, R, inputs.k_rot or inputs.v_rot,
                               inputs.tuning)
            and inputs.table_ok
            and has_tensor_cores())


def _fits(n_chunks, D):
    """True if the kernels read a tail of `n_chunks` chunks (1 to MAX_CHUNKS) and this head_dim."""
    return 1 <= n_chunks <= MAX_CHUNKS and D in HEAD_DIMS


def prefill_kernel_takes(inputs, queries, tail):
    """True if a call with these (1, n_q_heads, L, head_dim) queries runs `cuda_prefill`'s kernel as pass 1."""
    _, n_q, L, D = queries.shape
    return _fits(tail.n_chunks, D) and _prefills(inputs, n_q // inputs.n_kv * L, queries.dtype, D)


def question_kernel_takes(inputs, queries, tail):
    """True if a call with these (1, n_q_heads, L, head_dim) queries of fp16/bf16 runs a tensor-core kernel:
    `cuda_prefill`'s, or pass 1 on tensor cores (`uses_tensor_cores`) below the rows of `dense.prefill_attention`
    (`contiguous.on_pages` routes fp16 questions by it)."""
    _, n_q, L, D = queries.shape
    R = n_q // inputs.n_kv * L
    if prefill_kernel_takes(inputs, queries, tail):
        return True
    return (queries.dtype in (mx.float16, mx.bfloat16) and _fits(tail.n_chunks, D)
            and R < _dense_min_rows(inputs, queries.dtype, D) and uses_tensor_cores(inputs, R, D))


def route(inputs, n_q, L, D, dtype, scale, sinks, n_chunks, chunk_size, short_tail):
    """How calls of one shape run: PREFILL (`cuda_prefill`'s kernel as pass 1), DECODED (the pages decoded for
    MLX's SDPA), a `Launch` (pass 1 and the finish, in one launch or two), or None (the portable path)."""
    t = inputs.tuning
    R = n_q // inputs.n_kv * L
    fits = _fits(n_chunks, D)
    if fits and _prefills(inputs, R, dtype, D):
        return PREFILL
    if R >= _dense_min_rows(inputs, dtype, D):
        return DECODED
    if not fits:
        return None
    single = R <= t.single_max_rows and short_tail and n_chunks == 1 and sinks is None and inputs.kept is None
    return _launch(inputs, n_q, L, D, dtype, n_chunks, chunk_size, scale, single, sinks is not None)


def attend(inputs, prefix, queries, tail, scale, sinks, scratch):
    """Attention output (1, n_q_heads, L, head_dim) in the queries' dtype, or None if unsupported.

    Args:
        inputs (CudaInputs): the layer's pages as the kernels take them. prefix (LayerPrefix): the same pages.
        queries (mx.array): (1, n_q_heads, L, head_dim), the last L tokens of the tail.
        tail (state.Tail): the cache's dense tail.
        scale (float): softmax scale.
        sinks (mx.array | None): (n_q_heads,) sink logits (gpt-oss), merged by the two-kernel finish
            as one more logit per head. Default: None.
        scratch (state.Scratch): the cache's buffers: the single launch keeps its work buffer there (float32
            partials, then int32 block counters that the kernel returns to zero). Two calls on one cache must
            therefore run one after the other: each decode step's queries depend on the previous step's output,
            so mlx-lm's generate loop always orders them; two independent calls in one graph could overlap on the
            device and share the buffer. (An explicit edge, the previous output as an input, cost more host
            time per step than the single launch saves: benchmarks/gpu_e2e_variants.py at a876215.)
    """
    _, n_q, L, D = queries.shape
    n_chunks, short_tail = -(-tail.length // tail.chunk_size), tail.length <= inputs.tuning.single_max_tail
    # what a call does depends only on these (the tuning is the layer's)
    key = (n_q, L, D, queries.dtype, scale, sinks is None, n_chunks, tail.chunk_size, short_tail)
    launch = inputs.routes.get(key)
    if launch is None:
        launch = inputs.routes[key] = route(inputs, n_q, L, D, queries.dtype, scale, sinks, n_chunks,
                                            tail.chunk_size, short_tail)
    if launch is None:
        return None
    if launch is PREFILL:
        *partials, prm = cuda_prefill.pass1(inputs, prefix, queries, scale, tail.length)
        finish = _finish_kernel(inputs, queries.dtype, D, n_chunks, tail.chunk_size, scale, sinks is not None)
        return _finish(inputs, finish, partials, n_q // inputs.n_kv * L, queries, prm, sinks, tail)
    if launch is DECODED:
        n = prefix.n_tokens + tail.length
        sides = [decoded(inputs, prefix.n_tokens, side, n, queries.dtype, D) for side in "kv"]
        return dense.prefill_attention(prefix, tail, queries, scale, sinks, decoded=sides)
    prm = _params(inputs, launch, L, tail.length, tail.chunk_size)
    if launch.single:
        return launch.kernel(
            inputs=[queries, *launch.inputs, prm, scratch.buffer(launch, launch.work_size), tail.k_chunks[0],
                    tail.v_chunks[0], inputs.sgv],
            grid=launch.grid, threadgroup=(launch.threads, 1, 1), output_shapes=[queries.shape],
            output_dtypes=[queries.dtype])[0]
    partial = [(launch.n_splits, inputs.n_kv, launch.R)]
    partials = launch.kernel(
        inputs=[queries, *launch.inputs, prm], grid=launch.grid, threadgroup=(launch.threads, 1, 1),
        output_shapes=[(launch.n_splits, inputs.n_kv, launch.R, D)] + partial * 2, output_dtypes=[mx.float32] * 3)
    return _finish(inputs, launch.finish, partials, launch.R, queries, prm, sinks, tail)
