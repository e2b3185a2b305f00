"""Prompts that begin alike (one system prompt, the same few-shot examples) prefilled once per prefix.

Causal attention makes a prompt's first ``L`` positions depend on its first ``L`` tokens only, so
rows of one prefill whose prompts share ``L`` leading tokens have equal hidden states, keys and
values there in every layer. :func:`plan_prefixes` groups a prefill's rows by such prefixes;
:func:`prefill_layer` then runs each layer on every group's prefix once and on the last ``S``
columns of every row (each row's own tokens, its *suffix*, end there), and spreads the prefix
results back into each row's columns. It returns what the plain layer returns (the hidden states
and the keys/values of all columns) so that the cache, the tiers and the next layer do not know.

Rows are left-padded to ``P`` columns (the engine's layout): a row with ``n`` tokens holds them in
columns ``P - n ..``; its prefix of ``L`` tokens takes the first ``L`` of them.

A block's GPU batches prefill one after another within each layer, so a prefix that an earlier
batch of the block computed is not computed again: :func:`plan_block` has the first batch holding
it keep its results (hidden states, keys and values of one layer; at most one prompt's worth of
positions, released after the last batch taking them) and later batches take them. Which prompts
join which batch still matters when a job mixes several prefixes (task templates): each batch's
suffix spans its longest prompt's own part. :func:`prefix_order` picks the block's order, by
length or by prefix, that computes fewer positions (:func:`block_positions`).

A run's later prefills (each refill, each later block) meet the same system prompts again: a
:class:`PrefixCache` keeps the keys and values of every layer of the prefixes a run computes
(those two or more rows share, or a row alone shares with one of the last prompts it saw;
within its capacity in positions, the most used where they do not all fit: ``xsched run`` sizes
it for the plan's workload's prefixes) and a later batch takes them, a row alone too, computing
only the rest of each prompt.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from xprofiler.specs import ModelSpec
from workloads.workload import RUN_SHARE_AT_LEAST, neighbour_runs, sorted_neighbours
from xrunner.model import Rope, Weights, attention, attn_in, attn_out_mlp
from xsimulator.costmodel import (PREFIX_CACHE_DISPLACE_MARGIN, PREFIX_CACHE_GHOSTS, PREFIX_CACHE_SEEN,
                                  SHARE_PREFIX_AT_MOST)

# Grouping thresholds ``prefix_order`` tries per block (each costs two groupings of every GPU batch).
ORDER_CANDIDATES = 12


@dataclass(frozen=True)
class Sharing:
    """Which of one GPU batch's prefix groups it computes (``own``) and which it takes from a
    prefix an earlier batch of the block computes and holds, or the run's :class:`PrefixCache`
    keeps (``sources[g]``, its id; None: its own); ``lends``: (group, id) results to hold for
    later batches; ``stores``: (group, id) results the cache keeps from now on; ``releases``:
    held ids no later batch takes (:func:`_share_block`)."""

    own: tuple[int, ...]
    sources: tuple[int | None, ...]
    lends: tuple[tuple[int, int], ...]
    releases: tuple[int, ...]
    stores: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class PrefixPlan:
    """How ``m`` rows of one prefill (``P`` columns) share prefixes: group ``g`` holds row
    ``reps[g]``'s first ``lengths[g]`` tokens; every row computes its last ``suffix`` columns. The
    index tensors (built once per prefill, used in every layer) say, for each row and each column
    before the suffix, which group holds it and where (``width``: the zero column of padding).

    ``share`` says which groups are computed here (the ``prefix_*`` tensors index them, padded to
    ``own_width``) and which take an earlier GPU batch's results."""

    reps: tuple[int, ...]
    lengths: tuple[int, ...]
    columns: int  # P
    suffix: int  # S
    group_idx: torch.Tensor  # [m, P - S] long
    col_idx: torch.Tensor  # [m, P - S] long, into a group's ``width + 1`` columns
    prefix_rows: torch.Tensor  # [len(own), own_width] long: the row each computed group reads its input from
    prefix_cols: torch.Tensor  # [len(own), own_width] long: and the column
    prefix_pos: torch.Tensor  # [len(own), own_width] long: position ids
    prefix_mask: torch.Tensor | None  # [len(own), own_width] bool; None when every such prefix is as long
    share: Sharing

    @property
    def width(self) -> int:
        return max(self.lengths)

    @property
    def own_width(self) -> int:
        return max((self.lengths[g] for g in self.share.own), default=0)

    @property
    def positions(self) -> int:
        """Prompt positions one layer computes: each computed group's padded prefix, each row's suffix."""
        return len(self.share.own) * self.own_width + int(self.group_idx.shape[0]) * self.suffix


