"""Placement LP: where weights, KV cache and activations live, for fixed batch knobs.

For fixed ``(gbs, nb, compress_weight, compress_cache, cpu_attention)`` the nine fractions
``wg..hd`` are the only unknowns, and every cost-model term is affine in them
(``xsimulator.costmodel``), so the best placement is a linear program (FlexGen §4.3, App. A.3):

    minimise   (L * (t_prefill + n * t_decode) + head) / (gbs * nb * n)     seconds per token
    subject to t_phase >= group   for every parallel group of that phase's layer step
               sum(resident) + transient <= capacity   for every tier and transient
               each placement trio sums to 1, fractions in 0..1

The ``max`` over groups that run concurrently becomes ``t >= group`` constraints (minimax
reformulation, seed 004 §2.1.3). The representative block is the workload's typical shape:
GPU batches of ``gbs`` rows padded to the mean prompt, ``n`` = mean output decode steps at the
mean context. Memory uses the longest prompt and output, as the simulator and runner do.

The LP's fractions are then rounded to what the runner can place (:func:`round_placement`):
weights by whole layers, KV cache and activations by whole rows of a GPU batch, with
``xsimulator.policy.split_counts``; memory is re-checked and units move to slower tiers until
every tier fits. Other whole-layer weight splits are then priced exactly (the weights fixed, the
LP over the rest), since the relaxation cannot see that a layer is fetched whole or, with at most
two off the gpu, not at all (:func:`_whole_layer_search`). The cheapest rounded policy is what
gets simulated and reported.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Mapping

import pulp

from workloads.workload import Workload
from xprofiler.profile import TIERS, HardwareProfile
from xprofiler.specs import ModelSpec
from xsched.errors import UserError
from xsimulator.costmodel import (CostModel, MemoryTerms, prefix_groups_in_batch, workload_cache_positions,
                                  shared_prefix_rows, uncached_prefix_share)
from xsimulator.policy import PLACEMENT_VARS, Policy, split_counts

TRIOS: tuple[tuple[str, str, str], ...] = (("wg", "wc", "wd"), ("cg", "cc", "cd"), ("hg", "hc", "hd"))
# Among placements the LP prices alike, offloading weights is the last resort: the relaxation
# prices a layer split over tiers as the mean of its parts, but the runner moves whole layers, each
# bound by its own tier, while KV-cache and activation rows split within every layer. rtx3090 /
# opt-30b / G at gbs 16: half the weights on cpu or most of the cache on cpu, 0.0216 s per token
# either way in the LP; rounded, the weights' half cost 0.0320 s and the cache's 0.0216 s.
WEIGHT_TIE = 8.0
TIE_BREAK = 1e-6  # objective weight of slow-tier fractions, against ~1 for the normalised time
# A rounded placement priced over this many times the relaxation's optimum is worth a descent over
# whole-layer weight splits (:func:`_whole_layer_search`). On opt-6.7b / t4 / G's grid, of the
# 36 points where some gpu/cpu split beat the rounded relaxation by over 2%, the search got within
# 2% of the best split at 28 (the worst 0.910). Of six plan_quality cells, the descent at 1.05 raised
# exhaustive search's best plan in one (opt-30b / t4 / C2 at 1.25x, 1.044x), which 1.1 keeps, for
# 30% fewer LP solves on opt-175b / t4 (1389 against 1803 per 480 placements, before splits whose
# resident layers alone overflow the gpu were skipped: 868 now; 643 without the search).
WHOLE_LAYER_GAP = 1.1


@dataclass(frozen=True)
class Shape:
    """The representative block the LP prices: padded prompt, decode steps, their mean context,
    and the longest prompt/output that size the buffers."""

    prompt_len: int
    decode_steps: int
    decode_context: int
    max_prompt: int
    max_output: int
    samples: int = 1  # outputs per prompt (Workload.samples): a GPU batch prefills each prompt once
    prefix_tokens: int = 0  # leading tokens the mean prompt shares (Workload.mean_prefix_tokens): prefilled once per run
    prefix_groups: float = 1  # distinct such prefixes, one per prompt (Workload.effective_prefix_groups)
    cache_positions: int | None = None  # the run's prefix cache (costmodel.workload_cache_positions); None: max_prompt
    prefix_lengths: tuple[int, ...] = ()  # each prefix's length where they differ (Workload.prefix_lengths)

    @classmethod
    def of(cls, workload: Workload) -> "Shape":
        prompt = max(1, round(workload.prompt.mean))
        steps = max(1, round(workload.output.mean))
        return cls(prompt, steps, prompt + max(1, round(steps / 2)), workload.prompt.max_len,
                   workload.output.max_len, workload.samples, workload.mean_prefix_tokens,
                   workload.effective_prefix_groups, workload_cache_positions(workload), workload.prefix_lengths)

    def head_rows(self, phase: str, rows: int) -> float:
        """Rows of a GPU batch of ``rows`` whose last position the LM head multiplies in ``phase``:
        in prefill one per prompt (its samples share the prefill), whatever prefixes they share."""
        if phase != "prefill" or self.samples <= 1:
            return rows
        return max(rows / self.samples, 1.0)

    def computed(self, phase: str, rows: int, nb: int = 1) -> float:
        """Rows' worth of positions a GPU batch of ``rows`` (of ``nb`` joining together) computes
        in ``phase``: in prefill, one per prompt when its samples fill the batch in whole runs, and
        each shared prefix once wherever that saves anything (the fewest, so the LP's rate stays a
        bound), as many prefixes as the batch is expected to hold (``prefix_groups_in_batch``),
        computing its share of the block's distinct ones (later batches take what earlier ones
        computed: ``xrunner.prefix.plan_block``) that the run's prefix cache does not keep."""
        if phase != "prefill":
            return rows
        c = self.head_rows(phase, rows)
        if not self.prefix_tokens:
            return c
        groups = prefix_groups_in_batch(c, c * nb, self.prefix_groups)
        # (not in place: min() may return ``groups`` itself, and scaling it scaled both; a batch of
        # one row then read as computing its prefix, though it takes it from the cache)
        own = min(groups, prefix_groups_in_batch(c * nb, c * nb, self.prefix_groups, ordered=False) / nb) \
            * uncached_prefix_share(self.max_prompt if self.cache_positions is None else self.cache_positions,
                                    self.prefix_tokens, round(self.prefix_groups), self.prefix_lengths or None)
        return float(shared_prefix_rows(c, self.prompt_len, self.prefix_tokens, bound=True, groups=groups, own=own))


