"""The durable disk tier: one safetensors file per chunk, written atomically.

A blob is written to a temporary name in the same folder, flushed, fsynced and renamed, and
the folder fsynced, so a killed writer leaves either no file or a whole one (stray
temporaries are removed by gc). Paths come only from validated cache IDs (`layout.named_path`),
so nothing a caller or the catalog names can point outside the store's folder.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rag_kvcache.errors import StoreFullError
from rag_kvcache.storage.layout import is_name, make_folder, named_path

__all__ = ["DiskTier", "StoreFullError"]


class DiskTier:
    name = "disk"

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        make_folder(self.root)

    def path(self, cache_id: str) -> Path:
        return named_path(self.root, "cache ID", cache_id)

    def put(self, cache_id: str, data: bytes) -> None:
        target = self.path(cache_id)
        target.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as err:
            Path(tmp).unlink(missing_ok=True)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFullError(
                    f"disk full while writing chunk {cache_id} under {self.root}; "
                    "free space or run `rag-kvcache gc`"
                ) from err
            raise
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def get(self, cache_id: str) -> bytearray | None:
        """The blob's bytes, read into a mutable buffer that the parsed tensors then share."""
        try:
            with open(self.path(cache_id), "rb", buffering=0) as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                view, read = memoryview(data), 0
                while read < len(data):  # one read() returns at most ~2 GiB, or less
                    got = f.readinto(view[read:])
                    if not got:
                        break
                    read += got
                view.release()
        except FileNotFoundError:
            return None
        return data if read == len(data) else data[:read]  # shrank while read: fails checks

    def contains(self, cache_id: str) -> bool:
        return self.path(cache_id).exists()

    def remove(self, cache_id: str) -> bool:
        try:
            self.path(cache_id).unlink()
            return True
        except FileNotFoundError:
            return False

    def ids(self) -> Iterator[str]:
        for file in self.root.glob("*/*.safetensors"):
            if is_name("cache ID", file.stem):
                yield file.stem

    def remove_temporaries(self) -> int:
        """Delete half-written files of killed writers; returns how many."""
        stray = list(self.root.glob("*/.tmp-*"))
        for tmp in stray:
            tmp.unlink(missing_ok=True)
        return len(stray)

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.root.glob("*/*.safetensors"))
