"""Discrete-event simulation of the zig-zag block schedule over a stream of requests.

The job is cut into *intervals*: with ``refill_every = R > 0`` an interval is one refill (a
prefill of the rows that joined) followed by R decode steps; with ``R = 0`` an interval is a
whole block (its prefill, then decode until its longest request finishes). Between intervals,
free slots take the next queued requests, so R = 0 is the special case where every slot is free
at every interval start. Steps in which no row is active cost nothing, which is the same as
refilling at once when everything finished early.

Only the slot assignment walks the requests (O(1) list work each); the rest is numpy: active
rows per (GPU batch, step) from +1/-1 differences, padded contexts from a vectorised range-max,
and every step priced in one call of the cost model (layers are identical, so a step is
``num_layers`` layer steps plus the head; distinct (rows, length) pairs are priced once).
Semantics: docs/ARCHITECTURE.md "Shared execution semantics".
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Container
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from workloads.workload import Workload
from xprofiler.profile import HardwareProfile
from xprofiler.specs import ModelSpec
from xsched.errors import UserError
from xsimulator.costmodel import (PREFIX_CACHE_DISPLACE_MARGIN, PREFIX_CACHE_GHOSTS, PREFIX_CACHE_SEEN,
                                  SHARE_PREFIX_AT_MOST, BlockStep,
                                  CostModel, StepTerms, channel_groups, fits_in, run_cache_positions)
from xsimulator.policy import Policy
from xsimulator.result import SimResult
from xsimulator.trace import TraceEvent

DEFAULT_REQUESTS = 2000  # also the `xsched simulate --requests` default


@dataclass(frozen=True)
class Schedule:
    """Where and when each request runs: its slot (row of the block) and its first interval."""

    slot: np.ndarray  # [N] slot index; GPU batch = slot // gbs
    join: np.ndarray  # [N] interval in which the request is prefilled
    intervals_held: np.ndarray  # [N] intervals the request occupies its slot
    num_intervals: int
    interval_steps: int  # decode steps per interval (R, or the longest output - 1 when R = 0)


def assign_slots(prompt: np.ndarray, output: np.ndarray, policy: Policy, prefix_of: np.ndarray | None = None,
                 prefix: Any = 0, hold_positions: int | None = None,
                 cache_positions: int | None = None) -> Schedule:
    """Give queued requests to free slots at each interval start, in queue order.

    With ``bucket`` the requests joining together are sorted by prompt length before they fill
    the free slots in slot order, so each GPU batch gets similar lengths. ``prefix_of[i]``: which
    of several prefixes request ``i``'s prompt begins with (``prefix`` tokens long: one number,
    or one per request); joiners are then
    sorted by prefix first wherever that computes fewer prefill positions, as the engine does
    (``xrunner.prefix.prefix_order``; a batch takes a prefix an earlier one computed, within
    ``hold_positions``, or the run's cache keeps within ``cache_positions``: :func:`build_timeline`).
    A request of ``n`` output tokens holds its slot for
    ``max(1, ceil((n - 1) / R))`` intervals (prefill makes the first token, each decode step one
    more).
    """
    n = len(prompt)
    bls = policy.block_size
    r = policy.refill_every
    if r >= int(output.max()) - 1:  # every slot is free at every refill: the same schedule as none
        r = 0  # (and no empty steps: 1e9 of them took 52 GiB)
    steps = int(output.max()) - 1 if r == 0 else r
    held = np.ones(n, np.int64) if r == 0 else np.maximum(1, -(-(output - 1) // r))
    # Sequential by nature (who gets a slot depends on when earlier requests finish), so this
    # loop does O(1) list operations per request; everything after it is vectorised.
    held_l, prompt_l = held.tolist(), prompt.tolist()
    prefix_len = np.broadcast_to(np.asarray(prefix, np.int64), prompt.shape)
    of_l = None if prefix_of is None or not prefix_len.any() else prefix_of.tolist()
    len_l = prefix_len.tolist()
    slot_l, join_l = [0] * n, [0] * n
    free_by_interval: dict[int, list[int]] = {0: list(range(min(bls, n)))}  # slots past n stay empty
    pending = [0]
    pos = 0
    # The prefixes the run's cache keeps by now, for ordering the joiners: the first that two or
    # more rows of a GPU batch shared, while they fit (_cache_takes prices what it keeps, the most
    # used where they do not all fit). Marking every prefix a joiner began with priced templates
    # seen once as kept, and ordered later blocks as if they were (1.16-1.44x the engine's
    # positions on 57 templates, 16 x 4).
    cached: dict[int, None] = {}
    # (only a prefix two or more prompts begin with enters it; one alone is a prompt sharing nothing)
    shared = set() if of_l is None else set(np.flatnonzero(np.bincount(prefix_of) > 1).tolist())
    recent: deque[int] = deque(maxlen=PREFIX_CACHE_GHOSTS)  # the last joiners' prefixes (PrefixCache.recent)
    cache_positions = hold_positions if cache_positions is None else cache_positions
    room = n * int(prefix_len.max(initial=0)) if cache_positions is None else cache_positions  # positions left
    bucket, pop, push = policy.bucket, heapq.heappop, heapq.heappush  # (the loop runs once per freed interval)
    while pos < n:
        j = pop(pending)
        free = free_by_interval.pop(j)
        free.sort()
        take = min(len(free), n - pos)
        ids = range(pos, pos + take)
        if bucket and take > 1:
            ids = sorted(ids, key=prompt_l.__getitem__)
            if of_l is not None and 1 < len({s // policy.gbs for s in free[:take]}) < take:
                ids = _prefix_first(ids, free, prompt_l, of_l, len_l, policy.gbs,  # (else one batch, or one row each)
                                    hold_positions, cached)
        for s, i in zip(free, ids):
            slot_l[i] = s
            join_l[i] = j
            f = j + held_l[i]
            group = free_by_interval.get(f)
            if group is None:
                free_by_interval[f] = [s]
                push(pending, f)
            else:
                group.append(s)
        pos += take
        if of_l is not None and room > 0 and len(cached) < len(shared):  # (the engine admits a prefix two or
            # more rows of one GPU batch share; once all are kept or the room is gone, nothing changes)
            together: dict[tuple[int, int], list[int]] = {}
            for s, i in zip(free, ids):
                together.setdefault((s // policy.gbs, of_l[i]), []).append(i)
            before = set(recent)  # (a row alone in its batch is kept where a recent prompt began alike)
            prefixes_in = Counter(b for b, _ in together)
            for (b, w), rows in together.items():
                lone = len(rows) == 1 and prefixes_in[b] == 1 and w in before  # (the batch's one joiner)
                if (len(rows) > 1 or lone) and w in shared and w not in cached and len_l[rows[0]] <= room:
                    cached[w] = None
                    room -= len_l[rows[0]]
            recent.extend(of_l[i] for i in ids)
    slot, join = np.array(slot_l, np.int64), np.array(join_l, np.int64)
    return Schedule(slot, join, held, int((join + held).max()), max(steps, 0))


def _prefix_first(ids: list[int], free: list[int], prompt_l: list[int], of_l: list[int], len_l: list[int],
                  gbs: int, hold_positions: int | None, cached: Container[int] = ()) -> list[int]:
    """Joiners ``ids`` (sorted by length) sorted by their prefix (the prefixes in turn, or by
    their joiners' mean length), then length, when that computes fewer prefill positions over
    the GPU batches they fill (each batch groups its prompts as the engine does,
    :func:`_groupings`, and computes each group once unless an earlier batch did or the run's
    cache keeps it: ``cached``): the engine's candidates."""
    members: dict[int, list[int]] = {}
    for i in ids:
        members.setdefault(of_l[i], []).append(prompt_l[i])
    mean = {g: sum(v) / len(v) for g, v in members.items()}
    orders = [ids, sorted(ids, key=lambda i: (of_l[i], prompt_l[i])),
              sorted(ids, key=lambda i: (mean[of_l[i]], of_l[i], prompt_l[i]))]
    batches = sorted({s // gbs for s in free[:len(ids)]})
    at = {b: k for k, b in enumerate(batches)}
    cell = np.array([k * len(batches) + at[s // gbs] for k in range(len(orders)) for s in free[:len(ids)]])
    req = [i for order in orders for i in order]
    prompt = np.array([prompt_l[i] for i in req])
    cells = len(orders) * len(batches)
    rows = np.bincount(cell, minlength=cells)
    longest = np.zeros(cells, np.int64)
    np.maximum.at(longest, cell, prompt)
    g = _groupings(cell, prompt, np.array([of_l[i] for i in req]), np.array([len_l[i] for i in req]), None, rows,
                   longest)
    lend = np.where(g.ok[g.entry_cell] & (g.length > 0), g.length, -1)
    mine = np.array([w in cached for w in g.which.tolist()], bool)
    computes = np.zeros(len(lend), bool)
    for k in range(len(orders)):  # each candidate's batches in turn (a few cells: plain Python)
        e = np.flatnonzero(g.entry_cell // len(batches) == k)
        computes[e] = _replay_prefixes((g.entry_cell[e] % len(batches)).tolist(), g.which[e].tolist(),
                                       np.where(mine[e], -1, lend[e]).tolist(), g.length[e].tolist(), hold_positions)
    own = np.bincount(g.entry_cell, weights=computes & ~mine & (g.length > 0), minlength=cells)
    positions = _cell_prices(g, own, np.where(mine, g.wanted, 0), rows, longest)[0]
    return orders[int(np.argmin(positions.reshape(len(orders), -1).sum(axis=1)))]  # ties: length order, then the first


class _Grouped(NamedTuple):
    """:func:`_groupings`' answer: per (cell, prefix) entry and per cell."""

    entry_of: np.ndarray  # [N] each request's entry
    entry_cell: np.ndarray  # [E] each entry's cell
    which: np.ndarray  # [E] its prefix id
    prompts: np.ndarray  # [E] distinct prompts in it
    longest: np.ndarray  # [E] its longest prompt
    wanted: np.ndarray  # [E] its prefix's tokens
    length: np.ndarray  # [E] tokens it computes as a group: its prompts' shared prefix, a lone prompt's head, or 0
    run: np.ndarray  # [E] its prompts share ``length`` tokens as one group (the run's cache admits only these)
    suffix: np.ndarray  # [C] columns every row computes itself
    width: np.ndarray  # [C] the longest group
    groups: np.ndarray  # [C] groups computed (the engine's runs and groups of one)
    ok: np.ndarray  # [C] the grouping cuts the cell's positions to SHARE_PREFIX_AT_MOST or fewer


def _groupings(cell: np.ndarray, prompt: np.ndarray, prefix_of: np.ndarray, prefix_len: np.ndarray,
               group: np.ndarray | None, computed: np.ndarray, longest: np.ndarray) -> _Grouped:
    """How the engine groups each prefill cell's prompts (``xrunner.prefix._grouping``): the
    prompts of one prefix id (two or more distinct ones) form a run sharing its ``prefix_len``
    tokens (each keeping a token of its own), the runs kept are those sharing at least some
    threshold (the others' prompts are left alone), every row computes at least the longest own
    part among the kept runs (the suffix), and a prompt left alone computes the tokens it has
    beyond the suffix as a group of one; each group is padded to the longest. Of every
    threshold and every suffix the engine tries (the floor, or a lone prompt's length), the
    fewest positions. All cells at once; ``computed`` and ``longest``: each cell's distinct
    prompts and longest prompt; ``group``: each request's prompt (samples), None: its own.
    (Keeping every run and trying only two suffixes priced 1.0-1.86x the engine's positions
    on random batches of templates of 4-120 tokens.)"""
    cells = len(computed)
    span = int(prefix_of.max()) + 1
    keys, entry_of = np.unique(cell * span + prefix_of, return_inverse=True)
    entry_cell, which = np.divmod(keys, span)
    E = len(keys)
    distinct = entry_of if group is None else np.unique(np.stack((entry_of, np.asarray(group, np.int64))), axis=1)[0]
    prompts = np.bincount(distinct, minlength=E)
    short = np.full(E, np.iinfo(np.int64).max)
    np.minimum.at(short, entry_of, prompt)
    long = np.zeros(E, np.int64)
    np.maximum.at(long, entry_of, prompt)
    wanted = np.zeros(E, np.int64)
    np.maximum.at(wanted, entry_of, prefix_len)
    need = np.where(prompts >= 2, np.minimum(wanted, short - 1), 0)
    run = need > 0
    runs = np.bincount(entry_cell[run], minlength=cells)
    width = np.zeros(cells, np.int64)  # the longest run's prefix
    np.maximum.at(width, entry_cell[run], need[run])
    # Runs by length within their cell: the engine's thresholds keep those sharing at least the
    # k-th longest run's tokens and leave the others' prompts alone (a short template padded to a
    # long one's width can cost more than it saves)
    by = np.lexsort((-need, entry_cell))
    rank = np.empty(E, np.int64)
    first = np.searchsorted(entry_cell[by], entry_cell[by])
    rank[by] = np.arange(E) - first
    band = int(long.max()) + 1  # (cell, length) keys: cell * band + length
    best = np.full(cells, np.inf)
    keep = np.zeros(cells, np.int64)  # the shortest run kept
    suffix = np.zeros(cells, np.int64)
    for k in range(1, int(runs.max(initial=0)) + 1):
        tau = np.zeros(cells, np.int64)
        at_k = run & (rank == k - 1)
        tau[entry_cell[at_k]] = need[at_k]
        kept = run & (need >= tau[entry_cell])
        count = np.bincount(entry_cell[kept], minlength=cells)
        floor = np.zeros(cells, np.int64)  # the kept runs' longest own part
        np.maximum.at(floor, entry_cell[kept], (long - need)[kept])
        # Suffix candidates, as the engine tries them: the floor, or any longer lone prompt's length
        # (those longer than the suffix compute their heads beyond it as groups of one).
        lone = ~kept & (long > floor[entry_cell])
        cand_cell = np.concatenate((np.arange(cells), entry_cell[lone]))
        cand = np.concatenate((floor, long[lone]))
        key = entry_cell[lone] * band + long[lone]
        order = np.argsort(key, kind="stable")
        above = np.concatenate((np.cumsum(prompts[lone][order][::-1])[::-1], [0]))  # prompts at or past each
        at = np.searchsorted(key[order], cand_cell * band + cand, side="right")
        end = np.searchsorted(key[order], cand_cell * band + band - 1, side="right")
        over = above[at] - above[end]  # the cell's lone prompts longer than the candidate
        top = np.zeros(cells, np.int64)
        np.maximum.at(top, entry_cell[lone], long[lone])
        head = np.maximum(top[cand_cell] - cand, 0)
        cost = (count[cand_cell] + over) * np.maximum(width[cand_cell], head) + computed[cand_cell] * cand
        cost = np.where(runs[cand_cell] >= k, cost, np.inf)
        low = np.full(cells, np.inf)
        np.minimum.at(low, cand_cell, cost)
        won = cost <= low[cand_cell]
        pick = np.full(cells, -1)
        pick[cand_cell[won][::-1]] = np.flatnonzero(won)[::-1]  # the first candidate at the minimum
        better = low < best
        best = np.where(better, low, best)
        keep = np.where(better, tau, keep)
        suffix = np.where(better, cand[np.maximum(pick, 0)], suffix)
    kept = run & (need >= keep[entry_cell])
    head = np.where(kept, 0, np.maximum(long - suffix[entry_cell], 0))
    singles = np.bincount(entry_cell, weights=np.where(head > 0, prompts, 0), minlength=cells)
    head_width = np.zeros(cells, np.int64)
    np.maximum.at(head_width, entry_cell, head)
    ok = (runs > 0) & (computed >= 2) & (best <= SHARE_PREFIX_AT_MOST * computed * longest)
    return _Grouped(entry_of, entry_cell, which, prompts, long, wanted, np.where(kept, need, head), kept, suffix,
                    np.maximum(width, head_width), np.bincount(entry_cell[kept], minlength=cells) + singles, ok)


@dataclass(frozen=True)
class Timeline:
    """The priced schedule: per-interval prefill, per-step decode, request completion times."""

    schedule: Schedule
    prefill: BlockStep  # arrays over intervals [J]
    decode: BlockStep  # arrays over [J, interval_steps]
    prefill_rows: np.ndarray  # [nb, J] new rows per GPU batch and interval
    prefill_computed: np.ndarray  # [nb, J] of them computed: a prompt's samples joining together once
    # [nb, J] padded prompt length of each GPU batch's new rows; where they share prefixes, their
    # groups' width plus their own parts' (the engine's layout: _price_prefixes)
    prefill_len: np.ndarray
    decode_rows: np.ndarray  # [nb, J, steps] active rows
    decode_len: np.ndarray  # [nb, J, steps] padded context T
    start_s: np.ndarray  # [J] interval start times
    latency_s: np.ndarray  # [N]
    prefix: Any = 0  # [nb, J] leading tokens each prefill cell's prompts share, or take from the run's cache
    prefix_groups: Any = 1  # [nb, J] distinct prefixes among each cell's prompts (or one number for all)
    prefix_own: Any = None  # [nb, J] of them computed there (others an earlier GPU batch did); None: all

    @property
    def prefill_positions(self) -> np.ndarray:
        """[nb, J] prompt positions each prefill cell computes (padding, shared prefixes once)."""
        return CostModel.layer_rows("prefill", self.prefill_computed, self.prefill_len, self.prefix,
                                    self.prefix_groups, self.prefix_own) * self.prefill_len

    @property
    def wall_s(self) -> float:
        return float(self.prefill.seconds.sum() + self.decode.seconds.sum())


def build_timeline(cm: CostModel, policy: Policy, prompt: np.ndarray, output: np.ndarray,
                   group: np.ndarray | None = None, prefix: Any = 0, prefix_of: np.ndarray | None = None,
                   hold_positions: int | None = None, cache_positions: int | None = None) -> Timeline:
    """Simulate the requests (in queue order) under ``policy`` and price every step.

    ``group[i]``: the prompt request ``i`` is a sample of (:meth:`Workload.prompt_groups`); the
    rows of one group that join one GPU batch in one interval are computed once in prefill.
    ``prefix``: leading tokens the prompts share (one number, or one per request:
    :meth:`Workload.prefix_lengths_of`), computed once per GPU batch's prefill
    (:meth:`CostModel._shared_prefix_parts`, :func:`_price_prefixes`); each prompt keeps at
    least one token of its own, as in the engine. ``prefix_of[i]``: which of several such
    prefixes request ``i``'s prompt begins with (:meth:`Workload.prefix_ids`); each cell
    computes each of its prefixes once, after the joiners are ordered as in :func:`assign_slots`.
    A cell takes a prefix that an earlier GPU batch computed in the same prefill, holding at most
    ``hold_positions`` of them at a time (the engine's ``plan_block``; None: no limit), and one
    that the run's cache keeps, within ``cache_positions`` (default ``hold_positions``).
    """
    sched = assign_slots(prompt, output, policy, prefix_of, prefix, hold_positions, cache_positions)
    J, S = sched.num_intervals, sched.interval_steps
    nb, gbs = policy.nb, policy.gbs
    batch = sched.slot // gbs

    # Prefill of the rows that join in each interval, per GPU batch (batch axis first).
    cell = batch * J + sched.join
    prefill_rows = np.bincount(cell, minlength=nb * J).reshape(nb, J)
    computed = prefill_rows
    if group is not None and len(np.unique(group)) < len(group):
        first = np.unique(np.stack((cell, np.asarray(group, np.int64))), axis=1)[0]  # one per (cell, group)
        computed = np.bincount(first, minlength=nb * J).reshape(nb, J)
    prefill_len = np.zeros(nb * J, np.int64)
    np.maximum.at(prefill_len, cell, prompt)
    prefill_len = prefill_len.reshape(nb, J)
    prefix_len = np.broadcast_to(np.asarray(prefix, np.int64), prompt.shape)
    prefix, groups, own = 0, 1, None
    if prefix_len.any():
        prefix, groups, own, prefill_len = _price_prefixes(
            cell, prompt, np.zeros(len(prompt), np.int64) if prefix_of is None else np.asarray(prefix_of, np.int64),
            prefix_len, group if computed is not prefill_rows else None, computed, prefill_len, nb, J,
            hold_positions, cache_positions)

    # Decode on the global step axis g = interval * S + (u - 1): a request is active from the
    # first step of its join interval for output - 1 steps. Active rows come from +1/-1
    # differences; the padded context is g + 1 + the largest (prompt - join * S) among them.
    G = J * S
    first = sched.join * S
    decoding = output >= 2
    start = batch[decoding] * (G + 1) + first[decoding]
    stop = start + output[decoding] - 1
    diff = np.bincount(start, minlength=nb * (G + 1)) - np.bincount(stop, minlength=nb * (G + 1))
    decode_rows = np.cumsum(diff.reshape(nb, G + 1), axis=1)[:, :G]
    key = range_max(nb * (G + 1), start, stop - 1, (prompt - first)[decoding]).reshape(nb, G + 1)[:, :G]
    key += np.arange(1, G + 1, dtype=key.dtype)  # (the type's min where no row is active: stays below 0)
    decode_len = np.maximum(key, 0, dtype=np.int64)  # (int64: the cost model's products of lengths need it)
    decode_rows = decode_rows.reshape(nb, J, S)
    decode_len = decode_len.reshape(nb, J, S)

    placement = policy.placement()
    if computed is prefill_rows and not np.any(prefix):
        pre = price_steps(cm, "prefill", prefill_rows, prefill_len, placement)
    else:  # (rows, computed, length) triples: priced cell by cell, not from a table of pairs
        on = prefill_rows > 0
        pre = cm.block_step("prefill", prefill_rows, prefill_len, placement, on, np.logical_or.reduce(on, axis=0),
                            batch_axis=0, computed=computed, prefix=prefix, prefix_groups=groups, prefix_own=own)
    dec = price_steps(cm, "decode", decode_rows, decode_len, placement)

    # Completion times: a request ends with the decode step that makes its last token.
    interval_s = pre.seconds + dec.seconds.sum(axis=1)
    start = np.concatenate(([0.0], np.cumsum(interval_s)[:-1]))
    cum_step = np.concatenate((np.zeros((J, 1)), np.cumsum(dec.seconds, axis=1)), axis=1)
    g = output - 1
    last = sched.join + np.maximum(g - 1, 0) // max(S, 1)
    u_last = np.where(g > 0, g - (last - sched.join) * S, 0)
    finish = start[last] + pre.seconds[last] + cum_step[last, u_last]
    latency = finish - start[sched.join]
    return Timeline(sched, pre, dec, prefill_rows, computed, prefill_len, decode_rows, decode_len, start, latency,
                    prefix, groups, own)


def _price_prefixes(cell: np.ndarray, prompt: np.ndarray, prefix_of: np.ndarray, prefix_len: np.ndarray,
                    group: np.ndarray | None, computed: np.ndarray, longest: np.ndarray, nb: int, J: int,
                    hold_positions: int | None, cache_positions: int | None) -> tuple[Any, Any, Any, np.ndarray]:
    """Each prefill cell's (prefix, groups, own, length) for the cost model's shared-prefix
    price (``own * prefix + rows * (length - prefix)`` positions), as the engine plans it
    (``xrunner.prefix.plan_block``): the cell's grouping (:func:`_groupings`), its groups taken
    from an earlier GPU batch of the prefill or from the run's cache where they keep them
    (:func:`_own_prefixes`), or each row taking what the cache keeps of its prefix (the engine's
    ``_cached_grouping``), whichever computes the fewest positions; else the plain prefill.
    The groups a cell computes are padded to the longest of them and its rows' own parts to the
    longest, as the engine counts them, so its priced length is that width plus that suffix."""
    g = _groupings(cell, prompt, prefix_of, prefix_len, group, computed.ravel(), longest.ravel())
    lend = np.where(g.ok[g.entry_cell] & (g.length > 0), g.length, -1)
    own, avail, widest = _own_prefixes(g.entry_cell, g.entry_cell // J, g.entry_cell % J, g.which, lend, g.length,
                                       nb * J, hold_positions, np.where(g.run, g.prompts, 1), nb, cache_positions,
                                       np.where(~g.ok[g.entry_cell], g.wanted, 0))
    # (a GPU batch whose own grouping does not pass plans around the cache, a row computing alone
    # the prefix a recent prompt began with and keeping it, as the engine's _share_block does:
    # only batches of one row did so here, and 8 templates behind half the prompts in queue order
    # priced 1.148x the engine's positions with each prompt's template given, now 1.024)
    _, prefix, length, own, groups = _cell_prices(g, own, avail, computed.ravel(), longest.ravel(), widest)
    shape = (nb, J)
    return prefix.reshape(shape), groups.reshape(shape), own.reshape(shape), length.reshape(shape)


def _cell_prices(g: _Grouped, own: np.ndarray, avail: np.ndarray, rows: np.ndarray, longest: np.ndarray,
                 widest: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per cell, the engine's choice among its grouping (``own`` groups computed there), each
    row taking the ``avail`` tokens the cache keeps of its entry's prefix (``_cached_grouping``:
    the rest of the longest is the suffix, and the prompts it keeps nothing of compute their
    heads beyond it as groups of one) and the plain prefill: (positions, and the cost model's
    prefix, length, own and groups for them). The groups a cell computes pad to the ``widest``
    of them (default: its widest group), not to a wider one an earlier batch or the cache gives
    it, as the engine's ``_positions`` counts: a 300-token template taken beside 20-token ones
    and prompts sharing nothing priced the computed ones at 300 (1.134x the engine in queue
    order with each prompt's template given; 0.992 now)."""
    rows, P = rows.astype(float), longest
    widest = g.width if widest is None else widest
    takes = np.minimum(avail, g.longest - 1) > 0
    floor = np.zeros(len(P), np.int64)
    np.maximum.at(floor, g.entry_cell[takes], np.maximum(g.longest - avail, 1)[takes])
    head = np.where(takes, 0, np.maximum(g.longest - floor[g.entry_cell], 0))
    lone = np.bincount(g.entry_cell, weights=np.where(head > 0, g.prompts, 0), minlength=len(P))
    head_width = np.zeros(len(P), np.int64)
    np.maximum.at(head_width, g.entry_cell, head)
    taking = np.bincount(g.entry_cell, weights=takes, minlength=len(P)) > 0
    cost_take = np.where(taking, lone * head_width + rows * floor, np.inf)
    cost_take = np.where(cost_take < rows * P, cost_take, np.inf)
    cost_own = np.where(g.ok, own * widest + rows * g.suffix, np.inf)
    use_own = (cost_own <= cost_take) & np.isfinite(cost_own)
    use_take = ~use_own & np.isfinite(cost_take)
    with_heads = use_take & (head_width > 0)
    prefix = np.where(use_own, widest, np.where(with_heads, head_width, np.where(use_take, P - floor, 0)))
    length = np.where(use_own, widest + g.suffix, np.where(with_heads, head_width + floor, P))
    computes = np.where(use_own, own, np.where(with_heads, lone, 0.0))
    groups = np.where(use_own, g.groups, np.where(use_take, computes + 1, 1))  # (a taking cell computes fewer than it holds)
    positions = np.where(use_own, cost_own, np.where(use_take, cost_take, rows * P))
    return positions, prefix, length, computes, groups


def _within_hold(batch: np.ndarray, interval: np.ndarray, which: np.ndarray, lend: np.ndarray, need: np.ndarray,
                 computes: np.ndarray, hold_positions: int) -> np.ndarray:
    """:func:`_first_computes` where a prefill's batches hold at most ``hold_positions`` lent prefix
    positions at a time, as the engine does: each computed prefix that a later batch wants is
    held while they fit, until the last such batch. Replayed only for the prefills whose lent
    prefixes could exceed the limit."""
    lent = np.bincount(interval, weights=np.where(computes & (lend >= 0), lend, 0))
    over = np.flatnonzero(lent > hold_positions)
    if not len(over):
        return computes
    computes = computes.copy()
    for j in over:
        at = np.flatnonzero(interval == j)
        at = at[np.argsort(batch[at], kind="stable")]
        computes[at] = _replay_prefixes(batch[at].tolist(), which[at].tolist(), lend[at].tolist(), need[at].tolist(),
                                        hold_positions)
    return computes


def _replay_prefixes(batch: list[int], which: list[int], lend: list[int], need: list[int],
                     hold_positions: int | None) -> list[bool]:
    """The engine's ``plan_block`` on one prefill's (GPU batch, prefix) entries in batch order:
    whether each computes its prefix (else it takes the tokens an earlier batch computed and
    holds), holding a computed one (``lend`` tokens; -1: not shared there) only when a later
    batch wants it and ``hold_positions`` allow (None: no limit), until that batch is done."""
    held: dict[tuple[int, int], int] = {}  # (prefix, tokens) -> the last batch that wants it
    used, out = 0, []
    for k, (b, w, n) in enumerate(zip(batch, which, need)):
        took = any(pw == w and pn >= n for pw, pn in held)
        out.append(not took)
        if not took and lend[k] >= 0:
            last = max((batch[k2] for k2 in range(k + 1, len(batch)) if which[k2] == w and need[k2] <= lend[k]),
                       default=None)
            if last is not None and (hold_positions is None or used + lend[k] <= hold_positions):
                held[(w, lend[k])] = last
                used += lend[k]
        if k + 1 == len(batch) or batch[k + 1] != b:  # the batch is done: release what no later one wants
            for key in [key for key, last in held.items() if last == b]:
                used -= key[1]
                del held[key]
    return out


def _own_prefixes(cell: np.ndarray, batch: np.ndarray, prefill: np.ndarray, prefix_id: np.ndarray, lend: np.ndarray,
                  need: np.ndarray, cells: int, hold_positions: int | None, members: np.ndarray, nb: int = 1,
                  cache_positions: int | None = None, wanted: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Per cell, how many of its prefixes it computes, from one entry per (cell, prefix): the
    cell's GPU ``batch``, the ``prefill`` it belongs to, the tokens it computes of the prefix
    (``lend``; -1 where it shares none) and wants of it (``need``; 0: none). A prefix is taken
    where an earlier batch of the same prefill computed at least as many of its tokens
    (:func:`_first_computes`), within ``hold_positions`` (:func:`_within_hold`; None: no limit),
    or where the run's cache keeps it (:func:`_cache_takes`, within ``cache_positions``, default
    ``hold_positions``; ``members``: the entry's distinct prompts; ``wanted``: its prefix's
    tokens, which a lone prompt's entry keeps), whose entries the batches do not hold as well.
    Also per entry, the tokens the cache keeps of its prefix by then, and per cell the widest
    prefix it computes."""
    taken, stored, avail = _cache_takes(prefill * nb + batch, prefix_id, np.where(lend >= 0, need, -1), need,
                                        members, hold_positions if cache_positions is None else cache_positions, nb,
                                        need if wanted is None else wanted)
    lend = np.where(stored | taken, -1, lend)  # (the cache's are not held as well; a taken one is not computed)
    computes = _first_computes(batch, prefill * (int(prefix_id.max()) + 1) + prefix_id, lend, need)
    if hold_positions is not None:
        computes = _within_hold(batch, prefill, prefix_id, lend, need, computes, hold_positions)
    mine = computes & ~taken & (need > 0)
    widest = np.zeros(cells, np.int64)
    np.maximum.at(widest, cell[mine], need[mine])
    return np.bincount(cell, weights=mine, minlength=cells), avail, widest


def _cache_takes(time: np.ndarray, prefix_id: np.ndarray, lend: np.ndarray, need: np.ndarray, members: np.ndarray,
                 capacity: int | None, nb: int = 1, wanted: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The engine's run-wide prefix cache (``xrunner.prefix.PrefixCache``) on (cell, prefix)
    entries at ``time`` (prefill, then GPU batch, ``nb`` batches a prefill): a prefix enters it
    where two or more prompts of a cell share more of it (``lend`` tokens) than it keeps, within
    ``capacity`` positions (None: no limit; a longer run replaces a shorter one), and a later
    entry takes what it keeps then. Where one does not fit, its prompts so far weigh against the
    least used entries' (:meth:`PrefixCache._displace`: they leave when the prefill is done).
    A lone prompt whose prefix one of the last ``PREFIX_CACHE_GHOSTS`` prompts began with enters
    its ``wanted`` tokens (:meth:`PrefixCache.ghost_start`).
    Returns (taken whole: it keeps the ``need`` tokens, the entries that stored one, the tokens
    kept for each entry's prefix before it)."""
    ids = prefix_id.astype(np.int64)
    order = np.lexsort((ids, time))
    taken, stored = np.zeros(len(time), bool), np.zeros(len(time), bool)
    avail = np.zeros(len(time), np.int64)
    limit = float("inf") if capacity is None else capacity
    kept: dict[int, int] = {}  # prefix -> tokens kept
    uses: dict[int, int] = {}
    since: dict[int, int] = {}  # prefix -> admission order (the engine's ids)
    seen: dict[int, int] = {}
    leaving: list[int] = []
    claims: dict[int, int] = {}  # prefix -> room its displacing frees for the next prefill
    promised: dict[int, int] = {}
    used, retired, step, tick = 0, 0, -1, 0
    last: dict[int, int] = {}  # prefix -> prompts planned by the end of the last batch holding it
    planned, now, batch = 0, -1, {}
    wanted = need if wanted is None else wanted
    for e, t, w, n, want, rows, own in zip(order.tolist(), time[order].tolist(), ids[order].tolist(),
                                            lend[order].tolist(), need[order].tolist(), members[order].tolist(),
                                            wanted[order].tolist()):
        if t != now:  # the batch before is planned: its prompts join the recent ones
            planned += sum(batch.values())
            last.update(dict.fromkeys(batch, planned))
            now, batch = t, {}
        batch[w] = batch.get(w, 0) + rows
        # a batch's one row beginning as one of the last PREFIX_CACHE_GHOSTS prompts did (by batch)
        ghost = rows == 1 and own > 0 and w in last and planned - last[w] < PREFIX_CACHE_GHOSTS
        if ghost:
            n = own
        if t // nb != step:  # the prefill before is done: replaced and displaced entries go
            step = t // nb
            for v in leaving:
                seen[v] = uses.pop(v)
                used -= kept.pop(v)
            used -= retired
            leaving, retired, promised, claims = [], 0, claims, {}
        have = kept.get(w, 0)
        avail[e] = have
        if want > 0 and have >= want:
            taken[e] = True
            uses[w] += rows
            continue
        if n < 0 or rows < 2 and not ghost or n <= have:
            continue
        count = seen.pop(w, 0) + rows
        room = limit - used - sum(m for v, m in promised.items() if v != w)
        if n > room:  # PrefixCache._displace
            free = room + sum(kept[v] for v in leaving) - sum(m for v, m in claims.items() if v != w)
            victims, weight = [], 0
            for v in sorted((v for v in kept if v not in leaving), key=lambda v: (uses[v], since[v])):
                if free >= n:
                    break
                victims.append(v)
                weight += uses[v]
                free += kept[v]
            if free >= n and weight * PREFIX_CACHE_DISPLACE_MARGIN < count:
                leaving += victims
                claims[w] = n
            seen[w] = count
            if len(seen) > PREFIX_CACHE_SEEN:
                del seen[min(seen, key=seen.__getitem__)]
            continue
        promised.pop(w, None)
        if w in kept:  # a longer run replaces it (counted until the prefill is done)
            retired += have
            count += uses[w]
            if w in leaving:
                leaving.remove(w)
        stored[e] = True
        kept[w], uses[w], since[w] = n, count, tick
        used += n
        tick += 1
    return taken, stored, avail


def _first_computes(batch: np.ndarray, key: np.ndarray, lend: np.ndarray, need: np.ndarray) -> np.ndarray:
    """Whether each (GPU batch, prefix ``key``) pair computes its prefix: no earlier batch with
    the same key computed (``lend``; -1: did not) at least the ``need`` tokens it wants.
    :func:`_replay_prefixes` without a hold limit, vectorised over every prefill at once."""
    order, before = _best_before(key, batch, np.asarray(lend, np.int64) + 1)
    out = np.empty(len(order), bool)
    out[order] = before - 1 < np.asarray(need)[order]  # (the best lent before it)
    return out


def _best_before(key: np.ndarray, when: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The entries in (``key``, ``when``) order, and before each the largest ``value`` (>= 0) among
    the earlier entries of its key (0 where none): one running maximum for every key at once."""
    order = np.lexsort((when, key))
    k, v = key[order], value[order]
    start = np.concatenate(([True], k[1:] != k[:-1]))
    seg = np.cumsum(start) - 1
    span = int(v.max(initial=0)) + 1  # each key's values in a band of their own
    run = np.maximum.accumulate(seg * span + v)
    return order, np.where(start, 0, np.concatenate(([0], run[:-1])) - seg * span)


def range_max(n: int, lo: np.ndarray, hi: np.ndarray, value: np.ndarray) -> np.ndarray:
    """``out[i] = max(value[k] for ranges k with lo[k] <= i <= hi[k])``; int64 min where none does.

    A segment tree built with numpy: each range is split into O(log n) canonical nodes (all
    ranges at once, one tree level per pass), then node maxima are pushed down to the leaves.
    O((len(lo) + n) log n) without a Python loop per range. In int32 where everything fits (the
    result's type then; min of that type where no range covers): the tree is most of the
    simulator's memory traffic.
    """
    size = 1 << max(int(n - 1).bit_length(), 0)
    value = np.asarray(value, np.int64)
    small = 2 * size < 2**31 and (not len(value) or (value.min() > np.iinfo(np.int32).min
                                                       and value.max() <= np.iinfo(np.int32).max))
    kind = np.int32 if small else np.int64
    tree = np.full(2 * size, np.iinfo(kind).min, kind)
    left, right = np.asarray(lo, kind) + size, np.asarray(hi, kind) + 1 + size
    value = value.astype(kind, copy=False)
    while True:
        live = left < right
        if not live.any():
            break
        odd_left = live & (left & 1 == 1)
        np.maximum.at(tree, left[odd_left], value[odd_left])
        left = left + odd_left
        odd_right = live & (right & 1 == 1)
        right = right - odd_right
        np.maximum.at(tree, right[odd_right], value[odd_right])
        left, right = left >> 1, right >> 1
    level = 1
    while level < size:  # parents at [level, 2 level) push to children at [2 level, 4 level)
        parents = tree[level:2 * level]
        for child in (tree[2 * level:4 * level:2], tree[2 * level + 1:4 * level:2]):  # (left, right: long
            np.maximum(child, parents, out=child)  # strided loops, 2-3x faster than broadcasting over pairs)
        level *= 2
    return tree[size:size + n]


def price_steps(cm: CostModel, phase: str, rows: np.ndarray, length: np.ndarray, placement: dict[str, float]) -> BlockStep:
    """Price every step of a grid whose first axis is the GPU batch (rows 0 = batch idle).

    A batch's cost depends only on (rows, padded length), so when the grid has more cells than
    there are distinct pairs, the cost model is evaluated once on the dense table of pairs and
    gathered: exact for any cost function (bandwidth curves, rooflines, layer fits).
    """
    on = rows > 0
    any_on = np.logical_or.reduce(on, axis=0)
    busy = np.flatnonzero(any_on)
    if 2 * len(busy) < any_on.size:  # mostly idle steps (prefills of a job refilled often): price the busy ones
        nb = rows.shape[0]
        step = price_steps(cm, phase, rows.reshape(nb, -1)[:, busy], length.reshape(nb, -1)[:, busy], placement)
        return BlockStep(StepTerms(**{k: _scatter(v, busy, any_on.shape) for k, v in step.terms.as_dict().items()}),
                         _scatter(step.head_s, busy, any_on.shape), _scatter(step.seconds, busy, any_on.shape))
    top_rows, top_len = int(rows.max(initial=0)), int(length.max(initial=0))
    if (top_rows + 1) * (top_len + 1) * 4 > rows.size:
        return cm.block_step(phase, rows, length, placement, on, any_on, batch_axis=0)
    r_tab = np.arange(top_rows + 1)[:, None]
    l_tab = np.arange(top_len + 1)[None, :]
    live = (r_tab > 0).astype(float)  # an idle batch costs nothing
    terms = cm.batch_terms(phase, r_tab, l_tab, placement).scaled(live)
    shape = (top_rows + 1, top_len + 1)
    index = rows * (top_len + 1) + length
    gather = {k: (np.ravel(np.broadcast_to(v, shape))[index] if not np.isscalar(v) else v)
              for k, v in terms.as_dict().items()}
    # The embedding is each batch's, from the table; the LM head is one product over the step's
    # rows (CostModel.head_seconds with block_rows shares it out by rows; the shares add up to it),
    # priced per step from a table over the step's possible row counts.
    embed = np.ravel(np.broadcast_to(cm.embed_seconds(phase, r_tab, l_tab) * live, shape))[index]
    step_rows = np.sum(rows, axis=0, keepdims=True)
    counts = np.arange(int(step_rows.max(initial=0)) + 1)
    head_tab = np.where(counts > 0, cm.lm_head_seconds(counts), 0.0)
    head_steps = np.sum(embed, axis=0, keepdims=True) + head_tab[step_rows]
    return cm.combine(StepTerms(**gather), head_steps, placement, 1.0, any_on, batch_axis=0,
                      tokens=np.sum(cm.step_tokens(phase, rows, length), axis=0))


def _scatter(values: Any, at: np.ndarray, shape: tuple[int, ...]) -> Any:
    """``values`` of the flat positions ``at`` of a grid of ``shape``, 0 elsewhere (0 stays a number)."""
    if np.isscalar(values) and values == 0:
        return values
    out = np.zeros(int(np.prod(shape)))
    out[at] = values
    return out.reshape(shape)


def p99_length_latency(timeline: Timeline, output: np.ndarray, length: int) -> float:
    """Expected latency of a request of ``length`` output tokens (ExeGPT's SLA-(b)).

    Averaged over the requests at least that long: each stands for a request of exactly that
    length joining in the same interval, so the steps priced are those of a job that really
    contains it. (A p99 over requests covers the tail; this is the typical long request.) A job
    too small to hold one (a few dozen requests) extends its longest request at the mean seconds
    per decode step it ran at: its latency alone named a shorter request than the SLA does.
    """
    sched = timeline.schedule
    S = max(sched.interval_steps, 1)
    long_enough = output >= length
    if not long_enough.any():
        i = int(np.argmax(output))
        decoding = timeline.latency_s[i] - timeline.prefill.seconds[sched.join[i]]
        per_step = max(float(decoding), 0.0) / max(int(output[i]) - 1, 1)
        return float(timeline.latency_s[i] + (length - int(output[i])) * per_step)
    joins = sched.join[long_enough]
    g = length - 1
    last = joins + max(g - 1, 0) // S
    u_last = g - (last - joins) * S if g > 0 else np.zeros_like(joins)
    cum = np.concatenate((np.zeros((len(timeline.start_s), 1)), np.cumsum(timeline.decode.seconds, axis=1)), axis=1)
    finish = timeline.start_s[last] + timeline.prefill.seconds[last] + cum[last, u_last]
    return float(np.mean(finish - timeline.start_s[joins]))


def quantile(values: np.ndarray, q: float, weights: np.ndarray | None = None) -> float:
    """The smallest value with at least a fraction ``q`` of the (weighted) mass at or below it."""
    if weights is None:
        return float(np.quantile(values, q, method="inverted_cdf"))
    order = np.argsort(values, kind="stable")
    cw = np.cumsum(weights[order])
    idx = int(np.searchsorted(cw, q * cw[-1] * (1 - 1e-12), side="left"))
    return float(values[order][min(idx, len(values) - 1)])


def summarize(cm: CostModel, policy: Policy, workload: Workload, *, method: str, profile: HardwareProfile,
              num_requests: int, seed: int | None, wall_s: float, generated: float, prompt_tokens: float,
              padded_prompt: float, latencies: np.ndarray, latency_weights: np.ndarray | None,
              p99_length_s: float, prefill: BlockStep, decode: BlockStep, prefill_steps: int,
              decode_steps: int, cache_positions: int | None = None,
              longest: tuple[int, int] | None = None) -> SimResult:
    """Turn priced steps and request latencies into a SimResult (shared by both paths);
    ``cache_positions``: the run's prefix cache (default: sized for the workload); ``longest``:
    the (prompt, output) lengths memory is sized for (default: the workload's longest)."""
    L = cm.spec.num_layers
    busy: dict[str, float] = {}
    for name in StepTerms().as_dict():
        busy[name] = float(L * (np.sum(getattr(prefill.terms, name)) + np.sum(getattr(decode.terms, name))))
    busy["head"] = float(np.sum(prefill.head_s) + np.sum(decode.head_s))
    compute_busy = busy["gpu_compute"] + busy["cpu_compute"] + busy["dequant"] + busy["quant"] + busy["head"]
    longest = longest or (workload.prompt.max_len, workload.output.max_len)
    if cache_positions is None:
        cache_positions = run_cache_positions(policy, workload, longest[0])
    peaks = cm.peak_bytes(policy, *longest, cache_positions)
    caps = {t: float(profile.capacity_bytes(t)) for t in peaks}
    # No request outlasts its job: the analytic path's spread, right for large jobs, gave one request
    # of a 1-request job a p99 twice the job's wall time.
    latencies = np.minimum(latencies, wall_s)
    mean_lat = float(np.average(latencies, weights=latency_weights))
    return SimResult(
        method=method, model=cm.spec.name, profile=profile.name, workload=workload.name, policy=policy,
        num_requests=num_requests, seed=seed, wall_s=wall_s, generated_tokens=generated,
        prompt_tokens=prompt_tokens, padded_prompt_tokens=padded_prompt,
        throughput_tokens_per_s=generated / wall_s,
        padded_throughput_tokens_per_s=(padded_prompt + generated) / wall_s,
        total_throughput_tokens_per_s=(prompt_tokens + generated) / wall_s,
        latency_mean_s=mean_lat, latency_p50_s=quantile(latencies, 0.5, latency_weights),
        latency_p90_s=quantile(latencies, 0.9, latency_weights),
        latency_p99_s=quantile(latencies, 0.99, latency_weights),
        latency_max_s=float(np.max(latencies[latency_weights > 0] if latency_weights is not None else latencies)),
        p99_output_len=workload.output.quantile(0.99), latency_p99_length_s=p99_length_s,
        peak_bytes=peaks, capacity_bytes=caps, fits=all(fits_in(peaks, profile).values()), busy_s=busy,
        stall_s=max(wall_s - compute_busy, 0.0), prefill_s=float(np.sum(prefill.seconds)),
        decode_s=float(np.sum(decode.seconds)), num_prefill_steps=prefill_steps, num_decode_steps=decode_steps)


def check_requests(prompt: Any, output: Any) -> tuple[np.ndarray, np.ndarray]:
    p, o = np.asarray(prompt), np.asarray(output)
    if p.ndim != 1 or p.shape != o.shape or p.size == 0:
        raise UserError("requests need equally long, non-empty lists of prompt and output lengths")
    if np.any(p < 1) or np.any(o < 1):
        raise UserError("every request needs a prompt and an output of at least 1 token")
    return p.astype(np.int64), o.astype(np.int64)


def simulate(spec: ModelSpec, profile: HardwareProfile, policy: Policy, workload: Workload,
             num_requests: int = DEFAULT_REQUESTS, seed: int = 0,
             requests: tuple[Any, Any] | None = None, prefix_of: Any = None,
             cache_positions: int | None = None, prefix_len: Any = None) -> SimResult:
    """Discrete-event prediction for ``num_requests`` requests sampled from ``workload``.

    ``requests = (prompt_lens, output_lens)`` simulates exactly those requests instead, and
    ``prefix_of`` (one per request) says which of the workload's ``prefix_groups`` prefixes each
    begins with (a job's own, ``workloads.workload.prefix_runs``; default: drawn by
    :meth:`Workload.prefix_ids`), and ``prefix_len`` how long each one's is (default: the
    workload's ``prefix_lengths``, or ``prefix_tokens``). ``cache_positions``: the run's prefix
    cache (default: the policy's, or sized for ``workload``: ``costmodel.run_cache_positions``, as
    ``xsched run`` sizes it for a plan's).
    """
    result, _ = simulate_timeline(spec, profile, policy, workload, num_requests, seed, requests, prefix_of,
                                  cache_positions, prefix_len)
    return result


def simulate_timeline(spec: ModelSpec, profile: HardwareProfile, policy: Policy, workload: Workload,
                      num_requests: int = DEFAULT_REQUESTS, seed: int = 0,
                      requests: tuple[Any, Any] | None = None,
                      prefix_of: Any = None, cache_positions: int | None = None,
                      prefix_len: Any = None) -> tuple[SimResult, Timeline]:
    """Like :func:`simulate`, also returning the :class:`Timeline` (for traces and tests)."""
    if requests is None:
        prompt, output = workload.sample(num_requests, seed)
    else:
        prompt, output = check_requests(*requests)
    if prefix_of is not None:
        prefix_of = np.asarray(prefix_of, np.int64)
        if prefix_of.shape != prompt.shape:
            raise UserError(f"prefix_of gives {prefix_of.size} prefixes for {prompt.size} requests")
    elif workload.prefix_groups > 1 or workload.prefix_share < 1.0:
        prefix_of = workload.prefix_ids(len(prompt), seed, prompt_lens=prompt)
    prefix = workload.prefix_tokens if prefix_len is not None or prefix_of is None or not workload.prefix_lengths \
        else workload.prefix_lengths_of(prefix_of)
    if prefix_len is not None:
        prefix = np.asarray(prefix_len, np.int64)
        if prefix.shape != prompt.shape:
            raise UserError(f"prefix_len gives {prefix.size} lengths for {prompt.size} requests")
    cm = CostModel.for_policy(spec, profile, policy)
    max_prompt = max(workload.prompt.max_len, int(prompt.max()))  # the engine's
    cache = run_cache_positions(policy, workload, max_prompt) if cache_positions is None else cache_positions
    tl = build_timeline(cm, policy, prompt, output, workload.prompt_groups(len(prompt)) if workload.samples > 1
                        else None, prefix, prefix_of, hold_positions=max_prompt, cache_positions=cache)
    p99_len = workload.output.quantile(0.99)
    result = summarize(
        cm, policy, workload, method="discrete-event", profile=profile, num_requests=len(prompt),
        seed=seed if requests is None else None, wall_s=tl.wall_s, generated=float(output.sum()),
        prompt_tokens=float(prompt.sum()), padded_prompt=float(np.sum(tl.prefill_positions)),
        latencies=tl.latency_s, latency_weights=None, p99_length_s=p99_length_latency(tl, output, p99_len),
        prefill=tl.prefill, decode=tl.decode, prefill_steps=int(np.count_nonzero(tl.prefill_rows.sum(axis=0))),
        decode_steps=int(np.count_nonzero(tl.decode_rows.sum(axis=0))), cache_positions=cache_positions,
        # (as the engine sizes for the job's: requests past the workload's lengths were priced at its memory)
        longest=(max_prompt, max(workload.output.max_len, int(output.max()))))
    return result, tl


_TRACK_OF = {"gpu_compute": "compute", "dequant": "compute", "quant": "compute", "cpu_compute": "cpu_compute",
             "ctog": "ctog", "gtoc": "gtoc", "dtoc": "dtoc", "ctod": "ctod"}
MAX_TRACE_EVENTS = 2_000_000


def trace_events(cm: CostModel, timeline: Timeline) -> list[TraceEvent]:
    """The simulated timeline as trace events: per step, each resource's busy time.

    A step's time on a resource is summed over the layers (one event per resource per step,
    not per layer, so long jobs stay openable); within a step, terms that run one after another
    (:func:`channel_groups`) are laid out in sequence from the step start, and the LM head
    runs on the compute track once the last layer is done.
    """
    L = cm.spec.num_layers
    groups = channel_groups(cm.profile.compute_device, cm.overlap)
    J, S = timeline.decode.seconds.shape
    pre, dec = timeline.prefill, timeline.decode
    pre_terms = {k: np.broadcast_to(np.asarray(v, float), (J,)) for k, v in pre.terms.as_dict().items()}
    dec_terms = {k: np.broadcast_to(np.asarray(v, float), (J, S)) for k, v in dec.terms.as_dict().items()}
    pre_head = np.broadcast_to(np.asarray(pre.head_s, float), (J,))
    dec_head = np.broadcast_to(np.asarray(dec.head_s, float), (J, S))
    cum = np.concatenate((np.zeros((J, 1)), np.cumsum(dec.seconds, axis=1)), axis=1)
    steps = int(np.count_nonzero(timeline.prefill_rows.sum(axis=0))) + int(np.count_nonzero(dec.seconds))
    if steps * 7 > MAX_TRACE_EVENTS:
        raise UserError(f"a trace of {steps} steps is too large to open; simulate fewer --requests for the trace")
    events: list[TraceEvent] = []

    def step(t0: float, seconds: float, terms: dict[str, float], head: float, args: dict[str, Any]) -> None:
        for group in groups:
            t = t0
            for name in group:
                dur = L * terms[name]
                if dur > 0:
                    events.append(TraceEvent(_TRACK_OF[name], name if name != "gpu_compute" else "layers", t, dur,
                                             args))
                    t += dur
        if head > 0:  # after the last layer
            events.append(TraceEvent("compute", "head", t0 + seconds - head, head, args))

    for j in range(J):
        t_j = float(timeline.start_s[j])
        rows = int(timeline.prefill_rows[:, j].sum())
        if rows:
            computed = int(timeline.prefill_computed[:, j].sum())  # a prompt's samples in one batch count once
            step(t_j, float(pre.seconds[j]), {k: float(v[j]) for k, v in pre_terms.items()}, float(pre_head[j]),
                 {"block": j, "step": 0, "phase": "prefill", "rows": rows, "layers": L,
                  "padded_len": int(timeline.prefill_len[:, j].max()),
                  **({"computed_rows": computed} if computed != rows else {}),
                  **({"positions": round(float(timeline.prefill_positions[:, j].sum()))}
                     if np.any(timeline.prefix) else {})})
        t_dec = t_j + float(pre.seconds[j])
        for u in np.flatnonzero(dec.seconds[j] > 0):
            step(t_dec + float(cum[j, u]), float(dec.seconds[j, u]), {k: float(v[j, u]) for k, v in dec_terms.items()},
                 float(dec_head[j, u]),
                 {"block": j, "step": int(u) + 1, "phase": "decode", "rows": int(timeline.decode_rows[:, j, u].sum()),
                  "layers": L, "context": int(timeline.decode_len[:, j, u].max())})
    return events