@dataclass(frozen=True)
class Placement:
    """An LP solution: the relaxed fractions, the rounded policy and their per-token seconds."""

    fractions: dict[str, float]  # the LP's real-valued optimum
    lp_token_s: float  # its objective: seconds per generated token of the representative block
    policy: Policy  # rounded to whole layers / rows and re-checked against memory
    token_s: float  # the rounded policy's seconds per token (>= lp_token_s, except where the LP's
    # constant charges overstate the runner's: two staging or relay slots, a fetch for staged layers)
    moved_units: int  # layers/rows moved to slower tiers after rounding to make memory fit
    emptying_token_s: float = 0.0  # the same at each phase's cheapest row count (<= token_s)


class _CachedSizes(CostModel):
    """The cost model with its per-layer byte counts computed once: they walk the spec's tensor
    list on every access, and rounding a placement reads them a few hundred times."""

    layer_matmul_bytes = functools.cached_property(CostModel.layer_matmul_bytes.fget)  # type: ignore[assignment]
    layer_stored_bytes = functools.cached_property(CostModel.layer_stored_bytes.fget)  # type: ignore[assignment]

    @functools.cached_property
    def step_memo(self) -> dict[tuple, float]:
        """Priced layer steps of numeric placements: a third of one ``place`` call's are repeats
        (the rounded relaxation, each candidate's base, the reference step of every LP)."""
        return {}


