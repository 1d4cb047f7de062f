"""The CUDA backend: the flash-decoding kernels of `cartridge.attention.kernels.cuda` over stored pages, and MLX's
own SDPA over one contiguous buffer for dense pages (`cartridge.attention.contiguous`: faster, at the cost of a second
copy of the prefix, docs/performance.md "Dense pages")."""

import mlx.core as mx

from ...tiers.layout import layout_of
from .. import contiguous
from ..kernels import cuda, cuda_inputs
from .base import AttentionBackend, on_gpu


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
        # prefill too: the kernels hand long questions to MLX's SDPA themselves
        return contiguous.reads(prefix) or cuda.supported(prefix, head_dim)

    def build(self, prefix):
        """A `contiguous.Contiguous` record for dense pages, else the kernels' `CudaInputs`."""
        return contiguous.lay_out(prefix) if contiguous.reads(prefix) else cuda_inputs.lay_out(prefix)

    def attend(self, record, prefix, queries, tail, scale, sinks, scratch):
        if isinstance(record, contiguous.Contiguous):
            return contiguous.attend(record, prefix, queries, tail, scale, sinks, scratch)
        return cuda.attend(record, prefix, queries, tail, scale, sinks, scratch)


CUDA = Cuda()