class Held(NamedTuple):
    """One prefix's results in one layer, kept for later GPU batches of the block (or the run)."""

    hidden: torch.Tensor | None  # [n, d], the layer's output; None in the cache (a taker never reads it)
    k: torch.Tensor  # [Hkv, n, hd]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self if t is not None)


class PrefixCache:
    """Prefixes a run's earlier prefills computed, kept for its later ones (a refill, a later block).

    ``keys`` (id -> tokens as bytes) is what planning sees: :func:`plan_block` admits a computed
    prefix that two or more rows share while ``capacity`` positions allow (a longer run of an
    entry's tokens replaces it), and a row takes the most leading tokens any entry shares with its
    prompt. It remembers the last ``PREFIX_CACHE_GHOSTS`` prompts planned (``recent``): in a
    batch whose rows share too little among themselves, a row whose prompt begins as a recent one
    does computes that start as a group of its own, and it is admitted too (refilled one or two
    rows at a time, no two rows of a batch may ever share a template). When a prefix does not
    fit, the rows that computed it (now and before: ``seen``) are weighed against the rows that
    took or computed the least used entries (``uses``): where it has ``displace_margin`` times
    more, those leave when the step is done and it enters when a prefill next computes it, so a
    job with more templates than room keeps its most common ones, not its first.

    ``layers[l][id]`` holds an entry's keys and values in layer ``l`` once that layer computed
    them (the engine fills it); a replaced or leaving entry stays there, and in ``used``, until
    the step is done (``retired``: an earlier batch of that step may take it). Ids come from one
    counter shared with the held prefixes. ``displace_margin`` inf keeps the first that fit."""

    def __init__(self, capacity: int, displace_margin: float = PREFIX_CACHE_DISPLACE_MARGIN):
        self.capacity = capacity
        self.displace_margin = displace_margin
        self.keys: dict[int, bytes] = {}
        self.sizes: dict[int, int] = {}  # id -> positions, entries and retired ones
        self.uses: dict[int, int] = {}  # id -> rows that computed or took it
        self.seen: dict[bytes, int] = {}  # rows that computed a prefix the cache did not keep
        self.retired: list[int] = []
        self.leaving: list[int] = []  # entries a more used prefix displaces when the step is done
        self.claims: dict[bytes, int] = {}  # prefix -> the room its displacing frees, for the next step
        self.promised: dict[bytes, int] = {}  # (the claims of the step before: this step's)
        # the last prompts planned (none where nothing could be kept)
        self.recent: deque[bytes] = deque(maxlen=PREFIX_CACHE_GHOSTS if capacity > 0 else 0)
        self.ids = itertools.count()
        self.layers: dict[int, dict[int, Held]] = {}

    @property
    def used(self) -> int:
        return sum(self.sizes.values())

    def covering(self, key: bytes) -> int | None:
        """An entry whose tokens begin with ``key``'s (a taker takes its first ones), or None."""
        return next((i for i, k in self.keys.items() if k.startswith(key)), None)

    def longest_start(self, prompt: bytes, limit: int) -> tuple[int | None, int]:
        """(id, tokens): the entry sharing the most leading tokens with ``prompt``, at most ``limit``."""
        best: tuple[int | None, int] = (None, 0)
        for i, k in self.keys.items():
            n = min(len(os.path.commonprefix([k, prompt])) // _KEY_BYTES, limit)
            if n > best[1]:
                best = (i, n)
        return best

    def ghost_start(self, prompt: bytes, limit: int) -> int:
        """Leading tokens ``prompt`` shares with a recent prompt, at most ``limit``; 0 below
        ``RUN_SHARE_AT_LEAST`` of its tokens (a few tokens in common by chance)."""
        tokens = len(prompt) // _KEY_BYTES
        best = 0
        for k in self.recent:
            if k[:(best + 1) * _KEY_BYTES] != prompt[:(best + 1) * _KEY_BYTES]:
                continue  # (most differ at once, or share no more than the best so far)
            lo, hi = best + 1, min(len(k), len(prompt)) // _KEY_BYTES  # shares lo tokens; find the most
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if k[:mid * _KEY_BYTES] == prompt[:mid * _KEY_BYTES] else (lo, mid - 1)
            best = lo
        best = min(best, limit)
        return best if best >= max(1.0, RUN_SHARE_AT_LEAST * tokens) else 0

    def ghosted(self, key: bytes) -> bool:
        """Whether a recent prompt begins with ``key``'s tokens (so two prompts share them)."""
        return any(k.startswith(key) for k in self.recent)

    def took(self, ident: int, rows: int) -> None:
        """``rows`` of a prefill took entry ``ident``."""
        if ident in self.uses:
            self.uses[ident] += rows

    def _room(self, key: bytes) -> int:
        """Positions free for ``key`` now: the room promised to other prefixes is not."""
        return self.capacity - self.used - sum(n for k, n in self.promised.items() if k != key)

    def admit(self, key: bytes, rows: int = 2) -> int | None:
        """A new entry's id for ``key``, which ``rows`` of a prefill compute (retiring the entries
        it extends), or None when an entry covers it already or it does not fit (then the least
        used entries may be marked to leave for it: see the class)."""
        n = len(key) // _KEY_BYTES
        if self.covering(key) is not None:
            return None
        count = self.seen.pop(key, 0) + rows
        if n > self._room(key):
            self._displace(key, n, count)
            return None
        self.promised.pop(key, None)
        for i in [i for i, k in self.keys.items() if key.startswith(k)]:
            del self.keys[i]
            self.retired.append(i)
            count += self.uses.pop(i)
            if i in self.leaving:
                self.leaving.remove(i)
        ident = next(self.ids)
        self.keys[ident] = key
        self.sizes[ident] = n
        self.uses[ident] = count
        return ident

    def _displace(self, key: bytes, n: int, count: int) -> None:
        """Mark the least used entries to leave where ``count`` rows outweigh theirs and their
        room makes ``n`` fit, the room claimed for ``key`` in the next step (another prefix
        fitting in it first would undo the trade), and remember ``count`` for its next computation."""
        free = (self._room(key) + sum(self.sizes[i] for i in self.leaving)
                - sum(m for k, m in self.claims.items() if k != key))
        victims, weight = [], 0
        for i in sorted((i for i in self.keys if i not in self.leaving), key=lambda i: (self.uses[i], i)):
            if free >= n:
                break
            victims.append(i)
            weight += self.uses[i]
            free += self.sizes[i]
        if free >= n and weight * self.displace_margin < count:
            self.leaving += victims
            self.claims[key] = n
        self.seen[key] = count
        if len(self.seen) > PREFIX_CACHE_SEEN:  # forget the least seen
            del self.seen[min(self.seen, key=self.seen.__getitem__)]

    def drop_retired(self) -> list[int]:
        """Forget the entries replaced or displaced during the step just done; returns their ids."""
        for i in self.leaving:
            self.seen[self.keys.pop(i)] = self.uses.pop(i)
        out, self.retired, self.leaving = self.retired + self.leaving, [], []
        self.promised, self.claims = self.claims, {}
        for i in out:
            del self.sizes[i]
        return out

    def index_copy(self) -> "PrefixCache":
        """The keys and counts alone (planning a candidate order must not admit anything)."""
        out = PrefixCache(self.capacity, self.displace_margin)
        out.keys, out.sizes, out.ids = dict(self.keys), dict(self.sizes), itertools.count(10 ** 9)
        out.uses, out.seen, out.leaving = dict(self.uses), dict(self.seen), list(self.leaving)
        out.claims, out.promised = dict(self.claims), dict(self.promised)
        out.recent = deque(self.recent, maxlen=self.recent.maxlen)
        return out


def plan_prefixes(prompts: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> PrefixPlan | None:
    """Groups of rows sharing a prefix that cut the prefill's positions to ``SHARE_PREFIX_AT_MOST``
    of ``rows x P`` or fewer (``xsimulator.costmodel`` prices the same rule), or None.

    Rows sorted by prompt put shared prefixes next to each other: a group is a run whose
    neighbours share at least ``tau`` tokens, and ``tau`` is the one (among the neighbours' common
    lengths) that computes the fewest positions. Each row keeps at least its last token to itself
    (its logits come from the suffix). A row that shares with no other would need the suffix to
    hold its whole prompt; when that costs more, it computes its first tokens as a group of its own.
    """
    return plan_block([prompts], 0, device)[0]


def plan_block(batches: Sequence[Sequence[Sequence[int]]], hold_positions: int,
               device: torch.device | str = "cpu", cache: PrefixCache | None = None) -> list[PrefixPlan | None]:
    """:func:`plan_prefixes` for each of a block's GPU batches (in the order they compute), where a
    batch takes a prefix an earlier one computed (the same tokens, or a longer run of them) instead
    of computing it again. At most ``hold_positions`` prefix positions are held at a time (each
    one layer's hidden states, keys and values); 0 shares nothing across batches. ``cache``: the
    run's kept prefixes, which batches take too and which admits the ones computed here."""
    chosen = _share_block(batches, [_grouping(b) for b in batches], hold_positions,
                          PrefixCache(0) if cache is None else cache)
    return [None if c is None else _index_plan(b, c[0][1], c[0][2], max(len(p) for p in b), c[1], device)
            for b, c in zip(batches, chosen)]


def block_positions(batches: Sequence[Sequence[Sequence[int]]], hold_positions: int = 0,
                    share_prefixes: bool = True, cache: PrefixCache | None = None) -> int:
    """Prompt positions one layer computes for a block's prefills (:func:`plan_block`; ``cache``
    is not changed): each batch's distinct prompts (repeats are copies) padded to its longest, or
    fewer where they share prefixes."""
    distinct = [list(dict.fromkeys(tuple(p) for p in b)) for b in batches]
    if not share_prefixes:
        return sum(len(b) * max(len(p) for p in b) for b in distinct)
    cache = PrefixCache(0) if cache is None else cache.index_copy()
    total = 0
    for b, c in zip(distinct, _share_block(distinct, [_grouping(b) for b in distinct], hold_positions, cache)):
        total += len(b) * max(len(p) for p in b) if c is None else _positions(c[0], c[1].own, len(b))
    return total


def _positions(grouping: tuple[int, list[list[int]], list[int], int], own: Sequence[int], rows: int) -> int:
    """A batch's prompt positions (:attr:`PrefixPlan.positions`) before its index tensors exist."""
    lengths, S = grouping[2], grouping[3]
    return len(own) * max((lengths[g] for g in own), default=0) + rows * S


def _held_covering(held: dict[int, tuple[bytes, int]], key: bytes) -> int | None:
    return next((i for i, (k, _) in held.items() if k.startswith(key)), None)


def _share_block(batches: Sequence[Sequence[Sequence[int]]], groupings: Sequence[tuple | None],
                 hold_positions: int, cache: PrefixCache) -> list[tuple[tuple, Sharing] | None]:
    """Each batch's grouping (its own, or :func:`_cached_grouping` where the cache's prefixes cost
    fewer positions) and which of its groups it computes, takes from an earlier batch or the
    cache, lends or stores.

    A computed prefix that two or more rows share goes to the cache while it has room; another is
    held only when a later batch has a group it covers (its tokens begin the held ones), while
    ``hold_positions`` allow, and released after the last such batch. Holding nothing
    (``hold_positions`` 0), the cache shows what this step admits to the later steps only."""
    keys = [[] if g is None else [_key(b[run[0]][:n]) for run, n in zip(g[1], g[2])]
            for b, g in zip(batches, groupings)]
    held: dict[int, tuple[bytes, int]] = {}  # id -> (key, the last batch that may take it)
    used, out = 0, []
    planning = cache.index_copy() if hold_positions == 0 else cache  # (what later batches see)
    for j, b in enumerate(batches):
        plain = len(b) * max(len(p) for p in b)
        options = []
        if groupings[j] is not None:
            sources = [_held_covering(held, key) for key in keys[j]]
            options.append((groupings[j], [planning.covering(k) if s is None else s
                                           for k, s in zip(keys[j], sources)]))
        if planning.keys or planning.recent:
            cached = _cached_grouping(b, planning)
            # (at the plain prefill's positions too where it computes a start a recent prompt shares)
            if cached is not None and (cached[0][0] < plain or cached[0][0] == plain and _keeps(b, cached, planning)):
                options.append(cached)
        if not options:
            out.append(None)
            cache.recent.extend(_key(p) for p in b)
            continue
        grouping, sources = min(options, key=lambda o: _positions(o[0], [g for g, s in enumerate(o[1]) if s is None],
                                                                  len(b)))
        # A batch whose rows share too little among themselves plans around the cache: a row alone
        # beginning as a recent prompt did computes that start as a group of its own, kept here.
        ghosts = groupings[j] is None
        runs, lengths = grouping[1], grouping[2]
        own, lends, stores = [], [], []
        for g, src in enumerate(sources):
            if src is not None:
                cache.took(src, len(runs[g]))
                continue
            own.append(g)
            key = _key(b[runs[g][0]][:lengths[g]])
            ident = cache.admit(key, len(runs[g])) if len(runs[g]) > 1 or ghosts and cache.ghosted(key) else None
            if ident is not None:
                stores.append((g, ident))
                continue
            last = max((j2 for j2 in range(j + 1, len(keys)) if any(key.startswith(k2) for k2 in keys[j2])),
                       default=None)
            n = lengths[g]
            if last is not None and used + n <= hold_positions:
                ident = next(cache.ids)
                held[ident] = (key, last)
                lends.append((g, ident))
                used += n
        cache.recent.extend(_key(p) for p in b)  # (after its own admissions: a row does not share with itself)
        releases = tuple(i for i, (_, last) in held.items() if last == j)
        for i in releases:
            used -= len(held.pop(i)[0]) // _KEY_BYTES
        out.append((grouping, Sharing(tuple(own), tuple(sources), tuple(lends), releases, tuple(stores))))
    return out


def _keeps(prompts: Sequence[Sequence[int]], option: tuple[tuple, list[int | None]], cache: PrefixCache) -> bool:
    """Whether a grouping computes a row's start alone that a recent prompt shares (the cache
    keeps it where the batch's own grouping does not pass)."""
    (_, runs, lengths, _), sources = option
    return any(src is None and len(run) == 1 and cache.ghosted(_key(prompts[run[0]][:n]))
               for run, n, src in zip(runs, lengths, sources))


def _cached_grouping(prompts: Sequence[Sequence[int]], cache: PrefixCache
                     ) -> tuple[tuple[int, list[list[int]], list[int], int], list[int | None]] | None:
    """A batch's grouping around the cache: each row takes the most leading tokens an entry
    shares with its prompt (keeping a token of its own), rows taking as many of one entry forming
    a group; a row taking nothing whose prompt begins as a recent one does
    (:meth:`PrefixCache.ghost_start`) computes those tokens as a group of its own, for the cache
    to keep; the others compute their first tokens as groups of one where the suffix is shorter
    than their prompt. With the sources (cache ids, None for computed groups), or None when no
    row takes or shares anything."""
    m = len(prompts)
    n = np.array([len(p) for p in prompts])
    keys = [_key(p) for p in prompts]
    takes = [cache.longest_start(k, len(p) - 1) for k, p in zip(keys, prompts)]
    by_entry: dict[tuple[int, int], list[int]] = {}
    for i, (ident, t) in enumerate(takes):
        if ident is not None:
            by_entry.setdefault((ident, t), []).append(i)
    ghosts = {i: c for i, (ident, _) in enumerate(takes)
              if ident is None and cache.recent and (c := cache.ghost_start(keys[i], len(prompts[i]) - 1))}
    if not by_entry and not ghosts:
        return None
    floor = max([int(n[i]) - takes[i][1] for rows in by_entry.values() for i in rows]
                + [int(n[i]) - c for i, c in ghosts.items()])
    loners = np.array([i for i, (ident, _) in enumerate(takes) if ident is None and i not in ghosts], dtype=np.int64)
    cands = np.unique(np.concatenate(([floor], n[loners][n[loners] > floor])))
    over = n[loners][None, :] > cands[:, None]
    head = np.where(over, n[loners][None, :] - cands[:, None], 0).max(axis=1, initial=0)
    width = np.maximum(head, max(ghosts.values(), default=0))  # (computed groups pad to the widest)
    costs = (over.sum(axis=1) + len(ghosts)) * width + m * cands
    k = int(np.argmin(costs))
    S = int(cands[k])
    singles = [int(i) for i in loners if n[i] > S]
    runs = list(by_entry.values()) + [[i] for i in ghosts] + [[i] for i in singles]
    lengths = [t for _, t in by_entry] + list(ghosts.values()) + [int(n[i]) - S for i in singles]
    return ((int(costs[k]), runs, lengths, S),
            [ident for ident, _ in by_entry] + [None] * (len(ghosts) + len(singles)))


_KEY_BYTES = 4


def _key(tokens: Sequence[int]) -> bytes:
    """Prefix tokens as bytes: ``a.startswith(b)`` says ``b``'s tokens begin ``a``'s."""
    return np.asarray(tokens, dtype="<u4").tobytes()


def prefix_order(prompts: Sequence[Sequence[int]], batch_of: Sequence[int], hold_positions: int = 0,
                 cache: PrefixCache | None = None) -> list[int] | None:
    """An order of a block's joining ``prompts`` (given sorted by length; ``batch_of[k]``: the GPU
    batch that the ``k``-th of them joins) whose prefills compute fewer positions, or None.

    Length order cuts padding but scatters prompts that begin alike over every GPU batch, where
    each batch computes each prefix again (a job mixing a few task templates or system prompts).
    A candidate order keeps runs of prompts that share at least ``tau`` leading tokens together
    (sorted by length inside a run), the runs in token order, by their mean length (runs of
    like lengths then meet where a batch holds two) or largest first (so that prompts sharing
    nothing do not split the shared runs over batches where none passes the sharing rule: half
    of 24 prompts behind two prefixes computed no prefix once); the one computing the fewest positions
    (:func:`block_positions`, a later batch taking what an earlier one computed within
    ``hold_positions`` or what the run's ``cache`` keeps) wins, if it beats length order.
    """
    m = len(prompts)
    if not 1 < len(set(batch_of)) < m:
        return None  # one GPU batch groups whatever order its rows come in; one row per batch shares nothing

    def cost(order: Sequence[int]) -> int:
        cut: dict[int, list[Sequence[int]]] = {}
        for k, i in enumerate(order):
            cut.setdefault(batch_of[k], []).append(prompts[i])
        return block_positions([cut[j] for j in sorted(cut)], hold_positions, cache=cache)

    sorted_order, common = sorted_neighbours(prompts)
    taus = sorted({c for c in common if c > 0})
    if len(taus) > ORDER_CANDIDATES:  # spread the candidates over the common lengths seen
        taus = [taus[i] for i in np.linspace(0, len(taus) - 1, ORDER_CANDIDATES).round().astype(int)]
    best, best_cost = None, cost(range(m))
    for tau in taus:
        runs = [sorted(run, key=lambda i: (len(prompts[i]), i)) for run in neighbour_runs(sorted_order, common, tau)[0]]
        by_length = sorted(runs, key=lambda run: sum(len(prompts[i]) for i in run) / len(run))
        by_size = sorted(runs, key=len, reverse=True)  # shared runs together, before prompts sharing nothing
        for arrangement in (runs, by_length, by_size):
            order = [i for run in arrangement for i in run]
            c = cost(order)
            if c < best_cost:
                best, best_cost = order, c
    return best


def _grouping(prompts: Sequence[Sequence[int]]) -> tuple[int, list[list[int]], list[int], int] | None:
    """:func:`plan_prefixes`'s choice as (positions, runs of rows, their prefixes' lengths, suffix),
    or None."""
    m = len(prompts)
    if m < 2:
        return None
    n = np.array([len(p) for p in prompts])
    P = int(n.max())
    order, common = sorted_neighbours(prompts)
    best: tuple[int, list[list[int]], list[int], int] | None = None
    for tau in sorted({c for c in common if c > 0}):
        runs, shared = neighbour_runs(order, common, tau)
        groups = [(run, min(s, int(n[run].min()) - 1)) for run, s in zip(runs, shared) if len(run) > 1]
        groups = [(run, s) for run, s in groups if s > 0]
        if not groups:
            continue
        grouped = np.zeros(m, dtype=bool)
        for run, _ in groups:
            grouped[run] = True
        width = max(s for _, s in groups)
        floor = max(int(n[run].max()) - s for run, s in groups)  # the grouped rows' longest own part
        loners = np.flatnonzero(~grouped)
        # Suffix S >= floor: the loners longer than S compute their first n - S tokens as groups of one.
        cands = np.unique(np.concatenate(([floor], n[loners][n[loners] > floor])))
        over = n[loners][None, :] > cands[:, None]  # [candidates, loners]
        head = np.where(over, n[loners][None, :] - cands[:, None], 0).max(axis=1, initial=0)
        costs = (len(groups) + over.sum(axis=1)) * np.maximum(width, head) + m * cands
        k = int(np.argmin(costs))
        if best is None or costs[k] < best[0]:
            S = int(cands[k])
            singles = [int(i) for i in loners if n[i] > S]
            best = (int(costs[k]), [run for run, _ in groups] + [[i] for i in singles],
                    [s for _, s in groups] + [int(n[i]) - S for i in singles], S)
    if best is None or best[0] > SHARE_PREFIX_AT_MOST * m * P:
        return None
    return best


def _index_plan(prompts: Sequence[Sequence[int]], runs: list[list[int]], lengths: list[int], P: int,
                sharing: Sharing, device: torch.device | str) -> PrefixPlan:
    m, width = len(prompts), max(lengths)
    keep, group_of = [0] * m, [0] * m
    for g, (run, s) in enumerate(zip(runs, lengths)):
        for i in run:
            keep[i], group_of[i] = s, g
    S = max(len(p) - k for p, k in zip(prompts, keep))
    group_idx = torch.zeros((m, P - S), dtype=torch.long)
    col_idx = torch.full((m, P - S), width, dtype=torch.long)  # the zero column unless a prefix token
    for i, p in enumerate(prompts):
        first = P - len(p)
        g = group_of[i]
        group_idx[i] = g
        if keep[i] and first < P - S:  # its columns before the suffix hold the first of its prefix's tokens
            col_idx[i, first:] = torch.arange(width - lengths[g], width - lengths[g] + P - S - first)
    reps = tuple(run[0] for run in runs)
    own = sharing.own
    w_own = max((lengths[g] for g in own), default=0)
    prefix_rows = torch.tensor([[reps[g]] * w_own for g in own], dtype=torch.long).reshape(len(own), w_own)
    prefix_cols = torch.zeros((len(own), w_own), dtype=torch.long)
    prefix_pos = torch.zeros((len(own), w_own), dtype=torch.long)
    prefix_mask = torch.zeros((len(own), w_own), dtype=torch.bool)
    for o, g in enumerate(own):
        first, s = P - len(prompts[reps[g]]), lengths[g]
        prefix_cols[o, w_own - s:] = torch.arange(first, first + s)
        prefix_cols[o, :w_own - s] = first  # padding reads any real column; the mask hides it
        prefix_pos[o, w_own - s:] = torch.arange(s)
        prefix_mask[o, w_own - s:] = True
    return PrefixPlan(reps=reps, lengths=tuple(lengths), columns=P, suffix=S, group_idx=group_idx.to(device),
                      col_idx=col_idx.to(device), prefix_rows=prefix_rows.to(device),
                      prefix_cols=prefix_cols.to(device), prefix_pos=prefix_pos.to(device),
                      prefix_mask=None if bool(prefix_mask.all()) else prefix_mask.to(device),
                      share=sharing)


def _spread(plan: PrefixPlan, shared: torch.Tensor, own: torch.Tensor, dim: int) -> torch.Tensor:
    """Each row's columns before the suffix from its group's ``shared`` result (time along ``dim``
    1 or 2 of ``[G, width, ...]`` / ``[G, h, width, d]``), then its own last ``S`` columns."""
    pad_shape = list(shared.shape)
    pad_shape[dim] = 1
    ext = torch.cat([shared, shared.new_zeros(pad_shape)], dim=dim)
    if dim == 1:
        head = ext[plan.group_idx, plan.col_idx]  # [m, P - S, ...]
    else:  # advanced indices around a slice put their dims first: [m, P - S, h, d]
        head = ext[plan.group_idx, :, plan.col_idx].transpose(1, 2)
    return torch.cat([head, own], dim=dim)


def prefill_layer(spec: ModelSpec, w: Weights, hidden: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None,
                  rope: Rope | None, plan: PrefixPlan, sinks: torch.Tensor | None = None,
                  held: dict[int, Held] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, Held]]:
    """One decoder layer's prefill of ``hidden [m, P, d]`` computing shared prefixes once; returns
    (hidden out ``[m, P, d]``, k, v ``[m, Hkv, P, hd]``) as the plain layer computes them (a taken
    prefix's hidden states are zero where the source kept none: no later layer reads them), and
    the prefix results ``plan.share.lends`` asks to hold for later GPU batches and ``stores`` for
    the run's cache, without hidden states (``held``: those earlier batches or the cache hold, by
    id)."""
    S, P = plan.suffix, plan.columns
    share = plan.share
    parts: tuple[torch.Tensor, ...] = ()
    if share.own:
        xp = hidden[plan.prefix_rows, plan.prefix_cols]  # [own, own_width, d]
        q, k_p, v_p = attn_in(spec, w, xp, plan.prefix_pos, rope)
        attn = attention(spec, q, k_p, v_p, plan.prefix_mask, causal=True, sinks=sinks)
        parts = (attn_out_mlp(spec, w, attn, xp), k_p, v_p)
    wo, slot = plan.own_width, {g: o for o, g in enumerate(share.own)}
    lent = {ident: Held(*(_cols(t, slot[g], wo - plan.lengths[g], wo).clone() for t in parts))
            for g, ident in share.lends}
    lent.update({ident: Held(None, *(_cols(t, slot[g], wo - plan.lengths[g], wo).clone() for t in parts[1:]))
                 for g, ident in share.stores})
    if any(src is not None for src in share.sources):  # every group's results, right-aligned to width
        assert held is not None, "a plan that takes prefixes needs the held ones"
        wd, G = plan.width, len(plan.reps)
        ref = next(held[src] for src in share.sources if src is not None)
        full = [hidden.new_zeros((G, wd, hidden.shape[-1]))] + [r.new_zeros((G, r.shape[0], wd, r.shape[-1]))
                                                                for r in (ref.k, ref.v)]
        for g, (n, src) in enumerate(zip(plan.lengths, share.sources)):
            pieces = (_cols(t, slot[g], wo - n, wo) for t in parts) if src is None else \
                (None if t is None else _cols(t, None, 0, n) for t in held[src])
            for dst, piece in zip(full, pieces):
                if piece is not None:
                    _cols(dst, g, wd - n, wd).copy_(piece)
        parts = tuple(full)
    hp, k_p, v_p = parts
    xs = hidden[:, P - S:]
    q, k_s, v_s = attn_in(spec, w, xs, pos[:, P - S:], rope)
    k, v = _spread(plan, k_p, k_s, 2), _spread(plan, v_p, v_s, 2)
    attn = attention(spec, q, k, v, mask, causal=True, sinks=sinks)
    hs = attn_out_mlp(spec, w, attn, xs)
    return _spread(plan, hp, hs, 1), k, v, lent


def _cols(t: torch.Tensor, group: int | None, a: int, b: int) -> torch.Tensor:
    """Columns ``a:b`` of one group of a prefix result (``[G, width, d]`` or ``[G, h, width, hd]``),
    or of a held one (``group`` None: ``[width, d]`` or ``[h, width, hd]``)."""
    if group is not None:
        t = t[group]
    return t[a:b] if t.dim() == 2 else t[:, a:b]
