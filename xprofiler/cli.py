"""CLI of the profiler stage: ``xsched models``, ``xsched profile`` (+ ``show``, ``list``).

Registration imports nothing heavy; measuring imports torch inside the handler.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from xsched.cli import directory_arg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the built-in model registry with sizes")
    p.add_argument("--json", action="store_true", help="print the specs as JSON")
    p.set_defaults(handler=_models)

    prof = sub.add_parser(
        "profile", help="measure this machine into a profile file (or show / list profiles)",
        description="Measure bandwidths between tiers, disk I/O around the page cache, flop rates, "
                    "(de)quantization rates and per-layer times of the given models, and write a profile "
                    "JSON (plus the raw samples as CSV beside it). `xsched profile show FILE|PRESET` and "
                    "`xsched profile list` inspect profiles.")
    prof.add_argument("-o", "--output", type=Path, help="profile JSON to write (its raw samples go beside it, FILE.json -> FILE.samples.csv)")
    prof.add_argument("--model", action="append", default=[], metavar="NAME",
                      help="model whose decoder layer to sweep (registry name, HF directory or .gguf); "
                           "repeat for several; none = no per-layer fits")
    prof.add_argument("--offload-dir", type=directory_arg, default=None,
                      help="directory of the disk tier, where the disk test file goes (default: the system "
                           "temporary directory)")
    prof.add_argument("--gpu-mem", metavar="BYTES", default=None,
                      help="gpu-tier budget, e.g. 8GiB. Default: 90%% of the GPU's memory; on a host without a "
                           "GPU a declared RAM budget of 25%% of the RAM available now")
    prof.add_argument("--cpu-mem", metavar="BYTES", default=None,
                      help="cpu-tier budget (default: 75%% of the RAM available now, minus the gpu tier on a "
                           "host without a GPU)")
    prof.add_argument("--disk-test-bytes", metavar="BYTES", default=None,
                      help="size of the disk test file (default 256MiB with --quick, else 1GiB)")
    prof.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="compute dtype of the GEMM and layer measurements (default: float16 on a GPU, "
                           "float32 on the CPU, like xsched's runner)")
    prof.add_argument("--stat", choices=("median", "min"), default="median",
                      help="summary of the repeated samples: median (default) or min (estimates the machine "
                           "without the other processes sharing it; use on a busy shared host)")
    prof.add_argument("--threads", type=int, default=None,
                      help="torch threads for the measurements (default: torch's default, as the runner uses); "
                           "match what the runner will use")
    prof.add_argument("--quick", action="store_true", help="coarser grids and fewer passes (at most ~3 minutes)")
    prof.add_argument("--name", default=None, help="profile name (default: the host name)")
    prof.add_argument("--json", action="store_true", help="print the profile as JSON instead of a summary")
    prof.add_argument("--quiet", action="store_true", help="no progress bar")
    prof.set_defaults(handler=_profile)
    psub = prof.add_subparsers(dest="profile_cmd", metavar="{show,list}")

    show = psub.add_parser("show", help="print a readable summary of a profile file or preset")
    show.add_argument("profile", help="profile JSON file or preset name (see `xsched profile list`)")
    show.add_argument("--json", action="store_true", help="print the profile as JSON")
    show.set_defaults(handler=_show)

    lst = psub.add_parser("list", help="list the built-in presets")
    lst.add_argument("--json", action="store_true", help="print the preset names and profiles as JSON")
    lst.set_defaults(handler=_list)


def _models(args: argparse.Namespace) -> int:
    from xprofiler.specs import get_model_spec, model_names

    specs = [get_model_spec(n) for n in model_names()]
    if args.json:
        # each spec, with the table's derived columns (in its dtype) beside it
        print(json.dumps([{**s.to_dict(), "num_params": s.num_params, "weight_bytes": s.weight_bytes,
                           "kv_bytes_per_token": s.kv_bytes_per_token_per_layer * s.num_layers} for s in specs],
                         indent=2))
        return 0
    # (family: the decoder layout the engine runs, OPT's or Llama's; most registry models are the latter's kin)
    print(f"{'model':<14} {'family':<10} {'params':>8} {'layers':>6} {'hidden':>6} {'heads':>7} "
          f"{'fp16 weights':>13} {'KV/token':>10}")
    for s in specs:
        kv = s.kv_bytes_per_token_per_layer * s.num_layers
        family = s.family if s.name.startswith(s.family) else f"{s.family}-like"
        print(f"{s.name:<14} {family:<10} {s.num_params / 1e9:>7.2f}B {s.num_layers:>6} {s.hidden:>6} "
              f"{s.num_heads:>3}/{s.num_kv_heads:<3} {s.weight_bytes / 2**30:>9.1f} GiB {kv / 2**10:>6.0f} KiB")
    return 0


def _profile(args: argparse.Namespace) -> int:
    import dataclasses

    from xprofiler.measure import FULL, QUICK, ProfileOptions, profile_machine, samples_csv_path
    from xprofiler.show import summary
    from xsched.errors import UserError
    from xsched.fileio import files_of, separate_files

    if args.output is None:
        raise UserError("say where to write the profile: xsched profile -o profile.json")
    separate_files([("-o", args.output), ("-o (its samples file)", samples_csv_path(Path(args.output)))],
                   [f for m in args.model for f in files_of("--model", m)])
    settings = dataclasses.replace(QUICK if args.quick else FULL, stat=args.stat)
    opts = ProfileOptions(
        output=args.output, offload_dir=Path(args.offload_dir) if args.offload_dir else None,
        models=tuple(args.model), quick=args.quick, dtype=args.dtype, name=args.name,
        gpu_mem_bytes=_at_least_1mib(args.gpu_mem, "--gpu-mem"), cpu_mem_bytes=_at_least_1mib(args.cpu_mem, "--cpu-mem"),
        disk_test_bytes=_at_least_1mib(args.disk_test_bytes, "--disk-test-bytes"),
        progress=not args.quiet, settings=settings, threads=args.threads)
    profile, json_path, csv_path = profile_machine(opts)
    if args.json:
        print(profile.to_json())
    else:
        print(summary(profile))
        print(f"wrote {json_path} and {csv_path}")
    return 0


def _at_least_1mib(text: str | None, flag: str) -> int | None:
    """A size in bytes; one below 1 MiB is a unit left off (`--cpu-mem 16` meant 16GiB): no layer
    fits in it, and no disk read of it can be timed."""
    from xprofiler.measure import parse_bytes
    from xsched.errors import UserError

    if not text:
        return None
    try:
        value = parse_bytes(text)
    except UserError as exc:
        raise UserError(f"{flag} {exc}") from None
    if value < 2**20:
        bare = text.strip().replace(".", "", 1).isdigit()
        raise UserError(f"{flag} {text} is {value} byte(s), too small to use; "
                        + (f"give a unit, e.g. {flag} {text.strip()}GiB" if bare else "give at least 1MiB"))
    return value


def _show(args: argparse.Namespace) -> int:
    from xprofiler.presets import load_profile
    from xprofiler.show import summary

    profile = load_profile(args.profile)
    print(profile.to_json() if args.json else summary(profile))
    return 0


def _list(args: argparse.Namespace) -> int:
    from xprofiler.presets import load_preset, preset_names
    from xprofiler.show import one_line

    profiles = [load_preset(n) for n in preset_names()]
    if args.json:
        print(json.dumps({p.name: p.to_dict() for p in profiles}, indent=2))
        return 0
    for p in profiles:
        print(one_line(p))
    print("use one with --profile NAME; details: xsched profile show NAME", file=sys.stderr)
    return 0
