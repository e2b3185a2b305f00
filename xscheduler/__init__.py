"""xscheduler: the best policy under a latency SLA (placement LP inside branch-and-bound) and the Plan.

Imports without torch. ``plan_search`` is what ``xsched plan`` runs; ``place`` is the placement
LP for fixed batch knobs; ``frontier`` sweeps latency bounds. The public names load on first
use, so ``xsched --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xsched.lazy import lazy_exports

_EXPORTS = {
    "Confirmation": "xscheduler.plan",
    "Plan": "xscheduler.plan",
    "SLA": "xscheduler.plan",
    "SearchStats": "xscheduler.plan",
    "Placement": "xscheduler.placement",
    "place": "xscheduler.placement",
    "round_placement": "xscheduler.placement",
    "shortfall_bytes": "xscheduler.placement",
    "Evaluator": "xscheduler.search",
    "branch_and_bound": "xscheduler.search",
    "variants": "xscheduler.search",
    "FrontierPoint": "xscheduler.planner",
    "frontier": "xscheduler.planner",
    "plan_search": "xscheduler.planner",
    "Replan": "xscheduler.replan",  # (its function, replan, shares the submodule's name: import it from there)
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from xscheduler.placement import Placement, place, round_placement, shortfall_bytes
    from xscheduler.plan import SLA, Confirmation, Plan, SearchStats
    from xscheduler.planner import FrontierPoint, frontier, plan_search
    from xscheduler.replan import Replan
    from xscheduler.search import Evaluator, branch_and_bound, variants

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
