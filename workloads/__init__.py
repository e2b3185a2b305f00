"""workloads: prompt/output length distributions, presets, request files, fits and drift tests.

Imports without torch. ``get_workload(text)`` resolves what a user types on the command line.
The public names load on first use, so ``xsched --help`` does not pay for scipy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xsched.lazy import lazy_exports

_EXPORTS = {
    "LengthDistribution": "workloads.distributions",
    "DriftMonitor": "workloads.drift",
    "DriftReport": "workloads.drift",
    "FitReport": "workloads.fit",
    "fit_lengths": "workloads.fit",
    "Workload": "workloads.workload",
    "get_workload": "workloads.workload",
    "preset_names": "workloads.workload",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from workloads.distributions import LengthDistribution
    from workloads.drift import DriftMonitor, DriftReport
    from workloads.fit import FitReport, fit_lengths
    from workloads.workload import Workload, get_workload, preset_names

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
