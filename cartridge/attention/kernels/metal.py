"""Fused flash-decoding attention over compressed pages on MLX's Metal backend (`mx.fast.metal_kernel`).

The Metal source is `flash_decode.metal` (next to this file), handed to MLX as the kernel header; each kernel's
body is its compile-time constants and one call. Pass 1 reads the stored pages of every tier the CUDA kernel
reads (kernel tier ids and stored components: each codec's `kernel_layout`, tiers/layout.py) and dequantizes in
registers, split over tokens; the finish merges the splits, the protected tokens, the dense tail and the sinks by
log-sum-exp and writes the output in the queries' dtype. The reference for both is `kernels/portable.py`
(tests/attention/test_metal_kernels.py compares them against float64 on Apple silicon).

Status: the generated sources are compile-checked on Linux against `metal_shim.h` (tests/attention/test_metal_source.py);
they have NOT been run on Apple hardware. Only shape-dependent values that change the registers a thread needs are
compile-time constants (dtype, tiers, head_dim, query rows, rotation, tail chunks); KV heads, page size, split
sizes, sinks and V rotation are runtime parameters (`prm`), so the variants are few enough to list (`sources`).
Kernels are built once per variant and launches once per shape, as in cuda.py.
"""

import functools
import hashlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import mlx.core as mx
import numpy as np

from ...tiers import TIERS
from ...tiers.layout import AFF4, AFF6, AFF8, BF16, F32, FP16, KIVI4, MXFP4, MXFP8, NVFP4, TURBO, layout_of  # noqa: F401
from ...tiers.rotation import sign_bits
from .constants import constant_lines
from .cuda import split_tokens
from .cuda_inputs import rotation

SOURCE = Path(__file__).with_name("flash_decode.metal")
METAL_TYPES = {mx.float16: "half", mx.bfloat16: "bfloat16_t", mx.float32: "float"}
HEAD_DIMS = (64, 96, 128, 256)
ROW_VARIANTS = (1, 2, 4, 8)  # query rows per KV head a pass-1 variant holds (R rounded up)
MAX_ROWS = 8  # decode: at most 8 query rows per KV head (GQA group x query tokens)
MAX_CHUNKS = 8  # tail chunks the finish reads (its inputs tk0..tk7, tv0..tv7)
BN = 8  # simdgroups per pass-1 threadgroup: tokens in flight (MLX's sdpa_vector_2pass keeps 8 too)
TARGET_GROUPS = 256  # pass-1 threadgroups to aim for: splits x KV heads (unmeasured on Apple GPUs)
N_PARAMS = 16  # int32 parameters (Param in flash_decode.metal)
_DUMMY = 8  # elements of a placeholder input: MLX passes arrays of fewer than 8 elements in `constant` memory
PASS1_INPUTS = ["q", "sgk", "k0", "k1", "k2", "v0", "v1", "v2", "cbk", "cbv", "prm"]
FINISH_INPUTS = (["O", "M", "L", "q", "prm", "sgv", "snk", "pk", "pv"] + [f"tk{i}" for i in range(MAX_CHUNKS)]
                 + [f"tv{i}" for i in range(MAX_CHUNKS)])
PASS1_CALL = """threadgroup float tq[ROWS * HD];
threadgroup float tcb[32];
threadgroup float to[BN * HD];
threadgroup float tm[BN * ROWS];
threadgroup float tl[BN * ROWS];
cart::pass1<T, TK, BK, TV, BV, HD, ROWS, BN, RK>(q, SCALE, sgk, (const device uchar*)k0, (const device uchar*)k1,
    (const device uchar*)k2, (const device uchar*)v0, (const device uchar*)v1, (const device uchar*)v2, cbk, cbv,
    prm, O, M, L, tq, tcb, to, tm, tl, threadgroup_position_in_grid, simdgroup_index_in_threadgroup,
    thread_index_in_simdgroup);
"""
FINISH_CALL = """threadgroup float so[HD];
cart::finish<T, HD>(O, M, L, q, SCALE, prm, sgv, snk, pk, pv, tk0, tk1, tk2, tk3, tk4, tk5, tk6, tk7, tv0, tv1,
    tv2, tv3, tv4, tv5, tv6, tv7, out, so, threadgroup_position_in_grid, thread_index_in_simdgroup);
"""


