"""mlx-lm's prompt-cache files (`mlx_lm.cache_prompt`, `save_prompt_cache`): read one, checked, and write one.

The layout is mlx-lm's (mlx_lm/models/cache.py `save_prompt_cache`): a safetensors file whose arrays are the
caches' `state` trees flattened ("3.0" is layer 3's keys), and whose metadata is [user metadata, class names,
scalars] flattened: "0.model", "1.3" = "KVCache", and "2.j.0" / "2.j.1" the path and kind ("scalar", "string",
"none") of a state entry stored as an array that means a Python int, str or None. mlx-lm's loader resolves the
class names with `globals()`; here only the classes of `CLASSES` are taken, and each state is checked
(shapes, dtypes, counts) before mlx-lm's own `from_state` builds the cache from it.

    f = read_prompt_file("doc.safetensors")     # f.caches: mlx-lm caches, f.metadata: {"model": ..., ...}
    write_prompt_file("doc.safetensors", caches, {"model": ref, "tokenizer_config": "{}"})
"""

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import (ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache,
                                 save_prompt_cache)

from ..errors import InputError, WriteError
from ..format.atomic import write_file

CLASSES = {c.__name__: c for c in (KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache, CacheList)}
TAKEN = "KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache and CacheLists of them"
RECORD = "cartridge"  # metadata key of what `cartridge export` adds: token ids and the prompt layout (JSON)
SUFFIX = ".safetensors"  # mx.load (mlx_lm.generate --prompt-cache-file) tells the format by it
QUANT_BITS = (2, 3, 4, 5, 6, 8)  # mx.quantize's affine widths


@dataclass
class PromptFile:
    """A prompt-cache file as read.

    Attributes:
        path (Path): the file. caches (list): one mlx-lm cache per layer, as mlx-lm's `load_prompt_cache`
            gives them. metadata (dict[str, str]): the user metadata (mlx_lm.cache_prompt: "model",
            "tokenizer_config"). tokens (int): tokens the caches hold (their offset).
    """

    path: Path
    caches: list
    metadata: dict
    tokens: int


def read_prompt_file(path):
    """Read and check an mlx-lm prompt-cache file.

    Args:
        path (str | Path): a file written by `mlx_lm.cache_prompt` or `save_prompt_cache`.

    Returns:
        PromptFile

    Raises:
        InputError: one line naming what is wrong: not a file, not safetensors, not a prompt cache (no cache
            classes in its metadata), a cache class outside `CLASSES`, a state of the wrong shape or dtype,
            a batch of several sequences, an empty cache, or layers holding different token counts.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompt cache {path} does not exist or is not a file")
    try:
        arrays, flat = mx.load(str(path), format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise InputError(f"{path} is not a safetensors file ({' '.join(str(e).split())})") from None
    classes, metadata, scalars = _split_metadata(path, flat)
    for pos, kind in scalars:
        arrays[pos] = _scalar(path, arrays.get(pos), kind)
    states = tree_unflatten(list(arrays.items())) if arrays else []
    if not isinstance(states, list) or len(states) != len(classes):
        raise InputError(f"{path}: its arrays are not the states of its {len(classes)} caches")
    caches = [_cache(path, str(i), name, state) for i, (name, state) in enumerate(zip(classes, states))]
    return PromptFile(path, caches, metadata, _token_count(path, caches))


def _split_metadata(path, flat):
    """(class names, user metadata, [(array key, scalar kind)]) of mlx-lm's flattened metadata."""
    classes = {k[2:]: v for k, v in flat.items() if k.startswith("1.")}
    if not classes or any(not k.startswith(("0.", "1.", "2.")) for k in flat):
        raise InputError(f"{path} is a safetensors file but not an mlx-lm prompt cache (no cache classes in "
                         f"its metadata); make one with mlx_lm.cache_prompt")
    if sorted(classes) != sorted(str(i) for i in range(len(classes))):
        raise InputError(f"{path}: its cache class list is malformed ({sorted(classes)[:4]} ...)")
    names = [classes[str(i)] for i in range(len(classes))]
    metadata = {k[2:]: v for k, v in flat.items() if k.startswith("0.")}
    entries = {k[2:]: v for k, v in flat.items() if k.startswith("2.") and k != "2.0"}
    scalars = []
    for j in sorted({k.split(".")[0] for k in entries}, key=lambda s: int(s) if s.isdigit() else -1):
        pos, kind = entries.get(f"{j}.0"), entries.get(f"{j}.1")
        if pos is None or kind is None:
            raise InputError(f"{path}: scalar entry {j} of its metadata is malformed")
        scalars.append((pos, kind))
    return names, metadata, scalars


