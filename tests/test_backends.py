"""The attention-backend seam: kernel layouts declared by the codecs, the backend registry, the proof gate."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx

from cartridge.attention.policy import DEQUANTIZED
from cartridge.tiers import TIERS, layout as L


def test_every_codec_declares_the_kernel_layout_the_cuda_kernels_read():
    """The ids, bits and component order are the ones flash_decode.cuh's tiers take (kernels/cuda.py's former
    FUSED_TIERS table); a rotated tier reads as its base."""
    want = {"fp16": (L.FP16, 0, ("values",)), "bf16": (L.BF16, 0, ("values",)),
            "int8": (L.AFF8, 0, L.AFFINE), "int6": (L.AFF6, 0, L.AFFINE), "mlx4g32": (L.AFF4, 0, L.AFFINE),
            "fp8": (L.MXFP8, 0, ("codes", "scales")), "turbo4": (L.TURBO, 4, ("codes", "norms")),
            "turbo3": (L.TURBO, 3, ("codes", "norms")), "turbo2": (L.TURBO, 2, ("codes", "norms")),
            "mxfp4": (L.MXFP4, 0, ("codes", "scales")), "nvfp4": (L.NVFP4, 0, ("codes", "scales")),
            "kivi4": (L.KIVI4, 0, L.AFFINE)}
    got = {name: L.layout_of(codec) for name, codec in TIERS.items()}
    for name, layout in got.items():
        base = name.removesuffix("+rot")
        assert (layout.tier_id, layout.bits, layout.components) == want[base], name
        assert set(layout.components) <= {c.name for c in TIERS[name].components(64)}, name
    assert all(TIERS[n].kernel_layout is None for n in TIERS if n.endswith("+rot"))  # only through .base
    assert (L.FP16, L.KIVI4) == (0, 10)


def test_dense_pages_take_their_dtypes_layout_and_none_without_pages():
    assert L.layout_of(DEQUANTIZED) is None
    for dtype, tid in ((mx.float16, L.FP16), (mx.bfloat16, L.BF16), (mx.float32, L.F32)):
        assert L.layout_of(DEQUANTIZED, {"values": mx.zeros((1, 1, 16, 64), dtype=dtype)}).tier_id == tid
    assert L.layout_of(DEQUANTIZED, {"values": mx.zeros((1,), dtype=mx.int8)}) is None
