"""Typed, bounded reads of one index record (spec/FORMAT.md section 5): what the header parser and the
layer kinds (`format.kinds`) share."""

import json

from ..errors import FieldError
from . import keys as K

LIMITS = {  # key -> (min, max), inclusive
    K.N_LAYERS: (1, 4096),
    K.N_KV_HEADS: (1, 1024),
    K.HEAD_DIM: (1, 4096),
    K.PAGE_SIZE: (1, 1 << 16),
    K.TOKENS_COUNT: (1, (1 << 31) - 1),
    K.N_PAGES: (1, 1 << 31),
}


def json_field(records, key):
    """The JSON value of index key `key`.

    Args:
        records (dict[str, bytes]): the index. key (str): a header key.

    Raises:
        FieldError: the key is absent, or its bytes are not JSON.
    """
    raw = records.get(key)
    if raw is None:
        raise FieldError(f"index lacks required key {key!r}")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: "[[[[..." nested too deep
        raise FieldError(f"index key {key!r} is not valid JSON: {str(e)[:80]}") from None


def typed(records, key, kind):
    """The JSON value of `key`, required to be of type `kind` (int excludes bool) and within `LIMITS`.

    Args:
        records (dict[str, bytes]): the index. key (str): a header key. kind (type): int, str, list or dict.

    Raises:
        FieldError: absent, not JSON, of another type, or out of its limits; the message names the key.
    """
    value = json_field(records, key)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise FieldError(f"index key {key!r} is {str(value)[:40]}; expected an integer")
    if not isinstance(value, kind):
        raise FieldError(f"index key {key!r} has type {type(value).__name__}; expected {kind.__name__}")
    if key in LIMITS:
        lo, hi = LIMITS[key]
        if not lo <= value <= hi:
            raise FieldError(f"index key {key!r} is {value}; allowed {lo}..{hi}")
    return value