def available():
    """True if MLX's Metal backend is present (`mx.metal.is_available()`)."""
    return mx.metal.is_available()


@functools.cache
def header():
    """The kernel header: the text of `flash_decode.metal` (MLX prepends its own utils, which define bfloat16_t)."""
    return SOURCE.read_text()


def layout(codec, parts):
    """(kernel tier id, bits, component names) of a stored side from its codec's `kernel_layout`
    (`tiers.layout.layout_of`: a rotated tier read as its base, dense pages by their dtype), or None."""
    found = layout_of(codec, parts)
    return None if found is None else (found.tier_id, found.bits, tuple(found.components))


def supported(prefix, head_dim, mode="decode"):
    """True if Metal kernels read this layer: both sides' tiers have a kernel layout, head_dim in HEAD_DIMS
    (a power of two for TurboQuant and rotated sides, whose rotation block must be the whole head), decode mode
    (1-8 query rows per KV head, checked again per call), and kivi4 pages of whole 32-token groups."""
    if mode != "decode" or head_dim not in HEAD_DIMS:
        return False
    specs = [layout(prefix.k_codec, prefix.k_parts), layout(prefix.v_codec, prefix.v_parts)]
    if None in specs:
        return False
    rots = [rotation(prefix.k_codec, prefix.k_params), rotation(prefix.v_codec, prefix.v_params)]
    if any(r is not None and r["block"] != head_dim for r in rots):
        return False
    if any(r is not None for r in rots) or TURBO in (specs[0][0], specs[1][0]):
        if head_dim & (head_dim - 1):
            return False
    page = next(iter(prefix.k_parts.values())).shape[2]
    return KIVI4 not in (specs[0][0], specs[1][0]) or page % 32 == 0


def _msl_float(value):
    """A float32 as a decimal MSL literal: 9 significant digits round-trip it; hex float literals are C++17, MSL is
    C++14-based."""
    text = f"{float(np.float32(value)):.9g}"
    return text if "." in text or "e" in text else text + ".0"


def _constants(consts):
    """MSL lines defining a kernel's compile-time constants (types, ints, bools, the float SCALE)."""
    return constant_lines(consts, METAL_TYPES, _msl_float)


def kernel_spec(kind, consts):
    """(name, input names, output names, body) of "pass1" or "finish" with `consts` ((name, value) pairs)."""
    inputs, outputs, call = ((PASS1_INPUTS, ["O", "M", "L"], PASS1_CALL) if kind == "pass1"
                             else (FINISH_INPUTS, ["out"], FINISH_CALL))
    tag = hashlib.sha256((header() + repr(tuple(consts))).encode()).hexdigest()[:16]
    return f"cartridge_metal_{kind}_{tag}", list(inputs), outputs, _constants(consts) + call


@functools.cache
def _kernel(kind, consts):
    """The mx.fast.metal_kernel of `kernel_spec(kind, consts)`, built once."""
    name, inputs, outputs, body = kernel_spec(kind, consts)
    return mx.fast.metal_kernel(name=name, input_names=inputs, output_names=outputs, source=body, header=header())


def pass1_consts(dtype, k_spec, v_spec, D, rows, rk):
    """Compile-time constants of pass 1: queries' dtype, K and V (tier id, bits), head_dim, query rows the variant
    holds, simdgroups, whether q is rotated into K's stored basis; SCALE 1.0 (the caller sets the model's)."""
    return (("T", dtype), ("TK", k_spec[0]), ("BK", k_spec[1]), ("TV", v_spec[0]), ("BV", v_spec[1]), ("HD", D),
            ("ROWS", rows), ("BN", BN), ("RK", rk), ("SCALE", 1.0))


def finish_consts(dtype, D):
    """Compile-time constants of the finish: queries' dtype, head_dim; SCALE 1.0 (the caller sets the model's)."""
    return (("T", dtype), ("HD", D), ("SCALE", 1.0))


