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
evenly over every test it runs (streams x windows x tests), so the bound above still holds.
``xsched``'s drift watcher runs only the KS tests here (``tests=("ks",)``): its CUSUMs test the
mean exactly, while this z-test's normal approximation is loose in the tail at 64 lengths
(2 of 300 unshifted 3000-request streams fired on it at a budget that allowed 0.25%).

Feed lengths of requests whose fate is settled (e.g. all requests of finished blocks); feeding
only the requests that finished first biases the output lengths short.

:class:`CusumMonitor` is the sequential test for the drift that costs most, a shift of the mean
length: two one-sided CUSUMs (Page 1954) per stream, up and down, on normal scores of the
lengths under the planned distribution (a randomised probability-integral transform, so the
scores are exactly i.i.d. N(0, 1) while the plan holds, whatever its distribution, and one long
outlier cannot fire it alone). Each CUSUM's reference value is half the score shift that a change
of ``min_shift`` (default 15%) in every length causes, computed from the planned pmf, and its
threshold holds the false-alarm probability over a job of ``horizon`` requests at
``false_alarm_rate`` (split over the four CUSUMs) by Siegmund's approximation of the in-control
average run length; ``tests/test_workloads.py`` checks the rate by simulating null streams. It is
the optimal detector for a known shift (Lorden/Moustakides) and needs no looks: it reads every
settled request.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy import optimize, special, stats

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
    level: float | None = None  # the level this test is judged at (None: the report's per-test level)

    def fired_at(self, report_level: float) -> bool:
        return self.pvalue < (report_level if self.level is None else self.level)


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
        return tuple(s for s in self.stats if s.fired_at(self.level))

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


def mean_difference_pvalue(reference: np.ndarray, lengths: np.ndarray) -> tuple[float, float]:
    """(z, two-sided p) of the sample mean against another sample's (Welch's z)."""
    var_ref = float(reference.var(ddof=1)) if len(reference) > 1 else 0.0
    se = math.sqrt(float(lengths.var(ddof=1)) / len(lengths) + var_ref / len(reference)) or 1e-12
    z = (float(lengths.mean()) - float(reference.mean())) / se
    return z, float(2 * stats.norm.sf(abs(z)))


class DriftMonitor:
    """Repeated drift tests on a growing stream with a bounded overall false-alarm rate."""

    def __init__(self, planned: Workload, false_alarm_rate: float = 0.01, min_samples: int = 30,
                 tests: Sequence[str] = ("ks", "mean"), reference_samples: dict[str, Any] | None = None):
        """``reference_samples`` (stream name -> lengths): ``planned`` was estimated from these, so
        each test compares two samples (two-sample KS, Welch's z) instead of treating it as exact;
        against a fit of 80 lengths, one-sample KS on 1000-2400 later lengths of the same
        workload fired at p ~ 1e-7 (stop 36)."""
        if not 0.0 < false_alarm_rate < 1.0:
            raise UserError(f"false-alarm rate must be a fraction in (0, 1), got {false_alarm_rate}")
        if not tests or any(t not in ("ks", "mean") for t in tests):
            raise UserError(f"drift tests must be some of ks, mean; got {', '.join(tests) or 'none'}")
        self.tests = tuple(dict.fromkeys(tests))
        if min_samples < 2:
            raise UserError(f"min_samples must be >= 2, got {min_samples}")
        self.planned = planned
        self.false_alarm_rate = false_alarm_rate
        self.min_samples = min_samples
        self.looks = 0
        self.reference_samples = {k: np.asarray(v, np.int64) for k, v in (reference_samples or {}).items()}

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
        level = self.false_alarm_rate / (k * (k + 1)) / (len(self.tests) * len(samples))
        results = []
        for name, dist, arr in samples:
            mean = float(arr.mean())
            ref = self.reference_samples.get(name)
            if "ks" in self.tests:
                two = None if ref is None else stats.ks_2samp(arr, ref)
                d, p_ks = ks_pvalue(dist, arr) if two is None else (float(two.statistic), float(two.pvalue))
                results.append(DriftStat(name, "ks", d, p_ks, mean, dist.mean, len(arr)))
            if "mean" in self.tests:
                z, p_mean = mean_shift_pvalue(dist, arr) if ref is None else mean_difference_pvalue(ref, arr)
                results.append(DriftStat(name, "mean", z, p_mean, mean, dist.mean, len(arr)))
        drifted = any(s.pvalue < level for s in results)
        return DriftReport(k, n_prompt, n_output, level, drifted, tuple(results))


