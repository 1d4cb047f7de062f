"""Fused flash-decoding attention over compressed pages on MLX's CUDA backend (`mx.fast.cuda_kernel`).

The CUDA source is `flash_decode.cuh` (next to this file). Pass 1 reads the stored pages of every tier
with a `kernel_layout` (`cartridge.tiers.layout`) directly and dequantizes in registers, split over
tokens; the finish merges the splits, attends over the dense tail and writes the output in the queries' dtype. For decode (at most 8 query
rows per KV head, a tail of at most 64 tokens, a pass 1 of 4 warps) both run in one launch (`SINGLE_LAUNCH`):
the block of the last split also attends over the tail, as one more partial, and the last block of each
KV head to finish merges them (rotating a rotated V's prefix output back first); otherwise the finish is a
second kernel. When both sides are mlx4g32, a
block holds at most 4 query rows per KV head and the GPU has tensor cores (sm_80 or newer), pass 1 is the
tensor-core variant `flash_pass1_mma`. A question of many query rows per KV head takes `cuda_prefill`'s kernel
as pass 1 (the rows in `cuda_prefill.reads`) or, from `DECODED_MIN_ROWS` rows, the pages decoded for MLX's SDPA.
The plain reference for all of them is `cartridge.attention.kernels.portable` (tests compare them against float64).

Host cost matters as much as the kernels here: a decode step calls this once per layer, and MLX
builds and hashes the kernel source on every call. The source handed to MLX is therefore a few lines
that `#include` the .cuh by path (its content digest is part of the kernel name, so MLX's compile
cache never serves a stale build) after the shape's constants (no template arguments), and kernels,
grids, output shapes and decode parameters are made once per shape (`_Plan`, `_params`).
"""

import functools
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

# the kernel tier ids are the codecs' (`KernelLayout.tier_id`); re-exported for tests and benchmarks
from ...tiers.layout import AFF4, AFF6, AFF8, BF16, F32, FP16, KIVI4, MXFP4, MXFP8, NVFP4, TURBO  # noqa: F401
from ...tiers.layout import layout_of
from ...tiers.rotation import sign_bits
from . import cuda_decode, cuda_prefill, dense
from .constants import constant_lines


def _zeros(shape, dtype=np.float32):
    """A zero array with its data (not a lazy `mx.zeros`): MLX 0.32 evaluates a lazy array on the stream of the
    thread that made it, so one made at load and first evaluated on a server's worker thread raised 'There is no
    Stream(gpu, 0) in current thread' (tests/attention/test_generate_loop.py on an H200, mlx4g32+rot)."""
    return mx.array(np.zeros(shape, dtype=dtype))