def _variant_pairs():
    """{label: (K spec, V spec, rotated, head_dims, K dtypes, V dtypes)}: K = V for every tier the codecs lay out
    and its +rot variants, float32 dense pages beside each tier (a side decoded within a budget under a float32
    model; those only with float32 queries), and every K tier beside every other V tier (at head_dim 128). Dtypes:
    of the stored components, in the spec's order."""
    f32 = ((F32, 0, ("values",)), ("float32",))
    pairs = {"f32": (f32[0], f32[0], False, HEAD_DIMS, f32[1], f32[1])}
    sides = {}  # tier name -> (spec, rotated, component dtypes)
    for name in sorted(TIERS):
        codec = TIERS[name]
        spec = layout(codec, {})
        if spec is None:
            continue
        rot = hasattr(codec, "base")
        dims = tuple(d for d in HEAD_DIMS if not ((rot or spec[0] == TURBO) and d & (d - 1)))
        kinds = {c.name: c.dtype for c in codec.components(dims[0])}
        dtypes = tuple(kinds[n] for n in spec[2])
        pairs[name] = (spec, spec, rot, dims, dtypes, dtypes)
        sides[name] = (spec, rot, dtypes)
        if not rot:
            pairs[f"f32/{name}"] = (f32[0], spec, False, dims, f32[1], dtypes)
            pairs[f"{name}/f32"] = (spec, f32[0], spec[0] == TURBO, dims, dtypes, f32[1])
    # any K tier beside any V tier (a schema or a calibrated preset sets them per layer): each side's code is its own
    # template, so one head_dim compiles every pairing (`variants` takes these at float32 and one query row)
    for (kn, (ks, k_rot, kd)), (vn, (vs, _, vd)) in itertools.permutations(sorted(sides.items()), 2):
        pairs[f"{kn}/{vn}"] = (ks, vs, k_rot, (128,), kd, vd)
    return pairs


def _padded3(dtypes):
    """Component dtypes padded to three with the placeholders' uint32 (`_side_inputs`)."""
    return list(dtypes) + ["uint32"] * (3 - len(dtypes))


def variants():
    """Every (variant name, kind, consts, input dtype names) this module hands to MLX, SCALE as 1 (the model's
    scale is compiled in; any float compiles alike)."""
    out = []
    for label, (ks, vs, rot, dims, kd, vd) in sorted(_variant_pairs().items()):
        mixed, cross = "/" in label, "/" in label and "f32" not in label.split("/")
        for D, dtype, rows in itertools.product(dims, METAL_TYPES, ROW_VARIANTS):
            if mixed and (dtype != mx.float32 or rows not in ((1,) if cross else (1, 4))):
                continue
            rk = rot or ks[0] == TURBO
            t = str(dtype).split(".")[-1]
            ins = [t, "float32", *_padded3(kd), *_padded3(vd), "float32", "float32", "int32"]
            out.append((f"pass1 {label} D{D} {t} rows{rows}", "pass1", pass1_consts(dtype, ks, vs, D, rows, rk), ins))
    for D, dtype in itertools.product(HEAD_DIMS, METAL_TYPES):
        t = str(dtype).split(".")[-1]
        ins = ["float32"] * 3 + [t, "int32", "float32", "float32"] + [t] * (2 + 2 * MAX_CHUNKS)
        out.append((f"finish D{D} {t}", "finish", finish_consts(dtype, D), ins))
    return out


def sources():
    """[(variant name, kernel name, [(input name, dtype name)], [(output name, dtype name)], header, body)]:
    everything `mx.fast.metal_kernel` gets for each variant in `variants()` (every input has at least 8 elements,
    so MLX declares each `device`). tests/helpers/metal_source.py assembles the full source as MLX does."""
    out = []
    for label, kind, consts, ins in variants():
        name, inputs, outputs, body = kernel_spec(kind, consts)
        t = str(consts[0][1]).split(".")[-1]
        outs = [(n, "float32") for n in outputs] if kind == "pass1" else [("out", t)]
        out.append((label, name, list(zip(inputs, ins)), outs, header(), body))
    return out


