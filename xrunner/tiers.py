"""The tiered store: gpu (compute device), cpu (host RAM) and disk, with one copy routine.

Every buffer the engine allocates goes through :class:`TierStore` under a name from
``xsimulator.costmodel.CostModel.memory`` (``weights_home``, ``kv_stage``, ``weight_relay``...),
so :class:`MemoryLedger` knows the live and peak bytes per tier and per name; a run reports
the measured peak next to the planned one.

- ``gpu``: tensors on the compute device. On a host without CUDA that is the CPU, and the
  tier is a declared RAM budget: a copy between ``gpu`` and ``cpu`` is still a real memcpy.
- ``cpu``: host RAM, 4 KiB-aligned (``xprofiler.diskio.aligned_empty``) so that disk reads can
  land in it with O_DIRECT, and page-locked with ``cudaHostRegister`` when the device is CUDA
  (asynchronous copies on the copy streams need pinned memory).
- ``disk``: byte ranges of files in a private directory under ``offload_dir``, read and
  written around the page cache (``xprofiler.diskio.DirectFile``). Weight records are 4 KiB
  aligned and moved with O_DIRECT; KV cache and activation rows (small, unaligned pieces) use
  the fadvise method (write + fdatasync + drop, drop + read), so every read comes from the disk.

:meth:`TierStore.copy` moves any slice between any two tiers; disk <-> gpu goes through a cpu
relay buffer the caller owns (it is an accounted buffer, not a hidden allocation).
"""

from __future__ import annotations

import secrets
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from xprofiler.diskio import DirectFile, aligned_empty, round_up
from xprofiler.profile import TIERS
from xsched.errors import UserError
from xsched.fileio import describe_os_error



class MemoryLedger:
    """Live and peak bytes per tier (and per buffer name); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live: dict[str, int] = {t: 0 for t in TIERS}
        self.peak: dict[str, int] = {t: 0 for t in TIERS}
        self.by_name: dict[tuple[str, str], int] = {}
        self.window_peak: dict[str, int] = {t: 0 for t in TIERS}  # peak since the last reset_window()
        self.freed_total: dict[str, int] = {t: 0 for t in TIERS}  # bytes ever given back, per tier

    def add(self, tier: str, name: str, nbytes: int) -> None:
        with self._lock:
            self.live[tier] += int(nbytes)
            self.by_name[tier, name] = self.by_name.get((tier, name), 0) + int(nbytes)
            self.peak[tier] = max(self.peak[tier], self.live[tier])
            self.window_peak[tier] = max(self.window_peak[tier], self.live[tier])

    def reset_window(self) -> dict[str, int]:
        """Start a new peak window at the live bytes (e.g. after a reconfiguration); returns the old window's peak."""
        with self._lock:
            old = dict(self.window_peak)
            self.window_peak = dict(self.live)
            return old

    def sub(self, tier: str, name: str, nbytes: int) -> None:
        with self._lock:
            self.live[tier] -= int(nbytes)
            self.by_name[tier, name] -= int(nbytes)
            self.freed_total[tier] += int(nbytes)

    @contextmanager
    def transient(self, tier: str, name: str, nbytes: int) -> Iterator[None]:
        """Account a short-lived working set (e.g. q/k/v of one GPU batch) while it is alive."""
        if not nbytes:
            yield
            return
        self.add(tier, name, nbytes)
        try:
            yield
        finally:
            self.sub(tier, name, nbytes)


