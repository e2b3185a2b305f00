"""Re-plan when the observed prompt/output lengths drift from the workload a plan was priced on.

``replan`` is the offline answer (``xsched replan``): one look of the workloads drift tests at the
observed lengths; when one fires, the lengths after the estimated change point become the
observed workload (empirical pmfs), the old policy is priced on it, and ``plan_search`` looks for the best
policy for the *same* model, profile and SLA. ``DriftWatcher`` does the same online during
``xsched run``: it feeds every settled request to the CUSUMs of :class:`workloads.drift.CusumMonitor`
(a shift of the mean length, the drift that breaks an SLA or wastes throughput, found within a few
hundred requests) and looks every ``look_every`` of them with the windowed KS tests of
:class:`workloads.drift.DriftMonitor` (any change of shape); the two share ``false_alarm_rate``
over the job (:data:`CUSUM_SHARE`). As a ``between_blocks`` hook it hands the engine the new policy.

The search of a re-plan is ``plan_search(method="warm")``: a climb from the policy in force
(:func:`xscheduler.search.warm_search`, tens of simulations and LPs instead of the whole
branch-and-bound), falling back to branch-and-bound when nothing near it meets the SLA.
``scope="local"`` keeps the weight compression (changing it makes the engine read the weights again).

Censoring: a request that stopped because it reached ``max_new_tokens`` (not EOS) has an output
length that is only a lower bound of what the model would have written. It is counted at its
capped value in the tests and the fit, on purpose: the cap is exactly what the engine generates
for it (and for every later request with the same cap), and that work is what a plan is priced
on -- a plan's output distribution is truncated at its ``max_len``, which ``xsched run`` uses as
the default cap. Treating it as missing or imputing a longer length would price tokens that are
never generated. How many outputs were capped is reported, and when more of them hit the plan's
longest output than the planned distribution puts there, the description says the cap binds
(the model would write more; raise the cap and plan again to serve that).

Online, only *settled* requests are tested: when the caller passes each request's position in
the queue (``order``), a request counts once every earlier one has finished, so the short
requests that finish first in a block cannot bias the output lengths short.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np
from scipy import signal, special

from workloads.drift import DEFAULT_HORIZON, DEFAULT_MIN_SHIFT, CusumMonitor, DriftMonitor, DriftReport, DriftStat
from workloads.distributions import LengthDistribution
from workloads.workload import Workload, read_request_lengths, read_rows, request_copies, spearman_to_copula
from xprofiler.profile import HardwareProfile
from xsched.contract import Contract
from xsched.errors import UserError
from xscheduler.plan import SLA, Plan
from xsimulator.policy import Policy
from xsimulator.result import SimResult

if TYPE_CHECKING:  # the engine's hook argument; xscheduler must not import xrunner (torch)
    from xrunner.engine import BlockInfo

# Recent-window sizes each look also tests: a window about as long as the stream since a change
# has the power of a test that knew where the change was (see workloads.drift).
DEFAULT_WINDOWS: tuple[int, ...] = (64, 128, 256, 512, 1024)
DEFAULT_LOOK_EVERY = 64  # settled requests between two looks of the online watcher
SCOPES: tuple[str, ...] = ("full", "local")
# Default false-alarm budget of a job: the CUSUM threshold is exact, so the rate sits at the budget
# (benchmarks/drift.py: 4 of 300 null streams at 0.01, 2 of 300 at 0.005), and halving it costs
# about 15 requests of delay (2.3 / 0.17 per request): the default keeps the rate under 1%.
FALSE_ALARM_RATE = 0.005
# Share of the false-alarm budget given to the CUSUMs (the mean-shift detector); the windowed KS
# tests (any change of shape) get the rest: the CUSUM is the one whose delay the goals are about.
# Its threshold is conservative at large budgets (6% of null streams fired at a 20% budget in
# tests/test_workloads.py) and about exact at the small ones used here (see FALSE_ALARM_RATE).
CUSUM_SHARE = 0.75
# A re-plan's reference is a fit of the few lengths after the change point (30-60), and the CUSUMs
# allow for its error (``CusumMonitor.reference_sd``), which leaves a second, smaller shift
# slow to find. Once REFIT_GROWTH times as many lengths have settled quietly (every CUSUM under
# half its threshold, no test firing), the watcher refits the reference on all of them.
REFIT_GROWTH = 4
WINDOW_TESTS = ("ks",)  # the windowed tests beside the CUSUMs: shape changes (the CUSUMs test the mean)


def _met(p: SimResult, sla: SLA) -> str:
    """A comparison cell: whether ``p`` meets ``sla``; one that does not fit cannot run, whatever
    its latency, and says that is why (the cell read "NO" beside a latency well under the bound)."""
    if not sla.met_by(p):
        return "NO"
    return "yes" if p.fits else "NO (no fit)"


@dataclass(frozen=True)
class Replan(Contract):
    """One drift check and what it changed: the test, the fitted workload, old and new plans."""

    SCHEMA: ClassVar[str] = "xsched.Replan/1"

    drift: DriftReport  # every statistic of the look (JSON: a dict)
    drifted: bool
    observed: Workload  # fitted to the lengths after the estimated change point
    old_plan: Plan
    new_plan: Plan | None  # None: no drift, the old policy is still the best, or nothing meets the SLA
    wall_s: float  # wall time of the check and re-plan
    old_on_observed: SimResult | None = None  # the old policy priced on the observed workload
    num_observed: int = 0  # lengths given
    fit_from: int = 0  # index of the first length the fit used (the estimated change point)
    num_capped: int = 0  # outputs that reached max_new_tokens (counted at the cap, see module doc)
    notes: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.new_plan is not None

    def reason(self) -> str:
        """One line for logs and the engine's reconfiguration record."""
        s = _strongest(self.drift)
        what = (f"{s.stream} mean {s.planned_mean:.1f} -> {s.observed_mean:.1f} ({s.test} p={s.pvalue:.2g}, last "
                f"{s.n})") if s else "no test"
        kind, bound = self.old_plan.sla.kind, self.old_plan.sla.latency_s
        parts = [f"drift: {what}"]
        if self.old_on_observed is not None:
            parts.append(f"old policy on observed: {_tps(self.old_on_observed)} tok/s, {kind} "
                         f"{self.old_on_observed.latency_s(kind):,.4g} s (bound {bound:g})"
                         + ("" if self.old_on_observed.fits else ", does not fit in memory"))
        if self.new_plan is not None:
            p = self.new_plan.predicted
            parts.append(f"new: {_short(self.new_plan.policy)}, {_tps(p)} tok/s, {kind} {p.latency_s(kind):,.4g} s")
        else:
            parts.append("policy kept")
        return "; ".join(parts)

    def describe(self) -> str:
        """What the test says and what changes, in words, with predictions before and after."""
        r = self.drift
        kind, bound = self.old_plan.sla.kind, self.old_plan.sla.latency_s
        lines = [("drift detected" if self.drifted else "no significant drift")
                 + f" in {self.num_observed} observed requests (look {r.look}, per-test level {r.level:.3g}: "
                   "the tests and looks share the job's false-alarm budget, --false-alarm-rate)",
                 stats_table(r), ""]
        lines.append(f"observed workload (fitted to requests {self.fit_from}..{self.num_observed - 1}):")
        lines += ["  " + ln for ln in self.observed.describe().splitlines()[1:]]
        ref, obs = self.old_plan.workload, self.observed
        if (obs.prompt.max_len, obs.output.max_len) == (ref.prompt.max_len, ref.output.max_len):
            lines.append(f"  (the longest stay the plan's {ref.prompt.max_len} and {ref.output.max_len} tokens, "
                         "whatever was observed: memory is sized by them)")
        if self.num_capped:
            lines.append(f"  {self.num_capped} output(s) reached max_new_tokens; counted at the cap (what the "
                         "engine generates)")
        lines.append("")
        cols = [("old plan, planned workload", self.old_plan.predicted),
                ("old plan, observed workload", self.old_on_observed)]
        if self.new_plan is not None:
            cols.append(("new plan, observed workload", self.new_plan.predicted))
        w = max(len(c[0]) for c in cols)
        lines.append(f"  {'':<22}" + "".join(f"  {name:>{w}}" for name, _ in cols))
        rows = [("requests priced", lambda p: f"{p.num_requests}"),
                ("throughput tok/s", lambda p: f"{p.throughput_tokens_per_s:,.3f}"),
                (f"{kind} latency s", lambda p: f"{p.latency_s(kind):,.5g}"),
                ("p50 latency s", lambda p: f"{p.latency_p50_s:,.5g}"),
                ("fits in memory", lambda p: "yes" if p.fits else "NO"),
                # a plan that does not fit cannot run, whatever its latency would be
                (f"meets {kind} <= {bound:g} s", lambda p: _met(p, self.old_plan.sla))]
        if self.old_plan.margin > 0:
            planning = self.old_plan.planning_sla
            rows.append((f"within {planning.latency_s:g} s ({self.old_plan.margin:.0%} margin)",
                         lambda p: _met(p, planning)))
        for label, fmt in rows:
            lines.append(f"  {label:<22}" + "".join(f"  {(fmt(p) if p is not None else '-'):>{w}}" for _, p in cols))
        lines.append("")
        if self.new_plan is not None:
            lines.append("policy change:")
            lines += ["  " + d for d in policy_changes(self.old_plan.policy, self.new_plan.policy)]
        notes = list(self.notes)
        if self.new_plan is None:
            why = notes.pop(0) if self.drifted and notes else "the observed lengths are consistent with the plan's workload"
            lines.append("policy kept: " + why)
        lines += [f"note: {n}" for n in notes]
        lines.append(f"check and re-plan took {self.wall_s:.3f} s")
        return "\n".join(lines)


