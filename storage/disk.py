"""The durable disk tier: one safetensors file per chunk, written atomically.

A blob is written to a temporary name in the same folder, flushed, fsynced and renamed, and
the folder fsynced, so a killed writer leaves either no file or a whole one (stray
temporaries are removed by gc; a live writer's are not: it holds a lock on its file). Paths
come only from validated cache IDs (`layout.named_path`), so nothing a caller or the catalog
names can point outside the store's folder.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rag_kvcache.errors import StoreError, StoreFullError
from rag_kvcache.storage.layout import is_name, make_folder, named_path

__all__ = ["DiskTier", "StoreFullError"]
TEMPORARY_PREFIX = ".tmp-"


def open_regular(path: Path) -> int | None:
    """A read-only descriptor of the regular file at `path`, or None: missing, or damage in
    its place (a folder, a FIFO or device, a symlink loop, a file that cannot be opened), which
    the store then treats as a lost blob and re-encodes. Opened without blocking, so a FIFO
    cannot hang the read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


class DiskTier:
    name = "disk"

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        make_folder(self.root)

    def path(self, cache_id: str) -> Path:
        return named_path(self.root, "cache ID", cache_id)

    def put(self, cache_id: str, data: bytes) -> None:
        target = self.path(cache_id)
        tmp = ""
        try:
            # a file in the folder's place: an OSError. The blobs folder itself is made again
            # if it was deleted under a running process (it failed every write until a
            # restart), but never the store folder above it (a disk unmounted there)
            self.root.mkdir(exist_ok=True)
            target.parent.mkdir(exist_ok=True)
            self._clear_non_file(target)
            # the writer's PID in the name: between creating the file and locking it, gc
            # tells a live writer (keep) from a dead one (remove) by it
            fd, tmp = tempfile.mkstemp(
                prefix=f"{TEMPORARY_PREFIX}{os.getpid()}-", dir=target.parent
            )
            with os.fdopen(fd, "wb") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # held until renamed: gc sees a live writer
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                os.replace(tmp, target)
        except OSError as err:
            if tmp:
                Path(tmp).unlink(missing_ok=True)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFullError(
                    f"disk full while writing chunk {cache_id} under {self.root}; "
                    "free space or run `rag-kvcache gc`"
                ) from err
            raise StoreError(
                f"cannot write chunk {cache_id} under {self.root}: {err.strerror or err}; "
                "nothing was stored (check the disk)"
            ) from err
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def get(self, cache_id: str, nbytes: int | None = None) -> bytearray | None:
        """The blob's bytes, read into a mutable buffer that the parsed tensors then share;
        None where no readable file is (`open_regular`). Damage reads as empty bytes, which
        fail every check: a file of another size than `nbytes` (the catalog's; not read, so
        a blob replaced by a huge file costs nothing), or a read the disk fails (EIO)."""
        fd = open_regular(self.path(cache_id))
        if fd is None:
            return None
        with open(fd, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if nbytes is not None and size != nbytes:
                return bytearray()
            data = bytearray(size)
            view, read = memoryview(data), 0
            try:
                while read < len(data):  # one read() returns at most ~2 GiB, or less
                    got = f.readinto(view[read:])
                    if not got:
                        break
                    read += got
            except OSError:  # the disk failed the read: damage
                return bytearray()
            finally:
                view.release()
        return data if read == len(data) else data[:read]  # shrank while read: fails checks

    def contains(self, cache_id: str) -> bool:
        return self.path(cache_id).is_file()

    def remove(self, cache_id: str) -> bool:
        path = self.path(cache_id)
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except IsADirectoryError:
            return self._clear_non_file(path)

    @staticmethod
    def _clear_non_file(path: Path) -> bool:
        """A folder where a blob belongs is damage (never ours to keep): remove it, so the
        blob can be written; a symlink is removed, never followed."""
        if path.is_symlink():
            path.unlink()
            return True
        if path.is_dir():
            shutil.rmtree(path)
            return True
        return False

    def ids(self) -> Iterator[str]:
        """The cache IDs with a blob file where that ID's blob belongs (a folder in a blob's
        place is not one, nor a file under another ID's folder: no read or removal of that
        ID would ever reach it)."""
        for file in self.root.glob("*/*.safetensors"):
            stem = file.stem
            if is_name("cache ID", stem) and self.path(stem) == file and file.is_file():
                yield stem

    def remove_temporaries(self, older_than_s: float = 600.0) -> int:
        """Delete half-written files of dead writers; returns how many. A live writer holds
        a lock on its temporary file until it renames it (a killed one's lock is gone), and
        a file younger than `older_than_s` is left too (its writer may not have locked it
        yet)."""
        removed = 0
        for tmp in self.root.glob(f"*/{TEMPORARY_PREFIX}*"):
            try:
                info = tmp.lstat()  # a symlink is not followed
                if time.time() - info.st_mtime < older_than_s:
                    continue
                if not stat.S_ISREG(info.st_mode):  # no writer makes these: damage (and a
                    if not self._clear_non_file(tmp):  # FIFO would block the open below)
                        tmp.unlink()
                    removed += 1
                    continue
                fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            except FileNotFoundError:  # renamed by its writer meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live writer holds it
                continue
            else:
                if not _writer_alive(tmp.name):  # (alive: it has not locked it yet)
                    tmp.unlink(missing_ok=True)
                    removed += 1
            finally:
                os.close(fd)
        return removed

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.root.glob("*/*.safetensors") if f.is_file())

    def close(self) -> None:
        """Nothing held open between calls (a `BlobTier` closes what it holds)."""


def _writer_alive(name: str) -> bool:
    """Whether the process named in a temporary file's name (`.tmp-<pid>-...`) still runs on
    this machine. A name without a PID (an older writer's) counts as dead; a PID reused by
    another process keeps a dead writer's file until it exits (harmless)."""
    return process_alive(name.removeprefix(TEMPORARY_PREFIX).partition("-")[0])


def process_alive(pid: str) -> bool:
    """Whether the process `pid` (digits; anything else counts as dead) runs on this machine."""
    if not pid.isascii() or not pid.isdigit() or int(pid) > 2**22:  # (past any Linux PID:
        return False  # os.kill's OverflowError)
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