def _var(prob: "pulp.LpProblem", name: str, low: float | None = None, up: float | None = None,
         cat: str = "Continuous") -> "pulp.LpVariable":
    """A variable of ``prob``: PuLP >= 3.3 wants them made by the problem (a bare LpVariable warns
    on every call, thousands per search); older PuLP only has the bare constructor."""
    add = getattr(prob, "add_variable", None)
    if add is not None:
        return add(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


@functools.cache  # one solver object per process: making one starts a Highs() (the banner guard below)
def lp_solver() -> pulp.LpSolver:
    """HiGHS in-process when ``highspy`` is installed (about 2 ms a solve), else CBC, which PuLP
    runs as a subprocess (10-40 ms a solve, most of it process start-up)."""
    highs = getattr(pulp, "HiGHS", None)  # PuLP >= 2.8
    if highs is None or not highs(msg=False).available():
        return pulp.PULP_CBC_CMD(msg=False)
    highs = highs(msg=False)
    import highspy

    # The first Highs() of a process prints a banner on stdout whatever its options; stdout may
    # be the JSON a user asked for, so the banner goes to /dev/null (once: later ones are silent).
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    return highs


def _knob_policy(gbs: int, nb: int, compress_weight: bool, compress_cache: bool, cpu_attention: bool,
                 overlap: bool, fractions: Mapping[str, float] | None = None) -> Policy:
    return Policy(gbs=gbs, nb=nb, compress_weight=compress_weight, compress_cache=compress_cache,
                  cpu_attention=cpu_attention, overlap=overlap, **(dict(fractions) if fractions else {}))


def token_seconds(cm: CostModel, placement: Mapping[str, Any], gbs: int, nb: int, shape: Shape,
                  phase_time: Any = None, whole_layers: bool = True) -> Any:
    """Seconds per generated token of the representative block (numeric, or an LP expression when
    ``phase_time`` gives the LP's minimax variables for the prefill and decode layer steps).
    ``whole_layers``: as the runner places weights (``CostModel.mean_layer_seconds``); off, the
    LP's relaxation of the same fractions."""
    if phase_time is None:
        pre, dec = (_layer_step_s(cm, placement, phase, gbs, length, nb, whole_layers, shape.computed(phase, gbs, nb))
                    for phase, length in _phases(shape))
    else:
        pre, dec = phase_time
    n = shape.decode_steps
    prompts = shape.head_rows("prefill", gbs)  # (the head's rows: a shared prefix saves it nothing)
    head = nb * (float(cm.head_seconds("prefill", prompts, shape.prompt_len, nb * prompts))
                 + n * float(cm.head_seconds("decode", gbs, shape.decode_context, nb * gbs)))
    block_s = cm.spec.num_layers * (pre + n * dec) + head
    return block_s * (1.0 / (gbs * nb * n))


def emptying_token_seconds(cm: CostModel, placement: Mapping[str, Any], gbs: int, nb: int, shape: Shape) -> float:
    """Seconds per generated token of the representative block, each phase at its cheapest rows.

    A block's GPU batches empty as requests finish, so its steps run at any row count up to
    ``gbs``. Where a measured fit costs more per row at more rows (SmolLM2 on a 2-core VM under
    load: a decode layer 2.8 ms at one row, 8.9 ms at two), a block that prefills full and decodes
    emptied beats :func:`token_seconds` (1.33x). Here each request pays one prefill and the mean
    output's decode steps, each at the cheapest per-row cost over the powers of two up to
    ``gbs``; equal to :func:`token_seconds` when more rows never cost more per row."""
    L = cm.spec.num_layers
    prefill, decode = (min((L * float(_layer_step_s(cm, placement, phase, r, length, nb,
                                                    computed=shape.computed(phase, r, nb)))
                            + nb * float(cm.head_seconds(phase, shape.head_rows(phase, r), length,
                                                         nb * shape.head_rows(phase, r)))) / (r * nb)
                           for r in (2 ** k for k in range(gbs.bit_length())))
                       for phase, length in _phases(shape))
    return prefill / shape.decode_steps + decode


def _phases(shape: Shape) -> tuple[tuple[str, int], tuple[str, int]]:
    """The representative block's prefill and decode steps, with the length each is priced at."""
    return ("prefill", shape.prompt_len), ("decode", shape.decode_context)


def _layer_step_s(cm: CostModel, placement: Mapping[str, Any], phase: str, rows: int, length: int, nb: int,
                  whole_layers: bool = True, computed: float | None = None) -> Any:
    """One layer step of a block of ``nb`` GPU batches of ``rows`` rows (weights fetched once), of
    which ``computed`` are computed (:meth:`Shape.computed`; default all)."""
    c = rows if computed is None else computed
    memo = getattr(cm, "step_memo", None)
    key = None
    if memo is not None and all(isinstance(v, (int, float)) for v in placement.values()):
        key = (tuple(sorted(placement.items())), phase, rows, length, nb, whole_layers, c)
        if key in memo:
            return memo[key]
    step = cm.mean_layer_seconds(cm.batch_terms(phase, rows, length, placement, c).scaled(nb), placement,
                                 whole_layers=whole_layers, tokens=nb * cm.step_tokens(phase, c, length))
    if key is not None:
        memo[key] = step
    return step


def fits(cm: CostModel, profile: HardwareProfile, policy: Policy, shape: Shape) -> dict[str, float]:
    """Bytes by which each tier is over its capacity (empty when everything fits)."""
    peaks = cm.peak_bytes(policy, shape.max_prompt, shape.max_output, shape.cache_positions)
    return {t: peaks[t] - profile.capacity_bytes(t) for t in TIERS if peaks[t] > profile.capacity_bytes(t)}


# Weight buffers the runner double-buffers: (tier, buffer name, placement variables whose layers
# need it, the tiers faster than where those layers live).
STAGED: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("gpu", "weight_stage", ("wc", "wd"), ("gpu",)), ("cpu", "weight_relay", ("wd",), ("gpu", "cpu")))


