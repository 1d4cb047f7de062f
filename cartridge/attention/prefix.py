"""`LayerPrefix`: one layer's stored pages as loaded, the read-only prefix a `CartridgeCache` attends.

Apart from `cartridge.attention.caches` (which subclass mlx-lm's caches) so that placing and reporting
(`cartridge inspect`) import no mlx-lm.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerPrefix:
    """The read-only prefix of one layer.

    Attributes:
        k_codec, v_codec (TierCodec): tiers of the K and V pages.
        k_parts, v_parts (dict[str, mx.array]): component -> (n_pages, n_kv_heads, page_size, width).
        n_tokens (int): valid tokens (the last page may be padded).
        k_params, v_params (dict): the tiers' (layer, side) parameters from the header.
        backend (object | None): the record of the backend that attends this layer, made from its pages at load
            (`cartridge.attention.policy.place`; `AttentionBackend.build`): data only, its `name` the registry
            entry whose `attend` reads it (`cartridge.attention.backends`). None, or a None output from `attend`,
            means the portable path (`cartridge.attention.kernels.portable`).
        protected (Protected | None): fp16 copies of the first/last prefix tokens, attended instead of
            their compressed pages (`cartridge.tiers.protect`).
        key_scale (mx.array | None): (n_kv_heads, head_dim) float32 s of a layer whose K pages and protected
            copies hold K / s (format 1.11, `cartridge.tiers.key_scale`): its cache attends with queries * s and
            keeps its tail's keys / s; None: K as the model computed it.
    """

    k_codec: object
    k_parts: dict
    v_codec: object
    v_parts: dict
    n_tokens: int
    k_params: dict = field(default_factory=dict)
    v_params: dict = field(default_factory=dict)
    backend: object = None
    protected: object = None
    key_scale: object = None

    @property
    def n_kv_heads(self):
        """KV heads (axis 1 of every page array)."""
        return next(iter(self.k_parts.values())).shape[1]

    @property
    def nbytes(self):
        """Bytes of the stored pages of this layer (K and V)."""
        return sum(a.nbytes for a in (*self.k_parts.values(), *self.v_parts.values()))
