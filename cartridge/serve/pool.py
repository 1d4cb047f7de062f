"""The cartridges a server offers: found at start, loaded on first use, kept in an LRU under a byte budget
and a count (mlx_lm.server's --prompt-cache-bytes and --prompt-cache-size).

Every cartridge is answered with the one model the server loaded. A cartridge whose header records another
model's fingerprint is left out at start (one warning line; not listed, refused by name). One whose checks fail
or that was built with another model is refused (`Refused`, with the reason) and the others keep being served;
the refusal is remembered until the cartridge's files change. The cartridges built with the server's
model are indexed by their tokens (`shelf.PrefixIndex`): `match` finds those a base-model prompt starts with.
"""

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..tiers.schema import fold_tiers
from ..errors import CartridgeError, InputError
from ..format.pack import is_pack
from ..format.reader import open_cartridge
from ..format.writer import is_cartridge_dir
from ..read.load import load
from ..models.loader import DEFAULT_MODEL, default_gguf_path
from ..read.stored import built_with, check_fingerprint
from .shelf import SAVED, PrefixIndex

log = logging.getLogger("cartridge.serve")
SUFFIXES = (".cartz", ".cart")
BASE_ALIASES = ("default_model",)  # mlx_lm.server's name for its --model; a body without "model" means it too


class Refused(Exception):
    """A model id that cannot be served.

    Attributes:
        status (int): 404 for an unknown id, 422 for a cartridge that failed its checks or does not fit.
        code (str): "model_not_found", "cartridge_refused" or "cartridge_too_large". message (str).
    """

    def __init__(self, status, code, message):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class Entry:
    """One cartridge on offer.

    Attributes:
        name (str): its model id. path (Path): directory or .cartz file.
        info (CartridgeInfo | None): its header (None if the header could not be read).
        error (Refused | None): why it is refused, with the file signature it was refused for.
    """

    name: str
    path: Path
    info: object = None
    error: Refused = None
    refused_at: tuple = None
    loaded_at: tuple = None  # the files' signature when the loaded cartridge was read


def _is_cartridge(path):
    return is_cartridge_dir(path) or is_pack(path)


def find_cartridges(paths):
    """Map model ids to cartridge paths: each path is a cartridge (directory or .cartz) or a folder of them.

    Args:
        paths (list[str | Path]): as given on the command line.

    Returns:
        dict: name (the file name without .cart/.cartz) -> Path, sorted by name.

    Raises:
        InputError: a path that is neither, or two cartridges with the same name.
    """
    found = {}
    for raw in paths:
        path = Path(raw)
        if _is_cartridge(path) or (path.exists() and path.name.endswith(SUFFIXES)):
            items = [path]  # named as a cartridge: served, or refused with its error (not scanned as a folder)
        elif path.is_dir():
            # a damaged one is listed too (with its error), not left out unseen
            items = sorted(p for p in path.iterdir() if _is_cartridge(p) or p.name.endswith(SUFFIXES))
        else:
            raise InputError(f"{raw} is neither a cartridge (directory or .cartz) nor a folder of cartridges")
        for item in items:
            name = next((item.name[: -len(s)] for s in SUFFIXES if item.name.endswith(s)), item.name)
            if name in found and found[name].resolve() == item.resolve():
                continue  # the same cartridge given twice
            if name in found:
                raise InputError(f"two cartridges are named {name!r}: {found[name]} and {item}; rename one")
            found[name] = item
    return dict(sorted(found.items()))


def base_model_id(ref):
    """The model id of the base model itself: its file or folder name ("default": the GGUF's name)."""
    path = default_gguf_path() if ref == DEFAULT_MODEL else Path(ref)
    return path.stem if path.suffix == ".gguf" else path.name


def _signature(path):
    """What identifies the bytes of a cartridge on disk (name, mtime, size, inode of each of its files): a
    refusal is forgotten, and a loaded cartridge loaded and verified again, once they change."""
    try:
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        return tuple((f.name, st.st_mtime_ns, st.st_size, st.st_ino) for f in files for st in [f.stat()])
    except OSError:
        return None


def _count(n, word):
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _refusal(e):
    return Refused(422, "cartridge_refused", f"{type(e).__name__}: {e}")


