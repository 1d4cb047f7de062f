"""Score-aware encoding of K: codes chosen for the scores the queries will compute, not for K itself (issue 49).

Attention reads K only through the scores q . k, so what a K code costs is the score error q . (k - k_hat), whose
expected square over the queries is (k - k_hat)^T H (k - k_hat) with H = E[q q^T], the queries' second moment
per KV head (GQA: the group's query heads together). A builder knows H: the document's own queries went through
every layer at prefill (`cartridge.calibrate.queries`). Nearest rounding minimises |k - k_hat|^2, right for
H = I only; here each token's head_dim coordinates are rounded one at a time and each one's rounding error is
pushed onto the coordinates not yet rounded, weighted by H: GPTQ's error feedback (Frantar et al.,
arXiv:2210.17323, Algorithm 1, one row of a weight matrix there being one token's K vector here; OBQ's
update with the Cholesky factor of H^-1, damped by 1% of H's mean diagonal as GPTQ does). A group's scale and
bias (or MX/NV scale, or kivi4's per-channel range, or TurboQuant's norm) are chosen as the tier chooses them,
from the group's own values (a value the feedback moves out of the range is clipped); TurboQuant's per-token
norm is then fitted to the codes under H.

The stored format is the tier's own: codes, scales and biases read, decode and attend like any other of the
tier, with every kernel. Only the choice differs.

How an encode learns H: the builder holds `weighting(weights)` around the encode (`cartridge.build`); a codec's
`make_params(x, layer, side)` passes its params through `bind`, which returns them carrying that (layer, side)'s
H when there is one (`Weighted`, a dict: the header stores the same params as without), and `encode` takes it
back with `weight_of`. Without a weighting nothing changes. V is encoded the same way under W_o's Gram (the output
error its rounding causes, `cartridge.calibrate.outputs`) where the weighting holds one for it.
"""

from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import numpy as np

from . import key_scale

DAMPING = 0.01  # GPTQ's default: H + 1% of its mean diagonal on the diagonal
FEEDBACK_BLOCK = 32  # columns whose feedback is applied one at a time before one product updates the rest

_WEIGHTS = ContextVar("score_aware_weights", default=None)


class Weighted(dict):
    """A tier's params (the dict the header stores) with `weight`: (n_kv_heads, head_dim, head_dim) float64,
    the second moment of the queries in the basis the codes are chosen in."""

    weight = None


@contextmanager
def weighting(weights, key_scales=None):
    """Encode K (and V) score-aware inside the block, and K scaled per channel where `key_scales` says.

    Args:
        weights (dict | None): (layer, side) -> (n_kv_heads, head_dim, head_dim) float64 numpy weight: for K the
            queries' second moment (`cartridge.calibrate.queries.QueryMoments.weights`), for V W_o's Gram
            (`cartridge.calibrate.outputs.output_weights`); None or absent: nearest rounding.
        key_scales (dict | None): layer -> (n_kv_heads, head_dim) float32 s: that layer's K is encoded as K / s
            (`cartridge.tiers.key_scale`; the caller divides, `scale_of` tells it), its K weight taken to
            diag(s) H diag(s). Default: None.
    """
    token = _WEIGHTS.set((weights or {}, key_scales or {}) if weights or key_scales else None)
    try:
        yield
    finally:
        _WEIGHTS.reset(token)


def scale_of(layer, side):
    """The (n_kv_heads, head_dim) float32 scale a `weighting` holds for (layer, side) (K only), or None."""
    held = _WEIGHTS.get()
    return None if held is None or side != "k" else held[1].get(layer)


def bind(params, x, layer, side):
    """`params` carrying the weight of (layer, side) when a `weighting` holds one of x's shape, else `params`.

    Args:
        params (dict): a tier's params from its `make_params`. x (mx.array): (n_kv_heads, T, head_dim), the side.
        layer (int | str), side (str): where it goes.

    Returns:
        dict: `params` itself, or a `Weighted` copy of it.
    """
    held = _WEIGHTS.get()
    w = None if held is None else held[0].get((layer, side))
    if w is None or w.shape != (x.shape[0], x.shape[-1], x.shape[-1]):
        return params
    s = scale_of(layer, side)
    return with_weight(params, w if s is None else key_scale.scaled_moment(w, s))


def with_weight(params, weight):
    """A `Weighted` copy of `params` carrying `weight`."""
    out = Weighted(params)
    out.weight = weight
    return out


def weight_of(params):
    """The weight `bind` attached to params, or None."""
    return getattr(params, "weight", None)


def rotated_weight(params, rotate):
    """params with its weight taken into a rotated basis: R H R^T, `rotate(m)` computing m R^T on the last axis
    of an mx array (a rotated tier's rotation); params unchanged without a weight."""
    w = weight_of(params)
    if w is None:
        return params
    m = rotate(mx.array(w.astype(np.float32)))  # H R^T
    m = rotate(m.swapaxes(-1, -2))  # (H R^T)^T R^T = R H R^T (H symmetric)
    return with_weight(params, np.array(m).astype(np.float64))


