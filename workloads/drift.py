"""Drift test: do the lengths observed so far still follow the planned workload?

The runner calls :meth:`DriftMonitor.check` between blocks with *all* lengths observed so far.
Testing a growing stream again and again inflates false alarms, so each call (a "look") spends
only part of the false-alarm budget: look k tests at ``alpha / (k (k + 1))``, and these sum to
``alpha`` over any number of looks (Bonferroni over looks). Within a look the budget is split
evenly over the tests run: for prompt and output lengths each, a Kolmogorov-Smirnov test
against the planned distribution (any change of shape) and a z-test of the mean with the planned
std (most powerful for a shift of the mean, the drift ExeGPT §7.6 studies). Both are from
scipy.stats; KS is conservative for integer lengths, so the overall false-alarm rate stays at
most ``alpha`` (up to the normal approximation of the mean test).

A change in the middle of a long stream moves the mean of *everything* seen so far only slowly,
so a look may also test the most recent ``w`` lengths for a few window sizes (``windows``): the
window that holds about the post-change lengths has full power. The level of a look is split
evenly over every test it runs (streams x windows x 2), so the bound above still holds.

Feed lengths of requests whose fate is settled (e.g. all requests of finished blocks); feeding
only the requests that finished first biases the output lengths short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy import stats

from workloads.distributions import LengthDistribution
from workloads.fit import ks_pvalue
from workloads.workload import Workload
from xsched.errors import UserError


@dataclass(frozen=True)
class DriftStat:
    """One test of one length stream at one look."""

    stream: str  # "prompt" or "output"
    test: str  # "ks" or "mean"
    statistic: float
    pvalue: float
    observed_mean: float
    planned_mean: float
    n: int = 0  # how many (most recent) lengths the test used


@dataclass(frozen=True)
class DriftReport:
    """The outcome of one look: whether any test fired at this look's significance level."""

    look: int
    n_prompt: int
    n_output: int
    level: float  # per-test significance level used at this look
    drifted: bool
    stats: tuple[DriftStat, ...]

    def fired(self) -> tuple[DriftStat, ...]:
        return tuple(s for s in self.stats if s.pvalue < self.level)

    def describe(self) -> str:
        if not self.stats:
            return f"look {self.look}: too few lengths to test"
        head = "drift detected" if self.drifted else "no significant drift"
        parts = [f"{s.stream} {s.test} p={s.pvalue:.2g} (mean {s.observed_mean:.1f} of the last {s.n} vs planned "
                 f"{s.planned_mean:.1f})" for s in (self.fired() or self.stats)]
        return f"look {self.look}: {head} at level {self.level:.2g}: " + "; ".join(parts)


def mean_shift_pvalue(dist: LengthDistribution, lengths: np.ndarray) -> tuple[float, float]:
    """(z, two-sided p) of the sample mean against the planned mean and std."""
    n = len(lengths)
    if dist.std == 0:
        same = bool(np.all(lengths == dist.mean))
        return (0.0, 1.0) if same else (math.inf, 0.0)
    z = (float(np.mean(lengths)) - dist.mean) / (dist.std / math.sqrt(n))
    return z, float(2 * stats.norm.sf(abs(z)))


class DriftMonitor:
    """Repeated drift tests on a growing stream with a bounded overall false-alarm rate."""

    def __init__(self, planned: Workload, false_alarm_rate: float = 0.01, min_samples: int = 30):
        if not 0.0 < false_alarm_rate < 1.0:
            raise UserError(f"false-alarm rate must be a fraction in (0, 1), got {false_alarm_rate}")
        if min_samples < 2:
            raise UserError(f"min_samples must be >= 2, got {min_samples}")
        self.planned = planned
        self.false_alarm_rate = false_alarm_rate
        self.min_samples = min_samples
        self.looks = 0

    def check(self, prompt_lens: Any, output_lens: Any = None, windows: Sequence[int] = ()) -> DriftReport:
        """One look at all lengths observed so far (and at the most recent ``w`` of them for each
        ``w`` in ``windows`` that is at least ``min_samples`` and below the count); spends part of
        the false-alarm budget."""
        streams = []
        for name, dist, data in (("prompt", self.planned.prompt, prompt_lens),
                                 ("output", self.planned.output, output_lens)):
            if data is None:
                continue
            arr = np.asarray(data)
            if arr.size and (np.any(arr < 1) or np.any(arr != np.round(arr))):
                raise UserError(f"observed {name} lengths must be whole numbers >= 1")
            if arr.size >= self.min_samples:
                streams.append((name, dist, arr.astype(np.int64)))
        n_prompt = 0 if prompt_lens is None else len(prompt_lens)
        n_output = 0 if output_lens is None else len(output_lens)
        if not streams:
            return DriftReport(self.looks, n_prompt, n_output, 0.0, False, ())
        self.looks += 1
        k = self.looks
        samples = [(name, dist, arr[-w:]) for name, dist, arr in streams
                   for w in sorted({len(arr), *(w for w in windows if self.min_samples <= w < len(arr))})]
        level = self.false_alarm_rate / (k * (k + 1)) / (2 * len(samples))
        results = []
        for name, dist, arr in samples:
            d, p_ks = ks_pvalue(dist, arr)
            z, p_mean = mean_shift_pvalue(dist, arr)
            mean = float(arr.mean())
            results.append(DriftStat(name, "ks", d, p_ks, mean, dist.mean, len(arr)))
            results.append(DriftStat(name, "mean", z, p_mean, mean, dist.mean, len(arr)))
        drifted = any(s.pvalue < level for s in results)
        return DriftReport(k, n_prompt, n_output, level, drifted, tuple(results))
