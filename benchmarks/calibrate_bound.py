"""How long does ``xsched calibrate`` take for a ~0.5B model on this machine? (goal: <= 5 minutes)

The model is the 0.5B OPT shape of benchmarks/offload_vs_accelerate.py (36 layers, hidden 1024,
float32, random weights). A quick profile with its layer fits is measured first (not timed
against the goal: it is done once per machine), then calibration runs and is timed.

    OMP_NUM_THREADS=1 python benchmarks/calibrate_bound.py [--profile existing.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def spec_0_5b():
    from xprofiler.specs import ModelSpec

    return ModelSpec(name="opt-0.5b-random", family="opt", num_layers=36, hidden=1024, ffn=4096, num_heads=16,
                     num_kv_heads=16, head_dim=64, vocab_size=50272, max_positions=2048, norm="layernorm",
                     activation="relu", position="learned", tied_embeddings=True, bias=True, dtype="float32",
                     eos_token_id=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="a profile with opt-0.5b-random layer fits (default: measure)")
    ap.add_argument("--out", default="calibrated-0.5b.json")
    args = ap.parse_args()
    from xprofiler.measure import ProfileOptions, profile_machine
    from xprofiler.presets import load_profile
    from xrunner.calibrate import calibrate, report

    spec = spec_0_5b()
    if args.profile and Path(args.profile).exists():
        profile = load_profile(args.profile)
    else:
        t0 = time.perf_counter()
        path = Path(args.profile or "profile-0.5b.json")
        profile, _, _ = profile_machine(ProfileOptions(output=path, models=(spec,), quick=True, threads=1,
                                                       progress=sys.stderr.isatty()))
        print(f"profiled in {time.perf_counter() - t0:.0f} s -> {path}")
    t0 = time.perf_counter()
    fit = calibrate(profile, spec, profile_arg="profile", progress=sys.stderr.isatty())
    took = time.perf_counter() - t0
    fit.profile.save(args.out)
    print(report(fit))
    print(f"calibrate of {spec.name} ({spec.num_params / 1e9:.2f}B parameters) took {took:.0f} s "
          f"(goal <= 300 s): {'met' if took <= 300 else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
