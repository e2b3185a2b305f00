"""Disk I/O that bypasses the page cache, for the profiler and the engine's disk tier.

A read that hits the page cache measures RAM, not the disk, and flatters any plan that puts
weights or KV cache on disk. So every transfer here goes around the cache:

* ``o_direct`` (preferred): the file is opened with ``O_DIRECT``; buffers, offsets and lengths
  must be multiples of ``ALIGN_BYTES`` (4 KiB covers 512-byte and 4 KiB logical blocks).
* ``fadvise`` (fallback where the filesystem refuses ``O_DIRECT``): writes are followed by
  ``fdatasync`` and ``posix_fadvise(DONTNEED)`` so the written pages are clean and dropped;
  reads drop the range with ``DONTNEED`` first, so the data comes from the device.

Buffers come from :func:`aligned_empty`: a uint8 numpy array whose data pointer is aligned,
usable directly as a torch tensor (``torch.from_numpy(buf[:n]).view(dtype)``). Numpy is the
only dependency, so this module imports without torch.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from xsched.errors import UserError
from xsched.fileio import describe_os_error, scratch_file

ALIGN_BYTES = 4096
Method = Literal["o_direct", "fadvise"]


def round_up(nbytes: int, align: int = ALIGN_BYTES) -> int:
    """Smallest multiple of ``align`` that holds ``nbytes``."""
    return -(-int(nbytes) // align) * align


def aligned_empty(nbytes: int, align: int = ALIGN_BYTES) -> np.ndarray:
    """Uninitialised uint8 array of ``round_up(nbytes)`` bytes whose address is ``align``-aligned."""
    size = round_up(nbytes, align)
    raw = np.empty(size + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    buf = raw[start:start + size]
    assert buf.ctypes.data % align == 0
    return buf


def is_aligned(buf: np.ndarray, offset: int, align: int = ALIGN_BYTES) -> bool:
    """Whether a transfer of ``buf`` at ``offset`` satisfies O_DIRECT's alignment rules."""
    return buf.ctypes.data % align == 0 and buf.nbytes % align == 0 and offset % align == 0


def _view(buf: np.ndarray) -> memoryview:
    if not (isinstance(buf, np.ndarray) and buf.flags.c_contiguous):
        raise ValueError("disk I/O needs a C-contiguous numpy array (use aligned_empty)")
    return memoryview(buf.reshape(-1).view(np.uint8))


class DirectFile:
    """A file read and written around the page cache; ``method`` says how.

    ``direct=None`` tries ``O_DIRECT`` and falls back to ``fadvise`` when the filesystem
    refuses it (at open or at the first transfer); ``True`` insists on ``O_DIRECT``; ``False``
    uses the fallback. OS errors become ``UserError`` with a one-line message (full disk,
    permission, missing directory).
    """

    def __init__(self, path: str | Path, mode: Literal["r", "w", "rw"] = "rw", direct: bool | None = None):
        self.path = Path(path)
        flags = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT, "rw": os.O_RDWR | os.O_CREAT}[mode]
        self._auto = direct is None
        self.method: Method = "fadvise"
        self._fd = -1
        try:
            if direct is not False:
                try:
                    self._fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                    self.method = "o_direct"
                except OSError as exc:
                    if exc.errno != errno.EINVAL or direct:
                        raise
            if self._fd < 0:
                self._fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise UserError(describe_os_error(exc, self.path)) from None

    # ----------------------------------------------------------------- plumbing
    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _drop_direct(self) -> None:
        """Switch an open descriptor from O_DIRECT to the fadvise fallback (Linux allows it)."""
        fl = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fl & ~os.O_DIRECT)
        self.method = "fadvise"

    def _check(self, buf: np.ndarray, offset: int) -> None:
        if self.method == "o_direct" and not is_aligned(buf, offset):
            raise ValueError(f"O_DIRECT needs {ALIGN_BYTES}-aligned buffer address, length and offset "
                             f"(got length {buf.nbytes}, offset {offset}); allocate with aligned_empty")

    def _io(self, fn, buf: np.ndarray, offset: int) -> int:
        """Run a positional transfer loop, falling back once if O_DIRECT is refused mid-way."""
        self._check(buf, offset)
        try:
            return fn(_view(buf), offset)
        except OSError as exc:
            if exc.errno == errno.EINVAL and self.method == "o_direct" and self._auto:
                self._drop_direct()
                return self._io(fn, buf, offset)
            raise UserError(describe_os_error(exc, self.path)) from None

    # ----------------------------------------------------------------- transfers
    def allocate(self, nbytes: int) -> None:
        """Reserve ``nbytes`` on disk up front, so a full disk fails now and not mid-run."""
        try:
            os.posix_fallocate(self._fd, 0, int(nbytes))
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                os.ftruncate(self._fd, int(nbytes))  # filesystem without fallocate
                return
            raise UserError(describe_os_error(exc, self.path)) from None

    def write_at(self, buf: np.ndarray, offset: int, sync: bool = True) -> None:
        """Write all of ``buf`` at byte ``offset``; on return the data is on the device path.

        ``sync=False`` (fadvise method) leaves the data in the page cache until :meth:`flush`, so
        one fdatasync can cover many small writes; under O_DIRECT it changes nothing.
        """

        def loop(view: memoryview, off: int) -> int:
            done = 0
            while done < len(view):
                n = os.pwrite(self._fd, view[done:], off + done)
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                done += n
            if self.method == "fadvise" and sync:
                self._sync_drop(((off, done),))
            return done

        self._io(loop, buf, offset)

    def _sync_drop(self, ranges: Sequence[tuple[int, int]]) -> None:
        os.fdatasync(self._fd)
        for off, n in ranges:
            os.posix_fadvise(self._fd, off, n, os.POSIX_FADV_DONTNEED)

    def flush(self, ranges: Sequence[tuple[int, int]]) -> None:
        """After ``write_at(..., sync=False)``: one fdatasync, then drop each (offset, bytes) range."""
        if self.method != "fadvise" or not ranges:
            return
        try:
            self._sync_drop(ranges)
        except OSError as exc:
            raise UserError(describe_os_error(exc, self.path)) from None

    def read_into(self, buf: np.ndarray, offset: int) -> int:
        """Fill ``buf`` from byte ``offset``; returns the bytes read (fewer only at end of file)."""

        def loop(view: memoryview, off: int) -> int:
            if self.method == "fadvise":
                os.posix_fadvise(self._fd, off, len(view), os.POSIX_FADV_DONTNEED)
            done = 0
            while done < len(view):
                n = os.preadv(self._fd, [view[done:]], off + done)
                if n == 0:
                    break
                done += n
            return done

        return self._io(loop, buf, offset)


def probe_method(directory: str | Path) -> Method:
    """Which page-cache bypass works in ``directory`` (writes and removes a 4 KiB probe file)."""
    try:
        with scratch_file(directory, ".xsched-probe-") as name, DirectFile(name, "rw") as f:
            buf = aligned_empty(ALIGN_BYTES)
            buf.fill(7)
            f.write_at(buf, 0)
            f.read_into(buf, 0)
            return f.method
    except OSError as exc:
        raise UserError(describe_os_error(exc, directory)) from None
