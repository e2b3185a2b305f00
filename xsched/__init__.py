"""xsched: plan and run offline LLM batch generation under a latency SLA.

This package holds the command line and the few helpers every stage shares (errors, JSON
contracts, atomic file writes). The work happens in the stage packages: ``workloads``,
``xprofiler``, ``xsimulator``, ``xscheduler`` and ``xrunner``.
"""

__version__ = "0.1.0"
