"""One layer's pages as the CUDA kernels take them (`CudaInputs`), laid out once at load by `lay_out`.

Each side's stored components padded to three arrays, its 16 floats (TurboQuant's codebook, nvfp4's global
factor), its signs (TurboQuant's, or a rotated tier's rotation), the range of stored tokens pass 1 reads
(protected tokens, format 1.5, are read from their fp16 copies by the finish) and the tuning the layer's calls
run with. `kernels.cuda` reads the record; nothing here launches a kernel.
"""

from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx
import numpy as np

from ...tiers.layout import AFF4, F32, NVFP4, TURBO, layout_of
from ...tiers.rotation import sign_bits
from . import cuda_tuning


def zeros(shape, dtype=np.float32):
    """A zero array with its data (not a lazy `mx.zeros`): MLX 0.32 evaluates a lazy array on the stream of the
    thread that made it, so one made at load and first evaluated on a server's worker thread raised 'There is no
    Stream(gpu, 0) in current thread' (tests/attention/test_generate_loop.py on an H200, mlx4g32+rot)."""
    return mx.array(np.zeros(shape, dtype=dtype))


def tier_spec(codec, parts):
    """(kernel tier id, bits, component names) of a stored side from its codec's `kernel_layout`
    (`cartridge.tiers.layout.layout_of`), or None if no fused kernel reads it. A rotated tier (`mlx4g32+rot`)
    is read as its base tier; `rotation` gives its rotation."""
    found = layout_of(codec, parts)
    return None if found is None else (found.tier_id, found.bits, found.components)


def rotation(codec, params):
    """The rotation record of a +rot side ({"kind", "block", "seed"}, spec/FORMAT.md 6.4), else None."""
    return params.get("rotation") if hasattr(codec, "base") else None


def table_ok(spec, params):
    """False for a TurboQuant codebook that is not symmetric in fp16: flash_pass1_tc looks up magnitudes and
    takes the sign from the code (`tc_table`); the codebooks cartridge builds are symmetric by construction."""
    if spec is None or spec[0] != TURBO:
        return True
    cb = np.asarray(params["codebook"], dtype=np.float16)
    return bool(np.array_equal(cb, -cb[::-1]))


def side_inputs(spec, parts, params, rot=None):
    """Component arrays padded to three, codebook padded to 16 floats, and signs (n_kv, D) or a dummy: a
    TurboQuant side's, or a rotated side's (the rotation's signs, the same for every KV head)."""
    tid, _, names = spec
    arrays = [parts[n] for n in names] + [zeros((4,), np.uint32)] * (3 - len(names))
    if rot is not None:
        n_kv, D = arrays[0].shape[1], rot["block"]
        signs = mx.array(np.tile(sign_bits(rot["seed"], D), (n_kv, 1)))  # (n_kv, D)
        _, cb, _ = side_inputs(spec, parts, params)
        return arrays, cb, signs
    if tid == NVFP4:  # cb[0]: the global factor global_scale / (448 * 6), times the 2^8 the kernel's fp16 scales lack
        cb = np.zeros(16, dtype=np.float32)
        cb[0] = params["global_scale"] / (448.0 * 6.0) * 256.0
        return arrays, mx.array(cb), zeros((1,))
    if tid == TURBO:
        cb = np.zeros(16, dtype=np.float32)
        cb[: len(params["codebook"])] = params["codebook"]
        signs = mx.array(np.asarray(params["signs"], dtype=np.float32))  # (n_kv, D)
        return arrays, mx.array(cb), signs
    return arrays, zeros((16,)), zeros((1,))