def stats_table(report: DriftReport) -> str:
    """The look's tests, one row each: stream, window, test, statistic, p-value, fired."""
    if not report.stats:
        return "  (too few lengths to test)"
    head = f"  {'stream':<7} {'last n':>7} {'test':<5} {'statistic':>10} {'p-value':>9} {'obs mean':>9} " \
           f"{'plan mean':>9}  fired"
    rows = [f"  {s.stream:<7} {s.n:>7} {s.test:<5} {s.statistic:>10.4g} {s.pvalue:>9.3g} {s.observed_mean:>9.1f} "
            f"{s.planned_mean:>9.1f}  {'yes' if s.fired_at(report.level) else ''}" for s in report.stats]
    return "\n".join([head, *rows])


def policy_changes(old: Policy, new: Policy) -> list[str]:
    """The knobs that differ, in words (``old -> new``)."""
    out = []
    for label, a, b in (("GPU batch size", old.gbs, new.gbs), ("GPU batches per block", old.nb, new.nb),
                        ("refill every (decode steps)", old.refill_every, new.refill_every),
                        ("4-bit weights", old.compress_weight, new.compress_weight),
                        ("4-bit KV cache", old.compress_cache, new.compress_cache),
                        ("CPU attention", old.cpu_attention, new.cpu_attention),
                        ("prefix cache (positions)", _cache_size(old), _cache_size(new))):
        if a != b:
            out.append(f"{label}: {a} -> {b}")
    for what, prefix in (("weights", "w"), ("KV cache", "c"), ("activations", "h")):
        a = [getattr(old, prefix + t) for t in "gcd"]
        b = [getattr(new, prefix + t) for t in "gcd"]
        if not np.allclose(a, b):
            fmt = lambda v: "/".join(f"{x:.0%}" for x in v)  # noqa: E731
            out.append(f"{what} gpu/cpu/disk: {fmt(a)} -> {fmt(b)}")
    return out or ["(none)"]


