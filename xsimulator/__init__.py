"""xsimulator: predict throughput, latency percentiles, peak memory and the timeline of a policy.

Imports without torch. The cost model (``CostModel``) is shared with the scheduler's placement LP;
``simulate`` is the discrete-event path, ``simulate_analytic`` the fast expected-value path (ExeGPT §6).
The public names load on first use, so ``xsched --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xsched.lazy import lazy_exports

_EXPORTS = {
    "simulate_analytic": "xsimulator.analytic",
    "CostModel": "xsimulator.costmodel",
    "MemoryTerms": "xsimulator.costmodel",
    "StepTerms": "xsimulator.costmodel",
    "channel_groups": "xsimulator.costmodel",
    "compression_ratio": "xsimulator.costmodel",
    "PLACEMENT_VARS": "xsimulator.policy",
    "Policy": "xsimulator.policy",
    "SimResult": "xsimulator.result",
    "simulate": "xsimulator.discrete_event",
    "simulate_timeline": "xsimulator.discrete_event",
    "trace_events": "xsimulator.discrete_event",
    "TraceEvent": "xsimulator.trace",
    "TraceMarker": "xsimulator.trace",
    "read_chrome_trace": "xsimulator.trace",
    "write_chrome_trace": "xsimulator.trace",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from xsimulator.analytic import simulate_analytic
    from xsimulator.costmodel import CostModel, MemoryTerms, StepTerms, channel_groups, compression_ratio
    from xsimulator.policy import PLACEMENT_VARS, Policy
    from xsimulator.result import SimResult
    from xsimulator.discrete_event import simulate, simulate_timeline, trace_events
    from xsimulator.trace import TraceEvent, TraceMarker, read_chrome_trace, write_chrome_trace

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
