"""The files calibrations live in (link tokens, LoRA adapters): safetensors bytes with string
metadata, written atomically with their sha256 and read back with clear errors; never pickle."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from rag_kvcache.errors import CalibrationError


def write_atomically(path: Path, data: bytes) -> str:
    """Write `data` to `path` through a temporary beside it; returns its sha256. A write that
    fails leaves no temporary, and its OSError names `path` (a folder of that name was
    reported as the temporary's error, and the temporary stayed)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):  # (a folder named as the temporary stays)
            tmp.unlink(missing_ok=True)
        if e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e
    return hashlib.sha256(data).hexdigest()


def read_checked(path: Path, what: str, checksum: str | None = None) -> bytes:
    """The bytes of `path`; with `checksum`, a mismatch is a CalibrationError (a damaged file)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CalibrationError(f"cannot read {what} {path}: {e}") from None
    if checksum is not None and hashlib.sha256(data).hexdigest() != checksum:
        raise CalibrationError(f"{what} {path} is damaged: its checksum does not match")
    return data


def metadata(data: bytes) -> dict[str, str]:
    """The string metadata of safetensors bytes (KeyError / ValueError if there is none)."""
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    meta = header["__metadata__"]
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    return meta
