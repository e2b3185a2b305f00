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

Sharing happens inside one GPU batch, so which prompts join which batch matters when a job mixes
several prefixes (task templates): :func:`prefix_order` picks the block's order, by length or by
prefix, that computes fewer positions (:func:`prefill_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from xprofiler.specs import ModelSpec
from workloads.workload import neighbour_runs, sorted_neighbours
from xrunner.model import Rope, Weights, attention, attn_in, attn_out_mlp
from xsimulator.costmodel import SHARE_PREFIX_AT_MOST

# Grouping thresholds ``prefix_order`` tries per block (each costs two groupings of every GPU batch).
ORDER_CANDIDATES = 12


@dataclass(frozen=True)
class PrefixPlan:
    """How ``m`` rows of one prefill (``P`` columns) share prefixes: group ``g`` computes row
    ``reps[g]``'s first ``lengths[g]`` tokens; every row computes its last ``suffix`` columns. The
    index tensors (built once per prefill, used in every layer) say, for each row and each column
    before the suffix, which group holds it and where (``width``: the zero column of padding)."""

    reps: tuple[int, ...]
    lengths: tuple[int, ...]
    columns: int  # P
    suffix: int  # S
    group_idx: torch.Tensor  # [m, P - S] long
    col_idx: torch.Tensor  # [m, P - S] long, into a group's ``width + 1`` columns
    prefix_rows: torch.Tensor  # [G, width] long: the row each group reads its input from
    prefix_cols: torch.Tensor  # [G, width] long: and the column
    prefix_pos: torch.Tensor  # [G, width] long: position ids
    prefix_mask: torch.Tensor | None  # [G, width] bool; None when every group's prefix is as long

    @property
    def width(self) -> int:
        return max(self.lengths)

    @property
    def positions(self) -> int:
        """Prompt positions one layer computes: each group's padded prefix, each row's suffix."""
        return len(self.reps) * self.width + int(self.group_idx.shape[0]) * self.suffix


def plan_prefixes(prompts: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> PrefixPlan | None:
    """Groups of rows sharing a prefix that cut the prefill's positions to ``SHARE_PREFIX_AT_MOST``
    of ``rows x P`` or fewer (``xsimulator.costmodel`` prices the same rule), or None.

    Rows sorted by prompt put shared prefixes next to each other: a group is a run whose
    neighbours share at least ``tau`` tokens, and ``tau`` is the one (among the neighbours' common
    lengths) that computes the fewest positions. Each row keeps at least its last token to itself
    (its logits come from the suffix). A row that shares with no other would need the suffix to
    hold its whole prompt; when that costs more, it computes its first tokens as a group of its own.
    """
    best = _grouping(prompts)
    if best is None:
        return None
    _, runs, lengths = best
    return _index_plan(prompts, runs, lengths, max(len(p) for p in prompts), device)


def prefill_positions(prompts: Sequence[Sequence[int]], share_prefixes: bool = True) -> int:
    """Prompt positions one layer computes for a GPU batch's prefill of ``prompts``: its distinct
    prompts (repeats are copies) padded to the longest, or fewer where they share prefixes."""
    distinct = list(dict.fromkeys(tuple(p) for p in prompts))
    best = _grouping(distinct) if share_prefixes else None
    return len(distinct) * max(len(p) for p in distinct) if best is None else best[0]


def prefix_order(prompts: Sequence[Sequence[int]], batch_of: Sequence[int]) -> list[int] | None:
    """An order of a block's joining ``prompts`` (given sorted by length; ``batch_of[k]``: the GPU
    batch that the ``k``-th of them joins) whose prefills compute fewer positions, or None.

    Length order cuts padding but scatters prompts that begin alike over every GPU batch, where
    each batch computes each prefix again (a job mixing a few task templates or system prompts).
    A candidate order keeps runs of prompts that share at least ``tau`` leading tokens together
    (sorted by length inside a run), the runs in token order or by their mean length (runs of
    like lengths then meet where a batch holds two); the one computing the fewest positions
    (:func:`prefill_positions`, summed over the batches) wins, if it beats length order.
    """
    m = len(prompts)
    if not 1 < len(set(batch_of)) < m:
        return None  # one GPU batch groups whatever order its rows come in; one row per batch shares nothing

    def cost(order: Sequence[int]) -> int:
        cut: dict[int, list[Sequence[int]]] = {}
        for k, i in enumerate(order):
            cut.setdefault(batch_of[k], []).append(prompts[i])
        return sum(prefill_positions(b) for b in cut.values())

    sorted_order, common = sorted_neighbours(prompts)
    taus = sorted({c for c in common if c > 0})
    if len(taus) > ORDER_CANDIDATES:  # spread the candidates over the common lengths seen
        taus = [taus[i] for i in np.linspace(0, len(taus) - 1, ORDER_CANDIDATES).round().astype(int)]
    best, best_cost = None, cost(range(m))
    for tau in taus:
        runs = [sorted(run, key=lambda i: (len(prompts[i]), i)) for run in neighbour_runs(sorted_order, common, tau)[0]]
        by_length = sorted(runs, key=lambda run: sum(len(prompts[i]) for i in run) / len(run))
        for arrangement in (runs, by_length):
            order = [i for run in arrangement for i in run]
            c = cost(order)
            if c < best_cost:
                best, best_cost = order, c
    return best


def _grouping(prompts: Sequence[Sequence[int]]) -> tuple[int, list[list[int]], list[int]] | None:
    """:func:`plan_prefixes`'s choice as (positions, runs of rows, their prefixes' lengths), or None."""
    m = len(prompts)
    if m < 2:
        return None
    n = np.array([len(p) for p in prompts])
    P = int(n.max())
    order, common = sorted_neighbours(prompts)
    best: tuple[int, list[list[int]], list[int]] | None = None
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
                    [s for _, s in groups] + [int(n[i]) - S for i in singles])
    if best is None or best[0] > SHARE_PREFIX_AT_MOST * m * P:
        return None
    return best


def _index_plan(prompts: Sequence[Sequence[int]], runs: list[list[int]], lengths: list[int], P: int,
                device: torch.device | str) -> PrefixPlan:
    m, G, width = len(prompts), len(runs), max(lengths)
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
    prefix_rows = torch.tensor([[r] * width for r in reps], dtype=torch.long)
    prefix_cols = torch.zeros((G, width), dtype=torch.long)
    prefix_pos = torch.zeros((G, width), dtype=torch.long)
    prefix_mask = torch.zeros((G, width), dtype=torch.bool)
    for g, (r, s) in enumerate(zip(reps, lengths)):
        first = P - len(prompts[r])
        prefix_cols[g, width - s:] = torch.arange(first, first + s)
        prefix_cols[g, :width - s] = first  # padding reads any real column; the mask hides it
        prefix_pos[g, width - s:] = torch.arange(s)
        prefix_mask[g, width - s:] = True
    return PrefixPlan(reps=reps, lengths=tuple(lengths), columns=P, suffix=S, group_idx=group_idx.to(device),
                      col_idx=col_idx.to(device), prefix_rows=prefix_rows.to(device),
                      prefix_cols=prefix_cols.to(device), prefix_pos=prefix_pos.to(device),
                      prefix_mask=None if bool(prefix_mask.all()) else prefix_mask.to(device))


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
                  rope: Rope | None, plan: PrefixPlan, sinks: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer's prefill of ``hidden [m, P, d]`` computing shared prefixes once; returns
    (hidden out ``[m, P, d]``, k, v ``[m, Hkv, P, hd]``) as the plain layer computes them."""
    S, P = plan.suffix, plan.columns
    xp = hidden[plan.prefix_rows, plan.prefix_cols]  # [G, width, d]
    q, k_p, v_p = attn_in(spec, w, xp, plan.prefix_pos, rope)
    attn = attention(spec, q, k_p, v_p, plan.prefix_mask, causal=True, sinks=sinks)
    hp = attn_out_mlp(spec, w, attn, xp)
    xs = hidden[:, P - S:]
    q, k_s, v_s = attn_in(spec, w, xs, pos[:, P - S:], rope)
    k, v = _spread(plan, k_p, k_s, 2), _spread(plan, v_p, v_s, 2)
    attn = attention(spec, q, k, v, mask, causal=True, sinks=sinks)
    hs = attn_out_mlp(spec, w, attn, xs)
    return _spread(plan, hp, hs, 1), k, v
