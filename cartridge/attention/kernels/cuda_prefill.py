"""A question's prefill on the stored pages by one tensor-core kernel, with no fp16 copy (issue 34 item 3).

A question of L tokens over a long prefix is R = GQA group x L query rows per KV head. `prefill_tc` in
flash_decode.cuh (FlashAttention-2, Dao 2023) gives each block 16 x `WARPS` of those rows and one split of the
prefix's tokens: the block copies each 64-token tile as stored, decodes it once into fp16 rows in shared memory
(the tile decode of `flash_pass1_tc`; fp16 pages are read in place), and its warps multiply on tensor cores
(mma.m16n8k16) for the scores and the output, so a tile is read once per block of rows instead of once per 8 rows
(`flash_pass1_tc`'s row blocks), and nothing is written back but the splits' partials. `cuda.FusedAttention`'s
two-kernel finish (`finish_row`) then merges the splits, the dense tail (the question's own K/V, causal) and any
protected tokens. K stored rotated (+rot, TurboQuant) is met by rotating the queries into its basis first; V
stored rotated is rotated back by the finish, as for decode.

This module builds and launches pass 1 only (`cuda.FusedAttention` passes its tier inputs), so it imports nothing
of `cuda.py`.
"""

import functools
import hashlib
import math

import mlx.core as mx
import numpy as np

from ...tiers.layout import AFF4, AFF6, AFF8, BF16, FP16, KIVI4, MXFP4, MXFP8, NVFP4, TURBO
from .constants import constant_lines
from .dense import per_kv_head

ENABLED = True  # benchmarks switch it off to time the other paths
TILE = 64  # prefix tokens per tile (PF_TOK in flash_decode.cuh)
# Launch shape and rows, measured on an H200 (benchmarks/results/h200-s5-prefill.json: 32 q / 8 kv heads, head_dim
# 128, 32,768 and 131,072 tokens, 32 / 64 / 256 question tokens = 128 / 256 / 1,024 rows per KV head; times over
# MLX's dense SDPA): 8 warps (128 rows a block) against 4 at 131,072 tokens and 32 tokens: mlx4g32 0.29x against
# 0.61x, turbo3 0.36x against 0.84x, fp16 0.21x against 0.30x; 264 blocks beat 132 and 528 for mlx4g32. From 128
# rows the kernel beats flash_pass1_tc's row blocks (0.63-0.96x at 128 rows) and the pages decoded for MLX's SDPA
# (1.07-1.26x); at 256 rows (8 warps) mlx4g32 0.77x, turbo3 0.95x, fp16 0.56x against 1.10-1.23x decoded; at 1,024
# rows it loses (mlx4g32 2.56x, turbo3 3.25x, fp16 1.90x against decoded 1.09-1.17x: each block of 128 rows decodes
# the whole prefix again, and its mma.sync loop runs at about 230 TFLOP/s, below MLX's SDPA). 512 rows: not measured.
WARPS = 8  # warps per block: 16 query rows each
TARGET_BLOCKS = 264  # blocks to aim for over splits x KV heads x row blocks (132 SMs x 2)
MIN_ROWS = 128  # query rows per KV head from which `cuda.FusedAttention` takes this kernel
# and up to which: below 256 rows it beat flash_pass1_tc's row blocks (what answered there before) for every tier
# measured, even at 4 warps (256 rows: 1.14-1.61x against 1.28-2.00x); from 256 rows the pages decoded for MLX's
# SDPA (`cuda.DECODED_MIN_ROWS`) answer, except for the (K tier, bits) measured faster at 256 rows with 8 warps
# (unrotated): mlx4g32 0.77x, turbo3 0.95x, fp16 0.56x against 1.10-1.23x decoded (the others ran at 4 warps only)
MAX_ROWS = 255
MAX_ROWS_WIDE = 256
WIDE = frozenset(((AFF4, 0), (TURBO, 3)))
# fp16 K pages (no decode in the kernel): the rows from and up to which the kernel answers (also the questions
# `contiguous.ContiguousAttention` sends to the pages). Measured on an H100 (benchmarks/results/h100-s8-questions.json,
# 32 q / 8 kv heads, head_dim 128, 8 warps; times over MLX's SDPA over a contiguous cache at 131,072 / 32,768
# tokens): 32-128 rows 0.20-0.21x / 0.24-0.27x against flash_pass1_tc's row blocks' 0.22-1.05x / 0.26-1.01x;
# 192-384 rows 0.56-0.60x / 0.54-0.68x against 0.56-1.25x; 16 rows a tie (0.202x / 0.240x against 0.210x /
# 0.255x); 8 rows the row blocks win (0.135x / 0.174x against 0.200x / 0.237x), so they keep them; 512 rows 1.06x
# (each 128-row block reads the prefix again). The H200 agreed at 128 / 256 rows (h200-s5-prefill.json: 0.21x /
# 0.56x). bf16 pages: not taken (the kernel rounds to fp16). head_dim 64: not measured (the same rows are taken).
DENSE_ROWS = {FP16: (16, 384)}
TIERS = (FP16, BF16, AFF8, AFF6, AFF4, KIVI4, MXFP8, MXFP4, NVFP4, TURBO)  # the tiers flash_pass1_tc reads
HEAD_DIMS = (64, 128)
CALL = ("cart::prefill_tc<T, TK, BK, TV, BV, HD, NKV, PAGE, WARPS>(q, SCALE, (const void*)k0, (const void*)k1, "
        "(const void*)k2, (const void*)v0, (const void*)v1, (const void*)v2, cbk, cbv, prm, O, M, L);\n")
INPUTS = ["q", "k0", "k1", "k2", "v0", "v1", "v2", "cbk", "cbv", "prm"]
CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}