def nbytes_of(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True)
class DiskSlice:
    """A contiguous tensor of ``shape``/``dtype`` stored at byte ``offset`` of ``file``."""

    file: DirectFile
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n

    def row(self, i: int) -> "DiskSlice":
        """Sub-tensor ``i`` along the first dimension (contiguous, so still one byte range)."""
        inner = self.shape[1:]
        return DiskSlice(self.file, self.offset + i * (self.nbytes // self.shape[0]), inner, self.dtype)

    def span(self, start: int, stop: int) -> "DiskSlice":
        """Entries ``start:stop`` along the first dimension (one byte range)."""
        per = self.nbytes // self.shape[0]
        return DiskSlice(self.file, self.offset + start * per, (stop - start,) + self.shape[1:], self.dtype)


@dataclass(frozen=True)
class Ref:
    """Where a slice lives: its tier and the tensor (gpu/cpu) or disk range."""

    tier: str
    data: torch.Tensor | DiskSlice


def _numpy_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor (shares memory)."""
    return t.view(torch.uint8).reshape(-1).numpy() if t.dtype != torch.uint8 else t.reshape(-1).numpy()


class TierStore:
    """Allocates accounted buffers on the three tiers and copies slices between them."""

    def __init__(self, device: torch.device, offload_dir: str | Path | None, ledger: MemoryLedger,
                 on_copy: Callable[[str, float, float, int], None] | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.ledger = ledger
        self.on_copy = on_copy  # (channel, start, end, bytes), for busy time and the trace
        self._offload_root = Path(offload_dir) if offload_dir is not None else None
        self.dir: Path | None = None
        self.files: dict[str, DirectFile] = {}
        self._ends: dict[str, int] = {}
        self._registered: list[int] = []
        # data pointer -> (numpy owner of an aligned cpu buffer, the bytes the tensor made of it holds)
        self._keep: dict[int, tuple[np.ndarray, int]] = {}
        self._free: dict[str, list[tuple[int, int]]] = {}  # per offload file: free (offset, size), sorted
        self._allocated: dict[str, int] = {}  # bytes fallocated per offload file
        # Per thread: writes awaiting one fdatasync (deferred_sync), its CUDA copy streams, and
        # whether it is an I/O queue's thread (mark_io_thread).
        self._thread = threading.local()

    # ----------------------------------------------------------------- allocation
    def empty(self, tier: str, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An accounted, zero-filled tensor on the gpu or cpu tier.

        Zeroed because masked KV columns (left padding, a refilled slot's columns before its first
        token) are never written but still enter ``probs @ V``: a weight of 0 times NaN garbage
        from uninitialised memory is NaN.
        """
        if tier == "gpu" and self.cuda:
            t = torch.empty(shape, dtype=dtype, device=self.device)
        elif tier in ("gpu", "cpu"):  # host memory (the gpu tier too on a host without CUDA): 4 KiB-aligned
            nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
            buf = aligned_empty(max(nbytes, 1))
            if self.cuda and nbytes:  # only the cpu tier gets here on a CUDA host
                ptr = buf.ctypes.data
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, buf.nbytes, 0))
                self._registered.append(ptr)
            self._keep[buf.ctypes.data] = buf, nbytes
            t = torch.from_numpy(buf[:nbytes]).view(dtype).view(shape)
        else:
            raise ValueError(f"use disk_region for the disk tier, not {tier!r}")
        t.zero_()
        self.ledger.add(tier, name, nbytes_of(t))
        return t

    def adopt(self, tier: str, name: str, t: torch.Tensor) -> torch.Tensor:
        """Account a tensor created elsewhere (the head weights from the loader)."""
        self.ledger.add(tier, name, nbytes_of(t))
        return t

    def release(self, tier: str, name: str, t: torch.Tensor) -> None:
        """Un-account ``t``; a host buffer from :meth:`empty` (the cpu tier, and the gpu tier on a host
        without CUDA) is also unpinned and dropped here, so its memory goes back to the OS once the
        caller's references are gone (a reconfiguration)."""
        self.ledger.sub(tier, name, nbytes_of(t))
        if t.device.type == "cpu":
            buf, _ = self._keep.pop(t.data_ptr(), (None, 0))
            if buf is not None and self.cuda and buf.ctypes.data in self._registered:
                torch.cuda.cudart().cudaHostUnregister(buf.ctypes.data)
                self._registered.remove(buf.ctypes.data)

    def free_region(self, name: str, ds: DiskSlice, align: bool = False) -> None:
        """Give a :meth:`disk_region` back: un-account it and let a later region reuse its bytes."""
        kind = next(k for k, f in self.files.items() if f is ds.file)
        size = round_up(ds.nbytes) if align else ds.nbytes
        self.ledger.sub("disk", name, size)
        free = sorted(self._free.setdefault(kind, []) + [(ds.offset, size)])
        merged: list[tuple[int, int]] = []
        for off, n in free:  # coalesce neighbours
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        if merged and merged[-1][0] + merged[-1][1] == self._ends[kind]:  # a free tail shortens the file's use
            self._ends[kind] = merged.pop()[0]
        self._free[kind] = merged

    def _file(self, kind: str) -> DirectFile:
        """The offload file for ``kind``: ``weights`` (O_DIRECT, aligned records) or ``rows``."""
        if kind not in self.files:
            if self._offload_root is None:
                raise UserError("this policy puts data on the disk tier; pass an offload directory (--offload-dir)")
            if self.dir is None:
                try:
                    self._offload_root.mkdir(parents=True, exist_ok=True)
                    # named before it exists, so close() removes it after a Ctrl-C at any instant
                    self.dir = self._offload_root / f"xsched-offload-{secrets.token_hex(8)}"
                    self.dir.mkdir(mode=0o700)
                except OSError as exc:
                    if isinstance(exc, FileExistsError):  # another run's directory: not ours to remove
                        self.dir = None
                    raise UserError(describe_os_error(exc, self._offload_root)) from None
            self.files[kind] = DirectFile(self.dir / f"{kind}.bin", "rw", direct=None if kind == "weights" else False)
            self._ends[kind] = 0
        return self.files[kind]

    def disk_region(self, kind: str, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                    align: bool = False) -> DiskSlice:
        """Reserve an accounted range of an offload file (``reserve`` makes the space real)."""
        f = self._file(kind)
        ds = DiskSlice(f, self._ends[kind], tuple(shape), dtype)
        size = round_up(ds.nbytes) if align else ds.nbytes
        free = self._free.get(kind, [])
        hole = next((i for i, (off, n) in enumerate(free) if n >= size and (not align or off % 4096 == 0)), None)
        if hole is not None:  # first fit in space a freed region left
            off, n = free[hole]
            ds = DiskSlice(f, off, tuple(shape), dtype)
            free[hole:hole + 1] = [(off + size, n - size)] if n > size else []
        else:
            self._ends[kind] += size
        self.ledger.add("disk", name, size)
        return ds

    def reserve(self) -> None:
        """Allocate every reserved byte on disk now, so a full disk fails before the run."""
        for kind, f in self.files.items():
            if self._ends[kind] > self._allocated.get(kind, 0):
                f.allocate(round_up(self._ends[kind]))
                self._allocated[kind] = round_up(self._ends[kind])

    # ----------------------------------------------------------------- the copy routine
    def copy(self, dst: Ref, src: Ref, relay: torch.Tensor | None = None) -> None:
        """Copy ``src`` into ``dst`` (same number of elements and dtype), tier to tier.

        disk -> gpu and gpu -> disk go through ``relay`` (a cpu-tier tensor of at least the
        slice's bytes, 4 KiB-aligned for O_DIRECT records). Each leg is timed on its channel.
        A CUDA copy runs on the channel's stream and is complete when this returns.
        """
        if isinstance(src.data, DiskSlice):
            if isinstance(dst.data, DiskSlice):
                raise ValueError("disk to disk copies are not needed")
            direct = self._direct_buffer(dst, src.data)
            if direct is not None:
                self._read(src.data, direct)
                return
            if relay is None:
                raise ValueError("disk -> gpu needs a cpu relay buffer")
            io, typed = self._relay_views(relay, src.data)
            self._read(src.data, io)
            self._copy_tensor(dst.data, dst.tier, typed, "cpu")
            return
        if isinstance(dst.data, DiskSlice):
            direct = self._direct_buffer(src, dst.data)
            if direct is not None:
                self._write(dst.data, direct)
                return
            if relay is None:
                raise ValueError("gpu -> disk needs a cpu relay buffer")
            io, typed = self._relay_views(relay, dst.data)
            self._copy_tensor(typed, "cpu", src.data, src.tier)
            self._write(dst.data, io)
            return
        self._copy_tensor(dst.data, dst.tier, src.data, src.tier, defer=True)

    def mark_io_thread(self) -> None:
        """Declare the calling thread an I/O queue's (a pool initializer). Its copies do not wait for
        everything queued on the compute stream, which would serialise them behind compute they
        should overlap: only for the point :meth:`after` names (the engine's task: the compute
        that produced its data or last read its slot)."""
        self._thread.io = True

    @contextmanager
    def after(self, event: "torch.cuda.Event | None") -> Iterator[None]:
        """This thread's device copies inside the block first wait, on the device, for ``event`` (a
        point on the compute stream; None: no wait). The compute thread does not synchronise after
        each item, so the kernels that produce a row or last read a slot may still be queued."""
        prev = getattr(self._thread, "after", None)
        self._thread.after = event
        try:
            yield
        finally:
            self._thread.after = prev

    def _stream(self, channel: str) -> "torch.cuda.Stream":
        """This thread's copy stream for ``channel``: threads never share one, so a compute-thread
        copy (CPU attention) does not queue behind an I/O thread's whole-layer prefetch."""
        streams = self._thread.__dict__.setdefault("streams", {})
        if channel not in streams:
            streams[channel] = torch.cuda.Stream(self.device)
        return streams[channel]

    def _copy_tensor(self, dst: torch.Tensor, dst_tier: str, src: torch.Tensor, src_tier: str,
                     defer: bool = False) -> None:
        """One tier-to-tier tensor copy, complete on return unless ``defer`` and inside ``deferred_sync``.

        ``defer`` is for copies between two long-lived buffers (a home and a stage slot): relay legs
        never defer, since the relay is read by the disk write or overwritten by the next row's read.
        """
        channel = {("cpu", "gpu"): "ctog", ("gpu", "cpu"): "gtoc"}.get((src_tier, dst_tier))
        t0 = time.perf_counter()
        if self.cuda and channel is not None:
            stream = self._stream(channel)
            if not getattr(self._thread, "io", False):  # the compute thread: its queued kernels first
                stream.wait_stream(torch.cuda.current_stream(self.device))
            elif getattr(self._thread, "after", None) is not None:  # an I/O thread: up to its point only
                stream.wait_event(self._thread.after)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            pending = getattr(self._thread, "copies", None) if defer else None
            if pending is not None:  # one synchronisation per stream at the block's end, timed there
                entry = pending.setdefault(channel, [stream, t0, 0])
                entry[2] += nbytes_of(src)
                return
            stream.synchronize()
        else:
            dst.copy_(src)
        if channel is not None and self.on_copy is not None:
            self.on_copy(channel, t0, time.perf_counter(), nbytes_of(src))

    def _host_side(self, tier: str, ds: DiskSlice) -> bool:
        """Whether a ``tier`` tensor may be the disk transfer's own buffer.

        Always for the cpu tier. On a host without CUDA the gpu tier is host RAM as well, so a
        weight record is read straight into its (aligned) stage slot and written from one: no
        relay, and no relay -> stage memcpy on the compute cores. Row files (KV cache,
        activations) keep the relay path on both hosts, as the cost model prices them.
        """
        return tier == "cpu" or (not self.cuda and tier == "gpu" and ds.file is self.files.get("weights"))

    def needs_relay(self, dst: Ref, src: Ref) -> bool:
        """Whether :meth:`copy` of ``src`` into ``dst`` needs a relay (a disk leg it cannot do in place)."""
        for host, ds in ((dst, src.data), (src, dst.data)):
            if isinstance(ds, DiskSlice):
                return self._direct_buffer(host, ds) is None
        return False

    def _direct_buffer(self, ref: Ref, ds: DiskSlice) -> torch.Tensor | None:
        """The buffer a disk transfer of ``ds`` can use in place of a relay: ``ref``'s tensor itself, or,
        under O_DIRECT, the whole 4 KiB-rounded allocation that :meth:`empty` made for it (the
        tail past the tensor is that allocation's own padding, so reading into it clobbers
        nothing); None when it needs a relay."""
        t = ref.data
        if not self._host_side(ref.tier, ds) or not t.is_contiguous() or t.device.type != "cpu":
            return None
        if ds.file.method != "o_direct":
            return t
        if t.data_ptr() % 4096 or ds.offset % 4096:
            return None
        if nbytes_of(t) % 4096 == 0:
            return t
        owner, whole = self._keep.get(t.data_ptr(), (None, 0))
        n = round_up(ds.nbytes)  # only the whole tensor: past a view's end lie the rest of its buffer's bytes
        if owner is None or nbytes_of(t) != whole or whole != ds.nbytes or owner.nbytes < n:
            return None
        return torch.from_numpy(owner[:n])

    @staticmethod
    def _relay_views(relay: torch.Tensor, ds: DiskSlice) -> tuple[torch.Tensor, torch.Tensor]:
        """The relay's bytes for the disk transfer (4 KiB-rounded under O_DIRECT) and its typed view."""
        flat = relay.reshape(-1).view(torch.uint8)
        n = round_up(ds.nbytes) if ds.file.method == "o_direct" else ds.nbytes
        if n > flat.numel():
            raise ValueError(f"relay of {flat.numel()} bytes is too small for {n}")
        return flat[:n], flat[:ds.nbytes].view(ds.dtype).view(ds.shape)

    def _disk_io(self, channel: str, ds: DiskSlice, buf_tensor: torch.Tensor) -> None:
        """One disk transfer (``dtoc`` reads into, ``ctod`` writes from ``buf_tensor``), timed."""
        buf = _numpy_bytes(buf_tensor)
        n = round_up(ds.nbytes) if ds.file.method == "o_direct" else ds.nbytes
        pending = getattr(self._thread, "writes", None)
        t0 = time.perf_counter()
        if channel == "dtoc":
            ds.file.read_into(buf[:n], ds.offset)
        elif pending is not None and ds.file.method == "fadvise":
            ds.file.write_at(buf[:n], ds.offset, sync=False)
            pending.setdefault(id(ds.file), (ds.file, []))[1].append((ds.offset, n))
        else:
            ds.file.write_at(buf[:n], ds.offset)
        if self.on_copy is not None:
            self.on_copy(channel, t0, time.perf_counter(), ds.nbytes)

    @contextmanager
    def deferred_sync(self) -> Iterator[None]:
        """Row copies of this thread inside the block share one synchronisation, at its end.

        The engine moves disk-tier KV-cache and activation rows one row at a time (cpu-tier rows
        a run of consecutive slots at a time). An fdatasync after each
        disk write (about 0.25 ms on the VM this was built on) made disk-tier rows latency-bound,
        so a block's writes share one fdatasync per file; on CUDA its copies between homes and
        stage slots share one stream synchronisation per channel instead of one per row. Every
        copy is complete, and written data is on the device and out of the page cache, when the
        block returns, also when it raises.
        """
        outer = getattr(self._thread, "writes", None)
        if outer is not None:  # nested: the outer block flushes
            yield
            return
        self._thread.writes = pending = {}
        self._thread.copies = copies = {}
        try:
            yield
        finally:
            self._thread.writes = self._thread.copies = None
            for channel, (stream, c0, nbytes) in copies.items():
                stream.synchronize()
                if self.on_copy is not None:
                    self.on_copy(channel, c0, time.perf_counter(), nbytes)
            t0 = time.perf_counter()
            for f, ranges in pending.values():
                f.flush(ranges)
            if pending and self.on_copy is not None:
                self.on_copy("ctod", t0, time.perf_counter(), 0)

    def _read(self, ds: DiskSlice, into: torch.Tensor) -> None:
        self._disk_io("dtoc", ds, into)

    def _write(self, ds: DiskSlice, src: torch.Tensor) -> None:
        self._disk_io("ctod", ds, src)

    # ----------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Close and delete the offload files, unpin host buffers; safe to call twice."""
        for f in self.files.values():
            f.close()
        self.files.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self.cuda:
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()
        self._keep.clear()
        self._free.clear()