def _cache_size(p: Policy) -> int | str:
    return "default" if p.prefix_cache_positions is None else p.prefix_cache_positions


def _tps(r: SimResult) -> str:
    return f"{r.throughput_tokens_per_s:,.3f}"


def _short(p: Policy) -> str:
    return f"gbs {p.gbs} x nb {p.nb}, refill {p.refill_every}"


def _strongest(report: DriftReport) -> DriftStat | None:
    """The test furthest below the level (the one that fired hardest), else the smallest p."""
    if not report.stats:
        return None
    def ratio(s: DriftStat) -> float:  # p over the level it is judged at (tests have different levels)
        level = report.level if s.level is None else s.level
        return s.pvalue / level if level > 0 else s.pvalue

    return min(report.stats, key=lambda s: (ratio(s), s.test != "mean"))


def change_point(x: np.ndarray, mean: float, std: float, min_len: int) -> int:
    """Start of the segment whose mean departs most from ``mean``: the maximum-likelihood change
    point of a shift from a known mean (argmax over t of (S_n - S_t)^2 / (n - t), S the cumsum of
    standardised lengths), keeping at least ``min_len`` lengths after it."""
    n = len(x)
    if n <= min_len:
        return 0
    s = np.concatenate(([0.0], np.cumsum((np.asarray(x, float) - mean) / max(std, 1e-9))))
    t = np.arange(0, n - min_len + 1)
    return int(t[np.argmax((s[n] - s[t]) ** 2 / (n - t))])


