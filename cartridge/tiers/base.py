"""What every tier codec offers (spec/FORMAT.md section 6, "Tiers").

A codec turns one (layer, side) of K or V, shaped (n_kv_heads, T, head_dim), into named component
arrays shaped (n_kv_heads, T, width) of fixed dtypes (e.g. fp16 "values"; or uint32 "codes" plus
fp16 "scales" and "biases"). The container stores each component as its own extent of pages.
"""

from dataclasses import dataclass

import mlx.core as mx

from ..errors import CorruptCartridgeError
from . import score_aware


@dataclass(frozen=True)
class Component:
    """One stored array of a tier.

    Attributes:
        name (str): component name, lower_snake_case ("values", "codes", "scales", ...).
        dtype (str): storage dtype name: "float16", "bfloat16", "uint8", "uint32", ...
        width (int): elements per token per KV head (the last axis of the stored array).
    """

    name: str
    dtype: str
    width: int

    @property
    def itemsize(self):
        """Bytes per element of `dtype`."""
        return DTYPES[self.dtype].size


DTYPES = {
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
    "uint8": mx.uint8,
    "uint16": mx.uint16,
    "uint32": mx.uint32,
    "uint64": mx.uint64,
    "int8": mx.int8,
    "int16": mx.int16,
    "int32": mx.int32,
    "int64": mx.int64,
}


STATS_BLOCK = 1 << 19  # K/V elements a block of tokens holds where make_params reads the whole side


def token_blocks(x, elements=None):
    """x (n_kv_heads, T, head_dim) as consecutive token slices of at most `elements` elements (at least one token).

    Args:
        x (mx.array): any dtype. elements (int | None): default STATS_BLOCK (read when called).

    Returns:
        list[mx.array]: views (n_kv_heads, t_i, head_dim), sum of t_i = T; [] for T = 0.
    """
    n_kv, t, d = x.shape
    step = max(1, (elements or STATS_BLOCK) // max(1, n_kv * d))
    return [x[:, a:a + step] for a in range(0, t, step)]


class TierCodec:
    """Base class: one subclass per tier, registered by name in `cartridge.tiers.TIERS`."""

    name = ""
    codec_version = 1
    formula = ""  # bytes/token/layer-side in kv_dim and H = n_kv_heads (spec/FORMAT.md section 6)
    kernel_layout = None  # layout.KernelLayout where a fused attention kernel reads the tier
    dense_pages = False  # True: pages of the model's dtype made at load (their layout is their dtype's)

    def components(self, head_dim):
        """The stored components for one KV head of `head_dim` elements.

        Returns:
            list[Component]
        """
        raise NotImplementedError

    def check(self, n_kv_heads, head_dim):
        """Raise `InputError` if the tier cannot store this shape (e.g. head_dim % group size)."""

    def make_params(self, x, layer, side, transform=None):
        """Per-(layer, side) parameters chosen at build time from the data (seed, global scale ...).

        Args:
            x (mx.array): (n_kv_heads, T, head_dim), the K or V about to be encoded.
            layer (int), side (str): where it goes.
            transform (callable | None): a per-token map (n_kv_heads, t, head_dim) -> same shape float32 that the
                statistics are taken after (a rotated tier's rotation), applied to blocks of tokens (`token_blocks`)
                so that the transformed side is never whole in memory. Default: None.

        Returns:
            dict: JSON-serializable; stored under `layer.{i}.{side}.params` and passed back to
            `encode`, `decode`, `scores` and `weighted_values`.
        """
        return {}

    def check_params(self, params, n_kv_heads, head_dim):
        """Refuse stored params a reader cannot use (a missing field, a wrong length).

        Raises:
            CorruptCartridgeError: naming the field, the value found and the value allowed.
        """

    def encode(self, x, params):
        """Encode K or V of one layer.

        Args:
            x (mx.array): (n_kv_heads, T, head_dim), any float dtype.
            params (dict): from `make_params`.

        Returns:
            dict[str, mx.array]: component name -> (n_kv_heads, T, width) in the component's dtype.
        """
        raise NotImplementedError

    def decode(self, parts, params):
        """Reference decode of `encode`'s output (leading axes free) to float32 (..., head_dim)."""
        raise NotImplementedError

    def decode_stored(self, parts, params):
        """The pages decoded in the basis they were stored in, and that basis: attention can run there with the
        query rotated into it and the output rotated back (R orthogonal: (R q).(R k) = q.k), instead of rotating
        every stored token back.

        Returns:
            tuple: (values (..., head_dim) float32 or the stored dtype, basis): basis None for the original one,
            else an object whose `rotate(x)` / `unrotate(y)` map (n_kv_heads, T, head_dim) arrays into / out of it.
        """
        return self.decode(parts, params), self.stored_basis(params)

    def stored_basis(self, params):
        """The basis `decode_stored` returns, without decoding anything: here None (the original one)."""

    def bytes_per_token(self, n_kv_heads, head_dim):
        """Stored bytes per token for one (layer, side): the tier's formula in spec/FORMAT.md."""
        return n_kv_heads * sum(c.width * c.itemsize for c in self.components(head_dim))

    def scores(self, q, parts, params):
        """q . K^T over every page, for the portable attention path.

        Args:
            q (mx.array): (n_kv_heads, R, head_dim) float32, already multiplied by the softmax scale.
            parts (dict[str, mx.array]): component -> (n_pages, n_kv_heads, page_size, width).
            params (dict): the (layer, side) parameters.

        Returns:
            mx.array: (n_pages, n_kv_heads, R, page_size) float32.
        """
        k = self.decode(parts, params)  # (n_pages, n_kv_heads, P, D): the plain fallback dequantizes
        return q @ k.swapaxes(-1, -2)

    def weighted_values(self, p, parts, params):
        """Sum over every page of p . V, for the portable attention path.

        Args:
            p (mx.array): (n_pages, n_kv_heads, R, page_size) float32 softmax numerators.
            parts (dict[str, mx.array]): component -> (n_pages, n_kv_heads, page_size, width).
            params (dict): the (layer, side) parameters.

        Returns:
            mx.array: (n_kv_heads, R, head_dim) float32, in the original (un-rotated) basis.
        """
        return (p @ self.decode(parts, params)).sum(axis=0)



class FixedParamsCodec(TierCodec):
    """Base of the tiers whose params are fixed by the tier itself (mode, bits, group, scale rule, packing):
    written as `fixed_params()` and refused on read unless every one of those fields is as written."""

    def fixed_params(self):
        """The params every (layer, side) of this tier records (dict, JSON-serializable)."""
        raise NotImplementedError

    def make_params(self, x, layer, side, transform=None):
        return score_aware.bind(self.fixed_params(), x, layer, side)

    def check_params(self, params, n_kv_heads, head_dim):
        for key, value in self.fixed_params().items():
            if params.get(key) != value:
                raise CorruptCartridgeError(f"tier {self.name}: params.{key} is {params.get(key)!r}; expected {value!r}")
