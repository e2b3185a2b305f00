"""Measure this machine into a ``HardwareProfile`` (what ``xsched profile`` runs).

Order: check the offload directory (writable, enough free space) before any work; then
copies between tiers, disk write/read around the page cache, GEMM / attention / memory-roof
benchmarks, (de)quantization, and per-layer sweeps of the requested models. The disk test
file lives in the offload directory and is removed on success, on error and on Ctrl-C.
Raw samples are written as CSV beside the profile JSON; both are written atomically.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from xprofiler.fingerprint import cpu_cores
from xprofiler.profile import BandwidthCurve, HardwareProfile, HeadFit, LayerFit, WarmFit
from xprofiler.specs import get_model_spec
from xprofiler.sweeps import CUDA_FULL_GRIDS, CUDA_QUICK_GRIDS, FULL_GRIDS, PHASES, QUICK_GRIDS, Grid
from xsched.errors import UserError
from xsched.fileio import atomic_write_all, check_writable, scratch_file

MiB = 2**20
GiB = 2**30
DISK_MARGIN_BYTES = 64 * MiB
# Defaults of the tier budgets on a host without a GPU (fractions of MemAvailable at profile time):
# the declared `gpu` tier takes a quarter, the `cpu` tier what is left of three quarters; the last
# quarter stays free for the Python process, its working buffers and the page cache.
CPU_HOST_GPU_FRACTION = 0.25
HOST_RAM_FRACTION = 0.75
DISK_FREE_FRACTION = 0.9  # of the offload filesystem's free space at profile time
BUSY_WARN_CORES = 0.25  # warn when other processes used more CPU than this while we measured
CUDA_MEM_FRACTION = 0.9  # of the device's total memory (the CUDA context and allocator need the rest)
HEAD_MEMORY_FRACTION = 0.5  # of the gpu tier the logits-product benchmark may hold (both layouts)
CPU_ATTEND_DEFAULT_MODEL = "opt-1.3b"  # the CPU attention probe's heads when no model is given
# One KV-cache / activation row transfer: a 4 KiB piece (opt-125m's K or V column is 3 KiB), 32
# per timed call, on a reserved file large enough that every write lands on fresh space.
ROW_BYTES = 4096
ROW_CALLS = 32
ROWS_PER_STORE = (1, 16)  # rows written before one flush, in the two store points
ROW_STORE_CALLS = 4
ROW_FILE_BYTES = 64 * MiB


@dataclass(frozen=True)
class Settings:
    """How much to measure; ``quick`` and full differ only here."""

    copy_sizes: tuple[int, ...]
    disk_sizes: tuple[int, ...]
    disk_file_bytes: int
    passes: int
    warmup: int
    gemm_tokens: int
    gemv_bytes: int
    sweep_budget_s: float
    sweep_min_passes: int
    sweep_max_passes: int
    grids: dict[str, Grid] = field(default_factory=dict)
    stat: str = "median"  # how samples of one point are summarised: "median" or "min" (see bench)
    cuda_grids: dict[str, Grid] = field(default_factory=dict)  # on a GPU instead of ``grids``
    cuda_gemm_tokens: int = 0  # on a GPU instead of ``gemm_tokens``: a launch-bound probe is no rate
    cpu_gemm_tokens: int = 0  # the host CPU's probe beside a GPU (0: ``gemm_tokens``)

    def for_device(self, cuda: bool) -> "Settings":
        """These settings, with the GPU's layer grids and GEMM probe size on a CUDA device (the
        host CPU's own probe keeps ``gemm_tokens``: ``cpu_gemm_tokens``)."""
        if not cuda:
            return self
        return replace(self, grids=self.cuda_grids or self.grids, cpu_gemm_tokens=self.gemm_tokens,
                       gemm_tokens=self.cuda_gemm_tokens or self.gemm_tokens)


QUICK = Settings(copy_sizes=tuple(2**k for k in range(16, 27, 2)), disk_sizes=tuple(2**k for k in range(16, 27, 2)),
                 disk_file_bytes=256 * MiB, passes=5, warmup=1, gemm_tokens=256, gemv_bytes=64 * MiB,
                 sweep_budget_s=110.0, sweep_min_passes=5, sweep_max_passes=15, grids=QUICK_GRIDS,
                 cuda_grids=CUDA_QUICK_GRIDS, cuda_gemm_tokens=4096)
