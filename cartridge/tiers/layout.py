"""Kernel layouts: how a tier's stored pages look to an attention kernel, declared once per codec.

Every backend's fused kernel (`cartridge.attention.kernels.cuda`, `.metal`) identifies a tier by the same
small integer id and reads its components in the same order, so a codec states them here once, as its
`kernel_layout` class attribute (None: no kernel reads the tier). A rotated tier (`mlx4g32+rot`) has no
layout of its own: kernels read it as its `.base` codec's layout plus the rotation record (`layout_of`).
Dense pages made at load (the "dequantize-once" policy's codec, `dense_pages = True`) take the layout
of their dtype (`DENSE_LAYOUTS`).
"""

from dataclasses import dataclass

import mlx.core as mx

# kernel tier ids, shared by every backend's kernels (flash_decode.cuh's `tier` template argument)
FP16, BF16, F32, AFF8, AFF4, MXFP8, TURBO, MXFP4, NVFP4, AFF6, KIVI4 = range(11)


@dataclass(frozen=True)
class KernelLayout:
    """How one tier's stored side is handed to a kernel.

    Attributes:
        tier_id (int): the kernel tier id (module constants FP16 .. KIVI4).
        bits (int): bits per code where the kernel needs it (TurboQuant: 4, 3 or 2), else 0.
        components (tuple[str, ...]): the stored component names in kernel order, e.g.
            ("codes", "scales", "biases").
    """

    tier_id: int
    bits: int
    components: tuple


VALUES = ("values",)
AFFINE = ("codes", "scales", "biases")
DENSE_LAYOUTS = {mx.float16: KernelLayout(FP16, 0, VALUES), mx.bfloat16: KernelLayout(BF16, 0, VALUES),
                 mx.float32: KernelLayout(F32, 0, VALUES)}


def base_codec(codec):
    """The codec whose codes a kernel reads: a rotated tier's `.base`, else `codec` itself."""
    return getattr(codec, "base", codec)


def layout_of(codec, parts=None):
    """The kernel layout of a stored side, or None if no kernel reads it.

    Args:
        codec (TierCodec): the side's codec (a rotated tier is read as its base; `rotation.RotatedCodec`).
        parts (dict | None): the side's arrays; needed for dense pages (`dense_pages` codecs), whose
            layout is their dtype's (`DENSE_LAYOUTS`). Default: None (dense pages then have no layout).

    Returns:
        KernelLayout | None
    """
    if getattr(codec, "dense_pages", False):
        return None if parts is None else DENSE_LAYOUTS.get(parts["values"].dtype)
    return getattr(base_codec(codec), "kernel_layout", None)
