"""Analytic fast path: expected step shapes from the length distributions (ExeGPT §6).

Instead of sampling requests, this works with expectations over the prompt and output pmfs and
prices the *expected* steps with the same :class:`CostModel` as the discrete-event path:

- Slots of a block hold a request for ``d(n) = max(1, ceil((n - 1) / R))`` intervals; ExeGPT's
  P_D(U|S) is the step ``U = 1 + ((n - 2) mod R)`` in its last interval at which it finishes.
  The expected fraction of slots refilled at each interval follows the renewal recursion
  ``m_j = sum_i P(d = i) m_{j-i}`` (capped by the queue), so the expected active rows at step u
  of interval j are ``p[j, u] = sum_i m_{j-i} P(n - 1 >= i R + u)``. ExeGPT's P_D(U) is the
  stationary case of this: completions per interval = slots * sum_U P_D(U) when every request
  is weighted by its occupancy (renewal-reward), which is what the recursion reaches.
- ``R = 0`` (no refill) is the case where every slot is refilled at each block: full blocks
  are identical in expectation, so one full and one partial block are priced.
- Active rows per GPU batch are Binomial(rows, p); the step is priced conditional on its batch
  being active, weighted by that probability. The padded prompt of a GPU batch is an order
  statistic of the block's prompts (bucketed) or the max of its rows (not bucketed), computed
  with the regularised incomplete beta function; its expectation of non-linear terms uses an
  equal-probability quadrature. The padded context is ``E[max]`` over the active rows of
  prompt + age (ages exact for a block's first interval, stationary after refills begin).
- Latency percentiles need the spread between blocks too: without refill, prefills are priced
  under equally likely padded-length scenarios and the decode time a request sees varies with
  the other rows' lengths (variance of ``min(n - 1, c)`` times the cost of one row-step); with
  refill, each interval a request lives through adds the variance of one interval (joiner
  count and prompt lengths, active rows), as a normal spread.

Stated tolerance against the discrete-event path (tested on every preset with I/O-bound and
compute-bound policies, refill 0/1/8; measured again by ``benchmarks/sim_speed.py``): throughput
within 5%, mean latency within 7%, p50/p99/p99-length latency within 12%, for jobs of a few
thousand requests (measured worst over 300 jobs: 4.4%, 5.2%, 8.8%, 8.3%, 10.1%). The main errors
are Jensen gaps (``max`` of expected terms, expected max of lengths), the stationary age mixture
after refills and the normal approximation of how latency spreads between blocks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import signal, special, stats

from workloads.workload import Workload
from xprofiler.profile import HardwareProfile
from xprofiler.specs import ModelSpec
from xsched.errors import UserError
from xsimulator.costmodel import (BlockStep, CostModel, StepTerms, prefix_groups_in_batch, run_cache_positions,
                                  uncached_prefix_share)
from xsimulator.policy import Policy
from xsimulator.result import SimResult
from xsimulator.discrete_event import DEFAULT_REQUESTS, summarize

QUADRATURE = 16  # equal-probability nodes for expectations over a padded length
_LEVELS = (np.arange(QUADRATURE) + 0.5) / QUADRATURE
_LATENCY_BINS = 8192


_NOISE_NODES = 7  # equal-probability normal quantiles that smear a latency by its spread


def _with_spread(values: np.ndarray, weights: np.ndarray, sd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Latency values with a normal spread ``sd`` each, as weighted equal-probability nodes."""
    z = stats.norm.ppf((np.arange(_NOISE_NODES) + 0.5) / _NOISE_NODES)
    spread = values[..., None] + np.asarray(sd)[..., None] * z
    return np.maximum(spread, 0.0), np.broadcast_to(weights[..., None] / _NOISE_NODES, spread.shape)


_LATENCY_GROUPS = 64  # join intervals represented in the latency distribution


