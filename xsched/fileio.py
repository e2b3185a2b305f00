"""Small file helpers shared by every stage: atomic writes with one-line errors."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from xsched.errors import UserError


def describe_os_error(exc: OSError, path: Path | str) -> str:
    """One line that says what went wrong with ``path`` and what to do about it."""
    if exc.errno == errno.ENOSPC:
        return f"{path}: no space left on the device; free some space or write elsewhere"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{path}: not writable ({exc.strerror}); choose another location"
    if exc.errno == errno.ENOENT:
        return f"{path}: directory does not exist; create it first"
    return f"{path}: {exc.strerror or exc}"


def check_writable(path: Path | str, flag: str) -> None:
    """Fail before long work if ``path`` (given as ``flag``) cannot be written: its directory is
    missing or read-only, or it is a directory itself."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{path}: is a directory; pass a file path to {flag}")
    parent = p.resolve().parent
    if not parent.is_dir():
        raise UserError(f"{path}: directory {parent} does not exist; create it or pass another {flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{path}: directory {parent} is not writable; pass another {flag}")


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename."""
    path = Path(path)
    tmp_name = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
        tmp_name = None
    except OSError as exc:
        raise UserError(describe_os_error(exc, path)) from None
    finally:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))
