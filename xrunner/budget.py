"""Memory budgets that change mid-job, and the between-blocks hook that re-plans under them.

A :class:`BudgetSource` is polled at every block boundary (``Engine.run(between_blocks=...)``):
``poll()`` returns the gpu/cpu tier budgets in bytes (``{"gpu": ..., "cpu": ...}``, either key
may be missing) when they changed since the last poll, else None. :func:`budget_hook` turns a
source and a planner into the hook: on a change it re-plans under the new capacities and hands
the engine ``(policy, reason, capacity_bytes)``; the engine drains the rows in flight,
reconfigures (moving only what changed) and enforces the new budget from then on.

When no policy fits the new budget the job must not crash half-way without saying why:
if the policy in force still fits, the hook warns (``BudgetWarning``) and keeps it under the new
budget; otherwise it raises ``UserError`` naming the tier that is short and by how much (the CLI
stops cleanly, every result written so far is kept).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from xsched.errors import UserError

if TYPE_CHECKING:  # torch-free at import: the engine types are only needed for annotations
    from xprofiler.profile import HardwareProfile
    from xrunner.engine import BlockInfo
    from xscheduler.plan import Plan
    from xsimulator.policy import Policy

BUDGET_TIERS: tuple[str, ...] = ("gpu", "cpu")  # the tiers a budget may change (disk stays as planned)
FILE_KEYS: dict[str, str] = {"gpu_bytes": "gpu", "cpu_bytes": "cpu"}


class BudgetWarning(UserWarning):
    """A budget file that cannot be used (the budget stays as it was) or a budget no policy fits."""


class BudgetSource(Protocol):
    def poll(self) -> dict[str, float] | None:
        """The gpu/cpu tier budgets in bytes if they changed since the last poll, else None."""


class _Changes:
    """Remembers the last budget seen, so a source reports only changes."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def changed(self, budget: Mapping[str, float]) -> dict[str, float] | None:
        merged = {**self.last, **budget}
        if merged == self.last:
            return None
        self.last = merged
        return dict(merged)