DEFAULT_HORIZON = 10_000  # requests a job is assumed to hold when the caller does not say
DEFAULT_MIN_SHIFT = 0.15  # relative change of every length the CUSUM is tuned to catch fastest
DETECTION_DELAY = 500  # requests within which a CUSUM against an estimated reference should find a shift
SIEGMUND_OVERSHOOT = 1.166  # added to a CUSUM threshold in Siegmund's run-length approximation (the sum overshoots it)


def siegmund_arl(h: Any, k: Any) -> Any:
    """In-control average run length of a one-sided CUSUM of N(0, 1) scores with reference
    ``k`` and threshold ``h`` (Siegmund 1985, with the 1.166 overshoot correction). A ``k`` at or
    below 0 is a stream drifting up at least as fast as the allowance: the run length then grows
    only linearly in ``h``. Scalars or numpy arrays."""
    b = 2.0 * np.asarray(k, float) * (np.asarray(h, float) + SIEGMUND_OVERSHOOT)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        arl = np.where(np.abs(b) < 1e-6, (np.asarray(h, float) + SIEGMUND_OVERSHOOT) ** 2,
                       (np.expm1(np.minimum(b, 700.0)) - b) / (2.0 * np.asarray(k, float) ** 2))
    arl = np.where(b > 700, np.inf, np.maximum(arl, 1e-300))
    return float(arl) if arl.ndim == 0 else arl