def _scalar(path, array, kind):
    """A state entry mlx-lm stored as an array: an int or float, a str, or None (its `load_prompt_cache` rule)."""
    if array is None:
        raise InputError(f"{path}: its metadata names a scalar the file has no array for")
    if kind == "scalar" and array.size == 1:
        return array.item()
    if kind == "string" and array.ndim == 1:
        return "".join(chr(i) for i in array.tolist())
    if kind == "none":
        return None
    raise InputError(f"{path}: a scalar of kind {kind!r} and shape {tuple(array.shape)} is not one mlx-lm writes")


def _cache(path, where, name, state):
    """The mlx-lm cache of class `name` built from `state` by its own `from_state`, after the checks."""
    if name not in CLASSES:
        raise InputError(f"{path}: layer {where} is a {name}; cartridge import takes {TAKEN}")
    try:
        CHECKS[name](where, state)
    except (TypeError, ValueError, AttributeError, IndexError) as e:
        raise InputError(f"{path}: layer {where} ({name}) does not hold a {name} state: {e}") from None
    except InputError as e:
        raise InputError(f"{path}: layer {where} ({name}): {e}") from None
    if name == "CacheList":
        return CacheList(*(_cache(path, f"{where}.{j}", n, s) for j, (s, n) in enumerate(state)))
    return CLASSES[name].from_state(state)


def _one_sequence(shape):
    if shape[0] != 1:
        raise InputError(f"a batch of {shape[0]} sequences; a cartridge holds one")


def _kv(keys, values):
    for x in (keys, values):
        if not isinstance(x, mx.array) or x.ndim != 4:
            raise ValueError("K and V must be arrays of 4 axes (batch, kv heads, tokens, head_dim)")
        if not mx.issubdtype(x.dtype, mx.floating):
            raise ValueError(f"K/V of dtype {x.dtype}")
    _one_sequence(keys.shape)
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"K {tuple(keys.shape)} and V {tuple(values.shape)} differ in batch, heads or tokens")


def _count(name, n, low, high):
    if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= high:
        raise ValueError(f"{name} {n!r}; allowed {low} .. {high}")


def _check_kv_cache(where, state):
    keys, values, offset = state
    _kv(keys, values)
    _count("offset", offset, 1, keys.shape[2])


def _check_rotating(where, state):
    keys, values, offset, keep, max_size, idx = state
    _kv(keys, values)
    _count("max_size", max_size, 1, 2**31 - 1)
    _count("keep", keep, 0, max_size - 1)
    _count("offset", offset, 1, 2**31 - 1)
    _count("_idx", idx, 1, keys.shape[2])
    if keys.shape[2] < min(offset, max_size):
        raise ValueError(f"{keys.shape[2]} stored tokens of offset {offset} and max_size {max_size}")


def _check_quantized(where, state):
    keys, values, offset, group_size, bits = state
    if bits not in QUANT_BITS or group_size not in (32, 64, 128):
        raise ValueError(f"bits {bits!r} and group_size {group_size!r}")
    for w, scales, biases in (keys, values):
        if w.dtype != mx.uint32 or w.ndim != 4 or scales.shape != biases.shape or scales.shape[:3] != w.shape[:3]:
            raise ValueError("codes must be uint32 (batch, kv heads, tokens, words) beside scales and biases")
        if w.shape[-1] * 32 != scales.shape[-1] * group_size * bits:
            raise ValueError(f"{w.shape[-1]} code words do not hold {scales.shape[-1]} groups of {group_size}")
        _one_sequence(w.shape)
    if keys[0].shape[:3] != values[0].shape[:3]:
        raise ValueError("K and V hold different batch, heads or tokens")
    _count("offset", offset, 1, keys[0].shape[2])


