"""Decode and prefill speed of sliding-window layers against every layer full.

A decode step of a windowed layer (Mistral-7B-v0.1, Gemma 2/3, GPT-OSS's every other layer)
needs only its last ``sliding_window`` cached positions. The engine loads and attends to those
alone (``xrunner.engine._Work.first_col``); before stop 50 it loaded the whole context and hid
the rest with a mask. This script runs one random model twice per placement, with its windows
and with every layer full (the same work the masked version did, less the mask), and prints
the decode phase's tokens/s of each, measured from the engine's own trace (first decode layer
step to the last one's end, I/O and CPU attention included), beside the share of attention
work the window leaves: ``ModelSpec.decode_context`` over the context, which is what
``plan`` and ``simulate`` now price. The prefill columns are the same runs' prefill phase: a
windowed layer's prefill attends in bands of query chunks (``xrunner.model.banded_prefill``,
since stop 51; before, one attention over the whole prompt with a mask), priced by
``ModelSpec.prefill_context``.

    OMP_NUM_THREADS=2 python benchmarks/window_decode.py [--prompt 2048 --window 128 --every 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xprofiler.specs import ModelSpec  # noqa: E402
from xsimulator.policy import Policy  # noqa: E402

PLACEMENTS: dict[str, dict] = {
    "cache on the compute device": dict(),
    "cache on cpu, CPU attention": dict(cg=0.0, cc=1.0, cpu_attention=True),
    "cache on cpu, staged to the device": dict(cg=0.0, cc=1.0),
    "4-bit cache on the compute device": dict(compress_cache=True),
}


def model_spec(args: argparse.Namespace) -> ModelSpec:
    layers = tuple(i % args.every == 0 for i in range(args.layers)) if args.every > 1 else ()
    return ModelSpec(name="window-bench", family="llama", num_layers=args.layers, hidden=args.hidden,
                     ffn=args.ffn, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                     vocab_size=args.vocab, max_positions=args.prompt + args.new_tokens + 1, norm="rmsnorm",
                     activation="silu", position="rotary", tied_embeddings=False, dtype="float32",
                     sliding_window=args.window, window_layers=layers)


def phase_seconds(stats, phase: str) -> float:
    """Wall seconds from the first ``phase`` layer step's start to the last one's end."""
    spans = [(e.start_s, e.start_s + e.dur_s) for e in stats.events if e.name == phase]
    return max(b for _, b in spans) - min(a for a, _ in spans)


def run(spec: ModelSpec, policy: Policy, args: argparse.Namespace) -> tuple[float, float]:
    """(prefill, decode) seconds of one job of ``args.rows`` random prompts."""
    from xrunner.engine import Engine, Request
    from xrunner.loaders import RandomSource

    rng = np.random.default_rng(0)
    reqs = [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, spec.vocab_size, args.prompt)), args.new_tokens)
            for i in range(args.rows)]
    out: dict[str, tuple[int, ...]] = {}
    with tempfile.TemporaryDirectory() as d, \
            Engine(RandomSource(spec, seed=0), policy, max_prompt=args.prompt, max_output=args.new_tokens,
                   offload_dir=Path(d), record_trace=True) as eng:
        stats = eng.run(reqs, on_finished=lambda fs: out.update({f.id: f.output_ids for f in fs}))
    assert len(out) == len(reqs)
    return phase_seconds(stats, "prefill"), phase_seconds(stats, "decode")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--window", type=int, default=128, help="sliding window (GPT-OSS: 128)")
    ap.add_argument("--every", type=int, default=2, help="window every k-th layer (1: all, as Mistral v0.1)")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=17)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--placements", default=";".join(PLACEMENTS), help="';'-separated names from the table")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating; the fastest counts")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    windowed = model_spec(args)
    full = replace(windowed, sliding_window=None, window_layers=())
    ctx = args.prompt + args.new_tokens // 2
    share = windowed.decode_context(ctx) / ctx
    steps = args.rows * (args.new_tokens - 1)  # each request's first token comes from its prefill
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads, window "
          f"{args.window} on every {args.every}. layer(s); {args.rows} rows x {args.prompt} prompt + "
          f"{args.new_tokens} new tokens, {args.threads} threads")
    print(f"positions read per decode step, mid-decode, windowed / full (decode_context): {share:.3f}")
    print(f"keys scored per prefill query, windowed / full (prefill_context): "
          f"{windowed.prefill_context(args.prompt) / args.prompt:.3f}\n")
    print("| placement | prefill tok/s, windowed | every layer full | ratio | decode tok/s, windowed | "
          "every layer full | ratio |")
    print("|---|---|---|---|---|---|---|")
    tokens = args.rows * args.prompt
    for name in args.placements.split(";"):
        policy = Policy(gbs=args.rows, nb=1, **PLACEMENTS[name])
        run(windowed, policy, argparse.Namespace(**{**vars(args), "prompt": 8, "new_tokens": 2}))  # numba, allocator
        w = f = (float("inf"), float("inf"))
        for _ in range(args.repeats):  # the fastest of each phase
            w = tuple(map(min, w, run(windowed, policy, args)))
            f = tuple(map(min, f, run(full, policy, args)))
        print(f"| {name} | {tokens / w[0]:.0f} | {tokens / f[0]:.0f} | {f[0] / w[0]:.2f}x | {steps / w[1]:.1f} | "
              f"{steps / f[1]:.1f} | {f[1] / w[1]:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
