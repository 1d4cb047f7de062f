"""Parse and check the index records of a cartridge into a `CartridgeInfo` (spec/FORMAT.md 4-5).

Every count and length read from disk is bounded and cross-checked against the data file size before
anything is allocated from it; page offsets must follow the exact layout the writer produces.
"""

import hashlib
import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import (
    CorruptCartridgeError,
    FieldError,
    InputError,
    LayoutError,
    UnsupportedVersionError,
)
from ..tiers import DTYPES, TIERS, key_scale, protect
from . import keys as K
from .container import Extent, parse_head_table, parse_page_table
from .fields import typed
from .kinds import KINDS, SIDES, LayerInfo, layer_units, parse_kind
from .layout import ALIGN, FORMAT_MAJOR, align_up
from .source import read_source, read_sources

__all__ = ["SIDES", "CartridgeInfo", "LayerInfo", "layer_units", "parse_header", "require_attention_layers"]


@dataclass
class CartridgeInfo:
    """What a cartridge holds, as read from its index.

    Attributes:
        format_version (str): "major.minor".
        tokens (np.ndarray): uint32 prefix token ids, shape (n_tokens,).
        n_layers, n_kv_heads, head_dim, page_size, n_pages (int): cache geometry.
        tiers (list[dict]): per layer {"layer": i, "k": tier, "v": tier}.
        extents (dict): (layer, side) -> list[Extent], in component order.
        model_ref (str), fingerprint (dict), model_config (dict): the model it was built with.
        prompt_mode (str), separator (str): the prompt split (spec 5.4).
        system (str | None): the system message rendered before the document (format 1.4; None if absent).
        source_dtype (str): dtype of K/V as the model computed them.
        data_size (int): bytes of pages.bin.
        params (dict): (path, side) -> the tier's params object; path is the layer index, or "i.j" for
            cache j of a "list" layer i (`units`); extents are keyed the same way.
        unit_tiers (dict): path -> {"k": tier, "v": tier} of every stored cache with K/V.
        source (dict): the source document's "name", "bytes", "sha256", "first_line" (None where a
            format 1.0 cartridge lacks them): the format 1.1 keys, which after an extend describe its first source.
        sources (list[dict]): every source document, in order, each as `source` (`format.source.read_sources`):
            one from a build, one more per extend; [] for format 1.0. records (dict[str, bytes]): every raw
            index record.
        document_tokens (int): leading tokens that are the document (format 1.3; all tokens if absent);
            a conversation cartridge holds turns after them.
        parts (list[dict]): lineage.parts, [{kind, start, end, tokens_sha256}] ([] if built at once).
        lineage_source (str): lineage.source, hex SHA-256 of the MANIFEST it was written from ("" if none).
        model_repo_id (str | None), model_revision (str | None): the Hugging Face repo id the model was
            resolved from and the commit it resolved to (format 1.10; None where not recorded).
        key_scales (dict): layer path -> (n_kv_heads, head_dim) float32 s of a layer whose K pages hold K / s
            (format 1.11, `cartridge.tiers.key_scale`); {} where no layer is scaled.
    """

    format_version: str
    tokens: np.ndarray
    n_layers: int
    n_kv_heads: int
    head_dim: int
    page_size: int
    n_pages: int
    tiers: list
    extents: dict
    model_ref: str
    fingerprint: dict
    model_config: dict
    prompt_mode: str
    separator: str
    source_dtype: str
    data_size: int
    params: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)
    source: dict = field(default_factory=dict)
    sources: list = field(default_factory=list)
    records: dict = field(default_factory=dict, repr=False)
    document_tokens: int = 0
    parts: list = field(default_factory=list)
    lineage_source: str = ""
    protect_first: int = 0
    protect_last: int = 0
    protected: dict = field(default_factory=dict, repr=False)
    system: str | None = None
    unit_tiers: dict = field(default_factory=dict)
    model_repo_id: str | None = None
    model_revision: str | None = None
    key_scales: dict = field(default_factory=dict, repr=False)

    def units(self):
        """[(path, LayerInfo)] of every stored cache, in storage order (`layer_units`)."""
        return layer_units(self.layers)

    @property
    def kv_dim(self):
        """n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    def _growing(self):
        """(layer, side, (n_kv_heads, head_dim)) of every side that stores every prefix token."""
        return [(path, side, info.shape(side)) for path, info in self.units()
                if info.stores_every_token for side in SIDES]

    def bytes_per_token(self):
        """K+V payload bytes per token of the layers that store every token, by the tiers' formulas, plus
        the fp16 copies of protected tokens spread over the prefix (format 1.5, rounded to a byte)."""
        shapes = [shape for path, _, shape in self._growing() if isinstance(path, int)]  # not inside lists
        return sum(TIERS[self.unit_tiers[p][side]].bytes_per_token(*shape) for p, side, shape in self._growing()) + \
            protect.bytes_per_token(self.protect_first, self.protect_last, len(self.tokens), shapes)

    def fp16_bytes_per_token(self):
        """What the same layers would take in fp16: 2 bytes per element of every K and V row."""
        return sum(2 * shape[0] * shape[1] for _, _, shape in self._growing())

    def fixed_bytes(self):
        """Payload bytes that do not grow with the document: window pages and recurrent state."""
        kinds = dict(self.units())
        return sum(e.page_bytes * e.shape[0] for (p, _), ext in self.extents.items()
                   if kinds[p].kind_type.fixed for e in ext)

    def per_token_split(self):
        """Which caches `bytes_per_token` counts, and the payload of the others (a windowed model's bytes/token
        counts only its full-attention layers; its window layers hold a fixed payload).

        Returns:
            dict: {"per_token_layers": caches that store every prefix token, "layers": all caches, "fixed":
            {kind: {"layers": caches, "bytes": payload bytes}} of the kinds whose payload does not grow with
            the document (window, state)}; the "bytes" add up to `fixed_bytes()`.
        """
        units = dict(self.units())
        fixed = {}
        for unit in units.values():
            if unit.kind_type.fixed:
                fixed.setdefault(unit.kind, {"layers": 0, "bytes": 0})["layers"] += 1
        for (path, _), extents in self.extents.items():
            if units[path].kind_type.fixed:
                fixed[units[path].kind]["bytes"] += sum(e.page_bytes * e.shape[0] for e in extents)
        return {"per_token_layers": sum(1 for u in units.values() if u.stores_every_token), "layers": len(units),
                "fixed": fixed}


def require_attention_layers(info, what, kinds=("attention",)):
    """Refuse a cartridge with a layer of a kind other than `kinds`, a K/V layer of a shape other than the
    global (n_kv_heads, head_dim), or protected tokens.

    Save, compose and sharded loading handle paged attention layers of one shape only; extend also window
    layers, convert also dense, window and state layers (`kinds`); other kinds (format 1.4, section 5.5)
    and protected tokens (1.5, section 4.5.4) are refused in one line. K stored scaled (1.11, 4.5.6) is taken:
    each operation carries the scale.

    Args:
        info (CartridgeInfo): the cartridge's header. what (str): the operation, named in the message.
        kinds (tuple): the layer kinds the operation takes. Default: ("attention",).

    Raises:
        InputError: naming the first such layer, its kind and shapes.
    """
    shape = (info.n_kv_heads, info.head_dim)
    named = kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} and {kinds[-1]}"
    for i, layer in enumerate(info.layers):
        if layer.kind not in kinds:
            raise InputError(f"layer {i} is a {layer.kind} layer; {what} takes {named} layers only")
        if layer.kind_type.tiered and (layer.k_shape != shape or layer.v_shape != shape):
            raise InputError(f"layer {i} stores K {layer.k_shape} and V {layer.v_shape}; {what} takes layers of "
                             f"the cartridge's (n_kv_heads, head_dim) {shape} only")
    if info.protect_first + info.protect_last:  # their fp16 copies sit at positions a new cartridge would move
        raise InputError(f"the cartridge keeps {info.protect_first} first and {info.protect_last} last tokens in "
                         f"fp16; {what} takes cartridges without protected tokens only (convert the fp16 cartridge without "
                         f"--protect-first/--protect-last)")


CHOICES = {  # key -> allowed string values
    K.PROMPT_MODE: ("chat_template", "plain"),
    K.SOURCE_DTYPE: ("float32", "float16", "bfloat16"),
    K.ROPE: ("post",),
}


def _choice(records, key):
    value = typed(records, key, str)
    if value not in CHOICES[key]:
        raise FieldError(f"index key {key!r} is {value[:40]!r}; allowed {', '.join(CHOICES[key])}")
    return value


def _extents(records, layers, tiers, page_size, data_size):
    """Build every Extent, requiring the writer's exact layout: aligned, in order, no holes, no overlap."""
    pos, out = 0, {}
    for layer, info in layer_units(layers):
        for side, comps, n_pages in info.kind_type.components(records, layer, info, tiers.get(layer), page_size):
            out.setdefault((layer, side), [])
            for name, dtype, shape in comps:
                page_bytes = int(np.prod(shape[1:])) * DTYPES[dtype].size
                start = align_up(pos)
                if start + n_pages * page_bytes > data_size:
                    raise LayoutError(
                        f"layer {layer} {side} {name}: extent ends at {start + n_pages * page_bytes}, "
                        f"beyond the data file ({data_size} bytes)"
                    )
                key = K.page_table(layer, side, name)
                offsets, lengths, sums = parse_page_table(records.get(key), key, n_pages)
                want = [start + i * page_bytes for i in range(n_pages)]
                if offsets != want or any(n != page_bytes for n in lengths):
                    raise LayoutError(f"page table {key}: offsets/lengths do not follow the layout (spec 3.2)")
                head_key = K.head_table(layer, side, name)
                heads = parse_head_table(records.get(head_key), head_key, n_pages, shape[1])
                out[(layer, side)].append(Extent(layer, side, name, dtype, shape, start, page_bytes, sums, heads))
                pos = start + n_pages * page_bytes
    if align_up(pos, ALIGN) != data_size:
        raise LayoutError(f"data file is {data_size} bytes; the page tables cover {align_up(pos)}")
    return out


