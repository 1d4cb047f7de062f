"""Every LMDB index key of the container, in one place (spec/FORMAT.md section 4).

Keys are ASCII, dotted, lower_snake_case segments, at most `MAX_KEY_BYTES` bytes. JSON-valued keys
hold UTF-8 JSON text; binary-valued keys are marked in the spec.
"""

MAX_KEY_BYTES = 128

FORMAT_MAJOR = "cartridge.format_major"
FORMAT_MINOR = "cartridge.format_minor"
WRITER = "cartridge.writer"

MODEL_REF = "model.ref"
MODEL_FINGERPRINT = "model.fingerprint"
MODEL_CONFIG = "model.config"

PROMPT_MODE = "prompt.mode"
PROMPT_SEPARATOR = "prompt.separator"
PROMPT_SYSTEM = "prompt.system"  # OPTIONAL (format 1.4): the system message rendered before the document

TOKENS_COUNT = "tokens.count"
TOKENS_IDS = "tokens.ids"  # binary: uint32 little-endian, tokens.count of them

N_LAYERS = "cache.n_layers"
N_KV_HEADS = "cache.n_kv_heads"
HEAD_DIM = "cache.head_dim"
PAGE_SIZE = "cache.page_size"
N_PAGES = "cache.n_pages"
SOURCE_DTYPE = "cache.source_dtype"
ROPE = "cache.rope"

# format 1.3 (OPTIONAL; spec/FORMAT.md 4.5.3): where the document ends, and what the cartridge was made of
DOCUMENT_TOKENS = "prompt.document_tokens"  # int: leading tokens that are the document; absent: tokens.count
LINEAGE_PARTS = "lineage.parts"  # array of {kind, start, end, tokens_sha256}; absent: built at once
LINEAGE_SOURCE = "lineage.source"  # hex SHA-256 of the MANIFEST of the cartridge this one was written from

REQUIRED = (
    FORMAT_MAJOR, FORMAT_MINOR, MODEL_REF, MODEL_FINGERPRINT, MODEL_CONFIG, PROMPT_MODE,
    PROMPT_SEPARATOR, TOKENS_COUNT, TOKENS_IDS, N_LAYERS, N_KV_HEADS, HEAD_DIM, PAGE_SIZE, N_PAGES,
    SOURCE_DTYPE, ROPE,
)


# Format 1.5 (issue 19): protected tokens. Absent before 1.5, which means 0 / no record.
PROTECT_FIRST = "cache.protect_first"  # JSON integer N: the first N prefix tokens are also kept in fp16
PROTECT_LAST = "cache.protect_last"  # JSON integer M: the last M prefix tokens are also kept in fp16

# Format 1.8 (issue 33): OPTIONAL; absent = the schema was not chosen by measurement.
CALIBRATION = "cartridge.calibration"  # JSON object: target, bytes_per_token, predicted_kl, measured_kl, ...

# Format 1.9: OPTIONAL; absent = no preset was named (inspect shows "-").
PRESET = "cartridge.preset"  # JSON string: the preset the tiers and protection were resolved from

# Format 1.11: OPTIONAL, informational; absent = nearest rounding (inspect shows "-").
ENCODERS = "cartridge.encoders"  # JSON object {"k": "nearest" | "score", "v": "nearest" | "output"}: how a build chose codes

# Format 1.10: OPTIONAL; present when the model came from the Hugging Face hub (by repo id, or a snapshot folder).
MODEL_REPO_ID = "model.repo_id"  # JSON string "ORG/NAME": a reader loads the model by this id, not by model.ref
MODEL_REVISION = "model.revision"  # JSON string: the commit hash the repo id resolved to at build


def layer_key_scale(layer):
    """Binary (format 1.11): float32 little-endian (n_kv_heads, head_dim), the per-channel scale s whose K / s the
    layer's K pages hold (`cartridge.tiers.key_scale`)."""
    return f"layer.{layer}.k.scale"


def layer_protected(layer, side):
    """Binary: float16 little-endian (n_kv_heads, N + M, head_dim), tokens 0..N-1 then T-M..T-1."""
    return f"layer.{layer}.{side}.protected"