FULL = Settings(copy_sizes=tuple(2**k for k in range(12, 29, 2)), disk_sizes=tuple(2**k for k in range(12, 29, 2)),
                disk_file_bytes=1 * GiB, passes=9, warmup=2, gemm_tokens=1024, gemv_bytes=256 * MiB,
                sweep_budget_s=540.0, sweep_min_passes=7, sweep_max_passes=25, grids=FULL_GRIDS,
                cuda_grids=CUDA_FULL_GRIDS, cuda_gemm_tokens=8192)


@dataclass(frozen=True)
class ProfileOptions:
    """Everything ``xsched profile`` accepts; ``None`` means "choose from this machine"."""

    output: Path
    offload_dir: Path | None = None  # None: the system temporary directory
    models: tuple[Any, ...] = ()  # names/paths (see sweeps.resolve_spec) or ModelSpecs
    quick: bool = False
    gpu_mem_bytes: int | None = None
    cpu_mem_bytes: int | None = None
    disk_test_bytes: int | None = None
    dtype: str | None = None
    name: str | None = None
    progress: bool = True
    settings: Settings | None = None  # overrides quick/full (tests, the accuracy benchmark)
    threads: int | None = None  # torch intra-op threads; None = torch's default
    direct_io: bool | None = None  # None: O_DIRECT where the filesystem allows it


# ----------------------------------------------------------------------------- checks
def check_offload_dir(path: Path, need_bytes: int) -> str:
    """Fail early with one line if the offload directory cannot hold the disk test file.

    Returns the page-cache bypass that works there (``o_direct`` or ``fadvise``).
    """
    from xprofiler.diskio import probe_method

    if not path.exists():
        raise UserError(f"offload dir {path} does not exist; create it or pass another --offload-dir")
    if not path.is_dir():
        raise UserError(f"offload dir {path} is not a directory; pass a directory to --offload-dir")
    try:
        method = probe_method(path)
    except UserError as exc:
        raise UserError(f"offload dir {path} is not usable ({exc}); pass another --offload-dir") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes + DISK_MARGIN_BYTES:
        raise UserError(f"offload dir {path} has {free / MiB:.0f} MiB free but the disk test needs "
                        f"{(need_bytes + DISK_MARGIN_BYTES) / MiB:.0f} MiB; free space, pass another --offload-dir "
                        "or a smaller --disk-test-bytes")
    return method


def parse_bytes(text: str) -> int:
    """``8GiB``, ``512MiB``, ``16GB``, ``8e9`` or a plain integer -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "b": 1}
    s = text.strip().lower().replace(" ", "")
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix) and s[: -len(suffix)]:
            num, mult = s[: -len(suffix)], units[suffix]
            break
    else:
        num, mult = s, 1
    try:
        value = float(num) * mult
    except ValueError:
        raise UserError(f"{text!r} is not a size; write e.g. 8GiB, 512MiB, 16GB or 8000000000") from None
    if not value >= 1 or value == float("inf"):  # NaN fails too; 0.5 would truncate to 0 = "unset"
        raise UserError(f"{text!r}: a size must be at least 1 byte")
    return int(value)


class LoadMeter:
    """How many cores other processes kept busy while we measured (the noise we worked under)."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), _system_busy_s(), _own_cpu_s()

    def others_cores(self) -> float:
        wall = max(time.monotonic() - self.t0, 1e-9)
        others = (_system_busy_s() - self.busy0) - (_own_cpu_s() - self.own0)
        return max(others, 0.0) / wall


def _system_busy_s() -> float:
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            vals = [int(v) for v in fh.readline().split()[1:]]
        busy = sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # minus idle and iowait
        return busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its waited-for children."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


