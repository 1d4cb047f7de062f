"""A layer's stored pages decoded to the queries' dtype by one CUDA kernel, for a question's prefill (issue 34 item 3).

A question of many tokens (`CudaTuning.decoded_min_rows` query rows per KV head and more) attends by MLX's own SDPA over
the layer's pages decoded for that call (`kernels/dense.py`). Decoded by MLX ops, a compressed side costs several
passes over the layer (unpack, float32 arithmetic, the cast, the layout); `decode_tiles` in flash_decode.cuh reads
each 16-token tile once, as the tensor-core pass 1 reads it, and writes the values once, already laid out as
(n_kv_heads, tokens, head_dim) with room for the question. Rotated tiers (+rot, TurboQuant) stay in their stored
basis, as with the MLX-op decode. Launched by `kernels.cuda` (which passes the tier and its inputs).
"""

import functools
import hashlib

import mlx.core as mx

from ...tiers.layout import AFF4, AFF6, AFF8, KIVI4, MXFP4, MXFP8, NVFP4, TURBO
from .cuda_source import constants, source_header

DECODED_TIERS = (AFF8, AFF6, AFF4, KIVI4, MXFP8, MXFP4, NVFP4, TURBO)  # the compressed tiers flash_pass1_tc reads
HEAD_DIMS = (64, 128)
CALL = ("cart::decode_tiles<T, TIER, BITS, HD, NKV, PAGE, WARPS>((const void*)c0, (const void*)c1, "
        "(const void*)c2, cb, prm, out);\n")


def kernel_spec(consts, digest):
    """(name, input names, output names, body) of `decode_tiles` for `consts` ((name, value) pairs: T, TIER, BITS, HD,
    NKV, PAGE, WARPS); `digest` is flash_decode.cuh's (part of the name, as `cuda_source.kernel_spec` names its kernels)."""
    body = constants(consts) + CALL
    tag = hashlib.sha256(repr(consts).encode()).hexdigest()[:10]
    return f"cartridge_decode_{digest}_{tag}", ["c0", "c1", "c2", "cb", "prm"], ["out"], body


@functools.cache
def _kernel(consts):
    name, inputs, outputs, body = kernel_spec(consts, source_header()[1])
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=body,
                               header=source_header()[0])


def reads(spec, page, head_dim):
    """True if `decode_tiles` decodes a side of kernel tier `spec` ((tier id, bits, components), `cuda.tier_spec`)
    in pages of `page` tokens: a compressed tier, whole 16-token tiles in a page, head_dim 64 or 128."""
    return spec is not None and spec[0] in DECODED_TIERS and page % 16 == 0 and head_dim in HEAD_DIMS


def decode_side(spec, arrays, cb, n_tokens, n_out, head_dim, dtype, warps):
    """One side's stored tokens decoded, in their stored basis, as (1, n_kv_heads, n_out, head_dim) of `dtype`.

    Args:
        spec (tuple): (tier id, bits, components) of the side (`cuda.tier_spec`; `reads` must hold).
        arrays (list[mx.array]): its components (n_pages, n_kv_heads, page, width), padded to three.
        cb (mx.array): float32 (16,): the TurboQuant codebook (symmetric in fp16) or nvfp4's global factor in
            cb[0] (`CudaInputs.cbk`, `cbv`, as pass 1 takes them).
        n_tokens (int): stored tokens to decode; n_out (int): tokens of the output (>= n_tokens); tokens n_tokens
            .. n_out - 1 are not written (the caller writes the question's K/V there).
        head_dim (int): 64 or 128.
        dtype (mx.Dtype): float16, bfloat16 or float32.
        warps (int): 16-token tiles per block (`CudaTuning.decode_warps`).

    Returns:
        mx.array: (1, n_kv_heads, n_out, head_dim).
    """
    _, n_kv, page, _ = arrays[0].shape
    tid, bits, _ = spec
    consts = (("T", dtype), ("TIER", tid), ("BITS", bits), ("HD", head_dim), ("NKV", n_kv), ("PAGE", page),
              ("WARPS", warps))
    n_tiles = -(-n_tokens // 16)
    prm = mx.array([n_tokens, n_out], dtype=mx.int32)
    return _kernel(consts)(
        inputs=[*arrays, cb, prm], grid=(-(-n_tiles // warps) * warps * 32, n_kv, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(1, n_kv, n_out, head_dim)], output_dtypes=[dtype])[0]