def _side_inputs(spec, parts, params, rot):
    """Component arrays padded to three (placeholders of `_DUMMY` elements), the side's 16 floats (TurboQuant's
    codebook; nvfp4's global factor global_scale / (448 * 6) in [0]) and its signs (n_kv, D): TurboQuant's, or a
    rotated side's (the rotation's, the same for every KV head), else a placeholder. The page arrays are the
    ones mapped from the file, passed as they are."""
    tid, _, names = spec
    arrays = [parts[n] for n in names] + [mx.zeros((_DUMMY,), dtype=mx.uint32)] * (3 - len(names))
    cb = np.zeros(16, dtype=np.float32)
    signs = np.zeros(_DUMMY, dtype=np.float32)
    if tid == NVFP4:
        cb[0] = params["global_scale"] / (448.0 * 6.0)
    if tid == TURBO:
        cb[: len(params["codebook"])] = params["codebook"]
        signs = np.asarray(params["signs"], dtype=np.float32)
    if rot is not None:
        signs = np.tile(sign_bits(rot["seed"], rot["block"]), (arrays[0].shape[1], 1))
    return arrays, mx.array(cb), mx.array(signs)


def _padded(sinks):
    """Sink logits as float32 of at least `_DUMMY` elements (a shorter input would be `constant`, not `device`)."""
    sinks = sinks.astype(mx.float32)
    n = sinks.size
    return sinks if n >= _DUMMY else mx.concatenate([sinks, mx.zeros((_DUMMY - n,), dtype=mx.float32)])


@dataclass(frozen=True)
class _Launch:
    """What one call shape needs: the two kernels, rows, splits, grid and the parameter row."""

    pass1: object
    finish: object
    R: int
    n_splits: int
    prm: object  # int32 (N_PARAMS,) on the device, made once per (shape, tail length)


@dataclass(frozen=True, eq=False)
class MetalInputs:
    """The Metal backend's record of one layer (`LayerPrefix.backend`): its pages as the kernels take them.

    Attributes:
        k_spec, v_spec (tuple): (kernel tier id, bits, component names) of each side (`layout`).
        k_in, v_in (list[mx.array]): each side's components, padded to three with placeholders.
        cbk, cbv (mx.array): float32 (16,): codebook (TurboQuant) or global factor (nvfp4, in [0]).
        sgk, sgv (mx.array): float32 signs (n_kv, D) of a TurboQuant or rotated side, else a placeholder.
        rk (bool): q is rotated into K's stored basis. v_back (bool): the output is rotated back from V's.
        n_kv (int): KV heads. page (int): tokens per page. first, end (int): the stored tokens pass 1 reads.
        kept (tuple | None): the protected tokens' fp16 copies (K, V), each (n_kv, N + M, D).
        no_sinks (mx.array): float32 placeholder for the finish's sinks.
        launches, kept_as (dict): memos: launches by call shape, the protected copies by dtype.
    """

    name: ClassVar[str] = "metal"
    k_spec: tuple
    v_spec: tuple
    k_in: list
    v_in: list
    cbk: object
    cbv: object
    sgk: object
    sgv: object
    rk: bool
    v_back: bool
    n_kv: int
    page: int
    first: int
    end: int
    kept: tuple
    no_sinks: object
    launches: dict = field(default_factory=dict)
    kept_as: dict = field(default_factory=dict)


def lay_out(prefix):
    """The `MetalInputs` of a layer; `supported(prefix, head_dim)` must hold."""
    k_spec, v_spec = layout(prefix.k_codec, prefix.k_parts), layout(prefix.v_codec, prefix.v_parts)
    k_rot, v_rot = rotation(prefix.k_codec, prefix.k_params), rotation(prefix.v_codec, prefix.v_params)
    k_in, cbk, sgk = _side_inputs(k_spec, prefix.k_parts, prefix.k_params, k_rot)
    v_in, cbv, sgv = _side_inputs(v_spec, prefix.v_parts, prefix.v_params, v_rot)
    _, n_kv, page, _ = k_in[0].shape
    first, end = (0, prefix.n_tokens) if prefix.protected is None else prefix.protected.page_range(prefix.n_tokens)
    return MetalInputs(
        k_spec=k_spec, v_spec=v_spec, k_in=k_in, v_in=v_in, cbk=cbk, cbv=cbv, sgk=sgk, sgv=sgv,
        rk=k_rot is not None or k_spec[0] == TURBO, v_back=v_rot is not None or v_spec[0] == TURBO, n_kv=n_kv,
        page=page, first=first, end=end,
        kept=None if prefix.protected is None else (prefix.protected.k, prefix.protected.v),
        no_sinks=mx.zeros((_DUMMY,), dtype=mx.float32))


