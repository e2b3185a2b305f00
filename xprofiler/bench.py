"""Microbenchmarks: copies between tiers, disk I/O around the page cache, GEMM, attention, memory.

Each function returns ``samples.Point`` lists for ``samples.run_points``. On a CUDA device,
time comes from CUDA events around the call; on the CPU, from ``time.perf_counter``. On a
host without a GPU the ``gpu`` tier is RAM, so ctog/gtoc are memcpy between two RAM buffers:
exactly what the offloading engine does there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from xprofiler.diskio import DirectFile, aligned_empty
from xprofiler.samples import Point, sample_meta, wall_clock

# Each sample moves at least this many bytes (several transfers for small sizes), so that
# the timer's resolution and the Python call overhead stay small against the transfer.
MIN_BYTES_PER_CALL = 4 * 2**20


class Timer:
    """Seconds of one call on ``device``: CUDA events on a GPU, wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return wall_clock(fn)


# ----------------------------------------------------------------------------- copies
def copy_points(device: torch.device, sizes: Sequence[int], pinned: bool = True) -> list[Point]:
    """ctog and gtoc at each size: host->device and device->host (RAM->RAM on a CPU host).

    On CUDA the host buffer is pinned unless ``pinned`` is False (then the benches are named
    ``ctog_pageable``/``gtoc_pageable``); copies are ``non_blocking`` so pinned ones use DMA.
    """
    n_max = max(sizes)
    cuda = device.type == "cuda"
    host = torch.empty(n_max, dtype=torch.uint8, pin_memory=cuda and pinned)
    dev = torch.empty(n_max, dtype=torch.uint8, device=device)
    host.fill_(1)
    dev.fill_(2)  # touch every page now, not inside the first timed copy
    suffix = "" if (pinned or not cuda) else "_pageable"
    points = []
    for n in sizes:
        count = max(1, MIN_BYTES_PER_CALL // n)

        def ctog(n: int = n) -> None:
            dev[:n].copy_(host[:n], non_blocking=True)

        def gtoc(n: int = n) -> None:
            host[:n].copy_(dev[:n], non_blocking=True)

        points.append(Point(sample_meta("ctog" + suffix, size_bytes=n, count=count), ctog))
        points.append(Point(sample_meta("gtoc" + suffix, size_bytes=n, count=count), gtoc))
    return points


# ----------------------------------------------------------------------------- disk
class DiskBench:
    """ctod/dtoc points on one test file in the offload directory, around the page cache.

    The file is filled with random bytes first (a sparse file or zero pages could be served
    without touching the device); each timed call then writes or reads the next region of the
    file, wrapping around, so no call re-reads what the previous one just moved.
    """

    def __init__(self, path: Path, file_bytes: int, sizes: Sequence[int], direct: bool | None = None,
                 fresh: bool = False):
        self.sizes = sorted(sizes)
        self.file_bytes = file_bytes
        self.file = DirectFile(path, "rw", direct=direct)
        self.buf = aligned_empty(max(self.sizes))
        self.buf[:] = np.random.default_rng(0).integers(0, 256, self.buf.size, dtype=np.uint8)
        self._cursor = 0
        # ``fresh``: the file is only reserved, as the engine's offload files are; every write
        # lands on never-written space (whose first write also converts the filesystem extent,
        # which fdatasync must commit) and reads trail behind, over what was written.
        self.fresh = fresh
        self._read_cursor = 0

    @property
    def method(self) -> str:
        return self.file.method

    def fill(self) -> None:
        self.file.allocate(self.file_bytes)
        if self.fresh:
            return
        chunk = len(self.buf)
        for off in range(0, self.file_bytes, chunk):
            n = min(chunk, self.file_bytes - off)
            self.file.write_at(self.buf[:n], off)

    def _next_offset(self, n: int) -> int:
        if self._cursor + n > self.file_bytes:
            self._cursor = 0
        off = self._cursor
        self._cursor += n
        return off

    def points(self) -> list[Point]:
        """A ``ctod`` write and a ``dtoc`` read point per size (each call ~4 MiB of transfers)."""
        points = []
        for n in self.sizes:
            count = max(1, MIN_BYTES_PER_CALL // n)
            view = self.buf[:n]

            def write(n: int = n, view: np.ndarray = view) -> None:
                self.file.write_at(view, self._next_offset(n))

            points.append(Point(sample_meta("ctod", size_bytes=n, count=count), write))
            points.append(self._read_point("dtoc", n, count))
        return points

    def read_points(self, bench: str, count: int) -> list[Point]:
        """Only read points, ``count`` reads per timed call (after writes of a ``fresh`` file)."""
        return [self._read_point(bench, n, count) for n in self.sizes]

    def _read_point(self, bench: str, n: int, count: int) -> Point:
        view = self.buf[:n]

        def read() -> None:
            if self.fresh:
                if self._read_cursor + n > self._cursor:
                    self._read_cursor = 0
                off, self._read_cursor = self._read_cursor, self._read_cursor + n
            else:
                off = self._next_offset(n)
            self.file.read_into(view, off)

        return Point(sample_meta(bench, size_bytes=n, count=count), read)

    def store_points(self, rows_per_store: Sequence[int], count: int) -> list[Point]:
        """``row_store`` points: ``n`` row writes of the smallest size, then one flush (fdatasync).

        The engine's stores write KV-cache and activation rows this way (``deferred_sync``); two
        or more ``n`` separate the flush's fixed cost from the per-row one.
        """
        size = self.sizes[0]
        view = self.buf[:size]
        points = []
        for n in rows_per_store:
            def store(n: int = n) -> None:
                ranges = []
                for _ in range(n):
                    off = self._next_offset(size)
                    self.file.write_at(view, off, sync=False)
                    ranges.append((off, size))
                self.file.flush(ranges)

            points.append(Point(sample_meta("row_store", size_bytes=size, batch=n, count=count), store))
        return points

    def close(self) -> None:
        self.file.close()


# ----------------------------------------------------------------------------- compute
def gemm_point(bench: str, device: torch.device, dtype: torch.dtype, tokens: int, d_in: int, d_out: int,
               label: str = "") -> Point:
    """``[tokens, d_in] x [d_out, d_in]^T``: a prefill chunk through one projection."""
    x = torch.randn(tokens, d_in, device=device).to(dtype)
    w = (torch.randn(d_out, d_in, device=device) * 0.02).to(dtype)
    flops = 2.0 * tokens * d_in * d_out
    shape = f"{label}{tokens}x{d_in}x{d_out}"
    return Point(sample_meta(bench, dtype=str(dtype).removeprefix("torch."), shape=shape, flops=flops),
                 lambda: torch.nn.functional.linear(x, w))


def attention_point(bench: str, device: torch.device, dtype: torch.dtype, batch: int, heads: int, length: int,
                    head_dim: int, label: str = "") -> Point:
    """Attention scores and weighted sum as two batched matmuls over ``length`` keys."""
    q = torch.randn(batch, heads, length, head_dim, device=device).to(dtype)
    k = torch.randn(batch, heads, length, head_dim, device=device).to(dtype)
    v = torch.randn(batch, heads, length, head_dim, device=device).to(dtype)
    flops = 4.0 * batch * heads * head_dim * length * length
    shape = f"{label}{batch}x{heads}x{length}x{head_dim}"

    def fn() -> torch.Tensor:
        return torch.matmul(torch.matmul(q, k.transpose(-1, -2)), v)

    return Point(sample_meta(bench, dtype=str(dtype).removeprefix("torch."), shape=shape, flops=flops), fn)


def gemv_point(bench: str, device: torch.device, dtype: torch.dtype, weight_bytes: int, d_in: int) -> Point:
    """Matrix-vector product over a large weight: the memory roof a decode step sees."""
    elem = torch.empty((), dtype=dtype).element_size()
    rows = max(1, weight_bytes // (elem * d_in))
    w = (torch.randn(rows, d_in, device=device) * 0.02).to(dtype)
    x = torch.randn(1, d_in, device=device).to(dtype)
    nbytes = float(w.numel() * elem)
    return Point(sample_meta(bench, dtype=str(dtype).removeprefix("torch."), shape=f"{rows}x{d_in}", bytes=nbytes),
                 lambda: torch.nn.functional.linear(x, w))


def quant_points(device: torch.device, dtype: torch.dtype, shapes: Sequence[tuple[str, int, int, int]]
                 ) -> list[Point]:
    """Group-wise 4-bit quantize and dequantize, with the runner's code, per ``(label, rows, cols,
    head_dim)``: an MLP weight's shape and the model's head size.

    Quantize is the KV cache's write, ``xrunner.stored_forms.KVCodec.encode`` (each head's vector
    rotated, then quantized with the cache's range rule), over K and V of the weight's bytes:
    the KV write is the only quantization in the steady-state loop (weights are packed once, at
    load), and its rotation costs about as much again as the quantizer (opt-125m shapes, 1
    thread: encode 1.3-1.6x the bare quantizer). Dequantize writes an MLP weight into a buffer
    allocated once, as the engine does: the allocating form also times a fresh tensor and a
    transposing copy the engine never makes.
    """
    from xrunner.compression import KV_CLIP_STEPS, dequantize, quantize, stored_shape
    from xrunner.stored_forms import KVCodec

    points = []
    for label, rows, cols, head_dim in shapes:
        w = (torch.randn(rows, cols, device=device) * 0.02).to(dtype)
        meta = dict(dtype=str(dtype).removeprefix("torch."), shape=f"{label}{rows}x{cols}",
                    bytes=float(w.numel() * w.element_size()))
        codec = KVCodec(head_dim, dtype, compress=True)
        k, v = w.view(-1)[:w.numel() // head_dim * head_dim].view(1, 1, -1, head_dim).chunk(2, dim=2)
        kv_bytes = float((k.numel() + v.numel()) * k.element_size())
        points.append(Point(sample_meta("quant", **{**meta, "bytes": kv_bytes}),
                            lambda k=k, v=v, codec=codec: codec.encode(k, v)))
        q = quantize(w, clip_steps=KV_CLIP_STEPS)
        buf = torch.empty(stored_shape(q), dtype=dtype, device=device)
        points.append(Point(sample_meta("dequant", **meta), lambda q=q, buf=buf: dequantize(q, out=buf)))
        if device.type == "cpu":
            points.append(kv_attend_point(label, max(1, cols // KV_PROBE_HEAD_DIM), dtype))
    return points


KV_PROBE_HEAD_DIM, KV_PROBE_ROWS, KV_PROBE_CONTEXT = 64, 32, 128
CPU_ATTEND_ROWS, CPU_ATTEND_CONTEXT, CPU_ATTEND_MAX_BYTES, CPU_ATTEND_COPIES = 32, 256, 64 << 20, 8


def cpu_attend_point(label: str, spec: Any, dtype: torch.dtype) -> Point:
    """Decode attention on the host CPU as the engine delegates it (``xrunner.model.
    attend_rows_on_cpu``) over a ``dtype`` K/V cache in the cpu tier's layout, one query head per
    kv head of ``spec``; ``bytes``: K and V attended over, in ``dtype``. At most 32 rows of 256
    positions, fewer where that passes 64 MiB of cache. Successive calls cycle through copies of
    the cache that together are twice the CPU's last-level cache, so each reads its K/V from
    memory, as the engine's do (one copy, 25 MB for opt-125m's heads in bfloat16, stayed in a
    32 MiB cache and measured 10.9 GB/s; the engine's items, 50 MB each, ran at about 7)."""
    from dataclasses import replace
    from itertools import cycle

    from xprofiler.fingerprint import last_level_cache_bytes
    from xprofiler.sweeps import FALLBACK_CACHE_BYTES, rotation_copies
    from xrunner.model import attend_rows_on_cpu
    from xsimulator.costmodel import CPU_ATTENTION_CHUNK_BYTES

    one = replace(spec, num_heads=spec.num_kv_heads)
    size = torch.empty((), dtype=dtype).element_size()
    per_row = 2 * CPU_ATTEND_CONTEXT * spec.num_kv_heads * spec.head_dim * size
    rows = max(1, min(CPU_ATTEND_ROWS, CPU_ATTEND_MAX_BYTES // per_row))
    g = torch.Generator().manual_seed(0)
    copies = rotation_copies(rows * per_row, last_level_cache_bytes() or FALLBACK_CACHE_BYTES, CPU_ATTEND_COPIES)
    caches = cycle([[torch.randn(rows, CPU_ATTEND_CONTEXT, spec.num_kv_heads, spec.head_dim, generator=g).to(dtype)
                     for _ in range(2)] for _ in range(copies)])
    q = torch.randn(rows, spec.num_kv_heads, 1, spec.head_dim, generator=g).to(dtype)
    mask = torch.ones(rows, CPU_ATTEND_CONTEXT, dtype=torch.bool)
    idx = list(range(rows))
    meta = dict(dtype=str(dtype).removeprefix("torch."),
                shape=f"{label}{rows}x{spec.num_kv_heads}x{CPU_ATTEND_CONTEXT}x{spec.head_dim}",
                bytes=float(rows * per_row))
    return Point(sample_meta("cpu_attend", **meta),
                 lambda: attend_rows_on_cpu(one, q, next(caches), idx, mask, CPU_ATTENTION_CHUNK_BYTES))


def kv_attend_point(label: str, heads: int, dtype: torch.dtype = torch.float32) -> Point:
    """A CPU decode step's attention straight over a 4-bit K/V cache (``xrunner.kvattend``), one
    query head per kv head, the cache quantized from ``dtype`` (its mins and scales in it) as the
    engine's is; ``bytes``: K and V attended over, in ``dtype`` (the cost model's context bytes)."""
    from xrunner.compression import quantize
    from xrunner.kvattend import attend_quantized

    g = torch.Generator().manual_seed(0)
    b, t, d = KV_PROBE_ROWS, KV_PROBE_CONTEXT, KV_PROBE_HEAD_DIM
    k, v = (quantize(torch.randn(b, heads, t, d, generator=g).to(dtype), dim=-1, clip_steps=0) for _ in range(2))
    q, own = (torch.randn(b, heads, d, generator=g).to(dtype) for _ in range(2))
    attend_quantized(q, k, v, own, own, None)  # compile (or load the compiled kernel) outside the timing
    size = torch.empty((), dtype=dtype).element_size()
    meta = dict(dtype=str(dtype).removeprefix("torch."), shape=f"{label}{b}x{heads}x{t}x{d}",
                bytes=float(2 * b * heads * t * d * size))
    return Point(sample_meta("kv_attend", **meta), lambda: attend_quantized(q, k, v, own, own, None))
