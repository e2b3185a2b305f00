"""How well a workload's description of shared prefixes prices what the engine computes.

``xsched workload fit --tokenizer`` reduces a job's prompts to a few numbers
(``workloads.workload.prefix_fields``): the leading tokens the sharing prompts share
(``prefix_tokens``), how many distinct prefixes (``prefix_groups``), which fraction of the
prompts begin with one (``prefix_share``) and, where the prefixes differ, each one's length and
share (``prefix_lengths``, ``prefix_weights``). ``plan`` and ``simulate`` price a job from those
alone. This script builds jobs of random token ids (G task templates before random questions,
and some prompts that share nothing), counts the prefill positions the engine's own planning
computes for them block by block (``xrunner.prefix``: ``prefix_order``, ``plan_block``, the
run's prefix cache carried across blocks; no refill), and prints the simulators' positions from
the description over the engine's.

The first table has templates of like lengths, equally common; "as before" is the description
stop 58 gave (every prompt that shares nothing a prefix of its own, the shared tokens a mean over
all prompts, no share). The second has templates of unlike lengths and popularity (weights 1 /
rank^zipf); "one length" drops the per-prefix lists (every prefix the mean length, equally common:
the description before stop 60). The third refills slots as outputs end: the simulator is told
each prompt's own prefix and its length (as ``xsched run``'s simulated column is), and the engine's
planning replays the simulator's assignment of prompts to GPU batches and refills, so the table
checks the pricing of a given assignment.

The fourth has more templates than the run's prefix cache has room for (``--prompts`` x 4 of
them, so that many blocks meet the cache): the engine's positions with the cache keeping the
most used prefixes (stop 61), the first that fit (before), and with room for all.

The fifth is an evaluation suite (57 few-shot templates of 550-650 tokens before 30-110 token
questions, 4 output tokens, ``--prompts`` x 4 of them): ``xsched plan``'s policy on the t4 preset
with its prefix cache grown into free memory (``xscheduler.search.grow_prefix_cache``) and the
same policy with the default room, the engine's positions for both and the simulator's over them.

    python benchmarks/prefix_pricing.py [--prompts 512] [--only like|unlike|refill|many|suite]
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workloads.distributions import LengthDistribution  # noqa: E402
from workloads.workload import fixed_workload, prefix_fields, prefix_runs, run_prefix_lengths  # noqa: E402
from xprofiler.presets import load_profile  # noqa: E402
from xprofiler.specs import get_model_spec  # noqa: E402
from xrunner.prefix import PrefixCache, block_positions, plan_block, prefix_order  # noqa: E402
from xsimulator.analytic import simulate_analytic  # noqa: E402
from xsimulator.costmodel import workload_cache_positions  # noqa: E402
from xsimulator.discrete_event import simulate, simulate_timeline  # noqa: E402
from xsimulator.policy import Policy  # noqa: E402

# (templates, their lengths, the questions' lengths)
JOBS = ((1, (150, 160), (10, 60)), (2, (100, 110), (10, 60)), (4, (64, 72), (10, 40)), (8, (64, 72), (10, 40)))
POLICIES = (Policy(gbs=16, nb=4), Policy(gbs=8, nb=8), Policy(gbs=16, nb=4, bucket=False))
# (template lengths, popularity exponent): unlike templates, most common first
# (templates, their length, popularity exponent): more templates than the run's cache has room for
MANY = ((32, 100, 1.0), (32, 100, 1.2), (64, 60, 1.0), (16, 200, 1.0), (16, 200, 0.0))
UNLIKE = (((200, 20, 100, 40), 0.0), ((200, 20, 100, 40), 1.2), ((20, 200, 40, 100), 1.2),
          ((300,) + (20,) * 7, 1.0), ((20,) * 7 + (300,), 1.0), (tuple(range(20, 340, 20)), 1.0))


def job(rng: random.Random, templates: int, count: int, loners: float, head: tuple[int, int],
        question: tuple[int, int], vocab: int = 50000) -> list[tuple[int, ...]]:
    """``count`` prompts in random order: ``1 - loners`` of them one of ``templates`` random
    templates before a random question, the rest random tokens as long."""
    heads = [tuple(rng.randrange(vocab) for _ in range(rng.randint(*head))) for _ in range(templates)]
    sharing = round(count * (1 - loners))
    out = [rng.choice(heads) + tuple(rng.randrange(vocab) for _ in range(rng.randint(*question)))
           for _ in range(sharing)]
    span = (head[0] + question[0], head[1] + question[1])
    out += [tuple(rng.randrange(vocab) for _ in range(rng.randint(*span))) for _ in range(count - sharing)]
    rng.shuffle(out)
    return out


def unlike_job(rng: random.Random, lengths: tuple[int, ...], zipf: float, count: int, loners: float,
               question: tuple[int, int] = (10, 40), vocab: int = 50000) -> list[tuple[int, ...]]:
    """``count`` prompts: ``1 - loners`` of them a template of ``lengths[k]`` random tokens with
    weight ``1 / (k + 1)^zipf`` before a random question, the rest random tokens of 40-200."""
    heads = [tuple(rng.randrange(vocab) for _ in range(n)) for n in lengths]
    weights = [1 / (k + 1) ** zipf for k in range(len(lengths))]
    sharing = round(count * (1 - loners))
    out = [rng.choices(heads, weights)[0] + tuple(rng.randrange(vocab) for _ in range(rng.randint(*question)))
           for _ in range(sharing)]
    out += [tuple(rng.randrange(vocab) for _ in range(rng.randint(40, 200))) for _ in range(count - sharing)]
    rng.shuffle(out)
    return out


def engine_positions(prompts: list[tuple[int, ...]], policy: Policy, cache_positions: int,
                     first_come: bool = False) -> int:
    """Prefill positions one layer computes over the job, as the engine plans its blocks (its
    prefix cache sized as ``xsched run`` sizes it for the plan's workload; ``first_come``: it
    keeps the first prefixes that fit, as before stop 61, not the most used)."""
    hold = max(map(len, prompts))  # the engine holds one prompt's worth of prefixes
    cache, total = PrefixCache(cache_positions, float("inf")) if first_come else PrefixCache(cache_positions), 0
    for b in range(0, len(prompts), policy.block_size):
        block = sorted(prompts[b:b + policy.block_size], key=len) if policy.bucket else prompts[b:b + policy.block_size]
        if policy.bucket:
            order = prefix_order(block, [k // policy.gbs for k in range(len(block))], hold, cache)
            block = block if order is None else [block[i] for i in order]
        batches = [block[k:k + policy.gbs] for k in range(0, len(block), policy.gbs)]
        total += block_positions(batches, hold, cache=cache)
        plan_block(batches, hold, cache=cache)  # admits what this block computes
        cache.drop_retired()
    return total


def replayed_positions(prompts: list[tuple[int, ...]], schedule, gbs: int, cache_positions: int) -> int:
    """The engine's prefill positions for the GPU batches the discrete-event path filled at each
    refill (its ``schedule``: which prompts joined which batch when), planned by ``plan_block``
    with the run's prefix cache carried from refill to refill: the pricing of a given
    assignment, apart from how the joiners are assigned."""
    hold = max(map(len, prompts))
    cache, total = PrefixCache(cache_positions), 0
    for j in range(schedule.num_intervals):
        at = np.flatnonzero(schedule.join == j)
        batches: dict[int, list[tuple[int, ...]]] = {}
        for i in at[np.argsort(schedule.slot[at], kind="stable")]:
            batches.setdefault(int(schedule.slot[i]) // gbs, []).append(prompts[i])
        if batches:
            block = [batches[b] for b in sorted(batches)]
            total += block_positions(block, hold, cache=cache)
            plan_block(block, hold, cache=cache)
            cache.drop_retired()
    return total


def refilled(prompts: list[tuple[int, ...]], workload, policy: Policy, spec, profile) -> tuple[int, float]:
    """(the engine's positions, the discrete-event path's over them) for a refilled policy, the
    simulator told each prompt's own prefix and its length (as ``xsched run``'s simulated column
    is), the engine replaying the simulator's assignment."""
    lengths = np.array([len(p) for p in prompts])
    outputs = np.random.default_rng(0).integers(4, 40, len(prompts))  # unlike outputs free slots at unlike steps
    runs, run_len = run_prefix_lengths(prompts)
    own = replace(workload, prefix_groups=max(runs) + 1, prefix_share=1.0, prefix_lengths=(), prefix_weights=())
    cache = workload_cache_positions(workload, int(lengths.max()))
    sim, tl = simulate_timeline(spec, profile, policy, own, requests=(lengths, outputs), prefix_of=runs,
                                prefix_len=[run_len[k] for k in runs], cache_positions=cache)
    engine = replayed_positions(prompts, tl.schedule, policy.gbs, cache)
    return engine, sim.padded_prompt_tokens / engine