_NO_SINKS = _zeros((1,))  # the finish's `snk` input when the model has no sinks
TC_ONLY = (MXFP4, NVFP4, AFF6, KIVI4)  # tiers only `flash_pass1_tc` reads (no plain pass 1)
HEAD_DIMS = (64, 128, 256)
WARPS = 4  # warps per pass-1 block
# Launch shape, tuned on an H200 (benchmarks/gpu_check.py at a876215, 2026-11-30): 8 head_dim elements per lane,
# 4 tokens fetched at once per lane, about 4 blocks per SM.
TARGET_BLOCKS = 528  # pass-1 blocks to aim for (132 SMs x 4)
UNROLL = 4  # tokens each lane fetches at once in pass 1 (bytes in flight)
MAX_CHUNKS = 8  # tail chunks the finish reads directly; more falls back to the portable path
SINGLE_LAUNCH = True  # finish in pass 1's last block where it applies (benchmarks switch it off)
SINGLE_MAX_ROWS = 8  # query rows per KV head the last block finishes alone (2 per warp)
SINGLE_MAX_TAIL = 64  # tail tokens the last block attends to alone; longer tails take two launches
TENSOR_CORES = True  # use flash_pass1_mma where it applies (benchmarks switch it off to compare)
# The rotated tiers' fused path (flash_pass1_tc with RK, the finish's VROT) and sinks in the two-kernel finish
# (SINKS); tests/attention/test_kernels.py's fused rot and sinks cases passed on an H200 on 2026-12-02. Switched off,
# rotated layers are not `supported` (auto takes dequantize-once) and a call with sinks returns None (portable).
ROTATED_FUSED = True
SINKS_FUSED = True
# query rows per KV head (GQA group x question tokens) from which a call decodes the prefix for MLX's SDPA
# (`dense.prefill_attention`) instead of the kernel, whose time grows with the rows; by the K side's kernel
# tier, measured on an H200 (32 q / 8 kv heads, head_dim 128, 32K and 128K tokens, 128-1,024 rows:
# benchmarks/results/h200-prefill-sweep.json): fp16 and mlx4g32 (+rot) pages cross over between 128 and 256
# rows, int8 and turbo4 between 256 and 512; kivi4's decode (its per-channel groups: MLX ops, not
# mx.dequantize) is slower than the kernel at every count measured (8.5x against 6.2x dense at 1,024 rows)
DENSE_MIN_ROWS = {FP16: 256, BF16: 256, AFF4: 256, TURBO: 512, KIVI4: 1 << 30}
DENSE_MIN_ROWS_OTHER = 512
# the same crossover where `cuda_decode` decodes the pages (one kernel instead of MLX ops), measured on an H200
# (benchmarks/results/h200-prefill.json, 131,072 tokens, 32 q / 8 kv heads): at 128 rows the kernel is 0.67-1.03x
# dense and the decoded path 1.09-1.16x for all 8 tiers measured; at 256 rows the kernel 1.38-2.02x, decoded 1.10-1.18x
DECODED_MIN_ROWS = 256
# pass-1 blocks of the tensor-core variant, measured on an H200 (benchmarks/results/h200-blocks-sweep.json):
# head_dim 128: 264 (2 per SM) was fastest of 132-594 at 32K-128K tokens; head_dim 64: 528 (45.1-45.8 us
# against 49.2-49.4 for 264 at 128K, equal at 64K)
MMA_TARGET_BLOCKS = 264
MMA_TARGET_BLOCKS_D64 = 528
TC_TARGET_BLOCKS = 264  # the same for flash_pass1_tc (benchmarks sweep them apart)
TC_TARGET_BLOCKS_D64 = 528
MMA_STAGES = 3  # tiles of 16 tokens in flight per warp (cp.async pipeline depth)
MMA_WARPS = 4  # warps per tensor-core pass-1 block
MMA_HEAD_DIMS = (64, 128)
TC_STAGES = 3  # tiles of 16 tokens in flight per warp in flash_pass1_tc
TC_WARPS = 4
# warps of flash_pass1_tc when V is TurboQuant (whose finish is a second launch anyway: it rotates V back), measured
# on an H200 (benchmarks/results/h200-sweep.json, 264 blocks, 3 stages, 131,072 / 32,768 tokens): 8 warps turbo2
# 73.7 / 34.6 us against 86.7 / 37.2 for 4, turbo3 117.4 / 47.0 against 120.9 / 46.6, turbo4 100.6 / 41.5 against
# 104.7 / 41.6; for the tiers a single launch finishes, 8 warps (two launches) lost at 32K (mxfp4 45.1 against 36.5)
TC_WARPS_TURBO = 8
# tiers whose codes flash_pass1_tc looks up in registers (PRMT on a table of 8 magnitudes, `nib_lookup4`) rather
# than in a shared-memory table of code pairs (`smem_lookup4`); TurboQuant only for codebooks symmetric in fp16.
# Measured on an H200 (benchmarks/results/h200-lookup-decode.json, 131,072 tokens, head_dim 128): registers
# 103.1 / 107.9 us against 109.1 / 111.6 for mxfp4 / nvfp4, 103.6 against 106.4 for turbo4, but 145.3 / 122.1
# against 123.4 / 89.3 for turbo3 / turbo2 (spreading 3- and 2-bit codes into nibbles costs more than it saves)
REGISTER_LOOKUP = frozenset((MXFP4, NVFP4))
# a question's prefill decodes compressed pages by one CUDA kernel (`cuda_decode`) rather than by MLX ops
CUDA_DECODE = True
MMA_DIAG = 0  # benchmarks only: 1 = pass 1's copies without its math, 2 = its math without the copies,
# 3 = no finish in the single launch (outputs are then garbage)
PREFILL, DECODED = "prefill", "decoded"  # `FusedAttention._route`'s answers besides a plan
POISON = None  # tests set NaN: outputs are filled with it before each kernel runs
DECODE_EPL = 8  # elements of head_dim per lane when a block holds <= 4 query rows
SOURCE = Path(__file__).with_name("flash_decode.cuh")

CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}
PASS1_INPUTS = ["q", "sgk", "k0", "k1", "k2", "v0", "v1", "v2", "cbk", "cbv", "prm"]
PASS1_CALL = """cart::flash_pass1<T, TK, TV, BK, BV, HD, EPL, ROWS, NKV, PAGE, WARPS, UNR>(
    q, SCALE, sgk, (const void*)k0, (const void*)k1, (const void*)k2, (const void*)v0,
    (const void*)v1, (const void*)v2, cbk, cbv, prm, O, M, L);
"""
MMA_INPUTS = ["q", "sgk", "k0", "k1", "k2", "v0", "v1", "v2", "prm"]
TC_CALL = """cart::flash_pass1_tc<T, TK, BK, TV, BV, HD, NKV, PAGE, WARPS, STAGES, RK, LREG>(
    q, SCALE, sgk, (const void*)k0, (const void*)k1, (const void*)k2, (const void*)v0,
    (const void*)v1, (const void*)v2, cbk, cbv, prm, O, M, L);
"""
MMA_CALL = """cart::flash_pass1_mma<T, HD, NKV, PAGE, WARPS, STAGES, DIAG, RK>(
    q, SCALE, sgk, (const uint32_t*)(const void*)k0, (const __half*)(const void*)k1,
    (const __half*)(const void*)k2, (const uint32_t*)(const void*)v0, (const __half*)(const void*)v1,
    (const __half*)(const void*)v2, prm, O, M, L);
"""
# single launch: the partials (prefix splits, then the tail's slot) live in the cache's `work` buffer,
# followed by the block counters
SINGLE_SCRATCH = """const int n_part = (prm[3] + 1) * NKV * prm[1];  // (splits + tail) x KV heads x query rows
float* O = const_cast<float*>(work);
float* M = O + (size_t)n_part * HD;
float* L = M + n_part;
const int32_t* counter = reinterpret_cast<const int32_t*>(L + n_part);
"""
SINGLE_FINISH = """if (blockIdx.x == gridDim.x - 1 && blockIdx.z == 0)
  cart::tail_rows<T, HD, NKV, CH>(q, SCALE, prm, tk0, tv0, O, M, L, blockIdx.y);
if (cart::last_block(counter, blockIdx.y, gridDim.x * gridDim.z) && DIAG != 3)
  cart::finish_rows<T, HD, NKV, VROT>(O, M, L, prm, sgv, out, blockIdx.y);
"""


@functools.cache
def source_header():
    """(header, digest): an #include of `SOURCE` (the whole text where the path cannot be quoted)."""
    text = SOURCE.read_text()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = str(SOURCE.resolve())
    quotable = path.isascii() and path.isprintable() and not any(c in path for c in '"\\')
    return (f'#include "{path}"\n' if quotable else text), digest


def _constants(consts):
    """C++ lines defining a kernel's compile-time constants (types, ints, bools, the float SCALE as a hex literal)."""
    return constant_lines(consts, CUDA_TYPES, lambda value: float(np.float32(value)).hex())


def kernel_spec(kind, n_chunks=0, consts=()):
    """(name, input names, output names, body) of one kernel: "pass1", "mma" or "tc" (pass 1 alone), "finish"
    (merge, tail and output; `n_chunks` tail chunks), or "pass1+finish" / "mma+finish" (one launch: pass 1,
    `tail_rows` in the last split's block, then `finish_rows` in each KV head's last block). `consts` are
    (name, value) pairs compiled into the body, so the call passes no template arguments; the name carries
    them (hashed) and the .cuh digest."""
    if kind == "finish":
        tails = [name for i in range(n_chunks) for name in (f"tk{i}", f"tv{i}")]
        tks, tvs = ", ".join(tails[0::2]), ", ".join(tails[1::2])
        inputs, outputs = ["O", "M", "L", "q", "prm", "sgv", "snk", "pk", "pv", *tails], ["out"]
        body = (f"const T* tks[{n_chunks}] = {{{tks}}};\nconst T* tvs[{n_chunks}] = {{{tvs}}};\n"
                "cart::finish_row<T, HD, NKV, NCH, CH, VROT, SINKS, NP>(O, M, L, q, SCALE, prm, sgv, snk, pk, pv, tks, "
                "tvs, out, blockIdx.y, blockIdx.z);\n")
    else:
        base = kind.split("+")[0]
        inputs = list(MMA_INPUTS if base == "mma" else PASS1_INPUTS)
        body = {"pass1": PASS1_CALL, "mma": MMA_CALL, "tc": TC_CALL}[base]
        outputs = ["O", "M", "L"]
        if kind.endswith("+finish"):
            inputs += ["work", "tk0", "tv0", "sgv"]
            outputs = ["out"]
            body = SINGLE_SCRATCH + body + SINGLE_FINISH
    tag = hashlib.sha256(repr(consts).encode()).hexdigest()[:10]
    name = f"cartridge_{kind.replace('+', '_')}{n_chunks or ''}_{source_header()[1]}_{tag}"
    return name, inputs, outputs, _constants(consts) + body


@functools.cache
def _kernel(kind, n_chunks, consts, shared_memory=0):
    """The mx.fast.cuda_kernel of `kernel_spec(kind, n_chunks, consts)`, with `shared_memory` dynamic bytes."""
    name, inputs, outputs, body = kernel_spec(kind, n_chunks, consts)
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=body,
                               header=source_header()[0], shared_memory=shared_memory)


