"""Lloyd–Max scalar codebooks for one coordinate of a uniformly random unit vector (TurboQuant-MSE).

A coordinate X of a uniform point on the sphere S^{d-1} has the density (Zandieh et al., TurboQuant,
arXiv 2504.19874, Lemma 1; shared/reference/kv-quant-algorithms.md section 1.2)

    f_d(x) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) * (1 - x^2)^((d-3)/2),   x in [-1, 1].

The b-bit codebook c_1 < ... < c_{2^b} minimizes E|X - c(X)|^2 (continuous 1-D k-means, Eq. 4). It is
found here by Lloyd's iteration on a fine grid: decision thresholds are the midpoints of adjacent
centroids, and each centroid is the conditional mean of its cell. The builder computes it once per
(d, b) and stores the 2^b values in the header, so readers never recompute it.
"""

from functools import lru_cache

import numpy as np

GRID_POINTS = 1 << 18  # cells on [-1, 1]: the grid error is far below float32 rounding of the result
MAX_ITERATIONS = 20000
TOLERANCE = 1e-12


def _cumulative(d):
    """Grid x on [-1, 1] and the running integrals F(x) = int f, G(x) = int t f(t) dt (unnormalized)."""
    x = np.linspace(-1.0, 1.0, GRID_POINTS + 1)
    f = np.power(np.clip(1.0 - x * x, 0.0, None), (d - 3) / 2.0)
    h = x[1] - x[0]
    # trapezoid rule, cumulated: (n,) each
    F = np.concatenate([[0.0], np.cumsum((f[1:] + f[:-1]) * h / 2)])
    g = x * f
    G = np.concatenate([[0.0], np.cumsum((g[1:] + g[:-1]) * h / 2)])
    return x, F / F[-1], G / F[-1]


@lru_cache(maxsize=None)
def lloyd_max(d, bits):
    """The b-bit Lloyd–Max codebook for one coordinate of a uniform unit vector in R^d.

    Args:
        d (int): the dimension (head_dim), >= 3.
        bits (int): bits per coordinate, 1..8.

    Returns:
        tuple[float, ...]: 2^bits increasing centroids in (-1, 1), symmetric about 0, each rounded to
        float32. (Scaled by sqrt(d), d = 64: b = 2 -> +-0.4521, +-1.5000; the reference's table.)
    """
    x, F, G = _cumulative(d)
    k = 1 << bits
    # start from equal-probability cells: their conditional means
    edges = np.interp(np.linspace(0, 1, k + 1), F, x)
    c = _means(edges, x, F, G)
    for _ in range(MAX_ITERATIONS):
        edges = np.concatenate([[-1.0], (c[1:] + c[:-1]) / 2, [1.0]])
        new = _means(edges, x, F, G)
        done = np.max(np.abs(new - c)) < TOLERANCE
        c = new
        if done:
            break
    c = (c - c[::-1]) / 2  # exact symmetry (the density is even)
    return tuple(float(v) for v in c.astype(np.float32))


def _means(edges, x, F, G):
    """Conditional mean of X in each cell [edges[i], edges[i+1]]."""
    f_at = np.interp(edges, x, F)
    g_at = np.interp(edges, x, G)
    return np.diff(g_at) / np.diff(f_at)


def thresholds(codebook):
    """Decision thresholds: midpoints of adjacent centroids, float32, shape (2^b - 1,)."""
    c = np.asarray(codebook, dtype=np.float32)
    return (c[1:] + c[:-1]) / np.float32(2)


def mse(codebook, d):
    """E|X - c(X)|^2 for X ~ f_d under nearest-centroid coding (the distortion d*C of the reference)."""
    x, F, _ = _cumulative(d)
    c = np.asarray(codebook, dtype=np.float64)
    idx = np.searchsorted(thresholds(codebook).astype(np.float64), x)
    err = (x - c[idx]) ** 2
    dens = np.diff(F)
    return float(np.sum((err[1:] + err[:-1]) / 2 * dens))