def layer_tier(layer, side):
    """Tier name of one (layer, side); side is "k" or "v"."""
    return f"layer.{layer}.{side}.tier"


def layer_codec_version(layer, side):
    """Codec version of the tier stored at (layer, side)."""
    return f"layer.{layer}.{side}.codec_version"


def layer_params(layer, side):
    """Tier parameters (JSON object) of (layer, side)."""
    return f"layer.{layer}.{side}.params"


def layer_components(layer, side):
    """Component list (JSON array of {name, dtype, width}) of (layer, side)."""
    return f"layer.{layer}.{side}.components"


def page_table(layer, side, component):
    """Binary page table of one component extent: n_pages records of (u64 offset, u64 length, 32-byte sha256)."""
    return f"layer.{layer}.{side}.{component}.pages"

# --- Source document (format 1.1, OPTIONAL; a 1.0 cartridge lacks them and readers show "-") ---
SOURCE_NAME = "source.name"  # string: file name the document was read from ("stdin", or "" when not given)
SOURCE_BYTES = "source.bytes"  # integer: bytes of the document's UTF-8 text as prefilled
SOURCE_SHA256 = "source.sha256"  # string: lowercase hex SHA-256 of those bytes
SOURCE_FIRST_LINE = "source.first_line"  # string: first non-blank line, stripped, at most 120 characters
SOURCE_KEYS = (SOURCE_NAME, SOURCE_BYTES, SOURCE_SHA256, SOURCE_FIRST_LINE)
# format 1.7 (OPTIONAL): every document the cartridge holds, in order (build: one; extend appends one)
SOURCE_DOCUMENTS = "source.documents"  # array of {"name", "bytes", "sha256", "first_line"}
MAX_SOURCES = 65536

# --- per-head checksums (issue 22, format 1.2; spec/FORMAT.md 4.5.2) ---------------------------------
HEAD_RECORD_BYTES = 32  # one SHA-256 per (page, KV head)


def head_table(layer, side, component):
    """Binary per-head checksum table of one extent: n_pages * n_kv_heads SHA-256 digests, page-major.

    Optional (format >= 1.2): a reader verifying only some KV heads (a tensor-parallel rank) checks these;
    without it, it must verify whole pages.
    """
    return f"layer.{layer}.{side}.{component}.head_sums"


# Format 1.4: what each layer's cache holds (spec/FORMAT.md section 5.5). Absent in files before 1.4, where
# every layer is "attention" with the global cache.n_kv_heads / cache.head_dim.
def layer_kind(layer):
    """Cache kind of a layer: "attention", "dense", "window", "state" or (1.5) "list"."""
    return f"layer.{layer}.kind"


# Format 1.5: a "list" layer holds several caches (mlx-lm CacheList); cache j of layer i is described
# by the same layer.* keys under the layer path "i.j" (layer.3.1.kind, layer.3.1.k.tier, ...).
MAX_LIST_CACHES = 16


def layer_caches(layer):
    """A "list" layer's number of caches (integer 1..MAX_LIST_CACHES)."""
    return f"layer.{layer}.caches"


def part(layer, index):
    """The layer path of cache `index` of "list" layer `layer`: "i.j", used in place of a layer index."""
    return f"{layer}.{index}"


def layer_shape(layer, side):
    """[n_kv_heads, head_dim] of one side of a layer, as the model wrote it."""
    return f"layer.{layer}.{side}.shape"


def layer_window(layer):
    """A "window" layer's {"size": window, "start": first stored position, "count": stored tokens}."""
    return f"layer.{layer}.window"


def layer_state(layer):
    """A "state" layer's {"size": slots, "arrays": [{"index", "dtype", "shape"}, ...]}."""
    return f"layer.{layer}.state"


STATE_SIDE = "s"  # page tables of state arrays: layer.{i}.s.a{index}.pages, one page each


def state_component(index):
    """Component name of slot `index` of a state layer."""
    return f"a{index}"