def _slot_bytes(cm: CostModel, shape: Shape) -> dict[str, float]:
    """Bytes of one staging slot per buffer (from the cost model's own memory list)."""
    off_all = {v: (1.0 if v.endswith("d") else 0.0) for v in PLACEMENT_VARS}  # every layer on disk
    full = cm.memory(off_all, 1, 1, shape.max_prompt, shape.max_output, shape.cache_positions)
    return {name: float(full[tier].resident[name]) / min(2, cm.spec.num_layers) for tier, name, _, _ in STAGED}


def _staging_can_shrink(cm: CostModel, profile: HardwareProfile) -> list[str]:
    """Buffers that can hold fewer than two slots: fewer than two layers off their tier(s) is
    possible only when ``L - 1`` layers fit in the faster tiers."""
    near_all = (cm.spec.num_layers - 1) * cm.layer_stored_bytes
    return [name for _, name, _, faster in STAGED
            if near_all <= sum(float(profile.capacity_bytes(t)) for t in faster)]


def _exact_staging(prob: pulp.LpProblem, cm: CostModel, profile: HardwareProfile, x: dict[str, Any],
                   mem: dict[str, MemoryTerms], shape: Shape) -> dict[str, MemoryTerms]:
    """Replace the cost model's constant two staging slots by the exact ``min(2, ceil(k))``.

    The runner double-buffers fetched layers: ``k`` offloaded layers need ``min(2, k)`` slots
    (weight_stage on the gpu tier for cpu+disk layers, weight_relay on the cpu tier for disk
    layers). A linear expression cannot say that, so the cost model charges 2 slots, which
    keeps an all-gpu placement out of the LP when it fits only without staging. Two binaries
    per buffer make it exact (a small MILP): ``z1`` (any layer off the tier) and ``z2 <= z1``
    (more than one), with ``L * fraction <= z1 + (L - 1) * z2`` and ``z1 + z2`` slots.
    """
    L = cm.spec.num_layers
    slot = _slot_bytes(cm, shape)
    out = dict(mem)
    for tier, name, off, _ in STAGED:
        if name not in _staging_can_shrink(cm, profile):
            continue
        z1 = _var(prob, f"{name}_any", cat=pulp.LpBinary)
        z2 = _var(prob, f"{name}_two", cat=pulp.LpBinary)
        prob += z2 <= z1, f"{name}_order"
        prob += pulp.lpSum(x[v] for v in off) * L <= z1 + (L - 1) * z2, f"{name}_count"
        resident = dict(mem[tier].resident)
        resident[name] = (z1 + z2) * slot[name]
        out[tier] = replace(mem[tier], resident=resident)
    return out