def kernel_spec(consts, digest):
    """(name, input names, output names, body) of `prefill_tc` for `consts` ((name, value) pairs: T, TK, BK, TV, BV,
    HD, NKV, PAGE, WARPS, SCALE); `digest` is flash_decode.cuh's (part of the name, as `cuda.kernel_spec`'s)."""
    body = constant_lines(consts, CUDA_TYPES, lambda value: float(np.float32(value)).hex()) + CALL
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
def _kernel(header, digest, consts, shared_memory):
    name, inputs, outputs, body = kernel_spec(consts, digest)
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=body, header=header,
                               shared_memory=shared_memory)


def row_range(k_spec, rotated=False):
    """(fewest, most) query rows per KV head `prefill_tc` answers for K pages of kernel tier `k_spec`: DENSE_ROWS for
    unrotated fp16 pages, (MIN_ROWS, MAX_ROWS_WIDE) for the unrotated (tier, bits) in WIDE, else
    (MIN_ROWS, MAX_ROWS)."""
    if not rotated and k_spec[0] in DENSE_ROWS:
        return DENSE_ROWS[k_spec[0]]
    wide = not rotated and (k_spec[0], k_spec[1]) in WIDE
    return MIN_ROWS, MAX_ROWS_WIDE if wide else MAX_ROWS


def reads(k_spec, v_spec, page, head_dim, dtype, rows, rotated=False):
    """True if `prefill_tc` answers `rows` query rows per KV head of `dtype` over sides of kernel tiers `k_spec`,
    `v_spec` ((tier id, bits, components), `cuda.tier_spec`) in pages of `page` tokens, `rotated` if either side is
    a +rot tier: ENABLED, rows within `row_range`, fp16/bf16 queries (the kernel rounds them and the values to
    fp16, as `flash_pass1_tc` does), the tiers `flash_pass1_tc` reads, whole 16-token tiles in a page, head_dim 64
    or 128. The caller checks the GPU (tensor cores) and the TurboQuant codebooks (symmetric in fp16: looked up in
    registers)."""
    if None in (k_spec, v_spec):
        return False
    lo, hi = row_range(k_spec, rotated)
    return (ENABLED and lo <= rows <= hi
            and dtype in (mx.float16, mx.bfloat16) and k_spec[0] in TIERS and v_spec[0] in TIERS
            and page % 16 == 0 and head_dim in HEAD_DIMS)


def split_tokens(n_tokens, n_kv, row_blocks, target=None):
    """(tokens per split, splits): about `target` (default TARGET_BLOCKS) blocks over splits x `n_kv` x
    `row_blocks`, splits of whole 64-token tiles, at least 4 tiles each."""
    target = TARGET_BLOCKS if target is None else target
    n_splits = max(1, min(math.ceil(target / (n_kv * row_blocks)), math.ceil(n_tokens / (4 * TILE))))
    per = math.ceil(math.ceil(n_tokens / n_splits) / TILE) * TILE
    return per, math.ceil(n_tokens / per)


def pass1(attn, queries, scale, tail_len, source):
    """The prefix's share of every query row: partial outputs per split, for `finish_row`.

    Args:
        attn (cuda.FusedAttention): the layer's kernel inputs (k_spec, v_spec, k_in, v_in, cbk, cbv, n_kv, page,
            start, first, end, prefix).
        queries (mx.array): (1, n_q_heads, L, head_dim) float16 or bfloat16, in the original basis.
        scale (float): softmax scale.
        tail_len (int): tokens in the cache's dense tail (for the finish: prm[4]).
        source (tuple): (header, digest) of flash_decode.cuh (`cuda.source_header`).

    Returns:
        tuple: (O float32 (splits, n_kv, R, D) unnormalized, M float32 (splits, n_kv, R) the rows' largest score,
        L float32 (splits, n_kv, R) their sums of exp(score - M), prm int32 (8,): [end of the stored tokens, R,
        per split, splits, tail_len, L, start, first], as `cuda.FusedAttention._params` makes it for the finish).
    """
    _, n_q, L, D = queries.shape
    R = n_q // attn.n_kv * L
    q = queries
    basis = attn.prefix.k_codec.stored_basis(attn.prefix.k_params)
    if basis is not None:  # K stored rotated: (B q).(B k) = q.k
        q = per_kv_head(basis.rotate, queries, attn.n_kv).astype(queries.dtype)
    row_blocks = -(-R // (16 * WARPS))
    per, n_splits = split_tokens(attn.end - attn.start, attn.n_kv, row_blocks)
    (tk, bk, _), (tv, bv, _) = attn.k_spec, attn.v_spec
    consts = (("T", queries.dtype), ("TK", tk), ("BK", bk), ("TV", tv), ("BV", bv), ("HD", D), ("NKV", attn.n_kv),
              ("PAGE", attn.page), ("WARPS", WARPS), ("SCALE", float(scale)))
    smem = smem_bytes(attn.k_spec, attn.v_spec, D)
    # MLX raises a kernel's dynamic shared-memory limit only for more than 48000 bytes
    kernel = _kernel(*source, consts, smem if smem <= 48000 else max(smem, 48004))
    prm = mx.array([attn.end, R, per, n_splits, tail_len, L, attn.start, attn.first], dtype=mx.int32)
    partial = (n_splits, attn.n_kv, R)
    O, M, Lsum = kernel(
        inputs=[q, *attn.k_in, *attn.v_in, attn.cbk, attn.cbv, prm], grid=(n_splits * WARPS * 32, attn.n_kv, row_blocks),
        threadgroup=(WARPS * 32, 1, 1), output_shapes=[(*partial, D), partial, partial], output_dtypes=[mx.float32] * 3)
    return O, M, Lsum, prm
