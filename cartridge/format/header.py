"""Parse and check the index records of a cartridge into a `CartridgeInfo` (spec/FORMAT.md 4-5).

Every count and length read from disk is bounded and cross-checked against the data file size before
anything is allocated from it; page offsets must follow the exact layout the writer produces.
"""

import json
from dataclasses import dataclass, field

import numpy as np

from ..errors import CorruptCartridgeError, FieldError, LayoutError, UnsupportedVersionError
from ..tiers import TIERS, protect
from . import keys as K
from .container import Extent, parse_page_table
from .layout import ALIGN, FORMAT_MAJOR, align_up

LIMITS = {  # key -> (min, max), inclusive
    K.N_LAYERS: (1, 4096),
    K.N_KV_HEADS: (1, 1024),
    K.HEAD_DIM: (1, 4096),
    K.PAGE_SIZE: (1, 1 << 16),
    K.TOKENS_COUNT: (1, (1 << 31) - 1),
    K.N_PAGES: (1, 1 << 31),
}
SIDES = ("k", "v")


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
        source_dtype (str): dtype of K/V as the model computed them.
        data_size (int): bytes of pages.bin.
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
    protect_first: int = 0
    protect_last: int = 0
    protected: dict = field(default_factory=dict)  # (layer, side) -> np.ndarray (n_kv, N + M, head_dim) float16

    @property
    def kv_dim(self):
        """n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    def bytes_per_token(self):
        """K+V payload bytes of all layers per token, by the tiers' formulas."""
        return sum(
            TIERS[t[side]].bytes_per_token(self.n_kv_heads, self.head_dim) for t in self.tiers for side in SIDES
        ) + protect.bytes_per_token(self.protect_first, self.protect_last, len(self.tokens),
                                    (self.n_layers, self.n_kv_heads, self.head_dim))

    def fp16_bytes_per_token(self):
        """What the same cache would take in fp16: 2 sides * n_layers * kv_dim * 2 bytes."""
        return 2 * self.n_layers * self.kv_dim * 2


def _json(records, key):
    raw = records.get(key)
    if raw is None:
        raise FieldError(f"index lacks required key {key!r}")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: "[[[[..." nested too deep
        raise FieldError(f"index key {key!r} is not valid JSON: {str(e)[:80]}") from None


def _typed(records, key, kind):
    value = _json(records, key)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise FieldError(f"index key {key!r} is {str(value)[:40]}; expected an integer")
    if not isinstance(value, kind):
        raise FieldError(f"index key {key!r} has type {type(value).__name__}; expected {kind.__name__}")
    if key in LIMITS:
        lo, hi = LIMITS[key]
        if not lo <= value <= hi:
            raise FieldError(f"index key {key!r} is {value}; allowed {lo}..{hi}")
    return value


CHOICES = {  # key -> allowed string values
    K.PROMPT_MODE: ("chat_template", "plain"),
    K.SOURCE_DTYPE: ("float32", "float16", "bfloat16"),
    K.ROPE: ("post",),
}


def _choice(records, key):
    value = _typed(records, key, str)
    if value not in CHOICES[key]:
        raise FieldError(f"index key {key!r} is {value[:40]!r}; allowed {', '.join(CHOICES[key])}")
    return value


def _extents(records, geometry, tiers, data_size):
    """Build every Extent, requiring the writer's exact layout: aligned, in order, no holes, no overlap."""
    n_layers, n_kv, head_dim, page_size, n_pages = geometry
    pos, out = 0, {}
    for layer in range(n_layers):
        for side in SIDES:
            codec = TIERS[tiers[layer][side]]
            expected = [{"name": c.name, "dtype": c.dtype, "width": c.width} for c in codec.components(head_dim)]
            found = _json(records, K.layer_components(layer, side))
            if found != expected:
                raise FieldError(
                    f"layer {layer} {side}: components {str(found)[:200]} do not match tier {codec.name}: {expected}"
                )
            out[(layer, side)] = []
            for comp in codec.components(head_dim):
                page_bytes = n_kv * page_size * comp.width * comp.itemsize
                start = align_up(pos)
                if start + n_pages * page_bytes > data_size:
                    raise LayoutError(
                        f"layer {layer} {side} {comp.name}: extent ends at {start + n_pages * page_bytes}, "
                        f"beyond the data file ({data_size} bytes)"
                    )
                key = K.page_table(layer, side, comp.name)
                offsets, lengths, sums = parse_page_table(records.get(key), key, n_pages)
                want = [start + i * page_bytes for i in range(n_pages)]
                if offsets != want or any(n != page_bytes for n in lengths):
                    raise LayoutError(f"page table {key}: offsets/lengths do not follow the layout (spec 3.2)")
                out[(layer, side)].append(Extent(layer, side, comp.name, comp.dtype, (n_pages, n_kv, page_size, comp.width),
                                                 start, page_bytes, sums))
                pos = start + n_pages * page_bytes
    if align_up(pos, ALIGN) != data_size:
        raise LayoutError(f"data file is {data_size} bytes; the page tables cover {align_up(pos)}")
    return out


