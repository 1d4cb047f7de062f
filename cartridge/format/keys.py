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

TOKENS_COUNT = "tokens.count"
TOKENS_IDS = "tokens.ids"  # binary: uint32 little-endian, tokens.count of them

N_LAYERS = "cache.n_layers"
N_KV_HEADS = "cache.n_kv_heads"
HEAD_DIM = "cache.head_dim"
PAGE_SIZE = "cache.page_size"
N_PAGES = "cache.n_pages"
SOURCE_DTYPE = "cache.source_dtype"
ROPE = "cache.rope"

REQUIRED = (
    FORMAT_MAJOR, FORMAT_MINOR, MODEL_REF, MODEL_FINGERPRINT, MODEL_CONFIG, PROMPT_MODE,
    PROMPT_SEPARATOR, TOKENS_COUNT, TOKENS_IDS, N_LAYERS, N_KV_HEADS, HEAD_DIM, PAGE_SIZE, N_PAGES,
    SOURCE_DTYPE, ROPE,
)


# Format 1.1 (issue 19): protected tokens. Absent in a 1.0 cartridge, which means 0 / no record.
PROTECT_FIRST = "cache.protect_first"  # JSON integer N: the first N prefix tokens are also kept in fp16
PROTECT_LAST = "cache.protect_last"  # JSON integer M: the last M prefix tokens are also kept in fp16


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