def profile_for(plan: Plan, profile: HardwareProfile | str | None = None) -> HardwareProfile:
    """The profile the plan was priced on (a re-plan must use the same machine numbers)."""
    from xprofiler.presets import load_preset, load_profile, preset_names

    if profile is None:
        if plan.profile_source != "preset" or plan.profile_name not in preset_names():
            raise UserError(f"the plan was priced on the measured profile {plan.profile_name!r}; pass that profile "
                            "file with --profile")
        profile = load_preset(plan.profile_name)
    elif isinstance(profile, str):
        profile = load_profile(profile, check_machine=False)
    if profile.name != plan.profile_name or profile.fingerprint != plan.profile_fingerprint:
        raise UserError(f"profile {profile.name!r} is not the one the plan was priced on ({plan.profile_name!r}, "
                        "same name and fingerprint needed); pass that profile, or make a new plan with `xsched plan`")
    return profile


def fit_workload(prompt_lens: Any, output_lens: Any, reference: Workload) -> Workload:
    """The observed lengths as empirical pmfs (exactly what the simulator consumes; the
    parametric fits of ``workloads.fit`` cost seconds of Nelder-Mead and a re-plan must be fast)
    plus their copula correlation.

    The longest lengths never fall below the reference's: memory is sized by them, and a short
    sample's maximum would let the planner pick batches the job's longest request cannot fit.
    """
    p, o = np.asarray(prompt_lens, np.int64), np.asarray(output_lens, np.int64)
    prompt = LengthDistribution.empirical(p, max(reference.prompt.max_len, int(p.max())))
    output = LengthDistribution.empirical(o, max(reference.output.max_len, int(o.max())))
    return Workload(name=f"observed({reference.name})", prompt=prompt, output=output,
                    correlation=spearman_to_copula(p, o),
                    source=f"empirical, {len(p)} observed requests"
                    + ("; outputs per prompt and shared prefixes as planned (lengths hold neither)"
                       if reference.samples > 1 or reference.prefix_tokens else ""),
                    samples=reference.samples, prefix_tokens=reference.prefix_tokens,
                    prefix_groups=reference.prefix_groups, prefix_share=reference.prefix_share,
                    prefix_lengths=reference.prefix_lengths, prefix_weights=reference.prefix_weights,
                    own_part=reference.own_part, unshared_prompt=reference.unshared_prompt)


def _smoothed(x: np.ndarray, max_len: int) -> LengthDistribution:
    """A kernel estimate of the pmf behind ``x``: each length spread as a normal of Silverman's
    bandwidth (at least half a token) over the integers, within [1, max_len]."""
    h = max(0.5, 1.06 * float(np.std(x)) * len(x) ** -0.2)
    lo, hi = max(1, int(x.min() - 4 * h)), min(max_len, int(math.ceil(x.max() + 4 * h)))
    reach = int(math.ceil(4 * h))
    steps = np.arange(-reach, reach + 1)
    kernel = special.ndtr((steps + 0.5) / h) - special.ndtr((steps - 0.5) / h)
    counts = np.bincount(x - x.min(), minlength=int(x.max() - x.min()) + 1).astype(float)
    # a convolution (FFT: a file's lengths may span tens of thousands of tokens); the result
    # starts at x.min() - reach, cut to [lo, hi]
    spread = np.clip(signal.fftconvolve(counts, kernel), 0.0, None)
    first = int(x.min()) - reach
    weights = spread[lo - first:hi - first + 1].copy()
    # what spreads past 1 or max_len stays at that end: cut off and renormalised, the spike of
    # outputs capped at max_new_tokens was under-weighted and every later capped output scored
    # high (a file of 300 outputs, 31% at the cap, drifted against itself in 5 of 5 seeds)
    weights[0] += spread[:lo - first].sum()
    weights[-1] += spread[hi - first + 1:].sum()
    return LengthDistribution("empirical", max_len, lo, {}, tuple(range(lo, hi + 1)),
                              tuple(float(w) for w in weights / weights.sum()))


# A stream whose empirical counts add up to more than this is taken as exact (and not expanded).
MAX_REFERENCE_SAMPLE = 1_000_000


