"""``xsched plan``: the highest-throughput policy for a model, machine and workload under a latency SLA."""

from __future__ import annotations

import argparse
import math
import sys
import warnings

from xprofiler.profile import MAX_AUTO_MARGIN
from xsched.cli import (PREFIX_GROUPS_HELP, PREFIX_HELP, PREFIX_SHARE_HELP, SAMPLES_HELP, groups_arg, plan_requests,
                        prefix_arg, requests_arg, samples_arg, seed_arg, share_arg)

DEFAULT_PROFILE = "t4"
DEFAULT_MODEL = "opt-30b"
DEFAULT_WORKLOAD = "T"
DEFAULT_LATENCY_S = 3600.0
DEFAULT_REQUESTS = 2000  # xscheduler.planner.DEFAULT_REQUESTS; not imported, to keep start-up light


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="find the policy with the most tokens/s whose latency meets an SLA (the main job)",
        description="Search batch sizes, placement of weights / KV cache / activations over gpu, cpu and disk, "
                    "4-bit compression, CPU attention and the refill interval for the highest predicted "
                    "throughput whose request latency meets the bound. Placement comes from a linear program "
                    "per batch shape; the batch knobs from branch-and-bound over the simulator.")
    p.add_argument("--profile", default=None,
                   help=f"profile JSON from `xsched profile`, or a preset name (default: the {DEFAULT_PROFILE} preset)")
    p.add_argument("--model", default=None, help=f"model name (see `xsched models`), a model directory with "
                                                 f"config.json or a .gguf file (default {DEFAULT_MODEL})")
    p.add_argument("--workload", default=None,
                   help=f"preset S, T, G, C1, C2; fixed:PROMPT:OUTPUT; a JSONL/CSV of requests or a Workload JSON; "
                        f"@SCALE scales lengths (default {DEFAULT_WORKLOAD})")
    p.add_argument("--samples", type=samples_arg, default=None, metavar="N", help=SAMPLES_HELP)
    p.add_argument("--prefix-tokens", type=prefix_arg, default=None, metavar="N", help=PREFIX_HELP)
    p.add_argument("--prefix-groups", type=groups_arg, default=None, metavar="G", help=PREFIX_GROUPS_HELP)
    p.add_argument("--prefix-share", type=share_arg, default=None, metavar="FRACTION", help=PREFIX_SHARE_HELP)
    p.add_argument("--latency", type=float, default=None, metavar="SECONDS",
                   help=f"latency bound in seconds; 'inf' for pure throughput (default {DEFAULT_LATENCY_S:g})")
    p.add_argument("--sla", choices=("p99", "p99-length"), default="p99",
                   help="p99: 99%% of requests finish within the bound (default); p99-length: a request of the "
                        "workload's 99th-percentile output length does")
    p.add_argument("--margin", default="auto", metavar="auto|FRACTION",
                   help="fraction of the latency bound kept free for the real run being slower than predicted: "
                        "the search meets bound x (1 - margin). auto (default): derived from the run-to-run spread "
                        "and the remaining fit error that `xsched calibrate` recorded in the profile, 0 for a "
                        "profile without them; a number in [0, 1) overrides (0 = plan against the bound itself)")
    p.add_argument("--compress", choices=("auto", "on", "off"), default="auto",
                   help="4-bit group-wise compression of weights/KV cache: auto tries every combination "
                        "(default), on forces weights (and KV cache or CPU attention), off never")
    p.add_argument("--search", choices=("bnb", "exhaustive", "optuna"), default="bnb",
                   help="bnb: branch-and-bound (default); exhaustive: every point of the grid; optuna: TPE with "
                        "as many evaluations as branch-and-bound uses, a baseline to compare with (its plans "
                        "reached 0.87-0.93 of the best throughput on average in benchmarks/plan_quality.py, bnb's "
                        "1.00)")
    p.add_argument("--requests", type=requests_arg, default=None,
                   help="requests in the job the plan is priced on (default: as many as the --workload file held, "
                        f"else {DEFAULT_REQUESTS})")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the simulated request sample (default 0)")
    p.add_argument("--evaluator", choices=("discrete-event", "analytic"), default="discrete-event",
                   help="simulator path the search prices points with (the plan is always confirmed with the "
                        "discrete-event path)")
    p.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan (for `xsched run` / `xsched simulate --plan`)")
    p.add_argument("--frontier", metavar="PREFIX",
                   help="also write the latency-throughput Pareto frontier as PREFIX.csv and PREFIX.png")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_plan)

    r = sub.add_parser(
        "replan", help="test observed lengths against a plan's workload; re-plan for the same SLA if they drifted",
        description="Read the lengths a job observed (the results JSONL of `xsched run`, or a JSONL/CSV with "
                    "prompt_tokens and output_tokens per request, in the order observed), test them against the "
                    "plan's workload (CUSUMs of the mean, KS tests on the whole file and recent windows, "
                    "prompt and output), and "
                    "when they drifted, search a new plan for the same model, profile and SLA. Prints the tests, "
                    "what the old plan gives under the observed workload and what the new one changes.")
    r.add_argument("--plan", required=True, metavar="PLAN.json", help="plan JSON written by `xsched plan`")
    r.add_argument("--observed", required=True, metavar="RESULTS.jsonl|LENGTHS.csv",
                   help="observed requests: prompt_tokens and output_tokens each (stopped_on_eos: false marks an "
                        "output cut at max_new_tokens)")
    r.add_argument("--profile", default=None,
                   help="the profile the plan was priced on (default: the plan's preset; needed for measured ones)")
    r.add_argument("--false-alarm-rate", type=float, default=0.005,
                   help="probability of reporting drift when there is none (default 0.005)")
    r.add_argument("--compress", choices=("auto", "on", "off"), default="auto",
                   help="compression choices of the new search, as in `xsched plan` (default auto)")
    r.add_argument("--scope", choices=("full", "local"), default="full",
                   help="full (default): any compression; local: keep the plan's weight compression")
    r.add_argument("--search", choices=("warm", "bnb"), default="warm",
                   help="warm (default): climb from the plan's policy (fast); bnb: the whole branch-and-bound")
    r.add_argument("--requests", type=requests_arg, default=None,
                   help="job size to price the old and new plans on (default: the plan's own, as planned)")
    r.add_argument("-o", "--output", metavar="NEW_PLAN.json", help="write the new plan here (only when it changed)")
    r.add_argument("--json", action="store_true", help="print the Replan record as JSON")
    r.set_defaults(handler=_replan)


