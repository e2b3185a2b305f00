"""Fit a LengthDistribution to observed lengths and say how well each family fits.

Every family is fitted by maximising the likelihood of the *integer* pmf (the same discretised,
truncated object the simulator uses), so log-likelihoods are comparable across families; the
best family has the lowest BIC (AIC lets the empirical pmf, with one parameter per distinct length,
memorise a few hundred samples) among those the KS test does not reject at ``KS_ALPHA``: BIC
alone once chose a skew-normal with p = 3e-6 whose p99 fell 15% short of the data's. The
empirical pmf, which the test never rejects, wins when no parametric family fits. Parametric
families are truncated to the observed range, as the empirical pmf is: spread from length 1, a
fit to lengths of 21-300 put mass below 21 and its mean at 152.5 against the data's 160.5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from scipy import optimize, special, stats

from workloads.distributions import LengthDistribution
from xsched.contract import Contract
from xsched.errors import UserError

KS_ALPHA = 0.01  # a family whose KS p-value is below this does not describe the lengths


@dataclass(frozen=True)
class FitCandidate:
    """One family's maximum-likelihood fit and its goodness of fit."""

    family: str
    distribution: LengthDistribution
    log_likelihood: float
    num_params: int
    bic: float  # k ln(n) - 2 log-likelihood
    ks_statistic: float
    ks_pvalue: float  # conservative for integer data (the continuous KS null distribution)


@dataclass(frozen=True)
class FitReport(Contract):
    """All candidate fits, best first; ``best`` is the chosen distribution."""

    SCHEMA: ClassVar[str] = "xsched.FitReport/1"

    n: int
    best: LengthDistribution
    candidates: tuple[FitCandidate, ...]

    def describe(self) -> str:
        lines = [f"{self.n} lengths; best fit: {self.best.describe()}",
                 f"  {'family':<10} {'params':>6} {'log-lik':>12} {'BIC':>12} {'KS D':>7} {'KS p':>8}"]
        for c in self.candidates:
            lines.append(f"  {c.family:<10} {c.num_params:>6} {c.log_likelihood:>12.1f} {c.bic:>12.1f} "
                         f"{c.ks_statistic:>7.4f} {c.ks_pvalue:>8.3g}"
                         + (f"  rejected (KS p < {KS_ALPHA:g})" if c.ks_pvalue < KS_ALPHA else ""))
        return "\n".join(lines)


def ks_distance(dist: LengthDistribution, lengths: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance between the empirical CDF of integer lengths and ``dist``.

    Both CDFs are step functions jumping at integers, so the supremum is attained on the
    integers; evaluating there avoids scipy's tie handling, which overstates D for discrete data.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    lo, hi = min(int(lengths.min()), dist.min_len), max(int(lengths.max()), dist.max_len)
    grid = np.arange(lo, hi + 1)
    ecdf = np.searchsorted(np.sort(lengths), grid, side="right") / lengths.size
    return float(np.max(np.abs(ecdf - dist.cdf(grid))))


def ks_pvalue(dist: LengthDistribution, lengths: np.ndarray) -> tuple[float, float]:
    """(D, p): the one-sample KS test; p is conservative (never too small) for integer data."""
    d = ks_distance(dist, lengths)
    return d, float(stats.kstwo.sf(d, len(lengths)))


def _log_likelihood(dist: LengthDistribution, values: np.ndarray, counts: np.ndarray) -> float:
    if values.min() < dist.min_len or values.max() > dist.max_len:
        return -math.inf
    p = dist.probs_at(values)
    if np.any(p <= 0):
        return -math.inf
    return float(np.dot(counts, np.log(p)))


def _fit_parametric(family: str, values: np.ndarray, counts: np.ndarray, max_len: int) -> LengthDistribution:
    """Maximum-likelihood parameters of ``family`` truncated to the shortest length seen..max_len."""
    n = counts.sum()
    mean = float(np.dot(values, counts) / n)
    std = max(float(math.sqrt(np.dot((values - mean) ** 2, counts) / n)), 0.5)
    low = int(values.min())
    span = max_len - low

    def build(x: np.ndarray) -> LengthDistribution:
        m = low + span * float(special.expit(x[0]))
        s = float(np.exp(x[1]))
        if family == "skewnorm":
            return LengthDistribution.skewnorm(m, s, 0.99 * float(np.tanh(x[2])), max_len, low)
        return getattr(LengthDistribution, family)(m, s, max_len, low)

    def neg_ll(x: np.ndarray) -> float:
        try:
            ll = _log_likelihood(build(x), values, counts)
        except (UserError, OverflowError):  # Nelder-Mead can push std to 1e200, whose square overflows
            return 1e300
        return -ll if math.isfinite(ll) else 1e300

    frac = min(max((mean - low) / span, 1e-3), 1 - 1e-3) if span > 0 else 0.5
    x0 = [float(special.logit(frac)), math.log(std)] + ([0.0] if family == "skewnorm" else [])
    res = optimize.minimize(neg_ll, x0, method="Nelder-Mead", options={"xatol": 1e-4, "fatol": 1e-6, "maxiter": 600})
    return build(res.x)


def fit_lengths(lengths: Any, max_len: int | None = None) -> FitReport:
    """Fit truncated normal, skew-normal, log-normal and empirical pmfs; pick the lowest BIC of
    those the KS test keeps (the empirical pmf always passes)."""
    arr = np.asarray(lengths)
    if arr.size == 0:
        raise UserError("cannot fit a length distribution to no lengths")
    if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)) or arr.min() < 1:
        raise UserError("lengths to fit must be whole numbers of tokens >= 1")
    arr = arr.astype(np.int64)
    top = int(arr.max()) if max_len is None else int(max_len)
    if top < arr.max():
        raise UserError(f"max_len {top} is below the longest observed length {int(arr.max())}")
    values, counts = np.unique(arr, return_counts=True)
    if len(values) == 1:
        fixed = LengthDistribution.fixed(int(values[0]))
        cand = FitCandidate("fixed", fixed, 0.0, 0, 0.0, 0.0, 1.0)
        return FitReport(n=int(arr.size), best=fixed, candidates=(cand,))
    dists: list[tuple[str, LengthDistribution, int]] = [
        (family, _fit_parametric(family, values, counts, top), k)
        for family, k in (("truncnorm", 2), ("skewnorm", 3), ("lognorm", 2))]
    dists.append(("empirical", LengthDistribution.empirical(arr, top), len(values) - 1))
    cands = []
    for family, dist, k in dists:
        ll = _log_likelihood(dist, values, counts)
        d, p = ks_pvalue(dist, arr)
        cands.append(FitCandidate(family, dist, ll, k, k * math.log(arr.size) - 2 * ll, d, p))
    cands.sort(key=lambda c: c.bic)
    kept = next(c for c in cands if c.ks_pvalue >= KS_ALPHA or c.family == "empirical")
    return FitReport(n=int(arr.size), best=kept.distribution, candidates=tuple(cands))
