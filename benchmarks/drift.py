"""Drift benchmark (issue 8): a job whose output lengths shift +15% / +30% / -15% halfway through.

The streams are thousands of requests, so they run in the discrete-event simulator, not the
engine: requests settle in queue order and the watcher is consulted every ``--hook-every``
settled requests (standing in for the engine's block boundaries). With re-planning, the requests
admitted before the event run under the old policy and the rest under the new one (two
simulated segments; the reconfiguration stall itself is not simulated). Prints detection delay
(post-shift requests settled before the event), re-plan wall time, false alarms on unshifted
streams over many seeds, and SLA violations (fraction of requests over the bound) and
throughput with and without re-planning.

A second table times ``replan`` alone on ``--replan-samples`` shifted samples of 600 requests per
shift size, for both scopes (``local`` keeps the weight compression, ``full`` may change it) and
both search methods (``warm``, the default: a climb from the running policy; ``bnb``: the whole
branch-and-bound), with each plan's throughput over that of the best plan found for the sample;
``--exhaustive`` also prices every point of the memory-feasible grid (slow) and makes that the
reference. Every timing is printed beside the 1-minute load average: the machine may be shared.

    OMP_NUM_THREADS=1 python benchmarks/drift.py [--seeds 100] [--requests 4000] [--shift-seeds 10]
                                                 [--replan-samples 3] [--exhaustive]
                                                 [--event-seeds 20] [--reference-runs 200]

``--samples K`` makes every prompt ask for K outputs (runs of K requests with one prompt length,
each prompt's first told apart), as ``xsched run`` feeds a job with ``"n"``.

``--event-seeds`` adds a table of the events the online watcher raises per job of 3000 requests
when it keeps watching after its re-plans (one shift of +30%; that and x1.8 or x1.495 later), and
``--reference-runs`` one of the CUSUMs against a reference fitted on 30-200 lengths (what they
compare with after a re-plan): false alarms on unchanged lengths, and delay on a +30% shift.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages, not an installed copy

from workloads import get_workload
from xprofiler.presets import load_profile
from xprofiler.specs import get_model_spec
from xscheduler.plan import SLA
from xscheduler.planner import plan_search
from workloads.drift import CusumMonitor
from xscheduler.replan import CUSUM_SHARE, DriftWatcher, fit_workload, monitored, replan
from xscheduler.search import Evaluator, search, variants
from xsimulator.discrete_event import simulate_timeline

SHIFTS = (1.15, 1.30, 0.85)


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def run_stream(watcher, p, o, hook_every, samples=1):
    """Feed the stream in order (requests come in runs of ``samples`` with one prompt); the
    number of requests settled when the watcher first fired, or None."""
    for i in range(len(p)):
        watcher.observe(int(p[i]), int(o[i]), order=i, first=i % samples == 0)
        if (i + 1) % hook_every == 0 and watcher.check() is not None:
            return i + 1
    return None


def segment(plan, prof, policy, w, p, o):
    res, tl = simulate_timeline(plan.model, prof, policy, w, requests=(p, o))
    return tl.latency_s, res.wall_s, float(o.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-6.7b")
    ap.add_argument("--profile", default="t4")
    ap.add_argument("--workload", default="T")
    ap.add_argument("--latency", type=float, default=300.0)
    ap.add_argument("--requests", type=int, default=4000, help="requests per job (shift at the middle)")
    ap.add_argument("--seeds", type=int, default=100, help="unshifted streams for the false-alarm rate")
    ap.add_argument("--shift-seeds", type=int, default=3, help="shifted jobs per shift size")
    ap.add_argument("--hook-every", type=int, default=32)
    ap.add_argument("--false-alarm-rate", type=float, default=0.005, help="the watcher's budget (its default)")
    ap.add_argument("--scope", choices=("local", "full"), default="full", help="the watcher's re-plan scope")
    ap.add_argument("--samples", type=int, default=1,
                    help="outputs per prompt: requests come in runs of this many with one prompt length")
    ap.add_argument("--replan-samples", type=int, default=3, help="shifted samples per shift size timed alone")
    ap.add_argument("--exhaustive", action="store_true", help="compare re-plans with exhaustive search (slow)")
    ap.add_argument("--exhaustive-requests", type=int, default=1000)
    ap.add_argument("--event-seeds", type=int, default=0,
                    help="jobs per scenario for the events-per-job table (one shift, two shifts; 0: skip)")
    ap.add_argument("--reference-runs", type=int, default=0,
                    help="runs per reference size for the fitted-reference CUSUM table (0: skip)")
    args = ap.parse_args()

    prof = load_profile(args.profile)
    spec = prof.model_for(get_model_spec(args.model))
    w = replace(get_workload(args.workload), samples=args.samples)
    sla = SLA("p99", args.latency)
    t = time.perf_counter()
    plan = plan_search(spec, prof, w, sla, num_requests=1000, confirm_seeds=())
    print(f"plan: {args.model} on {args.profile}, workload {w.name}, {sla.describe()} ({time.perf_counter() - t:.1f} s "
          f"to plan); policy gbs {plan.policy.gbs} x nb {plan.policy.nb}, refill {plan.policy.refill_every}")
    if args.reference_runs:
        reference_table(w, args.false_alarm_rate * CUSUM_SHARE, args.reference_runs)
    if args.event_seeds:
        events_table(plan, prof, w, args.event_seeds)
    half = args.requests // 2
    rows = []
    replan_rows = replan_table(args, plan, prof, w) if args.replan_samples else []
    for factor, seed in tqdm([(f, s) for f in SHIFTS for s in range(args.shift_seeds)], desc="shifted jobs",
                             leave=False):
        shifted = replace(w, output=w.output.scaled(factor))
        a, b = w.sample(half, seed=10 + 2 * seed), shifted.sample(args.requests - half, seed=11 + 2 * seed)
        p, o = np.concatenate((a[0], b[0])), np.concatenate((a[1], b[1]))
        watcher = DriftWatcher(plan, prof, false_alarm_rate=args.false_alarm_rate, horizon=args.requests,
                               scope=args.scope)
        at = run_stream(watcher, p, o, args.hook_every, args.samples)
        lat0, wall0, tok = segment(plan, prof, plan.policy, w, p, o)
        row = {"shift": f"{factor - 1:+.0%}", "seed": seed, "delay": None if at is None else at - half,
               "load": load(), "test": None,
               "replan_s": None, "viol_without": float(np.mean(lat0 > sla.latency_s)),
               "tps_without": tok / wall0, "viol_with": None, "tps_with": None, "policy": "-"}
        if at is not None:
            ev = watcher.events[0]
            row["replan_s"] = ev.wall_s
            row["test"] = next((f"{st.stream} {st.test}" for st in ev.drift.fired()), None)
            new = ev.new_plan.policy if ev.new_plan is not None else plan.policy
            row["policy"] = _describe(new)
            if new == plan.policy:  # policy kept: the job runs on as one segment
                (l1, w1, t1), (l2, w2, t2) = segment(plan, prof, plan.policy, w, p, o), (lat0[at:], 0.0, 0.0)
                l1 = l1[:at]
            else:  # the block in flight drains under the old policy, the rest runs under the new one
                l1, w1, t1 = segment(plan, prof, plan.policy, w, p[:at], o[:at])
                l2, w2, t2 = segment(plan, prof, new, ev.observed, p[at:], o[at:])
            lat = np.concatenate((l1, l2))
            row["viol_with"] = float(np.mean(lat > sla.latency_s))
            row["viol_after_with"] = float(np.mean(l2 > sla.latency_s))
            row["tps_with"] = (t1 + t2) / (w1 + w2)
        row["viol_after_without"] = float(np.mean(lat0[at or half:] > sla.latency_s))
        rows.append(row)

    alarms = 0
    looks = []
    for seed in tqdm(range(args.seeds), desc="unshifted streams", leave=False):
        pp, oo = w.sample(args.requests, seed=100 + seed)
        watcher = DriftWatcher(plan, prof, false_alarm_rate=args.false_alarm_rate, horizon=args.requests)
        alarms += run_stream(watcher, pp, oo, args.hook_every, args.samples) is not None
        looks.append(watcher.looks)

    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    if replan_rows:
        ref = "exhaustive" if args.exhaustive else "best found"
        priced = args.exhaustive_requests if args.exhaustive else 1000
        print(f"\nre-plan alone on shifted samples of 600 requests ({priced} requests priced per point; 'vs ref' = "
              f"throughput / {ref} for the scope's variants)")
        print(f"{'shift':>6} {'seed':>4} {'scope':>6} {'method':>8} {'wall s':>7} {'load':>5} {'evals':>5} {'LPs':>4} "
              f"{'tok/s':>8} {'vs ref':>6} {'meets':>5}  policy")
        for r in replan_rows:
            print(f"{r['shift']:>6} {r['seed']:>4} {r['scope']:>6} {r['method']:>8} {r['wall_s']:>7.3f} {r['load']:>5} "
                  f"{r['evals']:>5} {r['lps']:>4} {r['tps']:>8.2f} {fmt(r['vs_ref'], '.3f'):>6} {r['meets']:>5}  "
                  f"{r['policy']}")
        for scope in ("local", "full"):
            for method in ("warm", "bnb"):
                sel = [r for r in replan_rows if r["scope"] == scope and r["method"] == method]
                ws, q = [r["wall_s"] for r in sel], [r["vs_ref"] for r in sel if r["vs_ref"] is not None]
                print(f"  {scope:>5} {method:>4}: wall {min(ws):.3f}-{max(ws):.3f} s (median {np.median(ws):.3f}), "
                      f"vs ref min {fmt(min(q) if q else None, '.3f')}, mean {fmt(np.mean(q) if q else None, '.3f')}")
    print(f"\n{'shift':>6} {'seed':>4} {'delay req':>9} {'fired':>14} {'replan s':>9} {'load':>5} {'viol w/o':>9} "
          f"{'viol with':>9} {'after w/o':>9} {'after with':>10} {'tok/s w/o':>10} {'tok/s with':>10}  new policy")
    for r in rows:
        print(f"{r['shift']:>6} {r['seed']:>4} {fmt(r['delay'], 'd'):>9} {fmt(r['test'], 's'):>14} "
              f"{fmt(r['replan_s'], '.2f'):>9} {r['load']:>5} {r['viol_without']:>9.3f} "
              f"{fmt(r['viol_with'], '.3f'):>9} {r['viol_after_without']:>9.3f} {fmt(r.get('viol_after_with'), '.3f'):>10} "
              f"{r['tps_without']:>10.2f} {fmt(r['tps_with'], '.2f'):>10}  {r['policy']}")
    for factor in SHIFTS:
        d = [r["delay"] for r in rows if r["shift"] == f"{factor - 1:+.0%}"]
        got = [x for x in d if x is not None]
        if d:
            print(f"  {factor - 1:+.0%}: detected {len(got)}/{len(d)}, delay "
                  + (f"min {min(got)}, median {np.median(got):.0f}, max {max(got)}, over 500: "
                     f"{sum(x > 500 for x in got) + len(d) - len(got)}" if got else "-"))
    rate = alarms / max(args.seeds, 1)
    print(f"\nfalse alarms: {alarms} of {args.seeds} unshifted streams of {args.requests} requests = {rate:.3f} "
          f"(goal < 0.01; configured {args.false_alarm_rate}; {np.mean(looks) if looks else 0:.0f} looks per stream)")
    print("goals: detection delay <= 500 requests, re-plan <= 1 s; 'viol' = fraction of requests over the "
          f"{sla.latency_s:g} s bound (whole job / after the shift), tok/s over the whole job")


def reference_table(w, rate: float, runs: int) -> None:  # noqa: ANN001
    """After a re-plan the CUSUMs compare with a fit of the m lengths after the change point: how
    often they fire on 2000 more unchanged lengths, and how soon after a +30% output shift."""
    print(f"\nCUSUMs against a reference fitted on m lengths of {w.name} ({runs} runs per m; budget {rate:g}):")
    print(f"{'m':>5} {'false alarms':>13} {'+30% found after (median)':>26} {'not within 2000':>16}  (delays: "
          f"{max(1, runs // 4)} runs; the median is of those found)")
    for m in (30, 60, 200):
        fired, delays = 0, []
        for s in tqdm(range(runs), desc=f"reference of {m}", leave=False):
            p, o = w.sample(m + 2000, seed=1000 + s)
            ref, samples = monitored(fit_workload(p[:m], o[:m], w))
            mon = CusumMonitor(ref, rate, 2000, reference_samples=samples)
            for a in range(m, m + 2000, 10):  # looked at as often as the delays below: a sum that
                mon.update(p[a:a + 10], o[a:a + 10])  # crossed and fell back is an alarm too
                if mon.drifted():
                    fired += 1
                    break
            if s < max(1, runs // 4):
                mon, longer = CusumMonitor(ref, rate, 2000, reference_samples=samples), np.minimum(np.round(o * 1.3), w.output.max_len)
                delays.append(None)
                for a in range(m, m + 2000, 10):
                    mon.update(p[a:a + 10], longer[a:a + 10])
                    if mon.drifted():
                        delays[-1] = a + 10 - m
                        break
        got = [d for d in delays if d is not None]
        print(f"{m:>5} {fired:>6} of {runs:<5} {np.median(got) if got else float('nan'):>26.0f} "
              f"{len(delays) - len(got):>9} of {len(delays)}")


def events_table(plan, prof, w, seeds: int) -> None:  # noqa: ANN001
    """Events the online watcher raises per job of 3000 requests: one shift of every length by +30%
    at request 300 (goal: one event), or that and a second shift from request 1500, x1.8 or x1.495
    of the plan's lengths (+38% or +15% over the first shift; goal: two events, the second soon
    after 1500). The second shift is compared with the re-plan's reference, a fit of the few
    lengths after the first change point until the watcher refits it (``REFIT_GROWTH``)."""
    scenarios = {"one shift": [(300, 1.0), (2700, 1.3)], "two shifts": [(300, 1.0), (1200, 1.3), (1500, 1.8)],
                 "smaller second": [(300, 1.0), (1200, 1.3), (1500, 1.495)]}
    print(f"\nevents per job of 3000 requests ({seeds} seeds; the watcher looks every 64 requests):")
    for name, parts in scenarios.items():
        counts, at_all, second = [], [], []
        for seed in tqdm(range(1, seeds + 1), desc=name, leave=False):
            drawn = [(w if f == 1.0 else get_workload(f"{w.name}@{f}")).sample(n, seed=seed + 50 * i)
                     for i, (n, f) in enumerate(parts)]
            p, o = np.concatenate([d[0] for d in drawn]), np.concatenate([d[1] for d in drawn])
            watcher, at = DriftWatcher(plan, prof, horizon=3000, num_requests=500), []
            for i in range(len(p)):
                watcher.observe(int(p[i]), int(o[i]))
                if (i + 1) % 64 == 0 and watcher.check() is not None:
                    at.append(i + 1)
            counts.append(len(at))
            at_all.append(at)
            if len(parts) > 2:
                second.append(next((a - 1500 for a in at if a > 1500), None))
        hist = ", ".join(f"{k} event(s): {counts.count(k)}" for k in sorted(set(counts)))
        found = [d for d in second if d is not None]
        after = (f"; the second shift found in {len(found)} of {seeds}, median {np.median(found):.0f} requests "
                 f"after it, max {max(found)}") if found else ("; the second shift never found" if second else "")
        print(f"  {name}: {hist}{after}; events at request {at_all}")


def replan_table(args, plan, prof, w) -> list[dict]:  # noqa: ANN001
    """``replan`` timed alone per scope and method on shifted samples, with its plan's quality."""
    rows = []
    jobs = [(f, s) for f in SHIFTS for s in range(args.replan_samples)]
    for factor, seed in tqdm(jobs, desc="re-plans", leave=False):
        p, o = replace(w, output=w.output.scaled(factor)).sample(600, seed=4 + seed)
        found, observed = [], None
        for scope in ("local", "full"):
            for method in ("warm", "bnb"):
                r = replan(plan, p, o, profile=prof, scope=scope, method=method,
                           false_alarm_rate=args.false_alarm_rate)
                if not r.drifted:
                    continue
                observed = r.observed  # the same fit for every scope and method (from the estimated change point)
                new = r.new_plan.predicted if r.new_plan is not None else r.old_on_observed
                pol = r.new_plan.policy if r.new_plan is not None else plan.policy
                stats = r.new_plan.search if r.new_plan is not None else None  # None: the policy was kept
                found.append(dict(shift=f"{factor - 1:+.0%}", seed=seed, scope=scope, method=method, wall_s=r.wall_s,
                                  load=load(), evals=stats.evaluations if stats else 0,
                                  lps=stats.lp_solves if stats else 0,
                                  tps=new.throughput_tokens_per_s, meets="yes" if plan.sla.met_by(new) else "NO",
                                  cw=pol.compress_weight, vs_ref=None, policy=_describe(pol)))
        if args.exhaustive and observed is not None:
            ev = Evaluator(plan.model, prof, observed, num_requests=args.exhaustive_requests)
            search(ev, [sp for sp in (ev.space(v) for v in variants("auto", prof.compute_device)) if sp],
                   plan.sla.kind, plan.sla.latency_s, "exhaustive")
            ok = [e for e in ev.cache.values() if e.meets(plan.sla.kind, plan.sla.latency_s)]
            for row in found:
                allowed = [e.throughput for e in ok if row["scope"] == "full"
                           or e.variant.compress_weight == plan.policy.compress_weight]
                row["vs_ref"] = row["tps"] / max(allowed) if allowed else None
        else:
            for row in found:
                same = [r["tps"] for r in found if row["scope"] == "full" or r["cw"] == plan.policy.compress_weight]
                row["vs_ref"] = row["tps"] / max(same)
        rows += found
    return rows


def _describe(p) -> str:  # noqa: ANN001
    v = "+".join(n for n, on in (("4-bit w", p.compress_weight), ("4-bit kv", p.compress_cache),
                                 ("cpu attn", p.cpu_attention)) if on) or "no compression"
    return f"{v}, gbs {p.gbs} x nb {p.nb}, refill {p.refill_every}"


if __name__ == "__main__":
    main()