def _replan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from workloads.workload import context_note
    from xscheduler.plan import Plan
    from xsched.fileio import check_writable, file_or_none, separate_files
    from xscheduler.replan import read_observed, replan

    if args.output is not None:
        check_writable(args.output, "-o")  # before the search, not after it
    # -o on --plan is allowed: the new plan replaces the old one
    separate_files([("-o", args.output)], [("--observed", args.observed), ("--profile", file_or_none(args.profile))])
    plan = Plan.load(args.plan)
    if args.requests is None:  # the old and new plans are priced on the plan's own job
        plan_requests(plan.predicted.num_requests, args.plan)
    prompts, outputs, capped, first = read_observed(Path(args.observed), plan.model.name)
    longest = int(max(prompts) + max(outputs)) if len(prompts) else 0
    if (beyond := context_note("the observed requests'", longest, plan.model.name, plan.model.max_positions)):
        print(f"xsched: note: {beyond}", file=sys.stderr)  # as `plan` and `simulate` say of a workload
    result = replan(plan, prompts, outputs, capped, first, profile=args.profile, false_alarm_rate=args.false_alarm_rate,
                    compress=args.compress, scope=args.scope, method=args.search, num_requests=args.requests)
    if args.output and result.new_plan is not None:
        result.new_plan.save(args.output)
    print(result.to_json() if args.json else result.describe())
    if args.output:
        print(f"wrote {args.output}" if result.new_plan is not None else f"no new plan; {args.output} not written",
              file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from workloads import get_workload
    from workloads.workload import ESTIMATE_NOTE, with_samples, workload_file
    from xprofiler.presets import load_profile
    from xprofiler.specs import get_model_spec
    from xsched.errors import UserError
    from xsched.fileio import atomic_write_all, check_writable, file_or_none, separate_files
    from xscheduler.plan import SLA
    from xscheduler.planner import SLAUnreachable, plan_search

    assumed = []
    if args.profile is None:
        assumed.append(f"no --profile given; using the {DEFAULT_PROFILE} preset (FlexGen's T4 machine); "
                       f"measure yours with `xsched profile`")
    if args.model is None:
        assumed.append(f"no --model given; planning {DEFAULT_MODEL}")
    if args.workload is None:
        assumed.append(f"no --workload given; using preset {DEFAULT_WORKLOAD} (ExeGPT translation lengths)")
    if args.latency is None:
        assumed.append(f"no --latency given; bounding {args.sla} latency at {DEFAULT_LATENCY_S:g} s")
    latency = DEFAULT_LATENCY_S if args.latency is None else args.latency
    if not latency > 0 or math.isnan(latency):
        raise UserError(f"--latency must be a positive number of seconds (or inf), got {latency:g}")
    if args.frontier is not None and (not Path(args.frontier).name or Path(args.frontier).is_dir()):
        raise UserError(f"--frontier takes a file prefix (PREFIX.csv and PREFIX.png are written), not a directory: "
                        f"{args.frontier!r}")
    frontier = (None, None) if args.frontier is None else (f"{args.frontier}.csv", f"{args.frontier}.png")
    separate_files([("-o", args.output), ("--frontier (.csv)", frontier[0]), ("--frontier (.png)", frontier[1])],
                   [("--profile", file_or_none(args.profile)), ("--workload", workload_file(args.workload or ""))])
    for path, flag in ((args.output, "-o"), (frontier[0], "--frontier"), (frontier[1], "--frontier")):
        if path is not None:  # before the search, which can take minutes
            check_writable(path, flag)
    profile = load_profile(args.profile or DEFAULT_PROFILE)
    spec = profile.model_for(get_model_spec(args.model or DEFAULT_MODEL))
    workload = with_samples(get_workload(args.workload or DEFAULT_WORKLOAD), args.samples, args.prefix_tokens,
                            args.prefix_groups, args.prefix_share)
    if args.requests is None:  # the job the workload was read from, as `run` will run it
        args.requests = workload.file_requests or DEFAULT_REQUESTS
        if workload.file_requests:
            assumed.append(f"no --requests given; pricing the {args.requests:,} requests the workload was read from "
                           "(--requests N for a job of another size)")
    if ESTIMATE_NOTE in workload.source:
        assumed.append(f"workload {workload.source}")
    caveats = workload.caveats(spec.name, spec.max_positions)
    if workload.prompt.min_len + workload.output.min_len <= spec.max_positions:  # (else plan_search refuses it)
        for caveat in caveats:  # now, not after a search that can take minutes (the plan's notes repeat them)
            warnings.warn(caveat, UserWarning, stacklevel=1)
    if (unfitted := profile.unfitted_note(spec)) is not None:
        assumed.append(unfitted)
    try:
        sla = SLA(args.sla, latency)
    except ValueError as exc:
        raise UserError(f"{exc}; give a positive --latency") from None
    progress = not args.quiet and sys.stderr.isatty()
    try:
        plan = plan_search(spec, profile, workload, sla, compress=args.compress, method=args.search,
                           num_requests=args.requests, seed=args.seed, evaluator=args.evaluator, progress=progress,
                           margin=args.margin)
    except SLAUnreachable as exc:
        if not args.frontier:
            raise
        # the frontier is most use exactly here: what each latency buys
        atomic_write_all(_frontier_files(args.frontier, spec, profile, workload, sla, args, progress))
        raise UserError(f"{exc}; {args.frontier}.csv and .png show the throughput each latency reaches") from None
    outputs = [(args.output, plan.file_bytes())] if args.output else []
    if args.frontier:
        outputs += _frontier_files(args.frontier, spec, profile, workload, sla, args, progress)
    atomic_write_all(outputs)  # all or none: a full disk on the last leaves the earlier ones as they were
    if args.json:
        print(plan.to_json())
    else:
        print(describe(plan))
    for line in assumed:
        print(f"note: {line}", file=sys.stderr if args.json else sys.stdout)
    for path, _ in outputs:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _seconds(value: float) -> str:
    """Four significant figures, never in exponent form (``1.432e+04 s`` stood beside ``5,366 s``)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def describe(plan) -> str:  # noqa: ANN001
    """The plan for a reader: the policy in words, the prediction, the SLA's slack, the search."""
    r, sla, s = plan.predicted, plan.sla, plan.search
    gib = 2.0**30
    lat = r.latency_s(sla.kind)
    bound = "unbounded" if math.isinf(sla.latency_s) else f"{sla.latency_s:,.6g} s"
    margin = {"calibration": "derived from the profile's calibration runs", "user": "set with --margin",
              "none": "the profile records no calibration error"}[plan.margin_source]
    if plan.margin_source == "calibration" and plan.margin >= MAX_AUTO_MARGIN:
        margin += (", capped: the calibration's error is 100% or more, so the predictions are not to be trusted; "
                   "calibrate again (`xsched calibrate`) or set --margin")
    lines = [
        f"plan for {plan.model.name} ({plan.model.dtype}) on profile {plan.profile_name} ({plan.profile_source}), "
        f"workload {plan.workload.name}, {r.num_requests:,} request" + ("s" if r.num_requests != 1 else "")
        + (f" ({plan.workload.samples} per prompt, prefilled once per GPU batch)" if plan.workload.samples > 1
           else "")
        + (f" (a shared {plan.workload.prefix_tokens}-token prefix"
           + (f", one of {plan.workload.prefix_groups}" if plan.workload.prefix_groups > 1 else "")
           + (f", before {plan.workload.prefix_share:.0%} of the prompts" if plan.workload.prefix_share < 1 else "")
           + ", prefilled once per run)" if plan.workload.prefix_tokens else ""),
        "policy:",
        *("  " + line for line in plan.policy.describe().splitlines()),
        f"predicted ({r.method}, seed {r.seed}): {r.throughput_tokens_per_s:,.3f} generated tokens/s "
        f"(total {r.total_throughput_tokens_per_s:,.3f}), job wall {_seconds(r.wall_s)} s",
        f"latency (a request's prefill start to its last token): {sla.kind} {lat:,.6g} s "
        + ("(no bound)" if math.isinf(sla.latency_s) else f"against a bound of {bound}")
        + ("" if math.isinf(sla.latency_s) else f" ({plan.slack:.1%} of the bound unused)")
        + f"; p50 {_seconds(r.latency_p50_s)} s, max {_seconds(r.latency_max_s)} s",
        f"planning margin: {plan.margin:.1%} ({margin}); searched against {sla.kind} <= "
        + ("unbounded" if math.isinf(sla.latency_s) else f"{plan.planning_latency_s:,.6g} s"),
        "peak memory: " + ", ".join(f"{t} {r.peak_bytes[t] / gib:,.2f} of {r.capacity_bytes[t] / gib:,.2f} GiB"
                                    for t in ("gpu", "cpu", "disk")),
    ]
    if plan.confirmations:
        # (the mean too: where prompts share prefixes a settled plan's seed-0 draw sits below it)
        draws = [r.throughput_tokens_per_s, *(c.throughput_tokens_per_s for c in plan.confirmations)]
        lines.append("re-simulated on other request samples: " + "; ".join(
            f"seed {c.seed}: {c.throughput_tokens_per_s:,.3f} tokens/s, {sla.kind} {c.latency_s:,.6g} s"
            + ("" if c.meets_sla else " (over the bound)") for c in plan.confirmations)
            + f"; mean of the {len(draws)} draws {sum(draws) / len(draws):,.3f} tokens/s")
    lines.append(f"search: {s.method}, {s.evaluations} simulator evaluations in a {s.grid_points}-point knob grid, "
                 f"{s.lp_solves} placement LPs, {s.wall_s:,.1f} s (searched with the {plan.searched_with} path)")
    warned = plan.workload.caveats(plan.model.name, plan.model.max_positions)  # (warned of before the search)
    lines += [f"note: {n}" for n in plan.notes if n not in warned]
    return "\n".join(lines)


def _frontier_files(prefix: str, spec, profile, workload, sla, args,  # noqa: ANN001
                    progress: bool) -> list[tuple[str, bytes]]:
    """The frontier's CSV and PNG (paths and contents)."""
    import csv
    import io

    from xscheduler.planner import frontier

    points = frontier(spec, profile, workload, sla.kind, compress=args.compress, num_requests=args.requests,
                      seed=args.seed, evaluator=args.evaluator, progress=progress)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([f"latency_{sla.kind}_s", "throughput_tokens_per_s", "gbs", "nb", "refill_every", "compress_weight",
                "compress_cache", "cpu_attention", "wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd"])
    for pt in points:
        pol = pt.evaluation.policy
        w.writerow([f"{pt.latency_s:.9g}", f"{pt.throughput_tokens_per_s:.9g}", pol.gbs, pol.nb, pol.refill_every,
                    int(pol.compress_weight), int(pol.compress_cache), int(pol.cpu_attention),
                    *(f"{v:.6g}" for v in pol.placement().values())])
    csv_path, png_path = f"{prefix}.csv", f"{prefix}.png"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.step([p.latency_s for p in points], [p.throughput_tokens_per_s for p in points], where="post", marker="o")
    if not math.isinf(sla.latency_s):
        ax.axvline(sla.latency_s, color="grey", linestyle="--", label=f"bound {sla.latency_s:g} s")
        ax.legend()
    ax.set_xscale("log")
    ax.set_xlabel(f"{sla.kind} latency (s)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{spec.name} on {profile.name}, workload {workload.name}")
    ax.grid(True, alpha=0.3)
    out = io.BytesIO()
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)
    return [(csv_path, buf.getvalue().encode()), (png_path, out.getvalue())]
