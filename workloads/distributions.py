"""LengthDistribution: the distribution of prompt or output lengths, in tokens.

Throughput under a latency bound depends on the whole distribution, not on its mean (ExeGPT
§6-7), so every family is reduced to one exact object: an integer pmf on ``min_len..max_len``.
Continuous families (scipy.stats) are rounded to the nearest integer and truncated to that range
(probability outside is dropped and the rest renormalised), as ExeGPT §7.1 truncates its normals.
The pmf drives sampling (inverse CDF), moments, percentiles and the analytic simulator, so they
can never disagree with each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, ClassVar, Literal, get_args

import numpy as np
from scipy import special

from xsched.contract import Contract
from xsched.errors import UserError

Family = Literal["truncnorm", "skewnorm", "lognorm", "fixed", "empirical", "mixture"]
FAMILIES: tuple[str, ...] = get_args(Family)
PARAMETRIC: tuple[str, ...] = ("truncnorm", "skewnorm", "lognorm")
_PARAM_NAMES: dict[str, tuple[str, ...]] = {
    "truncnorm": ("mean", "std"),
    "skewnorm": ("mean", "std", "skew"),
    "lognorm": ("mean", "std"),
    "fixed": ("value",),
    "empirical": (),
    "mixture": (),
}
# scipy's skew-normal cannot reach |skewness| >= 0.9953 (ExeGPT §7.6 notes the (-1, 1) limit).
MAX_SKEW = 0.99
# A std beyond this many times max_len makes the truncated pmf flat to float precision.
MAX_STD_RATIO = 1e6
# Longest length a distribution may reach: 8x the longest context of today's models. The pmf is a
# dense table over min_len..max_len, so `T@1e6` would otherwise allocate gigabytes.
MAX_LEN_TOKENS = 2**23


@dataclass(frozen=True)
class LengthDistribution(Contract):
    """Integer lengths in ``min_len..max_len`` drawn from one family (see module docstring).

    ``params`` holds the moments of the continuous distribution *before* rounding and
    truncation (``mean``, ``std`` and, for skew-normal, ``skew``), or ``value`` for ``fixed``.
    ``values``/``weights`` hold an empirical pmf; ``weights``/``components`` a mixture.
    Build instances with the classmethods (``truncnorm``, ``fixed``, ...), which check input.
    """

    SCHEMA: ClassVar[str] = "xsched.LengthDistribution/1"

    family: Family
    max_len: int
    min_len: int = 1
    params: dict[str, float] = field(default_factory=dict)
    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    components: tuple["LengthDistribution", ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UserError(f"unknown length distribution family {self.family!r}; use one of {', '.join(FAMILIES)}")
        if self.min_len < 1:
            raise UserError(f"{self.family}: lengths must be >= 1 token, got min_len={self.min_len}")
        if self.max_len < self.min_len:
            raise UserError(f"{self.family}: max_len={self.max_len} is below min_len={self.min_len}")
        if self.max_len > MAX_LEN_TOKENS:
            shown = f"{self.max_len:,}" if self.max_len < 10**15 else f"{float(self.max_len):.3g}"  # (not 300 digits)
            raise UserError(f"{self.family}: max_len={shown} tokens is beyond any model's context "
                            f"(at most {MAX_LEN_TOKENS:,}); check the lengths or the @SCALE factor")
        missing = [p for p in _PARAM_NAMES[self.family] if p not in self.params]
        extra = [p for p in self.params if p not in _PARAM_NAMES[self.family]]
        if missing or extra:
            raise UserError(f"{self.family}: parameters must be {', '.join(_PARAM_NAMES[self.family]) or 'none'}; "
                            f"got {', '.join(self.params) or 'none'}")
        if any(not math.isfinite(v) for v in self.params.values()):
            raise UserError(f"{self.family}: parameters must be finite numbers, got {self.params}")
        if self.family in PARAMETRIC:
            mean, std = self.params["mean"], self.params["std"]
            if std <= 0:
                raise UserError(f"{self.family}: std must be > 0, got {std:g}; use 'fixed' for a constant length")
            if std > MAX_STD_RATIO * self.max_len:  # lognorm squares std / mean: 1e200 overflowed
                raise UserError(f"{self.family}: std {std:g} is more than {MAX_STD_RATIO:g}x max_len "
                                f"{self.max_len}; the truncated distribution would be flat: use a smaller std")
            if not self.min_len <= mean <= self.max_len:
                raise UserError(f"{self.family}: mean {mean:g} is outside {self.min_len}..{self.max_len}; "
                                f"max must be >= mean (and mean >= 1)")
            if self.family == "skewnorm" and abs(self.params["skew"]) > MAX_SKEW:
                raise UserError(f"skewnorm: skew {self.params['skew']:g} is outside -{MAX_SKEW}..{MAX_SKEW}")
        elif self.family == "fixed":
            v = self.params["value"]
            if v != int(v) or not self.min_len <= v <= self.max_len:
                raise UserError(f"fixed: length {v:g} must be an integer in {self.min_len}..{self.max_len}")
        elif self.family == "empirical":
            if not self.values or len(self.values) != len(self.weights):
                raise UserError("empirical: needs matching non-empty values and weights")
            if min(self.values) < self.min_len or max(self.values) > self.max_len:
                raise UserError(f"empirical: values must lie in {self.min_len}..{self.max_len}")
            if min(self.weights) < 0 or not 0 < sum(self.weights) < math.inf:  # NaN and inf too
                raise UserError("empirical: weights must be finite and >= 0 with a positive, finite sum")
        elif self.family == "mixture":
            if not self.components or len(self.components) != len(self.weights):
                raise UserError("mixture: needs matching non-empty components and weights")
            if min(self.weights) < 0 or not 0 < sum(self.weights) < math.inf:  # NaN and inf too
                raise UserError("mixture: weights must be finite and >= 0 with a positive, finite sum")
            if min(c.min_len for c in self.components) < self.min_len or \
                    max(c.max_len for c in self.components) > self.max_len:
                raise UserError("mixture: components must lie inside the mixture's min_len..max_len")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def truncnorm(cls, mean: float, std: float, max_len: int, min_len: int = 1) -> "LengthDistribution":
        """Normal(mean, std) rounded and truncated to min_len..max_len (ExeGPT's task model)."""
        return cls("truncnorm", int(max_len), int(min_len), {"mean": float(mean), "std": float(std)})

    @classmethod
    def truncnorm_with_moments(cls, mean: float, std: float, max_len: int, min_len: int = 1) -> "LengthDistribution":
        """The truncated normal whose *realised* mean and std (after truncation) match the given ones.

        ExeGPT Table 3 reports realised moments: with them its 99th-percentile column is
        reproduced exactly. Where no truncated normal on the range reaches the requested std
        (e.g. std above that of a uniform), this returns the closest one in least squares.
        """
        if std <= 0:
            raise UserError(f"truncnorm: std must be > 0, got {std:g}; use 'fixed' for a constant length")
        if not min_len <= mean <= max_len:
            raise UserError(f"truncnorm: mean {mean:g} is outside {min_len}..{max_len}; max must be >= mean")
        if max_len == min_len:  # one possible length (e.g. a preset scaled far down)
            return cls.fixed(max_len)

        def residual(x: np.ndarray) -> list[float]:
            d = cls.truncnorm(x[0], x[1], max_len, min_len)
            # The tiny last term only breaks the tie when the std is unreachable (then the answer
            # is nearly uniform whatever the location): it keeps the location at the mean.
            return [(d.mean - mean) / std, (d.std - std) / std, 1e-4 * (x[0] - mean) / std]

        from scipy import optimize  # (here: it adds about 25 MiB to every process that reads a workload)

        widest = 2.0 * max(max_len - min_len, 1)  # wider than this is uniform on the range anyway
        sol = optimize.least_squares(residual, [mean, min(std, widest)],
                                     bounds=([min_len, 0.05], [max_len, widest]), xtol=1e-10, ftol=1e-10)
        return cls.truncnorm(float(sol.x[0]), float(sol.x[1]), max_len, min_len)

    @classmethod
    def skewnorm(cls, mean: float, std: float, skew: float, max_len: int, min_len: int = 1) -> "LengthDistribution":
        """Skew-normal with the given mean, std and skewness before truncation (ExeGPT §7.6)."""
        return cls("skewnorm", int(max_len), int(min_len),
                   {"mean": float(mean), "std": float(std), "skew": float(skew)})

    @classmethod
    def lognorm(cls, mean: float, std: float, max_len: int, min_len: int = 1) -> "LengthDistribution":
        """Log-normal with the given mean and std before truncation (long-tailed real datasets)."""
        return cls("lognorm", int(max_len), int(min_len), {"mean": float(mean), "std": float(std)})

    @classmethod
    def fixed(cls, value: int) -> "LengthDistribution":
        """Every request has exactly ``value`` tokens (FlexGen's benchmarks)."""
        if not (isinstance(value, (int, np.integer)) or (isinstance(value, float) and value.is_integer())):
            raise UserError(f"fixed: a length is a whole number of tokens, got {value!r}")  # (2.5 became 2)
        if int(value) < 1:
            raise UserError(f"fixed: lengths must be >= 1 token, got {value}")
        return cls("fixed", int(value), int(value), {"value": float(int(value))})

    @classmethod
    def empirical(cls, lengths: Any, max_len: int | None = None) -> "LengthDistribution":
        """The observed frequencies of ``lengths`` (positive integers)."""
        arr = np.asarray(lengths)
        if arr.size == 0:
            raise UserError("empirical: no lengths given")
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise UserError("empirical: lengths must be whole numbers of tokens")
        arr = arr.astype(np.int64)
        if arr.min() < 1:
            raise UserError(f"empirical: lengths must be >= 1 token, got {int(arr.min())}")
        return weighted_empirical(arr, np.ones(arr.size), max_len)

    @classmethod
    def mixture(cls, components: list["LengthDistribution"], weights: list[float]) -> "LengthDistribution":
        """A weighted mixture, e.g. a bimodal workload of short and long requests."""
        comps = tuple(components)
        if not comps:
            raise UserError("mixture: needs at least one component")
        return cls("mixture", max(c.max_len for c in comps), min(c.min_len for c in comps), {}, (),
                   tuple(float(w) for w in weights), comps)

    # ------------------------------------------------------------------ the pmf
    def _cdf_sf(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """CDF and survival function of a parametric family before truncation, at ``x``."""
        p = self.params
        # scipy.stats.norm / lognorm's own formulas (ndtr of the standardised value), without
        # building a frozen distribution per call: fits take the likelihood hundreds of times
        if self.family == "truncnorm":
            z = (x - p["mean"]) / p["std"]
            return special.ndtr(z), special.ndtr(-z)
        if self.family == "lognorm":
            sigma2 = math.log1p((p["std"] / p["mean"]) ** 2)
            with np.errstate(divide="ignore"):  # x = 0 is -inf: cdf 0, sf 1
                z = np.log(x / (p["mean"] * math.exp(-sigma2 / 2))) / math.sqrt(sigma2)
            return special.ndtr(z), special.ndtr(-z)
        if self.family == "skewnorm":
            # Owen's T closed form of the skew-normal CDF: identical to scipy.stats.skewnorm.cdf
            # (checked in the tests) and thousands of times faster, which the fitter needs.
            shape, loc, scale = skewnorm_parameters(p["mean"], p["std"], p["skew"])
            z = (x - loc) / scale
            t = special.owens_t(z, shape)
            return special.ndtr(z) - 2 * t, special.ndtr(-z) + 2 * t
        raise AssertionError(self.family)

    @cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        support = np.arange(self.min_len, self.max_len + 1, dtype=np.int64)
        if self.family in PARAMETRIC:
            edges = np.arange(self.min_len - 0.5, self.max_len + 1.0, 1.0)
            # Differences of cdf below the mean and of sf above it keep tail bins accurate.
            cdf, sf = self._cdf_sf(edges)
            probs = np.where(edges[1:] <= self.params["mean"], np.diff(cdf), -np.diff(sf))
            probs = np.clip(probs, 0.0, None)
        elif self.family == "fixed":
            probs = np.zeros(len(support))
            probs[int(self.params["value"]) - self.min_len] = 1.0
        elif self.family == "empirical":
            probs = np.zeros(len(support))
            np.add.at(probs, np.asarray(self.values) - self.min_len, np.asarray(self.weights, dtype=float))
        else:  # mixture
            probs = np.zeros(len(support))
            total = sum(self.weights)
            for comp, w in zip(self.components, self.weights):
                s, p = comp._table
                probs[s - self.min_len] += (w / total) * p
        total = probs.sum()
        if not total > 0:
            raise UserError(f"{self.describe()}: no probability mass inside {self.min_len}..{self.max_len}")
        probs = probs / total
        return support, probs

    def probs_at(self, lengths: Any) -> np.ndarray:
        """Probability of each of ``lengths`` (all within min_len..max_len), as :meth:`pmf` gives
        it. A parametric family is evaluated at these lengths' bins and its mass inside the range
        only, not over the whole table: a fit's likelihood is taken hundreds of times, and lengths
        near 2**23 made a table per evaluation take minutes."""
        x = np.asarray(lengths, dtype=np.int64)
        if self.family not in PARAMETRIC:
            return self._table[1][x - self.min_len]
        lo, hi = self.min_len - 0.5, self.max_len + 0.5
        # the table takes differences of cdf for bins up to the mean and of sf above: the same here
        split = min(max(lo + math.floor(self.params["mean"] - lo), lo), hi)
        cdf, sf = self._cdf_sf(np.concatenate((x - 0.5, x + 0.5, [lo, split, hi])))
        n = len(x)
        below = x + 0.5 <= self.params["mean"]
        probs = np.clip(np.where(below, cdf[n:2 * n] - cdf[:n], sf[:n] - sf[n:2 * n]), 0.0, None)
        total = (cdf[-2] - cdf[-3]) + (sf[-2] - sf[-1])
        if not total > 0:
            raise UserError(f"{self.describe()}: no probability mass inside {self.min_len}..{self.max_len}")
        return probs / total

    @cached_property
    def _cdf_table(self) -> np.ndarray:
        cdf = np.cumsum(self._table[1])
        cdf[-1] = 1.0
        return cdf

    def pmf(self) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths, probabilities)``: every length in min_len..max_len and its probability."""
        support, probs = self._table
        return support.copy(), probs.copy()

    def cdf(self, length: Any) -> Any:
        """P(L <= length), element-wise."""
        idx = np.clip(np.floor(np.asarray(length, dtype=float)) - self.min_len, -1, self.max_len - self.min_len)
        cdf = self._cdf_table
        out = np.where(idx < 0, 0.0, cdf[np.maximum(idx, 0).astype(np.int64)])
        return out if np.ndim(out) else float(out)

    def ppf(self, u: Any) -> Any:
        """Smallest length whose cdf reaches ``u`` (0..1), element-wise: the inverse CDF."""
        idx = np.searchsorted(self._cdf_table, np.asarray(u, dtype=float), side="left")
        out = self.min_len + np.minimum(idx, self.max_len - self.min_len)
        return out.astype(np.int64) if np.ndim(out) else int(out)

    def quantile(self, q: float) -> int:
        """The ``q``-quantile (q in 0..1, not percent), e.g. ``quantile(0.99)`` for the p99."""
        if not 0.0 <= q <= 1.0:
            raise UserError(f"quantile {q} is outside 0..1 (a fraction, not a percent)")
        return int(self.ppf(q))

    def sample(self, n: int, seed: int | np.random.Generator = 0) -> np.ndarray:
        """``n`` lengths by inverse-CDF sampling; the same seed gives the same lengths."""
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        return self.ppf(rng.random(int(n)))

    @cached_property
    def mean(self) -> float:
        support, probs = self._table
        return float(np.dot(support, probs))

    @cached_property
    def std(self) -> float:
        support, probs = self._table
        return float(math.sqrt(max(np.dot((support - self.mean) ** 2, probs), 0.0)))

    # ------------------------------------------------------------------ helpers
    def scaled(self, factor: float) -> "LengthDistribution":
        """Every length multiplied by ``factor`` (rounded, at least 1): small-machine variants."""
        if not 0 < factor < math.inf:
            raise UserError(f"scale factor must be a finite number > 0, got {factor}")

        def sc(x: float) -> int:
            return max(1, int(round(x * factor)))

        if self.family in PARAMETRIC:
            params = {k: (v if k == "skew" else v * factor) for k, v in self.params.items()}
            params["mean"] = max(1.0, params["mean"])
            top = max(sc(self.max_len), int(math.ceil(params["mean"])))
            low = max(1, min(sc(self.min_len), int(math.floor(params["mean"]))))  # rounding can pass the mean
            return LengthDistribution(self.family, top, low, params)
        if self.family == "fixed":
            return LengthDistribution.fixed(sc(self.params["value"]))
        # Both keep their declared max_len (a re-plan's fit sets one past its sample; memory is sized by it).
        if self.family == "empirical":
            return weighted_empirical(np.array([sc(v) for v in self.values]), np.asarray(self.weights),
                                      sc(self.max_len))
        mix = LengthDistribution.mixture([c.scaled(factor) for c in self.components], list(self.weights))
        return replace(mix, max_len=sc(self.max_len))

    def summary(self) -> dict[str, float]:
        """Realised statistics of the integer distribution (after rounding and truncation); min and max
        are the extremes it can draw (an empirical pmf of 6s in 6..8 read "p99 6, max 8")."""
        support, probs = self._table
        drawn = support[probs > 0]
        return {"mean": self.mean, "std": self.std, "p50": self.quantile(0.5), "p90": self.quantile(0.9),
                "p99": self.quantile(0.99), "min": int(drawn[0]), "max": int(drawn[-1])}

    def describe(self) -> str:
        if self.family == "fixed":
            return f"fixed {int(self.params['value'])}"
        if self.family in PARAMETRIC:
            extra = f", skew {self.params['skew']:g}" if self.family == "skewnorm" else ""
            return (f"{self.family}(mean {self.params['mean']:g}, std {self.params['std']:g}{extra}) "
                    f"in {self.min_len}..{self.max_len}")
        if self.family == "empirical":
            return f"empirical over {len(self.values)} distinct lengths in {self.min_len}..{self.max_len}"
        return "mixture of " + " + ".join(f"{w:g} x [{c.describe()}]" for c, w in zip(self.components, self.weights))


def skewnorm_parameters(mean: float, std: float, skew: float) -> tuple[float, float, float]:
    """(shape, loc, scale) of the skew-normal with the given mean, std and skewness.

    scipy parameterises by shape alpha; the moments follow from delta = alpha/sqrt(1+alpha^2)
    (Azzalini's method-of-moments inversion), checked against ``scipy.stats.skewnorm.stats``
    in the tests.
    """
    g = abs(skew) ** (2.0 / 3.0)
    delta = math.copysign(math.sqrt(math.pi / 2 * g / (g + ((4 - math.pi) / 2) ** (2.0 / 3.0))), skew)
    shape = delta / math.sqrt(1 - delta**2)
    scale = std / math.sqrt(1 - 2 * delta**2 / math.pi)
    loc = mean - scale * delta * math.sqrt(2 / math.pi)
    return shape, loc, scale


def weighted_empirical(values: np.ndarray, weights: np.ndarray, max_len: int | None = None) -> LengthDistribution:
    """Empirical pmf over integer ``values`` (repeats allowed) with ``weights``; merges duplicates."""
    uniq, inv = np.unique(values, return_inverse=True)
    w = np.zeros(len(uniq))
    np.add.at(w, inv, np.asarray(weights, dtype=float))
    top = int(uniq[-1]) if max_len is None else int(max_len)
    if len(uniq) == 1 and top == int(uniq[0]):
        return LengthDistribution.fixed(int(uniq[0]))
    return LengthDistribution("empirical", top, int(uniq[0]), {}, tuple(int(v) for v in uniq),
                              tuple(float(x) for x in w))
