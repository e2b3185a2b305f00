"""Plan search: the best throughput under a latency SLA, over batch knobs, compression and placement.

Three layers (the product's main job):

- **Outer choices** (``variants``): compression of weights / KV cache and CPU attention. Each is
  searched separately; the incumbent carries over, so later variants prune against it.
- **Monotone integer knobs** (``Space``): GPU batch size ``gbs`` and batches per block ``nb``
  (powers of two up to what memory allows) and the refill interval ``refill_every`` ordered from
  "never" to "every step". Latency grows (within tolerance) along gbs and nb, which is what
  ExeGPT's branch-and-bound (§5.1, Algorithm 1) exploits: a box of knob points is bounded below
  in latency by its bottom corner. Throughput grows too until the simulator's knee, so a top
  corner that meets the bound is its box's best point; one that misses bounds nothing, and the
  LP bounds the box instead (:func:`branch_and_bound`).
- **Placement** for each ``(variant, gbs, nb)``: the LP of :mod:`xscheduler.placement`, rounded.
  Its seconds per token of an ideal block also bound the simulated throughput from above
  (:meth:`Evaluator.bound`), so whole variants, boxes and candidate moves are pruned with LP
  solves (milliseconds) instead of simulations (tens of milliseconds).

Every point is priced by the simulator and cached (:class:`Evaluator`); the same evaluator
serves branch-and-bound, the exhaustive grid and Optuna, so their numbers compare directly.
Evaluation counts are simulator calls; LP solves are counted separately.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from workloads.workload import Workload
from xprofiler.profile import HardwareProfile
from xprofiler.specs import ModelSpec
from xscheduler.placement import Placement, place
from xsimulator.costmodel import PREFIX_CACHE_SLACK, CostModel, fits_in, workload_cache_positions
from xsimulator.policy import MAX_GBS, MAX_NB, Policy
from xsimulator.result import SimResult

# Refill intervals, never, then ever more often: throughput grows along them on most workloads,
# latency not monotonically (Evaluator.misses).
REFILL_LEVELS: tuple[int, ...] = (0, 64, 16, 4, 1)
EVALUATORS: tuple[str, ...] = ("discrete-event", "analytic")
# Upper bound on a point's simulated throughput, as a multiple of the LP's tokens/s for its
# (variant, gbs, nb). The LP prices an ideal block (prompts padded only to the mean, every row
# decoding for the mean output, no refill stalls), so the simulator lands at 0.30-1.03x of it
# over the whole grids of six benchmark cells (opt-6.7b, opt-30b, opt-175b, llama-2-70b; t4 and
# a100-80gb; workloads S, T, G, C2). The margin above the largest ratio keeps the bound safe.
LP_BOUND_SLACK = 1.05
LP_BOUND_SEEN = 1.03  # that largest ratio: an evaluator keeps the same margin above what it sees
# Lower bound on a point's simulated latency (p99 or p99-length, any refill), as a multiple of
# the time the LP's ideal block takes to decode a request of the workload's 99th-percentile output
# length (seconds per token x block size x that length). Over the whole grids of the 40 model x
# preset x workload combinations of ``benchmarks/plan_quality.py`` the simulator lands at 0.42x of
# it or more (the least at gbs 1 with 1024-2048 GPU batches, whose steps get cheaper as rows
# finish; the analytic evaluator at 0.425x there). The margin below the smallest ratio keeps the
# bound safe.
LP_LATENCY_SLACK = 0.4
LP_LATENCY_SEEN = 0.42  # that smallest ratio: an evaluator keeps the same margin below what it sees
# Refilling more often can lower latency (``Evaluator.misses``), but only so far: a (variant, gbs,
# nb)'s p99 or p99-length at a more frequent refill interval was at least 0.81 of its value at a
# less frequent one over the whole grids of the 40 model x preset x workload combinations of
# ``benchmarks/plan_quality.py`` (and in stop 36's counterexample, llama-3-8b / rtx3090 / S), 0.77
# over seven workloads on a profile measured on the 2-core VM, and at least REFILL_SEEN over 76
# randomly perturbed profiles (a review's fuzz, stop 40: a SmolLM2 VM profile with its rates
# rescaled, C2@0.25, gbs 4, refilling every step against every 64 steps). So a point that misses
# the bound by more than 1 / REFILL_LATENCY_SLACK shows that the same and larger shapes miss it at
# every more frequent interval too. A slack of 0.7 pruned that fuzz case's best point (0.44 of
# exhaustive search's throughput). (Less often is not bounded usefully: there the ratio fell to
# 0.23, refilling every step stalling every row for each new prompt.)
REFILL_LATENCY_SLACK = 0.5
REFILL_SEEN = 0.635  # that smallest ratio: an evaluator keeps the same margin below what it sees
# Latency may fall a little along gbs or nb where the placement moves with the batch: on
# h100-80gb / opt-175b / T (4-bit weights and cache, no refill) p99 was 266.5 s at gbs 2, 271.5 s
# at 4 and 269.5 s at 8, and with no tolerance `xsched plan --latency 269.6 --requests 400`
# stopped at gbs 2 with 0.44 of exhaustive search's throughput. Branch-and-bound prunes by latency
# only past the bound times (1 + this); a point is still offered only if it meets the bound itself.
# It cost plan_quality --quick 12 more evaluations in 1209 (0.01: 12 in 1209 too, over two cells).
LATENCY_TOLERANCE = 0.02
# Latency's monotonicity along gbs and nb is trusted only as far as the LP agrees: a point that
# misses the bound ``over`` times rules out a larger one only if ``over`` times the ratio of their
# LP latency floors (``Evaluator.ideal_latency_s``) times this slack is still over 1. A profile
# measured under noise can price 4 rows cheaper than 2 (the SmolLM2 VM profile rescaled, C2@0.5:
# 4-bit weights and cache at gbs 4 had p99 77.9 s, at gbs 1 96.5 s and at 2 127.1 s; LP floors
# 82.5, 91.4 and 125.0 s), and there a miss at gbs 1 pruned every larger gbs: 0.27 of exhaustive
# search's throughput. The floors' ratio alone (slack 1) caught that; on other cells of the same
# profile the simulated latency fell 0.87-0.91x where the floors rose 1.13-1.19x (0.21 and 0.32 of
# exhaustive search), which a slack below 0.78 catches. Only measured per-layer fits are that
# noisy: on presets (rates, no fits) the slack is 1, as 0.75 cost plan_quality --quick 6% more
# evaluations there.
MEASURED_MONOTONE_SLACK = 0.75
# A re-plan's warm search tries shape-and-refill jumps only from variants whose climb ended within
# this fraction of the best one (opt-30b/t4/T: the best after the jump was 5% behind before it).
JUMP_WITHIN = 0.9
# Branch-and-bound's answer is polished from every variant's best point within this fraction of
# it too (opt-6.7b/t4/G: the best plan was a shape step away in a variant whose best priced
# point was 0.977 of the answer; one-knob steps change the variant or the shape, not both).
POLISH_WITHIN = 0.95
JUMP_ROUNDS = 4
# A grown prefix cache takes at most this share of the room a plan leaves free on each tier: the
# rest stays for what the cost model does not count (allocator slack, the process itself).
CACHE_ROOM_SHARE = 0.5
# grow_prefix_caches grows the caches of this many of the fastest shapes that meet the bound (and of
# every power-of-two shape under their variants): the search prices every point with the default room
GROW_TRIES = 4
# Grown shapes within this fraction of the fastest are compared on GROW_SEEDS draws (the search's
# seed and the next ones), at most GROW_TIE_SHAPES of them
GROW_TIE = 0.05
GROW_SEEDS = 3
GROW_TIE_SHAPES = 6
# A plan for prompts behind shared prefixes keeps, of the points within NEAR_TIE of its throughput
# (at most GROW_TIE_SHAPES of them), the one fastest on the mean of NEAR_SEEDS draws
# (settle_near_ties): which template each prompt gets is one draw, and on a small job it moved
# shapes' throughput by up to 16% one way or the other.
NEAR_TIE = 0.15
NEAR_SEEDS = 5


@dataclass(frozen=True)
class Variant:
    """An outer, non-monotone choice: which tensors are 4-bit and where attention runs."""

    compress_weight: bool
    compress_cache: bool
    cpu_attention: bool

    def describe(self) -> str:
        comp = [n for n, on in (("weights", self.compress_weight), ("KV cache", self.compress_cache)) if on]
        return (("4-bit " + " + ".join(comp)) if comp else "no compression") + \
            (", CPU attention" if self.cpu_attention else "")


def variants(compress: str, compute_device: str) -> list[Variant]:
    """Outer choices for ``--compress auto|on|off``.

    ``on``: weights compressed (KV cache too unless attention runs on the CPU, which cannot
    read a compressed cache); ``off``: nothing compressed; ``auto``: every valid combination.
    CPU attention is only a choice on a CUDA host (on a CPU host attention already runs there).
    """
    if compress not in ("auto", "on", "off"):
        raise ValueError(f"compress must be auto, on or off, not {compress!r}")
    attn = (False, True) if compute_device == "cuda" else (False,)
    out = []
    for cw in (False, True):
        for cc in (False, True):
            for ca in attn:
                if cc and ca:
                    continue
                if compress == "off" and (cw or cc):
                    continue
                if compress == "on" and not (cw and (cc or ca)):
                    continue
                out.append(Variant(cw, cc, ca))
    return out


def refills_more_often(a: int, b: int) -> bool:
    """Whether refill interval ``a`` refills more often than ``b`` (0 is never)."""
    return a > 0 and (b == 0 or a < b)


@dataclass(frozen=True)
class Evaluation:
    """One knob point priced: its rounded policy and simulated result (None if nothing fits)."""

    variant: Variant
    gbs: int
    nb: int
    refill_every: int
    policy: Policy | None
    result: SimResult | None

    @property
    def fits(self) -> bool:
        return self.result is not None and self.result.fits

    @property
    def throughput(self) -> float:
        return self.result.throughput_tokens_per_s if self.fits else 0.0

    def latency(self, kind: str) -> float:
        return self.result.latency_s(kind) if self.fits else math.inf

    def meets(self, kind: str, bound_s: float) -> bool:
        return self.fits and self.latency(kind) <= bound_s


def in_effect(policy: Policy, job_rows: int, max_output: int, min_output: int = 1) -> Policy:
    """The policy that runs the same as ``policy``, so that the two share one simulation.

    Refill that cannot change a job of ``job_rows`` requests of ``min_output`` to ``max_output``
    tokens (:meth:`Policy.refill_in_effect`: one-row blocks, blocks holding the whole job, intervals
    past the longest output, one output length for all) is dropped: 4 simulations fewer per
    variant for one row alone, and the points where a throughput-bound search ends on a small job.
    Attention on the CPU is only for KV cache rows off the GPU, so with none there it is attention
    on the device: up to 16% of a grid's points (opt-6.7b on a100-80gb); the discrete-event
    simulator agrees exactly there, on all 40 model x preset x workload grids of
    ``benchmarks/plan_quality.py``.
    """
    refill = policy.refill_in_effect(job_rows, max_output, min_output)
    if refill != policy.refill_every:
        policy = replace(policy, refill_every=refill)
    if policy.cpu_attention and policy.cc == 0 and policy.cd == 0:
        policy = replace(policy, cpu_attention=False)
    return policy


@dataclass
class Space:
    """Knob values of one variant (each list in the order throughput and latency grow)."""

    variant: Variant
    gbs: list[int]
    nb: list[int]
    refill: list[int]
    block_cap: int  # a block never holds more rows than this (the job's size, to a power of two)

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.gbs), len(self.nb), len(self.refill)

    def knobs(self, index: tuple[int, int, int]) -> tuple[int, int, int]:
        """Knob values at an index; a block larger than the job is clipped (it behaves the same)."""
        g = self.gbs[index[0]]
        nb = max(1, min(self.nb[index[1]], self.block_cap // g))
        return g, nb, self.refill[index[2]]

    def points(self) -> set[tuple[int, int, int]]:
        """Distinct knob values of the grid (what exhaustive search evaluates)."""
        return {self.knobs((i, j, k)) for i in range(len(self.gbs)) for j in range(len(self.nb))
                for k in range(len(self.refill))}


@dataclass
class Evaluator:
    """Prices knob points with the placement LP and the simulator, caching both."""

    spec: ModelSpec
    profile: HardwareProfile
    workload: Workload
    num_requests: int = 2000
    seed: int = 0
    method: str = "discrete-event"
    on_eval: Callable[[], None] | None = None
    placements: dict[tuple, Placement | None] = field(default_factory=dict)
    cache: dict[tuple, Evaluation] = field(default_factory=dict)
    lp_solves: int = 0
    results: dict[Policy, SimResult] = field(default_factory=dict)  # by the policy in effect (:func:`in_effect`)
    shared: int = 0  # points priced with another point's simulation (the same policy in effect)
    # The LP bounds' slacks, widened when a simulation contradicts them (:meth:`_check_bounds`).
    bound_slack: float = LP_BOUND_SLACK
    floor_slack: float = LP_LATENCY_SLACK
    refill_slack: float = REFILL_LATENCY_SLACK  # narrowed when a simulation contradicts it (:meth:`_check_refill`)
    by_shape: dict[tuple, list[Evaluation]] = field(default_factory=dict)  # fitting points by (variant, gbs, nb)

    def __post_init__(self) -> None:
        if self.method not in EVALUATORS:
            raise ValueError(f"unknown evaluator {self.method!r}; choose from {', '.join(EVALUATORS)}")

    def placement(self, v: Variant, gbs: int, nb: int) -> Placement | None:
        if gbs > MAX_GBS or nb > MAX_NB:  # past what a Policy may ask for (a huge job's climb can get there)
            return None
        key = (v, gbs, nb)
        if key not in self.placements:
            self.lp_solves += 1
            self.placements[key] = place(self.spec, self.profile, self.workload, gbs, nb,
                                         compress_weight=v.compress_weight, compress_cache=v.compress_cache,
                                         cpu_attention=v.cpu_attention)
        return self.placements[key]

    def simulate(self, policy: Policy, seed: int | None = None, method: str | None = None) -> SimResult:
        if (method or self.method) == "analytic":
            from xsimulator.analytic import simulate_analytic

            return simulate_analytic(self.spec, self.profile, policy, self.workload, self.num_requests)
        from xsimulator.discrete_event import simulate

        return simulate(self.spec, self.profile, policy, self.workload, self.num_requests,
                        self.seed if seed is None else seed)

    def __call__(self, v: Variant, gbs: int, nb: int, refill: int) -> Evaluation:
        key = (v, gbs, nb, refill)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        placed = self.placement(v, gbs, nb)
        policy = result = None
        simulated = False
        if placed is not None:
            policy = replace(placed.policy, refill_every=refill)
            same = in_effect(policy, self.num_requests, self.workload.output.max_len, self.workload.output.min_len)
            twin = self.results.get(same)
            if twin is not None:
                result = replace(twin, policy=policy)
                self.shared += 1
            else:
                result = self.results[same] = self.simulate(policy)
                simulated = True
        ev = Evaluation(v, gbs, nb, refill, policy, result)
        self.cache[key] = ev
        if ev.fits:
            self._check_bounds(ev, placed)
            self._check_refill(ev)
        if self.on_eval is not None and (simulated or policy is None):
            self.on_eval()
        return ev

    def _check_bounds(self, ev: Evaluation, placed: Placement) -> None:
        """Widen :meth:`bound` and :meth:`latency_floor` where this simulation is beyond them.

        Their slacks were measured on the preset profiles' grids; a measured profile's fits can put
        the simulator further from the LP's ideal block, and a bound that a priced point already
        breaks would prune the answer. (A SmolLM2 profile measured on the 2-core VM under load,
        whose decode layer costs 2.8 ms at one row and 8.9 ms at two: simulated throughput up to
        1.43x the full block's LP rate, latency down to 0.34x the floor; 0.869 of exhaustive
        search's throughput at workload S and 2x the lowest latency, 0.921 with this widening,
        1.000 once the bound's rate took each phase at its cheapest rows,
        :attr:`Placement.emptying_token_s`.) The same margin is kept beyond the worst point
        seen, so pruning only ever loosens as the search learns."""
        if placed.emptying_token_s <= 0:
            return
        ideal = 1.0 / placed.emptying_token_s
        self.bound_slack = max(self.bound_slack, ev.throughput / ideal * (LP_BOUND_SLACK / LP_BOUND_SEEN))
        lowest = min(ev.latency(k) for k in ("p99", "p99-length"))
        ideal_s = self._ideal_latency_s(placed, ev.gbs, ev.nb)
        if ideal_s > 0:
            self.floor_slack = min(self.floor_slack, lowest / ideal_s * (LP_LATENCY_SLACK / LP_LATENCY_SEEN))

    def _check_refill(self, ev: Evaluation) -> None:
        """Narrow :attr:`refill_slack` where this point and one of the same shape at another refill
        interval are closer than :data:`REFILL_SEEN` (the more frequent one's latency over the
        other's), keeping the same margin, as :meth:`_check_bounds` does for the LP bounds."""
        same = self.by_shape.setdefault((ev.variant, ev.gbs, ev.nb), [])
        for other in same:
            if refills_more_often(ev.refill_every, other.refill_every):
                often, rarely = ev, other
            elif refills_more_often(other.refill_every, ev.refill_every):
                often, rarely = other, ev
            else:
                continue
            ratio = min(often.latency(k) / rarely.latency(k) for k in ("p99", "p99-length"))
            self.refill_slack = min(self.refill_slack, ratio * (REFILL_LATENCY_SLACK / REFILL_SEEN))
        same.append(ev)

    @property
    def evaluations(self) -> int:
        """Points priced: simulations, and points that do not fit (no simulation needed)."""
        return len(self.cache) - self.shared

    @property
    def job_cap(self) -> int:
        """The job's size to a power of two: a larger block behaves the same."""
        return 1 << max(0, math.ceil(math.log2(max(1, self.num_requests))))

    def bound(self, v: Variant, gbs: int, nb: int) -> float:
        """Throughput no point with these knobs can beat (any refill), from the LP alone: its
        rounded placement's rate with each phase at its cheapest rows (a block empties as requests
        finish) times :data:`LP_BOUND_SLACK`, or wider once a simulation beat it; 0 when nothing
        fits. Costs an LP solve, not a simulation."""
        placed = self.placement(v, gbs, nb)
        return (self.bound_slack / placed.emptying_token_s
                if placed is not None and placed.emptying_token_s > 0 else 0.0)

    def latency_floor(self, v: Variant, gbs: int, nb: int) -> float:
        """Latency no point with these knobs can beat (any refill), from the LP alone
        (:data:`LP_LATENCY_SLACK`, or lower once a simulation beat it); 0 when nothing fits. Costs
        an LP solve, not a simulation."""
        ideal = self.ideal_latency_s(v, gbs, nb)
        return 0.0 if ideal is None else self.floor_slack * ideal

    def _ideal_latency_s(self, placed: Placement, gbs: int, nb: int) -> float:
        """The LP's ideal block decoding a request of the workload's 99th-percentile output length."""
        return placed.token_s * gbs * nb * self.workload.output.quantile(0.99)

    def ideal_latency_s(self, v: Variant, gbs: int, nb: int) -> float | None:
        """:meth:`_ideal_latency_s` at these knobs, or None when nothing fits (an LP, cached)."""
        placed = self.placement(v, gbs, nb)
        return None if placed is None else self._ideal_latency_s(placed, gbs, nb)

    @functools.cached_property
    def monotone_slack(self) -> float:
        """:data:`MEASURED_MONOTONE_SLACK` where the profile has measured layer fits for the
        model, else 1."""
        measured = self.profile.layer_fit(self.profile.fit_name(self.spec), "decode", self.spec.dtype) is not None
        return MEASURED_MONOTONE_SLACK if measured else 1.0

    def miss_carries(self, v: Variant, small: tuple[int, int], large: tuple[int, int], over: float) -> bool:
        """Whether a point at ``small`` that misses the bound ``over`` times says ``large`` misses
        it too: its latency scaled by the LP floors' ratio and :attr:`monotone_slack` is still
        over the bound."""
        base, floor = self.ideal_latency_s(v, *small), self.ideal_latency_s(v, *large)
        return base is None or floor is None or base <= 0 or over * self.monotone_slack * floor / base > 1.0

    def misses(self, v: Variant, gbs: int, nb: int, refill: int, kind: str, bound_s: float) -> bool:
        """Whether the point is known to miss the bound without pricing it: by its LP latency floor
        (:meth:`latency_floor`), or by a point already priced, one of the same variant with no
        larger gbs and nb, whose latency is over it: at the same refill interval, or at a less
        frequent one by more than 1 / :attr:`refill_slack` (:data:`REFILL_LATENCY_SLACK`; stop 40:
        ``plan_quality.py --quick`` from 3.8% to 3.5% of exhaustive search's evaluations, max 7.6%
        to 7.0%, every cell still at 1.000 of its throughput; all 160 cells: mean 3.7%, max 12.3%,
        114 within 5%, 160 at 1.000; a slack of 0.7 saved three times as much but pruned a
        perturbed profile's best plan).

        Latency is not monotone along the refill levels. Stop 36's counterexample: llama-3-8b /
        rtx3090 / S, gbs 16, nb 1. Refilling every 16 steps gave p99 5.40 s, every 4 steps 4.93 s
        and every step 4.38 s (0.81x), so a bound missed at 16 said nothing about 4 or 1. Trusting the levels' order (stop 32 to 35) cut
        plan_quality's evaluations from 4.6% to 3.4% of exhaustive search's, but on that workload
        `xsched plan --latency 1.9 --requests 300` returned 0.707 of exhaustive search's throughput.
        Dropping it took ``plan_quality.py --quick`` from 2.1% to 3.2% of exhaustive search's
        evaluations and, the search's path having changed, one cell to 0.874 of its throughput;
        the cross-variant jump (:func:`_jump`) brought that cell back (3.5%, all 16 at 1.000).
        The LP floor costs no simulation either; without it plan_quality's evaluations were 2.24%
        of exhaustive search's, not 1.98% (stop 32)."""
        if self.latency_floor(v, gbs, nb) > bound_s:
            return True
        often = bound_s / self.refill_slack
        return any(e.variant == v and e.fits and e.gbs <= gbs and e.nb <= nb and e.latency(kind) > bound_s
                   and (e.refill_every == refill or (refills_more_often(refill, e.refill_every)
                                                     and e.latency(kind) > often))
                   and self.miss_carries(v, (e.gbs, e.nb), (gbs, nb), e.latency(kind) / bound_s)
                   for e in self.cache.values())

    def box_bound(self, space: "Space", lo: tuple[int, ...], hi: tuple[int, ...], kind: str = "p99",
                  bound_s: float = math.inf) -> float:
        """The largest :meth:`bound` over the points of a box of ``space`` (one refill level) that
        :meth:`misses` does not know to miss ``bound_s``: the others cannot be the answer, so
        their LP bounds need not keep the box (plan_quality: 2.21% -> 1.98% of exhaustive
        search's evaluations, cells within 5%: 157 -> 160 of 160)."""
        points = {space.knobs((i, j, lo[2])) for i in range(lo[0], hi[0] + 1) for j in range(lo[1], hi[1] + 1)}
        return max((self.bound(space.variant, g, nb) for g, nb, r in points
                    if not (math.isfinite(bound_s) and self.misses(space.variant, g, nb, r, kind, bound_s))),
                   default=0.0)

    def space(self, v: Variant, refill: Iterable[int] = REFILL_LEVELS, knee: bool = False,
              knee_tol: float = 0.02, max_exp: int = 12) -> Space | None:
        """Knob ranges of a variant, derived from memory. None when not even gbs = nb = 1 fits.

        Full ranges (``knee=False``, the exhaustive grid): powers of two up to the largest
        ``gbs`` (with nb = 1) and ``nb`` (with gbs = 1) whose placement LP is feasible, and blocks
        no larger than the job. With ``knee=True`` (branch-and-bound) the ranges stop where the
        placement LP's seconds per token stop improving (within ``knee_tol``): for each gbs, nb
        grows until the LP's time per token worsens; the gbs range ends at the gbs with the
        best time, and its smallest block within ``knee_tol`` of that time caps the block
        (``polish`` then looks past these edges). Past that knee a larger
        batch only pushes weights or KV cache to slower tiers, so throughput falls while latency
        still rises, which would break the monotonicity branch-and-bound relies on.
        """
        cap = self.job_cap
        if self.placement(v, 1, 1) is None:
            return None
        top = min(max_exp, int(math.log2(cap)))

        def largest(fits: Callable[[int], bool]) -> int:
            lo, hi = 0, top  # exponents; lo always fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if fits(1 << mid):
                    lo = mid
                else:
                    hi = mid - 1
            return lo

        if not knee:
            g = largest(lambda x: self.placement(v, x, 1) is not None)
            n = largest(lambda x: self.placement(v, 1, x) is not None)
        else:  # the walk below stops where memory does
            g = n = top
            per_g: list[tuple[float, int]] = []  # (best seconds per token over nb, knee of nb) per gbs
            start = 0  # the best block size barely moves with gbs: start each walk just below the last knee
            for i in range(top + 1):
                costs: dict[int, float] = {}
                for j in range(start, top - i + 1):
                    p = self.placement(v, 1 << i, 1 << j)
                    if p is None:
                        break
                    costs[j] = p.token_s
                    if p.token_s > min(costs.values()) * (1 + knee_tol):
                        break  # past this gbs's knee
                if not costs:
                    break
                best_c = min(costs.values())
                # The smallest block within knee_tol of the best: past it the LP sees little gain
                # while the simulator (padding, refill, longest sequences) often sees a loss.
                per_g.append((best_c, min(j for j, c in costs.items() if c <= best_c * (1 + knee_tol))))
                start = max(0, per_g[-1][1] - 2)
                overall = min(c for c, _ in per_g)
                if len(per_g) >= 3 and all(c > overall * (1 + knee_tol) for c, _ in per_g[-2:]):
                    break  # two larger batches in a row were worse: past the knee in gbs
            # The LP's best gbs (ties to the smaller: it leaves more memory for the rest of the block).
            best_g = min(c for c, _ in per_g)
            g = min(i for i, (c, _) in enumerate(per_g) if c <= best_g * (1 + 1e-6))
            cap = (1 << g) << per_g[g][1]
            n = min(n, int(math.log2(cap)))
        return Space(v, [1 << i for i in range(g + 1)], [1 << i for i in range(n + 1)], list(refill), cap)


# --------------------------------------------------------------------------- searches
def _better(a: Evaluation, b: Evaluation | None, kind: str) -> bool:
    """Higher throughput wins; equal throughput (within 1e-9) goes to the lower latency."""
    if b is None:
        return True
    if a.throughput > b.throughput * (1 + 1e-9):
        return True
    return a.throughput >= b.throughput * (1 - 1e-9) and a.latency(kind) < b.latency(kind)


def branch_and_bound(ev: Evaluator, space: Space, kind: str, bound_s: float, eps_t: float = 0.01,
                     eps_l: float = LATENCY_TOLERANCE, incumbent: Evaluation | None = None,
                     corners: bool = False) -> Evaluation | None:
    """ExeGPT Algorithm 1 generalised to d monotone knobs; returns the best point meeting the bound.

    A box ``[lo, hi]`` of knob indices is kept only while its bottom corner may meet the bound
    (latency(lo) <= L * (1 + eps_l)) and the LP bound over the box's (gbs, nb) pairs
    (:meth:`Evaluator.box_bound`) may beat the incumbent (bound * (1 + eps_t) >= best); that bound
    is checked first, so a box it prunes costs no simulation. ExeGPT bounds a box by its top
    corner's throughput instead, but a top corner that misses the latency bound may lie past the
    simulator's knee, where more rows lower throughput: llama-2-70b / a100-80gb / G at 2x the
    lowest latency, 4-bit weights refilling every 16 steps, gave 270 tokens/s at 128 x 4 and 382
    (the answer) at 128 x 2, and that bound left 0.954 of exhaustive search (stop 37). Under
    a finite bound the bottom corner is priced first, and a corner that an already priced point
    with no larger knobs and refill level shows to miss the bound (:meth:`Evaluator.misses`;
    latency grows along every knob) is not priced: a bottom corner so known ends the box, a top
    corner so known is not priced. A missing bottom corner ends the box only where every point of
    it is so known (the LP floors decide how far a miss carries, :data:`MEASURED_MONOTONE_SLACK`);
    otherwise the box is searched on. If the top corner meets the bound it is the box's best
    point. Otherwise the box splits in half along its longest knob. With ``corners`` the corners
    that raise one knob alone are priced first (they may be new incumbents) and the split
    goes along the longest other knob than the one whose corner did best (in 2-D: the paper's
    vertical/horizontal rule); on our grids that cost about 25% more evaluations for no better
    plan, so it is off by default.
    """
    best = incumbent
    d = len(space.shape)

    def perf(idx: tuple[int, ...]) -> Evaluation:
        return ev(space.variant, *space.knobs(idx))

    def offer(e: Evaluation) -> None:
        nonlocal best
        if e.meets(kind, bound_s) and _better(e, best, kind):
            best = e

    def viable(lo_e: Evaluation) -> bool:
        return lo_e.fits and lo_e.latency(kind) <= bound_s * (1 + eps_l)

    def hopeless(idx: tuple[int, ...]) -> bool:
        """A corner known to miss the bound, by latency's monotonicity (see ``Evaluator.misses``)."""
        return ev.misses(space.variant, *space.knobs(idx), kind, bound_s * (1 + eps_l))

    def promising(up: float) -> bool:
        return best is None or up * (1 + eps_t) >= best.throughput

    def bottom_ends(lo: tuple[int, ...], hi: tuple[int, ...]) -> bool:
        """Under a finite bound: price the bottom corner, unless known to miss, and say whether
        the box holds nothing more to search (that corner was all of it or does not fit, or it
        misses and so, by the LP floors, does every point)."""
        if not hopeless(lo):
            low_e = perf(lo)
            offer(low_e)
            if lo == hi or not low_e.fits:
                return True
            if low_e.latency(kind) <= bound_s * (1 + eps_l):
                return False
        return lo == hi or all_miss(lo, hi)

    def bottom_ok(lo: tuple[int, ...], hi: tuple[int, ...]) -> bool:
        """Price the bottom corner: whether the box may hold a point meeting the bound, and
        more than one point."""
        low_e = perf(lo)
        offer(low_e)
        return viable(low_e) and lo != hi

    def all_miss(lo: tuple[int, ...], hi: tuple[int, ...]) -> bool:
        """Whether every point of the box is known to miss the bound (:meth:`Evaluator.misses`).
        Points whose nb the block cap clips below the corner's are left out: each is also an
        unclipped point of the grid (the same knobs in effect), searched in its own boxes."""
        small = space.knobs(lo)[1]
        points = {space.knobs((i, j, lo[2])) for i in range(lo[0], hi[0] + 1) for j in range(lo[1], hi[1] + 1)}
        return all(ev.misses(space.variant, *p, kind, bound_s * (1 + eps_l)) for p in points if p[1] >= small)

    def admit(lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
        """Price a box's corners as needed and queue it if it may hold a better point."""
        nonlocal counter
        lp_up = ev.box_bound(space, lo, hi, kind, bound_s * (1 + eps_l))
        if not promising(lp_up):
            return  # pruned without simulating its corners
        # Under a finite bound many boxes hold no point that meets it: the bottom corner (the
        # lowest latency) says so in one simulation, before the top corner is priced.
        if bottom_first and bottom_ends(lo, hi):
            return
        if not (bottom_first and hopeless(hi)):  # a top corner known to miss the bound is not priced
            up_e = perf(hi)
            offer(up_e)
            if up_e.meets(kind, bound_s):
                return  # its top corner is the best it holds
        if not bottom_first and not bottom_ok(lo, hi):
            return
        if promising(lp_up) and lo != hi:
            heapq.heappush(queue, (-lp_up, counter, lo, hi))
            counter += 1

    bottom_first = math.isfinite(bound_s)
    queue: list[tuple[float, int, tuple[int, ...], tuple[int, ...]]] = []
    counter = 0
    admit((0,) * d, tuple(s - 1 for s in space.shape))
    while queue:
        neg_up, _, lo, hi = heapq.heappop(queue)
        if not promising(-neg_up):
            continue
        dims = [k for k in range(d) if hi[k] > lo[k]]
        if not dims:
            continue
        # Corners raising one knob alone: candidates, and the split heuristic.
        best_k, best_e = None, None
        for k in (dims if corners else ()):
            corner = tuple(hi[i] if i == k else lo[i] for i in range(d))
            e = perf(corner)
            offer(e)
            if e.meets(kind, bound_s) and (best_e is None or _better(e, best_e, kind)):
                best_k, best_e = k, e
        others = [k for k in dims if k != best_k] or dims
        k = max(others, key=lambda i: (hi[i] - lo[i], -i))
        mid = (lo[k] + hi[k]) // 2
        admit(lo, tuple(mid if i == k else hi[i] for i in range(d)))
        admit(tuple(mid + 1 if i == k else lo[i] for i in range(d)), hi)
    return best


def polish(ev: Evaluator, best: Evaluation, kind: str, bound_s: float, others: Iterable[Variant] = (),
           refills: Iterable[int] = REFILL_LEVELS, max_steps: int = 32) -> Evaluation:
    """Hill-climb from branch-and-bound's answer over batch shapes next to it.

    The knee ranges and monotonicity are approximations: along a ridge of equal block size the
    simulator can prefer more, smaller GPU batches than the LP's mean shapes suggest (padding,
    transients), and memory may allow a larger block than the knee. Each step prices the
    neighbours (gbs and nb halved or doubled, alone or trading one for the other at the same
    block size; the same shape with another refill interval or under another of the ``others``
    variants) and moves to the best one that meets the bound, until none is better. A neighbour
    whose LP bound cannot beat the step, or that :meth:`Evaluator.misses` knows to miss the
    bound, costs no simulation.
    """
    others, refills = list(others), list(refills)
    cap = ev.job_cap
    for _ in range(max_steps):
        g, nb = best.gbs, best.nb
        r = best.refill_every
        cands = [(best.variant, g2, nb2, r) for g2, nb2 in _shape_moves(g, nb, cap)]
        cands += [(best.variant, g, nb, r2) for r2 in refills if r2 != r]
        cands += [(v, g, nb, r) for v in others if v != best.variant]
        step = best
        for v, g2, nb2, r2 in cands:
            if ev.bound(v, g2, nb2) * (1 + 1e-9) < step.throughput or (
                    math.isfinite(bound_s) and ev.misses(v, g2, nb2, r2, kind, bound_s)):
                continue  # cannot be better, or known to miss the bound: skip the simulation
            e = ev(v, g2, nb2, r2)
            if e.meets(kind, bound_s) and _better(e, step, kind):
                step = e
        if step is best:
            return best
        best = step
    return best


def fill_between(ev: Evaluator, best: Evaluation, kind: str, bound_s: float) -> Evaluation:
    """The GPU batches between ``best``'s and twice it (1.25, 1.5 and 1.75 x) at its nb, refill
    and variant, where one meets the bound with more throughput: the searches' grids hold powers
    of two, and memory often stops between two of them (FlexGen's published 20 x 4 for OPT-30B at
    1024 + 32 tokens fits the t4 preset and priced 7.54 tokens/s against the grid's best, 16 x 4 at
    6.98). At most three evaluations; none where the LP bound cannot beat ``best`` or the shape is
    known to miss the bound."""
    top = best
    for g in sorted({best.gbs + best.gbs * k // 4 for k in (1, 2, 3)} - {best.gbs}):
        if g * best.nb > ev.job_cap or ev.bound(best.variant, g, best.nb) * (1 + 1e-9) < top.throughput or (
                math.isfinite(bound_s) and ev.misses(best.variant, g, best.nb, best.refill_every, kind, bound_s)):
            continue
        e = ev(best.variant, g, best.nb, best.refill_every)
        if e.meets(kind, bound_s) and _better(e, top, kind):
            top = e
    return top


# How far below the best so far a doubling of nb past the knee cap may price and the walk go on.
EXTEND_TOL = 0.01


def extend_past_cap(ev: Evaluator, space: Space, kind: str, bound_s: float,
                    best: Evaluation | None) -> Evaluation | None:
    """Grow the block past the knee cap while that keeps paying, for this space's own best point.

    The cap comes from the LP's mean shapes and can be too cautious; when the best point the
    search priced in this space sits at the cap, double nb while the bound allows a gain and the
    simulator's throughput stays within ``EXTEND_TOL`` of the best so far (a small dip can come
    before a rise: refill and the run's prefix cache flatten the curve), keeping the best (one or
    two evaluations per space, more along such a plateau).
    """
    mine = [e for e in ev.cache.values() if e.variant == space.variant and e.refill_every in space.refill
            and e.meets(kind, bound_s) and e.gbs * e.nb >= space.block_cap]
    if not mine:
        return best
    start = None
    for e in mine:
        start = e if _better(e, start, kind) else start
    top = grow_nb(ev, start, kind, bound_s)
    return top if _better(top, best, kind) else best


def grow_nb(ev: Evaluator, start: Evaluation, kind: str, bound_s: float) -> Evaluation:
    """Double ``start``'s nb while the bound allows a gain and the simulator's throughput stays
    within ``EXTEND_TOL`` of the best so far (meeting the latency bound), looking one doubling past
    a deeper dip and walking on where the throughput rises again; the best seen. (A run's prefix
    cache sized for eight templates priced 2276, 2198, 2226, 2817, ... 3123 tokens/s at nb 2, 4,
    8, 16, ... 128 of two rows: the walk stopped at 2.)"""
    cur = top = start
    while cur.gbs * cur.nb * 2 <= ev.job_cap and ev.bound(cur.variant, cur.gbs, cur.nb * 2) > top.throughput:
        nxt = ev(cur.variant, cur.gbs, cur.nb * 2, cur.refill_every)
        if not (nxt.meets(kind, bound_s) and nxt.throughput > top.throughput * (1 - EXTEND_TOL)):
            past = cur.nb * 4
            if cur.gbs * past > ev.job_cap or ev.bound(cur.variant, cur.gbs, past) <= top.throughput:
                break
            dip, nxt = nxt, ev(cur.variant, cur.gbs, past, cur.refill_every)
            if not (nxt.meets(kind, bound_s) and (_better(nxt, top, kind) or nxt.throughput > dip.throughput)):
                break
        cur = nxt
        if _better(nxt, top, kind):
            top = nxt
    return top


def exhaustive(ev: Evaluator, spaces: list[Space], kind: str, bound_s: float) -> Evaluation | None:
    """Every distinct point of every variant's grid; the best one meeting the bound."""
    best = None
    for space in spaces:
        for g, nb, r in sorted(space.points()):
            e = ev(space.variant, g, nb, r)
            if e.meets(kind, bound_s) and _better(e, best, kind):
                best = e
    return best


def optuna_search(ev: Evaluator, spaces: list[Space], kind: str, bound_s: float, budget: int,
                  seed: int = 0) -> Evaluation | None:
    """Optuna TPE over (variant, knob indices) with ``budget`` trials; infeasible points score
    below every feasible one, more so the further they miss the bound."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    best = None

    def objective(trial: Any) -> float:
        nonlocal best
        s = spaces[trial.suggest_int("variant", 0, len(spaces) - 1)]
        idx = tuple(min(trial.suggest_int(name, 0, max(sp.shape[i] for sp in spaces) - 1), s.shape[i] - 1)
                    for i, name in enumerate(("gbs", "nb", "refill")))
        e = ev(s.variant, *s.knobs(idx))
        if e.meets(kind, bound_s):
            if _better(e, best, kind):
                best = e
            return e.throughput
        if not e.fits:
            return -10.0
        return -min(e.latency(kind) / bound_s, 9.0)

    study.optimize(objective, n_trials=max(1, budget))
    return best


def lowest_latency(ev: Evaluator, spaces: list[Space], kind: str) -> Evaluation | None:
    """The point with the lowest latency: by monotonicity, one of the variants' bottom corners,
    or anything already evaluated that did better."""
    for s in spaces:
        ev(s.variant, *s.knobs((0, 0, 0)))
    fitting = [e for e in ev.cache.values() if e.fits]
    return min(fitting, key=lambda e: (e.latency(kind), -e.throughput)) if fitting else None


def pareto(evals: Iterable[Evaluation], kind: str) -> list[Evaluation]:
    """Points no other point beats in both latency and throughput, by rising latency."""
    pts = sorted((e for e in evals if e.fits), key=lambda e: (e.latency(kind), -e.throughput))
    out: list[Evaluation] = []
    for e in pts:
        if not out or e.throughput > out[-1].throughput * (1 + 1e-9):
            out.append(e)
    return out


@dataclass(frozen=True)
class SearchOutcome:
    best: Evaluation | None
    method: str
    evaluations: int
    grid_points: int
    lp_solves: int
    wall_s: float


def repair(ev: Evaluator, start: Evaluation, kind: str, bound_s: float, max_steps: int = 16) -> Evaluation | None:
    """From a point that misses the bound or does not fit (a running policy after its workload
    grew), the nearest smaller batch shapes that meet it: each step halves nb or gbs, or tries
    another refill interval, moving to the best neighbour that meets the bound, else to the fitting one with
    the lowest latency (else the smaller shape that still does not fit), until one meets the bound.
    None when none does within ``max_steps`` (the caller then searches without a start)."""
    cur = start
    for _ in range(max_steps):
        if cur.meets(kind, bound_s):
            return cur
        g, nb, r = cur.gbs, cur.nb, cur.refill_every
        # every other refill interval: latency is not monotone along them (Evaluator.misses)
        cands = [(g, nb // 2, r), (g // 2, nb, r)] + [(g, nb, r2) for r2 in REFILL_LEVELS if r2 != r]
        tried = [ev(cur.variant, *k) for k in cands if k[0] >= 1 and k[1] >= 1]
        evals = [e for e in tried if e.fits]
        if not evals:
            smaller = [e for e in tried if (e.gbs, e.nb) != (g, nb)]
            if not smaller:
                return None
            cur = min(smaller, key=lambda e: e.gbs * e.nb)  # nothing fits yet: keep shrinking
            continue
        meeting = [e for e in evals if e.meets(kind, bound_s)]
        cur = (max(meeting, key=lambda e: (e.throughput, -e.latency(kind))) if meeting
               else min(evals, key=lambda e: e.latency(kind)))
    return cur if cur.meets(kind, bound_s) else None


def warm_start(ev: Evaluator, start: tuple[Variant, int, int, int], kind: str, bound_s: float,
               others: Iterable[Variant] = (), refills: Iterable[int] = REFILL_LEVELS) -> Evaluation | None:
    """The best point near a running policy's knobs: price them on the evaluator's (new)
    workload, shrink the batch until the bound holds (:func:`repair`), then hill-climb
    (:func:`polish`); knobs that no longer fit (a smaller budget) shrink the same way. None when
    no smaller batch meets the bound within :func:`repair`'s steps."""
    ok = repair(ev, ev(*start), kind, bound_s)
    return None if ok is None else polish(ev, ok, kind, bound_s, others, refills)


def _shape_moves(g: int, nb: int, cap: int, trades: bool = True, diagonals: bool = False) -> list[tuple[int, int]]:
    """Batch shapes next to (g, nb): gbs or nb halved or doubled, or (``trades``) traded at the
    same block size, or (``diagonals``) both doubled, within the job's block cap."""
    moves = [(2 * g, nb), (g // 2, nb), (g, 2 * nb), (g, nb // 2)]
    if trades:
        moves += [(2 * g, nb // 2), (g // 2, 2 * nb)]
    if diagonals:
        moves.append((2 * g, 2 * nb))
    return [(g2, nb2) for g2, nb2 in moves if 1 <= g2 <= cap and 1 <= nb2 and g2 * nb2 <= cap]


def _jump(ev: Evaluator, best: Evaluation, kind: str, bound_s: float, refills: list[int],
          trades: bool = True, others: Iterable[Variant] = ()) -> Evaluation:
    """One shape step (:func:`_shape_moves`) together with another refill interval: moves that pay only
    together (a ridge the one-knob climb of :func:`polish` cannot cross); climbs on from the
    best of them. Shapes whose LP bound cannot beat the point, and points known to miss the bound
    (:meth:`Evaluator.misses`), cost no simulation. The best
    refill interval moves with the shape: opt-175b on t4, workload T, unbounded, polished to nb 4
    without refill, 0.945 of exhaustive search's nb 2 with refill every 16 steps; on a100-80gb,
    G, a trade of gbs for nb with another interval was 4.4% better (the re-planner, which has
    a second's budget, leaves trades out: 12% longer re-plans). With ``others``, the same and the
    neighbouring shapes under another variant too: opt-175b on t4, workload T, 1.25x the lowest
    latency, once branch-and-bound no longer trusted the refill order, ended on a 4-bit cache
    at 32 x 2 (0.874) where the 4-bit-weights, CPU-attention variant at 32 x 1 refilling every 16
    steps was best; the variant, the shape and the interval had to change together.

    The shapes include both knobs doubled (with ``trades``), and a jump that pays is
    followed by another, up to :data:`JUMP_ROUNDS`: on a fuzz's perturbed t4 profile (opt-6.7b,
    G, 1.5x the lowest latency) the climb stopped at 4-bit weights 32 x 1 refilling every 16
    steps (0.707 of exhaustive search), whose best plan was 64 x 2 without refill, and at 1.1x
    one jump reached 32 x 1 every 64 steps (0.927) where a second reached the answer, 64 x 1."""
    cap = ev.job_cap
    for _ in range(JUMP_ROUNDS):
        jump = best
        near = _shape_moves(best.gbs, best.nb, cap, trades, diagonals=trades)
        moves = [(best.variant, g2, nb2) for g2, nb2 in near]
        moves += [(v, g2, nb2) for v in others if v != best.variant for g2, nb2 in [(best.gbs, best.nb)] + near]
        for v, g2, nb2 in moves:
            if ev.bound(v, g2, nb2) * (1 + 1e-9) < jump.throughput:
                continue
            for r in refills:
                known_miss = math.isfinite(bound_s) and ev.misses(v, g2, nb2, r, kind, bound_s)
                climbed = (v, r) == (best.variant, best.refill_every) and (g2, nb2) != (2 * best.gbs, 2 * best.nb)
                if climbed or known_miss:  # polish priced the one-knob steps; not the doubled pair
                    continue
                e = ev(v, g2, nb2, r)
                if e.meets(kind, bound_s) and _better(e, jump, kind):
                    jump = e
        if jump is best:
            return best
        best = polish(ev, jump, kind, bound_s, others, refills)
    return best


def warm_search(ev: Evaluator, variants_: Iterable[Variant], start: tuple[int, int, int], kind: str,
                bound_s: float, refills: Iterable[int] = REFILL_LEVELS) -> SearchOutcome:
    """A re-plan's search: the running policy's knobs ``start`` = (gbs, nb, refill) are the
    starting point in every variant (:func:`warm_start` within it, then :func:`_jump`), and the
    best of those is hill-climbed once more across variants.

    A drift of a few tens of percent moves the best batch shape by a factor of two or so, which
    the climb covers in a few steps; it needs no knee walks (placement LPs over the whole grid)
    and no branch-and-bound, so it prices 30-130 points and 15-55 LPs instead of 100-200 and 160-330.
    ``benchmarks/drift.py`` and ``tests/test_replan.py`` compare it with exhaustive search.
    """
    t0, e0, l0 = time.perf_counter(), ev.evaluations, ev.lp_solves
    vs, refills = list(dict.fromkeys(variants_)), list(refills)
    found = [e for e in (warm_start(ev, (v, *start), kind, bound_s, (), refills) for v in vs) if e is not None]
    best = None
    if found:
        top = max(e.throughput for e in found)
        for e in found:  # jumps cost ~16 simulations: only for variants within JUMP_WITHIN of the best
            if e.throughput >= JUMP_WITHIN * top:
                e = _jump(ev, e, kind, bound_s, refills, trades=False)
            if _better(e, best, kind):
                best = e
    if best is not None and len(vs) > 1:
        best = polish(ev, best, kind, bound_s, vs, refills)
    return SearchOutcome(best, "warm", ev.evaluations - e0, 0, ev.lp_solves - l0, time.perf_counter() - t0)


def search(ev: Evaluator, spaces: list[Space], kind: str, bound_s: float, method: str = "bnb", *,
           eps_t: float = 0.01, eps_l: float = LATENCY_TOLERANCE, budget: int | None = None, seed: int = 0,
           refill_outer: bool = True) -> SearchOutcome:
    """Run one search method over ``spaces`` (one per variant) with a fresh count of evaluations.

    ``refill_outer``: branch-and-bound treats the refill interval as an outer choice (one 2-D
    search over gbs x nb per level) instead of a third monotone knob. Refilling more often
    raises throughput while weights stay resident, but each refill's prefill fetches offloaded
    weights again, so with weights off the device it lowers throughput: not monotone.

    The evaluator's cache is shared, so counts are those of the points this call asked for that
    were not already priced: pass a fresh :class:`Evaluator` to count a search on its own.
    """
    t0, e0, l0 = time.perf_counter(), ev.evaluations, ev.lp_solves
    grid = sum(len(s.points()) for s in spaces)
    if method == "bnb":
        best = None
        if refill_outer:
            spaces = [replace(s, refill=[r]) for s in spaces for r in s.refill]
        for space in _bnb_order(ev, spaces):
            best = branch_and_bound(ev, space, kind, bound_s, eps_t, eps_l, best)
        variants_ = list(dict.fromkeys(sp.variant for sp in spaces))
        refills = sorted({r for sp in spaces for r in sp.refill})
        extended = None
        for space in spaces:  # after the search, so that it does not change what was pruned
            extended = extend_past_cap(ev, space, kind, bound_s, extended)
        # Polish from several starts, hill-climbing being path-dependent: the best point, the
        # extension's, and each other variant's best when within POLISH_WITHIN of it; then the
        # shape-and-refill jump from the answer alone (jumps from the other climbs' ends never
        # changed the answer over plan_quality's 160 cells, and cost 2.4% of its evaluations).
        starts = [e for e in (best, extended) if e is not None]
        if best is not None:
            own: dict[Variant, Evaluation] = {}
            for e in ev.cache.values():
                if e.meets(kind, bound_s) and _better(e, own.get(e.variant), kind):
                    own[e.variant] = e
            starts += [e for v, e in own.items() if v != best.variant and e.throughput >= POLISH_WITHIN * best.throughput]
        seen = set()
        for start in starts:
            if (key := (start.variant, start.gbs, start.nb, start.refill_every)) in seen:
                continue
            seen.add(key)
            cand = polish(ev, start, kind, bound_s, variants_, refills)
            if _better(cand, best, kind) or best is None:
                best = cand
        if best is not None:  # (a climb stops at a dip that larger blocks climb out of: look past it)
            best = _jump(ev, grow_nb(ev, best, kind, bound_s), kind, bound_s, refills, others=variants_)
            best = grow_nb(ev, best, kind, bound_s)  # (the jump can land before such a dip too)
    elif method == "exhaustive":
        best = exhaustive(ev, spaces, kind, bound_s)
    elif method == "optuna":
        if budget is None:
            raise ValueError("optuna search needs a budget (number of evaluations)")
        best = optuna_search(ev, spaces, kind, bound_s, budget, seed)
    else:
        raise ValueError(f"unknown search method {method!r}")
    return SearchOutcome(best, method, ev.evaluations - e0, grid, ev.lp_solves - l0, time.perf_counter() - t0)


def grow_prefix_caches(ev: Evaluator, best: Evaluation, kind: str, bound_s: float,
                       tries: int = GROW_TRIES, scan: bool = True) -> Evaluation:
    """The fastest point with its prefix cache grown (:func:`grow_prefix_cache`), or ``best``
    where none gains: the ``tries`` fastest batch shapes the search met that meet the bound, and
    every shape of powers of two (gbs x nb within the job) under their variants, at ``best``'s
    refill interval. The search prices every point with the default room, and a smaller batch
    leaves more room for the cache: on an evaluation suite of 57 templates its answer, 128 x 8,
    grew to 185.0 tokens/s, the next fastest shape (64 x 16) to 205.3 and 16 x 8, which the
    search priced at 105.4, to 229.5. The grown throughput is not monotone in the shape (how the
    placement fills memory decides the room; 32 x 16 grew to 159.9) and a grown cache can beat
    the default room's LP bound, so no bound prunes this and no climb would cross its dips.
    ``scan`` False grows the ``tries`` shapes only (a re-plan mid-job: the scan costs about two
    simulations per shape, 5.7 s on that suite). Grown shapes within ``GROW_TIE`` of the fastest
    are compared on ``GROW_SEEDS`` draws."""
    w = ev.workload
    if best.policy is None or not best.fits or not w.prefix_tokens or \
            _room_for_every_prefix(w) <= workload_cache_positions(w):
        return best  # (the default room holds every prefix)

    def grown(e: Evaluation) -> Evaluation:
        return grow_prefix_cache(ev, e, kind, bound_s) if e.fits and e.meets(kind, bound_s) else e

    # (one try per batch shape and variant: its refill levels grow alike, and a job of short
    # outputs prices them all the same)
    pool = sorted((e for e in ev.cache.values() if e.policy is not None and e.meets(kind, bound_s)),
                  key=lambda e: -e.throughput)
    shapes = [(best.variant, best.gbs, best.nb)]
    for e in pool:
        if len(shapes) >= tries:
            break
        if (e.variant, e.gbs, e.nb) not in shapes:
            shapes.append((e.variant, e.gbs, e.nb))
    cap = ev.job_cap
    powers = [1 << k for k in range(cap.bit_length()) if 1 << k <= cap]
    for v in dict.fromkeys(v for v, _g, _nb in shapes) if scan else ():
        shapes += [(v, g, nb) for g in powers for nb in powers if g * nb <= cap and (v, g, nb) not in shapes]
    # (a shape the search missed that is faster with the default room is not this step's to take:
    # only grown ones compete)
    found = [e for e in (grown(ev(v, g, nb, best.refill_every)) for v, g, nb in shapes)
             if e.policy is not None and e.policy.prefix_cache_positions is not None and e.meets(kind, bound_s)
             and e.throughput > best.throughput]
    if not found:
        return best
    # Shapes within GROW_TIE of the fastest are told apart on more draws of which template each
    # prompt gets: one draw decided between them on a small job (8 x 16 at 17.69 tokens/s over
    # 16 x 8 at 17.66 on SmolLM2's 256 prompts; seeds 1 and 2 priced 18.63 and 18.62 against 18.96
    # and 19.33, and 16 x 8 ran 7% faster).
    return settle_near_ties(ev, max(found, key=lambda e: e.throughput), kind, bound_s, found, GROW_TIE,
                            GROW_SEEDS)[0]


def settle_near_ties(ev: Evaluator, best: Evaluation, kind: str, bound_s: float, pool: Iterable[Evaluation],
                     within: float = NEAR_TIE, draws: int = NEAR_SEEDS) -> tuple[Evaluation, dict[Policy, float]]:
    """Of ``best`` and the points of ``pool`` that meet the bound within ``within`` of its
    throughput (at most ``GROW_TIE_SHAPES``, fastest first, one per policy in effect), the one
    with the highest mean throughput over ``draws`` draws of the job (the evaluator's seed and
    the next ones), with the means compared (by policy; empty where nothing else was near). The
    simulator prices a point on one draw of the requests; where prompts share prefixes, which
    template each gets moves a small job's blocks, and shapes 10% apart on one draw came out
    level or the other way round on the mean of five."""
    job, w = ev.num_requests, ev.workload
    near: dict[Policy, Evaluation] = {}
    # (``best`` first: its policy in effect stands for itself, and it is always compared)
    for e in [best, *sorted(pool, key=lambda e: -e.throughput if e.policy is not None else 0.0)]:
        if e.policy is not None and e.meets(kind, bound_s) and e.throughput >= (1 - within) * best.throughput:
            near.setdefault(in_effect(e.policy, job, w.output.max_len, w.output.min_len), e)
    if len(near) <= 1:
        return best, {}
    seeds = [ev.seed + k for k in range(1, draws)]
    means = {e.policy: (e.throughput + sum(ev.simulate(e.policy, seed=s).throughput_tokens_per_s
                                           for s in seeds)) / draws for e in list(near.values())[:GROW_TIE_SHAPES]}
    return max((e for e in near.values() if e.policy in means), key=lambda e: means[e.policy]), means


def _room_for_every_prefix(w: Workload) -> int:
    """Cache positions that hold every prefix ``w`` lists, with the cost model's slack."""
    return math.ceil(PREFIX_CACHE_SLACK * float(w.prefix_table[0].sum()))


def grow_prefix_cache(ev: Evaluator, best: Evaluation, kind: str, bound_s: float) -> Evaluation:
    """``best`` with the run's prefix cache grown past its default room (at most
    ``PREFIX_CACHE_PROMPTS`` prompts' worth) toward room for every prefix of the workload, within
    ``CACHE_ROOM_SHARE`` of what each tier leaves free; kept where the simulator prices it at
    least as fast and within the bound. A job of many task templates (an evaluation suite's
    few-shot prompts) otherwise computes every template the cache cannot keep again at each
    refill and block."""
    w, policy = ev.workload, best.policy
    if policy is None or not best.fits or not w.prefix_tokens:
        return best
    base = workload_cache_positions(w)
    want = _room_for_every_prefix(w)
    if want <= base:
        return best
    cm = CostModel.for_policy(ev.spec, ev.profile, policy)
    peak = functools.partial(cm.peak_bytes, policy, w.prompt.max_len, w.output.max_len)
    now = peak(base)
    room = {t: now[t] + CACHE_ROOM_SHARE * (ev.profile.capacity_bytes(t) - now[t]) for t in now}
    fits = lambda c: all(v <= room[t] for t, v in peak(c).items())  # noqa: E731
    lo, hi = base, want
    if not fits(hi):
        while hi - lo > 1:  # peak bytes grow with the positions: the largest that fits
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        hi = lo
    if hi <= base:
        return best
    grown = replace(policy, prefix_cache_positions=hi)
    cand = Evaluation(best.variant, best.gbs, best.nb, best.refill_every, grown, ev.simulate(grown))
    if not all(fits_in(cand.result.peak_bytes, ev.profile).values()):
        return best
    return cand if cand.meets(kind, bound_s) and cand.throughput >= best.throughput else best


def _bnb_order(ev: Evaluator, spaces: list[Space]) -> list[Space]:
    """Spaces with the highest LP bound first: their incumbent prunes the others hardest, and
    ordering costs LP solves only (the stable sort keeps the refill levels' order)."""
    return sorted(spaces, key=lambda s: -ev.box_bound(s, (0, 0, 0), tuple(n - 1 for n in s.shape)))
