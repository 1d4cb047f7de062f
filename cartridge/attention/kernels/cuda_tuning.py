"""The CUDA kernels' tuning constants: launch shapes and the query-row crossovers between paths, in one record.

Every value was chosen by measurement on an H100 or H200; docs/performance.md "CUDA tuning constants" gives each
one's measurement and the result file under benchmarks/results/. The kernels read the record a layer was laid out with (`CudaInputs.tuning`,
`TUNING` unless a test or benchmark passes another: `dataclasses.replace(TUNING, ...)`).
"""

from dataclasses import dataclass, field

from ...tiers.layout import AFF4, BF16, FP16, KIVI4, MXFP4, NVFP4, TURBO


@dataclass(frozen=True)
class CudaTuning:
    """Launch shapes and crossovers of `kernels.cuda`, `cuda_prefill`, `cuda_decode` and the contiguous path.

    Attributes:
        target_blocks (int): plain pass-1 blocks to aim for (132 SMs x 4).
        warps (int): warps per plain pass-1 block (a single launch needs 4: 128 threads).
        unroll (int): tokens each lane fetches at once in the plain pass 1.
        decode_epl (int): head_dim elements per lane when a plain pass-1 block holds at most 4 query rows.
        single_max_rows (int): query rows per KV head that pass 1's last block finishes alone (one launch);
            0: every call takes two launches.
        single_max_tail (int): tail tokens that last block attends alone; a longer tail takes two launches.
        mma_target_blocks, mma_target_blocks_d64 (int): `flash_pass1_mma` blocks at head_dim 128 / 64.
        mma_stages (int): 16-token tiles in flight per warp in `flash_pass1_mma` (cp.async pipeline depth).
        mma_warps (int): warps per `flash_pass1_mma` block.
        tc_target_blocks, tc_target_blocks_d64 (int): `flash_pass1_tc` blocks at head_dim 128 / 64.
        tc_stages (int): 16-token tiles in flight per warp in `flash_pass1_tc`.
        tc_warps (int): warps per `flash_pass1_tc` block; tc_warps_turbo (int): the same with a TurboQuant V.
        register_lookup (frozenset): kernel tier ids whose codes `flash_pass1_tc` looks up in registers rather than
            in a shared-memory table of code pairs.
        dense_min_rows (dict): K's kernel tier id -> query rows per KV head from which a question decodes the pages
            by MLX ops for MLX's SDPA instead of the kernel; dense_min_rows_other (int): for the other tiers.
        decoded_min_rows (int): the same where `cuda_decode` decodes both sides (one kernel instead of MLX ops).
        decode_warps (int): 16-token tiles per `decode_tiles` block (`cuda_decode`).
        prefill_warps (int): warps per `prefill_tc` block (16 query rows each; `cuda_prefill`).
        prefill_target_blocks (int): `prefill_tc` blocks over splits x KV heads x row blocks (132 SMs x 2).
        prefill_min_rows, prefill_max_rows (int): the query rows per KV head `prefill_tc` answers; up to
            prefill_max_rows_wide for the unrotated (tier id, bits) in prefill_wide.
        prefill_dense_rows (dict): kernel tier id of unrotated dense K pages -> (fewest, most) rows `prefill_tc`
            answers for them.
        question_rows (tuple): (fewest, most) query rows per KV head of an fp16 cartridge's question answered over
            its pages rather than from the contiguous buffer (`cartridge.attention.contiguous`).
    """

    target_blocks: int = 528
    warps: int = 4
    unroll: int = 4
    decode_epl: int = 8
    single_max_rows: int = 8
    single_max_tail: int = 64
    mma_target_blocks: int = 264
    mma_target_blocks_d64: int = 528
    mma_stages: int = 3
    mma_warps: int = 4
    tc_target_blocks: int = 264
    tc_target_blocks_d64: int = 528
    tc_stages: int = 3
    tc_warps: int = 4
    tc_warps_turbo: int = 8
    register_lookup: frozenset = frozenset((MXFP4, NVFP4))
    dense_min_rows: dict = field(default_factory=lambda: {FP16: 256, BF16: 256, AFF4: 256, TURBO: 512, KIVI4: 1 << 30})
    dense_min_rows_other: int = 512
    decoded_min_rows: int = 256
    decode_warps: int = 4
    prefill_warps: int = 8
    prefill_target_blocks: int = 264
    prefill_min_rows: int = 128
    prefill_max_rows: int = 255
    prefill_max_rows_wide: int = 256
    prefill_wide: frozenset = frozenset(((AFF4, 0), (TURBO, 3)))
    prefill_dense_rows: dict = field(default_factory=lambda: {FP16: (16, 384)})
    question_rows: tuple = (8, 384)


TUNING = CudaTuning()  # the values in use