def ratios(prompts: list[tuple[int, ...]], policy: Policy, workloads: list, spec, profile) -> tuple[int, list[float]]:
    """The engine's positions (its cache sized for the first workload) and each workload's
    discrete-event positions over them, then the first's analytic ones."""
    lengths = np.array([len(p) for p in prompts])
    engine = engine_positions(prompts, policy, workload_cache_positions(workloads[0], int(lengths.max())))
    both = (lengths, np.full(len(prompts), 8))
    out = [simulate(spec, profile, policy, w, requests=both).padded_prompt_tokens / engine for w in workloads]
    out.append(simulate_analytic(spec, profile, policy, workloads[0], num_requests=len(prompts)).padded_prompt_tokens
               / engine)
    return engine, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--only", choices=("like", "unlike", "refill", "many", "suite"))
    args = ap.parse_args()
    spec, profile = get_model_spec("opt-1.3b"), load_profile("t4")
    rng = random.Random(args.seed)
    label = lambda p: f"{p.gbs} x {p.nb}" + ("" if p.bucket else ", queue order")  # noqa: E731
    if args.only in (None, "like"):
        print("| G | no prefix | fit: tokens, groups, share | policy | engine positions | discrete-event / engine "
              "| analytic / engine | as before: groups | as before: discrete-event / engine |")
        print("|---|---|---|---|---|---|---|---|---|")
        for templates, head, question in JOBS:
            for loners in (0.0, 0.1, 0.25, 0.5):
                prompts = job(rng, templates, args.prompts, loners, head, question)
                lengths = np.array([len(p) for p in prompts])
                base = replace(fixed_workload(int(lengths.mean()), 8), prompt=LengthDistribution.empirical(lengths))
                now = replace(base, **prefix_fields(prompts))
                old_tokens, runs = prefix_runs(prompts)
                before = replace(base, prefix_tokens=old_tokens, prefix_groups=max(runs) + 1)
                for policy in POLICIES:
                    engine, (des, old, ana) = ratios(prompts, policy, [now, before], spec, profile)
                    print(f"| {templates} | {loners:.0%} | {now.prefix_tokens}, {now.prefix_groups}, "
                          f"{now.prefix_share:.2f} | {label(policy)} | {engine} | {des:.3f} | {ana:.3f} "
                          f"| {before.prefix_groups} | {old:.3f} |", flush=True)
    if args.only in (None, "refill"):
        print("\n| jobs | no prefix | policy | engine positions (the simulator's assignment) "
              "| discrete-event / engine |")
        print("|---|---|---|---|---|")
        for name, make in (("8 like templates", lambda lon: job(rng, 8, args.prompts, lon, (64, 72), (10, 40))),
                           ("300 + 7 x 20 tokens, zipf 1", lambda lon: unlike_job(rng, UNLIKE[3][0], 1.0, args.prompts,
                                                                                  lon)),
                           ("20..320 tokens, zipf 1", lambda lon: unlike_job(rng, UNLIKE[5][0], 1.0, args.prompts,
                                                                            lon))):
            for loners in (0.0, 0.25):
                prompts = make(loners)
                lengths = np.array([len(p) for p in prompts])
                workload = replace(fixed_workload(int(lengths.mean()), 8), prompt=LengthDistribution.empirical(lengths),
                                   **prefix_fields(prompts))
                for policy in (Policy(gbs=8, nb=8, refill_every=1), Policy(gbs=8, nb=8, refill_every=4),
                               Policy(gbs=4, nb=16, refill_every=2)):
                    engine, r = refilled(prompts, workload, policy, spec, profile)
                    print(f"| {name} | {loners:.0%} | {policy.gbs} x {policy.nb}, refill every {policy.refill_every} "
                          f"| {engine} | {r:.3f} |", flush=True)
    if args.only in (None, "unlike"):
        print("\n| template lengths | zipf | no prefix | fit: tokens, groups, share | policy | engine positions "
              "| discrete-event / engine | analytic / engine | one length: discrete-event / engine |")
        print("|---|---|---|---|---|---|---|---|---|")
        for heads, zipf in UNLIKE:
            for loners in (0.0, 0.25):
                prompts = unlike_job(rng, heads, zipf, args.prompts, loners)
                lengths = np.array([len(p) for p in prompts])
                base = replace(fixed_workload(int(lengths.mean()), 8), prompt=LengthDistribution.empirical(lengths))
                now = replace(base, **prefix_fields(prompts))
                alike = replace(now, prefix_lengths=(), prefix_weights=())
                shown = ",".join(map(str, heads[:4])) + (",..." if len(heads) > 4 else "")
                for policy in POLICIES:
                    engine, (des, one, ana) = ratios(prompts, policy, [now, alike], spec, profile)
                    print(f"| {shown} | {zipf:g} | {loners:.0%} | {now.prefix_tokens}, {now.prefix_groups}, "
                          f"{now.prefix_share:.2f} | {label(policy)} | {engine} | {des:.3f} | {ana:.3f} | {one:.3f} |",
                          flush=True)

    if args.only in (None, "many"):
        print("\n| templates x tokens | zipf | cache positions | policy | engine positions: most used "
              "| first come / most used | room for all / most used | discrete-event / engine | analytic / engine |")
        print("|---|---|---|---|---|---|---|---|---|")
        for templates, tokens, zipf in MANY:
            prompts = unlike_job(rng, (tokens,) * templates, zipf, 4 * args.prompts, 0.0)
            lengths = np.array([len(p) for p in prompts])
            workload = replace(fixed_workload(int(lengths.mean()), 8), prompt=LengthDistribution.empirical(lengths),
                               **prefix_fields(prompts))
            cache = workload_cache_positions(workload, int(lengths.max()))
            for policy in POLICIES[:2]:
                engine, (des, ana) = ratios(prompts, policy, [workload], spec, profile)
                first = engine_positions(prompts, policy, cache, first_come=True)
                every = engine_positions(prompts, policy, 10 ** 9)
                print(f"| {templates} x {tokens} | {zipf:g} | {cache} | {label(policy)} | {engine} "
                      f"| {first / engine:.3f} | {every / engine:.3f} | {des:.3f} | {ana:.3f} |", flush=True)

    if args.only in (None, "suite"):
        suite(rng, 4 * args.prompts, spec, profile)