@dataclass(frozen=True, eq=False)
class CudaInputs:
    """The CUDA backend's record of one layer (`LayerPrefix.backend`): its pages as the kernels take them.

    Attributes:
        k_spec, v_spec (tuple): (kernel tier id, bits, component names) of each side (`tier_spec`).
        k_in, v_in (list[mx.array]): each side's components (n_pages, n_kv_heads, page, width), padded to three.
        cbk, cbv (mx.array): float32 (16,): each side's codebook (TurboQuant) or global factor (nvfp4, in [0]).
        sgk, sgv (mx.array): float32 signs (n_kv_heads, head_dim) of a TurboQuant or rotated side, else (1,).
        k_rot, v_rot (bool): the side is a +rot tier. n_kv (int): KV heads. page (int): tokens per page.
        first, end (int): the stored tokens pass 1 reads, first .. end - 1 (the others are protected copies);
            start (int): `first` rounded down to 16 (pass 1 starts there).
        kept (tuple | None): the protected tokens' fp16 copies (K, V), each (n_kv_heads, N + M, head_dim).
        mma (bool): both sides mlx4g32 in whole 16-token tiles (`flash_pass1_mma` reads them).
        table_ok (bool): TurboQuant codebooks symmetric in fp16 (`table_ok`).
        tc_reads (bool): no float32 side (`flash_pass1_tc` reads none).
        v_back (bool): the finish rotates the prefix output back from V's stored basis.
        no_sinks (mx.array): float32 (1,), the finish's sinks input when the model has none.
        tuning (CudaTuning): the launch shapes and crossovers the layer's calls use.
        routes, rows, kept_as (dict): memos of what depends only on a call's shape (`kernels.cuda`): `route`'s
            answer by shape, parameter rows by launch, the protected copies by dtype.
    """

    name: ClassVar[str] = "cuda"
    k_spec: tuple
    v_spec: tuple
    k_in: list
    v_in: list
    cbk: object
    cbv: object
    sgk: object
    sgv: object
    k_rot: bool
    v_rot: bool
    n_kv: int
    page: int
    first: int
    end: int
    start: int
    kept: tuple
    mma: bool
    table_ok: bool
    tc_reads: bool
    v_back: bool
    no_sinks: object
    tuning: object
    routes: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)
    kept_as: dict = field(default_factory=dict)


def lay_out(prefix, tuning=None):
    """The `CudaInputs` of a layer.

    Args:
        prefix (LayerPrefix): the layer's pages (tiers with a `kernel_layout`, or dense pages).
        tuning (CudaTuning | None): the launch shapes and crossovers; None: `cuda_tuning.TUNING`. Default: None.

    Returns:
        CudaInputs: its arrays hold their data (made at load, read from any thread).
    """
    k_spec = tier_spec(prefix.k_codec, prefix.k_parts)
    v_spec = tier_spec(prefix.v_codec, prefix.v_parts)
    k_rot, v_rot = rotation(prefix.k_codec, prefix.k_params), rotation(prefix.v_codec, prefix.v_params)
    k_in, cbk, sgk = side_inputs(k_spec, prefix.k_parts, prefix.k_params, k_rot)
    v_in, cbv, sgv = side_inputs(v_spec, prefix.v_parts, prefix.v_params, v_rot)
    _, n_kv, page, _ = k_in[0].shape
    # stored tokens first .. end - 1 are read from the pages; protected tokens (format 1.5) from their fp16 copies,
    # by the finish (so a protected layer takes two launches); pass 1 starts at a multiple of 16
    first, end = (0, prefix.n_tokens) if prefix.protected is None else prefix.protected.page_range(prefix.n_tokens)
    kept = None if prefix.protected is None else (prefix.protected.k, prefix.protected.v)
    return CudaInputs(
        k_spec=k_spec, v_spec=v_spec, k_in=k_in, v_in=v_in, cbk=cbk, cbv=cbv, sgk=sgk, sgv=sgv,
        k_rot=k_rot is not None, v_rot=v_rot is not None, n_kv=n_kv, page=page, first=first, end=end,
        start=first // 16 * 16, kept=kept, mma=k_spec[0] == AFF4 and v_spec[0] == AFF4 and page % 16 == 0,
        table_ok=table_ok(k_spec, prefix.k_params) and table_ok(v_spec, prefix.v_params),
        tc_reads=F32 not in (k_spec[0], v_spec[0]), v_back=v_spec[0] == TURBO or v_rot is not None,
        no_sinks=zeros((1,)), tuning=cuda_tuning.TUNING if tuning is None else tuning)