def _valid(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a positive number of bytes, got {value!r}")
    try:
        number = float(value)  # an int past float's range raised OverflowError, ending the job (review)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number <= 0:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}... ({len(repr(value))} digits)"
        raise ValueError(f"{key} must be a positive, finite number of bytes, got {shown}")
    return number


class FileBudget:
    """Budgets from a JSON file ``{"gpu_bytes": ..., "cpu_bytes": ...}``, re-read at every poll.

    A missing key keeps that tier's budget. A missing, unreadable or malformed file (also one
    caught half-written) gives one ``BudgetWarning`` per distinct problem and leaves the budget
    unchanged: a typo in a file someone edits mid-job must never stop the job. Before a job
    starts, ``poll(refuse=True)`` makes such a file (one that is there but cannot be used) a
    ``UserError`` instead: nothing is lost yet, and the job would run without the budget it was given.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._changes = _Changes()
        self._warned: set[str] = set()
        self._refuse = False

    def _warn(self, problem: str, usable: bool = False) -> None:
        if self._refuse and not usable:
            raise UserError(f"budget file {self.path}: {problem}; fix it or pass another --budget-file")
        if problem not in self._warned:
            self._warned.add(problem)
            warnings.warn(f"budget file {self.path}: {problem}; keeping the budget as it was", BudgetWarning,
                          stacklevel=3)

    def check(self) -> None:
        """Warn now about a file the run could not use (missing, not JSON, unknown keys, bad values):
        the run reads it between blocks only, and a job of one block never does. What it reads
        still counts as news at the first poll (the words are poll's, each warned once)."""
        seen = self._changes
        self._changes = _Changes()
        try:
            self.poll()
        finally:
            self._changes = seen

    def poll(self, refuse: bool = False) -> dict[str, float] | None:
        """The budget if it changed since the last poll; ``refuse``: a file that is there but cannot
        be used raises ``UserError`` (a missing one may still be written mid-job: it warns)."""
        self._refuse = refuse
        try:
            return self._read()
        finally:
            self._refuse = False

    def _read(self) -> dict[str, float] | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            self._warn("not found", usable=True)
            return None
        except (OSError, ValueError) as exc:  # a directory, no permission; not UTF-8
            self._warn(f"cannot be read as JSON ({str(exc).splitlines()[0]})")
            return None
        if not text.strip():  # created first, written next (or caught in between): not yet a budget
            self._warn("empty", usable=True)
            return None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # ValueError: bad JSON or an int past 4300 digits
            self._warn(f"cannot be read as JSON ({str(exc).splitlines()[0]})")
            return None
        if not isinstance(data, dict):
            self._warn(f"expected a JSON object with gpu_bytes and/or cpu_bytes, got {type(data).__name__}")
            return None
        unknown = sorted(set(data) - set(FILE_KEYS))
        if unknown:
            self._warn(f"unknown key(s) {', '.join(unknown)} (only gpu_bytes and cpu_bytes) ignored", usable=True)
        try:
            budget = {FILE_KEYS[k]: _valid(k, v) for k, v in data.items() if k in FILE_KEYS}
        except ValueError as exc:
            self._warn(str(exc))
            return None
        self._warned = {w for w in self._warned if w.startswith("unknown key")}  # a later problem warns again
        return self._changes.changed(budget)


class CallbackBudget:
    """Budgets from a Python callable ``fn() -> {"gpu": bytes, "cpu": bytes} | None`` (None: no news)."""

    def __init__(self, fn: Callable[[], Mapping[str, float] | None]):
        self.fn = fn
        self._changes = _Changes()

    def poll(self) -> dict[str, float] | None:
        budget = self.fn()
        if budget is None:
            return None
        unknown = sorted(set(budget) - set(BUDGET_TIERS))
        if unknown:
            raise ValueError(f"budget callback returned unknown tier(s) {unknown}; use {BUDGET_TIERS}")
        return self._changes.changed({k: _valid(k, v) for k, v in budget.items()})


def _bytes(x: float) -> str:
    return f"{x / 2**20:,.1f} MiB"


class BudgetHook:
    """The between-blocks hook of :func:`budget_hook`; ``capacity_bytes`` is the budget in force."""

    def __init__(self, source: BudgetSource, plan_fn: Callable[[dict[str, float]], "Policy"],
                 capacity_bytes: Mapping[str, float] | None = None, machine_bytes: Mapping[str, float] | None = None):
        self.source, self.plan_fn = source, plan_fn
        self.capacity_bytes: dict[str, float] | None = dict(capacity_bytes) if capacity_bytes is not None else None
        self.machine_bytes = dict(machine_bytes or {})  # the ceiling: what the machine had at the start
        self.events: list[str] = []  # one line per budget change it acted on

    def __call__(self, info: "BlockInfo") -> "tuple[Policy, str, dict[str, float]] | None":
        polled = self.source.poll()
        if polled is None:
            return None
        over = {t: b for t, b in polled.items() if b > self.machine_bytes.get(t, math.inf)}
        if over:  # a budget of 1e300 bytes was taken as is (review): plans for it would not fit the machine
            warnings.warn("budget above what this machine had at the start (" + ", ".join(
                f"{t} {_bytes(b)} > {_bytes(self.machine_bytes[t])}" for t, b in over.items())
                + "); using the machine's", BudgetWarning, stacklevel=2)
            polled = {**polled, **{t: self.machine_bytes[t] for t in over}}
        current = self.capacity_bytes if self.capacity_bytes is not None else (info.capacity_bytes or {})
        caps = {**current, **polled}
        if caps == current:
            return None
        change = ", ".join(f"{t} {_bytes(current[t]) if t in current else 'unset'} -> {_bytes(caps[t])}"
                           for t in BUDGET_TIERS if caps.get(t) != current.get(t))
        self.capacity_bytes = caps
        try:
            policy = self.plan_fn(dict(caps))
        except UserError as exc:
            over = {t: info.planned_peak_bytes[t] - caps[t] for t in caps
                    if t in info.planned_peak_bytes and info.planned_peak_bytes[t] > caps[t]}
            if over:
                tier, short = max(over.items(), key=lambda kv: kv[1])
                raise UserError(f"the memory budget changed ({change}) and no policy fits it ({exc}); the policy in "
                                f"force needs {short:,.0f} bytes more on the {tier} tier than the new budget: raise "
                                "the budget and resume the job") from None
            warnings.warn(f"budget changed ({change}) but re-planning failed ({exc}); the policy in force still "
                          "fits, keeping it", BudgetWarning, stacklevel=2)
            self.events.append(f"budget: {change}; no new plan, kept the policy in force")
            return info.policy, f"budget: {change} (policy kept)", caps
        reason = f"budget: {change}"
        self.events.append(reason)
        return policy, reason, caps


def budget_hook(source: BudgetSource, plan_fn: Callable[[dict[str, float]], "Policy"],
                capacity_bytes: Mapping[str, float] | None = None,
                machine_bytes: Mapping[str, float] | None = None) -> BudgetHook:
    """A ``between_blocks`` hook: poll ``source``; on a change, ``plan_fn(new capacities)`` gives the policy.

    ``capacity_bytes`` is the budget the job started with (default: what the engine enforces);
    ``machine_bytes`` caps a new budget per tier (a warning says so).
    """
    return BudgetHook(source, plan_fn, capacity_bytes, machine_bytes)


def plan_fn_for(plan: "Plan", profile: "HardwareProfile", **search: Any) -> Callable[[dict[str, float]], "Policy"]:
    """``plan_fn`` for :func:`budget_hook`: ``plan_search`` for the plan's model, workload and SLA on
    ``profile`` with its gpu/cpu capacities replaced by the new budget (``search``: plan_search options;
    the plan's margin unless ``margin`` is given)."""
    search.setdefault("margin", plan.margin)

    def plan_fn(capacity_bytes: dict[str, float]) -> "Policy":
        from xscheduler.planner import plan_search

        return plan_search(plan.model, with_budget(profile, capacity_bytes), plan.workload, plan.sla,
                           **search).policy

    return plan_fn


def with_budget(profile: "HardwareProfile", capacity_bytes: Mapping[str, float]) -> "HardwareProfile":
    """``profile`` with its gpu/cpu capacities replaced by those in ``capacity_bytes`` (others kept)."""
    return replace(profile, **{f"{t}_bytes": int(capacity_bytes[t]) for t in BUDGET_TIERS if t in capacity_bytes})
