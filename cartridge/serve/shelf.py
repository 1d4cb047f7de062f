"""The shelf as a prompt cache: find the cartridge whose tokens start a prompt (`PrefixIndex`), and save
the prefix of a prompt that matched none as a new cartridge after its answer (`Shelf`).

    request ─► rendered prompt tokens ─► longest cartridge token prefix (same model fingerprint) ─► its pages
                                                         │ none, and the prefix is over N tokens
    answer sent ─► generation thread: encode the prefix's K/V (fp16) ─► writer thread: write atomically
                   into the shelf, evict least recently used saved prefixes past --shelf-bytes

A saved prefix is an ordinary cartridge (verifiable, servable, `inspect`-able) named by the content hash
of (model fingerprint, token ids): `prefix-<16 hex>.cart`. Only saved prefixes are ever evicted; a
cartridge the user put on the shelf is never deleted. The least recently used order is kept in the saved
prefixes' directory modification times (set when a prefix answers), so it survives a restart.
"""

import hashlib
import logging
import os
import queue
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..write.encode import header_extras, write_layers
from ..write.options import DEFAULT_PAGE_SIZE, fit_page_size
from ..errors import CartridgeError, InputError
from ..format.atomic import clean_stale
from ..format.writer import CartridgeWriter, check_output_folder, check_space
from ..models.families import plan_layers
from ..models.prompt import encode_text, prompt_mode
from ..tiers import schema_for

SAVED = re.compile(r"prefix-[0-9a-f]{16}\.cart")
LEFTOVER = re.compile(r"\.(prefix-[0-9a-f]{16}\.cart)\.(tmp|old|new)-")  # `format.atomic`'s temporaries
EVERY_TOKEN_KINDS = ("attention", "dense")  # layers whose cache keeps every token's K/V after the answer
SHELF_TIER = "fp16"
log = logging.getLogger("cartridge.serve")


def _digests(tokens, lengths):
    """(n, BLAKE2b digest of tokens[:n]) for each n of the ascending `lengths`, in one pass over the tokens."""
    ids = np.asarray(tokens, dtype="<u4")
    h, at = hashlib.blake2b(digest_size=16), 0
    for n in lengths:
        h.update(ids[at:n].tobytes())
        at = n
        yield n, h.copy().digest()


class PrefixIndex:
    """Cartridges by the digest of their token ids: the ones a prompt starts with, in O(prompt) hashing.

    Like mlx_lm.server's prompt cache (`LRUPromptCache.fetch_nearest_cache`, its "shorter" case): a stored
    sequence is used when it is a prefix of the prompt, with at least one prompt token after it.
    """

    def __init__(self):
        self._names = {}  # (n, digest) -> [names]
        self._keys = {}  # name -> (n, digest)

    def add(self, name, tokens):
        """Index `name`'s token ids (list[int] or np.ndarray, at least one)."""
        key = next(_digests(tokens, [len(tokens)]))
        self._keys[name] = key
        self._names.setdefault(key, []).append(name)

    def remove(self, name):
        """Forget `name` (no-op if unknown)."""
        key = self._keys.pop(name, None)
        if key is not None:
            self._names[key].remove(name)
            if not self._names[key]:
                del self._names[key]

    def candidates(self, prompt):
        """Names whose tokens are a proper prefix of `prompt` (by digest), longest first.

        Returns:
            list[tuple[str, int]]: (name, its token count).
        """
        lengths = sorted({n for n, _ in self._names if n < len(prompt)})
        hits = [(name, n) for n, d in _digests(prompt, lengths) for name in self._names.get((n, d), ())]
        return hits[::-1]


def prefix_name(fingerprint_id, tokens):
    """`prefix-<16 hex>`: SHA-256 of the model fingerprint id and the little-endian uint32 token ids."""
    digest = hashlib.sha256(fingerprint_id.encode() + np.asarray(tokens, dtype="<u4").tobytes()).hexdigest()
    return f"prefix-{digest[:16]}"


