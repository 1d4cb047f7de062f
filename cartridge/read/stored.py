"""A cartridge's stored layers as MLX arrays, and the model facts a loader checks: what `load`, `distributed`
and `extend` share, below all three (none of them is imported here).

    prefixes = [stored_layer(info, data, i) for i in range(info.n_layers)]   # as stored, nothing decoded
"""

from dataclasses import replace

import mlx.core as mx

from ..attention.prefix import LayerPrefix
from ..storage.kinds import KINDS
from ..errors import ModelLoadError, ModelMismatchError
from ..format import keys as K
from ..format.header import SIDES
from ..models.hub import HubModel, cached_snapshot, download_command, recorded_ref
from ..models.loader import load_model, parameter_arrays
from ..tiers import DTYPES, TIERS, protect


def built_with(info):
    """How a cartridge names its model: "ORG/NAME at revision 0123456789ab" where it records a hub repo
    (format 1.10), else its `model.ref`."""
    return str(HubModel(info.model_repo_id, info.model_revision)) if info.model_repo_id else info.model_ref


def load_recorded_model(info, path=None):
    """Load the model a cartridge records: the snapshot of its hub revision where the local Hugging Face
    cache holds it (`hub.cached_snapshot`: the weights it was built with, though the id may now name
    others), else by its hub repo id where it has one (`hub.recorded_ref`), else by `model.ref`.

    Args:
        info (CartridgeInfo): the cartridge's header. path (str | Path | None): the cartridge, named in errors.

    Returns:
        LoadedModel

    Raises:
        ModelLoadError: one line naming the cartridge, its model and why it cannot be loaded here.
    """
    snapshot = cached_snapshot(info.model_repo_id, info.model_revision) if info.model_repo_id else None
    try:
        if snapshot is not None:  # the weights it was built with, even where the id now names others
            return replace(load_model(str(snapshot)), ref=info.model_repo_id)  # named as loaded by id
        return load_model(recorded_ref(info.model_ref, info.model_repo_id))
    except ModelLoadError as e:
        which = f"cartridge {path}" if path is not None else "the cartridge"
        raise ModelLoadError(f"{which} was built with model {built_with(info)}, which cannot be loaded here: "
                             f"{e}") from None


def check_fingerprint(info, fp, path=None, model_ref=None):
    """Refuse a model whose fingerprint differs from the cartridge's, in one line that says what to do.

    Args:
        info (CartridgeInfo): the cartridge's header. fp (dict): the model's `fingerprint()`.
        path (str | Path | None): the cartridge, named in the message. Default: None.
        model_ref (str | None): how the model was given ("default", a path, "ORG/NAME at revision ..."),
            named in the message.

    Raises:
        ModelMismatchError: naming the cartridge, the model it was built with (and its hub revision), the
            parts that differ (config, weights, tokenizer, chat_template) and the two ways out.
    """
    if fp["id"] == info.fingerprint.get("id"):
        return
    differ = [k for k in ("config", "weights", "tokenizer", "chat_template") if fp.get(k) != info.fingerprint.get(k)]
    which = f"cartridge {path}" if path is not None else "the cartridge"
    given = f" {model_ref}" if model_ref else ""
    ref, revision = recorded_ref(info.model_ref, info.model_repo_id), info.model_revision
    if info.model_repo_id and revision:  # the id now resolves to other weights: that revision is the way out
        way = (f"revision {revision} of {ref} (--model \"$({download_command(ref, revision)})\"; Python: "
               f"model=cartridge.load_model({ref!r}, revision={revision!r}))")
    else:
        way = f"--model {ref} (Python: model={ref!r})"
    raise ModelMismatchError(
        f"{which} was built with model {built_with(info)} (fingerprint {info.fingerprint.get('id', '')[:12]}); this "
        f"model{given} (fingerprint {fp['id'][:12]}) differs in {', '.join(differ) or 'id'}: answer with "
        f"{way}, or rebuild the cartridge with this model"
    )


def stored_array(data, extent):
    """One extent of pages.bin as an MLX array of its stored dtype, shaped `extent.shape`.

    Args:
        data (PageData | SliceData): the mapped pages. extent (Extent): from the header's page tables.

    Returns:
        mx.array: zero-copy where MLX can wrap host memory (Apple silicon), one copy otherwise; never a decode.
    """
    view = data.view(extent, "<u2" if extent.dtype == "bfloat16" else extent.dtype)
    arr = mx.asarray(view)
    return arr.view(mx.bfloat16) if extent.dtype == "bfloat16" else arr


def layer_prefix(info, data, layer, meta=None):
    """The stored K and V pages of one page-attended layer.

    Args:
        info (CartridgeInfo): the header. data (PageData | SliceData): the mapped pages.
        layer (int | str): a layer index, or "i.j" for cache j of a list layer. meta (LayerMeta | None): that
            layer's header record (default `info.layers[layer]`).

    Returns:
        LayerPrefix: the tiers' codecs and components (n_pages, n_kv_heads, P, width), as stored.
    """
    meta = meta or info.layers[layer]
    parts = {side: {e.component: stored_array(data, e) for e in info.extents[(layer, side)]} for side in SIDES}
    tier = info.unit_tiers[layer]
    return LayerPrefix(TIERS[tier["k"]], parts["k"], TIERS[tier["v"]], parts["v"], meta.count,
                       info.params[(layer, "k")], info.params[(layer, "v")],
                       protected=protect.layer_protected(info, layer), key_scale=_key_scale(info, layer))


def _key_scale(info, layer):
    """The layer's K scale as an mx array (format 1.11), or None."""
    s = info.key_scales.get(layer)
    return None if s is None else mx.array(s)


def stored_layer(info, data, layer, meta=None):
    """One layer as stored: a LayerPrefix ("attention") or a Dense/Window/State/List layer (`attention.layers`),
    as its kind loads it (`storage.kinds`).

    Args:
        info, data, layer, meta: as in `layer_prefix`.

    Returns:
        LayerPrefix | DenseLayer | WindowLayer | StateLayer | ListLayer
    """
    meta = meta or info.layers[layer]
    return KINDS[meta.kind].load(StoredLayers(info, data), layer, meta)


class StoredLayers:
    """What a layer kind loads from: a parsed cartridge's header and its mapped pages.

    Args:
        info (CartridgeInfo): the header. data (PageData | SliceData): the mapped pages.

    Attributes:
        dtype (mx.Dtype): the dtype the model computed K/V in. n_tokens (int): prefix tokens.
    """

    def __init__(self, info, data):
        self.info, self.data = info, data
        self.dtype, self.n_tokens = DTYPES[info.source_dtype], len(info.tokens)

    def prefix(self, path, meta):
        """The LayerPrefix of the cache at layer path `path` (`layer_prefix`)."""
        return layer_prefix(self.info, self.data, path, meta)

    def arrays(self, path):
        """The recurrent arrays of a "state" cache, in stored order, each shaped as produced."""
        return [stored_array(self.data, e)[0] for e in self.info.extents[(path, K.STATE_SIDE)]]

    def layer(self, path, meta):
        """The loaded layer of the cache at `path` (a list layer's cache)."""
        return stored_layer(self.info, self.data, path, meta)


def model_dtype(model):
    """Activation dtype of an mlx-lm model: the dtype of its first floating-point parameter (float32 if none).

    Args:
        model (nn.Module): the model.

    Returns:
        mx.Dtype: float32, float16 or bfloat16.
    """
    return next((w.dtype for w in parameter_arrays(model) if w.dtype in (mx.float32, mx.float16, mx.bfloat16)), mx.float32)