def _protected(inputs, dtype):
    """pk, pv: the protected tokens' copies (n_kv, NP, D) in `dtype`, or placeholders; made once per dtype."""
    kept = inputs.kept_as.get(dtype)
    if kept is None:
        kept = ([mx.zeros((_DUMMY,), dtype=dtype)] * 2 if inputs.kept is None
                else [a.astype(dtype) for a in inputs.kept])
        mx.eval(kept)
        inputs.kept_as[dtype] = kept
    return kept


def _launch(inputs, n_q, L, D, dtype, scale, tail_len, chunk_size, sinks):
    R = (n_q // inputs.n_kv) * L
    rows = next(r for r in ROW_VARIANTS if r >= R)
    per, n_splits = split_tokens(inputs.end - inputs.first, inputs.n_kv, 1, BN, TARGET_GROUPS)
    p1 = pass1_consts(dtype, inputs.k_spec, inputs.v_spec, D, rows, inputs.rk)[:-1] + (("SCALE", float(scale)),)
    fin = finish_consts(dtype, D)[:-1] + (("SCALE", float(scale)),)
    prm = np.zeros(N_PARAMS, dtype=np.int32)
    prm[:13] = [inputs.end, R, per, n_splits, tail_len, L, inputs.first, inputs.n_kv, inputs.page,
                0 if inputs.kept is None else inputs.kept[0].shape[1], sinks, inputs.v_back, chunk_size]
    prm = mx.array(prm)
    mx.eval(prm)
    return _Launch(_kernel("pass1", p1), _kernel("finish", fin), R, n_splits, prm)


def attend(inputs, prefix, queries, tail, scale, sinks, scratch):
    """Attention output (1, n_q_heads, L, head_dim) in the queries' dtype, or None where this is not decode.

    Args:
        inputs (MetalInputs): the layer's pages as the kernels take them. prefix (LayerPrefix): the same pages.
        queries (mx.array): (1, n_q_heads, L, head_dim), the last L tokens of the tail.
        tail (state.Tail): the cache's dense tail, chunks (1, n_kv, chunk_size, D).
        scale (float): softmax scale.
        sinks (mx.array | None): (n_q_heads,) sink logits (gpt-oss): one more logit per head, no value.
        scratch (state.Scratch): unused (the kernels write nothing in place).

    Returns:
        mx.array | None: None (the caller takes another path) for more than MAX_ROWS query rows per KV head,
        more than MAX_CHUNKS tail chunks, or an empty tail.
    """
    _, n_q, L, D = queries.shape
    n_chunks = tail.n_chunks
    if (n_q // inputs.n_kv) * L > MAX_ROWS or not 1 <= n_chunks <= MAX_CHUNKS or D not in HEAD_DIMS:
        return None
    key = (n_q, L, D, queries.dtype, scale, tail.length, tail.chunk_size, sinks is None)
    launch = inputs.launches.get(key)
    if launch is None:
        launch = inputs.launches[key] = _launch(inputs, n_q, L, D, queries.dtype, scale, tail.length,
                                                tail.chunk_size, sinks is not None)
    partial = (max(launch.n_splits * inputs.n_kv * launch.R, _DUMMY),)  # flat: a finish input, in device memory
    O, M, Lsum = launch.pass1(
        inputs=[queries, inputs.sgk, *inputs.k_in, *inputs.v_in, inputs.cbk, inputs.cbv, launch.prm],
        grid=(launch.n_splits * BN * 32, inputs.n_kv, 1), threadgroup=(BN * 32, 1, 1),
        output_shapes=[(launch.n_splits, inputs.n_kv, launch.R, D), partial, partial],
        output_dtypes=[mx.float32] * 3)
    k_chunks, v_chunks = tail.k_chunks[:n_chunks], tail.v_chunks[:n_chunks]
    pad = MAX_CHUNKS - n_chunks  # unread slots: the first chunk again (no copy)
    return launch.finish(
        inputs=[O, M, Lsum, queries, launch.prm, inputs.sgv,
                inputs.no_sinks if sinks is None else _padded(sinks), *_protected(inputs, queries.dtype),
                *k_chunks, *k_chunks[:1] * pad, *v_chunks, *v_chunks[:1] * pad],
        grid=(32, inputs.n_kv, launch.R), threadgroup=(32, 1, 1), output_shapes=[queries.shape],
        output_dtypes=[queries.dtype])[0]