def _needs_exact_staging(cm: CostModel, profile: HardwareProfile, status: str, frac: dict[str, float],
                         gbs: int, nb: int, shape: Shape) -> bool:
    """Whether the MILP of :func:`_exact_staging` may find a better placement than the LP.

    The MILP costs 2-3x an LP solve, so it runs only where the LP's two slots can have
    mattered: the LP found nothing, or its answer keeps fewer than two layers off a tier (the
    exact charge is smaller) while that tier's memory is binding. When the LP's answer has two
    or more layers off, its charge is exact there; a placement with fewer layers off that only
    the exact charge admits is then not looked for.
    """
    shrinkable = _staging_can_shrink(cm, profile)
    if not shrinkable:
        return False
    if status != "Optimal":
        return True
    L = cm.spec.num_layers
    slot = _slot_bytes(cm, shape)
    peaks = cm.peak_bytes(_knob_policy(gbs, nb, cm.compress_weight, cm.compress_cache, cm.cpu_attention,
                                       cm.overlap, frac), shape.max_prompt, shape.max_output, shape.cache_positions)
    for tier, name, off, _ in STAGED:
        exact = min(2, math.ceil(L * sum(frac[v] for v in off) - 1e-9))
        over = (2 - exact) * slot[name]  # what the LP charged beyond the runner's buffers
        if name in shrinkable and over > 0 and peaks[tier] + over >= float(profile.capacity_bytes(tier)) * (1 - 1e-6):
            return True
    return False


