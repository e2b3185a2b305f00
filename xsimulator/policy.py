"""Policy: everything the runner needs to know about *how* to execute a job.

FlexGen §4.3 (batch sizes and placement fractions) plus ExeGPT §4.2 (refill interval).
Fractions are 0..1 and each of the three placement triples sums to 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from xsched.contract import Contract

PLACEMENT_VARS: tuple[str, ...] = ("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd")
_SUM_TOLERANCE = 1e-6


def split_counts(fractions: tuple[float, float, float], n: int) -> tuple[int, int, int]:
    """Whole units (layers, rows) per tier (gpu, cpu, disk) for placement fractions over ``n`` units.

    The one rounding rule the scheduler and the runner share: largest remainder, ties to the
    faster tier, so the counts sum to ``n`` and a fraction that is a multiple of ``1/n`` maps
    exactly. Weights split by layers (layer ``i`` lives on gpu for the first counts[0] layers,
    then cpu, then disk); KV cache and activations split each GPU batch's rows the same way.
    """
    if n < 0:
        raise ValueError(f"cannot split {n} units")
    exact = [f * n for f in fractions]
    counts = [int(x + 1e-9) for x in exact]
    order = sorted(range(3), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts[0], counts[1], counts[2]


# Largest GPU batch and GPU batches per block a policy may ask for: far past any machine's memory
# (FlexGen's largest OPT-175B block is 32 x 8), and they bound the simulators' per-batch arrays
# (nb = 10^8 exhausted 24 GiB of RAM).
MAX_GBS = 2**20
MAX_NB = 2**12
MAX_CACHE_POSITIONS = 10**9  # a prefix cache past this holds more K/V than any machine (1e308 overflowed pricing)


@dataclass(frozen=True)
class Policy(Contract):
    """GPU batch size, batches per block, placement, compression, delegation and refill.

    Placement fractions (0..1, each trio summing to 1): ``wg``/``wc``/``wd`` of the weights,
    ``cg``/``cc``/``cd`` of the KV cache and ``hg``/``hc``/``hd`` of the activations on the gpu,
    cpu and disk tiers (FlexGen's policy variables)."""

    SCHEMA: ClassVar[str] = "xsched.Policy/1"

    gbs: int
    nb: int
    wg: float = 1.0
    wc: float = 0.0
    wd: float = 0.0
    cg: float = 1.0
    cc: float = 0.0
    cd: float = 0.0
    hg: float = 1.0
    hc: float = 0.0
    hd: float = 0.0
    compress_weight: bool = False
    compress_cache: bool = False
    cpu_attention: bool = False
    refill_every: int = 0  # decode steps between refills of finished slots; 0 = never
    bucket: bool = True  # sort prompts by length inside a block before cutting GPU batches
    overlap: bool = True  # overlap I/O with compute (FlexGen Alg. 1); off only for ablation
    # Positions the run's prefix cache keeps (every layer's keys and values, cpu tier); None: sized
    # for the workload's prefixes (``costmodel.workload_cache_positions``). The planner sets it where
    # a job has more prefixes than that room and memory is left (``xscheduler.search.grow_prefix_cache``).
    prefix_cache_positions: int | None = None

    def __post_init__(self) -> None:
        # The types JSON reading enforces, enforced here too: gbs=2.5 failed deep in a simulation,
        # gbs=True ran as 1, and compress_weight="yes" wrote JSON that could not be read back.
        for name in ("gbs", "nb", "refill_every") + (("prefix_cache_positions",) if self.prefix_cache_positions
                                                      is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be a whole number, got {v!r}")
            object.__setattr__(self, name, int(v))
        for name in ("compress_weight", "compress_cache", "cpu_attention", "bucket", "overlap"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        for var in PLACEMENT_VARS:
            if isinstance(getattr(self, var), bool) or not isinstance(getattr(self, var), (int, float, np.number)):
                raise ValueError(f"{var} must be a number (a fraction 0..1), got {getattr(self, var)!r}")
        if self.gbs < 1 or self.nb < 1:
            raise ValueError(f"gbs and nb must be >= 1, got gbs={self.gbs} nb={self.nb}")
        if self.gbs > MAX_GBS or self.nb > MAX_NB:  # the simulators' arrays grow with both
            raise ValueError(f"gbs and nb must be at most {MAX_GBS} and {MAX_NB}, got gbs={self.gbs} nb={self.nb}")
        if self.refill_every < 0:
            raise ValueError(f"refill_every must be >= 0, got {self.refill_every}")
        if self.prefix_cache_positions is not None and not 1 <= self.prefix_cache_positions <= MAX_CACHE_POSITIONS:
            raise ValueError(f"prefix_cache_positions must be from 1 to {MAX_CACHE_POSITIONS:,} (or absent), got "
                             f"{self.prefix_cache_positions:.4g}")
        for var in PLACEMENT_VARS:
            v = getattr(self, var)
            if not -_SUM_TOLERANCE <= v <= 1.0 + _SUM_TOLERANCE:
                raise ValueError(f"{var}={v} is outside 0..1 (fractions, not percents)")
            if not 0.0 <= v <= 1.0:  # computed as 1 - a - b, it may come out at -5.6e-17: held to 0..1
                object.__setattr__(self, var, min(max(float(v), 0.0), 1.0))
        for kind, trio in (("weights", ("wg", "wc", "wd")), ("KV cache", ("cg", "cc", "cd")),
                           ("activations", ("hg", "hc", "hd"))):
            total = sum(getattr(self, v) for v in trio)
            if abs(total - 1.0) > _SUM_TOLERANCE:
                raise ValueError(f"{kind} fractions {'+'.join(trio)} sum to {total:g}, not 1")

    @property
    def block_size(self) -> int:
        return self.gbs * self.nb

    def refill_in_effect(self, job_rows: int, max_output: int, min_output: int = 1) -> int:
        """``refill_every``, or 0 where refilling cannot change a job of ``job_rows`` requests of
        ``min_output`` to ``max_output`` tokens: a one-row block (its slot frees as its request
        finishes), a block with a slot for every request (none waits for a freed one), an interval
        no shorter than the longest output less one (every slot is free at every refill), or one
        output length for all (a block's rows all finish together, and the next block starts). The
        discrete-event simulator runs these exactly as without refill (to 1e-12, 3e-15, 7e-15 and
        1e-14 over the grids of ``benchmarks/plan_quality.py``, measured profiles and fixed-output
        jobs); the analytic one prices them so, its refill model having been up to 16% (one row,
        p99), 31% (whole job, throughput), 3.6x (long interval) and 36% (fixed output, throughput)
        off the discrete-event path there."""
        if (self.block_size == 1 or self.block_size >= job_rows or self.refill_every >= max_output - 1
                or min_output >= max_output):
            return 0
        return self.refill_every

    def for_job(self, job_rows: int) -> "Policy":
        """This policy cut to a job of ``job_rows`` requests that does not fill one block: as many
        GPU batches as it fills (or one of ``job_rows`` rows). The rows run as they would in the
        full block, whose other slots would stay empty; the buffers are sized for fewer rows."""
        if job_rows >= self.block_size or job_rows < 1:
            return self
        if job_rows >= self.gbs:
            return replace(self, nb=-(-job_rows // self.gbs))
        return replace(self, gbs=job_rows, nb=1)

    def layer_counts(self, num_layers: int) -> tuple[int, int, int]:
        """Layers whose weights live on gpu, cpu, disk (see :func:`split_counts`)."""
        return split_counts((self.wg, self.wc, self.wd), num_layers)

    def row_counts(self, kind: str, rows: int) -> tuple[int, int, int]:
        """Rows of a GPU batch whose KV cache (``kind="cache"``) or activations (``"act"``) live on each tier."""
        trio = {"cache": (self.cg, self.cc, self.cd), "act": (self.hg, self.hc, self.hd)}[kind]
        return split_counts(trio, rows)

    def placement(self) -> dict[str, float]:
        return {v: getattr(self, v) for v in PLACEMENT_VARS}

    def describe(self) -> str:
        """The policy in words: batch shape, what sits where, and the switches."""

        def percent(v: float) -> str:
            """Whole percents, but never 0% or 100% for a share that is neither (one row of 256 on the gpu
            read "0% gpu, 100% cpu")."""
            for text in (f"{v:.0%}", f"{v:.1%}"):
                if v in (0.0, 1.0) or text not in ("0%", "100%", "0.0%", "100.0%"):
                    return text
            return "<0.1%" if v < 0.5 else ">99.9%"

        def where(prefix: str) -> str:
            parts = [f"{percent(getattr(self, prefix + t))} {name}" for t, name in (("g", "gpu"), ("c", "cpu"), ("d", "disk"))
                     if getattr(self, prefix + t) > 0]
            return ", ".join(parts)

        lines = [
            f"block of {self.nb} GPU batch(es) x {self.gbs} sequences = {self.block_size}",
            f"weights: {where('w')}" + (" (4-bit)" if self.compress_weight else ""),
            f"KV cache: {where('c')}" + (" (4-bit)" if self.compress_cache else ""),
            f"activations: {where('h')}",
            "attention on CPU for KV not on the gpu tier" if self.cpu_attention and (self.cc or self.cd)
            else "attention on the compute device",  # with every KV row on the gpu tier, CPU attention has nothing
            f"refill finished slots every {self.refill_every} decode steps" if self.refill_every else "no refill",
        ]
        if self.prefix_cache_positions is not None:
            lines.append(f"prefix cache: {self.prefix_cache_positions:,} positions")
        return "\n".join(lines)