def feedback_factor(weight, damping=None):
    """U (n_kv, D, D) float32: the upper Cholesky factor of (H + damping * mean diag(H) * I)^-1 per head (GPTQ).

    damping (float | None): default DAMPING. A head whose H is zero (no query seen) gets the identity: nearest
    rounding.
    """
    damping = DAMPING if damping is None else damping
    n, d, _ = weight.shape
    h = weight.astype(np.float64).copy()
    mean_diag = np.einsum("nii->n", h) / d
    h[mean_diag <= 0] = np.eye(d)
    h += (damping * np.where(mean_diag > 0, mean_diag, 1.0))[:, None, None] * np.eye(d)
    # U from one Cholesky factorisation, without an inverse of H: with J the reversal, J H J = L L^T gives
    # H = R R^T, R = J L J upper triangular, so H^-1 = (R^-1)^T R^-1 and U = R^-1 (the factor is unique).
    # MLX's, not numpy's: numpy's threaded LAPACK took 40-400 ms of CPU for one 256 x 256 factor on the busy
    # 2-core machine, MLX's 0.6 ms (the same U within 2e-7).
    lower = mx.linalg.cholesky(mx.array(h[:, ::-1, ::-1].astype(np.float32)), stream=mx.cpu)
    return np.array(mx.linalg.tri_inv(lower[:, ::-1, ::-1], upper=True, stream=mx.cpu))


def feedback_round(x, weight, grid):
    """Round x coordinate by coordinate with GPTQ's error feedback under `weight` (module docstring).

    Args:
        x (np.ndarray): (n_kv, T, D) float32, in the basis the codes are chosen in.
        weight (np.ndarray): (n_kv, D, D) float64, the queries' second moment in that basis.
        grid: the tier's grid: `group` (columns sharing a grid), `start(block)` -> state for a block
            (n_kv, T, group) of x, `nearest(column, state, i)` -> (values, codes) of column i of the group, each
            (n_kv, T). A group's grid is chosen from x's own values, not from the values the feedback moved:
            a grid widened to cover them cost more than clipping them (KL 0.0054 against 0.0036 nats for
            mlx4g32+rot K on samples/lgpl-3.0.txt, as the first prototype on branch `fidelity` measured it).

    Returns:
        tuple: (codes (n_kv, T, D) uint32, values (n_kv, T, D) float32, states: one per group, in order).
    """
    n_kv, t, d = x.shape
    # The products are np.einsum's own loops, not matmul's BLAS call: numpy's OpenBLAS threads made a round of
    # 2,048 tokens x 256 take 120 ms of CPU against 22 ms on the busy 2-core machine (the same codes).
    u = feedback_factor(weight)
    w = np.ascontiguousarray(np.swapaxes(x, 1, 2), dtype=np.float32)  # (n_kv, D, T): each coordinate contiguous
    codes = np.zeros((n_kv, d, t), dtype=np.uint32)
    values = np.zeros((n_kv, d, t), dtype=np.float32)
    states, state = [], None
    block = FEEDBACK_BLOCK if d % FEEDBACK_BLOCK == 0 else d  # any block gives the same feedback (GPTQ's lazy batch)
    for a in range(0, d, block):
        b = min(a + block, d)
        errors = np.zeros((n_kv, b - a, t), dtype=np.float32)
        for j in range(a, b):
            if (j % grid.group) == 0:
                state = grid.start(x[..., j:j + grid.group])
                states.append(state)
            if j > a:  # the block's earlier errors onto this coordinate: (n_kv, j - a) . (n_kv, j - a, T)
                w[:, j] -= np.einsum("nb,nbt->nt", u[:, a:j, j], errors[:, :j - a])
            values[:, j], codes[:, j] = grid.nearest(w[:, j], state, j % grid.group)
            errors[:, j - a] = (w[:, j] - values[:, j]) / u[:, j, j, None]  # (n_kv, T)
        if b < d:  # the block's errors onto every later coordinate at once: (n_kv, B, D - b) x (n_kv, B, T)
            w[:, b:] -= np.einsum("nbd,nbt->ndt", u[:, a:b, b:], errors)
    return np.swapaxes(codes, 1, 2), np.swapaxes(values, 1, 2), states


def score_error(x, x_hat, weight):
    """Mean expected squared score error per token, mean over heads of (x - x_hat)^T H (x - x_hat).

    Args:
        x, x_hat (np.ndarray): (n_kv, T, D). weight (np.ndarray): (n_kv, D, D).

    Returns:
        float
    """
    e = np.asarray(x, dtype=np.float64) - np.asarray(x_hat, dtype=np.float64)
    return float(np.einsum("ntd,nde,nte->", e, weight, e) / (e.shape[0] * e.shape[1]))
