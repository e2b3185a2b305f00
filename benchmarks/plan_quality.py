"""Plan quality and cost: branch-and-bound against exhaustive search and Optuna TPE.

For every model x preset x workload, the whole memory-feasible grid is evaluated once (that is
exhaustive search; its evaluations are cached and reused for all bounds), the lowest achievable
p99 latency found, and four bounds set from tight to unbounded (1.25x, 2x and 4x the lowest, and
infinity). For each bound:

- branch-and-bound (``xscheduler`` defaults, fresh evaluator, so its count and wall time are its
  own, placement LPs for the knob ranges included): throughput / exhaustive throughput
  (goal >= 0.99 in every cell), simulator evaluations / exhaustive evaluations (goal <= 5%;
  placement LP solves are counted apart, column LPs), wall seconds (goal <= 5 s for opt-175b on t4);
- Optuna TPE with the same number of evaluations: throughput / exhaustive throughput.

Timings are from a shared 2-core machine; compare within one run. ``cpu s`` is the process's
CPU time for the branch-and-bound plan, what its wall time would be with a core to itself.

``--presets`` also takes profile files written by ``xsched profile``: a measured profile's noisy
fits are where the search's LP bounds are least safe, so check the planner on one too (for
example ``--models smollm2-135m --presets p.json --workloads S@0.125 --kinds p99 p99-length``).

    python benchmarks/plan_quality.py [--quick] [--requests 2000] [--models ...] [--presets ...]
                                      [--workloads ...] [--kinds p99 p99-length]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from tqdm import tqdm

from workloads import get_workload
from xprofiler.presets import load_profile, preset_names
from xprofiler.specs import get_model_spec
from xsched.errors import UserError
from xscheduler.placement import lp_solver
from xscheduler.search import Evaluator, search, variants

MODELS = ("opt-6.7b", "opt-30b", "opt-175b", "llama-2-70b")
PRESETS = ("t4", "a100-80gb")
WORKLOADS = ("S", "T", "G", "C1", "C2")
BOUNDS = (1.25, 2.0, 4.0, math.inf)
QUICK = dict(models=("opt-30b", "opt-175b"), presets=("t4",), workloads=("T", "C2"))


def cell(model: str, preset: str, wl: str, requests: int, kinds: tuple[str, ...] = ("p99",)) -> list[dict]:
    profile = load_profile(preset, check_machine=False)
    spec, workload = profile.model_for(get_model_spec(model)), get_workload(wl)
    vs = variants("auto", profile.compute_device)
    t0 = time.perf_counter()
    full = Evaluator(spec, profile, workload, num_requests=requests)
    spaces = [s for s in (full.space(v) for v in vs) if s]
    if not spaces:
        return [dict(model=model, preset=preset, workload=wl, note="does not fit")]
    exh_all = search(full, spaces, "p99", math.inf, "exhaustive")
    exh_wall = time.perf_counter() - t0
    rows = []
    for kind, factor in ((k, f) for k in kinds for f in BOUNDS):
        bound = min(e.latency(kind) for e in full.cache.values() if e.fits) * factor
        exh = search(full, spaces, kind, bound, "exhaustive").best
        t1, c1 = time.perf_counter(), time.process_time()
        ev = Evaluator(spec, profile, workload, num_requests=requests)
        bs = [s for s in (ev.space(v, knee=True) for v in vs) if s]
        out = search(ev, bs, kind, bound, "bnb")
        bnb_wall, bnb_cpu = time.perf_counter() - t1, time.process_time() - c1
        opt_ev = Evaluator(spec, profile, workload, num_requests=requests)
        opt_ev.placements = full.placements  # LPs are not what Optuna is measured on
        opt = search(opt_ev, spaces, kind, bound, "optuna", budget=out.evaluations).best
        ref = exh.throughput if exh else 0.0
        rows.append(dict(
            model=model, preset=preset, workload=wl, kind=kind, factor=factor, bound=bound, exh=ref,
            bnb=(out.best.throughput / ref) if exh and out.best else (1.0 if not exh and not out.best else 0.0),
            optuna=(opt.throughput / ref) if exh and opt else (1.0 if not exh and not opt else 0.0),
            evals=out.evaluations, grid=exh_all.evaluations, lps=ev.lp_solves, bnb_wall=bnb_wall, bnb_cpu=bnb_cpu,
            exh_wall=exh_wall))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"subset: {', '.join(QUICK['models'])} on {', '.join(QUICK['presets'])}, "
                         f"workloads {', '.join(QUICK['workloads'])}")
    ap.add_argument("--requests", type=int, default=2000, help="requests per simulated job (default 2000)")
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--presets", nargs="+", default=None)
    ap.add_argument("--workloads", nargs="+", default=None)
    ap.add_argument("--kinds", nargs="+", default=["p99"], choices=["p99", "p99-length"],
                    help="latency bounds to search under (default p99)")
    args = ap.parse_args(argv)
    models = args.models or (QUICK["models"] if args.quick else MODELS)
    presets = args.presets or (QUICK["presets"] if args.quick else PRESETS)
    wls = args.workloads or (QUICK["workloads"] if args.quick else WORKLOADS)
    combos = [(m, p, w) for m in models for p in presets for w in wls]
    header = (f"{'model':<14}{'preset':<10}{'wl':<9}{'kind':<11}{'bound':>7}{'exh tok/s':>11}{'B&B/exh':>9}{'TPE/exh':>9}"
              f"{'B&B evals':>10}{'grid':>6}{'evals %':>8}{'LPs':>5}{'B&B s':>7}{'cpu s':>7}{'exh s':>7}")
    print(header)
    rows = []
    for m, p, w in tqdm(combos, desc="plan quality", file=sys.stderr):
        try:
            got = cell(m, p, w, args.requests, tuple(args.kinds))
        except UserError as exc:
            got = [dict(model=m, preset=p, workload=w, note=str(exc))]
        name, model = (p if p in preset_names() else Path(p).stem), Path(m).name  # files by their names
        for r in got:
            if "note" in r:
                print(f"{model:<14}{name:<10}{w:<9}  {r['note'][:90]}", flush=True)
                continue
            rows.append(r)
            f = "inf" if math.isinf(r["factor"]) else f"{r['factor']:g}x"
            print(f"{model:<14}{name:<10}{w:<9}{r['kind']:<11}{f:>7}{r['exh']:>11.3f}{r['bnb']:>9.3f}{r['optuna']:>9.3f}{r['evals']:>10}"
                  f"{r['grid']:>6}{100 * r['evals'] / r['grid']:>7.1f}%{r['lps']:>5}{r['bnb_wall']:>7.2f}{r['bnb_cpu']:>7.2f}"
                  f"{r['exh_wall']:>7.1f}", flush=True)
    if rows:
        frac = [r["evals"] / r["grid"] for r in rows]
        print(f"\ncells: {len(rows)}; B&B/exhaustive throughput: min {min(r['bnb'] for r in rows):.3f}, "
              f"cells >= 0.99: {sum(r['bnb'] >= 0.99 for r in rows)}/{len(rows)}")
        print(f"evaluations B&B/exhaustive: mean {100 * sum(frac) / len(frac):.1f}%, max {100 * max(frac):.1f}%, "
              f"cells <= 5%: {sum(f <= 0.05 for f in frac)}/{len(frac)}")
        print(f"Optuna TPE (same budget)/exhaustive: mean {sum(r['optuna'] for r in rows) / len(rows):.3f}, "
              f"min {min(r['optuna'] for r in rows):.3f}")
        walls = [r["bnb_wall"] for r in rows if r["model"] == "opt-175b" and r["preset"] == "t4"]
        cpus = [r["bnb_cpu"] for r in rows if r["model"] == "opt-175b" and r["preset"] == "t4"]
        if walls:
            print(f"B&B wall per plan, opt-175b on t4: max {max(walls):.2f} s, mean {sum(walls) / len(walls):.2f} s, "
                  f"plans <= 5 s: {sum(w <= 5.0 for w in walls)}/{len(walls)}; process CPU time: max "
                  f"{max(cpus):.2f} s, mean {sum(cpus) / len(cpus):.2f} s (wall exceeds CPU time when other work "
                  f"shares the cores)")
        print(f"placement LPs per B&B plan: mean {sum(r['lps'] for r in rows) / len(rows):.0f}, "
              f"max {max(r['lps'] for r in rows)} (solver: {lp_solver().name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
