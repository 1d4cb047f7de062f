"""Constants of the on-disk layout shared by the reader (`container`) and the writer (`writer`).

spec/FORMAT.md sections 2-4 define each of them; both sides import them from here, so neither
imports the other.
"""

import hashlib
import struct
from pathlib import Path

MAGIC = b"CARTRIDG"
FORMAT_MAJOR = 1
FORMAT_MINOR = 11  # 1.1: optional source.* keys (spec/FORMAT.md 4.5.1); 1.2: per-(page, head) checksums (4.5.2); 1.3: prompt.document_tokens, lineage.* (4.5.3)
# 1.4: per-layer cache kinds and shapes, layer.{i}.kind/shape/window/state (spec/FORMAT.md section 5.5)
# 1.5: protected tokens, cache.protect_first/last and layer.{i}.{side}.protected (spec/FORMAT.md 4.5.4), "list" layers (5.5)
# 1.6: the int6 and int6+rot tiers (spec/FORMAT.md 6.2, 6.4)
# 1.7: source.documents, every source document in order (spec/FORMAT.md 4.5.1)
# 1.8: cartridge.calibration, the measured choice of the schema (spec/FORMAT.md 4.7)
# 1.9: cartridge.preset, the preset a build or convert was given (spec/FORMAT.md 4.5)
# 1.10: model.repo_id, model.revision, the Hugging Face repo a model was resolved from (spec/FORMAT.md 4.5.5)
# 1.11: layer.{i}.k.scale and K codec_version 2, K stored divided by a per-channel scale (spec/FORMAT.md 4.5.6)
MANIFEST_NAME, INDEX_NAME, DATA_NAME = "MANIFEST", "index.lmdb", "pages.bin"
MANIFEST_STRUCT = struct.Struct("<8sHHIQQ32s")  # magic, major, minor, manifest_size, index_size, data_size, index sha256
MANIFEST_SIZE = MANIFEST_STRUCT.size + 32  # + sha256 of the preceding 64 bytes
ALIGN = 16384
PAGE_RECORD = struct.Struct("<QQ32s")  # offset, length, sha256
MAX_INDEX_BYTES = 1 << 32
MAX_VALUE_BYTES = 1 << 31
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstandard frame's first 4 bytes (RFC 8878 3.1.1): a .cartz starts with one


def align_up(n, a=ALIGN):
    """Smallest multiple of `a` that is >= n."""
    return (n + a - 1) // a * a


def sha256_file(path, chunk=1 << 24):
    """SHA-256 of a whole file, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.digest()


def is_pack(path):
    """True if `path` is a regular file starting with a zstandard frame (a candidate .cartz pack).

    Args:
        path: str or Path; a directory, a missing path or an unreadable file is no pack.

    Returns:
        bool. Only the first 4 bytes are read (`ZSTD_MAGIC`); `pack.open_packed` checks the rest.
    """
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == ZSTD_MAGIC
