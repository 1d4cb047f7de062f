"""The CUDA kernels' source as MLX gets it: a few lines that `#include` flash_decode.cuh (next to this file) by path
after the shape's compile-time constants, then one call (`kernel_spec`); each (kind, constants) built once (`kernel`).

MLX builds and hashes the source it gets on every call, so it is kept short, and the .cuh's content digest is part
of every kernel's name, so MLX's compile cache never serves a stale build. `kernels.cuda` launches these;
`cuda_prefill` and `cuda_decode` name their kernels with the same digest.
"""

import functools
import hashlib
from pathlib import Path

import mlx.core as mx
import numpy as np

from .constants import constant_lines

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
MMA_CALL = """cart::flash_pass1_mma<T, HD, NKV, PAGE, WARPS, STAGES, RK>(
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
if (cart::last_block(counter, blockIdx.y, gridDim.x * gridDim.z))
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


def constants(consts):
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
    return name, inputs, outputs, constants(consts) + body


@functools.cache
def kernel(kind, n_chunks, consts, shared_memory=0):
    """The mx.fast.cuda_kernel of `kernel_spec(kind, n_chunks, consts)`, with `shared_memory` dynamic bytes."""
    name, inputs, outputs, body = kernel_spec(kind, n_chunks, consts)
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=body,
                               header=source_header()[0], shared_memory=shared_memory)