def _solve(cm: CostModel, profile: HardwareProfile, gbs: int, nb: int, shape: Shape,
           elastic: bool = False, exact_staging: bool = False, weights: Mapping[str, float] | None = None
           ) -> tuple[str, dict[str, float], float, dict[str, float]]:
    """Build and solve the LP. ``elastic`` adds a shortfall variable per tier (bytes over
    capacity) and minimises total shortfall instead: how far from fitting the knobs are.

    Returns (status, fractions, objective, shortfall bytes per tier). Times are expressed in
    units of an all-on-gpu reference step and bytes in units of each tier's capacity, so the
    LP is well conditioned whatever the machine's scale.
    """
    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    x: dict[str, Any] = {v: _var(prob, v, 0, 1) for v in PLACEMENT_VARS if weights is None or v not in weights}
    x.update(weights or {})
    for trio in TRIOS:
        if weights is None or trio[0] not in weights:
            prob += pulp.lpSum(x[v] for v in trio) == 1, f"sum_{trio[0][0]}"

    all_gpu = {v: (1.0 if v.endswith("g") else 0.0) for v in PLACEMENT_VARS}
    ref = float(token_seconds(cm, all_gpu, gbs, nb, shape)) or 1.0
    # The relaxation: one class, every layer split by the weight fractions. Fixed weights: whole
    # layers, each weight tier's layers priced apart (exact for these fractions).
    phase_time = []
    for name, phase, length in (("pre", "prefill", shape.prompt_len), ("dec", "decode", shape.decode_context)):
        computed = shape.computed(phase, gbs, nb)
        tokens = nb * cm.step_tokens(phase, computed, length)
        classes = ([(1.0, cm.weight_terms(x, tokens))] if weights is None
                   else cm.weight_tier_terms({**{v: 0.0 for v in PLACEMENT_VARS}, **weights}, tokens))
        total: Any = 0.0
        for j, (share, wterms) in enumerate(classes):
            var = _var(prob, f"t_{name}{j}", 0)
            for i, group in enumerate(cm.groups(cm.batch_terms(phase, gbs, length, x, computed).scaled(nb) + wterms)):
                prob += var * (1.0 / ref) >= group * (1.0 / ref), f"{name}{j}_group{i}"
            total = total + share * var
        phase_time.append(total)
    t_pre, t_dec = phase_time

    mem = cm.memory(x, gbs, nb, shape.max_prompt, shape.max_output, shape.cache_positions)
    if exact_staging:
        mem = _exact_staging(prob, cm, profile, x, mem, shape)
    short = {}  # elastic: bytes over capacity, in units of the tier's capacity
    caps = {t: max(float(profile.capacity_bytes(t)), 1.0) for t in TIERS}
    for tier in TIERS:
        scale = 1.0 / caps[tier]
        if elastic:
            short[tier] = _var(prob, f"short_{tier}", 0)
        for i, expr in enumerate(mem[tier].constraints()):
            prob += expr * scale <= (1.0 + short[tier] if elastic else 1.0), f"mem_{tier}_{i}"

    if elastic:
        # Blame the slowest tier that could take the bytes: a shortfall lands on the gpu tier only
        # when no placement can move it elsewhere (head weights, staging, transients).
        total = sum(caps.values())
        prob += pulp.lpSum((3 - i) * (caps[t] / total) * short[t] for i, t in enumerate(TIERS))
    else:
        # Placements that only load channels that are not the bottleneck tie in time; the tiny
        # second term breaks ties towards faster tiers (less traffic, and one answer whatever
        # the solver or the units), at a relative cost below TIE_BREAK in the objective.
        prob += (token_seconds(cm, x, gbs, nb, shape, (t_pre, t_dec)) * (1.0 / ref)
                 + TIE_BREAK * pulp.lpSum((WEIGHT_TIE if g == "wg" else 1.0) * (x[c] + 2 * x[d])
                                          for g, c, d in TRIOS if weights is None or g not in weights))
    prob.solve(lp_solver())
    status = pulp.LpStatus[prob.status]
    if status != "Optimal":
        return status, {}, float("inf"), {}
    frac = {v: min(1.0, max(0.0, float(x[v] if v in (weights or {}) else x[v].value() or 0.0)))
            for v in PLACEMENT_VARS}
    for trio in TRIOS:  # tidy solver round-off so each trio sums to exactly 1
        s = sum(frac[v] for v in trio)
        for v in trio:
            frac[v] /= s
    shortfall = {t: float(v.value() or 0.0) * caps[t] for t, v in short.items()}
    # the relaxation's own price, without the tie-break term
    lp_s = 0.0 if elastic else float(token_seconds(cm, frac, gbs, nb, shape, whole_layers=weights is not None))
    return status, frac, lp_s, shortfall


