"""The optional source-document keys (spec/FORMAT.md 4.2, format 1.1): which document a cartridge holds."""

import hashlib
import json
from pathlib import PurePath

from . import keys as K

FIRST_LINE_CHARS = 120


def source_keys(document, name=None):
    """The source.* header keys of `document`.

    Args:
        document (str): the text as prefilled. name (str | None): the file it came from ("stdin" for
            standard input); only its last path component is stored. Default: None (stored as "").

    Returns:
        dict: {key: JSON value} for `cartridge.format.keys.SOURCE_KEYS`.
    """
    raw = document.encode("utf-8")
    first = next((line.strip() for line in document.splitlines() if line.strip()), "")
    return {
        K.SOURCE_NAME: PurePath(name).name if name else "",
        K.SOURCE_BYTES: len(raw),
        K.SOURCE_SHA256: hashlib.sha256(raw).hexdigest(),
        K.SOURCE_FIRST_LINE: first[:FIRST_LINE_CHARS],
    }


def read_source(records):
    """The source.* keys found in raw index records, by short name; absent or malformed ones are None.

    Returns:
        dict: {"name", "bytes", "sha256", "first_line"}; values None where the key is absent (format 1.0).
    """
    want = {K.SOURCE_NAME: str, K.SOURCE_BYTES: int, K.SOURCE_SHA256: str, K.SOURCE_FIRST_LINE: str}
    out = {}
    for key, kind in want.items():
        try:
            value = json.loads(records[key]) if key in records else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            value = None
        ok = isinstance(value, kind) and not isinstance(value, bool)
        out[key.split(".", 1)[1]] = value if ok else None
    return out