def monitored(workload: Workload) -> tuple[Workload, dict[str, np.ndarray]]:
    """What the drift tests compare with, and the lengths it was estimated from, per stream.

    A stream that is an empirical pmf of whole counts (a workload read from a file of requests,
    or a re-plan's fit of the lengths after a change point) is a sample, not the truth: the tests
    get the sample (two-sample KS and mean tests, and CUSUMs that allow for its error) and a
    kernel-smoothed pmf of it (its maximum length kept). Taken as exact, an empirical pmf of the
    30-200 lengths after a change point gave every later length outside that sample a normal
    score of +-7, and ``xsched run`` re-planned 2-4 times for one shift (stop 36); a plan made
    from a file of 200 requests of G saw drift in 21 of 40 unchanged samples of 1000 (stop 37).
    Other streams are compared with as they are.
    """
    dists: dict[str, LengthDistribution] = {}
    samples: dict[str, np.ndarray] = {}
    for name in ("prompt", "output"):
        d = getattr(workload, name)
        w = np.asarray(d.weights, float)
        if d.family != "empirical" or not len(w) or np.any(w != np.round(w)) or w.min() < 0 \
                or w.sum() > MAX_REFERENCE_SAMPLE:
            continue
        samples[name] = np.repeat(np.asarray(d.values, np.int64), w.astype(np.int64))
        dists[name] = _smoothed(samples[name], d.max_len)
    if not samples:
        return workload, samples
    return replace(workload, **dists, source=f"{workload.source}, kernel-smoothed"), samples


def _monitors(reference: Workload, false_alarm_rate: float, min_samples: int, horizon: int,
              min_shift: float) -> tuple[DriftMonitor, CusumMonitor]:
    """The windowed tests and the CUSUMs against ``reference`` (as :func:`monitored` has it),
    sharing the false-alarm budget: CUSUM_SHARE to the CUSUMs, the rest to the windowed looks."""
    ref, samples = monitored(reference)
    return (DriftMonitor(ref, false_alarm_rate * (1 - CUSUM_SHARE), min_samples, WINDOW_TESTS, samples),
            CusumMonitor(ref, false_alarm_rate * CUSUM_SHARE, horizon, min_shift, reference_samples=samples))


