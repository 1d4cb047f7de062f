"""Attention over a frozen compressed prefix plus a dense tail, one file per backend.

Every kernel returns a partial (o, m, l) per query row: o = sum_j exp(s_j - m) v_j, m = max_j s_j,
l = sum_j exp(s_j - m), so the prefix and tail parts merge exactly by log-sum-exp (`merge`).
"""

from .portable import merge, prefix_partial, tail_partial

__all__ = ["merge", "prefix_partial", "tail_partial"]
