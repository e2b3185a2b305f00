"""A prompt's samples, or prompts' common system prompt, computed once in prefill.

``xsched run`` turns a prompt's ``"n"`` into n adjacent requests with equal prompts. Those
that join one GPU batch together share its prefill (``xrunner.engine._Work.share``): each
layer runs on the batch's distinct prompts and copies K/V and hidden states to the repeats.
This script runs one random-weight model on two jobs of the same shape, ``--prompts``
prompts x ``--n`` samples each, and on ``--prompts * --n`` distinct prompts of the same
lengths, under a few placements, and prints the prefill phase's seconds (the engine's own
trace, first prefill layer step to the last one's end) and the whole job's generated
tokens/s. The ratio is what sharing buys; the decode phase does the same work in both jobs.

With ``--system T`` it measures prefix sharing (``xrunner.prefix``) instead: ``--prompts * --n``
distinct questions of the same lengths, each behind one common ``T``-token system prompt, run with
the engine's prefix sharing on, on without the run's prefix cache (each prefill step computes the
prefixes again: ``prefix_cache=False``), on but batch by batch (each GPU batch computes them again
too: ``prefixes_across_batches=False``), and off (``share_prefixes``). ``--groups G`` puts one of G
system prompts (T tokens each, give or take a tenth) before each question, in random order, and
adds a run with the block's prompts in length order only (``order_by_prefix=False``), so that
every GPU batch holds most of the G prefixes; the run's prefix cache is then sized for the G
prefixes (``xsimulator.costmodel.prefix_cache_positions``, as ``xsched run`` sizes it for a plan's
workload), against "cache of one prompt" (one prompt's worth of positions, the engine's default).
``--jobs`` runs only the named ones. ``--nb`` smaller than the rows need runs several
blocks; ``--refill R`` refills free slots every R decode steps, with ``--varied`` output lengths
(1..``--new-tokens``) so that rows finish apart and refills bring a few rows each. The prefill
seconds are then the prefill steps' wall time summed.

    OMP_NUM_THREADS=2 python benchmarks/shared_prefill.py [--model smollm2-135m --n 8]
    OMP_NUM_THREADS=2 python benchmarks/shared_prefill.py --system 512 --prompt 128
    OMP_NUM_THREADS=2 python benchmarks/shared_prefill.py --system 256 --groups 8 --prompt 64
    OMP_NUM_THREADS=2 python benchmarks/shared_prefill.py --system 256 --prompt 64 --refill 2 --varied --nb 2
    OMP_NUM_THREADS=2 python benchmarks/shared_prefill.py --system 128 --groups 4 --prompt 64 --refill 2 --varied \
        --nb 2 --gbs 8 --prompts 8 --n 8 --jobs "by prefix,cache of one prompt,no cache"
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xprofiler.specs import get_model_spec  # noqa: E402
from xsimulator.costmodel import prefix_cache_positions  # noqa: E402
from xsimulator.policy import Policy  # noqa: E402

PLACEMENTS: dict[str, dict] = {
    "all on the compute device": dict(),
    "cache on cpu, CPU attention": dict(cg=0.0, cc=1.0, cpu_attention=True),
    "weights on disk, cache and activations on cpu": dict(wg=0.0, wd=1.0, cg=0.0, cc=1.0, hg=0.0, hc=1.0),
}


def requests(args: argparse.Namespace, repeated: bool, vocab: int) -> list:
    """``prompts x n`` requests keyed ``(prompt, sample)``; distinct: every one its own tokens,
    behind one of the ``--groups`` system prompts (``--system`` tokens; none if 0), drawn at random."""
    from xrunner.engine import Request

    rng = np.random.default_rng(0)
    spread = args.system // 10 if args.groups > 1 else 0
    systems = [tuple(int(t) for t in rng.integers(0, vocab, args.system + int(rng.integers(-spread, spread + 1))))
               for _ in range(args.groups)]
    lengths = rng.integers(args.prompt // 2, args.prompt + 1, args.prompts)
    out = []
    for p, length in enumerate(lengths):
        shared = tuple(int(t) for t in rng.integers(0, vocab, length))
        for k in range(args.n):
            ids = shared if repeated else tuple(int(t) for t in rng.integers(0, vocab, length))
            new = int(rng.integers(1, args.new_tokens + 1)) if args.varied else args.new_tokens
            out.append(Request((p, k), systems[int(rng.integers(args.groups))] + ids, new))
    return out


def prefill_seconds(events: list) -> float:
    """The prefill steps' wall time: each run of prefill events (between decode steps), first start
    to last end, summed."""
    total, span = 0.0, None
    for e in sorted((e for e in events if e.name in ("prefill", "decode")), key=lambda e: e.start_s):
        if e.name == "prefill":
            span = (e.start_s if span is None else span[0], e.start_s + e.dur_s)
        elif span is not None:
            total, span = total + span[1] - span[0], None
    return total + (0.0 if span is None else span[1] - span[0])


def max_prompt(args: argparse.Namespace) -> int:
    return args.system * 11 // 10 + args.prompt


def run(spec, policy: Policy, reqs: list, args: argparse.Namespace, **engine_kw: Any) -> tuple[float, float, int]:
    """(prefill seconds, job wall seconds, prefill positions computed) of one job (``engine_kw``:
    the engine's sharing switches and its prefix cache's size)."""
    from xrunner.engine import Engine
    from xrunner.loaders import RandomSource
    from xrunner.sampling import SamplingParams

    done: list = []
    with tempfile.TemporaryDirectory() as d, \
            Engine(RandomSource(spec, seed=0), policy, max_prompt=max_prompt(args),
                   max_output=args.new_tokens, offload_dir=Path(d), record_trace=True,
                   sampling=SamplingParams(temperature=0.8, seed=1), **engine_kw) as eng:
        t0 = time.perf_counter()
        stats = eng.run(reqs, on_finished=done.extend)
        wall = time.perf_counter() - t0
    assert len(done) == len(reqs)
    return prefill_seconds(stats.events), wall, stats.padded_prompt_tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="registry name; random weights of its shape")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many layers (default: all)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt", type=int, default=256, help="longest prompt; lengths drawn from half of it up")
    ap.add_argument("--system", type=int, default=0,
                    help="tokens of a system prompt before every prompt: compare prefix sharing on and off")
    ap.add_argument("--groups", type=int, default=1, help="distinct system prompts, one drawn per prompt")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--nb", type=int, default=None, help="GPU batches per block (default: one block for all rows)")
    ap.add_argument("--refill", type=int, default=0, help="refill free slots every R decode steps (0: none)")
    ap.add_argument("--varied", action="store_true", help="output lengths drawn from 1..--new-tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--placements", default=";".join(PLACEMENTS), help="';'-separated names from the table")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each job, alternating; the fastest counts")
    ap.add_argument("--jobs", default=None, help="','-separated names of the jobs to run (default: all)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    spec = replace(get_model_spec(args.model), dtype="float32")
    if args.layers:
        spec = replace(spec, num_layers=args.layers)
    rows = args.prompts * args.n
    nb = args.nb or -(-rows // args.gbs)
    if args.system:  # one job of distinct questions, prefix sharing on against off
        distinct = requests(args, False, spec.vocab_size)
        jobs = {"shared": (distinct, {}), "no cache": (distinct, dict(prefix_cache=False)),
                "batch by batch": (distinct, dict(prefixes_across_batches=False, prefix_cache=False)),
                "not shared": (distinct, dict(share_prefixes=False))}
        what = (f"{rows} distinct prompts of {args.prompt // 2}..{args.prompt} tokens behind one "
                f"{args.system}-token system prompt")
        if args.groups > 1:  # the cache sized for the G prefixes, as `xsched run` sizes it for a plan's workload
            sized = dict(prefix_cache_positions=prefix_cache_positions(max_prompt(args), args.system, args.groups))
            jobs = {"by prefix": (distinct, sized), "cache of one prompt": jobs["shared"],
                    "length order": (distinct, dict(order_by_prefix=False, **sized)),
                    **{k: v for k, v in jobs.items() if k != "shared"}}
            what = what.replace("one ", f"one of {args.groups} ").replace("-token system prompt",
                                                                           "-token (+-10%) system prompts")
    else:
        jobs = {"repeated": (requests(args, True, spec.vocab_size), {}),
                "distinct": (requests(args, False, spec.vocab_size), {})}
        what = f"{args.prompts} prompts x {args.n} samples, prompts of {args.prompt // 2}..{args.prompt} tokens"
    if args.jobs:
        unknown = set(args.jobs.split(",")) - set(jobs)
        if unknown:
            ap.error(f"--jobs: unknown {sorted(unknown)}; choose from {list(jobs)}")
        jobs = {k: v for k, v in jobs.items() if k in args.jobs.split(",")}
    first, *others = jobs
    refill = f", refilled every {args.refill} steps" if args.refill else ""
    new = f"1..{args.new_tokens}" if args.varied else str(args.new_tokens)
    print(f"{spec.name} shape, random weights, {spec.num_layers} layers, float32; {what}, {new} new "
          f"tokens; {nb} GPU batch(es) x {args.gbs}{refill}; {args.threads} threads\n")
    per_job = lambda what: " | ".join(f"{what}, {k}" for k in jobs)  # noqa: E731
    ratios = lambda what: " | ".join(f"{what}, {k} / {first}" for k in others)  # noqa: E731
    print(f"| placement | {per_job('prefill s')} | {ratios('prefill s')} | {per_job('positions')} | "
          f"{per_job('tok/s')} | {ratios('job s')} |")
    print("|---" * (1 + 3 * len(jobs) + 2 * len(others)) + "|")
    for name in args.placements.split(";"):
        policy = Policy(gbs=args.gbs, nb=nb, refill_every=args.refill, **PLACEMENTS[name])
        best = {k: (float("inf"), float("inf"), 0) for k in jobs}
        tokens = sum(r.max_new_tokens for r in next(iter(jobs.values()))[0])
        for _ in range(args.repeats):
            for k, (reqs, kw) in jobs.items():
                p, w, n = run(spec, policy, reqs, args, **kw)
                best[k] = (min(best[k][0], p), min(best[k][1], w), n)
        p0, w0, _ = best[first]
        cells = ([f"{best[k][0]:.2f}" for k in jobs] + [f"{best[k][0] / p0:.2f}x" for k in others]
                 + [str(best[k][2]) for k in jobs] + [f"{tokens / best[k][1]:.1f}" for k in jobs]
                 + [f"{best[k][1] / w0:.2f}x" for k in others])
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