def _check_arrays(where, state):
    cache, left_padding, lengths = state
    if left_padding is not None or lengths is not None:
        raise InputError("a batch cache (left padding or lengths); a cartridge holds one sequence")
    if not isinstance(cache, list) or not cache or all(a is None for a in cache):
        raise InputError("an empty ArraysCache")
    for a in cache:
        if a is not None and (not isinstance(a, mx.array) or a.ndim < 1 or a.shape[0] != 1):
            raise InputError("a state array without a batch axis of 1")


def _check_list(where, state):
    if not isinstance(state, list) or not state:
        raise ValueError("a CacheList state is a list of (state, class name) pairs")
    for part, name in state:
        if name not in CLASSES or name == "CacheList":
            raise InputError(f"holds a {name}; cartridge import takes {TAKEN}")


CHECKS = {"KVCache": _check_kv_cache, "RotatingKVCache": _check_rotating, "QuantizedKVCache": _check_quantized,
          "ArraysCache": _check_arrays, "CacheList": _check_list}


def leaf_caches(caches):
    """Every cache of a layer list, a CacheList's caches in their order (each with its layer path "i" / "i.j")."""
    for i, c in enumerate(caches):
        if isinstance(c, CacheList):
            yield from ((f"{i}.{j}", leaf) for j, leaf in enumerate(c.caches))
        else:
            yield str(i), c


def _token_count(path, caches):
    """The tokens every cache with an offset holds; they must agree."""
    counts = {where: c.offset for where, c in leaf_caches(caches) if hasattr(c, "offset")}
    if not counts:
        raise InputError(f"{path}: no layer holds K/V (recurrent states only); its token count is unknown")
    first = next(iter(counts))
    for where, n in counts.items():
        if n != counts[first]:
            raise InputError(f"{path}: layer {where} holds {n} tokens and layer {first} {counts[first]}")
    return counts[first]


def read_record(pf):
    """The `cartridge export` record of a prompt file (`RECORD` in its metadata), or None without one.

    Returns:
        dict | None: {"tokens": list[int], "prompt_mode", "separator", "system" (str | None),
        "document_tokens" (int)}.

    Raises:
        InputError: a record that is not that JSON object, or whose tokens do not match the caches' count.
    """
    raw = pf.metadata.get(RECORD)
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        tokens, doc = record["tokens"], record["document_tokens"]
        ok = (isinstance(tokens, list) and all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens)
              and record["prompt_mode"] in ("chat_template", "plain") and isinstance(record["separator"], str)
              and isinstance(record.get("system"), (str, type(None))) and isinstance(doc, int))
    except (ValueError, TypeError, KeyError, RecursionError):
        ok = False
    if not ok:
        raise InputError(f"{pf.path}: its {RECORD!r} metadata is not a cartridge export record")
    if len(tokens) != pf.tokens or not 1 <= doc <= len(tokens):
        raise InputError(f"{pf.path}: its {RECORD!r} metadata lists {len(tokens)} tokens ({doc} of the document); "
                         f"its caches hold {pf.tokens}")
    return record


def write_prompt_file(path, caches, metadata):
    """Write mlx-lm caches as a prompt-cache file with mlx-lm's own `save_prompt_cache`, atomically.

    Args:
        path (str | Path): the file to create or replace; it must end in ".safetensors".
        caches (list): mlx-lm caches, one per layer. metadata (dict[str, str]): the user metadata.

    Returns:
        Path: `path`.

    Raises:
        InputError: `path` does not end in ".safetensors" (mlx-lm's loader tells the format by it).
        WriteError: the file cannot be written (a full disk: "cannot write PATH: No space left on device");
            nothing is left behind.
    """
    path = Path(path)
    if path.suffix != SUFFIX:
        raise InputError(f"output {path} must end in {SUFFIX}: mlx_lm.generate --prompt-cache-file reads "
                         f"the file by that extension")

    def write(tmp):
        with open(tmp, "r+b") as f:  # in place: the temporary's lock is held on its inode
            save_prompt_cache(f, caches, metadata)

    try:
        return write_file(path, write)
    except (FileNotFoundError, IsADirectoryError):
        raise
    except OSError as e:  # a full disk, a size limit: the message alone would not say which file
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from None
