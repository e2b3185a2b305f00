"""workloads: prompt/output length distributions, presets, request files, fits and drift tests.

Imports without torch. ``get_workload(text)`` resolves what a user types on the command line.
"""

from workloads.distributions import LengthDistribution
from workloads.drift import DriftMonitor, DriftReport
from workloads.fit import FitReport, fit_lengths
from workloads.workload import Workload, get_workload, preset_names

__all__ = ["DriftMonitor", "DriftReport", "FitReport", "LengthDistribution", "Workload", "fit_lengths",
           "get_workload", "preset_names"]