# ----------------------------------------------------------------------------- the run
class _Bar:
    """A tqdm bar on stderr whose total grows as stages are planned (no-op when disabled)."""

    def __init__(self, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=0, unit="run", file=sys.stderr, dynamic_ncols=True,
                            disable=not sys.stderr.isatty())

    def stage(self, name: str, calls: int) -> None:
        if self.bar is not None:
            self.bar.set_description(name)
            self.bar.total += calls
            self.bar.refresh()

    def tick(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def measure_profile(opts: ProfileOptions) -> tuple[HardwareProfile, list[dict[str, Any]]]:
    """Run every benchmark and return the profile and the raw samples (nothing written).

    Bad options and an unusable offload directory fail before torch is even imported.
    """
    from xprofiler.diskio import round_up
    from xprofiler.sweeps import resolve_spec

    st = opts.settings or (QUICK if opts.quick else FULL)
    if opts.threads is not None and opts.threads < 1:
        raise UserError(f"--threads {opts.threads}: give a positive number of threads")
    cores = cpu_cores()
    if opts.threads is not None and opts.threads > cores:
        raise UserError(f"--threads {opts.threads}: this machine gives the process {cores} cores; pass at most {cores}")
    disk_test = round_up(max(opts.disk_test_bytes or st.disk_file_bytes, max(st.disk_sizes)))
    offload = Path(opts.offload_dir or tempfile.gettempdir()).expanduser().resolve()
    check_offload_dir(offload, disk_test)
    specs = [resolve_spec(m) for m in opts.models]

    import torch

    threads_before = torch.get_num_threads()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    try:
        return _measure(opts, st, offload, disk_test, specs)
    finally:
        torch.set_num_threads(threads_before)


@dataclass
class _Run:
    """Mutable state of one profiling run: the samples so far, the progress bar, notes."""

    st: Settings
    timer: Any
    bar: "_Bar"
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def run(self, name: str, points: Sequence[Any], passes: int | None = None, timer: Any = None,
            deadline: float | None = None) -> None:
        """Time ``points``; ``timer`` overrides the device timer (host-only work on a CUDA host).

        With a ``deadline`` (monotonic seconds) passes beyond ``sweep_min_passes`` are skipped
        once it is past.
        """
        from xprofiler.samples import calls_for, run_points

        passes = passes or self.st.passes
        self.bar.stage(name, calls_for(points, passes, self.st.warmup))
        self.rows.extend(run_points(points, timer or self.timer, passes, self.st.warmup, tick=self.bar.tick,
                                    deadline=deadline, min_passes=self.st.sweep_min_passes))

    def rate(self, bench: str, unit: str = "flops") -> float:
        from xprofiler.samples import rate

        return rate(self.rows, bench, unit=unit, stat=self.st.stat)

    def curve(self, bench: str) -> BandwidthCurve:
        from xprofiler.samples import bandwidth_curve

        return bandwidth_curve(self.rows, bench, self.st.stat)


def _measure(opts: ProfileOptions, st: Settings, offload: Path, disk_test: int, specs: list[Any]
             ) -> tuple[HardwareProfile, list[dict[str, Any]]]:
    import torch

    from xprofiler import bench
    from xprofiler.fingerprint import available_ram_bytes, detect_fingerprint, filesystem_type

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    st = st.for_device(cuda)
    dtype = opts.dtype or ("float16" if cuda else "float32")
    r = _Run(st=st, timer=bench.Timer(device), bar=_Bar(opts.progress))
    gpu_bytes, cpu_bytes = _capacities(opts, cuda, device, available_ram_bytes(), r.notes)
    fs = filesystem_type(offload)
    if fs in ("tmpfs", "ramfs"):
        r.notes.append(f"offload dir {offload} is on {fs}: the disk tier there is RAM")
    disk_bytes = int(DISK_FREE_FRACTION * shutil.disk_usage(offload).free)
    t_start, meter, load_start = time.monotonic(), LoadMeter(), os.getloadavg()[0]

    try:
        with scratch_file(offload, "xsched-profile-", ".bin") as test_file:
            disk_method = _run_benchmarks(r, opts, device, dtype, specs, gpu_bytes, test_file, disk_test)
            fits, heads, warms = _run_sweeps(r, opts, device, dtype, specs, gpu_bytes)
    finally:
        r.bar.close()

    if cuda:
        cpu_mm, cpu_bmm, cpu_mem = r.rate("cpu_mm"), r.rate("cpu_bmm"), r.rate("cpu_mem", unit="bytes")
    else:
        cpu_mm, cpu_bmm, cpu_mem = r.rate("mm"), r.rate("bmm"), r.rate("mem", unit="bytes")
        r.notes.append("compute device is the CPU: cpu_* rates are the device rates")
    others = meter.others_cores()
    if others > BUSY_WARN_CORES:
        warnings.warn(f"other processes kept {others:.2f} of {os.cpu_count()} cores busy while measuring, so the "
                      "figures are noisy; re-run on an idle machine, or with --stat min", stacklevel=3)
    r.notes.insert(0, f"measured with torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}; each "
                      f"figure is the {st.stat} of {st.passes} interleaved passes (layer sweeps: per the budget); "
                      f"disk I/O via {disk_method}; load average {load_start:.2f} at start, "
                      f"{os.getloadavg()[0]:.2f} at end; other processes kept {others:.2f} of "
                      f"{os.cpu_count()} cores busy on average")
    profile = HardwareProfile(
        name=opts.name or platform.node() or "this-machine", source="measured",
        fingerprint=detect_fingerprint(offload), compute_device="cuda" if cuda else "cpu",
        gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, disk_bytes=disk_bytes,
        ctog=r.curve("ctog"), gtoc=r.curve("gtoc"), dtoc=r.curve("dtoc"), ctod=r.curve("ctod"),
        ctog_pageable=r.curve("ctog_pageable") if cuda else None,
        gtoc_pageable=r.curve("gtoc_pageable") if cuda else None,
        mm_flops=r.rate("mm"), bmm_flops=r.rate("bmm"), cpu_mm_flops=cpu_mm, cpu_bmm_flops=cpu_bmm,
        quant_bytes_per_s=r.rate("quant", unit="bytes"), dequant_bytes_per_s=r.rate("dequant", unit="bytes"),
        kv_attend_bytes_per_s=r.rate("kv_attend", unit="bytes") if any(x["bench"] == "kv_attend" for x in r.rows)
        else 0.0,
        cpu_attend_bytes_per_s=r.rate("cpu_attend", unit="bytes"),
        mem_bytes_per_s=r.rate("mem", unit="bytes"), cpu_mem_bytes_per_s=cpu_mem, layer_fits=tuple(fits),
        head_fits=tuple(heads), warm_fits=tuple(warms), fit_keys={s.name: s.cost_key() for s in specs},
        **row_costs(r.rows, st.stat),
        compute_dtype=dtype, compute_threads=torch.get_num_threads(), disk_io=disk_method,  # type: ignore[arg-type]
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        wall_s=time.monotonic() - t_start, notes="; ".join(n for n in r.notes if n),
    )
    return profile, r.rows


def row_costs(rows: Sequence[dict[str, Any]], stat: str = "median") -> dict[str, float]:
    """``disk_sync_s``, ``disk_row_write_s`` and ``disk_row_read_s`` from the disk-row samples.

    A store's cost is a straight line through the per-call times of the stores of fewest and most
    rows; a pair that would give a negative slope or intercept (noise, or a flush that costs
    nothing, as on tmpfs) counts every row as the largest store's mean share instead.
    """
    from xprofiler.samples import summarize_by

    def per_call(bench: str, key: str) -> dict[Any, float]:
        return summarize_by([r for r in rows if r["bench"] == bench], key, lambda r: r["time_s"] / r["count"], stat)

    store = per_call("row_store", "batch")
    lo, hi = min(store), max(store)
    per_row = (store[hi] - store[lo]) / (hi - lo) if hi > lo else 0.0
    sync = store[lo] - lo * per_row
    if per_row <= 0 or sync < 0:
        sync, per_row = 0.0, store[hi] / hi
    read = statistics.median(per_call("row_dtoc", "size_bytes").values())
    return {"disk_sync_s": float(sync), "disk_row_write_s": float(per_row), "disk_row_read_s": read}


def _run_benchmarks(r: _Run, opts: ProfileOptions, device: Any, dtype: str, specs: list[Any], gpu_bytes: int,
                    test_file: Path, disk_test: int) -> str:
    """Copies, disk, compute and quantization; returns the disk I/O method used."""
    import torch

    from xprofiler import bench
    from xprofiler.samples import wall_clock

    st, cuda, tdt = r.st, device.type == "cuda", getattr(torch, dtype)
    copy_sizes = [s for s in st.copy_sizes if 2 * s <= gpu_bytes] or [min(st.copy_sizes)]
    r.run("copies", bench.copy_points(device, copy_sizes, pinned=True))
    if cuda:
        r.run("pageable copies", bench.copy_points(device, copy_sizes, pinned=False))
    r.bar.stage("disk fill", 0)
    disk = bench.DiskBench(test_file, disk_test, st.disk_sizes, direct=opts.direct_io)
    try:
        disk.fill()
        r.run("disk", disk.points(), timer=wall_clock)
    finally:
        disk.close()
    # KV-cache and activation rows: small pieces in files the engine opens without O_DIRECT.
    os.truncate(test_file, 0)  # the row bench needs never-written space
    rows = bench.DiskBench(test_file, ROW_FILE_BYTES, [ROW_BYTES], direct=False, fresh=True)
    try:
        rows.fill()
        r.run("disk rows", rows.store_points(ROWS_PER_STORE, count=ROW_STORE_CALLS)
              + rows.read_points("row_dtoc", count=ROW_CALLS), timer=wall_clock)
    finally:
        rows.close()
    shapes = _model_shapes(specs)
    r.run("compute", _compute_points(bench, device, tdt, shapes, st))
    if cuda:
        cpu_points = _compute_points(bench, torch.device("cpu"), torch.float32, shapes,
                                     replace(st, gemm_tokens=st.cpu_gemm_tokens or st.gemm_tokens), prefix="cpu_")
        r.run("cpu compute", cpu_points, timer=wall_clock)
    r.run("quantization", bench.quant_points(device, tdt, [(label, f, h, hd) for label, h, f, _, hd in shapes]))
    # CPU attention runs on the host in the model's dtype, beside its cache: one probe (a rate of
    # bytes), on the first model's heads, or a mid-size model's without models.
    probe = specs[0] if specs else get_model_spec(CPU_ATTEND_DEFAULT_MODEL)
    r.run("cpu attention", [bench.cpu_attend_point(f"{probe.name}:", probe, tdt)], timer=wall_clock)
    return disk.method


def _run_sweeps(r: _Run, opts: ProfileOptions, device: Any, dtype: str, specs: list[Any], gpu_bytes: int
                ) -> tuple[list[LayerFit], list[HeadFit], list[WarmFit]]:
    """Per-layer sweeps of each model, sized by the time budget, and their fits; on a CPU what a
    decode layer saves with its weights cached (``WarmFit``); then each model's logits products
    (``HeadFit``)."""
    from xprofiler import sweeps
    from xprofiler.specs import DTYPE_BYTES

    st = r.st
    mm, mem = r.rate("mm"), r.rate("mem", unit="bytes")
    csv_name = samples_csv_path(opts.output).name
    fits: list[LayerFit] = []
    heads: list[HeadFit] = []
    warms: list[WarmFit] = []
    for spec in specs:
        planned: dict[str, Any] = {}
        for phase in PHASES:
            if phase not in st.grids:
                continue
            budget = st.sweep_budget_s / (len(specs) * len(PHASES))
            deadline = time.monotonic() + budget
            pts, passes, dropped = sweeps.plan_points(
                spec, phase, st.grids[phase], budget, mm, mem, DTYPE_BYTES[dtype], st.sweep_min_passes,
                st.sweep_max_passes, st.warmup, kv_limit_bytes=0.25 * gpu_bytes)
            if dropped:
                r.notes.append(sweeps.describe_dropped(spec.name, phase, dropped))
            planned[phase] = pts
            if pts:
                points = sweeps.layer_points(spec, phase, pts, device, dtype)
                r.run(f"{spec.name} {phase}", points, passes, deadline=deadline)
        fits.extend(sweeps.fit_sweeps(spec, r.rows, dtype, csv_name, st.stat))
        # The decode sweep's points (their calls per sample) at its shortest context, for WarmFit.
        decode = planned.get("decode") or {}
        length = min((n for _, n in decode), default=0)
        warm_pts = {p: c for p, c in decode.items() if p[1] == length and p[0] in sweeps.WARM_ROWS}
        if device.type == "cpu" and warm_pts:
            r.run(f"{spec.name} warm weights", sweeps.layer_points(spec, "decode", warm_pts, device, dtype, warm=True))
            warm = sweeps.fit_warm(spec, r.rows, dtype, st.stat)
            if warm is not None:
                warms.append(warm)
        head_bytes = 2 * spec.vocab_size * spec.hidden * DTYPE_BYTES[dtype]  # both layouts at once
        if head_bytes > HEAD_MEMORY_FRACTION * gpu_bytes:
            r.notes.append(f"{spec.name}: logits product not timed (its two layouts need {head_bytes / GiB:.2f} GiB, "
                           f"over {HEAD_MEMORY_FRACTION:g} of the gpu tier); the cost model prices it from the roofs")
            continue
        r.run(f"{spec.name} head", sweeps.head_points(spec, device, dtype))
        head = sweeps.fit_head(spec, r.rows, dtype, st.stat)
        if head is not None:
            heads.append(head)
    return fits, heads, warms


def _capacities(opts: ProfileOptions, cuda: bool, device: Any, avail: int, notes: list[str]) -> tuple[int, int]:
    """Byte budgets of the gpu and cpu tiers, from the options or from this machine."""
    import torch

    host = int(HOST_RAM_FRACTION * avail)
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        gpu = opts.gpu_mem_bytes or int(CUDA_MEM_FRACTION * total)
        if gpu > total:
            raise UserError(f"--gpu-mem {gpu} exceeds the GPU's {total} bytes; pass at most that")
        cpu = opts.cpu_mem_bytes or host
    else:
        gpu = opts.gpu_mem_bytes or int(CPU_HOST_GPU_FRACTION * avail)
        if opts.gpu_mem_bytes is None:
            notes.append(f"no GPU: the gpu tier is a declared RAM budget of {gpu / GiB:.2f} GiB "
                         f"(default {CPU_HOST_GPU_FRACTION:g} of the {avail / GiB:.1f} GiB available)")
        cpu = opts.cpu_mem_bytes or max(host - gpu, 0)
        if cpu < 2**20:  # the default, left nothing: every plan would be refused for the cpu tier
            raise UserError(f"--gpu-mem {gpu / GiB:.2f} GiB leaves no cpu tier of the default "
                            f"{HOST_RAM_FRACTION:g} x {avail / GiB:.2f} GiB available; lower --gpu-mem or pass --cpu-mem")
        if gpu + cpu > avail:
            raise UserError(f"gpu tier {gpu / GiB:.2f} GiB + cpu tier {cpu / GiB:.2f} GiB exceed the "
                            f"{avail / GiB:.2f} GiB of RAM available; lower --gpu-mem or --cpu-mem")
    if opts.cpu_mem_bytes and opts.cpu_mem_bytes > avail:
        raise UserError(f"--cpu-mem {opts.cpu_mem_bytes} exceeds the {avail} bytes of RAM available")
    return gpu, cpu


def _model_shapes(specs: Sequence[Any]) -> list[tuple[str, int, int, int, int]]:
    """(label, hidden, ffn, heads, head_dim) per model; a mid-size default without models."""
    if not specs:
        return [("", 2048, 8192, 16, 128)]
    return [(f"{s.name}:", s.hidden, s.ffn, s.num_heads, s.head_dim) for s in specs]


def _compute_points(bench: Any, device: Any, tdt: Any, shapes: Sequence[tuple[str, int, int, int, int]],
                    st: Settings, prefix: str = "") -> list[Any]:
    """GEMM of a prefill chunk, prefill attention and a weight-sized GEMV per model shape."""
    points = []
    for label, hidden, ffn, heads, head_dim in shapes:
        points.append(bench.gemm_point(prefix + "mm", device, tdt, st.gemm_tokens, hidden, ffn, label))
        points.append(bench.attention_point(prefix + "bmm", device, tdt, 1, heads, 512, head_dim, label))
        points.append(bench.gemv_point(prefix + "mem", device, tdt, st.gemv_bytes, hidden))
    return points


# ----------------------------------------------------------------------------- output
def samples_csv_path(output: Path) -> Path:
    """``profile.json`` -> ``profile.samples.csv`` beside it."""
    return output.with_name(output.stem + ".samples.csv")


def write_profile(profile: HardwareProfile, rows: Sequence[dict[str, Any]], output: Path) -> tuple[Path, Path]:
    """Write the samples CSV and the profile JSON, both or neither (a new CSV beside an old JSON
    would not be the samples that JSON was fitted from)."""
    import pandas as pd

    csv_path = samples_csv_path(output)
    atomic_write_all([(csv_path, pd.DataFrame(list(rows)).to_csv(index=False).encode()),
                      (output, profile.file_bytes())])
    return output, csv_path


def profile_machine(opts: ProfileOptions) -> tuple[HardwareProfile, Path, Path]:
    """Measure and write; returns the profile and the JSON and CSV paths."""
    check_writable(opts.output, "-o")
    check_writable(samples_csv_path(opts.output), "-o")  # written beside it: fail now, not after measuring
    profile, rows = measure_profile(opts)
    json_path, csv_path = write_profile(profile, rows, opts.output)
    return profile, json_path, csv_path

