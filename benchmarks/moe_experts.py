"""Decode speed of a mixture of experts with 4-bit weights: experts dequantized when reached, or all.

With 4-bit weights the engine dequantizes a layer before its compute. Until stop 52 that meant
every routed expert at every layer step, although a decode step of a few rows sends its tokens
to few of them. Now ``stored_forms.LayerWeights`` dequantizes an expert when a token first
reaches it. This script runs one random Qwen3-MoE-shaped model both ways at several batch sizes
and prints decode tokens/s (the engine's trace: first decode layer step to the last one's end),
the experts dequantized per layer step (counted from the trace) beside what ``plan`` and
``simulate`` price (``ModelSpec.experts_reached``: uniform routing), and the ratio. "All
experts" reads every expert's keys as soon as the layer's weights are unpacked, which is the
work the engine did before.

    OMP_NUM_THREADS=1 python benchmarks/moe_experts.py [--experts 64 --per-token 4 --rows 1,4,16,64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xprofiler.specs import ModelSpec  # noqa: E402
from xsimulator.policy import Policy  # noqa: E402


def model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(name="moe-bench", family="llama", num_layers=args.layers, hidden=args.hidden, ffn=args.ffn,
                     num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                     vocab_size=args.vocab, max_positions=args.prompt + args.new_tokens + 1, norm="rmsnorm",
                     activation="silu", position="rotary", tied_embeddings=False, dtype="float32",
                     num_experts=args.experts, experts_per_token=args.per_token)


def run(spec: ModelSpec, rows: int, all_experts: bool, args: argparse.Namespace) -> tuple[float, float, dict]:
    """(decode seconds, experts dequantized per decode layer step, outputs) of one job."""
    from xrunner.engine import Engine, Request
    from xrunner.loaders import RandomSource

    rng = np.random.default_rng(0)
    reqs = [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, spec.vocab_size, args.prompt)), args.new_tokens)
            for i in range(rows)]
    out: dict[str, tuple[int, ...]] = {}
    with tempfile.TemporaryDirectory() as d, \
            Engine(RandomSource(spec, seed=0), Policy(gbs=rows, nb=1, compress_weight=True), max_prompt=args.prompt,
                   max_output=args.new_tokens, offload_dir=Path(d), record_trace=True) as eng:
        if all_experts:
            unpack = eng._weights

            def every_expert(layer: int) -> dict:
                w = unpack(layer)
                for key in list(w):
                    w[key]
                return w
            eng._weights = every_expert  # type: ignore[method-assign]
        stats = eng.run(reqs, on_finished=lambda fs: out.update({f.id: f.output_ids for f in fs}))
    decode = [e for e in stats.events if e.name == "decode"]
    t0, t1 = min(e.start_s for e in decode), max(e.start_s + e.dur_s for e in decode)
    experts = [e for e in stats.events if e.name == "dequant_weights" and e.args.get("expert") and t0 <= e.start_s <= t1]
    return t1 - t0, len(experts) / (spec.num_layers * (args.new_tokens - 1)), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256, help="each expert's width")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--per-token", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=9)
    ap.add_argument("--rows", default="1,4,16,64", help="comma-separated batch sizes (one GPU batch each)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating; the fastest counts")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    spec = model_spec(args)
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.experts} experts of width {args.ffn}, "
          f"{args.per_token} per token; 4-bit weights on the compute device; {args.prompt} prompt + "
          f"{args.new_tokens} new tokens, {args.threads} thread(s)\n")
    print("| rows | decode tok/s, experts when reached | all experts | ratio | experts per decode layer step: "
          "measured | priced (uniform routing) | all |")
    print("|---|---|---|---|---|---|---|")
    run(spec, 2, False, argparse.Namespace(**{**vars(args), "new_tokens": 2}))  # numba, allocator
    for rows in (int(r) for r in args.rows.split(",")):
        lazy = eager = float("inf")
        reached = 0.0
        for _ in range(args.repeats):
            s, reached, got = run(spec, rows, False, args)
            lazy = min(lazy, s)
            s, _n, want = run(spec, rows, True, args)
            eager = min(eager, s)
            if got != want:
                raise SystemExit(f"outputs differ at {rows} rows")
        steps = rows * (args.new_tokens - 1)
        print(f"| {rows} | {steps / lazy:.1f} | {steps / eager:.1f} | {eager / lazy:.2f}x | {reached:.1f} | "
              f"{spec.experts_reached(rows):.1f} | {args.experts} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