def read_observed(path: Path, model: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths, capped flags, first-sample flags) from a results JSONL or
    a lengths JSONL/CSV; a results line with a ``"sample"`` other than 0 repeats its prompt.

    ``stopped_on_eos`` false (as ``xsched run`` writes it) marks an output that ended at its
    ``max_new_tokens``; a file without that column has no capped outputs. Lines naming another
    ``model`` than the plan's (``xsched run`` writes its name) get a warning: another model
    writes outputs of other lengths, and a re-plan from them is for that model's job.
    """
    rows = read_rows(path)
    others = sorted({str(r["model"]) for r in rows if r.get("model") not in (None, model)})
    if model is not None and others:
        warnings.warn(f"{path} holds results of {', '.join(others)}, the plan is for {model}; the re-plan assumes "
                      f"{model} writes outputs as long (replan that model's plan, or run {model} on the prompts "
                      "first)", UserWarning, stacklevel=2)
    keys = [json.dumps([r["id"], r.get("sample")]) for r in rows if r.get("id") is not None]
    if len(set(keys)) < len(keys):  # (a results file appended to twice counts those requests twice)
        warnings.warn(f"{path}: {len(keys) - len(set(keys))} line(s) repeat the id (and sample) of an earlier "
                      "line; each counts as an observed request", UserWarning, stacklevel=2)
    lengths = read_request_lengths(path, rows=rows)
    if lengths.outputs is None:
        raise UserError(f"{path}: no output lengths; each request needs output_tokens")
    capped, first = [], []
    for i, row in enumerate(rows, start=1):  # a lengths file's "n" counts a prompt n times, as its lengths do
        copies = request_copies(row, f"{path}: request {i}")
        capped += [str(row.get("stopped_on_eos", "")).strip().lower() in ("false", "0")] * copies
        first += [row.get("sample", 0) in (0, None)] + [False] * (copies - 1)
    return lengths.prompts, lengths.outputs, np.array(capped, bool), np.array(first, bool)


def _check_lengths(prompt_lens: Any, output_lens: Any, censored: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p, o = np.asarray(prompt_lens), np.asarray(output_lens)
    if p.ndim != 1 or p.shape != o.shape:
        raise UserError("observed prompt and output lengths must be two equally long lists")
    c = np.zeros(len(p), bool) if censored is None else np.asarray(censored, bool)
    if c.shape != p.shape:
        raise UserError("the censored flags must have one entry per observed request")
    for name, a in (("prompt", p), ("output", o)):
        if a.size and (not np.all(np.isfinite(a)) or np.any(a != np.round(a)) or np.any(a < 1)):
            raise UserError(f"observed {name} lengths must be whole numbers of tokens >= 1")
    return p.astype(np.int64), o.astype(np.int64), c


def _respond(plan: Plan, profile: HardwareProfile, p: np.ndarray, o: np.ndarray, capped: np.ndarray,
             report: DriftReport, reference: Workload, t0: float, *, num_requests: int, evaluator: str,
             compress: str, min_samples: int, scope: str = "full", method: str = "warm",
             running: Policy | None = None) -> Replan:
    """After a look: fit the observed lengths, price the old policy on them, search if drifted."""
    from xscheduler.planner import plan_search
    from xscheduler.search import variants
    from xsimulator.discrete_event import simulate

    start = 0
    s = _strongest(report)
    if report.drifted and s is not None:
        if s.test == "mean":
            x = p if s.stream == "prompt" else o
            dist = reference.prompt if s.stream == "prompt" else reference.output
            start = change_point(x, dist.mean, dist.std, min_samples)
        else:  # KS on the last n, or a CUSUM positive for the last n (its change-point estimate)
            start = max(0, min(len(p) - s.n, len(p) - min_samples))
    observed = fit_workload(p[start:], o[start:], reference)
    notes = []
    top = reference.output.max_len
    at_top = int(np.sum(capped[start:] & (o[start:] >= top)))
    n_fit = len(o) - start
    q = float(reference.output.pmf()[1][-1])  # planned mass at the longest output
    if at_top > n_fit * q + 3 * math.sqrt(max(n_fit * q * (1 - q), 1.0)):
        notes.append(f"{at_top} of {n_fit} outputs stopped at their token limit without EOS, at or past the "
                     f"longest planned output ({top} tokens), more than the {q:.1%} the plan expects: the cap "
                     "binds; the model would write more")
    pol = plan.policy if running is None else running  # the policy in force (a budget change may have moved it)
    old_on = simulate(plan.model, profile, pol, observed, num_requests, seed=0)
    if not old_on.fits:
        over = ", ".join(f"{t} {old_on.peak_bytes[t] / 2**30:,.2f} of {old_on.capacity_bytes[t] / 2**30:,.2f} GiB"
                         for t in ("gpu", "cpu", "disk") if old_on.peak_bytes[t] > old_on.capacity_bytes[t])
        notes.append(f"the old policy does not fit in memory on the observed lengths ({over}): it cannot run them")
    new_plan = None
    if report.drifted:
        try:
            only = [v for v in variants(compress, profile.compute_device) if v.compress_weight == pol.compress_weight] \
                if scope == "local" else None
            only = only or None  # compress="off" under 4-bit weights: nothing keeps them, so search every choice
            cand = plan_search(plan.model, profile, observed, plan.sla, compress=compress, num_requests=num_requests,
                               evaluator=evaluator, confirm_seeds=(), only=only, method=method, start=pol,
                               margin=plan.margin)
            # Same SLA and the same margin: the re-plan promises what the plan promised.
            cand = replace(cand, margin_source=plan.margin_source)
        except UserError as exc:
            notes.insert(0, f"no new plan: {exc}")
        else:
            if cand.policy != pol:
                new_plan = cand
            else:
                notes.insert(0, "the old policy is still the best for the observed workload")
    return Replan(drift=report, drifted=report.drifted, observed=observed, old_plan=plan, new_plan=new_plan,
                  wall_s=time.perf_counter() - t0, old_on_observed=old_on, num_observed=len(p), fit_from=start,
                  num_capped=int(capped.sum()), notes=tuple(notes))


def replan(plan: Plan, prompt_lens: Any, output_lens: Any, censored: Any = None, first: Any = None, *,
           profile: HardwareProfile | str | None = None, false_alarm_rate: float = FALSE_ALARM_RATE,
           min_samples: int = 30,
           windows: Sequence[int] = DEFAULT_WINDOWS, num_requests: int | None = None,
           evaluator: str = "discrete-event", compress: str = "auto", scope: str = "full",
           method: str = "warm", min_shift: float = DEFAULT_MIN_SHIFT) -> Replan:
    """Test the observed lengths against ``plan.workload``; if they drifted, plan again.

    Lengths are in the order they were observed (a change in the middle of the list is located
    and only what follows it is fitted); ``censored[i]`` marks an output that stopped at its
    ``max_new_tokens`` (see the module docstring for how it counts); ``first[i]`` (default all)
    that request ``i`` is the first of its prompt's samples: the drift tests count each prompt's
    length once, while the re-plan's fit counts it per sample, as ``workload fit`` does. The
    search uses the same model, profile (``profile_for``) and SLA as ``plan``; ``evaluator`` prices its candidates
    and the chosen plan is priced by the discrete-event simulator on ``num_requests`` requests
    (default: the plan's own job size; a block near the job's size makes latency grow with it,
    so pricing a 2000-request plan on 1000 requests once passed a p99 that the real job missed
    by 45%).
    ``method``: ``warm`` (default; see the module docstring) or any ``plan_search`` method.
    ``scope="local"`` keeps the plan's weight compression (no weight reload mid-job; KV-cache
    compression, CPU attention, batch shape, refill and placement may change); ``"full"`` may
    change it too. ``min_shift``: the relative length change the CUSUMs are tuned to.
    """
    if scope not in SCOPES:
        raise UserError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    check_false_alarm_rate(false_alarm_rate)
    num_requests = plan.predicted.num_requests if num_requests is None else num_requests
    if num_requests < 1:
        raise UserError(f"num_requests must be >= 1, got {num_requests}")
    t0 = time.perf_counter()
    prof = profile_for(plan, profile)
    p, o, c = _check_lengths(prompt_lens, output_lens, censored)
    if len(p) < min_samples:
        raise UserError(f"only {len(p)} observed request(s); the drift test needs at least {min_samples}")
    monitor, cusum = _monitors(plan.workload, false_alarm_rate, min_samples, len(p), min_shift)
    if first is not None and np.shape(first) != p.shape:
        raise UserError("the first-sample flags must have one entry per observed request")
    once = p if first is None else p[np.asarray(first, bool)]
    report = monitor.check(once, o, windows)
    cusum.update(once, o)
    stats = cusum.stats()
    report = replace(report, stats=report.stats + stats,
                     drifted=report.drifted or any(s.fired_at(cusum.level) for s in stats))
    return _respond(plan, prof, p, o, c, report, plan.workload, t0, num_requests=num_requests, evaluator=evaluator,
                    compress=compress, min_samples=min_samples, scope=scope, method=method)


def check_false_alarm_rate(rate: float) -> None:
    """The rate as the user gave it (the tests get shares of it, which once showed in the error);
    below 1e-9 the CUSUM threshold's root search fails."""
    if not 1e-9 <= rate < 1.0:
        raise UserError(f"the false-alarm rate must be a fraction in [1e-9, 1), got {rate:g}")