def _layers(records, n_layers, n_kv, head_dim, n_tokens):
    """Every layer's LayerInfo; a layer without `layer.{i}.kind` (format < 1.4) is "attention" of the global shape."""
    return [parse_kind(records, layer, n_tokens) if K.layer_kind(layer) in records
            else LayerInfo("attention", (n_kv, head_dim), (n_kv, head_dim), 0, n_tokens) for layer in range(n_layers)]


FINGERPRINT_PARTS = ("id", "config", "weights", "tokenizer", "chat_template")


def _fingerprint(records):
    """model.fingerprint: an object of five lowercase hex SHA-256 strings (spec 5.3)."""
    fp = typed(records, K.MODEL_FINGERPRINT, dict)
    for part in FINGERPRINT_PARTS:
        v = fp.get(part)
        if not (isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)):
            raise FieldError(f"model.fingerprint.{part} is {str(v)[:70]!r}; expected 64 lowercase hex digits")
    return fp


def _tier_map(records, layers):
    """(rows, by path): one {"layer", "k", "v"} row per layer (None for a "state" layer, and for a "list"
    layer whose caches differ), and {"k", "v"} of every stored cache with K/V by its path."""
    by_path = {}
    for path, info in layer_units(layers):
        if info.kind_type.tiered:  # a state is stored as produced, no tier
            by_path[path] = {side: _unit_tier(records, path, side) for side in SIDES}
    rows = []
    for layer, info in enumerate(layers):
        paths = [p for p, _ in KINDS[info.kind].units(layer, info)]
        found = [by_path[p] for p in paths if p in by_path]
        same = found and all(t == found[0] for t in found)
        rows.append({"layer": layer, "k": found[0]["k"] if same else None, "v": found[0]["v"] if same else None})
    return rows, by_path


