"""RunResult: what a real run of a plan measured, named like the simulator's ``SimResult``.

The same metric names as :class:`xsimulator.result.SimResult` where they mean the same thing
(throughput, padded/total throughput, latency percentiles, peak bytes per tier, busy seconds,
wall time, step counts), and the plan's prediction beside them, so that ``xsched run`` can print
measured next to predicted and a calibration can fit one against the other. Percentiles use
the simulator's own :func:`xsimulator.discrete_event.quantile` (inverted CDF), so a gap between
the two columns is the model's, not a different definition's.

No torch here: reading a result file must not need the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from xprofiler.profile import TIERS
from xsched.contract import Contract
from xsimulator.discrete_event import quantile
from xsimulator.policy import Policy
from xsimulator.result import SimResult

# The simulator's busy terms grouped onto the runner's measured resources (the trace tracks):
# dequantisation, quantisation and the LM head run on the compute path.
SIM_TERMS_OF_TRACK: dict[str, tuple[str, ...]] = {
    "compute": ("gpu_compute", "dequant", "quant", "head"),
    "cpu_compute": ("cpu_compute",),
    "ctog": ("ctog",), "gtoc": ("gtoc",), "dtoc": ("dtoc",), "ctod": ("ctod",),
}


@dataclass(frozen=True)
class Adaptation:
    """A policy change applied mid-run (drift re-plan or budget change; also a trace marker)."""

    at_s: float  # job clock when it started
    stall_s: float  # wall seconds the job stopped for it
    reason: str  # "drift: ..." or "budget: ..." with the predictions before/after
    old_policy: Policy
    new_policy: Policy


@dataclass(frozen=True)
class RunResult(Contract):
    """Measured metrics of one ``xsched run`` (the requests it ran, not those resumed past)."""

    SCHEMA: ClassVar[str] = "xsched.RunResult/1"

    model: str
    policy: Policy  # the plan's, in force at the start (after changes: adaptations[-1].new_policy)
    device: str
    dtype: str
    num_requests: int  # requests run by this invocation
    num_skipped: int  # requests already in the results file (--resume)
    wall_s: float
    generated_tokens: int
    prompt_tokens: int
    padded_prompt_tokens: int
    throughput_tokens_per_s: float  # generated tokens / wall time (the headline number)
    padded_throughput_tokens_per_s: float  # (prefill positions computed + generated tokens) / wall time
    total_throughput_tokens_per_s: float  # (prompt + generated tokens) / wall time
    latency_mean_s: float
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    latency_max_s: float
    num_stopped_on_eos: int
    peak_bytes: dict[str, float]  # measured, per tier
    planned_peak_bytes: dict[str, float]  # CostModel.memory for this policy and the job's max lengths
    capacity_bytes: dict[str, float]  # what the run was allowed per tier
    busy_s: dict[str, float]  # measured seconds per resource (trace tracks)
    num_prefill_steps: int
    num_decode_steps: int
    max_prompt: int
    max_output: int
    predicted: SimResult | None = None  # the plan's prediction, if the run came from a plan
    # The simulator on this job's own requests (the prompt and output lengths as run, in the order
    # run), when the plan's profile was at hand and the policy did not change mid-run: the like-for-
    # like prediction, where the plan's is for its workload's sample of requests.
    simulated: SimResult | None = None
    adaptations: tuple[Adaptation, ...] = ()  # policy changes between blocks (xsched run --adapt/--budget-file)
    # CUDA runs: the caching allocator's peak reserved bytes (torch.cuda.max_memory_reserved), which
    # peak_bytes["gpu"] (the engine's own allocations) does not see; None on other devices.
    device_reserved_peak_bytes: float | None = None

    @property
    def fits(self) -> bool:
        """Measured peak within the planned peak on every tier (the memory contract)."""
        return all(self.peak_bytes.get(t, 0.0) <= self.planned_peak_bytes.get(t, 0.0) for t in TIERS)

    def predicted_busy_s(self, which: str = "predicted") -> dict[str, float] | None:
        """A prediction's (``predicted`` or ``simulated``) busy seconds summed onto the measured resources."""
        p = getattr(self, which)
        if p is None:
            return None
        return {track: sum(p.busy_s.get(t, 0.0) for t in terms) for track, terms in SIM_TERMS_OF_TRACK.items()}

    def comparison_rows(self) -> list[tuple[str, ...]]:
        """(metric, measured, simulated, plan) rows for the end-of-run table; no simulated column
        without ``simulated``."""
        preds = [p for p in (self.simulated, self.predicted) if p is not None] or [None]
        busy = [self.predicted_busy_s(w) for w, p in (("simulated", self.simulated), ("predicted", self.predicted))
                if p is not None] or [None]
        gib = 2.0**30

        def num(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        def row(name: str, measured: str, of: Any, fmt: str) -> tuple[str, ...]:
            return (name, measured, *(num(p and of(p), fmt) for p in preds))

        rows = [
            row("requests", str(self.num_requests), lambda p: p.num_requests, "d"),
            row("wall s", num(self.wall_s, ",.2f"), lambda p: p.wall_s, ",.2f"),
            row("throughput tok/s", num(self.throughput_tokens_per_s, ",.2f"), lambda p: p.throughput_tokens_per_s,
                ",.2f"),
            row("total tok/s", num(self.total_throughput_tokens_per_s, ",.2f"),
                lambda p: p.total_throughput_tokens_per_s, ",.2f"),
            row("padded tok/s", num(self.padded_throughput_tokens_per_s, ",.2f"),
                lambda p: p.padded_throughput_tokens_per_s, ",.2f"),
        ]
        for name in ("mean", "p50", "p90", "p99", "max"):
            key = f"latency_{name}_s"
            rows.append(row(f"latency {name} s", num(getattr(self, key), ",.3f"), lambda p: getattr(p, key), ",.3f"))
        for tier in TIERS:
            rows.append(row(f"peak {tier} GiB", num(self.peak_bytes.get(tier, 0.0) / gib, ",.3f"),
                            lambda p: p.peak_bytes.get(tier, 0.0) / gib, ",.3f"))
        if self.device_reserved_peak_bytes is not None:
            rows.append(("gpu reserved GiB", num(self.device_reserved_peak_bytes / gib, ",.3f"), *("-" for _ in preds)))
        for track, secs in self.busy_s.items():
            if secs > 0 or any(b and b.get(track, 0.0) > 0 for b in busy):
                rows.append((f"busy {track} s", num(secs, ",.2f"), *(num(b and b.get(track), ",.2f") for b in busy)))
        return rows

    def describe(self) -> str:
        gib = 2.0**30
        rows = self.comparison_rows()
        names = ["measured", *(["simulated"] if self.simulated is not None else []),
                 *(["plan"] if self.predicted is not None or self.simulated is None else [])]
        widths = [max(len(r[0]) for r in rows)] + [max(max(len(r[i]) for r in rows), len(names[i - 1]))
                                                    for i in range(1, len(names) + 1)]
        changed = len(self.adaptations)
        # After a change mid-run the plan's policy is only where the job started: name both.
        policies = [("policy", self.policy)] if not changed else [
            ("policy at start (the plan's)", self.policy),
            (f"policy at end (after {changed} change(s), listed below)", self.adaptations[-1].new_policy)]
        head = [
            f"ran {self.num_requests} request{'s' * (self.num_requests != 1)} on {self.model} ({self.device}, "
            f"{self.dtype})"
            + (f"; {self.num_skipped} already done (resumed)" if self.num_skipped else ""),
            *(f"  {label}: " + p.describe().replace("\n", "; ") for label, p in policies),
            "  planned peak" + (" (the highest of the policies run)" if changed else "") + ": "
            + ", ".join(f"{t} {self.planned_peak_bytes.get(t, 0.0) / gib:,.3f} GiB" for t in TIERS)
            + ("" if self.fits else "  -- MEASURED PEAK ABOVE PLAN"),
            "",
            "  " + "  ".join(f"{c:>{w}}" if i else " " * w for i, (c, w) in enumerate(zip(["", *names], widths))),
        ]
        head += ["  " + "  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        # (at_s: when the move began, after the re-plan; the stderr line's time is when the block ended)
        head += [f"  reconfigured at {a.at_s:,.1f} s (stalled {a.stall_s:.2f} s): {a.reason}" for a in self.adaptations]
        if self.simulated is not None:
            n = self.simulated.num_requests
            head.append(f"  (simulated: {self.simulated.method} simulation of "
                        + (f"these {n} requests at their prompt and output lengths" if n != 1 else
                           "this request at its prompt and output lengths")
                        + f", on profile {self.simulated.profile})")
        if self.predicted is not None:
            head.append(f"  (plan: {self.predicted.method} simulation of {self.predicted.num_requests:,} requests "
                        f"of workload {self.predicted.workload} on profile {self.predicted.profile}"
                        + (", for the policy at start" if changed else "") + ")")
        if changed and self.simulated is None:
            head.append("  (no simulated column: the policy changed mid-run, and a simulation prices one policy)")
        return "\n".join(head)


def latency_stats(latencies_s: Sequence[float]) -> dict[str, float]:
    """Mean, p50/p90/p99 (inverted CDF, as the simulator) and max; zeros for an empty run."""
    lat = np.asarray(latencies_s, dtype=float)
    if lat.size == 0:
        return {"latency_mean_s": 0.0, "latency_p50_s": 0.0, "latency_p90_s": 0.0, "latency_p99_s": 0.0,
                "latency_max_s": 0.0}
    return {"latency_mean_s": float(lat.mean()), "latency_p50_s": quantile(lat, 0.5),
            "latency_p90_s": quantile(lat, 0.9), "latency_p99_s": quantile(lat, 0.99),
            "latency_max_s": float(lat.max())}


def build_run_result(*, model: str, policy: Policy, device: str, dtype: str, stats: Any,
                     latencies_s: Sequence[float], num_stopped_on_eos: int, num_skipped: int,
                     capacity_bytes: Mapping[str, float], max_prompt: int, max_output: int,
                     predicted: SimResult | None, simulated: SimResult | None = None) -> RunResult:
    """A RunResult from the engine's ``EngineStats`` and the finished requests' latencies."""
    wall = float(stats.wall_s)
    per_s = (lambda n: n / wall) if wall > 0 else (lambda n: 0.0)
    return RunResult(
        model=model, policy=policy, device=device, dtype=dtype, num_requests=len(latencies_s),
        num_skipped=num_skipped, wall_s=wall, generated_tokens=int(stats.generated_tokens),
        prompt_tokens=int(stats.prompt_tokens), padded_prompt_tokens=int(stats.padded_prompt_tokens),
        throughput_tokens_per_s=per_s(stats.generated_tokens),
        padded_throughput_tokens_per_s=per_s(stats.padded_prompt_tokens + stats.generated_tokens),
        total_throughput_tokens_per_s=per_s(stats.prompt_tokens + stats.generated_tokens),
        **latency_stats(latencies_s), num_stopped_on_eos=num_stopped_on_eos,
        peak_bytes={t: float(stats.peak_bytes.get(t, 0)) for t in TIERS},
        planned_peak_bytes={t: float(stats.planned_peak_bytes.get(t, 0.0)) for t in TIERS},
        capacity_bytes={t: float(capacity_bytes.get(t, 0.0)) for t in TIERS},
        busy_s={k: float(v) for k, v in stats.busy_s.items()},
        num_prefill_steps=int(stats.num_prefill_steps), num_decode_steps=int(stats.num_decode_steps),
        max_prompt=max_prompt, max_output=max_output, predicted=predicted, simulated=simulated,
        device_reserved_peak_bytes=None if stats.device_reserved_peak_bytes is None
        else float(stats.device_reserved_peak_bytes))
