"""Do a block's later GPU batches run their decode layers faster, as ``WarmFit`` prices them?

On a CPU the layer fits read every layer's weights from memory, as a block's first GPU batch
does; the later batches reread the layer just read (from the last-level cache), and with 4-bit
weights every batch reads the buffer the layer was just dequantized into. This runs the engine
(random weights, EOS ignored) with a traced block of two GPU batches per plan and prints the
median decode layer event per batch, beside the saving the profile's ``WarmFit`` gives at that
row count (``--profile``; the profile must have been measured for this model).

    OMP_NUM_THREADS=1 python benchmarks/warm_batches.py --profile p.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xsimulator.policy import Policy  # noqa: E402

PLANS: dict[str, dict] = {
    "all-gpu": dict(),
    "kv-cpu-cpu-attention": dict(cg=0.0, cc=1.0, cpu_attention=True),
    "4-bit weights and cache": dict(compress_weight=True, compress_cache=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="opt-125m", help="registry model (random weights)")
    ap.add_argument("--profile", default=None, help="a profile with this model's WarmFit, to compare with")
    ap.add_argument("--rows", type=int, default=8, help="rows per GPU batch (default 8)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from xprofiler.presets import load_profile
    from xprofiler.sweeps import resolve_spec
    from xrunner.engine import Engine, Request
    from xrunner.loaders import RandomSource

    torch.set_num_threads(args.threads)
    spec = resolve_spec(args.model).with_dtype("float32")
    warm = load_profile(args.profile).warm_fit(spec.name, "float32") if args.profile else None
    source = RandomSource(spec, seed=0)
    rng = np.random.default_rng(0)
    n = 2 * args.rows
    print(f"{spec.name} float32, {args.threads} thread(s), GPU batches of {args.rows} rows x 2 per block, "
          f"{args.prompt} + {args.new_tokens} tokens; median decode layer event (ms) per GPU batch")
    saved = f"{warm.predict_s(args.rows) * 1e3:.2f}" if warm else "-"
    print(f"{'plan':26s} {'batch 0':>8s} {'batch 1':>8s} {'saved':>7s} {'WarmFit':>8s} {'CPU attention':>14s}")
    for name, kw in PLANS.items():
        policy = Policy(gbs=args.rows, nb=2, **kw)
        reqs = [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, spec.vocab_size, args.prompt)),
                        args.new_tokens) for i in range(2 * n)]
        with Engine(source, policy, max_prompt=args.prompt, max_output=args.new_tokens, record_trace=True,
                    offload_dir=tempfile.gettempdir()) as eng:
            eng.run(reqs[:n])  # warm-up block: allocator, thread pools
            stats = eng.run(reqs[n:])
        per = {b: [e.dur_s for e in stats.events if e.track == "compute" and e.name == "decode"
                   and e.args["batch"] == b] for b in (0, 1)}
        cpu = [e.dur_s for e in stats.events if e.name == "cpu_attention"]
        b0, b1 = (float(np.median(per[b])) * 1e3 for b in (0, 1))
        cpu_s = f"{np.median(cpu) * 1e3:.2f} in each" if cpu else "-"
        print(f"{name:26s} {b0:8.2f} {b1:8.2f} {b0 - b1:7.2f} {saved:>8s} {cpu_s:>14s}")


if __name__ == "__main__":
    main()