def round_placement(cm: CostModel, profile: HardwareProfile, policy: Policy, shape: Shape,
                    keep_weights: bool = False) -> tuple[Policy, int] | None:
    """Round ``policy``'s fractions to whole layers and rows, then make memory fit again.

    Rounding uses the runner's rule (``split_counts``). If a tier overflows afterwards, one
    unit at a time (a layer of weights, a row of KV cache or of activations) moves from the
    overflowing tier to the next slower one, choosing the move that costs the least time per
    byte freed; with ``keep_weights`` only rows move (a weight split being priced as such).
    Returns (policy, units moved) or None when no sequence of moves fits.
    """
    L, gbs = cm.spec.num_layers, policy.gbs
    units = {"w": L, "c": gbs, "h": gbs}
    counts = {k: list(split_counts(tuple(getattr(policy, k + t) for t in "gcd"), n)) for k, n in units.items()}

    def make(c: dict[str, list[int]]) -> Policy:
        frac = {k + t: c[k][i] / units[k] for k in units for i, t in enumerate("gcd")}
        return replace(policy, **frac)

    current = make(counts)
    moved = 0
    for _ in range(3 * (L + 2 * gbs) + 1):
        over = fits(cm, profile, current, shape)
        if not over:
            return current, moved
        tier = next(t for t in TIERS if t in over)
        src = TIERS.index(tier)
        if src == len(TIERS) - 1:
            return None  # the disk is full: nothing slower to move to
        base_s = float(token_seconds(cm, current.placement(), gbs, current.nb, shape))
        base_peak = cm.peak_bytes(current, shape.max_prompt, shape.max_output, shape.cache_positions)[tier]
        best: tuple[float, dict[str, list[int]]] | None = None
        for k in units:
            if counts[k][src] == 0 or (keep_weights and k == "w"):
                continue
            trial = {kk: list(v) for kk, v in counts.items()}
            trial[k][src] -= 1
            trial[k][src + 1] += 1
            cand = make(trial)
            freed = base_peak - cm.peak_bytes(cand, shape.max_prompt, shape.max_output, shape.cache_positions)[tier]
            if freed <= 0:
                continue
            cost = (float(token_seconds(cm, cand.placement(), gbs, cand.nb, shape)) - base_s) / freed
            if best is None or cost < best[0]:
                best = (cost, trial)
        if best is None:
            return None
        counts = best[1]
        current = make(counts)
        moved += 1
    return None


def place(spec: ModelSpec, profile: HardwareProfile, workload: Workload, gbs: int, nb: int, *,
          compress_weight: bool = False, compress_cache: bool = False, cpu_attention: bool = False,
          overlap: bool = True) -> Placement | None:
    """The best placement for these knobs (LP, then rounding), or None if nothing fits.

    ``spec`` should already be in the profile's compute dtype (``profile.model_for``).
    """
    # slots: the engine copies runs of consecutive cpu-tier rows, which the cost model counts per
    # batch of gbs slots (without it, one copy per row: up to gbs times the simulator's count)
    cm = _CachedSizes(spec, profile, compress_weight, compress_cache, cpu_attention, overlap, nb=nb, slots=gbs)
    shape = Shape.of(workload)
    status, frac, lp_s, _ = _solve(cm, profile, gbs, nb, shape)
    if _needs_exact_staging(cm, profile, status, frac, gbs, nb, shape):
        ex_status, ex_frac, ex_s, _ = _solve(cm, profile, gbs, nb, shape, exact_staging=True)
        if ex_status == "Optimal" and (status != "Optimal" or ex_s < lp_s):
            status, frac, lp_s = ex_status, ex_frac, ex_s
    if status != "Optimal":
        return None
    relaxed = _knob_policy(gbs, nb, compress_weight, compress_cache, cpu_attention, overlap, frac)
    rounded = round_placement(cm, profile, relaxed, shape)
    if rounded is None:
        return None
    policy, moved = rounded
    token_s = float(token_seconds(cm, policy.placement(), gbs, nb, shape))
    policy, moved, token_s = _whole_layer_search(cm, profile, gbs, nb, shape, relaxed, (policy, moved, token_s), lp_s)
    emptying = emptying_token_seconds(cm, policy.placement(), gbs, nb, shape)
    return Placement(fractions=frac, lp_token_s=lp_s, policy=policy, token_s=token_s, moved_units=moved,
                     emptying_token_s=min(token_s, emptying))


