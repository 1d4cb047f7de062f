"""The optional source-document keys (spec/FORMAT.md 4.2, formats 1.1 and 1.7): which documents a cartridge holds."""

import hashlib
import json
from pathlib import PurePath

from . import keys as K

FIRST_LINE_CHARS = 120
FIELDS = {"name": str, "bytes": int, "sha256": str, "first_line": str}  # of a source, by its short name
SINGLE_KEYS = dict(zip(FIELDS, K.SOURCE_KEYS))  # short name -> its format 1.1 key


def source_entry(document, name=None):
    """One source of `source.documents`: the document's file name, UTF-8 bytes, SHA-256 and first line.

    Args:
        document (str): the text as prefilled. name (str | None): the file it came from ("stdin" for
            standard input); only its last path component is stored. Default: None (stored as "").

    Returns:
        dict: {"name", "bytes", "sha256", "first_line"}.
    """
    raw = document.encode("utf-8")
    first = next((line.strip() for line in document.splitlines() if line.strip()), "")
    return {"name": PurePath(name).name if name else "", "bytes": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(), "first_line": first[:FIRST_LINE_CHARS]}


def source_keys(document, name=None):
    """The source.* header keys of a cartridge built from `document` (arguments as `source_entry`).

    Returns:
        dict: {key: JSON value}: the single-source keys of format 1.1 (`cartridge.format.keys.SOURCE_KEYS`)
        and `source.documents` (1.7), a list of that one source.
    """
    entry = source_entry(document, name)
    return {**{SINGLE_KEYS[k]: v for k, v in entry.items()}, K.SOURCE_DOCUMENTS: [entry]}


def _checked(value, kind):
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def read_source(records):
    """The single-source keys (format 1.1) found in raw index records, by short name; absent or malformed ones are None.

    Returns:
        dict: {"name", "bytes", "sha256", "first_line"}; values None where the key is absent (format 1.0).
    """
    out = {}
    for short, kind in FIELDS.items():
        key = SINGLE_KEYS[short]
        try:
            value = json.loads(records[key]) if key in records else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            value = None
        out[short] = _checked(value, kind)
    return out


def read_sources(records):
    """Every source a cartridge records, in order (spec/FORMAT.md 4.5.1).

    `source.documents` (format 1.7) when present and a list of at most `MAX_SOURCES` objects; else the one
    source of the format 1.1 keys; else none (format 1.0). A malformed field reads as None, never an error.

    Returns:
        list[dict]: {"name", "bytes", "sha256", "first_line"} per source (values None where not recorded).
    """
    try:
        listed = json.loads(records[K.SOURCE_DOCUMENTS]) if K.SOURCE_DOCUMENTS in records else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        listed = None
    if isinstance(listed, list) and 0 < len(listed) <= K.MAX_SOURCES and all(isinstance(e, dict) for e in listed):
        return [{short: _checked(e.get(short), kind) for short, kind in FIELDS.items()} for e in listed]
    single = read_source(records)
    return [single] if any(v is not None for v in single.values()) else []
