"""Fused flash-decoding attention over compressed pages on MLX's CUDA backend (`mx.fast.cuda_kernel`).

Two kernels per layer and step (source in `cuda_source.py`): pass 1 reads the stored pages of every
tier in `FUSED_TIERS` directly and dequantizes in registers, split over tokens; pass 2 merges the
splits, attends over the dense tail and writes the output in the queries' dtype. When both sides are
mlx4g32, a block holds at most 4 query rows per KV head (decode with GQA up to 4) and the GPU has
tensor cores (sm_80 or newer), pass 1 is the tensor-core variant `flash_pass1_mma`. The plain reference
for both is `cartridge.kernels.portable` (tests compare them against float64).
"""

import functools
import math
import re

import mlx.core as mx
import numpy as np

from .cuda_source import HEADER_FINISH, HEADER_MMA, HEADER_PASS1, PASS1, PASS1_MMA, finish_source

FP16, BF16, F32, AFF8, AFF4, MXFP8, TURBO = range(7)
# tier name -> (kernel tier id, bits per code for TurboQuant, stored components in kernel order)
FUSED_TIERS = {
    "fp16": (FP16, 0, ("values",)),
    "bf16": (BF16, 0, ("values",)),
    "int8": (AFF8, 0, ("codes", "scales", "biases")),
    "mlx4g32": (AFF4, 0, ("codes", "scales", "biases")),
    "fp8": (MXFP8, 0, ("codes", "scales")),
    "turbo4": (TURBO, 4, ("codes", "norms")),
    "turbo3": (TURBO, 3, ("codes", "norms")),
    "turbo2": (TURBO, 2, ("codes", "norms")),
}
DENSE_IDS = {mx.float16: FP16, mx.bfloat16: BF16, mx.float32: F32}
HEAD_DIMS = (64, 128, 256)
WARPS = 4  # warps per pass-1 block
# Launch shape, tuned on an H200 (benchmarks/gpu_check.py, 2026-11-30): 8 head_dim elements per lane,
# 4 tokens fetched at once per lane, about 4 blocks per SM.
TARGET_BLOCKS = 528  # pass-1 blocks to aim for (132 SMs x 4)
UNROLL = 4  # tokens each lane fetches at once in pass 1 (bytes in flight)
MAX_CHUNKS = 8  # tail chunks pass 2 reads directly; more falls back to the portable path
TENSOR_CORES = True  # use flash_pass1_mma where it applies (benchmarks switch it off to compare)
MMA_TARGET_BLOCKS = 528  # pass-1 blocks for the tensor-core variant
MMA_STAGES = 3  # tiles of 16 tokens in flight per warp (cp.async pipeline depth)
MMA_WARPS = 4  # warps per tensor-core pass-1 block
MMA_HEAD_DIMS = (64, 128)
POISON = None  # tests set NaN: outputs are filled with it before each kernel runs
DECODE_EPL = 8  # elements of head_dim per lane when a block holds <= 4 query rows
_KERNELS = {}


def _pass1():
    if "pass1" not in _KERNELS:
        _KERNELS["pass1"] = mx.fast.cuda_kernel(
            name="cartridge_flash_pass1",
            input_names=["q", "fprm", "sgk", "k0", "k1", "k2", "v0", "v1", "v2", "cbk", "cbv", "prm"],
            output_names=["O", "M", "L"], source=PASS1, header=HEADER_PASS1)
    return _KERNELS["pass1"]


def _pass1_mma():
    if "pass1_mma" not in _KERNELS:
        _KERNELS["pass1_mma"] = mx.fast.cuda_kernel(
            name="cartridge_flash_pass1_mma",
            input_names=["q", "fprm", "k0", "k1", "k2", "v0", "v1", "v2", "prm"],
            output_names=["O", "M", "L"], source=PASS1_MMA, header=HEADER_MMA)
    return _KERNELS["pass1_mma"]


@functools.cache
def has_tensor_cores():
    """True if the default device is an NVIDIA GPU of compute capability 8.0 or newer (mma.m16n8k16
    with fp16 operands and cp.async need sm_80)."""
    found = re.fullmatch(r"sm_(\d+)\w*", str(mx.device_info().get("architecture", "")))
    return found is not None and int(found.group(1)) >= 80