def _whole_layer_search(cm: CostModel, profile: HardwareProfile, gbs: int, nb: int, shape: Shape, relaxed: Policy,
                        best: tuple[Policy, int, float], lp_s: float) -> tuple[Policy, int, float]:
    """Other whole-layer weight splits than the rounded relaxation's: (policy, units moved, token_s).

    The relaxation spreads offloaded weights over every layer, where each costs a sliver of
    fetch; the runner fetches whole layers, and none at all when at most two are off the gpu tier
    (they stay in the stage slots, ``_weights_stay_staged``), which also needs no more gpu memory
    than keeping them resident. So the relaxation can offload five layers to keep the KV cache on
    the gpu when all weights resident and the cache offloaded is faster: opt-30b / a100-80gb / G,
    25 of 464 grid points priced 1.3-1.9x faster that way. Here each split's KV-cache and
    activation fractions come from the LP with the weights fixed and priced by whole layers
    (exact for that split): first all weights on the gpu tier, then, while the best price is over
    :data:`WHOLE_LAYER_GAP` times the relaxation's, a descent moving layers between gpu and cpu
    in halving steps from a quarter of the layers.
    """
    L = cm.spec.num_layers
    resident_max = int(float(profile.capacity_bytes("gpu")) // cm.layer_stored_bytes)  # weights alone

    def better(counts: tuple[int, int, int]) -> bool:
        nonlocal best
        if counts[0] > resident_max:
            return False  # cannot fit: spare the LP
        cand = _place_whole_layers(cm, profile, gbs, nb, shape, counts, relaxed)
        if cand is not None and cand[2] < best[2] * (1 - 1e-9):
            best = cand
            return True
        return False

    if best[0].layer_counts(L)[0] < L:
        better((L, 0, 0))
    if best[2] <= lp_s * WHOLE_LAYER_GAP:
        return best
    cur, step = best[0].layer_counts(L), max(1, L // 4)
    while step >= 1:
        moves = [(cur[0] + d, cur[1] - d, cur[2]) for d in (step, -step)]
        moved = next((c for c in moves if min(c) >= 0 and better(c)), None)
        if moved is None:
            step //= 2
        else:
            cur = moved
    return best


def _place_whole_layers(cm: CostModel, profile: HardwareProfile, gbs: int, nb: int, shape: Shape,
                        counts: tuple[int, int, int], like: Policy) -> tuple[Policy, int, float] | None:
    """The best placement with ``counts`` weight layers on (gpu, cpu, disk): the LP over the other
    fractions with the weights fixed, rounded like any other; None when nothing fits."""
    weights = {v: c / cm.spec.num_layers for v, c in zip(TRIOS[0], counts)}
    status, frac, _, _ = _solve(cm, profile, gbs, nb, shape, weights=weights)
    if status != "Optimal":
        return None
    # Rows only: moving a weight layer is free while another channel is the bottleneck, and the
    # rounding would otherwise walk every candidate back to one split (t4 / opt-6.7b / C2, 16 x 16,
    # CPU attention: 0-16 gpu layers all rounded to none, while 20 gpu layers were 1.9x faster).
    rounded = round_placement(cm, profile, replace(like, **frac), shape, keep_weights=True)
    if rounded is None:
        return None
    policy, moved = rounded
    return policy, moved, float(token_seconds(cm, policy.placement(), gbs, nb, shape))


def shortfall_bytes(spec: ModelSpec, profile: HardwareProfile, workload: Workload, gbs: int = 1, nb: int = 1, *,
                    compress_weight: bool = False, compress_cache: bool = False, cpu_attention: bool = False
                    ) -> dict[str, float]:
    """Bytes each tier lacks for the least demanding placement of these knobs ({} if it fits)."""
    cm = _CachedSizes(spec, profile, compress_weight, compress_cache, cpu_attention)
    status, _, _, short = _solve(cm, profile, gbs, nb, Shape.of(workload), elastic=True)
    if status != "Optimal":
        raise UserError(f"the placement LP for {spec.name} could not be solved ({status})")
    return {t: b for t, b in short.items() if b > 1.0}
