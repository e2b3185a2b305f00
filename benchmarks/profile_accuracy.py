"""How well do the profiler's per-layer fits predict layer times they did not measure?

1. Runs the real ``xsched profile --quick --model M`` (a subprocess, as a user would) and
   reports its wall time (goal <= 180 s on the project's 2-core machine).
2. Times one decoder layer (the runner's ``layer_forward``) on the quick profile's coarse grid
   AND on held-out points between its nodes, all in the same interleaved passes (so a change
   in the machine's load hits both sets alike), fits on the coarse grid only, and compares the
   fit's predictions with the held-out measurements. Goal: median error <= 5%, max <= 15%.

Both summaries of the repeated samples are evaluated from the same samples: ``median`` (the
profiler's default) and ``min`` (``--stat min``). The load that other processes put on the
machine meanwhile is printed, since on a shared host it dominates the error.

    .venv/bin/python benchmarks/profile_accuracy.py [--model smollm2-135m] [--passes 7] [--skip-cli]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from xprofiler.bench import Timer, gemm_point, gemv_point
from xprofiler.samples import rate, run_points
from xprofiler.fit import fit_layer, relative_errors
from xprofiler.measure import LoadMeter
from xprofiler.sweeps import QUICK_GRIDS, Grid, estimate_s, layer_points, point_times, resolve_spec, sample_counts

# Held-out points: between the quick grid's nodes (see xprofiler.sweeps.QUICK_GRIDS), inside its
# trimmed prefill rectangle (batch x length <= its max_tokens). 96 and 192 rows of 32-token
# prompts are the prefill an offloading plan runs (192 x 32: benchmarks/offload_vs_accelerate.py).
HELD_OUT = {
    "prefill": Grid((3, 6, 12, 24, 96, 192), (32, 128, 384), max_tokens=6144),
    "decode": Grid((5, 10, 20, 40, 80, 160), (256, 1024), max_tokens=131072),
}


def run_cli_quick(model: str, offload_dir: Path, threads: int | None) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "quick.json"
        t0 = time.monotonic()
        extra = ["--threads", str(threads)] if threads else []
        subprocess.run([sys.executable, "-m", "xsched", "profile", "--quick", "--quiet", "--model", model,
                        "--offload-dir", str(offload_dir), "-o", str(out), *extra], check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.monotonic() - t0
        return wall, json.loads(out.read_text())


def machine_rates(device) -> tuple[float, float]:
    """GEMM rate and memory roof, to size the samples as the profiler does."""
    import torch

    pts = [gemm_point("mm", device, torch.float32, 256, 1024, 4096),
           gemv_point("mem", device, torch.float32, 64 * 2**20, 1024)]
    rows = run_points(pts, Timer(device), passes=3)
    return rate(rows, "mm"), rate(rows, "mem", unit="bytes")


def accuracy(model: str, passes: int, compare_prefill_rows: int | None = None) -> dict:
    import torch

    spec = resolve_spec(model).with_dtype("float32")  # the dtype it times in: byte features count in it
    device = torch.device("cpu")
    results: dict = {"model": spec.name, "passes": passes, "phases": {}}
    meter = LoadMeter()
    flops, mem = machine_rates(device)
    for phase, grid in QUICK_GRIDS.items():
        train = grid.points(spec.max_positions)
        held = HELD_OUT[phase].points(spec.max_positions)
        counts = sample_counts({p: estimate_s(spec, phase, *p, flops, mem, 4) for p in train + held})
        points = layer_points(spec, phase, counts, device, "float32")
        rows = run_points(points, Timer(device), passes=passes, warmup=1, seed=1)
        is_held = {f"{b}x{n}" for b, n in held}
        train_rows = [r for r in rows if r["shape"] not in is_held]
        held_rows = [r for r in rows if r["shape"] in is_held]
        per_stat = {}
        stats = [("median", None), ("min", None)]
        if compare_prefill_rows and phase == "prefill":  # the same samples, the grid of an earlier stop
            stats.append(("median", compare_prefill_rows))
        for stat, max_batch in stats:
            b, n, t = point_times(train_rows, spec.name, phase, stat)
            if max_batch:
                keep = b <= max_batch
                b, n, t = b[keep], n[keep], t[keep]
            fit = fit_layer(spec, phase, b, n, t, model=spec.name, dtype="float32")
            hb_, hn_, ht = point_times(held_rows, spec.name, phase, stat)
            pred = fit.predict_s(spec, hb_, hn_)
            err = relative_errors(pred, ht)
            lin_err = relative_errors(fit.linear_s(spec, hb_, hn_), ht)
            per_stat[stat if max_batch is None else f"{stat}, to {max_batch} rows"] = {
                "median_rel_error": float(np.median(err)), "max_rel_error": float(np.max(err)),
                "linear_only_median": float(np.median(lin_err)), "linear_only_max": float(np.max(lin_err)),
                "points": [{"batch": int(x), "length": int(y), "measured_s": float(m), "predicted_s": float(p)}
                           for x, y, m, p in zip(hb_, hn_, ht, pred)],
            }
        results["phases"][phase] = per_stat
    results["other_processes_cores"] = meter.others_cores()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--passes", type=int, default=15, help="interleaved passes (the quick profile uses up to 15)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--offload-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--skip-cli", action="store_true", help="skip the timed `xsched profile --quick` run")
    ap.add_argument("--compare-prefill-rows", type=int, default=None, metavar="N",
                    help="also fit the prefill on the grid's points of at most N rows (the same samples; "
                         "32: the quick grid before stop 34) and report it")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict = {"threads": torch.get_num_threads()}
    if not args.skip_cli:
        meter = LoadMeter()
        wall, prof = run_cli_quick(args.model, args.offload_dir, args.threads)
        report["quick_profile"] = {"wall_s": wall, "goal_s": 180, "profile_wall_s": prof["wall_s"],
                                   "other_processes_cores": meter.others_cores()}
    report["accuracy"] = accuracy(args.model, args.passes, args.compare_prefill_rows)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if "quick_profile" in report:
        q = report["quick_profile"]
        print(f"xsched profile --quick --model {args.model}: {q['wall_s']:.1f} s wall (goal <= 180 s); "
              f"other processes kept {q['other_processes_cores']:.2f} cores busy")
    acc = report["accuracy"]
    print(f"held-out accuracy, {acc['model']}, {report['threads']} threads, {acc['passes']} interleaved passes; "
          f"other processes kept "
          f"{acc['other_processes_cores']:.2f} cores busy")
    print(f"{'phase':<8} {'stat':<18} {'median err':>10} {'max err':>8}  {'linear only med/max':>20}  goal 5% / 15%")
    for phase, per_stat in acc["phases"].items():
        for stat, r in per_stat.items():
            print(f"{phase:<8} {stat:<18} {r['median_rel_error']:>10.1%} {r['max_rel_error']:>8.1%}  "
                  f"{r['linear_only_median']:>9.1%} / {r['linear_only_max']:<8.1%}")
    for phase, per_stat in acc["phases"].items():
        for stat in (s for s in per_stat if s.startswith("median")):
            print(f"{phase} held-out points ({stat}): " + ", ".join(
                f"{p['batch']}x{p['length']} {p['measured_s'] * 1e3:.2f}ms "
                f"{p['predicted_s'] / p['measured_s'] - 1:+.0%}" for p in per_stat[stat]["points"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
