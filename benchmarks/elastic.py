"""A memory budget cut by 30% mid-job: what the reconfiguration moves and costs vs a full rebuild.

An OPT-shaped random model (default 8 layers, hidden 1024: ~400 MB of decoder layers + ~200 MB
embeddings in fp32) is saved as a safetensors directory (``offload_vs_accelerate.make_model_dir``),
so a full reload really reads it from the disk (page cache dropped first). The job is planned by
``plan_search`` under a gpu-tier budget of ``--gpu-fraction`` of the model's bytes; at the second
block boundary a ``CallbackBudget`` cuts the gpu-tier budget by ``--cut`` and ``budget_hook``
re-plans with ``plan_search`` under the new capacity; the engine drains, reconfigures and goes on.

Printed: planned/measured peak per tier before the cut (vs the old budget), after it (measured
since the change, vs the new budget) and during the change itself; bytes the change copied per
channel, re-read from slower tiers or the source, vs a full reload (every weight byte from the
model files); the stall of the change vs the time to build a new Engine for the new policy from
the files (what re-planning without reconfigure costs, before any prefill).

The block is capped at ``--max-block`` rows (the planner, with no latency bound, holds the whole job in one
block, which leaves no boundary to change at). The planner prices points with the t4 preset's rates made a CPU host (``--profile`` to change):
only its memory terms matter for what fits, and those are the engine's exact buffers.

    OMP_NUM_THREADS=1 python benchmarks/elastic.py [--layers 8 --hidden 1024 --requests 96 --max-block 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from offload_vs_accelerate import bench_spec, drop_page_cache, make_model_dir  # noqa: E402

TIERS = ("gpu", "cpu", "disk")
SLOWER = {("cpu", "gpu"), ("disk", "gpu"), ("disk", "cpu")}  # moves that read a slower tier


def mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def capped(policy, max_block: int):
    """The policy with its block cut to at most ``max_block`` rows (fewer rows never need more memory),
    so the job has several blocks and therefore boundaries where the budget can change."""
    gbs = min(policy.gbs, max_block)
    return replace(policy, gbs=gbs, nb=max(1, min(policy.nb, max_block // gbs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/xsched-bench-elastic"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-block", type=int, default=32,
                    help="cap on the planned block (rows); the planner would hold the whole job in one block")
    ap.add_argument("--gpu-fraction", type=float, default=0.8, help="gpu-tier budget / model bytes at the start")
    ap.add_argument("--cpu-gib", type=float, default=4.0, help="cpu-tier budget")
    ap.add_argument("--cut", type=float, default=0.3, help="fraction of the gpu-tier budget removed mid-job")
    ap.add_argument("--profile", default="t4")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from workloads.workload import fixed_workload
    from xprofiler.presets import load_profile
    from xrunner.budget import CallbackBudget, budget_hook, plan_fn_for
    from xrunner.engine import Engine, Request
    from xrunner.loaders import HFDirectorySource
    from xscheduler.plan import SLA
    from xscheduler.planner import plan_search

    torch.manual_seed(0)
    spec = bench_spec(args)
    model_dir = args.workdir / f"opt-{args.layers}x{args.hidden}"
    t0 = time.perf_counter()
    make_model_dir(spec, model_dir)
    print(f"model dir ready in {time.perf_counter() - t0:.1f} s: {model_dir}", file=sys.stderr)
    source = HFDirectorySource(model_dir)
    spec = source.spec
    profile = replace(load_profile(args.profile), compute_device="cpu", compute_dtype="float32")
    workload = fixed_workload(args.prompt_len, args.new_tokens)
    sla = SLA("p99", float("inf"))  # throughput only
    model_bytes = spec.weight_bytes
    start = {"gpu": args.gpu_fraction * model_bytes, "cpu": args.cpu_gib * 2**30}
    cut = {"gpu": (1 - args.cut) * start["gpu"]}
    search = dict(compress="off", num_requests=args.requests, confirm_seeds=())
    plan = plan_search(spec, replace(profile, gpu_bytes=int(start["gpu"]), cpu_bytes=int(start["cpu"])), workload,
                       sla, **search)
    plan = replace(plan, policy=capped(plan.policy, args.max_block))
    print("initial plan:", plan.policy.describe().replace("\n", "; "), file=sys.stderr)
    polls = []

    def budget():
        polls.append(1)
        return cut if len(polls) == 2 else None

    replan = plan_fn_for(plan, profile, **search)
    hook = budget_hook(CallbackBudget(budget), lambda caps: capped(replan(caps), args.max_block),
                       capacity_bytes=start)
    reqs = [Request(f"r{i}", tuple(int(x) for x in torch.randint(4, spec.vocab_size, (args.prompt_len,))),
                    args.new_tokens) for i in range(args.requests)]
    done: list[str] = []
    offload = Path(tempfile.mkdtemp(prefix="elastic-", dir=args.workdir))
    with Engine(source, plan.policy, max_prompt=args.prompt_len, max_output=args.new_tokens, capacity_bytes=start,
                offload_dir=offload, profile=profile) as eng:
        planned_before = dict(eng.planned_peak_bytes)
        layer_bytes = eng.layout.nbytes
        stats = eng.run(reqs, on_finished=lambda fs: done.extend(f.id for f in fs), between_blocks=hook)
    if len(stats.reconfigurations) != 1:
        raise SystemExit(f"expected one reconfiguration, got {len(stats.reconfigurations)}")
    rec = stats.reconfigurations[0]
    assert sorted(done) == sorted(r.id for r in reqs), "requests lost or duplicated"
    peak_before = rec.peak_before_bytes  # measured under the old policy, up to the change

    # A full rebuild for the new policy: a new Engine reading every weight from the model files.
    drop_page_cache(model_dir)
    t0 = time.perf_counter()
    with Engine(source, rec.new_policy, max_prompt=args.prompt_len, max_output=args.new_tokens,
                capacity_bytes=rec.capacity_bytes, offload_dir=offload, profile=profile):
        rebuild_s = time.perf_counter() - t0
    full_reload_bytes = spec.num_layers * layer_bytes + spec.head_weight_bytes
    moved = sum(rec.moved_bytes.values())
    from_slower = sum(b for ch, b in rec.moved_bytes.items() if tuple(ch.split("->")) in SLOWER) + rec.reloaded_bytes

    out = {
        "model": {"layers": spec.num_layers, "hidden": spec.hidden, "model_bytes": model_bytes},
        "budget_before": start, "budget_after": rec.capacity_bytes,
        "policy_before": rec.old_policy.describe().replace("\n", "; "),
        "policy_after": rec.new_policy.describe().replace("\n", "; "),
        "planned_peak_before": planned_before, "planned_peak_after": rec.planned_peak_bytes,
        "measured_peak_before_change": peak_before, "measured_peak_since_change": stats.peak_bytes_since_change,
        "measured_peak_during_change": rec.transition_peak_bytes, "freed_bytes": rec.freed_bytes,
        "moved_bytes": rec.moved_bytes, "read_from_slower_tiers_or_source_bytes": from_slower,
        "full_reload_bytes": full_reload_bytes, "stall_s": rec.stall_s, "full_rebuild_s": rebuild_s,
        "job_wall_s": stats.wall_s, "generated_tokens": stats.generated_tokens, "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"model: {spec.num_layers} layers x hidden {spec.hidden}, {mib(model_bytes)} MiB (fp32); "
          f"{args.requests} requests of {args.prompt_len}+{args.new_tokens} tokens; torch threads {out['threads']}")
    print(f"before: {out['policy_before']}\nafter:  {out['policy_after']}\nreason: {rec.reason}\n")
    print(f"{'tier':5} {'budget before':>14} {'peak before':>12} {'budget after':>13} {'planned after':>14} "
          f"{'peak after':>11} {'peak during':>12} {'freed':>8}   (MiB)")
    for t in TIERS:
        b0 = start.get(t, float("nan"))
        b1 = rec.capacity_bytes.get(t, float("nan")) if rec.capacity_bytes else float("nan")
        print(f"{t:5} {mib(b0):>14} {mib(peak_before[t]):>12} {mib(b1):>13} {mib(rec.planned_peak_bytes[t]):>14} "
              f"{mib(stats.peak_bytes_since_change[t]):>11} {mib(rec.transition_peak_bytes[t]):>12} "
              f"{mib(rec.freed_bytes[t]):>8}")
    print("* peak during the change starts at the live bytes when it begins (the old policy's buffers, freed first)")
    print()
    print(f"copied by the change: {', '.join(f'{k} {mib(v)} MiB' for k, v in rec.moved_bytes.items()) or 'nothing'} "
          f"(total {mib(moved)} MiB)")
    print(f"read from slower tiers or the source: {mib(from_slower)} MiB vs full reload {mib(full_reload_bytes)} MiB "
          f"({from_slower / full_reload_bytes:.3f})")
    print(f"stall of the change: {rec.stall_s:.3f} s vs full rebuild (new Engine from the files, cache dropped): "
          f"{rebuild_s:.3f} s ({rec.stall_s / rebuild_s:.3f})")
    print(f"job: {stats.wall_s:.1f} s, {stats.generated_tokens} tokens")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