def _finish(n_chunks):
    key = f"finish{n_chunks}"
    if key not in _KERNELS:
        tails = [name for i in range(n_chunks) for name in (f"tk{i}", f"tv{i}")]
        _KERNELS[key] = mx.fast.cuda_kernel(
            name=f"cartridge_flash_finish{n_chunks}",
            input_names=["O", "M", "L", "q", "fprm", "prm", "sgv", *tails],
            output_names=["out"], source=finish_source(n_chunks), header=HEADER_FINISH)
    return _KERNELS[key]


def tier_spec(codec, parts):
    """(kernel tier id, bits, component names) for a stored side, or None if no fused kernel reads it."""
    if codec.name == "dequantized":
        tid = DENSE_IDS.get(parts["values"].dtype)
        return None if tid is None else (tid, 0, ("values",))
    return FUSED_TIERS.get(codec.name)


def supported(prefix, head_dim):
    """True if both sides' tiers and the head_dim have a fused kernel."""
    return (head_dim in HEAD_DIMS and tier_spec(prefix.k_codec, prefix.k_parts) is not None
            and tier_spec(prefix.v_codec, prefix.v_parts) is not None)


def _side_inputs(spec, parts, params):
    """Component arrays padded to three, codebook padded to 16 floats, and signs (n_kv, D) or a dummy."""
    tid, _, names = spec
    arrays = [parts[n] for n in names] + [mx.zeros((4,), dtype=mx.uint32)] * (3 - len(names))
    if tid == TURBO:
        cb = np.zeros(16, dtype=np.float32)
        cb[: len(params["codebook"])] = params["codebook"]
        signs = mx.array(np.asarray(params["signs"], dtype=np.float32))  # (n_kv, D)
        return arrays, mx.array(cb), signs
    return arrays, mx.zeros((16,), dtype=mx.float32), mx.zeros((1,), dtype=mx.float32)


def split_plan(n_tokens, n_kv, row_blocks, slots, target_blocks=None):
    """(tokens per split, number of splits): about `target_blocks` (default TARGET_BLOCKS) blocks, each
    split a multiple of `slots` tokens and at least 4 rounds of them."""
    target = TARGET_BLOCKS if target_blocks is None else target_blocks
    n_splits = max(1, min(math.ceil(target / (n_kv * row_blocks)), math.ceil(n_tokens / (4 * slots))))
    per = math.ceil(math.ceil(n_tokens / n_splits) / slots) * slots
    return per, math.ceil(n_tokens / per)


