"""The simulator and the planner against FlexGen's own measurements on its T4 machine.

FlexGen (seed 000, Tables 15-18) reports the generation throughput it measured on one T4 GPU
(the machine of the ``t4`` preset) for OPT-6.7B, OPT-30B and OPT-175B, with the policy it ran
(GPU batch x batches, wg, wc, cg, cc, hg, hc), without and with 4-bit compression; Table 21
repeats some of them with the page cache kept out of the way, as ``xsched`` always reads disk.
This script:

1. prices each published policy with the simulator on the ``t4`` preset (one block of the
   policy's rows, every prompt and output of the table's lengths, as FlexGen measured it) and
   prints predicted / measured throughput;
2. plans each setting with ``xsched``'s planner (no latency bound; compression off for the
   FlexGen rows, on for FlexGen (c)) and prints the plan's predicted throughput beside FlexGen's
   measured one, and the FlexGen policy's predicted throughput: how much better than FlexGen's
   choice the planner's is, by the same cost model.

The preset is not a measurement of that machine (its notes give the derating of each rate), so
part 1 tests the cost model and the preset together. No goal; compare the ratios.

    python benchmarks/flexgen_tables.py [--only 175b] [--requests 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from workloads import get_workload
from xprofiler.presets import load_profile
from xprofiler.profile import BandwidthCurve, HardwareProfile
from xprofiler.specs import get_model_spec
from xscheduler import SLA, plan_search
from xsimulator import Policy, SimResult, simulate

# (table, prompt, output, model, system, measured tokens/s, (gbs, nb, wg, wc, cg, cc, hg, hc) in percent)
# Tables 15-18 ("FlexGen" and "FlexGen (c)" rows) and Table 21 (page cache managed; 48 x 3 is
# OOM there for OPT-175B).
PUBLISHED = [
    ("15", 512, 32, "opt-6.7b", "FlexGen", 25.26, (2, 1, 100, 0, 100, 0, 100, 0)),
    ("15", 512, 32, "opt-30b", "FlexGen", 7.32, (48, 3, 20, 80, 0, 100, 0, 100)),
    ("15", 512, 32, "opt-175b", "FlexGen", 0.69, (32, 8, 0, 50, 0, 0, 0, 100)),
    ("15", 512, 32, "opt-6.7b", "FlexGen (c)", 29.12, (72, 1, 100, 0, 100, 0, 100, 0)),
    ("15", 512, 32, "opt-30b", "FlexGen (c)", 8.70, (16, 20, 20, 80, 0, 100, 100, 0)),
    ("15", 512, 32, "opt-175b", "FlexGen (c)", 1.12, (48, 3, 0, 100, 0, 100, 0, 100)),
    ("16", 1024, 32, "opt-6.7b", "FlexGen", 13.72, (1, 1, 100, 0, 100, 0, 100, 0)),
    ("16", 1024, 32, "opt-30b", "FlexGen", 3.50, (20, 4, 4, 96, 0, 100, 0, 100)),
    ("16", 1024, 32, "opt-175b", "FlexGen", 0.35, (12, 12, 0, 50, 0, 0, 0, 100)),
    ("16", 1024, 32, "opt-6.7b", "FlexGen (c)", 13.18, (28, 1, 100, 0, 100, 0, 100, 0)),
    ("16", 1024, 32, "opt-30b", "FlexGen (c)", 3.98, (20, 12, 0, 100, 0, 100, 0, 100)),
    ("16", 1024, 32, "opt-175b", "FlexGen (c)", 0.42, (12, 4, 0, 100, 0, 100, 0, 100)),
    ("17", 128, 128, "opt-6.7b", "FlexGen", 106.404, (7, 1, 100, 0, 100, 0, 100, 0)),
    ("17", 128, 128, "opt-30b", "FlexGen", 24.634, (32, 10, 25, 75, 0, 100, 100, 0)),
    ("17", 128, 128, "opt-175b", "FlexGen", 2.409, (64, 8, 0, 50, 0, 0, 0, 100)),
    ("17", 128, 128, "opt-6.7b", "FlexGen (c)", 92.568, (196, 1, 100, 0, 100, 0, 100, 0)),
    ("17", 128, 128, "opt-30b", "FlexGen (c)", 39.141, (128, 8, 25, 75, 0, 100, 0, 100)),
    ("17", 128, 128, "opt-175b", "FlexGen (c)", 4.264, (80, 3, 0, 100, 0, 100, 100, 0)),
    ("18", 512, 8, "opt-6.7b", "FlexGen", 16.425, (2, 1, 100, 0, 100, 0, 100, 0)),
    ("18", 512, 8, "opt-30b", "FlexGen", 3.938, (512, 8, 20, 80, 0, 100, 0, 100)),
    ("18", 512, 8, "opt-175b", "FlexGen", 0.451, (32, 8, 0, 50, 0, 0, 0, 100)),
    ("18", 512, 8, "opt-6.7b", "FlexGen (c)", 14.244, (76, 1, 100, 0, 100, 0, 100, 0)),
    ("18", 512, 8, "opt-30b", "FlexGen (c)", 4.019, (16, 36, 25, 75, 0, 100, 0, 100)),
    ("18", 512, 8, "opt-175b", "FlexGen (c)", 0.559, (48, 3, 0, 100, 0, 100, 0, 100)),
    ("21", 512, 32, "opt-30b", "FlexGen", 7.32, (48, 3, 20, 80, 0, 100, 0, 100)),
    ("21", 512, 32, "opt-30b", "FlexGen", 7.26, (48, 3, 0, 100, 0, 100, 0, 100)),
    ("21", 512, 32, "opt-30b", "FlexGen", 5.40, (48, 1, 20, 80, 0, 100, 0, 100)),
    ("21", 512, 32, "opt-30b", "FlexGen", 1.66, (32, 8, 0, 50, 0, 0, 0, 100)),
    ("21", 512, 32, "opt-175b", "FlexGen", 0.49, (32, 8, 0, 50, 0, 0, 0, 100)),
    ("21", 512, 32, "opt-30b", "FlexGen", 1.55, (32, 8, 0, 0, 0, 0, 0, 100)),
    ("21", 512, 32, "opt-175b", "FlexGen", 0.44, (32, 8, 0, 0, 0, 0, 0, 100)),
    ("21", 512, 32, "opt-30b", "FlexGen", 0.88, (32, 1, 0, 50, 0, 0, 0, 100)),
    ("21", 512, 32, "opt-175b", "FlexGen", 0.23, (32, 1, 0, 50, 0, 0, 0, 100)),
    ("21", 512, 32, "opt-30b", "FlexGen", 0.20, (1, 1, 20, 80, 100, 0, 100, 0)),
    ("21", 512, 32, "opt-30b", "FlexGen", 0.04, (1, 1, 0, 50, 100, 0, 100, 0)),
    ("21", 512, 32, "opt-175b", "FlexGen", 0.01, (1, 1, 0, 50, 100, 0, 100, 0)),
    ("21", 512, 32, "opt-30b", "FlexGen", 1.57, (8, 1, 0, 100, 100, 0, 100, 0)),
    ("21", 512, 32, "opt-30b", "FlexGen", 0.05, (2, 1, 0, 0, 100, 0, 100, 0)),
    ("21", 512, 32, "opt-175b", "FlexGen", 0.01, (2, 1, 0, 0, 100, 0, 100, 0)),
]


def flexgen_policy(system: str, knobs: tuple[int, ...]) -> Policy:
    """FlexGen's tuple as a Policy: percents to fractions, the rest on disk; the uncompressed
    system attends on the CPU wherever the cache is off the GPU (its CPU delegation), the
    compressed one keeps attention on the GPU (a 4-bit cache is read there)."""
    gbs, nb, wg, wc, cg, cc, hg, hc = knobs
    compressed = system.endswith("(c)")
    return Policy(gbs=gbs, nb=nb, wg=wg / 100, wc=wc / 100, wd=1 - (wg + wc) / 100,
                  cg=cg / 100, cc=cc / 100, cd=1 - (cg + cc) / 100, hg=hg / 100, hc=hc / 100, hd=1 - (hg + hc) / 100,
                  compress_weight=compressed, compress_cache=compressed, cpu_attention=not compressed and cg < 100)


# The preset's rates that its notes derive by judgment (the disk's are measured in FlexGen's Table 24),
# in groups that --fit scales by one factor each: more factors than these were not identified by
# the 25 rows (a free bmm_flops went to 11x the preset, past the T4's peak).
FITTED = {
    "gpu_flops": ("mm_flops", "bmm_flops"),
    "gpu_memory": ("mem_bytes_per_s",),
    "cpu": ("cpu_mm_flops", "cpu_bmm_flops", "cpu_mem_bytes_per_s"),
    "quantization": ("quant_bytes_per_s", "dequant_bytes_per_s"),
    "pcie": ("ctog", "gtoc"),
}
HOLDOUT_TABLES = ("17", "18")
# No rate above the T4's datasheet peak: 65 TFLOP/s fp16 (the preset's 0.4 of it), 320 GB/s GDDR6
# (0.8), PCIe 3.0 x16 15.75 GB/s (0.8); the host's rates are bounded by 4x the preset's.
MOST = {"gpu_flops": 1 / 0.4, "gpu_memory": 1 / 0.8, "cpu": 4.0, "quantization": 4.0, "pcie": 1 / 0.8}


def scaled_profile(base: HardwareProfile, factors: dict[str, float]) -> HardwareProfile:
    """``base`` with each FITTED group's rates multiplied by its factor."""
    changes = {}
    for group, f in factors.items():
        for name in FITTED[group]:
            rate = getattr(base, name)
            changes[name] = BandwidthCurve.flat(rate.large_bytes_per_s * f) if isinstance(rate, BandwidthCurve) \
                else rate * f
    return replace(base, **changes)


