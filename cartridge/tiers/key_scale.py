"""Per-channel K scaling folded into the query (issue 49 item 3; format 1.11, spec/FORMAT.md 4.5.6).

A score reads K only through q . k = (q * s) . (k / s) for any positive per-channel vector s, so a layer may store
k / s and attend with q * s: exact before quantization (SmoothQuant's migration, Xiao et al., arXiv:2211.10438,
section 4, with K in the role of the weights and the query in that of the activations). What changes is the
rounding: a channel whose keys are large and whose queries are small gets its range shrunk, and the reverse.
Under a rotation (+rot) the rounding error is about alike on every channel, so the expected squared score error
is about E|q * s|^2 E|k / s|^2 / 12 steps; by Cauchy-Schwarz it is least at s_c^2 = sqrt(E[k_c^2] / E[q_c^2]),
SmoothQuant's alpha = 1/2 on second moments, the choice here (`choose`), per (layer, KV head, channel) from the
document's own keys and queries (a GQA group's queries pooled). s is normalised to a geometric mean of 1 per head,
each channel within a factor MAX_SCALE of the median channel.

On disk: the K pages and protected copies of a scaled layer hold k / s; `layer.{i}.k.scale` holds s (float32);
its K `codec_version` is `SCALED_VERSION` (2), so that a reader before 1.11, which would read k / s as K, refuses
it. A reader multiplies the queries by s before any rotation or kernel (`CartridgeCache.attention`) and divides
the keys it appends by s; a decode to the model's own K multiplies by s (`attention.pages.decode_prefix`).
Per decode step that is one multiply of the queries (n_q_heads x head_dim) and one of the new keys per layer.
"""

import mlx.core as mx
import numpy as np

from ..errors import FieldError
from ..format import keys as K

SCALED_VERSION = 2  # K codec_version of a scaled side: version 1's encoding of K / s
BOUND = (2.0 ** -16, 2.0 ** 16)  # what a reader takes (spec 4.5.6): q * s and k / s stay far inside float16
MAX_SCALE = 16.0  # s within 16x of the median channel's: one no query reads (E[q_c^2] = 0) is not shrunk without bound


def choose(query_moment, keys):
    """The per-channel scale of one layer's K.

    Args:
        query_moment (np.ndarray): (n_kv_heads, head_dim, head_dim) float64 E[q q^T] of the document's queries
            per KV head (`cartridge.calibrate.queries`), post-RoPE like K.
        keys (np.ndarray): (n_kv_heads, T, head_dim) the layer's K as stored (post-RoPE).

    Returns:
        np.ndarray: (n_kv_heads, head_dim) float32 s > 0, geometric mean 1 per head, each channel's within a
        factor MAX_SCALE of the median channel's (a channel no query reads is shrunk that far, no further).
    """
    q2 = np.maximum(np.einsum("nii->ni", query_moment), 0.0)
    k2 = np.mean(np.square(keys.astype(np.float64)), axis=1)
    floor = 1e-12 * np.maximum(q2.max(axis=1, keepdims=True), k2.max(axis=1, keepdims=True)) + 1e-30
    log_s = 0.25 * (np.log(k2 + floor) - np.log(q2 + floor))
    log_s = np.clip(log_s - np.median(log_s, axis=1, keepdims=True), -np.log(MAX_SCALE), np.log(MAX_SCALE))
    return np.exp(log_s - log_s.mean(axis=1, keepdims=True)).astype(np.float32)


def scaled_moment(query_moment, scale):
    """E[(q * s)(q * s)^T] = diag(s) E[q q^T] diag(s): the second moment of the queries that read k / s.

    Args:
        query_moment (np.ndarray): (n_kv, D, D). scale (np.ndarray): (n_kv, D).
    """
    s = scale.astype(np.float64)
    return query_moment * s[:, :, None] * s[:, None, :]


def divided(x, scale):
    """K / s: x (n_kv_heads, T, head_dim) mx array, scale (n_kv_heads, head_dim) numpy float32 -> float32 mx array."""
    return x.astype(mx.float32) / mx.array(scale)[:, None, :]


def record(scale):
    """The `layer.{i}.k.scale` value: float32 little-endian (n_kv_heads, head_dim), row-major."""
    return np.ascontiguousarray(scale, dtype="<f4").tobytes()


def read(records, units, versions):
    """{layer path: (n_kv_heads, head_dim) float32 s} of the scaled layers, checked (spec 4.5.6).

    Args:
        records (dict[str, bytes]): the index. units (list): [(path, LayerInfo)] of the stored caches.
        versions (dict): path -> K codec_version as recorded.

    Raises:
        FieldError: a scale on a layer other than "attention", a scale without K codec_version 2 or the other
            way round, a record of the wrong length, or a value outside BOUND.
    """
    out = {}
    for path, info in units:
        key = K.layer_key_scale(path)
        raw, scaled = records.get(key), versions.get(path) == SCALED_VERSION
        if raw is None and not scaled:
            continue
        if info.kind != "attention":
            raise FieldError(f"layer {path} is a {info.kind} layer; only attention layers store K scaled ({key})")
        if raw is None or not scaled:
            raise FieldError(f"layer {path}: {key} and K codec_version {SCALED_VERSION} go together; found "
                             f"{'no ' if raw is None else ''}scale with codec_version {versions.get(path)}")
        n_kv, head_dim = info.shape("k")
        if len(raw) != 4 * n_kv * head_dim:
            raise FieldError(f"index key {key!r}: {len(raw)} bytes, expected {4 * n_kv * head_dim}")
        s = np.frombuffer(raw, dtype="<f4").reshape(n_kv, head_dim)
        if not (np.isfinite(s).all() and (s >= BOUND[0]).all() and (s <= BOUND[1]).all()):
            raise FieldError(f"index key {key!r}: every scale must be within [2^-16, 2^16]")
        out[path] = s.astype(np.float32)
    return out