class FusedAttention:
    """Fused attention of one layer: the prefix pages as stored, plus the cache's dense tail.

    Args:
        prefix (LayerPrefix): the layer's pages (tiers in `FUSED_TIERS`, or dense pages).
    """

    def __init__(self, prefix):
        self.k_spec = tier_spec(prefix.k_codec, prefix.k_parts)
        self.v_spec = tier_spec(prefix.v_codec, prefix.v_parts)
        self.k_in, self.cbk, self.sgk = _side_inputs(self.k_spec, prefix.k_parts, prefix.k_params)
        self.v_in, self.cbv, self.sgv = _side_inputs(self.v_spec, prefix.v_parts, prefix.v_params)
        _, self.n_kv, self.page, _ = self.k_in[0].shape
        self.n_tokens = prefix.n_tokens
        self.mma = self.k_spec[0] == AFF4 and self.v_spec[0] == AFF4 and self.page % 16 == 0
        self._fprm = {}
        self._prm = {}  # (R, L, n_splits, per) -> (tail lengths, 6) int32 table on the device

    def _scale(self, scale):
        if scale not in self._fprm:
            self._fprm[scale] = mx.array([scale], dtype=mx.float32)
        return self._fprm[scale]

    def _params(self, R, L, per, n_splits, tail_len, chunk_size):
        """Kernel parameters as a device array; decode steps slice a table made once (no host copy)."""
        if L > 1:
            return mx.array([self.n_tokens, R, per, n_splits, tail_len, L], dtype=mx.int32)
        key = (R, per, n_splits)
        if key not in self._prm:
            n = MAX_CHUNKS * chunk_size + 1
            table = np.zeros((n, 6), dtype=np.int32)
            table[:] = [self.n_tokens, R, per, n_splits, 0, 1]
            table[:, 4] = np.arange(n)
            self._prm[key] = mx.array(table)
        return self._prm[key][tail_len]

    def uses_tensor_cores(self, R, D):
        """True if pass 1 runs `flash_pass1_mma` for R query rows per KV head and head_dim D."""
        return TENSOR_CORES and self.mma and R <= 4 and D in MMA_HEAD_DIMS and has_tensor_cores()

    def __call__(self, cache, queries, scale):
        """Attention output (1, n_q_heads, L, head_dim) in the queries' dtype, or None if unsupported.

        Args:
            cache (CartridgeCache): supplies the dense tail chunks and their length.
            queries (mx.array): (1, n_q_heads, L, head_dim), the last L tokens of the tail.
            scale (float): softmax scale.
        """
        _, n_q, L, D = queries.shape
        n_chunks = -(-cache.tail_len // cache.chunk_size)
        if not 1 <= n_chunks <= MAX_CHUNKS or D not in HEAD_DIMS:
            return None
        R = (n_q // self.n_kv) * L  # query rows per KV head: GQA group x query tokens
        fprm = self._scale(scale)
        if self.uses_tensor_cores(R, D):
            per, n_splits = split_plan(self.n_tokens, self.n_kv, 1, 16 * MMA_WARPS, MMA_TARGET_BLOCKS)
            prm = self._params(R, L, per, n_splits, cache.tail_len, cache.chunk_size)
            O, M, Lsum = _pass1_mma()(
                inputs=[queries, fprm, *self.k_in, *self.v_in, prm],
                template=[("T", queries.dtype), ("HD", D), ("NKV", self.n_kv), ("PAGE", self.page),
                          ("WARPS", MMA_WARPS), ("STAGES", MMA_STAGES)],
                grid=(n_splits * MMA_WARPS * 32, self.n_kv, 1), threadgroup=(MMA_WARPS * 32, 1, 1),
                output_shapes=[(n_splits, self.n_kv, R, D), (n_splits, self.n_kv, R), (n_splits, self.n_kv, R)],
                output_dtypes=[mx.float32] * 3, init_value=POISON)
            return self._finish(cache, queries, fprm, prm, O, M, Lsum, R, D)
        rows, epl, unroll = (R, DECODE_EPL, UNROLL) if R <= 4 else (8, 8, UNROLL)
        slots = (32 // (D // epl)) * WARPS * unroll  # tokens a block consumes per round
        row_blocks = -(-R // rows)
        per, n_splits = split_plan(self.n_tokens, self.n_kv, row_blocks, slots)
        prm = self._params(R, L, per, n_splits, cache.tail_len, cache.chunk_size)
        (tk, bk, _), (tv, bv, _) = self.k_spec, self.v_spec
        O, M, Lsum = _pass1()(
            inputs=[queries, fprm, self.sgk, *self.k_in, *self.v_in, self.cbk, self.cbv, prm],
            template=[("T", queries.dtype), ("TK", tk), ("TV", tv), ("BK", bk), ("BV", bv), ("HD", D),
                      ("EPL", epl), ("ROWS", rows), ("NKV", self.n_kv), ("PAGE", self.page), ("WARPS", WARPS),
                      ("UNR", unroll)],
            grid=(n_splits * WARPS * 32, self.n_kv, row_blocks), threadgroup=(WARPS * 32, 1, 1),
            output_shapes=[(n_splits, self.n_kv, R, D), (n_splits, self.n_kv, R), (n_splits, self.n_kv, R)],
            output_dtypes=[mx.float32] * 3, init_value=POISON)
        return self._finish(cache, queries, fprm, prm, O, M, Lsum, R, D)

    def _finish(self, cache, queries, fprm, prm, O, M, Lsum, R, D):
        """Pass 2: merge the prefix splits (O, M, Lsum) with the dense tail; see `finish` in the source."""
        n_chunks = -(-cache.tail_len // cache.chunk_size)
        tv = self.v_spec[0]
        tails = [c for pair in zip(cache._k_chunks[:n_chunks], cache._v_chunks[:n_chunks]) for c in pair]
        return _finish(n_chunks)(
            inputs=[O, M, Lsum, queries, fprm, prm, self.sgv, *tails],
            template=[("T", queries.dtype), ("HD", D), ("NKV", self.n_kv), ("NCH", n_chunks),
                      ("CH", cache.chunk_size), ("VTURBO", tv == TURBO)],
            grid=(128, self.n_kv, R), threadgroup=(128, 1, 1),
            output_shapes=[queries.shape], output_dtypes=[queries.dtype], init_value=POISON)[0]