def suite(rng: random.Random, count: int, spec, profile) -> None:
    """The fifth table: a plan's grown prefix cache against the default room on an evaluation suite."""
    from xscheduler import SLA, plan_search
    from xsimulator.costmodel import run_cache_positions

    print("\n| model | policy | cache positions | engine positions | discrete-event / engine "
          "| predicted tokens/s | predicted peak cpu GiB |")
    print("|---|---|---|---|---|---|---|")
    lengths = [rng.randint(550, 650) for _ in range(57)]
    prompts = unlike_job(rng, tuple(lengths), 0.0, count, 0.0, question=(30, 110))
    sizes = np.array([len(p) for p in prompts])
    workload = replace(fixed_workload(int(sizes.mean()), 4), prompt=LengthDistribution.empirical(sizes),
                       **prefix_fields(prompts))
    both = (sizes, np.full(count, 4))
    for name in ("opt-1.3b", "opt-6.7b"):
        model = profile.model_for(get_model_spec(name))
        plan = plan_search(model, profile, workload, SLA("p99", 3600), confirm_seeds=())
        for policy in (plan.policy, replace(plan.policy, prefix_cache_positions=None)):
            cache = run_cache_positions(policy, workload, int(sizes.max()))
            engine = engine_positions(prompts, policy, cache)
            sim = simulate(model, profile, policy, workload, requests=both)
            print(f"| {name} | {policy.gbs} x {policy.nb} | {cache} | {engine} | {sim.padded_prompt_tokens / engine:.3f} "
                  f"| {sim.throughput_tokens_per_s:.1f} | {sim.peak_bytes['cpu'] / 2 ** 30:.2f} |", flush=True)


if __name__ == "__main__":
    main()
