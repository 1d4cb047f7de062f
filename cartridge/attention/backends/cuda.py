"""The CUDA backend: the flash-decoding kernels of `cartridge.attention.kernels.cuda` over stored pages, and MLX's
own SDPA over one contiguous buffer for dense pages (`cartridge.attention.kernels.contiguous`; measured on an H200)."""

import mlx.core as mx

from ...tiers.layout import layout_of
from ..kernels import contiguous
from .base import AttentionBackend, on_gpu

# dense pages (an fp16/bf16 cartridge, "dequantize-once") through `contiguous.ContiguousAttention` rather than the
# flash-decoding kernel: MLX's SDPA over a contiguous buffer, at the cost of a second copy of the prefix (issue 34)
CONTIGUOUS_DENSE = True


class Cuda(AttentionBackend):
    """MLX's CUDA device and its fused kernels over the stored pages (every tier with a `kernel_layout`)."""

    name = "cuda"
    device = "cuda"
    policy = "fused"
    default_policy = "fused"

    def is_current(self):
        return on_gpu() and mx.cuda.is_available()

    def available(self):
        return self.is_current()

    def reads(self, codecs):
        return all(layout_of(c) is not None for c in codecs)

    def supports(self, prefix, head_dim, mode):
        from ..kernels import cuda  # (it builds CUDA arrays at import)

        if CONTIGUOUS_DENSE and contiguous.reads(prefix):
            return True
        return cuda.supported(prefix, head_dim)  # prefill too: the kernel hands long ones to MLX's SDPA itself

    def build(self, prefix):
        if CONTIGUOUS_DENSE and contiguous.reads(prefix):
            return contiguous.ContiguousAttention(prefix)
        from ..kernels import cuda

        return cuda.FusedAttention(prefix)


CUDA = Cuda()
