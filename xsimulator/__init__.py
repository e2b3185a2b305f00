"""xsimulator: predict throughput, latency percentiles and the timeline of a policy.

Imports without torch.
"""

from xsimulator.policy import PLACEMENT_VARS, Policy

__all__ = ["PLACEMENT_VARS", "Policy"]
