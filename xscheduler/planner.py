"""``plan_search`` and ``frontier``: the scheduler's entry points (used by ``xsched plan``).

The search prices points with the discrete-event simulator on one fixed request sample by
default: on these grids it is as fast as the analytic path (4-30 ms a point, while a placement
LP takes about 10 ms) and, unlike the analytic path, it stays exact when a block holds the whole
job with refill on. The chosen policy is then re-simulated by the discrete-event path on other
seeds (``Plan.confirmations``), which shows how much the p99 moves between samples.

A planning margin keeps part of the bound free for the real run being slower than predicted:
the search meets ``bound * (1 - margin)``. ``margin="auto"`` takes it from the profile's
calibration evidence (:meth:`xprofiler.profile.CalibrationError.planning_margin`: run-to-run
spread and remaining fit error of the calibration runs), 0 for a profile without it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from workloads.workload import Workload
from xprofiler.profile import HardwareProfile
from xprofiler.specs import ModelSpec
from xsched.errors import UserError
from xscheduler.placement import shortfall_bytes
from xscheduler.plan import SLA, Confirmation, Plan, SearchStats
from xscheduler.search import (LATENCY_TOLERANCE, NEAR_SEEDS, NEAR_TIE, Evaluation, Evaluator, Space, Variant,
                               fill_between, grow_prefix_caches, lowest_latency, pareto, search, settle_near_ties,
                               variants, warm_search)
from xsimulator.costmodel import workload_cache_positions
from xsimulator.discrete_event import DEFAULT_REQUESTS
from xsimulator.policy import Policy

CONFIRM_SEEDS = (1, 2)


def _shape(policy: Policy, variant: Variant | None = None) -> str:
    return f"{policy.gbs} x {policy.nb}" + (f", refill every {policy.refill_every}" if policy.refill_every else "") \
        + (f" ({variant.describe()})" if variant is not None else "")


def _one_line(policy) -> str:  # noqa: ANN001
    return policy.describe().replace("\n", "; ")


def _spaces(ev: Evaluator, compress: str, knee: bool, only: Sequence[Variant] | None = None) -> list[Space]:
    choices = variants(compress, ev.profile.compute_device) if only is None else list(only)
    out = [s for s in (ev.space(v, knee=knee) for v in choices) if s]
    if not out:
        _raise_does_not_fit(ev, compress)
    return out


def _raise_does_not_fit(ev: Evaluator, compress: str) -> None:
    frugal = variants(compress, ev.profile.compute_device)[-1]  # most compressed choice allowed
    short = shortfall_bytes(ev.spec, ev.profile, ev.workload, 1, 1, compress_weight=frugal.compress_weight,
                            compress_cache=frugal.compress_cache, cpu_attention=frugal.cpu_attention)
    what = "; ".join(f"the {tier} tier is short by {b:,.0f} bytes ({b / 2**30:,.2f} GiB; it has "
                     f"{ev.profile.capacity_bytes(tier):,} bytes)" for tier, b in short.items())
    if not frugal.compress_weight:
        hint = " (allow 4-bit compression: --compress auto or on; in xsched run, --replan-compress)"
    else:  # nothing more the planner can squeeze: the model or the machine has to change
        disk = " (the disk tier is the free space under the profile's --offload-dir)" if "disk" in short else ""
        hint = f"; plan a smaller model, or profile a machine with more room on that tier{disk}"
    raise UserError(f"{ev.spec.name} ({ev.spec.dtype}) does not fit profile {ev.profile.name} even one sequence "
                    f"at a time with {frugal.describe()}: {what or 'no placement satisfies every tier'}{hint}")


def _evaluator(spec: ModelSpec, profile: HardwareProfile, workload: Workload, num_requests: int, seed: int,
               evaluator: str, progress: bool) -> tuple[Evaluator, Callable[[], None]]:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="plan search", unit=" evals", leave=False)
    ev = Evaluator(spec, profile, workload, num_requests=num_requests, seed=seed, method=evaluator,
                   on_eval=bar.update if bar is not None else None)
    return ev, (bar.close if bar is not None else (lambda: None))


def resolve_margin(profile: HardwareProfile, margin: float | str = "auto") -> tuple[float, str]:
    """(margin fraction, where it came from) for ``plan_search``'s ``margin`` argument.

    ``"auto"``: the profile's calibration evidence, or 0 (source ``"none"``) when it has none;
    a number: that fraction, 0 <= margin < 1 (source ``"user"``).
    """
    if isinstance(margin, str):
        if margin != "auto":
            try:
                margin = float(margin)
            except ValueError:
                raise UserError(f"margin must be 'auto' or a fraction in [0, 1), got {margin!r}") from None
        else:
            err = profile.calibration_error
            if err is None:
                return 0.0, "none"
            return err.planning_margin(), "calibration"
    m = float(margin)
    if not 0.0 <= m < 1.0 or math.isnan(m):
        raise UserError(f"margin must be a fraction in [0, 1) of the latency bound (0.1 = plan for 90% of it), got "
                        f"{margin!r}")
    return m, "user"


class SLAUnreachable(UserError):
    """Policies fit in memory, but none meets the latency bound (the frontier still says what is reachable)."""


def plan_search(spec: ModelSpec, profile: HardwareProfile, workload: Workload, sla: SLA, *, compress: str = "auto",
                method: str = "bnb", num_requests: int = DEFAULT_REQUESTS, seed: int = 0,
                evaluator: str = "discrete-event", eps_t: float = 0.01, eps_l: float = LATENCY_TOLERANCE,
                confirm_seeds: tuple[int, ...] = CONFIRM_SEEDS, progress: bool = False,
                budget: int | None = None, only: Sequence[Variant] | None = None,
                margin: float | str = "auto", start: Policy | None = None) -> Plan:
    """The highest-throughput policy whose predicted latency meets ``sla`` less the planning margin.

    ``spec`` is planned in the profile's compute dtype (``profile.model_for(spec)``, applied here: a
    float32 opt-1.3b on the float16 t4 preset planned 32 x 1 at 639 tokens/s where its float16 form
    gives 64 x 1 at 1,369). ``method``:
    ``bnb`` (branch-and-bound inside memory-derived knee ranges), ``exhaustive`` (every point of
    the full memory-feasible grid) or ``optuna`` (TPE, ``budget`` evaluations; default: what
    branch-and-bound needs on the same problem). ``only`` restricts the outer choices
    (compression, CPU attention) to the given variants, e.g. the running plan's for a quick
    re-plan mid-job. ``warm`` (a re-plan's fast search) hill-climbs from the knobs of ``start``,
    the running policy, in every allowed variant (:func:`xscheduler.search.warm_search`), and falls
    back to ``bnb`` when nothing near them meets the bound. ``margin`` (see :func:`resolve_margin`):
    the search meets ``sla.latency_s * (1 - margin)``; the plan records the SLA, the margin and that
    bound. Raises ``UserError`` when nothing fits or no policy meets the bound (naming the lowest
    latency that is achievable, and the margin when one tightened the bound).
    """
    import xsched

    if num_requests < 1:
        raise UserError(f"the job needs at least 1 request, got {num_requests}")
    if not isinstance(sla, SLA):
        raise UserError(f"sla must be an SLA (e.g. SLA(\"p99\", 3600.0)), got {sla!r}")
    spec = profile.model_for(spec)
    shortest = workload.prompt.min_len + workload.output.min_len
    if shortest > spec.max_positions:
        raise UserError(f"every request of workload {workload.name} is beyond {spec.name}'s {spec.max_positions} "
                        f"positions (the shortest prompt + output is {shortest} tokens), and `xsched run` refuses "
                        "them: scale the workload (NAME@0.5) or plan a model with a longer context")
    user_sla = sla
    warm = method == "warm"  # (a re-plan mid-job: the cache's shape scan is left out)
    margin_f, margin_source = resolve_margin(profile, margin)
    sla = user_sla.tightened(margin_f)
    t0 = time.perf_counter()
    ev, close = _evaluator(spec, profile, workload, num_requests, seed, evaluator, progress)
    try:
        if method == "optuna" and budget is None:
            scout = Evaluator(spec, profile, workload, num_requests=num_requests, seed=seed, method=evaluator)
            budget = search(scout, _spaces(scout, compress, knee=True, only=only), sla.kind, sla.latency_s, "bnb",
                            eps_t=eps_t, eps_l=eps_l).evaluations
        out = None
        if method == "warm":
            if start is None:
                raise UserError("search method 'warm' needs the running policy to start from")
            choices = variants(compress, profile.compute_device) if only is None else list(only)
            out = warm_search(ev, choices, (start.gbs, start.nb, start.refill_every), sla.kind, sla.latency_s)
        if out is None or out.best is None:  # warm: nothing near the start meets the bound, search everything
            spaces = _spaces(ev, compress, knee=(method in ("bnb", "warm")), only=only)
            out = search(ev, spaces, sla.kind, sla.latency_s, "bnb" if method == "warm" else method, eps_t=eps_t,
                         eps_l=eps_l, budget=budget, seed=seed)
            method = "warm+bnb" if method == "warm" else method
        best = out.best
        if best is None:
            low = lowest_latency(ev, spaces, sla.kind)
            if low is None:
                _raise_does_not_fit(ev, compress)
            why = ""
            if margin_f > 0:
                how = ("derived from the profile's calibration runs" if margin_source == "calibration"
                       else "asked for")
                why = (f" ({user_sla.latency_s:g} s less the planning margin {margin_f:.1%} {how}; "
                       f"--margin 0 plans against the bound itself)")
            raise SLAUnreachable(f"no policy meets {sla.kind} <= {sla.latency_s:g} s{why}; the lowest achievable is "
                            f"{low.latency(sla.kind):,.4g} s (policy {_one_line(low.policy)})")
        best = searched = fill_between(ev, best, sla.kind, sla.latency_s)
        best = grown = grow_prefix_caches(ev, best, sla.kind, sla.latency_s, scan=not warm)
        means: dict[Policy, float] = {}
        if workload.prefix_tokens:
            best, means = settle_near_ties(ev, best, sla.kind, sla.latency_s, ev.cache.values())
    finally:
        close()
    predicted = best.result
    if evaluator != "discrete-event" or predicted.seed != seed:
        predicted = ev.simulate(best.policy, seed=seed, method="discrete-event")
    confirmations = []
    for s in confirm_seeds:
        r = ev.simulate(best.policy, seed=s, method="discrete-event")
        confirmations.append(Confirmation(s, r.throughput_tokens_per_s, r.latency_s(sla.kind), sla.met_by(r)))
    # what the workload itself leaves unpriced, recorded where a library caller and the plan file see it
    notes = workload.caveats(spec.name, spec.max_positions)
    if best is not grown and best.policy in means and grown.policy in means:
        apart = best.variant != grown.variant
        notes.append(f"{_shape(best.policy, best.variant if apart else None)} chosen over "
                     f"{_shape(grown.policy, grown.variant if apart else None)} "
                     f"({best.throughput:,.4g} against {grown.throughput:,.4g} tokens/s on seed {seed}, within "
                     f"{NEAR_TIE:.0%}): on the mean of {NEAR_SEEDS} draws of which prefix each prompt gets, "
                     f"{means[best.policy]:,.4g} against {means[grown.policy]:,.4g}")
    if grown is not searched and best.policy.prefix_cache_positions is not None:
        notes.append(f"prefix cache grown to {best.policy.prefix_cache_positions:,} positions for the workload's "
                     f"{workload.prefix_groups} prefixes (default {workload_cache_positions(workload):,}): "
                     + (f"{best.throughput:,.4g} tokens/s against {searched.throughput:,.4g} with the default"
                        if replace(best.policy, prefix_cache_positions=None) == searched.policy else
                        f"{best.throughput:,.4g} tokens/s at {_shape(best.policy)}, where a grown cache is fastest, "
                        f"against {searched.throughput:,.4g} at the search's {_shape(searched.policy)} with the "
                        "default"))
    if not sla.met_by(predicted):
        notes.append(f"the discrete-event simulation (seed {seed}) puts {sla.kind} latency at "
                     f"{predicted.latency_s(sla.kind):,.4g} s, over the bound the {evaluator} search used "
                     f"({sla.latency_s:g} s)")
    stats = SearchStats(method=method, evaluations=ev.evaluations, grid_points=out.grid_points,
                        lp_solves=ev.lp_solves, wall_s=time.perf_counter() - t0)
    return Plan(policy=best.policy, predicted=predicted, sla=user_sla, model=spec, workload=workload,
                profile_name=profile.name, profile_source=profile.source, profile_fingerprint=profile.fingerprint,
                search=stats, version=xsched.__version__, notes=tuple(notes), searched_with=evaluator,
                confirmations=tuple(confirmations), margin=margin_f, margin_source=margin_source,
                planning_latency_s=sla.latency_s, profile_threads=profile.compute_threads)


@dataclass(frozen=True)
class FrontierPoint:
    """A Pareto point: no policy has both lower latency and higher throughput."""

    latency_s: float
    throughput_tokens_per_s: float
    evaluation: Evaluation


def frontier(spec: ModelSpec, profile: HardwareProfile, workload: Workload, kind: str = "p99", *,
             compress: str = "auto", num_requests: int = DEFAULT_REQUESTS, seed: int = 0,
             evaluator: str = "discrete-event", bounds: int = 8, progress: bool = False) -> list[FrontierPoint]:
    """The latency-throughput Pareto frontier (FlexGen Fig. 1): branch-and-bound for ``bounds``
    latency bounds spaced geometrically from the lowest achievable latency to that of the
    unbounded plan, sharing one evaluation cache; every point priced on the way counts."""
    ev, close = _evaluator(spec, profile, workload, num_requests, seed, evaluator, progress)
    try:
        spaces = _spaces(ev, compress, knee=True)
        top = search(ev, spaces, kind, math.inf, "bnb").best
        low = lowest_latency(ev, spaces, kind)
        if top is not None and low is not None:
            lo, hi = low.latency(kind), top.latency(kind)
            for i in range(1, bounds):
                search(ev, spaces, kind, lo * (hi / lo) ** (i / bounds), "bnb")
    finally:
        close()
    return [FrontierPoint(e.latency(kind), e.throughput, e) for e in pareto(ev.cache.values(), kind)]