@dataclass
class DriftWatcher:
    """Online drift check for ``xsched run``: ``observe`` each finished request, call between blocks.

    The watcher's reference is the plan's workload until a re-plan, then the fitted observed
    workload (with a fresh false-alarm budget), so one shift causes one re-plan. A re-plan whose
    search finds nothing meeting the SLA keeps the policy (the event says why).
    """

    plan: Plan
    profile: HardwareProfile
    false_alarm_rate: float = FALSE_ALARM_RATE
    min_samples: int = 30
    look_every: int = DEFAULT_LOOK_EVERY
    windows: tuple[int, ...] = DEFAULT_WINDOWS
    num_requests: int | None = None  # job size each re-plan prices its candidates on (None: the plan's)
    evaluator: str = "discrete-event"
    compress: str = "auto"
    scope: str = "full"  # "local" keeps the running plan's weight compression (no weight reload mid-job)
    method: str = "warm"  # plan_search method: "warm" climbs from the running policy, "bnb" searches everything
    horizon: int = DEFAULT_HORIZON  # requests in the job: the CUSUM holds its false alarms over this many
    min_shift: float = DEFAULT_MIN_SHIFT  # relative length change the CUSUM is tuned to catch fastest
    events: list[Replan] = field(default_factory=list)
    looks: int = 0

    def __post_init__(self) -> None:
        check_false_alarm_rate(self.false_alarm_rate)
        if self.num_requests is None:
            self.num_requests = self.plan.predicted.num_requests
        if self.look_every < 1:
            raise UserError(f"look_every must be >= 1, got {self.look_every}")
        self._reset(self.plan.workload, self.horizon)
        self._p: list[int] = []
        self._o: list[int] = []
        self._c: list[bool] = []
        self._f: list[bool] = []  # the first of its prompt's samples
        self._pending: dict[int, tuple[int, int, bool, bool]] = {}
        self._next = 0
        self._start = 0  # first settled request compared with the current reference
        self._fit_from: int | None = None  # first length of a re-plan's fitted reference (None: the plan's)
        # (settled count, lengths fitted) at each refit of a re-plan's reference (REFIT_GROWTH)
        self.refits: list[tuple[int, int]] = []
        self._looked_at = 0

    def _reset(self, reference: Workload, horizon: int) -> None:
        """Compare what settles from now on with ``reference`` (:func:`_monitors`)."""
        self.reference = reference
        self._monitor, self._cusum = _monitors(reference, self.false_alarm_rate, self.min_samples,
                                               max(int(horizon), 1), self.min_shift)

    @property
    def settled(self) -> int:
        return len(self._p)

    def observe(self, prompt_len: int, output_len: int, censored: bool = False, order: int | None = None,
                first: bool = True) -> None:
        """One finished request. ``order`` (its position in the queue, from 0) holds it back until
        every earlier request has finished, so the test never sees only the fast ones. ``first``:
        it is the first of its prompt's samples (the drift tests count each prompt's length once;
        8 copies of each made every one of 20 unchanged streams fire)."""
        if prompt_len < 1 or output_len < 1:
            raise UserError("observed prompt and output lengths must be >= 1 token")
        item = (int(prompt_len), int(output_len), bool(censored), bool(first))
        if order is None:
            self._settle(item)
            return
        self._pending[int(order)] = item
        while self._next in self._pending:
            self._settle(self._pending.pop(self._next))
            self._next += 1

    def _settle(self, item: tuple[int, int, bool, bool]) -> None:
        self._p.append(item[0])
        self._o.append(item[1])
        self._c.append(item[2])
        self._f.append(item[3])

    def _once(self, start: int) -> list[int]:
        """The prompt lengths settled from ``start`` on, one per prompt."""
        return [p for p, f in zip(self._p[start:], self._f[start:]) if f]

    def check(self, running: Policy | None = None) -> Replan | None:
        """The event if a CUSUM is over its threshold, or if ``look_every`` requests settled since
        the last look and the windowed tests fire; else None. ``running``: the policy in force
        (default: the plan's), where the re-plan starts and what it compares with."""
        n = self.settled - self._start
        if n < self.min_samples:
            return None
        t0 = time.perf_counter()
        fed = self._start + self._cusum.count  # feed the CUSUMs in one batch (numpy scores) per check
        self._cusum.update(self._once(fed), self._o[fed:])
        cusum = self._cusum.stats()
        sl = slice(self._start, None)
        # A CUSUM over its threshold waits until min_samples lengths lie after its change-point
        # estimate: a big shift fires within a few requests, and a fit mixing in the lengths from
        # before the change would leave a reference the next CUSUM fires against again.
        if any(s.fired_at(self._cusum.level) and s.n >= self.min_samples for s in cusum):
            p, o, c = np.array(self._p[sl]), np.array(self._o[sl]), np.array(self._c[sl], bool)
            report = DriftReport(self._monitor.looks, n, n, self._cusum.level, True, cusum)
        elif self.settled - self._looked_at >= self.look_every:
            self._looked_at = self.settled
            self.looks += 1
            p, o, c = np.array(self._p[sl]), np.array(self._o[sl]), np.array(self._c[sl], bool)
            report = self._monitor.check(self._once(self._start), o, self.windows)
            if not report.drifted:
                self._refit()
                return None
            report = replace(report, stats=report.stats + cusum)
        else:
            self._refit()
            return None
        event = _respond(self.plan, self.profile, p, o, c, report, self.reference, t0,
                         num_requests=self.num_requests, evaluator=self.evaluator, compress=self.compress,
                         min_samples=self.min_samples, scope=self.scope, method=self.method, running=running)
        self.events.append(event)
        if event.new_plan is not None:
            self.plan = event.new_plan
        self._reset(event.observed, self.horizon - self.settled)  # a fit of the lengths after the change point
        self._fit_from = self._start + event.fit_from
        self._start = self.settled
        return event

    def _refit(self) -> None:
        """Refit a re-plan's reference on every length since its change point once REFIT_GROWTH
        times as many have settled and the CUSUMs are quiet (a change that has begun would be
        half-absorbed into the new reference). The new CUSUMs' allowance for the reference's
        error shrinks with the square root of its lengths."""
        if self._fit_from is None or not self._cusum.quiet():
            return
        fitted = self._start - self._fit_from
        if self.settled - self._fit_from < REFIT_GROWTH * fitted:
            return
        sl = slice(self._fit_from, None)
        observed = fit_workload(np.array(self._p[sl]), np.array(self._o[sl]), self.reference)
        looks = self._monitor.looks
        self._reset(observed, self.horizon - self.settled)
        self._monitor.looks = looks  # the windowed tests go on spending the re-plan's budget, not a fresh one
        self._start = self.settled
        self.refits.append((self.settled, self.settled - self._fit_from))

    def __call__(self, info: "BlockInfo") -> tuple[Policy, str] | None:
        """``between_blocks`` hook: the new policy and a one-line reason when a re-plan changed it."""
        event = self.check(info.policy)
        if event is None or event.new_plan is None or event.new_plan.policy == info.policy:
            return None
        return event.new_plan.policy, event.reason()