class Pool:
    """Cartridges loaded on first use and kept, most recently used last, while their pages fit the budget.

    Args:
        paths (dict): name -> Path, from `find_cartridges`.
        lm (LoadedModel): the one model every cartridge is answered with.
        max_bytes (int | None): most page bytes (pages.bin, as mapped) kept loaded; None: no limit.
        verify (str): "pages" checks every page checksum at load (default), "header" skips them.
        attention (str): the attention policy passed to `cartridge.load`. Default: "auto".
        max_memory (int | None): `cartridge.load`'s max_memory. Default: None.
        max_count (int | None): most cartridges kept loaded; None: no limit. Default: None.
        model_name (str | None): the model reference as given (--model), also a name of the base model.

    Attributes:
        left_out (dict): name -> Entry of the cartridges whose header names another model: not offered.
    """

    def __init__(self, paths, lm, max_bytes=None, verify="pages", attention="auto", max_memory=None, max_count=None,
                 model_name=None):
        self.lm, self.max_bytes, self.verify, self.attention = lm, max_bytes, verify, attention
        self.max_memory, self.max_count = max_memory, max_count
        self.base_id = base_model_id(lm.ref)
        self.base_names = {self.base_id, lm.ref, model_name, *BASE_ALIASES} - {None}
        clash = sorted(self.base_names & set(paths))
        if clash:
            raise InputError(f"a cartridge is named {clash[0]!r}, a name of the base model; rename it")
        self._lock = threading.RLock()  # models() is read from the event loop, the shelf's writer adds and removes
        self.index = PrefixIndex()
        self.entries, self.left_out = {}, {}
        for name, path in paths.items():
            self._offer(name, path)
        for name, entry in list(self.entries.items()):
            if entry.info is not None and entry.info.fingerprint.get("id") != lm.fingerprint["id"]:
                self.left_out[name] = self.entries.pop(name)
        if self.left_out:
            log.warning("%s left out, built with another model than %s: %s", _count(len(self.left_out), "cartridge"),
                        lm.label, ", ".join(f"{name} ({built_with(e.info)})" for name, e in self.left_out.items()))
        self._loaded = OrderedDict()  # name -> Cartridge, least recently used first

    def _offer(self, name, path):
        entry = self._read_header(name, path)
        with self._lock:
            self.entries[name] = entry
            if entry.info is not None and entry.info.fingerprint.get("id") == self.lm.fingerprint["id"]:
                self.index.add(name, entry.info.tokens)

    def add(self, name, path):
        """Offer one more cartridge (a prefix the shelf saved)."""
        self._offer(name, Path(path))

    def remove(self, name):
        """Stop offering `name` (an evicted prefix): forgotten, unloaded, out of the index."""
        with self._lock:
            self.entries.pop(name, None)
            self._loaded.pop(name, None)
            self.index.remove(name)

    def is_base(self, name):
        """True for None or a name of the base model (its id, its reference, "default_model")."""
        return name is None or name in self.base_names

    def match(self, prompt):
        """Cartridges built with this model whose tokens a prompt starts with (at least one token after).

        Args:
            prompt (list[int]): the prompt's token ids.

        Returns:
            list[tuple[str, int]]: (name, tokens) longest first; among equal lengths the most faithful first
            (most stored bytes per token: fp16 before int8 before 4-bit tiers), then by name; each checked
            token by token.
        """
        with self._lock:
            hits = self.index.candidates(prompt)
            infos = {name: self.entries[name].info for name, _ in hits if name in self.entries}
        ids = np.asarray(prompt, dtype=np.uint32)
        found = [(name, n) for name, n in hits if name in infos and np.array_equal(infos[name].tokens, ids[:n])]
        return sorted(found, key=lambda hit: (-hit[1], -infos[hit[0]].bytes_per_token(), hit[0]))

    def _read_header(self, name, path):
        entry = Entry(name, path)
        try:
            entry.info, data = open_cartridge(path, verify="header")
            data.close()
        except CartridgeError as e:
            entry.error, entry.refused_at = _refusal(e), _signature(path)
        return entry

    @property
    def loaded_bytes(self):
        """Page bytes of the cartridges loaded now."""
        return sum(c.info.data_size for c in self._loaded.values())

    def get(self, name):
        """The loaded cartridge for `name`, or None for the base model (`is_base`).

        Raises:
            Refused: 404 for an unknown id; 422 for a cartridge that fails its checks, was built with
            another model, or has more page bytes than the whole budget.
        """
        if self.is_base(name):
            return None
        entry = self.entries.get(name)
        if name in self.left_out:  # not listed; named anyway: why
            try:
                check_fingerprint(self.left_out[name].info, self.lm.fingerprint, self.left_out[name].path, self.lm.ref)
            except CartridgeError as e:
                raise _refusal(e) from None
        if entry is None:
            raise Refused(404, "model_not_found", f"the model {name!r} does not exist; GET /v1/models lists "
                          f"{len(self.entries)} cartridge{'' if len(self.entries) == 1 else 's'} and the base "
                          f"model {self.base_id!r}")
        with self._lock:
            cart = self._loaded.get(name)
            if cart is not None:
                if entry.loaded_at == _signature(entry.path):
                    self._loaded.move_to_end(name)
                    return cart
                del self._loaded[name]  # its files changed since it was verified: read and verify them again
        if entry.error is not None and entry.refused_at == _signature(entry.path):
            raise entry.error
        if entry.info is not None:
            self._check_size(name, entry.info.data_size)
        return self._load(entry)

    def _load(self, entry):
        signature = _signature(entry.path)
        try:
            if entry.info is not None:  # refuse another model's cartridge before reading its pages
                check_fingerprint(entry.info, self.lm.fingerprint, entry.path, self.lm.ref)
            cart = load(entry.path, model=self.lm, verify=self.verify, attention=self.attention,
                        max_memory=self.max_memory)
        except CartridgeError as e:
            with self._lock:
                entry.error, entry.refused_at = _refusal(e), _signature(entry.path)
            raise entry.error from None
        with self._lock:
            entry.info, entry.error, entry.loaded_at = cart.info, None, signature
            if self.entries.get(entry.name) is entry:  # not removed (evicted) while it loaded
                self._make_room(entry.name, cart.info.data_size)
                self._loaded[entry.name] = cart
        return cart

    def _check_size(self, name, size):
        if self.max_bytes is not None and size > self.max_bytes:
            raise Refused(422, "cartridge_too_large", f"cartridge {name!r} maps {size:,} page bytes; "
                          f"--max-bytes is {self.max_bytes:,}")

    def _make_room(self, name, size):
        if self.max_bytes is not None:
            self._check_size(name, size)
        while self._loaded and ((self.max_bytes is not None and self.loaded_bytes + size > self.max_bytes)
                                or (self.max_count is not None and len(self._loaded) >= self.max_count)):
            self._loaded.popitem(last=False)  # the mapping closes once its last array is gone

    def models(self):
        """The /v1/models entries: every cartridge, then the base model.

        Returns:
            list[dict]: OpenAI model objects with `base_model`, `tier`, `tiers`, `tokens`, `bytes`
            (page bytes), `loaded` and `saved_prefix` (written by `--save-prefixes-over`); a refused
            cartridge also has `error`.
        """
        with self._lock:
            rows = [self._row(e) for e in self.entries.values()]
        rows.append({"id": self.base_id, "object": "model", "created": int(time.time()), "owned_by": "cartridge",
                     "base_model": self.lm.ref, "cartridge": False, "tokens": 0, "bytes": 0, "loaded": True})
        return rows

    def _row(self, entry):
        row = {"id": entry.name, "object": "model", "created": int(_mtime(entry.path)), "owned_by": "cartridge",
               "cartridge": True, "path": str(entry.path), "loaded": entry.name in self._loaded,
               "saved_prefix": bool(SAVED.fullmatch(entry.path.name))}
        if entry.info is not None:
            tiers = fold_tiers(entry.info.tiers)
            uniform = len(tiers) == 1 and tiers[0]["k"] == tiers[0]["v"]
            row.update(base_model=entry.info.model_ref, tier=tiers[0]["k"] if uniform else "mixed", tiers=tiers,
                       tokens=len(entry.info.tokens), bytes=entry.info.data_size)
        if entry.error is not None:
            row["error"] = entry.error.message
        return row


def _mtime(path):
    try:
        return path.stat().st_mtime
    except OSError:
        return 0
