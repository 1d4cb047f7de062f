"""The two documents and the question the composed-cartridge tests build and ask (tests/compose/test_compose.py,
test_compose_blend.py), and the last position's logits of a forward pass."""

import mlx.core as mx
import numpy as np

DOC_A = "Section 1. The lessee may terminate the agreement with 30 days of written notice. " * 3
DOC_B = "Annex B. Rent is due on the first day of each month, payable by bank transfer to the lessor. " * 2
Q = "When is rent due?"


def _logits(model, ids, cache):
    return np.array(model(mx.array(ids)[None], cache=cache)[0, -1])