def _representatives(index: np.ndarray, weight: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``groups`` of the (ordered) ``index`` values, each carrying its group's weight.

    Latency curves of neighbouring join intervals are nearly equal, so the middle interval of
    each run of about equal weight stands for the run; this bounds the cost of the quantiles.
    """
    if len(index) <= groups:
        return index, weight
    cum = np.cumsum(weight) / weight.sum()
    group = np.minimum((cum * groups - 1e-12).astype(np.int64), groups - 1)
    starts = np.flatnonzero(np.diff(np.concatenate(([-1], group))))
    ends = np.concatenate((starts[1:], [len(index)]))
    middle = (starts + ends - 1) // 2
    return index[middle], np.add.reduceat(weight, starts)


def _scaled(step: BlockStep, w: Any) -> BlockStep:
    return BlockStep(step.terms.scaled(w), step.head_s * w, step.seconds * w)


def _concat(a: BlockStep, b: BlockStep) -> BlockStep:
    cat = lambda x, y: np.concatenate((np.ravel(x), np.ravel(y)))  # noqa: E731
    terms = StepTerms(*(cat(getattr(a.terms, k), getattr(b.terms, k)) for k in a.terms.as_dict()))
    return BlockStep(terms, cat(a.head_s, b.head_s), cat(a.seconds, b.seconds))


class _Analytic:
    """Expected-value pricing of one policy on one workload."""

    def __init__(self, cm: CostModel, policy: Policy, workload: Workload, n: int):
        self.cm, self.policy, self.workload, self.n = cm, policy, workload, n
        self.placement = policy.placement()
        self.prompt = workload.prompt
        xo, po = workload.output.pmf()
        self.out_support, self.out_pmf = xo, po
        top = int(xo[-1])
        self.max_out = top
        # surv[x] = P(n > x) = P(n - 1 >= x): a row is active in decode step x after joining
        surv = 1.0 - np.cumsum(np.bincount(xo, po, minlength=top + 2))
        self.surv = np.clip(surv, 0.0, 1.0)
        # Var(min(n - 1, c)) for c = 0..top: how much the decode work a request sees before
        # its c-th step varies with the lengths of the other rows.
        x = np.arange(1, top + 2)
        e1 = np.concatenate(([0.0], np.cumsum(self.surv[1:])))
        e2 = np.concatenate(([0.0], np.cumsum((2 * x - 1) * self.surv[1:])))
        self.var_min = np.clip(e2 - e1**2, 0.0, None)
        # Joiners sorted by prefix, then length (the engine's prefix order) when that computes fewer
        # prefill positions in a full block: GPU batches then hold few prefixes but prompts of any
        # length, so they are priced as not sorted by length. Else by length alone (``bucket``).
        self.by_prefix = policy.bucket and self._prefix_first()
        self.bucketed = policy.bucket and not self.by_prefix

    # ---------------------------------------------------------------- length expectations
    def distinct(self, requests: Any) -> Any:
        """Expected distinct prompts among ``requests`` adjacent requests: a prompt's samples are
        runs of k, and a window of r at a random offset meets (r - 1) / k + 1 of them."""
        k = self.workload.samples
        r = np.asarray(requests, dtype=float)
        return r if k == 1 else np.where(r > 1, (r - 1) / k + 1, r)

    def prompt_nodes(self, rank: Any, total: Any) -> np.ndarray:
        """Quadrature nodes of the ``rank``-th smallest of ``total`` prompts: [..., Q] (requests
        that sample one prompt count once)."""
        rank = self.distinct(rank)[..., None]
        total = self.distinct(total)[..., None]
        safe_r = np.maximum(rank, 1e-9)
        level = special.betaincinv(safe_r, np.maximum(total - safe_r + 1.0, 1e-9), _LEVELS)
        return self.prompt.ppf(np.clip(level, 0.0, 1.0)).astype(float)

    def max_prompt_in_band(self, lo: np.ndarray, hi: np.ndarray, a: np.ndarray) -> np.ndarray:
        """E[max of ``a`` prompts drawn from the quantile band lo..hi of the prompt pmf]."""
        lv = _LEVELS ** (1.0 / np.maximum(self.distinct(a), 1e-9))[..., None]
        return self.prompt.ppf(np.clip(lo[..., None] + lv * (hi - lo)[..., None], 0.0, 1.0)).mean(axis=-1)

    # ---------------------------------------------------------------- steps
    def computed_rows(self, rows: np.ndarray) -> np.ndarray:
        """Expected rows a prefill of ``rows`` joining rows computes: :meth:`distinct`, except
        in blocks without refill whose GPU batches hold whole runs (bucketing keeps a run
        adjacent), which cut no run: r / k."""
        k, pol = self.workload.samples, self.policy
        if k > 1 and pol.refill_every == 0 and pol.gbs % k == 0:
            return rows / k
        return self.distinct(rows)

    @property
    def uncached(self) -> float:
        """Share of the workload's prefixes that the run's prefix cache does not keep
        (:func:`~xsimulator.costmodel.uncached_prefix_share`)."""
        w = self.workload
        cache = run_cache_positions(self.policy, w)
        return uncached_prefix_share(cache, w.prefix_tokens, w.prefix_groups, w.prefix_table[0])

    def prefix_groups(self, rows: np.ndarray, by_prefix: Any = None, joining: Any = None,
                      weight: Any = None, fresh: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Expected distinct prefixes among each GPU batch's computed rows (``rows [..., nb]``;
        :func:`~xsimulator.costmodel.prefix_groups_in_batch`), and how many of them it computes
        itself (the others an earlier batch of the prefill did: ``xrunner.prefix.plan_block``).
        The joiners (``joining [..., 1]`` computed rows in all; default: the batches' sum) are
        sorted by prefix where ``by_prefix`` (a bool, or one per leading index: ``[..., 1]``);
        ``weight``: P(batch runs), default whether it has rows. ``fresh``: the share of them not in
        the run's cache yet (default :attr:`uncached`, a later prefill's; 1: the run's first).

        The block computes the ``G (1 - (1 - 1/G)^N)`` distinct prefixes of its ``N`` joiners
        once each, every batch its share. Joiners in length order spread each prefix over the
        batches, which hold ``max_prompt`` positions of prefixes at a time, so that share of
        the distinct ones is taken, the rest computed again."""
        w = self.workload
        computed = self.computed_rows(rows)
        if joining is None:
            joining = np.sum(computed, axis=-1, keepdims=True)
        by_prefix = self.by_prefix if by_prefix is None else by_prefix
        count = lambda ordered: prefix_groups_in_batch(computed, joining, w.effective_prefix_groups,  # noqa: E731
                                                       ordered=ordered)
        groups = (count(bool(by_prefix)) if np.ndim(by_prefix) == 0
                  else np.where(by_prefix, count(True), count(False)))
        weight = (computed > 0) if weight is None else weight
        total = np.sum(weight * groups, axis=-1, keepdims=True)
        distinct = np.minimum(prefix_groups_in_batch(joining, joining, w.effective_prefix_groups, ordered=False),
                              total)
        taken = np.clip(1.0 - distinct / np.maximum(total, 1e-300), 0.0, 1.0)
        held = np.minimum(1.0, w.prompt.max_len / max(w.prefix_tokens, 1) / np.maximum(distinct, 1.0))
        taken = taken * np.where(by_prefix, 1.0, held)
        return groups, groups * (1.0 - taken) * (self.uncached if fresh is None else fresh)

    def prefix_at(self, nodes: np.ndarray) -> Any:
        """Shared tokens priced for a batch whose longest prompt is ``nodes``: the workload's mean
        (``prefix_tokens x prefix_share``), or, where its prefixes differ in length
        (``prefix_lengths``), ``prefix_share`` times the expected length of the prefix behind a
        prompt of that length. A prompt is a prefix plus an own part, normal with the prompts'
        mean less the prefixes' and the variance left over; the longest is taken one standard
        deviation up. Priced at the mean, a 300-token template's prompts read as a few shared
        tokens before hundreds of their own (1.4-4.8x the engine's positions on such jobs)."""
        w = self.workload
        lengths, weights = w.prefix_table
        if not w.prefix_lengths or np.ptp(lengths) == 0:
            return w.mean_prefix_tokens
        mean = float(np.sum(lengths * weights) / weights.sum())
        spread = math.sqrt(max(self.prompt.std ** 2 - float(np.sum(weights * (lengths - mean) ** 2) / weights.sum()),
                               1.0))
        own = max(self.prompt.mean - mean, 1.0) + spread
        z = (np.asarray(nodes, float)[..., None] - lengths - own) / spread
        like = weights * np.exp(-0.5 * z * z) * (lengths < np.asarray(nodes, float)[..., None])
        total = like.sum(axis=-1)
        expected = np.where(total > 0, (like * lengths).sum(axis=-1) / np.maximum(total, 1e-300), 0.0)
        return w.prefix_share * expected

    def positions(self, rows: np.ndarray, nodes: np.ndarray, by_prefix: Any = None, joining: Any = None,
                  weight: Any = None, fresh: Any = None) -> np.ndarray:
        """Prompt positions a prefill of ``rows`` joining rows computes at each padded length of
        ``nodes [..., Q]``: :meth:`computed_rows`, and each shared prefix once."""
        computed = self.computed_rows(rows)[..., None]
        groups, own = self.prefix_groups(rows, by_prefix, joining, weight, fresh)
        return self.cm.layer_rows("prefill", computed, nodes, self.prefix_at(nodes), groups[..., None],
                                  own[..., None]) * nodes

    def _prefix_first(self) -> bool:
        """Whether a full block's prefill computes fewer positions with its prompts sorted by
        prefix (batches of few prefixes, any length) than by length (each batch meets most)."""
        w, pol = self.workload, self.policy
        if w.prefix_groups <= 1 or not w.prefix_tokens or pol.nb < 2:
            return False
        rows = np.full(pol.nb, float(pol.gbs))
        by_length = self.positions(rows, self.prompt_nodes(np.cumsum(rows), np.full(pol.nb, rows.sum())), False)
        return bool(np.sum(self.positions(rows, self.prompt_nodes(rows, rows), True)) < np.sum(by_length))

    def prefill(self, rows: np.ndarray, nodes: np.ndarray, weight: np.ndarray, by_prefix: Any = None,
                joining: Any = None, fresh: Any = None) -> BlockStep:
        """Expected prefill of GPU batches with ``rows`` each ([..., nb]); ``weight`` = P(batch runs).

        ``nodes`` [..., nb, Q] are quadrature nodes of each batch's padded prompt length;
        ``by_prefix``, ``joining``, ``fresh``: see :meth:`prefix_groups`.
        """
        r = rows[..., None]
        computed = self.computed_rows(rows)
        c = computed[..., None]
        cm = self.cm
        groups, own = self.prefix_groups(rows, by_prefix, joining, weight, fresh)
        bt = cm.batch_terms("prefill", r, nodes, self.placement, computed=c, prefix=self.prefix_at(nodes),
                            prefix_groups=groups[..., None], prefix_own=own[..., None])
        shape = nodes.shape
        terms = StepTerms(*(np.mean(np.broadcast_to(v, shape), axis=-1) for v in bt.as_dict().values()))
        block = 1.0 - np.prod(1.0 - weight, axis=-1)
        # The LM head is one product over the block's rows: priced at their expected count in a
        # step that runs (the weights are each batch's chance to run, so the charges add up to
        # P(block runs) products).
        block_rows = (np.sum(weight * computed, axis=-1) / np.maximum(block, 1e-300))[..., None, None]
        head = np.mean(np.broadcast_to(cm.head_seconds("prefill", c, nodes, block_rows), shape), axis=-1)
        tokens = (np.sum(weight * self.positions(rows, nodes, by_prefix, joining, weight, fresh).mean(axis=-1), axis=-1)
                  / np.maximum(block, 1e-300))
        return cm.combine(terms, head, self.placement, weight, np.minimum(block, 1.0), tokens=tokens)

    def decode_conditional(self, rows: np.ndarray, p: np.ndarray, context: np.ndarray) -> tuple[BlockStep, np.ndarray]:
        """Expected decode step given the block is active, and P(block active).

        ``rows`` [..., nb] slots per GPU batch, ``p`` [..., 1] probability a slot is active,
        ``context`` [..., nb] expected padded context of an active batch.
        """
        q = 1.0 - (1.0 - p) ** rows  # P(batch has an active row)
        block = 1.0 - np.prod((1.0 - p) ** rows, axis=-1)
        a = np.where(q > 0, rows * p / np.maximum(q, 1e-300), 0.0)
        w = np.where(block[..., None] > 0, q / np.maximum(block[..., None], 1e-300), 0.0)
        bt = self.cm.batch_terms("decode", a, context, self.placement)
        head = self.cm.head_seconds("decode", a, context, np.sum(w * a, axis=-1, keepdims=True))
        step = self.cm.combine(bt, head, self.placement, w, (block > 0).astype(float), tokens=np.sum(w * a, axis=-1))
        return step, block

    def row_step_slope(self, a: np.ndarray, ctx: np.ndarray) -> float:
        """Seconds one more active row adds to a decode step, at the busiest step's shape."""
        if a.size == 0:  # every output is one token: no decode step
            return 0.0
        t = int(np.argmax(np.sum(a, axis=-1)))
        base = np.asarray(a[t], dtype=float)
        if base.sum() <= 0:
            return 0.0
        bump = base * (1.0 + 1.0 / base.sum())  # one more row, spread over the batches
        two = np.stack((base, bump))
        ctx_t = np.broadcast_to(ctx[t], two.shape)
        on = (two > 0).astype(float)
        step = self.cm.block_step("decode", two, ctx_t, self.placement, on, 1.0).seconds
        return float(max(step[1] - step[0], 0.0))

    # ---------------------------------------------------------------- no refill
    def blocks(self) -> dict[str, Any]:
        pol, n = self.policy, self.n
        bls, gbs, nb = pol.block_size, pol.gbs, pol.nb
        kinds = [(bls, n // bls)] + ([(n % bls, 1)] if n % bls else [])
        kinds = [(m, c) for m, c in kinds if c > 0]
        S = self.max_out - 1
        u = np.arange(1, S + 1)
        pre_steps, dec_steps, lat_vals, lat_w, p99len = [], [], [], [], []
        wall, steps = 0.0, 0.0
        padded = 0.0
        n99 = self.workload.output.quantile(0.99)
        blocks = sum(c for _, c in kinds)  # the first computes every prefix it meets; later ones the uncached
        fresh = (1.0 + (blocks - 1) * self.uncached) / blocks
        for m, count in kinds:
            rows = np.clip(m - gbs * np.arange(nb), 0, gbs).astype(float)
            cum = np.cumsum(rows)
            on = (rows > 0).astype(float)
            if self.bucketed:
                rank, total = cum, np.full(nb, float(m))
                lo, hi = (cum - rows) / m, cum / m
            else:
                rank, total = rows, rows
                lo, hi = np.zeros(nb), np.ones(nb)
            nodes = self.prompt_nodes(rank, total)
            pre = self.prefill(rows, nodes, on, fresh=fresh)
            padded += count * float(np.sum(self.positions(rows, nodes, fresh=fresh).mean(axis=-1) * on))
            # Blocks differ in their prompts, so their prefills differ: price QUADRATURE
            # equally likely prefills (bucketed GPU batches rise and fall together; unsorted
            # ones independently, so their quantile levels are staggered).
            level = np.arange(QUADRATURE)[:, None] * np.ones(nb, np.int64)
            if not self.bucketed:
                level = (level + (np.arange(nb) * QUADRATURE) // nb) % QUADRATURE
            scenario_len = nodes[np.arange(nb)[None, :], level]  # [Q, nb]
            groups, own = self.prefix_groups(rows, fresh=fresh)
            pre_scenarios = self.cm.block_step("prefill", rows[None, :], scenario_len, self.placement, on,
                                               float(on.any()), computed=self.computed_rows(rows)[None, :],
                                               prefix=self.prefix_at(scenario_len),
                                               prefix_groups=groups[None, :], prefix_own=own[None, :]).seconds
            p = self.surv[u][:, None]  # [S, 1]
            qk = 1.0 - (1.0 - p) ** rows
            a = np.where(qk > 0, rows * p / np.maximum(qk, 1e-300), 0.0)
            ctx = np.where(rows > 0, self.max_prompt_in_band(np.broadcast_to(lo, a.shape), np.broadcast_to(hi, a.shape),
                                                             np.maximum(a, 1.0)), 0.0) + u[:, None]
            dec, active = self.decode_conditional(np.broadcast_to(rows, a.shape), p, ctx)
            decoded = np.concatenate(([0.0], np.cumsum(dec.seconds)))  # after decode step t
            block_s = float(pre.seconds) + float(np.sum(active * dec.seconds))
            wall += count * block_s
            pre_steps.append(_scaled(pre, float(count)))
            dec_steps.append(_scaled(dec, count * active))
            # Decode time up to a request's last step varies with the other rows' lengths:
            # slope (seconds per active row-step) x sd of their summed row-steps.
            slope = self.row_step_slope(a, ctx)
            sd = slope * np.sqrt(max(m - 1, 0) * self.var_min[self.out_support - 1])
            vals = pre_scenarios[:, None] + decoded[self.out_support - 1][None, :]
            v, w_ = _with_spread(vals, np.broadcast_to(count * m * self.out_pmf / QUADRATURE, vals.shape),
                                 np.broadcast_to(sd, vals.shape))
            lat_vals.append(v)
            lat_w.append(w_)
            p99len.append((count * m, float(pre.seconds) + decoded[n99 - 1]))
            steps += count * float(np.sum(active))
        weight = sum(w for w, _ in p99len)
        return self._finish(pre_steps, dec_steps, lat_vals, lat_w, sum(w * v for w, v in p99len) / weight, wall,
                            padded, prefill_steps=sum(c for _, c in kinds), decode_steps=int(round(steps)))

    # ---------------------------------------------------------------- refill
    def renewal(self, held_pmf: np.ndarray) -> np.ndarray:
        """Expected fraction of slots filled at each interval until the queue is empty.

        Uncapped, ``m_j = sum_i P(d = i) m_{j-i}`` with ``m_0`` the first fill: an IIR filter.
        It settles to ``1 / E[d]`` within a few ``max(d)`` intervals (renewal theorem), after
        which it is extended with that value. The queue only binds at the end, so the capped
        sequence is this one cut where the cumulative joiners reach the number of requests.
        """
        bls, n = self.policy.block_size, self.n
        m0 = min(1.0, n / bls)
        dmax = len(held_pmf) - 1
        m_inf = 1.0 / float(np.dot(np.arange(dmax + 1), held_pmf))
        impulse = np.zeros(4 * dmax + 16)
        impulse[0] = m0
        m = signal.lfilter([1.0], np.concatenate(([1.0], -held_pmf[1:])), impulse)
        cum = bls * np.cumsum(m)
        if cum[-1] < n:
            extra = int(np.ceil((n - cum[-1]) / (bls * m_inf * m0))) + 1
            m = np.concatenate((m, np.full(extra, m_inf * m0)))
            cum = bls * np.cumsum(m)
        last = int(np.searchsorted(cum, n - 1e-6, side="left"))
        m = m[: last + 1].copy()
        m[last] = (n - (cum[last - 1] if last > 0 else 0.0)) / bls
        return m

    def refill(self) -> dict[str, Any]:
        pol = self.policy
        bls, gbs, nb, R = pol.block_size, pol.gbs, pol.nb, pol.refill_every
        xo, po = self.out_support, self.out_pmf
        held = np.maximum(1, -(-(xo - 1) // R))
        dmax = int(held.max())
        held_pmf = np.bincount(held, po, minlength=dmax + 1)  # P(d = i)
        m = self.renewal(held_pmf)
        joins_end = len(m)  # intervals with joiners: 0 .. joins_end - 1
        J = joins_end + dmax
        m_full = np.concatenate((m, np.zeros(dmax)))
        u = np.arange(1, R + 1)
        age_grid = np.arange(dmax)[:, None] * R + u[None, :]  # [dmax, R] age of a row at step u
        surv_grid = self.surv[np.minimum(age_grid, len(self.surv) - 1)]
        p = signal.oaconvolve(m_full[:, None], surv_grid, axes=0)[:J]  # [J, R] P(slot active)
        p = np.clip(p, 0.0, 1.0)

        # Intervals far from both ends are stationary (same m and p): price one representative.
        m_inf = 1.0 / float(np.dot(np.arange(dmax + 1), held_pmf))
        steady = np.abs(m[: joins_end - 1] - m_inf) <= 1e-3 * m_inf
        bad = np.nonzero(~steady)[0]
        first_steady_m = int(bad[-1]) + 1 if len(bad) else 0
        lo_stat, hi_stat = first_steady_m + dmax, joins_end - 1  # p stationary on [lo_stat, hi_stat)
        kept = np.arange(J)
        mult = np.ones(J)
        if hi_stat - lo_stat > 2:
            kept = np.concatenate((np.arange(lo_stat + 1), np.arange(hi_stat, J)))
            mult = np.ones(len(kept))
            mult[lo_stat] = hi_stat - lo_stat  # row lo_stat stands for lo_stat .. hi_stat - 1
        K = len(kept)
        pk, mk = p[kept], m_full[kept]
        r_join = bls * mk

        # Prefill of the joiners. The first fill is a whole sorted block. Later, each slot is
        # refilled with probability q = m_j, so GPU batch k gets f ~ Binomial(gbs, q) new rows;
        # it runs a prefill when f >= 1, with E[f | f >= 1] rows padded to the longest of them
        # (bucketed: the joiners are sorted and fill free slots in slot order, so batch k holds
        # a run of ranks after the expected joiners of batches 0..k-1). Refill probabilities are
        # rounded to 1/512 so order statistics are computed once per distinct value.
        q_u, inv = np.unique(np.round(np.clip(mk, 0.0, 1.0) * 512.0) / 512.0, return_inverse=True)
        runs = 1.0 - (1.0 - q_u) ** gbs  # P(f >= 1)
        f_bar = np.where(runs > 0, gbs * q_u / np.maximum(runs, 1e-300), 1.0)
        order_k = np.arange(nb)[None, :]
        others = gbs * q_u[:, None]
        sorted_rank = (f_bar[:, None] + order_k * others, f_bar[:, None] + (nb - 1) * others)
        nodes = self.prompt_nodes(*(sorted_rank if pol.bucket else (f_bar[:, None] * np.ones(nb),) * 2))[inv]
        rows = (f_bar[:, None] * np.ones(nb))[inv]
        weight = (runs[:, None] * np.ones(nb))[inv]
        by_prefix = np.zeros((len(inv), 1), dtype=bool)
        joining = np.maximum(self.distinct(nb * others), 1.0)[inv]  # expected joiners of a refill, computed
        if pol.bucket and self.workload.prefix_groups > 1 and self.workload.prefix_tokens:
            # Each refill's joiners go by prefix or by length, whichever computes fewer positions.
            any_length = self.prompt_nodes(f_bar[:, None] * np.ones(nb), f_bar[:, None] * np.ones(nb))[inv]
            def cost(nd: np.ndarray, ordered: bool) -> np.ndarray:
                return np.sum(weight * self.positions(rows, nd, ordered, joining, weight).mean(axis=-1), axis=-1)

            by_prefix = (cost(any_length, True) < cost(nodes, False))[:, None]
            nodes = np.where(by_prefix[..., None], any_length, nodes)
        if kept[0] == 0:
            first_rows = np.clip(r_join[0] - gbs * np.arange(nb), 0, gbs)
            first_rank = np.cumsum(first_rows) if self.bucketed else first_rows
            first_total = np.full(nb, r_join[0]) if self.bucketed else first_rows
            rows[0], weight[0], by_prefix[0] = first_rows, (first_rows > 0), self.by_prefix
            joining[0] = np.sum(self.computed_rows(first_rows))
            nodes[0] = self.prompt_nodes(np.maximum(first_rank, 1e-9), np.maximum(first_total, 1e-9))
        fresh = np.full((len(rows), 1), self.uncached)
        if kept[0] == 0:
            fresh[0] = 1.0  # the run's first prefill computes every prefix it meets
        pre = self.prefill(rows, nodes, weight, by_prefix, joining, fresh)
        padded = float(np.sum(mult * np.sum(weight * self.positions(rows, nodes, by_prefix, joining, weight, fresh)
                                            .mean(axis=-1), axis=1)))

        # Decode: active rows per GPU batch and the padded context (prompt band + age).
        lo = np.arange(nb) / nb if self.bucketed else np.zeros(nb)
        hi = lo + 1.0 / nb if self.bucketed else np.ones(nb)
        rows_slot = np.full(nb, float(gbs))
        pj = pk[:, :, None]
        qk = 1.0 - (1.0 - pj) ** rows_slot
        a = np.where(qk > 0, rows_slot * pj / np.maximum(qk, 1e-300), 0.0)  # [K, R, nb]
        r_stat = bls * m_inf
        ctx = self.stationary_context(lo, hi, a, surv_grid, r_stat)
        if kept[0] == 0:
            ctx[0] = self.max_prompt_in_band(np.broadcast_to(lo, a[0].shape), np.broadcast_to(hi, a[0].shape),
                                             np.maximum(a[0], 1.0)) + u[:, None]
        dec, active = self.decode_conditional(np.broadcast_to(rows_slot, a.shape), pj, ctx)
        dec_s = dec.seconds * (active > 0)

        # Times on the original interval axis (stationary intervals repeat the representative).
        interval_s = pre.seconds + np.sum(active * dec.seconds, axis=1)
        row_of = np.empty(J, np.int64)
        row_of[kept] = np.arange(K)
        if K < J:
            row_of[lo_stat:hi_stat] = lo_stat
        start = np.concatenate(([0.0], np.cumsum(interval_s[row_of])[:-1]))
        cum_dec = np.concatenate((np.zeros((K, 1)), np.cumsum(dec_s, axis=1)), axis=1)

        def time_after(j: np.ndarray, step: np.ndarray) -> np.ndarray:
            """Time at the end of decode step ``step`` (0 = the prefill) of original interval j."""
            r = row_of[np.minimum(j, J - 1)]
            return start[np.minimum(j, J - 1)] + pre.seconds[r] + cum_dec[r, step]

        join_rows = np.nonzero(mk > 0)[0]
        joiners = bls * mk[join_rows] * mult[join_rows]
        joins, group_w = _representatives(kept[join_rows], joiners, _LATENCY_GROUPS)
        g = xo - 1
        last = joins[:, None] + np.maximum(g - 1, 0)[None, :] // R
        u_last = np.where(g > 0, g[None, :] - (last - joins[:, None]) * R, 0)
        lat = time_after(last, u_last) - start[joins][:, None]
        weights = group_w[:, None] * po[None, :]
        # Each interval a request lives through starts with a prefill of random size (how many
        # join, how long their prompts) and has R decode steps with a random number of rows.
        ref = lo_stat if K < J else min(K // 2, joins_end - 1)  # a steady-state interval
        sd = np.sqrt(held * self.interval_variance(ref, nodes, rows, weight, m_inf, pk, a, ctx))
        lat, weights = _with_spread(lat, weights, np.broadcast_to(sd, lat.shape))
        g99 = self.workload.output.quantile(0.99) - 1
        last99 = joins + max(g99 - 1, 0) // R
        u99 = g99 - (last99 - joins) * R if g99 > 0 else np.zeros_like(joins)
        w99 = group_w  # p99-length requests join in proportion to joiners
        p99len = float(np.dot(w99, time_after(last99, u99) - start[joins]) / w99.sum())
        wall = float(np.sum(interval_s * mult))
        return self._finish([_scaled(pre, mult)], [_scaled(dec, active * mult[:, None])], [lat.ravel()],
                            [weights.ravel()], p99len, wall, padded,
                            prefill_steps=int(round(float(np.sum(mult[join_rows])))),
                            decode_steps=int(round(float(np.sum(active * mult[:, None])))))

    def interval_variance(self, k: int, nodes: np.ndarray, rows: np.ndarray, weight: np.ndarray, m_inf: float,
                          p: np.ndarray, a: np.ndarray, ctx: np.ndarray) -> float:
        """Variance of one steady-state interval's duration (refill mode), in seconds squared.

        Prefill: the padded prompt lengths (quadrature scenarios, batches together when
        bucketed) and the number of joiners (Binomial(slots, m), times the seconds one more
        joiner adds). Decode: R steps whose active rows vary by Binomial(slots, p), times the
        seconds one more row adds, taken as fully correlated within the interval.
        """
        pol = self.policy
        bls, nb, R = pol.block_size, pol.nb, pol.refill_every
        level = np.arange(QUADRATURE)[:, None] * np.ones(nb, np.int64)
        if not self.bucketed:
            level = (level + (np.arange(nb) * QUADRATURE) // nb) % QUADRATURE
        scen_len = nodes[k][np.arange(nb)[None, :], level]
        scen = self.cm.block_step("prefill", rows[k][None, :], scen_len, self.placement, weight[k], 1.0).seconds
        # One more joiner, spread over the batches, at the mean padded lengths.
        joiners = float(np.sum(rows[k] * weight[k]))
        two = np.stack((rows[k], rows[k] * (1.0 + 1.0 / max(joiners, 1e-9))))
        mean_len = np.broadcast_to(nodes[k].mean(axis=-1), two.shape)
        pre2 = self.cm.block_step("prefill", two, mean_len, self.placement, weight[k], 1.0).seconds
        q = min(max(m_inf, 1e-9), 1.0)
        var_pre = float(np.var(scen)) + float(pre2[1] - pre2[0]) ** 2 * bls * q * (1.0 - q)
        slope = self.row_step_slope(a[k], ctx[k])
        p_bar = float(np.mean(p[k]))
        var_dec = (slope * R) ** 2 * bls * p_bar * (1.0 - p_bar)
        return var_pre + var_dec

    def stationary_context(self, lo: np.ndarray, hi: np.ndarray, a: np.ndarray, surv_grid: np.ndarray,
                           joiners: float) -> np.ndarray:
        """E[max over ``a`` active rows of prompt + age] after refills began: [K, R, nb].

        Ages follow the stationary mixture (weights P(n - 1 >= age)). With bucketing a GPU batch
        keeps the prompts of its band of each refill's sorted joiners; since free slots are
        spread at random, the band is widened by the spread of the free-slot count before it.
        """
        R = surv_grid.shape[1]
        nb = len(lo)
        ages = np.arange(surv_grid.shape[0])[:, None] * self.policy.refill_every + np.arange(1, R + 1)[None, :]
        w = surv_grid / np.maximum(surv_grid.sum(axis=0, keepdims=True), 1e-300)  # [dmax, R]
        xp, pp = self.prompt.pmf()
        cdf_p = np.cumsum(pp)
        if self.bucketed and nb > 1:
            spread = np.sqrt(np.clip(lo * (1 - lo), 0, None) / max(joiners, 1.0))
            spread_hi = np.sqrt(np.clip(hi * (1 - hi), 0, None) / max(joiners, 1.0))
            lo, hi = np.clip(lo - spread, 0.0, 1.0), np.clip(hi + spread_hi, 0.0, 1.0)
        band = np.clip((cdf_p[None, :] - lo[:, None]) / np.maximum(hi - lo, 1e-12)[:, None], 0.0, 1.0)  # [nb, P]
        band_pmf = np.diff(np.concatenate((np.zeros((nb, 1)), band), axis=1), axis=1)
        age_w = np.zeros((R, int(ages.max()) + 1))  # weight of each age at step u
        age_w[np.arange(R)[None, :].repeat(len(ages), 0), ages] = w
        ctx_pmf = signal.fftconvolve(band_pmf[None, :, :], age_w[:, None, :], axes=-1)  # [R, nb, G]
        cdf_c = np.clip(np.cumsum(ctx_pmf, axis=-1), 0.0, 1.0)
        grid = int(xp[0]) + np.arange(cdf_c.shape[-1])  # context of each cdf_c column
        # E[max of a draws] for every integer a = 1..gbs, then linear interpolation in a.
        gbs = self.policy.gbs
        counts = np.arange(1, gbs + 1, dtype=float)
        lv = _LEVELS[None, :] ** (1.0 / counts[:, None])  # [A, Q]
        rows = cdf_c.reshape(R * nb, -1)
        offset = np.arange(R * nb)[:, None]
        flat = (rows + 2.0 * offset).ravel()
        queries = (lv.ravel()[None, :] * (1 - 1e-12) + 2.0 * offset).ravel()
        pos = np.searchsorted(flat, queries, side="left") - (offset * rows.shape[1]).repeat(lv.size, axis=1).ravel()
        table = grid[np.clip(pos, 0, len(grid) - 1)].reshape(R, nb, gbs, -1).mean(axis=-1)  # [R, nb, A]
        af = np.clip(a, 1.0, float(gbs)) - 1.0
        i0 = np.floor(af).astype(np.int64)
        i1 = np.minimum(i0 + 1, gbs - 1)
        frac = af - i0
        r_idx = np.arange(R)[None, :, None]
        k_idx = np.arange(nb)[None, None, :]
        return table[r_idx, k_idx, i0] * (1 - frac) + table[r_idx, k_idx, i1] * frac

    # ---------------------------------------------------------------- results
    def _finish(self, pre_steps: list[BlockStep], dec_steps: list[BlockStep], lat_vals: list[np.ndarray],
                lat_w: list[np.ndarray], p99len: float, wall: float, padded: float,
                prefill_steps: int, decode_steps: int) -> dict[str, Any]:
        pre = pre_steps[0]
        for s in pre_steps[1:]:
            pre = _concat(pre, s)
        dec = dec_steps[0]
        for s in dec_steps[1:]:
            dec = _concat(dec, s)
        values = np.concatenate([np.ravel(v) for v in lat_vals])
        weights = np.concatenate([np.ravel(w) for w in lat_w])
        return {"prefill": pre, "decode": dec, "latencies": values, "weights": weights, "p99len": p99len,
                "wall": wall, "padded": padded, "prefill_steps": prefill_steps, "decode_steps": decode_steps}


def binned(values: np.ndarray, weights: np.ndarray, bins: int = _LATENCY_BINS) -> tuple[np.ndarray, np.ndarray]:
    """Weighted values merged into ``bins`` bins (upper edges), so quantiles stay cheap."""
    lo, hi = float(values.min()), float(values.max())
    if hi <= lo:
        return np.array([hi]), np.array([weights.sum()])
    idx = np.minimum(((values - lo) / (hi - lo) * bins).astype(np.int64), bins - 1)
    w = np.bincount(idx, weights, minlength=bins)
    upper = lo + (np.arange(bins) + 1) * (hi - lo) / bins
    keep = w > 0
    return upper[keep], w[keep]


def simulate_analytic(spec: ModelSpec, profile: HardwareProfile, policy: Policy, workload: Workload,
             num_requests: int = DEFAULT_REQUESTS) -> SimResult:
    """Expected throughput and latency percentiles of ``num_requests`` requests, no sampling.

    Where refilling cannot change the run (:meth:`Policy.refill_in_effect`) it is priced as a
    block without refill, as the discrete-event path runs it.
    """
    if isinstance(num_requests, bool) or int(num_requests) != num_requests or num_requests < 1:
        raise UserError(f"number of requests must be >= 1, got {num_requests}")  # (was a ZeroDivisionError)
    cm = CostModel.for_policy(spec, profile, policy)
    model = _Analytic(cm, policy, workload, int(num_requests))
    refills = policy.refill_in_effect(int(num_requests), workload.output.max_len, workload.output.min_len) > 0
    out = model.refill() if refills else model.blocks()
    values, weights = out["latencies"], out["weights"]
    if len(values) > _LATENCY_BINS:
        values, weights = binned(values, weights)
    return summarize(
        cm, policy, workload, method="analytic", profile=profile, num_requests=int(num_requests), seed=None,
        wall_s=out["wall"], generated=num_requests * workload.output.mean,
        prompt_tokens=num_requests * workload.prompt.mean, padded_prompt=out["padded"], latencies=values,
        latency_weights=weights, p99_length_s=out["p99len"], prefill=out["prefill"], decode=out["decode"],
        prefill_steps=out["prefill_steps"], decode_steps=out["decode_steps"])