def dir_bytes(path):
    """Bytes of the files in a cartridge directory."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


class Recorded:
    """Stands in for `CartridgeWriter` on the generation thread: keeps the encoded extents and records, so
    that the disk work (`write`) runs on another thread without any MLX call.

    Args:
        dest (Path): the cartridge to create. force (bool): unused (never replaces).
    """

    def __init__(self, dest, force=False):
        self.dest, self.extents, self.records = Path(dest), [], []
        self.header = self.token_ids = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_extent(self, layer, side, component, pages):
        """Keep one extent (`CartridgeWriter.add_extent`'s arguments; pages: np.ndarray)."""
        self.extents.append((layer, side, component, np.ascontiguousarray(pages)))

    def add_record(self, key, raw):
        """Keep one binary index record."""
        self.records.append((key, bytes(raw)))

    def commit(self, header, token_ids):
        """Keep the header and the token ids; returns this (what `write_layers` returns)."""
        self.header, self.token_ids = header, np.asarray(token_ids, dtype=np.uint32)
        return self

    @property
    def nbytes(self):
        """Page bytes held (about the cartridge's size on disk)."""
        return sum(e[3].nbytes for e in self.extents)

    def write(self):
        """Write the cartridge (atomically: all of it, or nothing at `dest`).

        Returns:
            Path: the published directory.

        Raises:
            WriteError: the disk is full, the folder cannot be written, ... (nothing is left behind).
        """
        check_space(self.dest, self.nbytes + (1 << 20))
        with CartridgeWriter(self.dest) as writer:
            for extent in self.extents:
                writer.add_extent(*extent)
            for record in self.records:
                writer.add_record(*record)
            return writer.commit(self.header, self.token_ids)


class Shelf:
    """Saved prefixes of one folder: write-behind of new ones, least-recently-used eviction by bytes.

    Made on the generation thread (it probes the model's cache kinds once); `capture` runs there too, the
    writes on a thread of its own. A write that fails (full disk, folder gone read-only) is one warning
    line; the server goes on serving.

    Args:
        folder (Path): the shelf (the first served folder). pool (Pool): where saved prefixes are offered.
        min_tokens (int): save a prefix of more than this many tokens. max_bytes (int): saved prefixes' bytes.

    Raises:
        InputError: a model with layers that keep only part of the prompt (sliding window, recurrent), whose
            prefix state is gone once the answer is generated.
        WriteError: the folder cannot be written.
    """

    def __init__(self, folder, pool, min_tokens, max_bytes):
        self.folder, self.pool, self.min_tokens, self.max_bytes = Path(folder), pool, min_tokens, max_bytes
        check_output_folder(self.folder / "probe.cart")
        lm = pool.lm
        self.plans = plan_layers(lm.model, encode_text(lm.tokenizer, "Is this prefix stored?", True))
        kinds = sorted({p.kind for p in self.plans} - set(EVERY_TOKEN_KINDS))
        if kinds:
            raise InputError(f"--save-prefixes-over: this model has {', '.join(kinds)} layers, which keep only "
                             f"part of a prompt; its prefixes cannot be saved after an answer")
        self.schema = schema_for(len(self.plans), SHELF_TIER, None, None, 0)
        self._lock = threading.Lock()
        self._saved = self._scan()  # name -> (path, bytes), least recently used first
        self._pending = set()
        self._queue = queue.Queue(maxsize=1)  # one prefix waiting, one being written: the memory they hold
        self._evict()
        self._thread = threading.Thread(target=self._run, name="cartridge-shelf", daemon=True)
        self._thread.start()

    def _scan(self):
        for entry in self.folder.iterdir():
            leftover = LEFTOVER.match(entry.name)
            if leftover:  # a write or an eviction that died: its lock is gone
                clean_stale(self.folder / leftover.group(1))
        found = [(p.stat().st_mtime, p) for p in self.folder.iterdir() if SAVED.fullmatch(p.name) and p.is_dir()]
        return OrderedDict((p.name[:-5], (p, dir_bytes(p))) for _, p in sorted(found))

    @property
    def saved_bytes(self):
        """Bytes of the saved prefixes on the shelf."""
        with self._lock:
            return sum(b for _, b in self._saved.values())

    def touch(self, name):
        """`name` answered a prompt: the most recently used (on disk too: its directory's mtime)."""
        with self._lock:
            if name not in self._saved:
                return
            self._saved.move_to_end(name)
            path = self._saved[name][0]
        try:
            os.utime(path)
        except OSError:
            pass  # the order in memory still holds; only a restart forgets it

    def capture(self, tokens, text, caches):
        """Encode the K/V of `tokens` from the caches of the answer just generated and queue its write.

        Args:
            tokens (list[int]): the prefix (the first tokens the caches hold). text (str): the prefix's text
                (recorded as the source document: its SHA-256 and first line).
            caches (list): the request's mlx-lm caches, filled past the prefix.

        Returns:
            str | None: the name queued, or None (already on the shelf or queued, larger than --shelf-bytes,
            or a write still waiting: one info line).
        """
        lm = self.pool.lm
        name = prefix_name(lm.fingerprint["id"], tokens)
        with self._lock:
            if name in self._saved or name in self._pending:
                return None
        if self._queue.full():
            log.info("prefix of %s tokens not saved: another is still being written", f"{len(tokens):,}")
            return None
        page_size = fit_page_size(DEFAULT_PAGE_SIZE, len(tokens))
        rec = write_layers(self.folder / f"{name}.cart", lm, tokens, caches, self.schema, self.plans, page_size,
                           prompt_mode(lm.tokenizer), source=header_extras(text or " ", None, None),
                           open_writer=Recorded)
        if rec.nbytes > self.max_bytes:
            log.info("prefix of %s tokens not saved: its pages alone are %s bytes, more than --shelf-bytes %s",
                     f"{len(tokens):,}", f"{rec.nbytes:,}", f"{self.max_bytes:,}")
            return None
        with self._lock:
            self._pending.add(name)
        self._queue.put(rec)
        return name

    def _run(self):
        while True:
            rec = self._queue.get()
            try:
                if rec is None:
                    return
                self._write(rec)
            finally:
                self._queue.task_done()

    def wait(self):
        """Block until every queued prefix is written (or failed)."""
        self._queue.join()

    def _write(self, rec):
        name = rec.dest.name[:-5]
        try:
            path = rec.write()
            size = dir_bytes(path)
        except (CartridgeError, OSError) as e:
            log.warning("prefix %s not saved: %s", name, e)
            return
        finally:
            with self._lock:
                self._pending.discard(name)
        with self._lock:
            self._saved[name] = (path, size)
        self.pool.add(name, path)
        log.info("saved prefix %s: %s tokens, %s bytes", name, f"{len(rec.token_ids):,}", f"{size:,}")
        self._evict()

    def _evict(self):
        """Remove least recently used saved prefixes until their bytes fit --shelf-bytes (the one just written
        last: only if its files alone are more)."""
        while True:
            with self._lock:
                if sum(b for _, b in self._saved.values()) <= self.max_bytes or not self._saved:
                    return
                name, (path, size) = self._saved.popitem(last=False)
            self.pool.remove(name)
            try:  # moved aside first (atomic), so a crash leaves no half-deleted cartridge under its name
                aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
                os.rename(path, aside / path.name)
                shutil.rmtree(aside)
            except OSError as e:
                log.warning("could not evict %s: %s", path, e.strerror or e)
                continue
            log.info("evicted prefix %s (%s bytes) past --shelf-bytes %s", name, f"{size:,}", f"{self.max_bytes:,}")

    def close(self):
        """Write what is queued, then stop the writer thread."""
        self._queue.put(None)
        self._thread.join()
