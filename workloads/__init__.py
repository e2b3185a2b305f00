"""workloads: prompt/output length distributions, presets, request files, fits and drift tests.

Imports without torch. ``get_workload(text)`` resolves what a user types on the command line.
The public names load on first use, so ``xsched --help`` does not pay for scipy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'workloads' has no attribute {name!r}")


def __dir__() -> list[str]:  # the lazy names too, for completion and help()
    return sorted(set(globals()) | set(__all__))
