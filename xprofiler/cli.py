"""CLI of the profiler stage: ``xsched models`` (and later ``xsched profile``)."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the built-in model registry with sizes")
    p.add_argument("--json", action="store_true", help="print the specs as JSON")
    p.set_defaults(handler=_models)


def _models(args: argparse.Namespace) -> int:
    from xprofiler.specs import get_model_spec, model_names

    specs = [get_model_spec(n) for n in model_names()]
    if args.json:
        print(json.dumps([s.to_dict() for s in specs], indent=2))
        return 0
    print(f"{'model':<14} {'family':<6} {'params':>8} {'layers':>6} {'hidden':>6} {'heads':>7} "
          f"{'fp16 weights':>13} {'KV/token':>10}")
    for s in specs:
        kv = s.kv_bytes_per_token_per_layer * s.num_layers
        print(f"{s.name:<14} {s.family:<6} {s.num_params / 1e9:>7.2f}B {s.num_layers:>6} {s.hidden:>6} "
              f"{s.num_heads:>3}/{s.num_kv_heads:<3} {s.weight_bytes / 2**30:>9.1f} GiB {kv / 2**10:>6.0f} KiB")
    return 0