def priced(profile: HardwareProfile, row: tuple) -> SimResult:
    """The simulator's prediction for one published row: one block of the policy's rows, as FlexGen
    measured it."""
    _, prompt, output, model, system, _, knobs = row
    pol = flexgen_policy(system, knobs)
    return simulate(profile.model_for(get_model_spec(model)), profile, pol, get_workload(f"fixed:{prompt}:{output}"),
                    num_requests=pol.block_size)


def page_cache_helped(row: tuple) -> bool:
    """Tables 15-18's uncompressed OPT-175B runs read weights through the OS page cache (Table 21's
    note: 0.69 there against 0.49 with it managed); xsched always bypasses it."""
    return row[0] != "21" and row[3] == "opt-175b" and not row[4].endswith("(c)")


def fit(base: HardwareProfile, rows: list[tuple]) -> None:
    """Fit FITTED's factors to the rows outside HOLDOUT_TABLES (least squares on log ratios), then
    print the log-error on the held-out tables before and after."""
    from scipy.optimize import least_squares

    usable = [r for r in rows if not page_cache_helped(r)]
    train = [r for r in usable if r[0] not in HOLDOUT_TABLES]
    test = [r for r in usable if r[0] in HOLDOUT_TABLES]

    def errors(x: np.ndarray, subset: list[tuple]) -> np.ndarray:
        prof = scaled_profile(base, dict(zip(FITTED, np.exp(x))))
        return np.array([math.log(priced(prof, r).throughput_tokens_per_s / r[5]) for r in subset])

    t0 = time.perf_counter()
    top = np.log([MOST[g] for g in FITTED])
    got = least_squares(lambda x: errors(x, train), np.zeros(len(FITTED)), bounds=(np.full(len(FITTED), -math.log(16)),
                        top), diff_step=0.05)
    print(f"\nFit of {len(FITTED)} rate factors (groups of the preset's rates) on {len(train)} rows of Tables 15, 16 "
          f"and 21 ({time.perf_counter() - t0:.0f} s; uncompressed OPT-175B of Tables 15-18 left out: page cache):")
    for name, x in zip(FITTED, got.x):
        print(f"  {name:<13} x {math.exp(x):.3f}  ({', '.join(FITTED[name])})")
    for label, subset in (("fitted on", train), ("held out (Tables 17, 18)", test)):
        before, after = np.abs(errors(np.zeros(len(FITTED)), subset)), np.abs(errors(got.x, subset))
        print(f"  {label:<26} {len(subset):>2} rows: median |log ratio| {np.median(before):.3f} -> "
              f"{np.median(after):.3f} (x{math.exp(np.median(before)):.2f} -> x{math.exp(np.median(after)):.2f}), max "
              f"{before.max():.3f} -> {after.max():.3f}")