def _unit_tier(records, layer, side):
    name = typed(records, K.layer_tier(layer, side), str)
    if name not in TIERS:
        raise FieldError(f"layer {layer} {side}: unknown tier {name[:40]!r}; known: {', '.join(TIERS)}")
    version = typed(records, K.layer_codec_version(layer, side), int)
    known = max(TIERS[name].codec_version, key_scale.SCALED_VERSION) if side == "k" else TIERS[name].codec_version
    if version > known:
        raise UnsupportedVersionError(f"layer {layer} {side}: tier {name} codec version {version}; this reader knows up "
                                      f"to {known}")
    return name


def parse_header(records, manifest):
    """Check the index records and build a `CartridgeInfo`.

    Args:
        records (dict[str, bytes]): from `container.read_index`.
        manifest (dict): from `container.read_manifest`.

    Raises:
        FieldError, LayoutError (CorruptCartridgeError), UnsupportedVersionError: on any failed check.
    """
    major = typed(records, K.FORMAT_MAJOR, int)
    if major != FORMAT_MAJOR or major != manifest["major"]:
        raise UnsupportedVersionError(f"cartridge file is format {major}; this cartridge reads up to {FORMAT_MAJOR}")
    minor = typed(records, K.FORMAT_MINOR, int)
    if minor != manifest["minor"]:  # spec section 2: a header of another minor than its MANIFEST is not one cartridge
        raise FieldError(f"cartridge.format_minor is {minor}; the MANIFEST says {manifest['minor']}")
    n_tokens = typed(records, K.TOKENS_COUNT, int)
    ids = records.get(K.TOKENS_IDS)
    if ids is None or len(ids) != 4 * n_tokens:
        raise FieldError(f"tokens.ids: {0 if ids is None else len(ids)} bytes, expected {4 * n_tokens}")
    geometry = tuple(typed(records, k, int) for k in (K.N_LAYERS, K.N_KV_HEADS, K.HEAD_DIM, K.PAGE_SIZE, K.N_PAGES))
    n_layers, _, _, page_size, n_pages = geometry
    if n_pages != -(-n_tokens // page_size):
        raise FieldError(f"cache.n_pages is {n_pages}; {n_tokens} tokens in pages of {page_size} need {-(-n_tokens // page_size)}")
    layers = _layers(records, n_layers, geometry[1], geometry[2], n_tokens)
    tiers, unit_tiers = _tier_map(records, layers)
    _choice(records, K.ROPE)  # keys stored before RoPE would give wrong answers: refuse, don't guess
    first, last, protected = protect.read(records, layers, n_tokens)
    tiered = [(path, info) for path, info in layer_units(layers) if info.kind_type.tiered]
    scales = key_scale.read(records, tiered, {path: typed(records, K.layer_codec_version(path, "k"), int)
                                               for path, _ in tiered})
    return CartridgeInfo(
        format_version=f"{major}.{minor}",
        tokens=np.frombuffer(ids, dtype="<u4").copy(),
        n_layers=n_layers, n_kv_heads=geometry[1], head_dim=geometry[2], page_size=page_size, n_pages=n_pages,
        tiers=tiers,
        extents=_extents(records, layers, unit_tiers, page_size, manifest["data_size"]),
        model_ref=typed(records, K.MODEL_REF, str),
        fingerprint=_fingerprint(records),
        model_config=typed(records, K.MODEL_CONFIG, dict),
        prompt_mode=_choice(records, K.PROMPT_MODE),
        separator=typed(records, K.PROMPT_SEPARATOR, str),
        system=typed(records, K.PROMPT_SYSTEM, str) if K.PROMPT_SYSTEM in records else None,
        source_dtype=_choice(records, K.SOURCE_DTYPE),
        data_size=manifest["data_size"],
        params=_params(records, unit_tiers, layers),
        unit_tiers=unit_tiers,
        layers=layers,
        source=read_source(records), sources=read_sources(records),
        records=records,
        **_lineage(records, ids, n_tokens),
        **_hub(records),
        protect_first=first, protect_last=last, protected=protected, key_scales=scales,
    )


def _params(records, tiers, layers):
    """Every (path, side)'s params object, checked by its tier (spec/FORMAT.md section 6)."""
    out = {}
    for path, info in layer_units(layers):
        if not info.kind_type.tiered:
            continue
        for side in SIDES:
            params = typed(records, K.layer_params(path, side), dict)
            try:
                TIERS[tiers[path][side]].check_params(params, *info.shape(side))
            except CorruptCartridgeError as e:  # the codec names the field; we name the (layer, side)
                raise FieldError(f"layer {path} {side}: {e}") from None
            out[(path, side)] = params
    return out


PART_KINDS = ("build", "extend", "conversation")


def _hex64(value):
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _lineage(records, ids, n_tokens):
    """The format 1.3 keys (all OPTIONAL): document end, parts, source cartridge (spec/FORMAT.md 4.5.3)."""
    doc = typed(records, K.DOCUMENT_TOKENS, int) if K.DOCUMENT_TOKENS in records else n_tokens
    if not 1 <= doc <= n_tokens:
        raise FieldError(f"index key {K.DOCUMENT_TOKENS!r} is {doc}; allowed 1..{n_tokens}")
    parts = typed(records, K.LINEAGE_PARTS, list) if K.LINEAGE_PARTS in records else []
    at = 0
    for i, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("kind") in PART_KINDS and part.get("start") == at
                and type(part.get("end")) is int and at < part["end"] <= n_tokens and _hex64(part.get("tokens_sha256"))):
            raise FieldError(f"lineage.parts[{i}] is {str(part)[:120]}; expected {{kind in {PART_KINDS}, start {at}, "
                             f"end {at + 1}..{n_tokens}, tokens_sha256 64 hex digits}}")
        if hashlib.sha256(ids[4 * at:4 * part["end"]]).hexdigest() != part["tokens_sha256"]:
            raise FieldError(f"lineage.parts[{i}]: tokens_sha256 does not match token ids {at}..{part['end']}")
        at = part["end"]
    if parts and at != n_tokens:
        raise FieldError(f"lineage.parts cover tokens 0..{at}; the cartridge holds {n_tokens}")
    source = typed(records, K.LINEAGE_SOURCE, str) if K.LINEAGE_SOURCE in records else ""
    if source and not _hex64(source):
        raise FieldError(f"index key {K.LINEAGE_SOURCE!r} is {source[:70]!r}; expected 64 lowercase hex digits")
    return {"document_tokens": doc, "parts": parts, "lineage_source": source}


_REPO_PART = r"(?!.*(--|\.\.))[A-Za-z0-9_]([A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"  # huggingface_hub's validate_repo_id
HUB_FORMS = {  # key -> (pattern, what the spec allows), format 1.10 (spec/FORMAT.md 4.5.5)
    K.MODEL_REPO_ID: (re.compile(f"{_REPO_PART}/{_REPO_PART}", re.ASCII), "ORG/NAME, a Hugging Face repo id"),
    K.MODEL_REVISION: (re.compile("[0-9a-f]{40}"), "a commit hash of 40 lowercase hex digits"),
}


def _hub(records):
    """The format 1.10 keys (OPTIONAL): the Hugging Face repo id and revision of the model (spec 4.5.5)."""
    out = {}
    for key, name in ((K.MODEL_REPO_ID, "model_repo_id"), (K.MODEL_REVISION, "model_revision")):
        value = typed(records, key, str) if key in records else None
        pattern, allowed = HUB_FORMS[key]
        if value is not None and not pattern.fullmatch(value):
            raise FieldError(f"index key {key!r} is {value[:120]!r}; expected {allowed}")
        out[name] = value
    return out
