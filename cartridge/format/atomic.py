"""Atomic output directories: write into a locked hidden sibling, publish by rename, clean up after
writers that died.

    .NAME.new-XXXX   just created, not yet locked (lives for microseconds)
    .NAME.tmp-XXXX   being written; its writer holds an exclusive flock on the directory
    NAME             published: complete and never written again

Plain files (`write_file`, or `TempDir(..., directory=False)`) follow the same scheme. Published
directories and files get the mode a plain mkdir()/open() would give (0o777/0o666 & ~umask), not the
0700/0600 of mkdtemp/mkstemp.

A writer killed at any point (even SIGKILL) leaves NAME as it was and a `.tmp-` sibling whose lock
died with it; the next writer of NAME removes such siblings (it can lock them, so nobody owns them) and
never touches a locked one. `CARTRIDGE_CRASH_AT=<stage>` makes a writer SIGKILL itself at that named
stage, for the crash tests (tests/system/test_crash.py).
"""

import ctypes
import errno
import fcntl
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

CRASH_ENV = "CARTRIDGE_CRASH_AT"
STALE_NEW_SECONDS = 3600  # a `.new-` directory older than this lost its writer between mkdir and lock
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: mkdtemp/mkstemp make 0700/0600, a published cartridge gets the usual mode


def crash_point(stage):
    """SIGKILL this process if `CARTRIDGE_CRASH_AT` names `stage` (a test hook; a no-op otherwise)."""
    if os.environ.get(CRASH_ENV) == stage:
        os.kill(os.getpid(), signal.SIGKILL)


def _try_lock(path):
    """An fd holding an exclusive flock on `path` (a directory or file), or None if another process holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def clean_stale(dest):
    """Remove temporaries of `dest` left by dead writers (unlocked `.tmp-`, `.old-`; old `.new-`).

    Returns:
        list[str]: names removed.
    """
    dest = Path(dest)
    removed = []
    if not dest.parent.is_dir():
        return removed
    for entry in dest.parent.iterdir():
        kind = entry.name[len(dest.name) + 2:len(dest.name) + 6] if entry.name.startswith(f".{dest.name}.") else ""
        if kind not in ("tmp-", "old-", "new-") or entry.is_symlink():
            continue
        if kind == "new-" and time.time() - entry.stat().st_mtime < STALE_NEW_SECONDS:
            continue
        fd = _try_lock(entry)
        if fd is not None:
            _remove(entry)
            os.close(fd)
            removed.append(entry.name)
    return removed


def _remove(path):
    if Path(path).is_dir() and not Path(path).is_symlink():  # a symlink is unlinked, never followed
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


def _locked_temp(dest, directory):
    """Create `.NAME.new-XXXX`, lock it, rename it to `.NAME.tmp-XXXX`; return (path, lock fd)."""
    if directory:
        new = Path(tempfile.mkdtemp(prefix=f".{dest.name}.new-", dir=dest.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.new-", dir=dest.parent)
        os.close(fd)
        new = Path(name)
    os.chmod(new, (0o777 if directory else 0o666) & ~_UMASK)
    lock = _try_lock(new)
    path = new.with_name(new.name.replace(".new-", ".tmp-", 1))
    os.rename(new, path)  # the lock follows the inode: cleaners only remove unlocked `.tmp-` names
    return path, lock


def fsync_dir(path):
    """fsync a directory, so that renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a, b):
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE, macOS renamex_np RENAME_SWAP)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        rc = libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rc = libc.renamex_np(os.fsencode(a), os.fsencode(b), 0x2)
    else:
        return False
    return rc == 0


class TempDir:
    """A locked hidden sibling of `dest` to write into; `publish()` renames it into place.

    Args:
        dest (str | Path): the directory (or, with directory=False, the file) to create or replace.
        directory (bool): make a directory; False makes an empty file. Default: True.

    Attributes:
        path (Path): the temporary directory or file.
    """

    def __init__(self, dest, directory=True):
        self.dest = Path(dest)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(self.dest)
        self.path, self._lock = _locked_temp(self.dest, directory)
        crash_point("temp-created")

    def discard(self):
        """Remove the temporary directory (or file) and release the lock."""
        _remove(self.path)
        self._release()

    def _release(self):
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def publish(self, force):
        """Move the finished directory (or file) to `dest`; an existing one is swapped out atomically.

        Args:
            force (bool): replace an existing `dest`.
        """
        if self.path.is_dir():
            fsync_dir(self.path)
        crash_point("before-publish")
        if self.dest.is_dir() and force:
            old = self.path
            if not _exchange(self.path, self.dest):  # no atomic swap here: move the old one aside first
                old = Path(tempfile.mkdtemp(prefix=f".{self.dest.name}.old-", dir=self.dest.parent))
                os.rename(self.dest, old / self.dest.name)
                os.rename(self.path, self.dest)
            crash_point("after-exchange")
            fsync_dir(self.dest.parent)
            _remove(old)
        else:  # a new directory, or a file (os.replace swaps files atomically everywhere)
            (os.replace if self.path.is_file() else os.rename)(self.path, self.dest)
            fsync_dir(self.dest.parent)
        self._release()
        crash_point("published")
        return self.dest


def write_file(dest, write):
    """Create or replace the plain file `dest` atomically: `write(tmp)` fills a locked hidden sibling
    (mode 0o666 & ~umask, as open() gives), which is then renamed onto `dest`. If anything fails, `dest`
    is left as it was and the temporary is removed. Callers refuse an existing `dest` beforehand when
    replacing it was not asked for.

    Args:
        dest (str | Path): the file to write; its folder must exist (it is not created).
        write (callable): called with the temporary's Path; writes the whole content there (by name,
            in place: the lock is held on that inode).

    Returns:
        Path: `dest`.

    Raises:
        FileNotFoundError: the folder of `dest` does not exist. IsADirectoryError: `dest` is a directory.
    """
    dest = Path(dest)
    if not dest.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "folder does not exist", str(dest.parent))
    tmp = TempDir(dest, directory=False)
    try:
        write(tmp.path)
        return tmp.publish(force=False)  # files are replaced by os.replace; a directory at dest is refused
    except BaseException:
        tmp.discard()
        raise
