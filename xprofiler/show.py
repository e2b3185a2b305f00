"""Readable summaries of profiles for ``xsched profile show`` and ``xsched profile list``.

Plain text tables, SI-prefixed, so a user can compare a measured profile with a preset at a
glance. No torch.
"""

from __future__ import annotations

import textwrap

from xprofiler.profile import CHANNELS, MAX_AUTO_MARGIN, BandwidthCurve, HardwareProfile

GiB = 2**30


def si(value: float, unit: str) -> str:
    """``1.5e9, "B/s"`` -> ``1.50 GB/s`` (decimal prefixes, three significant digits)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def _curve(c: BandwidthCurve) -> str:
    large = si(c.large_bytes_per_s, "B/s")
    if not c.sizes_bytes:
        return f"{large} (flat)"
    pts = ", ".join(f"{_size(s)}: {si(b, 'B/s')}" for s, b in zip(c.sizes_bytes, c.bytes_per_s))
    return f"{large} large; {pts}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def summary(p: HardwareProfile) -> str:
    """Multi-line human-readable description of a profile."""
    fp = p.fingerprint
    gpu = f"{fp.gpu_name} ({gib(fp.gpu_mem_bytes)})" if fp.gpu_name else "none"
    lines = [
        f"profile {p.name} ({p.source}{', ' + p.created if p.created else ''})",
        f"  machine      {fp.cpu_model}, {fp.cpu_cores} CPUs (logical), {gib(fp.ram_bytes)} RAM; GPU {gpu}; "
        f"torch {fp.torch_version}; offload fs {fp.offload_fs}",
        f"  compute      {p.compute_device}" + (f", {p.compute_dtype}" if p.compute_dtype else "")
        + (f", disk I/O via {p.disk_io}" if p.disk_io else "") + (f", took {p.wall_s:.0f} s" if p.wall_s else ""),
        f"  capacity     gpu {gib(p.gpu_bytes)}, cpu {gib(p.cpu_bytes)}, disk {gib(p.disk_bytes)}",
    ]
    for ch in CHANNELS:
        lines.append(f"  {ch:<12} {_curve(p.bandwidth(ch))}")
    for name in ("ctog_pageable", "gtoc_pageable"):
        c = getattr(p, name)
        if c is not None:
            lines.append(f"  {name:<12} {_curve(c)}")
    lines += [
        f"  device       mm {si(p.mm_flops, 'FLOP/s')}, bmm {si(p.bmm_flops, 'FLOP/s')}, memory roof "
        + (si(p.mem_bytes_per_s, "B/s") if p.mem_bytes_per_s else "unknown"),
        f"  host cpu     mm {si(p.cpu_mm_flops, 'FLOP/s')}, bmm {si(p.cpu_bmm_flops, 'FLOP/s')}, memory roof "
        + (si(p.cpu_mem_bytes_per_s, "B/s") if p.cpu_mem_bytes_per_s else "unknown")
        + (f", decode attention {si(p.cpu_attend_bytes_per_s, 'B/s')} of {p.compute_dtype or 'float32'} K/V"
           if p.cpu_attend_bytes_per_s else ""),
        f"  4-bit        quantize {si(p.quant_bytes_per_s, 'B/s')}, dequantize {si(p.dequant_bytes_per_s, 'B/s')}"
        + (f", decode attention over the codes {si(p.kv_attend_bytes_per_s, 'B/s')} of "
           f"{p.compute_dtype or 'float32'} K/V" if p.kv_attend_bytes_per_s else ""),
    ]
    if p.disk_row_write_s or p.disk_row_read_s:
        lines.append(f"  disk rows    4 KiB KV/activation rows: read {p.disk_row_read_s * 1e6:.0f} us each; a store "
                     f"{p.disk_sync_s * 1e6:.0f} us + {p.disk_row_write_s * 1e6:.0f} us per row")
    if p.layer_fits:
        lines.append("  layer fits   model / phase: time = sum of terms (1/coef as a rate); linear-part error med/max")
        for f in p.layer_fits:
            terms = ", ".join(_term(n, c) for n, c in zip(f.features, f.coef))
            grid = f", grid {len(f.grid_batches)}x{len(f.grid_lengths)}" if f.grid_ratio else ""
            lines.append(f"    {f.model} / {f.phase} ({f.dtype}, {f.n_samples} points{grid}): {terms}; "
                         f"error {f.median_rel_error:.1%} / {f.max_rel_error:.1%}")
    else:
        lines.append("  layer fits   none (compute time from the flop rates and memory roofs)")
    for f in p.head_fits:
        cells = ", ".join(f"{r}: {t * 1e3:.3g}" + (" T" if layout == "transposed" else "")
                          for r, t, layout in zip(f.rows, f.seconds, f.layouts or ("",) * len(f.rows)))
        lines.append(f"  lm head      {f.model} ({f.dtype}), ms per rows (T: transposed layout): {cells}")
    for f in p.warm_fits:
        cells = ", ".join(f"{r}: {t * 1e3:.3g}" for r, t in zip(f.rows, f.saved_s))
        lines.append(f"  warm weights {f.model} ({f.dtype}), ms a decode layer saves with its weights cached, "
                     f"per rows: {cells}")
    if p.calibration:
        # factors read "x1.2"; terms in seconds (names ending _s) read "1.09 ms"; what the solver left
        # at its bound of zero reads 0, not "1.9e-13 ms"
        lines.append("  calibration  " + ", ".join(
            (f"{k} {_rounded(v * 1e3, 1e-6)} ms" if k.endswith("_s") else f"{k} x{_rounded(v, 1e-6)}")
            for k, v in sorted(p.calibration.items())))
    err = p.calibration_error
    if err is not None:
        spread = "unknown" if err.repeat_rel_spread is None else f"{err.repeat_rel_spread:.1%}"
        lines.append(f"  run error    step wall times, {err.quantile:.0%} quantile: run-to-run spread {spread} "
                     f"({err.repeats} repeats), fit error {err.fit_rel_error:.1%}; planning margin "
                     f"{err.planning_margin():.1%}"
                     + (" (capped: an error of 100% or more; calibrate again)"
                        if err.planning_margin() >= MAX_AUTO_MARGIN else ""))
    if p.notes:
        lines.append(textwrap.fill(p.notes, width=110, initial_indent="  notes        ",
                                   subsequent_indent=" " * 15))
    return "\n".join(lines)


def _rounded(value: float, zero_below: float) -> str:
    return "0" if abs(value) < zero_below else f"{value:.3g}"


def _term(name: str, coef: float) -> str:
    if coef == 0:
        return f"{name} 0"
    if name == "const":
        return f"{coef * 1e3:.3g} ms"
    if name.endswith("flops"):
        return f"{name} @ {si(1 / coef, 'FLOP/s')}"
    if name.endswith("bytes"):
        return f"{name} @ {si(1 / coef, 'B/s')}"
    return f"{name} x {coef * 1e6:.3g} us"


def one_line(p: HardwareProfile) -> str:
    """A row of ``xsched profile list``."""
    gpu = p.fingerprint.gpu_name or f"{p.compute_device} (no GPU)"
    return (f"{p.name:<16} {gpu:<24} gpu {gib(p.gpu_bytes):>9}  cpu {gib(p.cpu_bytes):>9}  "
            f"disk {gib(p.disk_bytes):>10}  ctog {si(p.ctog.large_bytes_per_s, 'B/s'):>10}  "
            f"dtoc {si(p.dtoc.large_bytes_per_s, 'B/s'):>10}  mm {si(p.mm_flops, 'FLOP/s'):>13}")
