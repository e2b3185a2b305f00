"""How many copies move offloaded rows, and what CPU attention costs per call.

Stop 38 traced an H200 run at 0.25-0.3 ms per offloaded KV row per decode item: the engine
copied cpu-tier rows one row and cache part at a time. Since stop 39 it copies a run of
consecutive slots at once (``xrunner.engine._runs``), and CPU attention converts a
half-precision cache in float32 chunks (``xrunner.model.attend_rows_on_cpu``). Two tables:

1. ``TierStore.copy`` calls between the cpu and gpu tiers per layer and GPU batch ("item") for
   a few placements, with the first row of the batch finished after the prefill (so the rows
   left start at slot 1), beside the copies one per row and part would make, and the job's wall
   time; the tokens are checked equal between the two.
2. Milliseconds per call of ``attend_rows_on_cpu`` at a few float32 chunk sizes, against
   converting the whole context at once (the engine's way before stop 39).

On a CPU host table 1's copies are memcpys. A GPU host makes the same counts while each part's
rows stay under 128 KiB (``CUDA_RUN_ROW_BYTES``; the defaults' rows are about 60 KiB), and
moves larger ones one at a time. Each placement first runs once untimed (start-up costs).

    OMP_NUM_THREADS=1 python benchmarks/offload_rows.py [--model opt-125m] [--rows 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xsimulator.policy import Policy  # noqa: E402

PLACEMENTS: dict[str, dict] = {
    "4-bit KV cache, half on cpu": dict(cg=0.5, cc=0.5, compress_cache=True),
    "4-bit KV cache, all on cpu": dict(cg=0.0, cc=1.0, compress_cache=True),
    "KV cache and hidden states on cpu": dict(cg=0.0, cc=1.0, hg=0.0, hc=1.0),
}
CHUNKS_MIB = (2, 8, 32)
ATTENTION_SHAPES = (("opt-1.3b", 64, 256), ("opt-1.3b", 16, 1024), ("opt-125m", 32, 512))


def copies_table(args: argparse.Namespace) -> None:
    import torch

    import xrunner.engine as engine_module
    from xprofiler.sweeps import resolve_spec
    from xrunner.engine import Engine, Request
    from xrunner.loaders import RandomSource
    from xrunner.tiers import TierStore

    spec = resolve_spec(args.model).with_dtype("float32")
    source = RandomSource(spec, seed=0)
    rng = np.random.default_rng(0)
    reqs = [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, spec.vocab_size, args.prompt)),
                    1 if i == 0 else args.new_tokens) for i in range(args.rows)]
    count = {"n": 0}
    real = TierStore.copy

    def counted(self, dst, src, relay=None):
        if {dst.tier, src.tier} == {"cpu", "gpu"}:
            count["n"] += 1
        return real(self, dst, src, relay)

    def run(policy: Policy, run_bytes: int) -> tuple[int, float, dict, int]:
        engine_module.COPY_RUN_BYTES = run_bytes
        out: dict[str, tuple[int, ...]] = {}
        with Engine(source, policy, max_prompt=args.prompt, max_output=args.new_tokens,
                    offload_dir=tempfile.gettempdir()) as eng:
            count["n"] = 0
            t0 = time.perf_counter()
            stats = eng.run(reqs, on_finished=lambda fs: out.update({f.id: f.output_ids for f in fs}))
            wall = time.perf_counter() - t0
        items = spec.num_layers * (stats.num_prefill_steps + stats.num_decode_steps)
        return count["n"], wall, out, items

    torch.set_num_threads(args.threads)
    TierStore.copy = counted  # type: ignore[method-assign]
    default = engine_module.COPY_RUN_BYTES
    print(f"{spec.name} float32, {args.threads} thread(s), {args.rows} rows x 1 batch, {args.prompt} + "
          f"{args.new_tokens} tokens (row 0 stops after the prefill)")
    print(f"{'placement':36s} {'copies/item':>11s} {'per row':>8s} {'wall s':>7s} {'per row s':>9s}  same tokens")
    try:
        for name, kw in PLACEMENTS.items():
            policy = Policy(gbs=args.rows, nb=1, **kw)
            run(policy, default)  # warm-up: allocator, thread pools, first-use kernels
            n_runs, wall_runs, out_runs, items = run(policy, default)
            n_rows, wall_rows, out_rows, _ = run(policy, 1)  # a one-byte cap: one copy per row and part
            print(f"{name:36s} {n_runs / items:11.1f} {n_rows / items:8.1f} {wall_runs:7.2f} {wall_rows:9.2f}  "
                  f"{out_runs == out_rows}")
    finally:
        TierStore.copy = real  # type: ignore[method-assign]
        engine_module.COPY_RUN_BYTES = default


def attention_table(args: argparse.Namespace) -> None:
    import torch

    from xprofiler.sweeps import resolve_spec
    from xrunner.model import attend_rows_on_cpu, attention

    torch.set_num_threads(args.threads)

    def median_ms(fn, repeats: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    print(f"\nCPU attention, bfloat16 cache, {args.threads} thread(s): ms per call (median of 5)")
    print(f"{'shape':26s} {'whole':>8s}" + "".join(f" {f'{c} MiB':>8s}" for c in CHUNKS_MIB))
    for model, rows, length in ATTENTION_SHAPES:
        spec = resolve_spec(model).with_dtype("bfloat16")
        hkv, d = spec.num_kv_heads, spec.head_dim
        ctx = [torch.randn(rows, length, hkv, d).to(torch.bfloat16) for _ in range(2)]
        q = torch.randn(rows, spec.num_heads, 1, d).to(torch.bfloat16)
        mask = torch.ones(rows, length, dtype=torch.bool)
        idx = list(range(rows))

        def whole():
            return attention(spec, q.float(), *(x.transpose(1, 2).float() for x in ctx), None, causal=False)

        cells = [median_ms(whole)] + [median_ms(lambda c=c: attend_rows_on_cpu(spec, q, ctx, idx, mask, c << 20))
                                      for c in CHUNKS_MIB]
        print(f"{f'{model} {rows} x {length}':26s}" + "".join(f" {c:8.1f}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="opt-125m", help="registry model for table 1 (random weights)")
    ap.add_argument("--rows", type=int, default=32, help="rows of the GPU batch in table 1 (default 32)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-attention", action="store_true", help="table 1 only")
    args = ap.parse_args()
    if args.rows < 2:
        ap.error("--rows must be at least 2 (row 0 finishes early)")
    copies_table(args)
    if not args.skip_attention:
        attention_table(args)


if __name__ == "__main__":
    main()