def _lut_bytes(tid, bits):
    """Bytes of one side's shared-memory code-pair table (TcSide::LUT_BYTES): 0 for a tier without lookups."""
    if tid not in (MXFP4, NVFP4, TURBO):
        return 0
    entries = 1 << (2 * (bits if tid == TURBO else 4))
    return entries * (32 if entries * 128 <= 8192 else 8192 // (4 * entries)) * 4


def tc_smem_bytes(k_spec, v_spec, D, lreg=False, warps=None, stages=None):
    """Dynamic shared memory of flash_pass1_tc (tc_smem_bytes in flash_decode.cuh): the code-pair tables (unless
    `lreg`, lookups in registers), then the stages or the warps' outputs, whichever is larger."""
    warps, stages = warps or TC_WARPS, stages or TC_STAGES
    tk, tv = (cuda_prefill.tc_side_bytes(s[0], s[1], D) for s in (k_spec, v_spec))
    tables = 0 if lreg else _lut_bytes(k_spec[0], k_spec[1]) + _lut_bytes(v_spec[0], v_spec[1])
    return tables + max(warps * stages * (tk + tv), warps * 8 * D * 4)


@functools.cache
def has_tensor_cores():
    """True if the default device is an NVIDIA GPU of compute capability 8.0 or newer (mma.m16n8k16
    with fp16 operands, mma.m16n8k32 with 8-bit integers and cp.async need sm_80)."""
    found = re.fullmatch(r"sm_(\d+)\w*", str(mx.device_info().get("architecture", "")))
    return found is not None and int(found.group(1)) >= 80


def tier_spec(codec, parts):
    """(kernel tier id, bits, component names) of a stored side from its codec's `kernel_layout`
    (`cartridge.tiers.layout.layout_of`), or None if no fused kernel reads it. A rotated tier (`mlx4g32+rot`)
    is read as its base tier; `rotation` gives its rotation."""
    found = layout_of(codec, parts)
    return None if found is None else (found.tier_id, found.bits, found.components)


def rotation(codec, params):
    """The rotation record of a +rot side ({"kind", "block", "seed"}, spec/FORMAT.md 6.4), else None."""
    return params.get("rotation") if hasattr(codec, "base") else None


def supported(prefix, head_dim):
    """True if both sides' tiers and the head_dim have a fused kernel (mxfp4, nvfp4 and the rotated tiers: only
    the tensor-core pass 1, so head_dim 64 or 128, pages of a multiple of 16 tokens and a GPU with tensor
    cores; a rotation's block must be the whole head, as it is by default at 64 and 128)."""
    specs = [tier_spec(prefix.k_codec, prefix.k_parts), tier_spec(prefix.v_codec, prefix.v_parts)]
    if head_dim not in HEAD_DIMS or None in specs:
        return False
    rots = [rotation(prefix.k_codec, prefix.k_params), rotation(prefix.v_codec, prefix.v_params)]
    if any(r is not None and (r["block"] != head_dim or not ROTATED_FUSED) for r in rots):  # whole heads only
        return False
    if any(s[0] in TC_ONLY for s in specs) or any(r is not None for r in rots):  # beside float32 pages: none
        page = prefix.k_parts[next(iter(prefix.k_parts))].shape[2]
        return F32 not in (specs[0][0], specs[1][0]) and head_dim in MMA_HEAD_DIMS and page % 16 == 0 and \
            has_tensor_cores()
    return True


def _table_ok(spec, params):
    """False for a TurboQuant codebook that is not symmetric in fp16: flash_pass1_tc looks up magnitudes and
    takes the sign from the code (`tc_table`); the codebooks cartridge builds are symmetric by construction."""
    if spec is None or spec[0] != TURBO:
        return True
    cb = np.asarray(params["codebook"], dtype=np.float16)
    return bool(np.array_equal(cb, -cb[::-1]))


def _side_inputs(spec, parts, params, rot=None):
    """Component arrays padded to three, codebook padded to 16 floats, and signs (n_kv, D) or a dummy: a
    TurboQuant side's, or a rotated side's (the rotation's signs, the same for every KV head)."""
    tid, _, names = spec
    arrays = [parts[n] for n in names] + [_zeros((4,), np.uint32)] * (3 - len(names))
    if rot is not None:
        n_kv, D = arrays[0].shape[1], rot["block"]
        signs = mx.array(np.tile(sign_bits(rot["seed"], D), (n_kv, 1)))  # (n_kv, D)
        _, cb, _ = _side_inputs(spec, parts, params)
        return arrays, cb, signs
    if tid == NVFP4:  # cb[0]: the global factor global_scale / (448 * 6), times the 2^8 the kernel's fp16 scales lack
        cb = np.zeros(16, dtype=np.float32)
        cb[0] = params["global_scale"] / (448.0 * 6.0) * 256.0
        return arrays, mx.array(cb), _zeros((1,))
    if tid == TURBO:
        cb = np.zeros(16, dtype=np.float32)
        cb[: len(params["codebook"])] = params["codebook"]
        signs = mx.array(np.asarray(params["signs"], dtype=np.float32))  # (n_kv, D)
        return arrays, mx.array(cb), signs
    return arrays, _zeros((16,)), _zeros((1,))


def split_plan(n_tokens, n_kv, row_blocks, slots, target_blocks=None, granule=None):
    """(tokens per split, number of splits): about `target_blocks` (default TARGET_BLOCKS) blocks, each
    split at least 4 rounds of `slots` tokens and a multiple of `granule` tokens (default `slots`)."""
    target = TARGET_BLOCKS if target_blocks is None else target_blocks
    granule = granule or slots
    n_splits = max(1, min(math.ceil(target / (n_kv * row_blocks)), math.ceil(n_tokens / (4 * slots))))
    per = math.ceil(math.ceil(n_tokens / n_splits) / granule) * granule
    return per, math.ceil(n_tokens / per)


@dataclass(frozen=True, eq=False)  # hashed by identity: a key of the cache's scratch
class _Plan:
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


class FusedAttention:
    """Fused attention of one layer: the prefix pages as stored, plus the cache's dense tail.

    Args:
        prefix (LayerPrefix): the layer's pages (tiers with a `kernel_layout`, or dense pages).
    """

    def __init__(self, prefix):
        self.prefix = prefix
        self.k_spec = tier_spec(prefix.k_codec, prefix.k_parts)
        self.v_spec = tier_spec(prefix.v_codec, prefix.v_parts)
        k_rot, v_rot = rotation(prefix.k_codec, prefix.k_params), rotation(prefix.v_codec, prefix.v_params)
        self.k_in, self.cbk, self.sgk = _side_inputs(self.k_spec, prefix.k_parts, prefix.k_params, k_rot)
        self.v_in, self.cbv, self.sgv = _side_inputs(self.v_spec, prefix.v_parts, prefix.v_params, v_rot)
        self.k_rot, self.v_rot = k_rot is not None, v_rot is not None
        _, self.n_kv, self.page, _ = self.k_in[0].shape
        # stored tokens first .. end - 1 are read from the pages; protected tokens (format 1.5) from their fp16
        # copies, by the finish (so a protected layer takes two launches); pass 1 starts at a multiple of 16
        self.first, self.end = (0, prefix.n_tokens) if prefix.protected is None else \
            prefix.protected.page_range(prefix.n_tokens)
        self.start = self.first // 16 * 16
        self.kept = None if prefix.protected is None else (prefix.protected.k, prefix.protected.v)  # (n_kv, NP, D)
        self._kept_as = {}  # dtype -> the protected copies in it
        rotated = self.k_rot or self.v_rot
        self.mma = self.k_spec[0] == AFF4 and self.v_spec[0] == AFF4 and self.page % 16 == 0
        self.tc_only = self.k_spec[0] in TC_ONLY or self.v_spec[0] in TC_ONLY or rotated
        self.table_ok = _table_ok(self.k_spec, prefix.k_params) and _table_ok(self.v_spec, prefix.v_params)
        self.tc_reads = F32 not in (self.k_spec[0], self.v_spec[0])  # flash_pass1_tc reads no float32 pages
        self.v_back = self.v_spec[0] == TURBO or self.v_rot  # the finish rotates the prefix output back
        self._rows = {}  # (R, per, n_splits, chunk_size) -> [int32 (8,) device row per tail length]
        self._plans = {}

    def _params(self, plan, L, tail_len, chunk_size):
        """Kernel parameters [end of the stored tokens read, R, per split, splits, tail length, query tokens, first
        split's start, first stored token read] (int32 (8,)) on the device. Decode steps (L = 1) take a row made
        and evaluated once per tail length, so a step adds no operation for them."""
        head = [self.end, plan.R, plan.per, plan.n_splits]
        if L > 1:
            return mx.array([*head, tail_len, L, self.start, self.first], dtype=mx.int32)
        key = (plan.R, plan.per, plan.n_splits, chunk_size)
        rows = self._rows.get(key)
        if rows is None:
            table = np.zeros((MAX_CHUNKS * chunk_size + 1, 8), dtype=np.int32)
            table[:] = [*head, 0, 1, self.start, self.first]
            table[:, 4] = np.arange(len(table))
            rows = self._rows[key] = list(mx.array(table))
            mx.eval(rows)
        return rows[tail_len]

    def _protected(self, dtype):
        """The finish's pk, pv: the protected tokens' fp16 copies (n_kv, NP, D) in `dtype`, or one-element dummies."""
        kept = self._kept_as.get(dtype)
        if kept is None:
            kept = [mx.zeros((1,), dtype=dtype)] * 2 if self.kept is None else [a.astype(dtype) for a in self.kept]
            mx.eval(kept)
            self._kept_as[dtype] = kept
        return kept

    def _cuda_decodes(self, spec, dtype, D):
        """True if `cuda_decode` decodes a side of `spec` for queries of `dtype`: fp16/bf16 queries only (it rounds
        the values to fp16 on the way, as flash_pass1_tc reads them: a float32 model keeps the exact MLX-op decode)."""
        return (CUDA_DECODE and dtype in (mx.float16, mx.bfloat16) and self.table_ok
                and cuda_decode.reads(spec, self.page, D))

    def _dense_min_rows(self, dtype, D):
        """Query rows per KV head from which a call takes `dense.prefill_attention`: DECODED_MIN_ROWS where
        `cuda_decode` decodes both sides, else DENSE_MIN_ROWS (the MLX-op decode's crossover)."""
        if all(self._cuda_decodes(s, dtype, D) for s in (self.k_spec, self.v_spec)):
            return DECODED_MIN_ROWS
        return DENSE_MIN_ROWS.get(self.k_spec[0], DENSE_MIN_ROWS_OTHER)

    def decoded(self, side, n_out, dtype, D):
        """A side's stored tokens decoded by `cuda_decode.decode_side` as (1, n_kv, n_out, D) of `dtype` (stored
        basis), or None where that kernel does not read the side (`dense.prefill_attention` decodes by MLX ops)."""
        spec, arrays, cb = (self.k_spec, self.k_in, self.cbk) if side == "k" else (self.v_spec, self.v_in, self.cbv)
        if not self._cuda_decodes(spec, dtype, D):
            return None
        return cuda_decode.decode_side(spec, arrays, cb, self.prefix.n_tokens, n_out, D, dtype, source_header())

    def uses_mma(self, R, D):
        """True if pass 1 runs `flash_pass1_mma` (mlx4g32 K and V) for R query rows per KV head and head_dim D."""
        return TENSOR_CORES and self.mma and R <= 4 and D in MMA_HEAD_DIMS and has_tensor_cores()

    def uses_tensor_cores(self, R, D):
        """True if pass 1 runs on tensor cores (`flash_pass1_mma` or `flash_pass1_tc`) for R query rows per KV
        head and head_dim D; the TC_ONLY and rotated tiers always do (they have no other pass 1), float32 pages
        never."""
        return ((self.tc_only or TENSOR_CORES) and self.tc_reads and D in MMA_HEAD_DIMS and self.page % 16 == 0
                and has_tensor_cores())

    def _plan(self, n_q, L, D, dtype, n_chunks, chunk_size, scale, single, sinks):
        R = (n_q // self.n_kv) * L  # query rows per KV head: GQA group x query tokens
        smem = 0
        if self.uses_mma(R, D):
            target = MMA_TARGET_BLOCKS_D64 if D == 64 else MMA_TARGET_BLOCKS
            # splits of whole 16-token tiles, equal within a tile: at 131072 tokens, 32 x 3984 + 3584 tokens
            # rather than 32 x 4032 + 2048 (a block with half the work, and the others longer)
            per, n_splits = split_plan(self.end - self.start, self.n_kv, 1, 16 * MMA_WARPS, target, granule=16)
            kind, inputs, threads = "mma", [self.sgk, *self.k_in, *self.v_in], MMA_WARPS * 32
            consts = [("T", dtype), ("HD", D), ("NKV", self.n_kv), ("PAGE", self.page), ("WARPS", MMA_WARPS),
                      ("STAGES", MMA_STAGES), ("DIAG", MMA_DIAG), ("RK", self.k_rot)]
            grid = (n_splits * threads, self.n_kv, 1)
        elif self.uses_tensor_cores(R, D):
            target = TC_TARGET_BLOCKS_D64 if D == 64 else TC_TARGET_BLOCKS
            row_blocks = -(-R // 8)
            warps = TC_WARPS_TURBO if self.v_spec[0] == TURBO else TC_WARPS
            per, n_splits = split_plan(self.end - self.start, self.n_kv, row_blocks, 16 * warps, target, granule=16)
            (tk, bk, _), (tv, bv, _) = self.k_spec, self.v_spec
            lreg = bool(REGISTER_LOOKUP & {tk, tv}) and self.table_ok
            kind, inputs, threads = "tc", [self.sgk, *self.k_in, *self.v_in, self.cbk, self.cbv], warps * 32
            consts = [("T", dtype), ("TK", tk), ("BK", bk), ("TV", tv), ("BV", bv), ("HD", D), ("NKV", self.n_kv),
                      ("PAGE", self.page), ("WARPS", warps), ("STAGES", TC_STAGES), ("DIAG", 0),
                      ("RK", self.k_rot), ("LREG", lreg)]
            grid = (n_splits * threads, self.n_kv, row_blocks)
            smem = tc_smem_bytes(self.k_spec, self.v_spec, D, lreg, warps)
            # MLX raises a kernel's shared-memory limit only for more than 48000 dynamic bytes; with the static
            # arrays (about 6 KB) a smaller request could still pass the default 48 KiB
            smem = smem if smem <= 48 * 1024 - 8192 else max(smem, 48004)
        else:
            rows, epl = (R, DECODE_EPL) if R <= 4 else (8, 8)
            slots = (32 // (D // epl)) * WARPS * UNROLL  # tokens a block consumes per round
            row_blocks = -(-R // rows)
            per, n_splits = split_plan(self.end - self.start, self.n_kv, row_blocks, slots)
            (tk, bk, _), (tv, bv, _) = self.k_spec, self.v_spec
            kind, inputs, threads = "pass1", [self.sgk, *self.k_in, *self.v_in, self.cbk, self.cbv], WARPS * 32
            consts = [("T", dtype), ("TK", tk), ("TV", tv), ("BK", bk), ("BV", bv), ("HD", D), ("EPL", epl),
                      ("ROWS", rows), ("NKV", self.n_kv), ("PAGE", self.page), ("WARPS", WARPS), ("UNR", UNROLL),
                      ("DIAG", 0)]
            grid = (n_splits * threads, self.n_kv, row_blocks)
        consts.append(("SCALE", float(scale)))
        if single and threads == 128:
            consts = (*consts, ("CH", chunk_size), ("VROT", self.v_back))
            work = (n_splits + 1) * self.n_kv * R * (D + 2) + self.n_kv
            return _Plan(_kernel(kind + "+finish", 1, consts, smem), consts, inputs, grid, threads, True, None, R, per,
                         n_splits, work)
        consts = tuple(consts)
        return _Plan(_kernel(kind, 0, consts, smem), consts, inputs, grid, threads, False,
                     self._finish_kernel(dtype, D, n_chunks, chunk_size, scale, sinks), R, per, n_splits, 0)

    def _finish_kernel(self, dtype, D, n_chunks, chunk_size, scale, sinks):
        """The two-kernel finish (`finish_row`) for this layer: tail chunks, rotated V, sinks, protected tokens."""
        return _kernel("finish", n_chunks, (
            ("T", dtype), ("HD", D), ("NKV", self.n_kv), ("NCH", n_chunks), ("CH", chunk_size), ("VROT", self.v_back),
            ("SINKS", sinks), ("NP", 0 if self.kept is None else self.kept[0].shape[1]), ("SCALE", float(scale))))

    def _finish(self, finish, partials, R, queries, prm, sinks, cache, n_chunks):
        """Launch `finish` over pass 1's `partials` (O, M, L) of R query rows per KV head: the output."""
        k_chunks, v_chunks = cache.tail_chunks
        tails = [c for pair in zip(k_chunks[:n_chunks], v_chunks[:n_chunks]) for c in pair]
        return finish(
            inputs=[*partials, queries, prm, self.sgv, _NO_SINKS if sinks is None else sinks.astype(mx.float32),
                    *self._protected(queries.dtype), *tails], grid=(128, self.n_kv, R),
            threadgroup=(128, 1, 1), output_shapes=[queries.shape], output_dtypes=[queries.dtype],
            init_value=POISON)[0]

    def _prefills(self, R, dtype, D):
        """True if `cuda_prefill` answers R query rows per KV head of `dtype` (both sides read there, the TurboQuant
        codebooks symmetric, a GPU with tensor cores)."""
        return (cuda_prefill.reads(self.k_spec, self.v_spec, self.page, D, dtype, R, self.k_rot or self.v_rot)
                and self.table_ok
                and has_tensor_cores())

    @staticmethod
    def _fits(n_chunks, D, sinks):
        """True if the kernels read a tail of `n_chunks` chunks (1 to MAX_CHUNKS), this head_dim and sinks."""
        return 1 <= n_chunks <= MAX_CHUNKS and D in HEAD_DIMS and (sinks is None or SINKS_FUSED)

    def prefill_kernel_takes(self, cache, queries, sinks=None):
        """True if a call with these (1, n_q_heads, L, head_dim) queries runs `cuda_prefill`'s kernel as pass 1."""
        _, n_q, L, D = queries.shape
        n_chunks = -(-cache.tail_len // cache.chunk_size)
        return self._fits(n_chunks, D, sinks) and self._prefills(n_q // self.n_kv * L, queries.dtype, D)

    def question_kernel_takes(self, cache, queries, sinks=None):
        """True if a call with these (1, n_q_heads, L, head_dim) queries of fp16/bf16 runs a tensor-core kernel:
        `cuda_prefill`'s, or pass 1 on tensor cores (`uses_tensor_cores`) below the rows of `dense.prefill_attention`
        (`contiguous.ContiguousAttention.on_pages` routes fp16 questions by it)."""
        _, n_q, L, D = queries.shape
        R = n_q // self.n_kv * L
        if self.prefill_kernel_takes(cache, queries, sinks):
            return True
        n_chunks = -(-cache.tail_len // cache.chunk_size)
        return (queries.dtype in (mx.float16, mx.bfloat16) and self._fits(n_chunks, D, sinks)
                and R < self._dense_min_rows(queries.dtype, D) and self.uses_tensor_cores(R, D))

    def __call__(self, cache, queries, scale, sinks=None):
        """Attention output (1, n_q_heads, L, head_dim) in the queries' dtype, or None if unsupported.

        Args:
            cache (CartridgeCache): supplies the dense tail chunks, their length, and `scratch`, where
                the single launch keeps its work buffer (float32 partials, then int32 block counters that
                the kernel returns to zero). Two calls on one cache must therefore run one after the
                other: each decode step's queries depend on the previous step's output, so mlx-lm's
                generate loop always orders them; two independent calls in one graph could overlap on
                the device and share the buffer. (An explicit edge, the previous output as an input,
                cost more host time per step than the single launch saves: benchmarks/gpu_e2e_variants.py at a876215.)
            queries (mx.array): (1, n_q_heads, L, head_dim), the last L tokens of the tail.
            scale (float): softmax scale.
            sinks (mx.array | None): (n_q_heads,) sink logits (gpt-oss), merged by the two-kernel finish
                as one more logit per head. Default: None.
        """
        _, n_q, L, D = queries.shape
        tail_len, chunk_size = cache.tail_len, cache.chunk_size
        n_chunks, short_tail = -(-tail_len // chunk_size), tail_len <= SINGLE_MAX_TAIL
        # what a call does depends only on these; the module's switches are read at a shape's first call
        key = (n_q, L, D, queries.dtype, scale, sinks is None, n_chunks, chunk_size, short_tail)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._route(n_q, L, D, queries.dtype, scale, sinks, n_chunks, chunk_size,
                                                  short_tail)
        if plan is None:
            return None
        if plan is PREFILL:
            *partials, prm = cuda_prefill.pass1(self, queries, scale, tail_len, source_header())
            finish = self._finish_kernel(queries.dtype, D, n_chunks, chunk_size, scale, sinks is not None)
            return self._finish(finish, partials, n_q // self.n_kv * L, queries, prm, sinks, cache, n_chunks)
        if plan is DECODED:
            return dense.prefill_attention(self.prefix, cache, queries, scale, sinks, decode=self.decoded)
        prm = self._params(plan, L, tail_len, chunk_size)
        k_chunks, v_chunks = cache.tail_chunks
        if plan.single:
            work = cache.scratch.get(plan)
            if work is None:  # a real buffer (not a broadcast zero): the kernel writes it in place
                work = cache.scratch[plan] = mx.array(np.zeros(plan.work_size, dtype=np.float32))
            return plan.kernel(
                inputs=[queries, *plan.inputs, prm, work, k_chunks[0], v_chunks[0], self.sgv],
                grid=plan.grid, threadgroup=(plan.threads, 1, 1), output_shapes=[queries.shape],
                output_dtypes=[queries.dtype], init_value=POISON)[0]
        partial = [(plan.n_splits, self.n_kv, plan.R)]
        partials = plan.kernel(
            inputs=[queries, *plan.inputs, prm], grid=plan.grid, threadgroup=(plan.threads, 1, 1),
            output_shapes=[(plan.n_splits, self.n_kv, plan.R, D)] + partial * 2, output_dtypes=[mx.float32] * 3,
            init_value=POISON)
        return self._finish(plan.finish, partials, plan.R, queries, prm, sinks, cache, n_chunks)

    def _route(self, n_q, L, D, dtype, scale, sinks, n_chunks, chunk_size, short_tail):
        """How calls of one shape run: PREFILL (`cuda_prefill`'s kernel as pass 1), DECODED (the pages decoded for
        MLX's SDPA), a `_Plan` (pass 1 and the finish, in one launch or two), or None (the portable path)."""
        R = n_q // self.n_kv * L
        fits = self._fits(n_chunks, D, sinks)
        if fits and self._prefills(R, dtype, D):
            return PREFILL
        if R >= self._dense_min_rows(dtype, D):
            return DECODED
        if not fits:
            return None
        single = (SINGLE_LAUNCH and R <= SINGLE_MAX_ROWS and short_tail and n_chunks == 1 and sinks is None
                  and self.kept is None)
        return self._plan(n_q, L, D, dtype, n_chunks, chunk_size, scale, single, sinks is not None)
