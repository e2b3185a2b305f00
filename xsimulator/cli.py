"""``xsched simulate``: predict what a policy does on a machine, model and workload."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from xsched.cli import (PREFIX_GROUPS_HELP, PREFIX_HELP, PREFIX_SHARE_HELP, SAMPLES_HELP, groups_arg, plan_requests,
                        prefix_arg, requests_arg, samples_arg, seed_arg, share_arg)
from xsched.fileio import json_error_text, path_exists, read_text

DEFAULT_PROFILE = "t4"
DEFAULT_REQUESTS = 2000  # xsimulator.discrete_event.DEFAULT_REQUESTS; not imported here to keep start-up light
PLAN_SCHEMA = "xsched.Plan/1"  # xscheduler.plan.Plan.SCHEMA; not imported: the simulator comes before the scheduler


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="predict throughput, latency percentiles, peak memory and the timeline of a policy",
        description="Simulate a policy (batch sizes, placement, compression, refill) on a machine profile, a model "
                    "and a workload of prompt/output lengths. Prints predicted throughput, request latency "
                    "percentiles, peak bytes per tier and where the time goes.")
    p.add_argument("--profile", default=None,
                   help=f"profile JSON from `xsched profile`, or a preset name (default: a --plan's own preset "
                        f"profile, else the {DEFAULT_PROFILE} preset)")
    p.add_argument("--model", help="model name (see `xsched models`), a model directory with config.json or a "
                                   ".gguf file")
    p.add_argument("--workload", help="preset S, T, G, C1, C2; fixed:PROMPT:OUTPUT; or a JSONL/CSV of requests or a "
                                      "Workload JSON; append @SCALE to scale all lengths (e.g. T@0.25)")
    p.add_argument("--samples", type=samples_arg, default=None, metavar="N", help=SAMPLES_HELP)
    p.add_argument("--prefix-tokens", type=prefix_arg, default=None, metavar="N", help=PREFIX_HELP)
    p.add_argument("--prefix-groups", type=groups_arg, default=None, metavar="G", help=PREFIX_GROUPS_HELP)
    p.add_argument("--prefix-share", type=share_arg, default=None, metavar="FRACTION", help=PREFIX_SHARE_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--policy", help="policy as JSON text or a JSON file, e.g. '{\"gbs\": 8, \"nb\": 4, \"wg\": 0.5, "
                                      "\"wc\": 0.5, \"wd\": 0}' (fractions 0..1; gbs and nb are required, the "
                                      "others default to all on the gpu tier, no compression, no refill)")
    src.add_argument("--plan", help="plan JSON from `xsched plan`: its policy, and its model and workload unless given")
    p.add_argument("--requests", type=requests_arg, default=None,
                   help="requests to sample from the workload (default: a --plan's own, else as many as the --workload "
                        f"file held, else {DEFAULT_REQUESTS})")
    p.add_argument("--seed", type=seed_arg, default=None,
                   help="seed of the request sample (default: a --plan's own, else 0)")
    p.add_argument("--method", choices=("discrete-event", "analytic"), default="discrete-event",
                   help="discrete-event (default) samples requests and simulates every step; analytic uses "
                        "expected batch shapes from the length distributions (faster, approximate)")
    p.add_argument("--trace", metavar="OUT.json", help="write the simulated timeline as a Chrome trace (Perfetto)")
    p.add_argument("-o", "--output", metavar="RESULT.json", help="also write the SimResult JSON to this file")
    p.add_argument("--json", action="store_true", help="print the SimResult as JSON")
    p.set_defaults(handler=_simulate)


def _read_json_arg(text: str, what: str) -> Any:
    """JSON given inline or as a file path."""
    from xsched.errors import UserError

    path = Path(text)
    inline = text.lstrip().startswith(("{", "["))
    if not inline and path_exists(path):
        text = read_text(path, what=f"{what} file")
    elif not inline:
        raise UserError(f"{what} {text!r} is neither JSON text nor an existing file")
    if not inline:
        what = f"{path}: {what}"  # (name the file the error is in)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise UserError(f"{what} is nested too deeply to be a JSON object of settings") from None
    except ValueError as exc:  # an integer literal past Python's 4300 digits
        raise UserError(f"{what} is not valid JSON ({json_error_text(exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} must be a JSON object")
    return data


def _profile_arg(given: str | None, plan: dict[str, Any], plan_path: str | None, notes: list[str]) -> str:
    """``--profile`` if given; else the plan's own profile (a plan is priced on one machine, so
    simulating it on another by default would silently change every number); else the default."""
    from xprofiler.presets import preset_names
    from xsched.errors import UserError

    if given is not None:
        return given
    name, source = plan.get("profile_name"), plan.get("profile_source")
    if not plan or not isinstance(name, str):
        notes.append(f"note: no --profile given; using the {DEFAULT_PROFILE} preset")
        return DEFAULT_PROFILE
    if source == "preset" and name in preset_names():
        notes.append(f"note: no --profile given; using the plan's profile, the {name} preset")
        return name
    raise UserError(f"{plan_path}: the plan was made with the {source} profile {name!r}, which the plan does not "
                    f"contain and which is not a preset; pass --profile with that profile's JSON file")


def _simulate(args: argparse.Namespace) -> int:
    from workloads import Workload, get_workload
    from workloads.workload import ESTIMATE_NOTE, with_samples, workload_file
    from xprofiler.presets import load_profile
    from xprofiler.specs import ModelSpec, get_model_spec
    from xsched.contract import check_schema
    from xsched.errors import UserError
    from xsched.fileio import atomic_write_all, check_writable, file_or_none, separate_files
    from xsimulator.policy import Policy

    notes: list[str] = []
    outputs: list[tuple[str, bytes]] = []  # written together at the end
    plan: dict[str, Any] = {}
    if args.plan:
        plan = _read_json_arg(args.plan, "plan")
        check_schema(plan, PLAN_SCHEMA, args.plan)  # read in parts below, so Plan.from_dict's check is not made
        if "policy" not in plan:
            raise UserError(f"{args.plan}: a plan needs a 'policy' object; write one with `xsched plan -o`")
        policy = Policy.from_dict(plan["policy"], where=f"{args.plan}: policy")
    else:
        policy = Policy.from_dict(_read_json_arg(args.policy, "--policy"), where="--policy")
    # A plan is priced on its own job (size and request sample): simulate that unless told otherwise.
    predicted = plan.get("predicted") if isinstance(plan.get("predicted"), dict) else {}
    own = {k: v for k in ("num_requests", "seed")
           if isinstance(v := predicted.get(k), int) and not isinstance(v, bool)
           and (1 if k == "num_requests" else 0) <= v < 2**64}  # else the defaults, as for a policy
    if args.requests is None and "num_requests" in own:
        args.requests = plan_requests(own["num_requests"], args.plan)
    args.seed = own.get("seed", 0) if args.seed is None else args.seed
    separate_files([("-o", args.output), ("--trace", args.trace)],
                   [("--plan", file_or_none(args.plan)), ("--policy", file_or_none(args.policy)),
                    ("--profile", file_or_none(args.profile)),
                    ("--workload", workload_file(args.workload or ""))])
    for path, flag in ((args.output, "-o"), (args.trace, "--trace")):
        if path is not None:  # before simulating a large job
            check_writable(path, flag)

    if args.model:
        spec = get_model_spec(args.model)
        planned_for = plan.get("model", {}).get("name") if isinstance(plan.get("model"), dict) else plan.get("model")
        if isinstance(planned_for, str) and planned_for != spec.name:  # (as for another profile, below)
            notes.append(f"note: the plan was made for model {planned_for!r}; simulating its policy on {spec.name!r}")
    elif isinstance(plan.get("model"), dict):
        spec = ModelSpec.from_dict(plan["model"], where="plan model")
    elif isinstance(plan.get("model"), str):
        spec = get_model_spec(plan["model"])
    else:
        raise UserError("give --model (a name from `xsched models` or a model directory)")

    if args.workload:
        workload = get_workload(args.workload)
    elif isinstance(plan.get("workload"), dict):
        workload = Workload.from_dict(plan["workload"], where="plan workload")
    else:
        raise UserError("give --workload (S, T, G, C1, C2, fixed:PROMPT:OUTPUT, or a file of requests)")
    workload = with_samples(workload, args.samples, args.prefix_tokens, args.prefix_groups, args.prefix_share)
    if args.requests is None:  # the job a workload file held, as `plan` prices it
        args.requests = workload.file_requests or DEFAULT_REQUESTS
    if ESTIMATE_NOTE in workload.source:
        notes.append(f"note: {workload.source}")
    for caveat in workload.caveats(spec.name, spec.max_positions):
        warnings.warn(caveat, UserWarning, stacklevel=1)

    profile = load_profile(_profile_arg(args.profile, plan, args.plan, notes))
    planned_on = plan.get("profile_name")
    if args.profile is not None and isinstance(planned_on, str) and (
            profile.name != planned_on or dataclasses.asdict(profile.fingerprint) != plan.get("profile_fingerprint")):
        notes.append(f"note: the plan was made for profile {planned_on!r}; simulating it on {profile.name!r}")
    if args.model:  # a plan's model already carries the dtype it was planned in
        spec = profile.model_for(spec)
    if (unfitted := profile.unfitted_note(spec)) is not None:
        notes.append(f"note: {unfitted}")

    if args.method == "analytic":
        if args.trace:
            raise UserError("--trace needs the discrete-event method (the analytic path has no timeline)")
        from xsimulator.analytic import simulate_analytic

        result = simulate_analytic(spec, profile, policy, workload, args.requests)
    else:
        from xsimulator.costmodel import CostModel
        from xsimulator.discrete_event import simulate_timeline, trace_events
        from xsimulator.trace import chrome_trace_text

        result, timeline = simulate_timeline(spec, profile, policy, workload, args.requests, args.seed)
        if args.trace:
            events = trace_events(CostModel.for_policy(spec, profile, policy), timeline)
            outputs.append((args.trace, chrome_trace_text(
                events, process=f"xsched simulate {spec.name}", metadata={
                    "policy": policy.to_dict(), "workload": workload.name, "profile": profile.name,
                    "source": "simulated"}).encode()))
            notes.append(f"wrote {len(events)} trace events to {args.trace}")
    if not result.fits:  # still priced (what-if), but a script must be able to tell
        short = ", ".join(f"{t} by {(result.peak_bytes[t] - result.capacity_bytes[t]) / 2**30:,.2f} GiB"
                          for t in ("gpu", "cpu", "disk") if result.peak_bytes[t] > result.capacity_bytes[t])
        warnings.warn(f"the policy does not fit {profile.name}'s memory (over {short}); `xsched run` refuses it: "
                      "`xsched plan` finds one that fits", UserWarning, stacklevel=1)
    if args.output:
        outputs.append((args.output, result.file_bytes()))
    atomic_write_all(outputs)  # all or none: a full disk on the second leaves the first as it was
    if args.json:
        print(result.to_json())
    else:
        print(result.describe())
    for note in notes:
        print(note, file=sys.stderr)
    return 0
