"""numpy references of the tiers' encode rules as spec/FORMAT.md section 6 states them.

The tests check that the codecs' stored bytes are exactly what these plain float64 rules give, so the
spec's text, not only MLX's behaviour, pins the format.
"""

import numpy as np

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])  # code 0..7; bit 3 is the sign
E4M3 = np.array([(m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                 for e in range(16) for m in range(8)])[:127]  # code 0..126; 0x7F is NaN, never written


def nearest_code(a, table):
    """Index of the nearest table value to each a >= 0; ties go to the even index."""
    d = np.abs(a[..., None] - table)
    best = d.min(-1, keepdims=True)
    idx = np.arange(len(table))
    tie_even = np.where((d == best) & (idx % 2 == 0), idx, len(table)).min(-1)
    return np.where(tie_even < len(table), tie_even, np.where(d == best, idx, len(table)).min(-1))


def unpack_elements(words, bits):
    """uint32 words (..., W) -> elements (..., W * 32 / bits), element i at bits bits*(i % per) of word i / per."""
    per = 32 // bits
    shifts = (np.arange(per) * bits).astype(np.uint32)
    out = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return out.reshape(*words.shape[:-1], -1)


def mx_reference(x, mode):
    """mxfp8 / mxfp4 (group 32): E8M0 scale byte 127 + clamp(ceil(log2(amax / emax)), -127, 127), 127 for
    an all-zero group; element = nearest E4M3 / E2M1 value of |x| / scale (saturating, ties to even
    code), sign bit set for x < 0 (E2M1: not for a zero code).

    Returns:
        tuple: element codes (..., D) and scale bytes (..., D/32), both int64.
    """
    table, emax, sign = (E2M1, 6.0, 8) if mode == "mxfp4" else (E4M3, 448.0, 128)
    g = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(g).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.clip(np.ceil(np.log2(amax / emax)), -127, 127), 0)
    code = nearest_code(np.minimum(np.abs(g) / 2.0 ** e, emax), table)
    neg = (g < 0) & ((code > 0) if mode == "mxfp4" else True)
    code = code | np.where(neg, sign, 0)
    return code.reshape(x.shape), (e[..., 0] + 127).astype(np.int64)


def nvfp4_reference(x, global_scale):
    """nvfp4 (group 16): scale byte = nearest E4M3 code of (amax / 6) * (448 * 6 / global_scale);
    element = nearest E2M1 of |x| * (448 * 6 / global_scale) / e4m3(scale byte), all zero if that
    scale is 0; sign bit as mxfp4.
    """
    g = x.astype(np.float64).reshape(*x.shape[:-1], -1, 16)
    enc = 448.0 * 6.0 / np.float64(np.float32(global_scale))
    s = nearest_code(np.minimum(np.abs(g).max(-1) / 6.0 * enc, 448.0), E4M3)
    sval = E4M3[s][..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(sval > 0, np.abs(g) * enc / sval, 0)
    code = nearest_code(np.minimum(a, 6.0), E2M1)
    code = code | np.where((g < 0) & (code > 0), 8, 0)
    return code.reshape(x.shape), s


def hadamard(n):
    """Sylvester Hadamard matrix H_n (entries +-1), n a power of two."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def turbo_reference(x, params):
    """TurboQuant-MSE codes and norms of x (n_kv, T, D) in float64: y = H diag(s) x / sqrt(D),
    u = y / |y|, idx = #{k : u > t_k}, norm = |y| (raw) or |y| / |C[idx]| (corrected).

    Returns:
        tuple: idx (n_kv, T, D) int64, norm (n_kv, T) float64, u (n_kv, T, D) float64.
    """
    d = x.shape[-1]
    s = np.asarray(params["signs"], dtype=np.float64)[:, None, :]
    y = (x.astype(np.float64) * s) @ hadamard(d).T / np.sqrt(d)
    n = np.linalg.norm(y, axis=-1, keepdims=True)
    u = np.where(n > 0, y / np.where(n > 0, n, 1), 0)
    c = np.asarray(params["codebook"], dtype=np.float64)
    t = (np.float32(c[1:]) + np.float32(c[:-1])) / np.float32(2)
    idx = (u[..., None] > t.astype(np.float64)).sum(-1)
    if params["norm"] == "corrected":
        n = n / np.linalg.norm(c[idx], axis=-1, keepdims=True)
    return idx, n[..., 0], u


def threshold_distance(u, codebook):
    """Distance of each u to the nearest decision threshold (float64)."""
    c = np.asarray(codebook, dtype=np.float32)
    t = ((c[1:] + c[:-1]) / np.float32(2)).astype(np.float64)
    return np.abs(u[..., None] - t).min(-1)
