"""Plan: the scheduler's answer, and everything the runner and a reader need to trust it.

A plan carries its own context (model spec, workload, the profile's name and fingerprint) so
that ``xsched run`` and ``xsched simulate --plan`` need nothing else, and so that a plan used on
another machine can say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from workloads.workload import Workload
from xprofiler.profile import Fingerprint
from xprofiler.specs import ModelSpec
from xsched.contract import Contract
from xsched.errors import UserError
from xsimulator.policy import Policy
from xsimulator.result import SimResult

SLAKind = Literal["p99", "p99-length"]
SLA_KINDS: tuple[str, ...] = get_args(SLAKind)


@dataclass(frozen=True)
class SLA(Contract):
    """A latency bound (ExeGPT §7.6): ``p99`` of requests, or a ``p99-length`` request, within L s.

    ``latency_s = inf`` means unbounded (pure throughput).
    """

    SCHEMA: ClassVar[str] = "xsched.SLA/1"

    kind: SLAKind
    latency_s: float

    def __post_init__(self) -> None:
        if self.kind not in SLA_KINDS:  # (SLA("p95", 10) was taken, and failed mid-search)
            raise ValueError(f"SLA kind must be p99 or p99-length, got {self.kind!r}")
        if not self.latency_s > 0 or math.isnan(self.latency_s):
            raise ValueError(f"latency bound must be > 0 seconds, got {self.latency_s:g}")

    def met_by(self, result: SimResult, tolerance: float = 0.0) -> bool:
        """Whether the predicted latency is within the bound, allowing ``tolerance`` (fraction)."""
        return result.latency_s(self.kind) <= self.latency_s * (1.0 + tolerance)

    def tightened(self, margin: float) -> "SLA":
        """The bound a plan is searched against: ``latency_s * (1 - margin)`` (``margin`` in 0..1)."""
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be a fraction in [0, 1), got {margin}")
        if not self.latency_s * (1.0 - margin) > 0:  # a 5e-324 s bound less a margin rounds to 0
            raise UserError(f"a latency bound of {self.latency_s:g} s less the margin {margin:g} leaves no time; "
                            "give a larger --latency")
        return SLA(self.kind, self.latency_s * (1.0 - margin))

    def describe(self) -> str:
        if math.isinf(self.latency_s):
            return f"{self.kind}: unbounded"
        what = "99% of requests finish" if self.kind == "p99" else "a p99-length request finishes"
        return f"{self.kind}: {what} within {self.latency_s:g} s"


@dataclass(frozen=True)
class SearchStats(Contract):
    """How the plan was found: method, simulator evaluations, size of the full grid, wall time."""

    SCHEMA: ClassVar[str] = "xsched.SearchStats/1"

    method: Literal["bnb", "exhaustive", "optuna", "warm", "warm+bnb"]  # warm: a re-plan's climb from its policy
    evaluations: int  # simulator calls (placement LPs included in their cost)
    grid_points: int  # points of the knob grid searched (exhaustive/optuna: memory-feasible grid; bnb: knee ranges)
    lp_solves: int
    wall_s: float


@dataclass(frozen=True)
class Confirmation(Contract):
    """The plan re-simulated by the discrete-event path on another request sample."""

    SCHEMA: ClassVar[str] = "xsched.Confirmation/1"

    seed: int
    throughput_tokens_per_s: float
    latency_s: float  # of the plan's SLA kind
    meets_sla: bool


@dataclass(frozen=True)
class Plan(Contract):
    """The chosen policy with its predicted result, the SLA it meets and where it came from."""

    SCHEMA: ClassVar[str] = "xsched.Plan/1"

    policy: Policy  # rounded to what the runner can place; this is what was simulated
    predicted: SimResult
    sla: SLA
    model: ModelSpec  # in the dtype the plan was priced in
    workload: Workload
    profile_name: str
    profile_source: Literal["measured", "preset"]
    profile_fingerprint: Fingerprint
    search: SearchStats
    version: str  # xsched version that wrote the plan
    notes: tuple[str, ...] = ()
    searched_with: str = "discrete-event"  # simulator path the search priced points with
    confirmations: tuple[Confirmation, ...] = ()  # discrete-event re-simulations on other seeds
    # The planning margin: the search met ``sla.latency_s * (1 - margin)`` (``planning_latency_s``),
    # leaving room for a real run to be slower than predicted. ``margin_source``: "calibration"
    # (derived from the profile's CalibrationError), "user" (--margin F) or "none". Plans written
    # before margins existed load with margin 0 and the SLA's own bound.
    margin: float = 0.0
    margin_source: Literal["none", "calibration", "user"] = "none"
    planning_latency_s: float | None = None
    # torch threads the profile's rates were measured with (0: unknown, plans written before it):
    # a run computes with them even without the profile file at hand.
    profile_threads: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.profile_threads, int) or self.profile_threads < 0:
            raise ValueError(f"profile_threads must be a whole number >= 0 (0: unknown), got {self.profile_threads!r}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be a fraction in [0, 1), got {self.margin}")
        want = self.sla.tightened(self.margin).latency_s
        if self.planning_latency_s is None:
            object.__setattr__(self, "planning_latency_s", want)
        elif not math.isclose(self.planning_latency_s, want, rel_tol=1e-9):
            raise ValueError(f"planning_latency_s {self.planning_latency_s:g} is not the bound {self.sla.latency_s:g} "
                             f"less the margin {self.margin:g} ({want:g})")

    @property
    def planning_sla(self) -> SLA:
        """The SLA the search met: the user's bound less the margin."""
        return self.sla.tightened(self.margin)

    @property
    def slack(self) -> float:
        """Fraction of the user's latency bound left unused (0 = exactly at the bound; 1 = unbounded)."""
        if math.isinf(self.sla.latency_s):
            return 1.0
        return 1.0 - self.predicted.latency_s(self.sla.kind) / self.sla.latency_s
