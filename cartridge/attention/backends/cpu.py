"""The CPU device: portable and dense paths for decode steps (K codes unpacked to bytes under a budget:
`cartridge.attention.unpacked`); a question's prefill over the pages decoded for that call
(`cartridge.attention.kernels.cpu.question_prefill`; extend's prefill: `kernels.cpu.attention`)."""

import mlx.core as mx

from ..kernels import cpu
from .base import AttentionBackend


class Cpu(AttentionBackend):
    """MLX's CPU device; no fused decode kernel. Where unmeasured, `auto` decodes once: BLAS matmuls over dense
    pages are several times faster than MLX's scalar CPU dequantization (docs/performance.md "Memory on CPU").
    A question's prefill (mode "prefill") decodes each layer's pages for the call and attends with BLAS."""

    name = "cpu"
    device = "cpu"
    default_policy = "dequantize-once"

    def is_current(self):
        return mx.default_device() == mx.cpu

    def available(self):
        return self.is_current()

    def supports(self, prefix, head_dim, mode):
        return mode == "prefill" and self.is_current()

    def build(self, prefix):
        return cpu.QuestionPrefill()

    def attend(self, record, prefix, queries, tail, scale, sinks, scratch):
        return cpu.question_prefill(prefix, queries, tail, scale, sinks)


CPU = Cpu()
