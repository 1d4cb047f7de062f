"""A question's prefill on the stored pages by one tensor-core kernel, with no fp16 copy (issue 34 item 3).

A question of L tokens over a long prefix is R = GQA group x L query rows per KV head. `prefill_tc` in
flash_decode.cuh (FlashAttention-2, Dao 2023) gives each block 16 x `prefill_warps` of those rows and one split of the
prefix's tokens: the block copies each 64-token tile as stored, decodes it once into fp16 rows in shared memory
(the tile decode of `flash_pass1_tc`; fp16 pages are read in place), and its warps multiply on tensor cores
(mma.m16n8k16) for the scores and the output, so a tile is read once per block of rows instead of once per 8 rows
(`flash_pass1_tc`'s row blocks), and nothing is written back but the splits' partials. `kernels.cuda`'s
two-kernel finish (`finish_row`) then merges the splits, the dense tail (the question's own K/V, causal) and any
protected tokens. K stored rotated (+rot, TurboQuant) is met by rotating the queries into its basis first; V
stored rotated is rotated back by the finish, as for decode.

This module builds and launches pass 1 only, from the layer's `CudaInputs` (`kernels.cuda` routes calls here). Its
launch shape and the rows it answers are the layer's `CudaTuning` (docs/performance.md "CUDA tuning constants").
"""

import functools
import hashlib
import math

import mlx.core as mx

from ...tiers.layout import AFF4, AFF6, AFF8, BF16, FP16, KIVI4, MXFP4, MXFP8, NVFP4, TURBO
from . import cuda_tuning
from .cuda_source import constants, source_header
from .dense import per_kv_head

TILE = 64  # prefix tokens per tile (PF_TOK in flash_decode.cuh)
TIERS = (FP16, BF16, AFF8, AFF6, AFF4, KIVI4, MXFP8, MXFP4, NVFP4, TURBO)  # the tiers flash_pass1_tc reads
HEAD_DIMS = (64, 128)
CALL = ("cart::prefill_tc<T, TK, BK, TV, BV, HD, NKV, PAGE, WARPS>(q, SCALE, (const void*)k0, (const void*)k1, "
        "(const void*)k2, (const void*)v0, (const void*)v1, (const void*)v2, cbk, cbv, prm, O, M, L);\n")
INPUTS = ["q", "k0", "k1", "k2", "v0", "v1", "v2", "cbk", "cbv", "prm"]


def kernel_spec(consts, digest):
    """(name, input names, output names, body) of `prefill_tc` for `consts` ((name, value) pairs: T, TK, BK, TV, BV,
    HD, NKV, PAGE, WARPS, SCALE); `digest` is flash_decode.cuh's (part of the name, as `cuda_source.kernel_spec`'s)."""
    body = constants(consts) + CALL
    tag = hashlib.sha256(repr(consts).encode()).hexdigest()[:10]
    return f"cartridge_prefill_{digest}_{tag}", INPUTS, ["O", "M", "L"], body