def knobs_text(p: Policy) -> str:
    pct = lambda x: f"{100 * x:.0f}"  # noqa: E731
    extra = "".join((" c" if p.compress_weight or p.compress_cache else "", " cpu-attn" if p.cpu_attention else ""))
    return (f"{p.gbs}x{p.nb} w{pct(p.wg)}/{pct(p.wc)} c{pct(p.cg)}/{pct(p.cc)} h{pct(p.hg)}/{pct(p.hc)}{extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="rows whose model contains this text (e.g. 175b)")
    ap.add_argument("--requests", type=int, default=2048, help="requests per planned job (default 2048)")
    ap.add_argument("--no-plan", action="store_true", help="part 1 only")
    ap.add_argument("--fit", action="store_true", help="also fit the preset's judged rates to Tables 15, 16 and 21 "
                    "and test them on Tables 17 and 18")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args()
    profile = load_profile("t4")
    rows = [r for r in PUBLISHED if args.only is None or args.only in r[3]]

    print(f"Part 1: FlexGen's published policies priced by the simulator on the {profile.name} preset")
    head = (f"{'table':<5} {'len':>8} {'model':<9} {'system':<12} {'policy':<36} {'measured':>9} {'predicted':>10} "
            f"{'ratio':>6} fits")
    print(head)
    print("-" * len(head))
    part1 = []
    for row in rows:
        table, prompt, output, model, system, measured, knobs = row
        pol = flexgen_policy(system, knobs)
        r = priced(profile, row)
        ratio = r.throughput_tokens_per_s / measured
        part1.append(dict(table=table, prompt=prompt, output=output, model=model, system=system, measured=measured,
                          policy=knobs_text(pol), predicted=r.throughput_tokens_per_s, ratio=ratio, fits=r.fits))
        print(f"{table:<5} {f'{prompt}+{output}':>8} {model:<9} {system:<12} {knobs_text(pol):<36} {measured:>9.3f} "
              f"{r.throughput_tokens_per_s:>10.3f} {ratio:>6.2f} {'yes' if r.fits else 'NO'}")
    print("-" * len(head))
    logs = [abs(math.log(p["ratio"])) for p in part1]
    within = lambda f: sum(1 / f <= p["ratio"] <= f for p in part1)  # noqa: E731
    print(f"predicted / measured: median {statistics.median(p['ratio'] for p in part1):.2f}, "
          f"within 1.25x {within(1.25)}/{len(part1)}, within 1.5x {within(1.5)}/{len(part1)}, "
          f"within 2x {within(2.0)}/{len(part1)}; geometric mean |error| {math.exp(statistics.mean(logs)) - 1:.0%}")

    part2 = []
    if not args.no_plan:
        print(f"\nPart 2: xsched's plan for each Table 15-18 setting (no latency bound, {args.requests} requests)")
        head2 = (f"{'table':<5} {'len':>8} {'model':<9} {'system':<12} {'FlexGen measured':>16} "
                 f"{'its policy predicted':>20} {'xsched plan':<40} {'predicted':>10} {'plan s':>7}")
        print(head2)
        print("-" * len(head2))
        for table, prompt, output, model, system, measured, knobs in rows:
            if table == "21":
                continue
            spec = get_model_spec(model)
            w = get_workload(f"fixed:{prompt}:{output}")
            theirs = simulate(profile.model_for(spec), profile, flexgen_policy(system, knobs), w,
                              num_requests=args.requests)
            t0 = time.perf_counter()
            plan = plan_search(spec, profile, w, SLA("p99", math.inf), num_requests=args.requests, margin=0.0,
                               compress="on" if system.endswith("(c)") else "off")
            took = time.perf_counter() - t0
            ours = plan.predicted.throughput_tokens_per_s
            part2.append(dict(table=table, prompt=prompt, output=output, model=model, system=system, measured=measured,
                              flexgen_policy_predicted=theirs.throughput_tokens_per_s, plan=knobs_text(plan.policy),
                              plan_predicted=ours, plan_s=took))
            print(f"{table:<5} {f'{prompt}+{output}':>8} {model:<9} {system:<12} {measured:>16.3f} "
                  f"{theirs.throughput_tokens_per_s:>20.3f} {knobs_text(plan.policy):<40} {ours:>10.3f} {took:>7.1f}")
        print("-" * len(head2))
        gain = [p["plan_predicted"] / p["flexgen_policy_predicted"] for p in part2]
        print(f"xsched's plan / FlexGen's policy, both priced by the simulator over the same job: median "
              f"{statistics.median(gain):.2f}x, range {min(gain):.2f}-{max(gain):.2f}x")
    if args.fit:
        fit(profile, rows)
    if args.json:
        print(json.dumps({"published": part1, "planned": part2}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