FINGERPRINT_PARTS = ("id", "config", "weights", "tokenizer", "chat_template")


def _fingerprint(records):
    """model.fingerprint: an object of five lowercase hex SHA-256 strings (spec 5.3)."""
    fp = _typed(records, K.MODEL_FINGERPRINT, dict)
    for part in FINGERPRINT_PARTS:
        v = fp.get(part)
        if not (isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)):
            raise FieldError(f"model.fingerprint.{part} is {str(v)[:70]!r}; expected 64 lowercase hex digits")
    return fp


def _tier_map(records, n_layers):
    tiers = []
    for layer in range(n_layers):
        row = {"layer": layer}
        for side in SIDES:
            name = _typed(records, K.layer_tier(layer, side), str)
            if name not in TIERS:
                raise FieldError(f"layer {layer} {side}: unknown tier {name[:40]!r}; known: {', '.join(TIERS)}")
            version = _typed(records, K.layer_codec_version(layer, side), int)
            if version > TIERS[name].codec_version:
                raise UnsupportedVersionError(
                    f"layer {layer} {side}: tier {name} codec version {version}; this reader knows up to {TIERS[name].codec_version}"
                )
            row[side] = name
        tiers.append(row)
    return tiers


def parse_header(records, manifest):
    """Check the index records and build a `CartridgeInfo`.

    Args:
        records (dict[str, bytes]): from `container.read_index`.
        manifest (dict): from `container.read_manifest`.

    Raises:
        FieldError, LayoutError (CorruptCartridgeError), UnsupportedVersionError: on any failed check.
    """
    major = _typed(records, K.FORMAT_MAJOR, int)
    if major != FORMAT_MAJOR or major != manifest["major"]:
        raise UnsupportedVersionError(f"cartridge file is format {major}; this cartridge reads up to {FORMAT_MAJOR}")
    n_tokens = _typed(records, K.TOKENS_COUNT, int)
    ids = records.get(K.TOKENS_IDS)
    if ids is None or len(ids) != 4 * n_tokens:
        raise FieldError(f"tokens.ids: {0 if ids is None else len(ids)} bytes, expected {4 * n_tokens}")
    geometry = tuple(_typed(records, k, int) for k in (K.N_LAYERS, K.N_KV_HEADS, K.HEAD_DIM, K.PAGE_SIZE, K.N_PAGES))
    n_layers, _, _, page_size, n_pages = geometry
    if n_pages != -(-n_tokens // page_size):
        raise FieldError(f"cache.n_pages is {n_pages}; {n_tokens} tokens in pages of {page_size} need {-(-n_tokens // page_size)}")
    tiers = _tier_map(records, n_layers)
    _choice(records, K.ROPE)  # keys stored before RoPE would give wrong answers: refuse, don't guess
    first, last, protected = protect.read(records, n_layers, geometry[1], geometry[2], n_tokens)
    return CartridgeInfo(
        format_version=f"{major}.{_typed(records, K.FORMAT_MINOR, int)}",
        tokens=np.frombuffer(ids, dtype="<u4").copy(),
        n_layers=n_layers, n_kv_heads=geometry[1], head_dim=geometry[2], page_size=page_size, n_pages=n_pages,
        tiers=tiers,
        extents=_extents(records, geometry, tiers, manifest["data_size"]),
        model_ref=_typed(records, K.MODEL_REF, str),
        fingerprint=_fingerprint(records),
        model_config=_typed(records, K.MODEL_CONFIG, dict),
        prompt_mode=_choice(records, K.PROMPT_MODE),
        separator=_typed(records, K.PROMPT_SEPARATOR, str),
        source_dtype=_choice(records, K.SOURCE_DTYPE),
        data_size=manifest["data_size"],
        params=_params(records, tiers, geometry[1], geometry[2]),
        protect_first=first, protect_last=last, protected=protected,
    )


def _params(records, tiers, n_kv, head_dim):
    """Every (layer, side)'s params object, checked by its tier (spec/FORMAT.md section 6)."""
    out = {}
    for t in tiers:
        for side in SIDES:
            params = _typed(records, K.layer_params(t["layer"], side), dict)
            try:
                TIERS[t[side]].check_params(params, n_kv, head_dim)
            except CorruptCartridgeError as e:  # the codec names the field; we name the (layer, side)
                raise FieldError(f"layer {t['layer']} {side}: {e}") from None
            out[(t["layer"], side)] = params
    return out