@functools.cache
def _normal_nodes(points: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """Gauss-Hermite nodes and weights of N(0, 1): the mean over a reference's error."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(points)
    return nodes, weights / weights.sum()


def cusum_pvalue(stat: float, k: float, horizon: int, reference_sd: float = 0.0) -> float:
    """Probability that a CUSUM on an unchanged stream reaches ``stat`` within ``horizon`` scores.
    Against a reference estimated with an error of ``reference_sd`` in mean score, the stream
    seems to drift by that error, so the chance is averaged over it (run length close to
    exponential: P(alarm <= n) = 1 - exp(-n / ARL0), conservative from a fresh start)."""
    if reference_sd <= 0:
        return float(-math.expm1(-horizon / siegmund_arl(max(stat, 0.0), k)))
    nodes, weights = _normal_nodes()
    arl = siegmund_arl(max(stat, 0.0), k - reference_sd * nodes)
    return float(np.dot(weights, -np.expm1(-horizon / arl)))


def cusum_threshold(k: float, horizon: int, alpha: float, reference_sd: float = 0.0) -> float:
    """Threshold at which one CUSUM fires by mistake within ``horizon`` scores with probability
    ``alpha`` (:func:`cusum_pvalue` at it is ``alpha``); 0 where even h = 0 fires less often."""
    if cusum_pvalue(0.0, k, horizon, reference_sd) <= alpha:
        return 0.0
    top = 1e4 if k - 4 * reference_sd <= 0 else 600.0 / (2.0 * (k - 4 * reference_sd))
    top = min(top, 1e4)
    if cusum_pvalue(top, k, horizon, reference_sd) > alpha:  # the error's spread alone fires it
        return top
    return float(optimize.brentq(lambda h: math.log(cusum_pvalue(h, k, horizon, reference_sd)) - math.log(alpha),
                                 0.0, top, xtol=1e-6))


def _least(f: Any, lo: float, hi: float, points: int = 21) -> float:
    """Where ``f`` is least on [lo, hi]: a grid (``f`` may be flat or rise before its minimum),
    then Brent's bounded search between the best point's neighbours."""
    grid = np.linspace(lo, hi, points)
    i = int(np.argmin([f(x) for x in grid]))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, points - 1)]
    if b - a < 1e-9:
        return float(grid[i])
    return float(optimize.minimize_scalar(f, bounds=(a, b), method="bounded", options={"xatol": 1e-4}).x)


def cusum_design(tuned: float, horizon: int, alpha: float, reference_sd: float = 0.0, cap: float = math.inf,
                 delay: int = DETECTION_DELAY) -> tuple[float, float]:
    """Allowance and threshold of a CUSUM tuned for a mean score shift of ``2 * tuned``.

    Against an exact reference that is the classic design: allowance ``tuned``. Against one
    estimated with an error of ``reference_sd`` in mean score the threshold holds the false-alarm
    probability averaged over that error at ``alpha`` (:func:`cusum_threshold`), which a larger
    allowance (up to ``cap``) lowers. The allowance is then the one that finds the tuned shift
    soonest, (h + 1.166) / (2 tuned - k) requests, if some allowance finds it within ``delay``;
    otherwise the one that finds the smallest shift within ``delay``, k + (h + 1.166) / delay:
    a reference of 30 lengths cannot tell a 15% change from its own error at a level of 0.1%.
    Against fewer than about 10 lengths no allowance below ``cap`` holds the level, and the
    threshold is out of reach (:func:`cusum_threshold`'s top): the windowed tests watch alone."""
    if reference_sd <= 0:
        return tuned, cusum_threshold(tuned, horizon, alpha)

    def threshold(k: float) -> float:
        return cusum_threshold(k, horizon, alpha, reference_sd)

    def smallest(k: float) -> float:
        return k + (threshold(k) + SIEGMUND_OVERSHOOT) / delay

    cap = min(cap, tuned + 6 * reference_sd)  # past 6 sd the error hardly matters: the classic design
    lo = min(tuned, cap)  # a cap below the tuned allowance: the sums could never reach a threshold
    k = _least(smallest, lo, cap)
    if smallest(k) <= 2 * tuned:
        k = _least(lambda k: (threshold(k) + SIEGMUND_OVERSHOOT) / (2 * tuned - k), lo, min(cap, 2 * tuned - 1e-6))
    return k, threshold(k)


class _Scores:
    """Normal scores of lengths under one planned distribution (randomised PIT)."""

    def __init__(self, dist: LengthDistribution, rng: np.random.Generator, tail: float = 1e-12):
        support, probs = dist.pmf()
        self.lo, self.hi = int(support[0]), int(support[-1])
        self.cdf = np.concatenate(([0.0], np.cumsum(probs)))
        self.rng = rng
        self.tail = tail  # least probability a score may claim on either side

    def __call__(self, x: np.ndarray) -> np.ndarray:
        i = np.clip(np.asarray(x, np.int64) - self.lo, -1, self.hi - self.lo + 1)
        below = np.where(i < 0, 0.0, self.cdf[np.clip(i, 0, len(self.cdf) - 1)])
        at = np.where((i < 0) | (i > self.hi - self.lo), 0.0, self.cdf[np.clip(i + 1, 0, len(self.cdf) - 1)] - below)
        u = np.clip(below + self.rng.random(len(i)) * at, self.tail, 1 - self.tail)
        return special.ndtri(u)

    def shift(self, dist: LengthDistribution, factor: float) -> float:
        """Mean score of ``dist`` scaled by ``factor`` (the expected randomised score, exactly, with
        the scores' own tail: with 1e-12 there, a narrow reference's allowance came out past the
        largest score a clipped tail allows, and its CUSUM could never fire)."""
        support, probs = dist.scaled(factor).pmf()
        i = np.clip(support - self.lo, -1, self.hi - self.lo + 1)
        below = np.where(i < 0, 0.0, self.cdf[np.clip(i, 0, len(self.cdf) - 1)])
        above = np.where(i > self.hi - self.lo, 1.0, self.cdf[np.clip(i + 1, 0, len(self.cdf) - 1)])
        # E over U in [below, above] of ndtri(U clipped to [t, 1 - t]): phi(ndtri(x)) - phi(ndtri(y))
        # integrates ndtri over [x, y] between the clips, each clip adds its value times its width
        t = self.tail
        lo, hi = np.clip(below, t, 1 - t), np.clip(above, t, 1 - t)
        inner = stats.norm.pdf(special.ndtri(lo)) - stats.norm.pdf(special.ndtri(hi))
        edge = special.ndtri(1 - t)
        clipped = edge * (np.clip(above - np.maximum(below, 1 - t), 0.0, None)
                          - np.clip(np.minimum(above, t) - below, 0.0, None))
        width = above - below
        mean = np.where(width > 1e-12, (inner + clipped) / np.maximum(width, 1e-300), special.ndtri(lo))
        return float(np.dot(probs, mean))


class CusumMonitor:
    """Two one-sided CUSUMs (longer, shorter) per length stream, fed every settled request."""

    def __init__(self, planned: Workload, false_alarm_rate: float = 0.01, horizon: int = DEFAULT_HORIZON,
                 min_shift: float = DEFAULT_MIN_SHIFT, seed: int = 0,
                 reference_samples: dict[str, Any] | None = None):
        """``reference_samples`` (stream name -> lengths), as for :class:`DriftMonitor`: ``planned``
        was estimated from these, which the sums then allow for (:meth:`reference_sd`)."""
        if not 0.0 < false_alarm_rate < 1.0:
            raise UserError(f"false-alarm rate must be a fraction in (0, 1), got {false_alarm_rate}")
        if horizon < 1:
            raise UserError(f"horizon must be >= 1 request, got {horizon}")
        if not 0.0 < min_shift < 1.0:
            raise UserError(f"min_shift must be a fraction in (0, 1), got {min_shift}")
        rng = np.random.default_rng(seed)
        self.planned, self.horizon, self.false_alarm_rate = planned, int(horizon), false_alarm_rate
        self.level = false_alarm_rate / 4  # per CUSUM: two streams x two directions
        self._streams = {}
        for name, dist in (("prompt", planned.prompt), ("output", planned.output)):
            n = len((reference_samples or {}).get(name, ()))
            sc = _Scores(dist, rng, 1e-12 if not n else 0.5 / (n + 1))
            ks = (max(sc.shift(dist, 1 + min_shift), 1e-3) / 2, max(-sc.shift(dist, 1 - min_shift), 1e-3) / 2)
            sd = self.reference_sd(n) if n else 0.0
            # the allowance stays below the largest score the clipped tail allows, or a reference
            # of a few lengths (7 or fewer of T) leaves a CUSUM that can never fire
            edge = float(special.ndtri(1 - sc.tail))
            ks, hs = zip(*(cusum_design(k, self.horizon, self.level, sd, (k + edge) / 2) for k in ks))
            self._streams[name] = dict(dist=dist, scores=sc, k=ks, sd=sd, h=hs, s=[0.0, 0.0], since=[0, 0],
                                       total=[0.0, 0.0])
        self.count = 0

    @staticmethod
    def reference_sd(reference_n: int) -> float:
        """Error in mean normal score of a reference estimated from ``reference_n`` lengths: the
        mean of Phi^-1(F_n(X)) is off by the integral of (F_n - F) / phi, whose variance is
        Var(Z) / n = 1 / n to first order. The sums would take that offset for a change, so each
        CUSUM's threshold holds its false-alarm level averaged over it (:func:`cusum_design`).

        Such a reference's tails are also only known to about 1 / (n + 1): its scores claim no
        less than half that on either side (``_Scores``' tail), where a kernel fit's thin tail
        scored a length past the sample's maximum up to +7.

        History, a reference fitted on 30 / 60 / 200 lengths of T, then more lengths of T read
        every 64 (``benchmarks/drift.py --reference-runs 200`` for the delays: it shifts 50 runs
        +30% after the fit; false alarms over 3000 unchanged streams of 2000 lengths, CUSUM share
        of the default budget, 0.375%, i.e. about 11 of 3000):

        | allowance, threshold | false alarms of 3000, n = 30 / 60 | +30%: median delay | not within 2000, of 50 |
        |---|---|---|---|
        | stop 37: + isf(level) / sqrt(n), p-values at the tuned allowance | 37 / 18 | 205 / 200 / 100 | 14 / 5 / 0 |
        | stop 43: the same, fired at the tuned allowance's threshold | 0 / 0 | 770 / 600 / 240 | 46 / 31 / 0 |
        | threshold averaged over the error, allowance chosen (shipped) | 9 / 4 | 505 / 365 / 170 | 38 / 16 / 0 |

        Against 30 lengths a +30% shift (about 0.5 in mean score) is below what such a reference
        can tell from its own error at a level of 0.1%: the watcher's refit is what finds it."""
        return 1.0 / math.sqrt(reference_n)

    def update(self, prompt_lens: Any, output_lens: Any) -> None:
        """Add settled lengths (in the order they settled). The prompt lengths may be fewer than
        the outputs: a prompt sampled n times is one prompt length (n copies would make its sums
        move n times as far on one draw)."""
        p, o = np.atleast_1d(np.asarray(prompt_lens, np.int64)), np.atleast_1d(np.asarray(output_lens, np.int64))
        if len(p) > len(o):
            raise UserError("more prompt lengths than output lengths: each prompt has at least one output")
        if not len(o):
            return
        for name, x in (("prompt", p), ("output", o)):
            st = self._streams[name]
            zs, raws = st["scores"](x).tolist(), x.tolist()
            for d, sign in ((0, 1.0), (1, -1.0)):
                s, since, total, k = st["s"][d], st["since"][d], st["total"][d], st["k"][d]
                for z, raw in zip(zs, raws):
                    s += sign * z - k
                    if s > 0:
                        since, total = since + 1, total + raw
                    else:
                        s, since, total = 0.0, 0, 0.0
                st["s"][d], st["since"][d], st["total"][d] = s, since, total
        self.count += len(o)

    def stats(self) -> tuple[DriftStat, ...]:
        """One statistic per CUSUM: its value, the chance a null stream reaches it within the
        horizon (the p-value; it fires below :attr:`level`, i.e. at its threshold) and the lengths
        since it last was 0 (its estimate of where a change began). Against an estimated reference
        the chance is averaged over the reference's error (:meth:`reference_sd`)."""
        out = []
        for name, st in self._streams.items():
            for d, label in ((0, "cusum+"), (1, "cusum-")):
                n = st["since"][d]
                mean = st["total"][d] / n if n else float(st["dist"].mean)
                p = cusum_pvalue(st["s"][d], st["k"][d], self.horizon, st["sd"]) if st["s"][d] > 0 else 1.0
                if st["s"][d] > 0 and st["s"][d] >= st["h"][d]:  # a sum at 0 has seen nothing, even at h = 0
                    p = min(p, self.level * (1 - 1e-9))  # the threshold is the rule; keep p consistent with it
                out.append(DriftStat(name, label, st["s"][d], p, mean, st["dist"].mean, n, self.level))
        return tuple(out)

    def drifted(self) -> bool:
        return any(s.fired_at(self.level) for s in self.stats())

    def quiet(self, fraction: float = 0.5) -> bool:
        """Whether every CUSUM is below ``fraction`` of its threshold: no change is building up."""
        return all(st["s"][d] <= fraction * st["h"][d] for st in self._streams.values() for d in (0, 1))
