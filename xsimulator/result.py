"""SimResult: what the simulator predicts for one policy on one workload.

The same numbers the runner measures (``RunResult``), so the two can be compared line by line:
throughput (generated, padded and total tokens/s), request latency percentiles, the latency of a
request whose output is the workload's 99th-percentile length (ExeGPT's SLA-(b)), peak bytes per
tier and where the time went.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import ClassVar, Literal

from xprofiler.profile import TIERS
from xsched.contract import Contract
from xsimulator.policy import Policy


@dataclass(frozen=True)
class SimResult(Contract):
    """Predicted metrics of a job (see docs/ARCHITECTURE.md "Shared execution semantics")."""

    SCHEMA: ClassVar[str] = "xsched.SimResult/1"

    method: Literal["discrete-event", "analytic"]
    model: str
    profile: str
    workload: str
    policy: Policy
    num_requests: int
    seed: int | None
    wall_s: float
    generated_tokens: float
    prompt_tokens: float
    padded_prompt_tokens: float
    throughput_tokens_per_s: float  # generated tokens / wall time (the headline number)
    padded_throughput_tokens_per_s: float  # (prefill positions computed + generated tokens) / wall time
    total_throughput_tokens_per_s: float  # (prompt + generated tokens) / wall time
    latency_mean_s: float
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    latency_max_s: float
    p99_output_len: int
    latency_p99_length_s: float  # expected latency of a request of p99_output_len tokens (SLA p99-length)
    peak_bytes: dict[str, float]
    capacity_bytes: dict[str, float]
    fits: bool  # every tier's peak within its capacity
    busy_s: dict[str, float]  # seconds each term kept its resource busy, summed over the job
    stall_s: float  # wall time during which the compute path did not compute (waiting on I/O)
    prefill_s: float
    decode_s: float
    num_prefill_steps: int
    num_decode_steps: int

    def __post_init__(self) -> None:
        # A plan file carries its prediction: a hand-edited or corrupted one (a NaN throughput, a
        # negative latency) would otherwise be printed and compared against as if predicted.
        def ok(x: object) -> bool:
            return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0

        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("float", "int") and not ok(v):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {v!r}")
            for k, x in (v.items() if f.type == "dict[str, float]" else ()):
                if not ok(x):
                    raise ValueError(f"{f.name}[{k!r}] must be a finite number >= 0, got {x!r}")
        for name in ("peak_bytes", "capacity_bytes"):
            if set(getattr(self, name)) != set(TIERS):
                raise ValueError(f"{name} must give bytes for the tiers {', '.join(TIERS)}, got "
                                 f"{', '.join(map(str, getattr(self, name))) or 'none'}")
        order = (self.latency_p50_s, self.latency_p90_s, self.latency_p99_s, self.latency_max_s)
        if any(a > b * (1 + 1e-9) for a, b in zip(order, order[1:])) or self.latency_mean_s > order[-1] * (1 + 1e-9):
            raise ValueError("latencies must satisfy p50 <= p90 <= p99 <= max and mean <= max, got "
                             + ", ".join(f"{x:.6g}" for x in (self.latency_mean_s, *order)))

    def latency_s(self, sla: str) -> float:
        """The latency an SLA kind constrains: ``p99`` or ``p99-length``."""
        if sla == "p99":
            return self.latency_p99_s
        if sla == "p99-length":
            return self.latency_p99_length_s
        raise ValueError(f"unknown SLA kind {sla!r}")

    def describe(self) -> str:
        gib = 2.0**30
        lines = [
            f"{self.method} simulation of {self.num_requests:,} request{'s' * (self.num_requests != 1)} ({self.workload}) on {self.model}, "
            f"profile {self.profile}",
            "  policy: " + self.policy.describe().replace("\n", "; "),
            f"  throughput {self.throughput_tokens_per_s:,.2f} generated tokens/s "
            f"(total {self.total_throughput_tokens_per_s:,.2f}, padded {self.padded_throughput_tokens_per_s:,.2f}); "
            f"wall {self.wall_s:,.1f} s",
            f"  latency p50 {self.latency_p50_s:,.2f} s, p90 {self.latency_p90_s:,.2f} s, "
            f"p99 {self.latency_p99_s:,.2f} s, max {self.latency_max_s:,.2f} s; "
            f"a {self.p99_output_len}-token (p99-length) request {self.latency_p99_length_s:,.2f} s",
            "  peak memory: " + ", ".join(
                f"{t} {self.peak_bytes[t] / gib:,.2f} of {self.capacity_bytes[t] / gib:,.2f} GiB"
                for t in ("gpu", "cpu", "disk")) + ("" if self.fits else "  -- DOES NOT FIT"),
            "  busy: " + ", ".join(f"{k} {v:,.1f} s" for k, v in self.busy_s.items() if v > 0)
            + f"; compute stalled {self.stall_s:,.1f} s",
            f"  {self.num_prefill_steps} prefill steps ({self.prefill_s:,.1f} s), "
            f"{self.num_decode_steps} decode steps ({self.decode_s:,.1f} s)",
        ]
        return "\n".join(lines)
