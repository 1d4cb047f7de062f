"""Attention policies: how decode steps read the prefix pages (issue 4; docs/performance.md "Attention paths").

- "portable": MLX ops over the stored pages (`kernels/portable.py`); CPU, Metal and CUDA.
- "fused": one flash-decoding kernel per backend reading the stored pages (`kernels/cuda.py`); CUDA.
- "dequantize-once": decode the prefix into dense pages of the model's dtype at load (more memory,
  no per-step decode work), then attend with the backend's dense path.
- "auto": per backend, the policy measured fastest (`AUTO`, from `cartridge bench` runs).
"""

import mlx.core as mx

from ..errors import InputError
from ..tiers import protect
from ..tiers.float16 import Float16Codec
from .cache import LayerPrefix

POLICIES = ("auto", "fused", "portable", "dequantize-once")
# Measured with `cartridge bench` (docs/performance.md "Attention paths"): the fastest policy per backend.
AUTO = {"cpu": "dequantize-once", "cuda": "fused", "metal": "portable"}


def backend():
    """"cpu", "cuda" or "metal": where the default device runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


class DequantizedCodec(Float16Codec):
    """Dense pages in the model's dtype, made once at load by the "dequantize-once" policy."""

    name = "dequantized"


DEQUANTIZED = DequantizedCodec()


def resolve(policy):
    """The concrete policy for this backend.

    Raises:
        InputError: unknown policy, or "fused" where no fused kernel exists for the backend.
    """
    if policy not in POLICIES:
        raise InputError(f"attention policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
    if policy == "auto":
        return AUTO[backend()]
    if policy == "fused" and backend() != "cuda":
        raise InputError(f"the fused attention kernels need the CUDA backend; this device is {backend()}")
    return policy


def dequantize(prefix, dtype):
    """The same prefix with both sides decoded to dense (n_pages, n_kv_heads, P, head_dim) pages."""
    k = prefix.k_codec.decode(prefix.k_parts, prefix.k_params).astype(dtype)
    v = prefix.v_codec.decode(prefix.v_parts, prefix.v_params).astype(dtype)
    if prefix.protected is not None:  # dense pages take the fp16 copies in place
        k, v = (protect.overwrite(x, prefix.protected, side, prefix.n_tokens) for x, side in ((k, "k"), (v, "v")))
    return LayerPrefix(DEQUANTIZED, {"values": k}, DEQUANTIZED, {"values": v}, prefix.n_tokens)


def kernel_for(policy, prefix, head_dim):
    """The fused attention of one layer for a concrete policy, or None for the portable path.

    The fused kernel takes one head_dim for K and V; a layer whose widths differ takes the portable path.
    No fused kernel reads protected tokens' fp16 copies either: such a layer takes the portable path.
    """
    if policy == "portable" or backend() != "cuda" or prefix.protected is not None:
        return None
    from .kernels import cuda

    return cuda.FusedAttention(prefix) if cuda.supported(prefix, head_dim) else None


def prepare(prefixes, policy, dtype, head_dims):
    """Apply a concrete policy to loaded prefixes.

    Args:
        prefixes (list): one per layer, as stored: a LayerPrefix for a page-attended layer; other
            layers (`cartridge.attention.layers`) pass through unchanged.
        policy (str): a concrete policy from `resolve`.
        dtype (mx.Dtype): the model's activation dtype (dense pages use it).
        head_dims (list[tuple]): per layer (K head_dim, V head_dim); ignored for other layers.

    Returns:
        list: the LayerPrefixes with `kernel` set where a fused kernel applies (and dense pages for
        "dequantize-once").
    """
    out = []
    for p, (k_dim, v_dim) in zip(prefixes, head_dims):
        if not isinstance(p, LayerPrefix):
            out.append(p)
            continue
        q = dequantize(p, dtype) if policy == "dequantize-once" else p
        kernel = kernel_for(policy, q, k_dim) if k_dim == v_dim else None
        out.append(LayerPrefix(q.k_codec, q.k_parts, q.v_codec, q.v_parts, q.n_tokens, q.k_params, q.v_params,
                               kernel, q.protected))
    mx.eval([[list(p.k_parts.values()), list(p.v_parts.values())] for p in out if isinstance(p, LayerPrefix)])
    return out