def tc_side_bytes(tid, bits, D):
    """Bytes of one side's 16-token tile in shared memory (TcSide::BYTES in flash_decode.cuh, as `flash_pass1_tc`
    and `prefill_tc` copy it): array 0 with its row stride, then arrays 1 and 2 (kivi4: its token group's 32 rows)."""
    affine = tid in (AFF8, AFF6, AFF4, KIVI4)
    b0 = (2 * D if tid in (FP16, BF16) else D if tid in (AFF8, MXFP8) else 3 * D // 4 if tid == AFF6
          else D * bits // 8 if tid == TURBO else D // 2)
    b1 = D // 16 if affine else {MXFP8: D // 32, MXFP4: D // 32, NVFP4: D // 16, TURBO: 2}.get(tid, 0)
    b2 = D // 16 if affine else 0
    rows = 32 if tid == KIVI4 else 16
    rs = b0 if b0 % 16 or (b0 // 16) % 2 else b0 + 16  # TcSide::RS: an odd number of 16-byte units
    return 16 * rs + (rows * b1 + 15) // 16 * 16 + (rows * b2 + 15) // 16 * 16


def smem_bytes(k_spec, v_spec, D):
    """Dynamic shared memory of `prefill_tc` (PfLayout::BYTES): two stages of four TcSide tiles a side, and a
    decoded 64-token tile of (D + 8) halves a row for each side not stored as fp16."""
    stage = 4 * (tc_side_bytes(k_spec[0], k_spec[1], D) + tc_side_bytes(v_spec[0], v_spec[1], D))
    decoded = sum(TILE * (D + 8) * 2 for spec in (k_spec, v_spec) if spec[0] != FP16)
    return 2 * stage + decoded


@functools.cache
def _kernel(consts, shared_memory):
    name, inputs, outputs, body = kernel_spec(consts, source_header()[1])
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=body,
                               header=source_header()[0], shared_memory=shared_memory)


def row_range(k_spec, rotated=False, tuning=None):
    """(fewest, most) query rows per KV head `prefill_tc` answers for K pages of kernel tier `k_spec` under `tuning`
    (default `cuda_tuning.TUNING`): `prefill_dense_rows` for unrotated dense pages, (`prefill_min_rows`,
    `prefill_max_rows_wide`) for the unrotated (tier, bits) in `prefill_wide`, else (`prefill_min_rows`,
    `prefill_max_rows`)."""
    t = cuda_tuning.TUNING if tuning is None else tuning
    if not rotated and k_spec[0] in t.prefill_dense_rows:
        return t.prefill_dense_rows[k_spec[0]]
    wide = not rotated and (k_spec[0], k_spec[1]) in t.prefill_wide
    return t.prefill_min_rows, t.prefill_max_rows_wide if wide else t.prefill_max_rows


def reads(k_spec, v_spec, page, head_dim, dtype, rows, rotated=False, tuning=None):
    """True if `prefill_tc` answers `rows` query rows per KV head of `dtype` over sides of kernel tiers `k_spec`,
    `v_spec` ((tier id, bits, components), `cuda.tier_spec`) in pages of `page` tokens, `rotated` if either side is
    a +rot tier: rows within `row_range` (of `tuning`), fp16/bf16 queries (the kernel rounds them and the values to
    fp16, as `flash_pass1_tc` does), the tiers `flash_pass1_tc` reads, whole 16-token tiles in a page, head_dim 64
    or 128. The caller checks the GPU (tensor cores) and the TurboQuant codebooks (symmetric in fp16: looked up in
    registers)."""
    if None in (k_spec, v_spec):
        return False
    lo, hi = row_range(k_spec, rotated, tuning)
    return (lo <= rows <= hi
            and dtype in (mx.float16, mx.bfloat16) and k_spec[0] in TIERS and v_spec[0] in TIERS
            and page % 16 == 0 and head_dim in HEAD_DIMS)


def split_tokens(n_tokens, n_kv, row_blocks, target):
    """(tokens per split, splits): about `target` blocks over splits x `n_kv` x `row_blocks`, splits of whole
    64-token tiles, at least 4 tiles each."""
    n_splits = max(1, min(math.ceil(target / (n_kv * row_blocks)), math.ceil(n_tokens / (4 * TILE))))
    per = math.ceil(math.ceil(n_tokens / n_splits) / TILE) * TILE
    return per, math.ceil(n_tokens / per)


def pass1(inputs, prefix, queries, scale, tail_len):
    """The prefix's share of every query row: partial outputs per split, for `finish_row`.

    Args:
        inputs (CudaInputs): the layer's pages as the kernels take them (`cuda_inputs`), and its tuning.
        prefix (LayerPrefix): the same pages (K's stored basis).
        queries (mx.array): (1, n_q_heads, L, head_dim) float16 or bfloat16, in the original basis.
        scale (float): softmax scale.
        tail_len (int): tokens in the cache's dense tail (for the finish: prm[4]).

    Returns:
        tuple: (O float32 (splits, n_kv, R, D) unnormalized, M float32 (splits, n_kv, R) the rows' largest score,
        L float32 (splits, n_kv, R) their sums of exp(score - M), prm int32 (8,): [end of the stored tokens, R,
        per split, splits, tail_len, L, start, first], as `kernels.cuda` makes it for the finish).
    """
    _, n_q, L, D = queries.shape
    n_kv, warps = inputs.n_kv, inputs.tuning.prefill_warps
    R = n_q // n_kv * L
    q = queries
    basis = prefix.k_codec.stored_basis(prefix.k_params)
    if basis is not None:  # K stored rotated: (B q).(B k) = q.k
        q = per_kv_head(basis.rotate, queries, n_kv).astype(queries.dtype)
    row_blocks = -(-R // (16 * warps))
    per, n_splits = split_tokens(inputs.end - inputs.start, n_kv, row_blocks, inputs.tuning.prefill_target_blocks)
    (tk, bk, _), (tv, bv, _) = inputs.k_spec, inputs.v_spec
    consts = (("T", queries.dtype), ("TK", tk), ("BK", bk), ("TV", tv), ("BV", bv), ("HD", D), ("NKV", n_kv),
              ("PAGE", inputs.page), ("WARPS", warps), ("SCALE", float(scale)))
    smem = smem_bytes(inputs.k_spec, inputs.v_spec, D)
    # MLX raises a kernel's dynamic shared-memory limit only for more than 48000 bytes
    kernel = _kernel(consts, smem if smem <= 48000 else max(smem, 48004))
    prm = mx.array([inputs.end, R, per, n_splits, tail_len, L, inputs.start, inputs.first], dtype=mx.int32)
    partial = (n_splits, n_kv, R)
    O, M, Lsum = kernel(
        inputs=[q, *inputs.k_in, *inputs.v_in, inputs.cbk, inputs.cbv, prm],
        grid=(n_splits * warps * 32, n_kv, row_blocks), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(*partial, D), partial, partial], output_dtypes=[mx.float32] * 3)
    return O, M, Lsum, prm
