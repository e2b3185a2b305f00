"""Timing harness and summaries shared by every profiler benchmark (no torch).

A benchmark is a list of *points* (a metadata dict plus a zero-argument callable). Points are
warmed up, then timed in several passes, each pass in a fresh random order, so that a burst
of load from another process lands on a few samples of many points instead of on all samples
of one point. Every raw sample becomes a row (the CSV kept beside the profile); a statistic
over the passes (median by default) is what the profile stores.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from xprofiler.profile import BandwidthCurve

Row = dict[str, Any]
Clock = Callable[[Callable[[], Any]], float]


@dataclass
class Point:
    """One thing to time: ``meta`` goes into every sample row; ``fn`` runs it once.

    A sample times ``meta["count"]`` back-to-back calls (so short operations are timed over a
    span long enough that the timer and a single preemption do not dominate); ``time_s`` in
    the row is the time of all of them.
    """

    meta: Row
    fn: Callable[[], Any]

    def run(self) -> None:
        for _ in range(self.meta.get("count", 1)):
            self.fn()


def wall_clock(fn: Callable[[], Any]) -> float:
    """Seconds of one call by ``time.perf_counter`` (the CPU timer; CUDA uses events)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_points(points: Sequence[Point], timer: Clock, passes: int, warmup: int = 1, seed: int = 0,
               tick: Callable[[int], Any] | None = None, deadline: float | None = None,
               min_passes: int = 1) -> list[Row]:
    """Warm up every point, then time each once per pass in a shuffled order; one row per sample.

    After ``min_passes`` passes, no new pass starts once ``time.monotonic()`` is past
    ``deadline``: the budget holds even when the machine is slower than planned.
    """
    rows: list[Row] = []
    for p in points:
        for _ in range(warmup):
            p.run()
        if tick:
            tick(warmup)
    rng = random.Random(seed)
    for k in range(passes):
        if deadline is not None and k >= min_passes and time.monotonic() > deadline:
            if tick:
                tick(len(points) * (passes - k))
            break
        order = list(range(len(points)))
        rng.shuffle(order)
        for i in order:
            rows.append({**points[i].meta, "pass": k, "time_s": timer(points[i].run)})
            if tick:
                tick(1)
    return rows


def calls_for(points: Sequence[Point], passes: int, warmup: int) -> int:
    """How many timed or warm-up samples ``run_points`` will take (for the progress bar)."""
    return len(points) * (passes + warmup)


# ----------------------------------------------------------------------------- summaries
STATS: tuple[str, ...] = ("median", "min")


def summarize_by(rows: Iterable[Row], key: str, value: Callable[[Row], float], stat: str = "median",
                 ) -> dict[Any, float]:
    """``stat`` of ``value(row)`` per distinct ``row[key]``, sorted by key.

    ``median`` is the typical time on this machine as it was; ``min`` (of times, so the max of
    rates, as ``timeit`` advises) estimates the machine without the other processes that share
    it. Callers pass times or rates: for a rate, the best is the largest value.
    """
    if stat not in STATS:
        raise ValueError(f"unknown statistic {stat!r}")
    groups: dict[Any, list[float]] = defaultdict(list)
    for r in rows:
        groups[r[key]].append(value(r))
    pick = np.median if stat == "median" else np.min
    return {k: float(pick(v)) for k, v in sorted(groups.items())}


def _rates_by(rows: Sequence[Row], bench: str, key: str, amount: Callable[[Row], float], stat: str
              ) -> dict[Any, float]:
    """``amount / stat(time)`` per ``key`` (the statistic is taken on times, then inverted)."""
    mine = [r for r in rows if r["bench"] == bench]
    if not mine:
        raise ValueError(f"no samples for {bench}")
    times = summarize_by(mine, key, lambda r: r["time_s"] / (amount(r) * r["count"]), stat)
    return {k: 1.0 / t for k, t in times.items()}


def bandwidth_curve(rows: Sequence[Row], bench: str, stat: str = "median") -> BandwidthCurve:
    """Bytes/s per transfer size; the large-transfer value is the largest size's."""
    per_size = _rates_by(rows, bench, "size_bytes", lambda r: r["size_bytes"], stat)
    sizes = tuple(int(s) for s in per_size)
    rates = tuple(per_size.values())
    return BandwidthCurve(sizes_bytes=sizes, bytes_per_s=rates, large_bytes_per_s=rates[-1])


def rate(rows: Sequence[Row], bench: str, unit: str = "flops", stat: str = "median") -> float:
    """``unit`` per second per shape, then the median over shapes."""
    per_shape = _rates_by(rows, bench, "shape", lambda r: r[unit], stat)
    return float(np.median(list(per_shape.values())))


def sample_meta(bench: str, **kw: Any) -> Row:
    """The columns every sample row has, with ``kw`` filled in."""
    base: Row = {"bench": bench, "model": "", "phase": "", "dtype": "", "shape": "", "batch": 0, "length": 0,
                 "size_bytes": 0, "count": 1, "flops": 0.0, "bytes": 0.0}
    base.update(kw)
    return base
