"""The cost model: seconds per layer step and peak bytes per tier, written once for two users.

The simulator evaluates it numerically (numpy arrays of batch rows and lengths, many steps at
once); the scheduler's placement LP evaluates it with PuLP affine expressions for the nine
placement fractions ``wg..hd``. Every term is therefore *affine in the placement fractions*:
placement values are only multiplied by numbers and added, never compared, and every ``max``
is returned as its separate terms (:class:`StepTerms` groups, :class:`MemoryTerms` transients)
so the LP can use the minimax reformulation (seed 004 §2.1.3) while the simulator takes the max.

The terms follow FlexGen Appendix A.3 (seed 000) for one decoder layer, generalised to what our
runner does: grouped-query attention, per-GPU-batch shapes, compression (4-bit group-wise: fewer
bytes moved plus (de)quantisation time) and CPU attention (activations move instead of KV).

Time unit: one *layer step* = one decoder layer applied to every GPU batch of the block. Weight
transfers happen once per layer step (all GPU batches share the fetched layer); KV cache and
activation transfers and compute happen once per GPU batch. A whole decode or prefill step is
``num_layers`` layer steps plus the LM head (see ``docs/ARCHITECTURE.md``).

Calibration (``HardwareProfile.calibration``, fitted by ``xsched calibrate`` from real runs):
multiplicative factors on the terms named in :data:`FACTOR_TERMS` (default 1.0) and additive
seconds for :data:`OVERHEAD_TERMS` (default 0.0).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, Mapping

import numpy as np

from xprofiler.diskio import round_up
from xprofiler.profile import CHANNELS, TIERS, BandwidthCurve, HardwareProfile
from xprofiler.specs import ModelSpec
from xsched.errors import UserError
from xsimulator.policy import Policy, split_counts

# Multiplicative calibration factors, one per separately visible time term.
# ``dtoc_rows`` scales disk reads of KV-cache and activation rows, which go through files opened
# without O_DIRECT one row at a time, apart from ``dtoc``'s whole weight records read with
# O_DIRECT. Stop 36: with one factor for both, opt-125m's calibration measured weight records 15%
# slower than the profile's curve and row reads 28% faster than priced; the fit settled between
# (0.98), and every weights-on-disk plan was predicted 10-30% fast on its disk reads.
FACTOR_TERMS: tuple[str, ...] = ("ctog", "gtoc", "dtoc", "ctod", "gpu_compute", "cpu_compute", "dequant",
                                 "quant", "head", "dtoc_rows")
# Additive calibration terms in seconds: per layer per GPU batch (kernel launches, Python), per
# GPU batch per generation step (embedding, sampling, bookkeeping), and per layer per block step
# (the first GPU batch of a block reads the layer's weights from memory, the others find them in
# the cache: the block schedule's weight reuse one level down; the profile's layer fits are timed
# with warm weights). And per copy of a KV-cache or activation row between the cpu and gpu tiers
# (the engine moves those a run of consecutive slots and KV part at a time, disk rows one row at a
# time: on the 2-core VM this was built on, a 3 KiB row cost tens of microseconds of Python and
# launch, not 3 KiB of bandwidth, and with one factor per channel that cost inflated the factor of
# whole-layer weight copies two-fold).
# And ``kv_codec_overhead_s``: per layer and GPU batch of a decode step over a 4-bit cache, the
# codec's fixed work per call (encoding the step's K/V, the query's rotation, the own position's
# exact K/V, the output's un-rotation), which no per-byte rate sees. Stop 28: fitted 1.27 ms on
# opt-125m's 8-row calibration run (1 thread); a factor on the kernel's bytes had to absorb it as
# 7.9x, which over-prices large batches.
# And ``cpu_attention_overhead_s``: per layer, GPU batch and tier of a decode step whose offloaded
# rows attend on the CPU, the delegation's fixed work (the query and new K/V copied over, the
# mask, the cache write, the kernel's dispatch). Stop 50: with one factor on the bytes, the short
# calibration run fitted ``cpu_compute`` 2.09 and a model windowed to 128 of 512 positions had
# its CPU attention priced 2.4x what it measured.
OVERHEAD_TERMS: tuple[str, ...] = ("layer_overhead_s", "step_overhead_s", "block_layer_overhead_s", "row_copy_s",
                                   "kv_codec_overhead_s", "cpu_attention_overhead_s")
# Compute seconds lost per second of disk reads running beside the compute (a fraction, default
# 0): on a host without CUDA the reads land in the memory the compute streams from, and on a
# small VM their interrupts and copies share its cores. Calibration fits it from the compute busy
# time of the runs that read from disk; on the 2-core VM this was built on, compute ran 8-14%
# longer in weights-on-disk plans than the same plans all in memory. ``copy_interference``, the
# same per second of copies between the cpu and gpu tiers (ctog, gtoc): on a host without CUDA
# those are memcpys on the engine's I/O threads, which take cores and memory bandwidth from the
# compute (stop 32: plans with the KV cache on the cpu tier were predicted 3-14% fast without it).
INTERFERENCE_TERMS: tuple[str, ...] = ("disk_interference", "copy_interference")
# The engine attends in place over a span of a GPU batch's slots while it is at most this many
# times the rows left in it (xrunner.engine.attention_span); the cost model prices the same rule.
SPAN_MAX_RATIO = 3
# The most bytes of one KV-cache part or hidden state that one copy of a run of rows moves between
# the cpu and gpu tiers (``xrunner.engine._runs``).
COPY_RUN_BYTES = 8 << 20
# On CUDA a run of rows over part of their positions is strided in pinned memory, which torch
# gathers through pageable memory; a row of at least this many bytes moves alone, as one DMA
# from pinned memory (stop 38: per-row calls cost 0.25-0.3 ms each, which only rows this large
# amortise).
CUDA_RUN_ROW_BYTES = 128 << 10
# The float32 K/V chunk through which CPU attention converts a half-precision cache or gathers
# rows that are no range (``xrunner.model.attend_rows_on_cpu``).
CPU_ATTENTION_CHUNK_BYTES = 8 << 20
# Stored KV parts per layer and row (the engine's KVCodec): K and V; 4-bit: codes, mins, scales of each.
KV_PARTS = 2
KV_PARTS_COMPRESSED = 6

QUANT_BITS = 4
QUANT_GROUP = 64
# A GPU batch's prefill shares the prefixes its prompts begin with only when that leaves at most
# this fraction of the prefill's positions (``xrunner.prefix``): a second, smaller set of GEMMs and
# the gathers cost something, and a few shared template tokens before long questions save little.
SHARE_PREFIX_AT_MOST = 0.8


def shared_prefix_split(rows: Any, length: Any, prefix: Any, bound: bool = False,
                        groups: Any = 1.0, own: Any = None) -> tuple[Any, Any]:
    """(where the prefix is shared, its length there) for a prefill of ``rows`` distinct prompts
    (padded ``length``) that begin with ``groups`` distinct prefixes of ``prefix`` tokens: the
    engine then computes each prefix once and each row's last ``length - prefix`` columns (each
    row keeps at least one token), only where that cuts the positions to
    :data:`SHARE_PREFIX_AT_MOST` or fewer; ``bound``: wherever it cuts them at all (the LP's rate
    must stay an upper bound). A batch that computes fewer than its ``groups`` prefixes (``own``:
    it takes the others, which the run's cache keeps, ``xrunner.prefix.PrefixCache``) shares them
    whatever its rows."""
    r = np.asarray(rows, dtype=float)
    n = np.maximum(np.asarray(length, dtype=float), 1.0)
    p = np.clip(np.minimum(prefix, n - 1.0), 0.0, None)
    limit = r * n if bound else SHARE_PREFIX_AT_MOST * r * n
    use = (r >= 2) & (groups * p + r * (n - p) <= limit)
    if own is not None:
        use = use | (np.asarray(own) < groups)
    return use & (p > 0), p


def shared_prefix_rows(rows: Any, length: Any, prefix: Any, bound: bool = False, groups: Any = 1.0,
                       own: Any = None) -> Any:
    """Rows' worth of positions that prefill computes (:func:`shared_prefix_split`), where ``own``
    of the ``groups`` prefixes are computed here (the rest an earlier GPU batch of the block
    computed in the same layer: ``xrunner.prefix.plan_block``; None: all of them)."""
    r = np.asarray(rows, dtype=float)
    n = np.maximum(np.asarray(length, dtype=float), 1.0)
    use, p = shared_prefix_split(rows, length, prefix, bound, groups, own)
    return np.where(use, ((groups if own is None else own) * p + r * (n - p)) / n, r)


# The run's prefix cache keeps at most this many prompts' worth of positions (each layer's keys and
# values on the cpu tier): beside a block's KV cache of gbs x nb whole contexts, a few prompts'.
PREFIX_CACHE_PROMPTS = 8
# ``prefix_tokens`` is the prefixes' mean length: room for a quarter more keeps the longer ones too.
PREFIX_CACHE_SLACK = 1.25
# A prefix the full cache does not keep displaces its least used entries only where more rows
# computed it than took or computed them by this factor: at 1 two templates about as common kept
# trading places, each trade computing both again (+5.7% positions on 16 equally common ones).
PREFIX_CACHE_DISPLACE_MARGIN = 1.5
# Prefixes the cache remembers computing without keeping them (their rows weigh against its entries').
PREFIX_CACHE_SEEN = 256
# Recent prompts the cache remembers (``PrefixCache.recent``): a prompt that begins as one of them
# does is computed as a group of its own and kept, though no other row of its GPU batch shares it.
PREFIX_CACHE_GHOSTS = 64


def prefix_cache_positions(max_prompt: int, prefix: int, groups: int) -> int:
    """Positions the run's prefix cache keeps (``xrunner.prefix.PrefixCache``): room for the
    workload's ``groups`` prefixes of ``prefix`` tokens, at least one prompt's worth (prefixes a
    workload does not describe) and at most ``PREFIX_CACHE_PROMPTS``. One prompt's worth kept one
    of two or more templates, and every refill computed the others again."""
    room = math.ceil(PREFIX_CACHE_SLACK * max(prefix, 0) * max(groups, 1))
    return min(PREFIX_CACHE_PROMPTS * max_prompt, max(max_prompt, room))


def workload_cache_positions(workload: Any, max_prompt: int | None = None) -> int:
    """:func:`prefix_cache_positions` for ``workload``'s prefixes (its ``prefix_lengths`` summed
    where it lists them) and prompts up to ``max_prompt`` (default: its longest)."""
    lengths, _ = workload.prefix_table
    top = workload.prompt.max_len if max_prompt is None else max_prompt
    return prefix_cache_positions(top, math.ceil(lengths.sum() / max(len(lengths), 1)), len(lengths))


def run_cache_positions(policy: Any, workload: Any, max_prompt: int | None = None) -> int:
    """Positions the run's prefix cache keeps under ``policy``: its own where it sets them, else
    :func:`workload_cache_positions` (what ``xsched run`` gives the engine)."""
    if policy.prefix_cache_positions is not None:
        return policy.prefix_cache_positions
    return workload_cache_positions(workload, max_prompt)


def uncached_prefix_share(cache_positions: int, prefix: int, groups: int, lengths: Any = None) -> float:
    """Share of ``groups`` distinct ``prefix``-token prefixes that the run's prefix cache does not
    keep: it keeps ``cache_positions // prefix`` of those prefills compute (the most used,
    ``xrunner.prefix.PrefixCache``), and later prefills take those instead of computing them.
    ``lengths``: each prefix's (``Workload.prefix_table``), of which it keeps as many as fit,
    shortest first (the most it can keep: the share stays a lower bound for the LP)."""
    if prefix <= 0:
        return 1.0
    if lengths is not None and len(lengths):
        kept = int(np.searchsorted(np.cumsum(np.sort(np.asarray(lengths))), cache_positions, side="right"))
        return max(0.0, 1.0 - kept / len(lengths))
    return max(0.0, 1.0 - (cache_positions // prefix) / max(groups, 1))


def prefix_groups_in_batch(rows: Any, joining: Any, groups: int, ordered: bool = True) -> Any:
    """Expected distinct prefixes among one GPU batch's ``rows`` prompts when each prompt begins
    with one of ``groups`` equally likely prefixes (:attr:`Workload.prefix_groups`).

    ``joining`` prompts (every GPU batch's) join in the same step. ``ordered``: the engine sorts
    them so that prompts beginning alike join one GPU batch (``xrunner.prefix.prefix_order``, under
    bucketing): the ``G_N`` prefixes that ``N`` joiners hold then lie in runs, and a batch of ``r``
    consecutive joiners crosses ``(r - 1) (G_N - 1) / (N - 1)`` run boundaries. Not ordered: the
    batch holds a random ``r`` of them, ``G (1 - (1 - 1/G)^r)`` prefixes."""
    r = np.maximum(np.asarray(rows, dtype=float), 1.0)
    if groups <= 1:
        return np.ones_like(r)
    seen = lambda k: groups * (1.0 - (1.0 - 1.0 / groups) ** k)  # noqa: E731
    if not ordered:
        return seen(r)
    n = np.maximum(np.asarray(joining, dtype=float), r)
    return np.minimum(1.0 + (r - 1.0) * (seen(n) - 1.0) / np.maximum(n - 1.0, 1.0), seen(r))


def compression_ratio(dtype_bytes: int, bits: int = QUANT_BITS, group: int = QUANT_GROUP) -> float:
    """Stored bytes / original bytes for group-wise quantisation with a (min, scale) pair per group.

    The pair is kept in the tensor's own dtype (as ``xrunner.compression`` does): for fp16,
    (4 + 2*16/64) / 16 = 0.28125.
    """
    return (bits + 2 * 8 * dtype_bytes / group) / (8 * dtype_bytes)


def quantized_bytes(length: int, vectors: int, dtype_bytes: int, bits: int = QUANT_BITS,
                    group: int = QUANT_GROUP) -> int:
    """Stored bytes of ``vectors`` vectors of ``length`` values quantised in groups along their length,
    the last group padded to a whole one as ``xrunner.compression.quantize`` stores it (a head of 32
    or 100 values takes one or two whole groups; :func:`compression_ratio` is the unpadded rate)."""
    return vectors * -(-length // group) * (group * bits // 8 + 2 * dtype_bytes)


IN_ROTATION_BLOCK = 512  # input channels rotated together: 8 x 64 Sylvester factors
MLP_OUT_WEIGHTS = ("down_proj.weight", "fc2.weight")


def input_rotated(shapes: Mapping[str, tuple[int, ...]], block: int = IN_ROTATION_BLOCK) -> set[str]:
    """The 4-bit weights ``xrunner`` also stores with input channels rotated, per ``block``: the
    MLP's output projection, when its input is whole blocks.

    Its input (the MLP's hidden activation) has outlier channels that a Hadamard rotation
    spreads over ``block`` channels before GPTQ rounds the weight. On SmolLM2-135M (16 windows,
    64 calibration sequences) 4-bit weights went from +4.71% / +4.21% to +3.77% / +3.49%
    perplexity on two calibration draws; 64-channel blocks changed nothing (+4.74%), and rotating
    every projection's input by 64 cost more (+5.69%) (docs/BENCHMARKS.md, stop 29)."""
    return {n for n, s in shapes.items() if n.endswith(MLP_OUT_WEIGHTS) and len(s) == 2 and s[1] % block == 0}


def rotation_flop_ratio(spec: ModelSpec, group: int = QUANT_GROUP, block: int = IN_ROTATION_BLOCK) -> float:
    """Extra linear-layer flops of 4-bit weights / the layer's matmul flops.

    ``xrunner`` stores each whole group of ``group`` output rows rotated by a Hadamard matrix
    and rotates the output back: ``group`` multiply-adds per output value, against ``in`` per
    output value for the matmul itself (a tensor whose rows are not whole groups is not rotated).
    The weights of :func:`input_rotated` also rotate their input, per ``block`` channels as two
    Kronecker factors (``block / group`` and ``group``): that many multiply-adds per input value.
    The engine does that only for GPTQ codes (a real model with calibration text), which a plan
    cannot tell; a random-weight model's plan is over-charged by it (OPT-0.5B shape: 2.3% of the
    layer's matmul flops).
    """
    shapes = {n: s for n, s in spec.layer_tensor_shapes().items() if len(s) == 2}
    extra = sum(o * group for o, _ in shapes.values() if o % group == 0)
    extra += sum(shapes[n][1] * (block // group + group) for n in input_rotated(shapes, block))
    return extra / sum(o * i for o, i in shapes.values())


def quantize_scratch_bytes(out_rows: int, in_cols: int, group: int = QUANT_GROUP) -> int:
    """Working bytes of packing one ``[out, in]`` weight into 4-bit (``xrunner.compression``):
    the rotated float32 copy, the range search's float32 groups and dequantized candidate, three
    uint8 code arrays (the kept, the candidate's and the merge), about twelve float32 values per
    group (ranges, candidate ranges, errors) and the 4-bit record made (codes, float32 min and
    scale per group), rows padded to ``group``."""
    n = -(-out_rows // group) * group * in_cols
    return 3 * n * 4 + 3 * n + 12 * (n // group) * 4 + n // 2 + 2 * (n // group) * 4


def pack_scratch_bytes(spec: ModelSpec) -> int:
    """:func:`quantize_scratch_bytes` of a layer's largest weight (the packer does one at a time)."""
    return max(quantize_scratch_bytes(*s) for s in spec.layer_tensor_shapes().values() if len(s) == 2)


def _fraction(part: Any, whole: Any) -> Any:
    """``part / whole`` (floats or arrays), 0 where ``whole`` is 0."""
    part, whole = np.asarray(part, dtype=float), np.asarray(whole, dtype=float)
    out = np.where(whole > 0, part / np.where(whole > 0, whole, 1.0), 0.0)
    return float(out) if out.ndim == 0 else out


def head_layout_bytes(spec: ModelSpec, compute_device: str, rows: int) -> float:
    """What a CPU runner holds while it times the LM head's two layouts to keep the faster
    (``xrunner.model.cpu_head_layout``): the matrix's second copy and one product's input and
    logits for ``rows`` rows (a block's: the head runs once per step); none on CUDA."""
    if compute_device != "cpu":
        return 0.0
    return float((spec.vocab_size * spec.hidden + rows * (spec.hidden + spec.vocab_size)) * spec.dtype_bytes)


def layer_load_bytes(spec: ModelSpec, compress_weight: bool, cuda: bool, stored_bytes: float) -> float:
    """Host bytes while one layer is read and packed into its home: the source's copy of the layer
    (``spec.dtype``), the packer's scratch for its largest weight when compressing, and on a CUDA
    host the packed record staged in RAM before it is copied to the device."""
    scratch = pack_scratch_bytes(spec) if compress_weight else 0
    return float(spec.weight_bytes_per_layer + scratch) + (float(stored_bytes) if cuda else 0.0)


# --------------------------------------------------------------------------- time terms
@dataclass(frozen=True)
class StepTerms:
    """Seconds each resource is busy during one layer step (floats, arrays or LP expressions).

    ``gpu_compute`` is everything on the compute device except (de)quantisation; ``cpu_compute``
    is attention delegated to the host CPU. How the terms combine into a duration is decided in
    one place, :func:`parallel_groups`.
    """

    ctog: Any = 0.0
    gtoc: Any = 0.0
    dtoc: Any = 0.0
    ctod: Any = 0.0
    gpu_compute: Any = 0.0
    cpu_compute: Any = 0.0
    dequant: Any = 0.0
    quant: Any = 0.0

    def __add__(self, other: "StepTerms") -> "StepTerms":
        return StepTerms(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, k: Any) -> "StepTerms":
        """Every term multiplied by ``k`` (a number or an array broadcasting with the terms)."""
        return StepTerms(*(_times(k, v) if not _is_zero(v) else 0.0 for v in self.as_dict().values()))

    def sum(self, axis: int) -> "StepTerms":
        """Numeric terms summed over ``axis`` (e.g. over the GPU batches of a block)."""
        return StepTerms(*(np.sum(getattr(self, f.name), axis=axis) for f in fields(self)))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


COMPUTE_TERMS: tuple[str, ...] = ("gpu_compute", "cpu_compute", "dequant", "quant")


def channel_groups(compute_device: str, overlap: bool) -> tuple[tuple[str, ...], ...]:
    """Which terms run one after another (a group) while groups run concurrently.

    - No overlap (ablation): everything in sequence, one group.
    - CUDA host (FlexGen Alg. 1): compute, and each of the four copy channels, in parallel.
    - CPU host: the "gpu" tier is RAM, so ctog/gtoc are memcpys on the same cores as compute and
      add to it; disk reads and writes still overlap.

    Calibration (issue 7) may refine this; it is the only place that decides it.
    """
    if not overlap:
        return (COMPUTE_TERMS + CHANNELS,)
    if compute_device == "cuda":
        return (COMPUTE_TERMS, ("ctog",), ("gtoc",), ("dtoc",), ("ctod",))
    return (COMPUTE_TERMS + ("ctog", "gtoc"), ("dtoc",), ("ctod",))


def parallel_groups(terms: StepTerms, compute_device: str, overlap: bool) -> tuple[Any, ...]:
    """Sums of terms per :func:`channel_groups`; a layer step lasts as long as the largest.

    Each group is affine in the placement, so the LP can require ``t >= group`` for each.
    """
    out = []
    for group in channel_groups(compute_device, overlap):
        total: Any = 0.0
        for name in group:
            value = getattr(terms, name)
            if not _is_zero(value):
                total = value if _is_zero(total) else total + value
        out.append(total)
    return tuple(out)


def step_seconds(terms: StepTerms, compute_device: str, overlap: bool) -> Any:
    """Numeric duration of a layer step: the max over :func:`parallel_groups` (element-wise)."""
    groups = [g for g in parallel_groups(terms, compute_device, overlap) if not _is_zero(g)]
    if not groups:
        return 0.0
    out = groups[0]
    for g in groups[1:]:
        out = np.maximum(out, g)
    return out


@dataclass(frozen=True)
class BlockStep:
    """A prefill or decode step of a block: per-layer terms, head seconds and total seconds."""

    terms: StepTerms
    head_s: Any
    seconds: Any


# --------------------------------------------------------------------------- memory terms
@dataclass(frozen=True)
class MemoryTerms:
    """Bytes on one tier: named buffers that coexist, plus transients of which one is live.

    ``peak = max(sum(resident) + max(transient), sum(alone))``. The names are the runner's
    allocation list (see :meth:`CostModel.memory`); the LP adds ``sum(resident) + t <= capacity``
    for each transient ``t``. ``alone``: buffers that exist for a moment before anything else
    on the tier is allocated (the runner's first step), so they never add to the rest.
    """

    tier: str
    resident: dict[str, Any]
    transient: dict[str, Any]
    alone: dict[str, Any] = field(default_factory=dict)

    def peak_bytes(self) -> float:
        base = sum(float(v) for v in self.resident.values())
        return max(base + max((float(v) for v in self.transient.values()), default=0.0),
                   sum(float(v) for v in self.alone.values()))

    def constraints(self) -> list[Any]:
        """One affine expression per transient, and the ``alone`` sum: each must stay within the
        tier's capacity."""
        base = sum(self.resident.values())
        out = [base + t for t in self.transient.values()] or [base]
        if self.alone:  # a constant, in base's type (an LP expression when placing)
            out.append(base * 0 + sum(self.alone.values()))
        return out


# --------------------------------------------------------------------------- helpers
def bandwidth_at(curve: BandwidthCurve, size_bytes: Any) -> Any:
    """``BandwidthCurve.at`` element-wise: linear in log(size) between points, flat outside."""
    if not curve.sizes_bytes:
        return curve.large_bytes_per_s
    sizes = np.log(np.asarray(curve.sizes_bytes, dtype=float))
    x = np.log(np.maximum(np.asarray(size_bytes, dtype=float), 1.0))
    bw = np.interp(x, sizes, np.asarray(curve.bytes_per_s, dtype=float))
    return np.where(x >= sizes[-1], curve.large_bytes_per_s, bw)


def cpu_attention_chunk(rows: int, f32_row_bytes: float, chunk_bytes: int = CPU_ATTENTION_CHUNK_BYTES) -> int:
    """Rows per float32 chunk of CPU attention (``xrunner.model.attend_rows_on_cpu``): as many as
    ``chunk_bytes`` holds of rows of ``f32_row_bytes`` K/V, at least one, at most ``rows``."""
    return int(max(1, min(rows, chunk_bytes // max(1, int(f32_row_bytes)))))


def cpu_attention_scratch_bytes(rows: int, context: int, kv_dim: int, q_dim: int, heads: int, dtype_bytes: float,
                                in_place: bool, chunk_bytes: int = CPU_ATTENTION_CHUNK_BYTES) -> float:
    """Bytes that CPU attention of ``rows`` rows over ``context`` positions allocates beside its
    inputs (``xrunner.model.attend_rows_on_cpu``): the engine books this, and the planner plans a
    bound of it (:meth:`CostModel.memory`).

    In place (float32 rows that are a range): a contiguous or head-expanded copy of the strided
    K/V views that the kernel may make, and float32 scores and probabilities. In chunks: a float32
    chunk of K/V of ``CPU_ATTENTION_CHUNK_BYTES`` (at least one row), the chunk gathered in the
    cache's dtype, its K/V expanded to the query heads (grouped-query models), its query and
    output in float32, its scores and probabilities. Both: the rows' output.
    """
    scores = 2 * heads * context * 4
    out = rows * q_dim * dtype_bytes
    if in_place:
        return rows * (2 * context * max(q_dim, kv_dim) * dtype_bytes + scores) + out
    kv_row = 2 * context * kv_dim
    m = cpu_attention_chunk(rows, 4 * kv_row, chunk_bytes)
    expand = 2 * context * q_dim * 4 if q_dim != kv_dim else 0
    return m * (kv_row * (4 + dtype_bytes) + expand + 2 * q_dim * 4 + scores) + out


def _op_seconds(profile: HardwareProfile, kind: str, flops: Any, read_bytes: Any) -> Any:
    """Time of one kernel from flop rates; a roofline when the profile knows memory bandwidth."""
    roofline = getattr(profile, "compute_s", None)  # added by the profiler's measured roofs
    if roofline is not None:
        return roofline(kind, flops, read_bytes)
    rate = {"mm": profile.mm_flops, "bmm": profile.bmm_flops, "cpu_mm": profile.cpu_mm_flops,
            "cpu_bmm": profile.cpu_bmm_flops}[kind]
    return flops / rate


def _stage_slots(fraction: Any, num_layers: int) -> Any:
    """Layer-sized staging slots for ``fraction`` of the layers living off a tier.

    The runner places weights by whole layers (``Policy.layer_counts``) and double-buffers the
    fetched ones, so ``k`` offloaded layers need ``min(2, k)`` slots (a fractional placement
    counts its largest possible rounding). An LP expression gets the constant upper bound 2:
    ``2 * fraction`` (FlexGen's per-tensor split) would under-count whole layers, the OOM of
    FlexGen issue #108.
    """
    if isinstance(fraction, (int, float)):
        return float(min(2, math.ceil(fraction * num_layers - 1e-9)))
    return 2.0


def _weights_stay_staged(placement: Mapping[str, Any], num_layers: int) -> bool:
    """Whether every offloaded layer keeps a stage slot of its own, so it is fetched only once.

    The runner keeps fetched layers in its two stage slots (:func:`_stage_slots`) and fetches a
    layer only when no slot holds it. With at most two offloaded layers (counted with the runner's
    rounding, ``split_counts``) each has a slot, so after its first fetch in a job (a one-time copy
    of <= 2 layers, not priced) it is never fetched again. With three or more, the layers are
    visited in a cycle longer than the slots, so each is evicted before its next use and all are
    fetched every step. LP expressions get False: the LP keeps the per-step charge (an upper
    bound; its fractions are rounded to whole layers and the rounded policy is priced exactly).
    """
    trio = (placement["wg"], placement["wc"], placement["wd"])
    if not all(isinstance(x, (int, float)) for x in trio):
        return False
    _g, c, d = split_counts(trio, num_layers)
    return c + d <= 2


def _is_zero(x: Any) -> bool:
    """True only for a plain number equal to 0 (never for an LP expression or an array)."""
    return isinstance(x, (int, float)) and x == 0


def _calls(fraction: Any) -> Any:
    """1 where a tier holds some of a batch's rows (the engine makes one call for them), else 0.
    For an LP expression, the fraction itself: the placement LP is linear, so a per-call cost is
    relaxed to one proportional to the share (it under-prices a small share)."""
    if isinstance(fraction, numbers.Real):  # (numpy's scalars too)
        return 1.0 if fraction > 0 else 0.0
    if isinstance(fraction, np.ndarray):
        return (fraction > 0).astype(float)
    return fraction


def _times(k: Any, x: Any) -> Any:
    """``k * x``, skipping the multiply for a plain 1 and returning 0 for a plain 0."""
    if isinstance(k, (int, float)):
        if k == 1:
            return x
        if k == 0:
            return 0.0
    return k * x




# --------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class CostModel:
    """Per-layer-step times and per-tier peak bytes of one model on one machine.

    Fixed here: the model, the profile and the discrete policy switches (compression, CPU
    attention, overlap). Placement fractions are passed to each call, so the LP can pass
    variables. Batch rows and lengths may be numpy arrays (any shape, broadcasting together).
    """

    spec: ModelSpec
    profile: HardwareProfile
    compress_weight: bool = False
    compress_cache: bool = False
    cpu_attention: bool = False
    overlap: bool = True
    slots: int = 0  # rows of a GPU batch (the policy's gbs); 0: unknown, gathers are not priced
    nb: int = 1  # GPU batches per block: on a CPU all but the first read a layer's weights cached

    def __post_init__(self) -> None:
        if self.compress_cache and self.cpu_attention:
            raise UserError("compress_cache with cpu_attention is not supported (the CPU would have to dequantise "
                            "the cache); turn one of them off")
        known = FACTOR_TERMS + OVERHEAD_TERMS + INTERFERENCE_TERMS
        unknown = set(self.profile.calibration) - set(known)
        if unknown:
            raise UserError(f"profile calibration has unknown term(s) {', '.join(sorted(unknown))}; known: "
                            f"{', '.join(known)}")

    @classmethod
    def for_policy(cls, spec: ModelSpec, profile: HardwareProfile, policy: Policy) -> "CostModel":
        return cls(spec, profile, policy.compress_weight, policy.compress_cache, policy.cpu_attention, policy.overlap,
                   slots=policy.gbs, nb=policy.nb)

    @cached_property
    def _rotation_factor(self) -> float:
        return 1.0 + rotation_flop_ratio(self.spec)

    # ----------------------------------------------------------------- sizes
    @property
    def dtype_bytes(self) -> int:
        return self.spec.dtype_bytes

    @property
    def ratio(self) -> float:
        return compression_ratio(self.dtype_bytes)

    @property
    def layer_matmul_bytes(self) -> int:
        """Uncompressed bytes of one layer's projection weights (what the matmuls read)."""
        return self.spec.matmul_params_per_layer * self.dtype_bytes

    def dequant_bytes(self, tokens: Any = None) -> Any:
        """Bytes of one layer's 4-bit projections dequantized in a layer step whose GPU batches hold
        ``tokens`` tokens: every projection but the routed experts, and of those the ones the tokens
        are expected to reach (``ModelSpec.experts_reached``; ``stored_forms.LayerWeights``
        dequantizes an expert when a token first reaches it). None: every expert."""
        spec = self.spec
        if not spec.num_experts or tokens is None:
            return self.layer_matmul_bytes
        idle = spec.num_experts - spec.experts_reached(tokens)
        return self.layer_matmul_bytes - idle * (spec.expert_params * self.dtype_bytes)

    @staticmethod
    def layer_rows(phase: str, computed: Any, length: Any, prefix: Any, prefix_groups: Any = 1.0,
                   prefix_own: Any = None) -> Any:
        """Rows' worth of positions a layer computes (:func:`shared_prefix_rows` in a prefill)."""
        if phase == "prefill" and np.any(prefix):
            return shared_prefix_rows(computed, length, prefix, groups=prefix_groups, own=prefix_own)
        return computed

    @staticmethod
    def step_tokens(phase: str, rows: Any, length: Any) -> Any:
        """Tokens a GPU batch of ``rows`` passes through a layer in one step (prefill: padded prompts)."""
        return rows * length if phase == "prefill" else rows

    @property
    def layer_stored_bytes(self) -> float:
        """Bytes of one layer as stored and moved: 2-D weights compressed if asked (groups along the
        output channels, the last one padded), 1-D kept."""
        other = self.spec.weight_bytes_per_layer - self.layer_matmul_bytes
        if not self.compress_weight:
            return float(self.layer_matmul_bytes + other)
        return float(sum(quantized_bytes(s[0], s[1], self.dtype_bytes)
                         for s in self.spec.layer_tensor_shapes().values() if len(s) == 2) + other)

    @property
    def kv_stored_ratio(self) -> float:
        """Stored / plain bytes of the KV cache: 4-bit head vectors take whole groups (KVCodec)."""
        d = self.spec.head_dim
        return quantized_bytes(d, 1, self.dtype_bytes) / (d * self.dtype_bytes) if self.compress_cache else 1.0

    @property
    def fused_kv(self) -> bool:
        """A 4-bit cache on a CPU: decode attends over the codes (``xrunner.kvattend``, in float32
        whatever the model's dtype), with no dequantized copy of the cache and no attention over one."""
        return self.compress_cache and self.profile.compute_device != "cuda"

    @property
    def warm_share(self) -> float:
        """Share of decode GPU batches that read their layer's weights from the CPU's cache
        (``WarmFit``): with 4-bit weights every one (each reads the buffer the layer was just
        dequantized into), else all but the block's first (a block's last steps, with fewer
        batches left, are priced as full ones). 0 on a GPU (its cache holds no layer)."""
        if self.profile.compute_device != "cpu":
            return 0.0
        return 1.0 if self.compress_weight else (self.nb - 1) / self.nb

    @cached_property
    def _fit_name(self) -> str:
        """The name of the profile's fits for this model (another of its shape's; looked up once)."""
        return self.profile.fit_name(self.spec)

    @cached_property
    def _warm_fit(self) -> Any:
        """The profile's ``WarmFit`` for this model where some batches read warm, else None
        (looked up once: ``batch_terms`` runs for every step the simulator prices)."""
        return self.profile.warm_fit(self._fit_name, self.spec.dtype) if self.warm_share else None

    def factor(self, term: str) -> float:
        return self.profile.calibration_factor(term)

    def overhead_s(self, term: str) -> float:
        return float(self.profile.calibration.get(term, 0.0))

    def _copy_s(self, channel: str, nbytes: Any, unit_bytes: Any) -> Any:
        """Seconds to move ``nbytes`` on ``channel``, at the bandwidth of ``unit_bytes`` transfers."""
        return nbytes / bandwidth_at(self.profile.bandwidth(channel), unit_bytes)

    # ----------------------------------------------------------------- time terms
    def weight_terms(self, placement: Mapping[str, Any], tokens: Any = None) -> StepTerms:
        """Fetching the next layer's non-resident weights, once per layer step of a block.

        Disk-resident weights go disk -> cpu relay -> device, so they use dtoc and ctog; on a
        host without CUDA the record is read straight into the stage slot (the "gpu" tier is RAM),
        so only dtoc. At most two offloaded layers stay in the stage slots and cost nothing per
        step (:func:`_weights_stay_staged`). With compressed weights every layer (resident and
        staged ones too) is dequantised once per layer step, a mixture of experts' routed experts as
        far as the step's ``tokens`` reach them (:meth:`dequant_bytes`). The engine's once-per-layer
        work for the block (``block_layer_overhead_s``: weight hand-off, prefetch) is compute time,
        also once per layer step.
        """
        return self._weight_terms(placement, _weights_stay_staged(placement, self.spec.num_layers), tokens)

    def _weight_terms(self, placement: Mapping[str, Any], staged: bool, tokens: Any = None) -> StepTerms:
        p, w = placement, self.layer_stored_bytes
        relayed = p["wc"] + p["wd"] if self.profile.compute_device == "cuda" else p["wc"]
        ctog = 0.0 if staged else self._move(relayed, "ctog", w)
        dtoc = 0.0 if staged else self._move(p["wd"], "dtoc", w)
        dequant = 0.0
        if self.compress_weight:
            dequant = self.dequant_bytes(tokens) / self.profile.dequant_bytes_per_s * self.factor("dequant")
        return StepTerms(ctog=ctog, dtoc=dtoc, dequant=dequant,
                         gpu_compute=self.overhead_s("block_layer_overhead_s") + self._interference(dtoc, ctog))

    def weight_tier_terms(self, placement: Mapping[str, Any], tokens: Any = None) -> list[tuple[Any, StepTerms]]:
        """``(share of the layers, weight_terms of one such layer)`` per weight tier.

        The runner places whole layers (``xrunner.engine._layer_tiers``), so a layer step fetches
        either a whole layer or nothing, and the step lasts ``max(compute, fetch)`` of *that*
        layer. Pricing the average layer instead (FlexGen's model, which splits every layer) is
        the max of the averages, below the average of the maxes whenever some layers are I/O-bound
        and others compute-bound: sim_vs_run's 50%-on-disk plan ran 17-31% slower than predicted
        that way. Numeric placements only; staged layers (``_weights_stay_staged``) fetch nothing.
        """
        if _weights_stay_staged(placement, self.spec.num_layers) or not all(
                isinstance(placement[v], (int, float)) for v in ("wg", "wc", "wd")):
            return [(1.0, self.weight_terms(placement, tokens))]
        out = []
        for var in ("wg", "wc", "wd"):
            share = float(placement[var])
            if share > 0:
                one = {**placement, "wg": 0.0, "wc": 0.0, "wd": 0.0, var: 1.0}
                out.append((share, self._weight_terms(one, var == "wg", tokens)))
        return out

    def _compute_parts(self, phase: str, rows: Any, length: Any) -> tuple[Any, Any]:
        """(non-attention seconds, attention seconds) of one layer on the compute device."""
        fit = self.profile.layer_fit(self._fit_name, phase, self.spec.dtype)
        if fit is not None:
            return fit.parts_s(self.spec, rows, length)
        spec = self.spec
        tokens = rows * length if phase == "prefill" else rows
        linear_flops = tokens * spec.linear_flops_per_token()
        linear = _op_seconds(self.profile, "mm", linear_flops,
                             self.layer_matmul_bytes + 2 * tokens * spec.act_bytes_per_token)
        read = spec.prefill_context(length) if phase == "prefill" else spec.decode_context(length)  # (windows)
        attn_flops = tokens * spec.attention_flops_per_token(read)
        kv_read = rows * read * spec.kv_bytes_per_token_per_layer
        attn = _op_seconds(self.profile, "bmm", attn_flops, kv_read)
        return linear, attn

    def _shared_prefix_parts(self, rows: Any, length: Any, prefix: Any, other_s: Any, attn_s: Any,
                             groups: Any = 1.0, own: Any = None) -> tuple[Any, Any]:
        """A prefill's (non-attention, attention) seconds where its ``rows`` share ``groups``
        prefixes (else ``other_s``, ``attn_s``, the plain layer's): two passes, as the engine runs
        them (each pays its own read of the layer's weights), the ``own`` prefixes it computes
        (default all; :func:`shared_prefix_rows`) as rows of their own length, then every row's
        suffix; the suffix's queries attend to the whole padded prompt. An ``own`` below 1 (an
        expectation) prices that share of one prefix's pass."""
        use, p = shared_prefix_split(rows, length, prefix, groups=groups, own=own)
        if not np.any(use):
            return other_s, attn_s
        n = np.maximum(np.asarray(length, dtype=float), 1.0)
        p = np.maximum(p, 1.0)
        suffix = np.maximum(n - p, 1.0)
        own = np.asarray(groups if own is None else own, dtype=float)
        pre_other, pre_attn = self._compute_parts("prefill", np.maximum(own, 1.0), p)
        part = np.minimum(own, 1.0)
        pre_other, pre_attn = pre_other * part, pre_attn * part
        suf_other, _ = self._compute_parts("prefill", rows, suffix)
        return (np.where(use, pre_other + suf_other, other_s),
                np.where(use, pre_attn + attn_s * (suffix / n), attn_s))

    def batch_terms(self, phase: str, rows: Any, length: Any, placement: Mapping[str, Any],
                    computed: Any = None, prefix: Any = 0, prefix_groups: Any = 1.0,
                    prefix_own: Any = None) -> StepTerms:
        """One layer for one GPU batch of ``rows`` sequences.

        ``length`` is the padded prompt length (prefill) or the padded context ``T`` including
        the token being generated (decode). Rows are split over tiers by the KV (cg/cc/cd) and
        activation (hg/hc/hd) fractions. ``computed`` (prefill): the rows actually computed when
        some repeat a prompt (its samples); every row still moves its own K/V and hidden state.
        ``prefix`` (prefill): tokens every prompt begins with, computed once per distinct prefix
        (``prefix_groups`` of them in the batch, ``prefix_own`` of those computed by this batch;
        :meth:`_shared_prefix_parts`).
        """
        if phase not in ("prefill", "decode"):
            raise ValueError(f"unknown phase {phase!r}")
        p, spec, dt = placement, self.spec, self.dtype_bytes
        prefill = phase == "prefill"
        tok = length if prefill else 1
        act = rows * tok * (spec.hidden * dt)  # hidden states entering (and leaving) the layer
        kv_new = rows * tok * spec.kv_bytes_per_token_per_layer  # K and V this step appends
        kv_new_st = kv_new * self.kv_stored_ratio if self.compress_cache else kv_new
        off_c = p["cc"] + p["cd"]  # KV rows not resident on the device

        parts = KV_PARTS_COMPRESSED if self.compress_cache else KV_PARTS
        rows_move, disk_rows = self._move_rows, self._disk_rows
        # Hidden states cross a tier boundary between layers only: the first layer's input is the
        # embedding and the last layer's output goes to the LM head, so L - 1 of L layers move them.
        between = (spec.num_layers - 1) / spec.num_layers
        hc_moved, hd_moved = _times(between, p["hc"]), _times(between, p["hd"])
        act_ops = self._row_copies(p["hc"], rows, 1, act)
        ctog = rows_move(hc_moved, "ctog", act, act_ops) + rows_move(hd_moved, "ctog", act, rows)
        gtoc = rows_move(hc_moved, "gtoc", act, act_ops) + rows_move(hd_moved, "gtoc", act, rows)
        dtoc = disk_rows(hd_moved, "dtoc", act, rows, 1)
        ctod = disk_rows(hd_moved, "ctod", act, rows, 1) + disk_rows(p["cd"], "ctod", kv_new_st, rows, parts)

        def kv_moves(channel: str, nbytes: Any) -> Any:
            """Offloaded KV rows to or from the device: cpu-tier rows by runs, disk rows by rows."""
            return (rows_move(p["cc"], channel, nbytes, self._row_copies(p["cc"], rows, parts, nbytes))
                    + rows_move(p["cd"], channel, nbytes, rows * parts))

        computed = rows if computed is None else computed
        other_s, attn_s = self._compute_parts(phase, computed, length)
        if prefill and np.any(prefix):
            other_s, attn_s = self._shared_prefix_parts(computed, length, prefix, other_s, attn_s, prefix_groups,
                                                        prefix_own)
        warm = self._warm_fit
        if not prefill and warm is not None:
            # Never below half the cold time: the saving was measured at one context (the decode
            # grid's shortest), on a whole layer, and is taken off the attention-free part alone.
            other_s = np.maximum(other_s - self.warm_share * warm.predict_s(rows), 0.5 * other_s)
        if self.compress_weight:
            other_s = _times(self._rotation_factor, other_s)
        cpu_compute: Any = 0.0
        dequant: Any = 0.0
        kv_encoded = computed * tok * spec.kv_bytes_per_token_per_layer  # the repeats' are copies
        quant = kv_encoded * (self.factor("quant") / self.profile.quant_bytes_per_s) if self.compress_cache else 0.0
        if prefill:
            # The device computes the prompt's KV; offloaded rows are written back (and on to disk).
            gtoc = gtoc + kv_moves("gtoc", kv_new_st)
            gpu_compute = other_s + attn_s
        else:
            read = spec.decode_context(length)  # positions the new token attends to (a window's only)
            kv_ctx = rows * read * spec.kv_bytes_per_token_per_layer  # the cache it reads
            kv_ctx_st = kv_ctx * self.kv_stored_ratio if self.compress_cache else kv_ctx
            dtoc = dtoc + disk_rows(p["cd"], "dtoc", kv_ctx_st, rows, parts)
            # Over a 4-bit cache on a CPU, attention is the fused kernel's, priced below (a profile
            # from before its probe prices it as on a GPU: dequantize, then attend).
            fused = self.fused_kv and self.profile.kv_attend_bytes_per_s > 0
            if self.cpu_attention:
                # Offloaded rows attend on the CPU: q, k, v go down, the attention output comes up
                # (one copy per tensor for all the rows).
                gtoc = gtoc + rows_move(off_c, "gtoc", rows * ((spec.q_dim + 2 * spec.kv_dim) * dt), 3)
                ctog = ctog + rows_move(off_c, "ctog", rows * (spec.q_dim * dt), 1)
                if not _is_zero(off_c):
                    cpu_attn = self._cpu_attention_s(rows, read, kv_ctx) * self.factor("cpu_compute")
                    calls = _calls(p["cc"]) + _calls(p["cd"])  # one per tier holding offloaded rows
                    cpu_compute = (off_c * cpu_attn + calls * self.overhead_s("cpu_attention_overhead_s")
                                   + _times(p["cc"], self._scattered_rows_s(rows, length, kv_ctx, cpu_attn_s=cpu_attn)))
                gpu_compute = other_s + _times(p["cg"], attn_s)
            else:
                # Offloaded rows' cache comes to the device for attention; the new entries go back.
                ctog = ctog + kv_moves("ctog", kv_ctx_st)
                gtoc = gtoc + kv_moves("gtoc", kv_new_st)
                gpu_compute = other_s + (0.0 if fused else attn_s)
            gpu_compute = gpu_compute + _times(p["cg"], self._scattered_rows_s(rows, length, kv_ctx_st))
            if fused:
                # A kernel on the compute device, like attention and scaled with it by the
                # gpu_compute factor (the weights' dequant factor prices another kernel): measured
                # with one query head per kv head; each further one repeats the work.
                heads = spec.num_heads / spec.num_kv_heads
                gpu_compute = gpu_compute + kv_ctx * (heads / self.profile.kv_attend_bytes_per_s)
            elif self.compress_cache:
                dequant = kv_ctx * (self.factor("dequant") / self.profile.dequant_bytes_per_s)
        codec_s = self.overhead_s("kv_codec_overhead_s") if self.compress_cache and not prefill else 0.0
        gpu_compute = (_times(self.factor("gpu_compute"), gpu_compute) + self.overhead_s("layer_overhead_s") + codec_s
                       + self._interference(dtoc, ctog + gtoc))
        return StepTerms(ctog=ctog, gtoc=gtoc, dtoc=dtoc, ctod=ctod, gpu_compute=gpu_compute,
                         cpu_compute=cpu_compute, dequant=dequant, quant=quant)

    def _scattered(self, rows: Any) -> Any:
        """Where ``rows`` active rows are no contiguous range of their batch's slots (two or more
        left of ``slots``: the finished ones are spread over the batch), or None where none is."""
        if not self.slots or isinstance(rows, (int, float)) and not 1 < rows < self.slots:
            return None
        r = np.asarray(rows)
        return np.logical_and(r > 1, r < self.slots)

    def _scattered_rows_s(self, rows: Any, length: Any, nbytes: Any, cpu_attn_s: Any = None) -> Any:
        """Extra decode seconds of rows that are no contiguous range of their batch's slots: on the
        gpu tier, or with ``cpu_attn_s`` (the rows' CPU attention seconds) on the cpu tier.

        The engine attends in place over the span from the first to the last such row when the
        rows fill at least 1 / ``SPAN_MAX_RATIO`` of it and the cache is not 4-bit
        (``xrunner.engine.attention_span``): the idle slots in the span cost attention. Otherwise
        it gathers the rows' context (:meth:`_gather_s`). Finished rows are spread at random over
        the slots, so the span is the expected range of ``rows`` of ``slots``.
        """
        scattered = self._scattered(rows)
        if scattered is None:
            return 0.0
        cpu = cpu_attn_s is not None
        gather = self._gather_s(rows, nbytes, cpu=cpu)
        if self.compress_cache:
            return gather
        r = np.asarray(rows, dtype=float)
        span = np.maximum((self.slots + 1) * (r - 1) / (r + 1) + 1, r)
        if cpu:  # CPU attention's time is linear in rows (the profile's CPU rates have no row term)
            idle = np.asarray(cpu_attn_s, dtype=float) * (span - r) / np.maximum(r, 1.0)
        else:
            idle = self._compute_parts("decode", span, length)[1] - self._compute_parts("decode", r, length)[1]
        out = np.where(scattered, np.where(span <= SPAN_MAX_RATIO * r, idle, gather), 0.0)
        return float(out) if np.ndim(out) == 0 else out

    def _cpu_attention_s(self, rows: Any, length: Any, kv_ctx: Any) -> Any:
        """Seconds of decode attention of ``rows`` over ``kv_ctx`` bytes of cache on the host CPU.

        From the profile's probe of the engine's own CPU attention where it has one (one query
        head per kv head: each further one repeats the work, as on the 4-bit kernel), else the
        host's float32 roofline, which misses a half-precision cache's conversion to float32.
        """
        rate = self.profile.cpu_attend_bytes_per_s
        if rate > 0:
            return kv_ctx * ((self.spec.num_heads / self.spec.num_kv_heads) / rate)
        return _op_seconds(self.profile, "cpu_bmm", rows * self.spec.attention_flops_per_token(length), kv_ctx)

    def _gather_s(self, rows: Any, nbytes: Any, cpu: bool) -> Any:
        """Seconds to gather ``nbytes`` of decode KV context of ``rows`` active rows into one tensor.

        Rows that are no contiguous range (:meth:`_scattered`) and attend where no in-place span
        is used (a 4-bit cache, rows too sparse in their span) have their context
        copied out first (``xrunner.engine._take``); the layer fits, timed on contiguous caches,
        do not see the copy (opt-125m, 32 slots: decode layers 1.15-1.57x the fit at 4-30 rows).
        Priced at the memory roof: a CPU copy moves three times its bytes (read, and the
        destination line read for ownership before it is written), a GPU copy twice.
        """
        scattered = self._scattered(rows)
        roof = self.profile.cpu_mem_bytes_per_s if cpu else self.profile.mem_bytes_per_s
        if scattered is None or not roof:
            return 0.0
        traffic = 3.0 if cpu or self.profile.compute_device == "cpu" else 2.0
        out = np.where(scattered, traffic * np.asarray(nbytes, dtype=float) / roof, 0.0)
        return float(out) if np.ndim(out) == 0 else out

    def _move(self, fraction: Any, channel: str, nbytes: Any) -> Any:
        """``fraction`` of a transfer of ``nbytes`` on ``channel``, calibrated (0 if none moves)."""
        if _is_zero(fraction):
            return 0.0
        return fraction * (self._copy_s(channel, nbytes, nbytes) * self.factor(channel))

    def _row_copies(self, cpu: Any, rows: Any, parts: int, nbytes: Any) -> Any:
        """Copies that move the ``cpu`` share of ``rows`` active rows' ``nbytes`` (``parts``
        tensors per row) between the cpu and gpu tiers, per unit of that share (the ``ops`` of
        :meth:`_move_rows`; rows on disk pass through the relay one row and part at a time).

        Rows on the cpu tier are copied a run of consecutive slots at a time
        (``xrunner.engine._runs``), in pieces of at most ``COPY_RUN_BYTES`` of a part; on CUDA,
        rows of ``CUDA_RUN_ROW_BYTES`` or more one at a time. With
        ``rows`` of the batch's ``n`` slots active, spread at random (as :meth:`_scattered`
        assumes), the ``s = cpu * n`` slots of the cpu tier hold ``s r / n`` active rows and
        ``(s - 1) r (r - 1) / (n (n - 1))`` adjacent active pairs on average; each pair joins two
        rows into one run. The LP's share is a variable, and a count that does not scale with it
        is no linear term: there the whole batch's runs (``cpu`` = 1) are scaled instead, which
        charges a share of a tier with every row active a share of its one copy. Without the
        slot count, one copy per row (the bound).
        """
        # Plain floats take math's path: numpy on scalars costs ~20 us a call, and the planner
        # prices thousands of placements per plan (same IEEE arithmetic, same results).
        scalar = (isinstance(rows, (int, float)) and isinstance(nbytes, (int, float))
                  and not isinstance(cpu, np.ndarray))
        if scalar:
            mx, mn, floor, where = max, min, math.floor, (lambda c, a, b: a if c else b)
            r, total = float(rows), float(nbytes)
        else:
            mx, mn, floor, where = np.maximum, np.minimum, np.floor, np.where
            r, total = np.asarray(rows, dtype=float), np.asarray(nbytes, dtype=float)
        n = self.slots
        per_unit = r if n <= 1 else r * (n - r + 1.0) / n
        if n > 1 and isinstance(cpu, (int, float, np.ndarray, np.number)):
            c = mx(float(cpu) if isinstance(cpu, (int, float)) else np.asarray(cpu, dtype=float), 1e-12)
            runs = c * r - (c * n - 1.0) * r * (r - 1.0) / (n * (n - 1.0))
            per_unit = mn(runs, c * r) / c
        # each part's own row size: a 4-bit cache's codes are about 16x its mins and scales
        units = ([QUANT_BITS / 8, self.dtype_bytes / QUANT_GROUP, self.dtype_bytes / QUANT_GROUP] * 2
                 if parts == KV_PARTS_COMPRESSED and self.compress_cache else [1.0] * parts)
        out: Any = 0.0
        for unit in units:
            row_bytes = total * (unit / sum(units)) / mx(r, 1.0)
            per_copy = mx(floor(COPY_RUN_BYTES / mx(row_bytes, 1.0)), 1.0)
            if self.profile.compute_device == "cuda":  # large rows move alone (CUDA_RUN_ROW_BYTES)
                per_copy = where(row_bytes >= CUDA_RUN_ROW_BYTES, 1.0, per_copy)
            out = out + mx(per_unit, r / per_copy)
        return float(out) if np.ndim(out) == 0 else out

    def _move_rows(self, fraction: Any, channel: str, nbytes: Any, ops: Any) -> Any:
        """``fraction`` of moving ``nbytes`` of rows between the cpu and gpu tiers as ``ops`` copies.

        Each copy moves its own share at the bandwidth of its size and pays ``row_copy_s`` (the
        engine's per-copy work), which no bandwidth factor scales.
        """
        if _is_zero(fraction):
            return 0.0
        seconds = self._copy_s(channel, nbytes, nbytes / np.maximum(ops, 1)) * self.factor(channel)
        return fraction * (seconds + ops * self.overhead_s("row_copy_s"))

    def _interference(self, dtoc: Any, copies: Any = 0.0) -> Any:
        """Compute seconds lost to ``dtoc`` seconds of disk reads and ``copies`` seconds of
        cpu <-> gpu tier copies beside it (:data:`INTERFERENCE_TERMS`)."""
        lost: Any = 0.0
        for term, busy in (("disk_interference", dtoc), ("copy_interference", copies)):
            k = float(self.profile.calibration.get(term, 0.0))
            if not _is_zero(busy) and k:
                lost = lost + k * busy
        return lost

    def _disk_rows(self, fraction: Any, channel: str, nbytes: Any, rows: Any, per_row: int) -> Any:
        """``fraction`` of moving ``nbytes`` of KV-cache or activation rows to or from disk.

        The engine moves those one row (and KV part) at a time through files opened without
        O_DIRECT, so each of the ``rows * per_row`` transfers moves its bytes at the bandwidth of
        its own size. A read also pays the profile's per-row latency (drop + read); the writes
        of one store share one fdatasync (``TierStore.deferred_sync``): each row pays
        ``disk_row_write_s`` and each kind (KV cache, activations) with rows on disk one
        ``disk_sync_s`` (one flush covers both kinds, so that case is counted twice). Priced as
        one transfer at the batch's bandwidth, a 3 KiB row came out 60x too cheap on the VM this
        was built on, and calibration pushed ``ctod`` to its bound. Reads are scaled by
        ``dtoc_rows``, not by ``dtoc`` (see :data:`FACTOR_TERMS`).
        """
        if _is_zero(fraction):
            return 0.0
        ops = rows * per_row
        unit = nbytes / np.maximum(ops, 1)
        seconds = ops * (unit / bandwidth_at(self.profile.bandwidth(channel), unit))
        if channel == "ctod":
            seconds = seconds + (ops * self.profile.disk_row_write_s + self.profile.disk_sync_s)
            return fraction * (seconds * self.factor("ctod"))
        seconds = seconds + ops * self.profile.disk_row_read_s
        return fraction * (seconds * self.factor("dtoc_rows"))

    def layer_terms(self, phase: str, rows: Any, length: Any, placement: Mapping[str, Any], nb: int) -> StepTerms:
        """A layer step of a block of ``nb`` identical GPU batches (the LP's representative step)."""
        return (self.weight_terms(placement, nb * self.step_tokens(phase, rows, length))
                + self.batch_terms(phase, rows, length, placement).scaled(nb))

    def layer_seconds(self, terms: StepTerms) -> Any:
        return step_seconds(terms, self.profile.compute_device, self.overlap)

    def groups(self, terms: StepTerms) -> tuple[Any, ...]:
        return parallel_groups(terms, self.profile.compute_device, self.overlap)

    def block_step(self, phase: str, rows: Any, length: Any, placement: Mapping[str, Any], batch_weight: Any,
                   block_weight: Any, batch_axis: int = -1, computed: Any = None, prefix: Any = 0,
                   prefix_groups: Any = 1.0, prefix_own: Any = None) -> "BlockStep":
        """A whole prefill or decode step of a block, GPU batches on ``batch_axis``.

        ``batch_weight`` says whether (1/0) each GPU batch takes part; ``block_weight`` whether
        any does, i.e. whether the layer's weights are fetched at all. ``computed``: see
        :meth:`batch_terms`; the head counts computed rows, the experts reached their positions.
        """
        c = rows if computed is None else computed
        positions = self.step_tokens(phase, self.layer_rows(phase, c, length, prefix, prefix_groups, prefix_own),
                                     length)
        tokens = np.sum(_times(batch_weight, positions), axis=batch_axis)
        block_rows = np.sum(_times(batch_weight, np.broadcast_to(c, np.shape(positions))), axis=batch_axis,
                            keepdims=True)
        return self.combine(self.batch_terms(phase, rows, length, placement, computed, prefix, prefix_groups,
                                             prefix_own),
                            self.head_seconds(phase, c, length, block_rows), placement, batch_weight, block_weight,
                            batch_axis, tokens)

    def combine(self, batch_terms: StepTerms, head_s: Any, placement: Mapping[str, Any], batch_weight: Any,
                block_weight: Any, batch_axis: int = -1, tokens: Any = None) -> "BlockStep":
        """Sum per-batch terms over ``batch_axis`` with weights, add the weight fetch, price the step.

        The analytic path passes probabilities as weights and expected per-batch terms.
        ``tokens``: the block's tokens per layer step (:meth:`dequant_bytes`; None: every expert).
        Duration = ``num_layers * layer_step + head``.
        """
        batches = batch_terms.scaled(batch_weight).sum(axis=batch_axis)
        head = np.sum(_times(batch_weight, head_s), axis=batch_axis)
        seconds = self.spec.num_layers * self.mean_layer_seconds(batches, placement, block_weight, tokens=tokens) + head
        terms = batches + self.weight_terms(placement, tokens).scaled(block_weight)  # the mean layer's terms
        return BlockStep(terms=terms, head_s=head, seconds=seconds)

    def mean_layer_seconds(self, batches: StepTerms, placement: Mapping[str, Any], block_weight: Any = 1.0,
                           whole_layers: bool = True, tokens: Any = None) -> Any:
        """Mean duration of the layer steps of a block whose GPU batches' terms sum to ``batches``:
        the layers of each weight tier priced apart (:meth:`weight_tier_terms`). Without
        ``whole_layers``, every layer split by the fractions (the LP's relaxation, FlexGen's model:
        never above the whole-layer price, since a max of means is at most the mean of maxes)."""
        tiers = (self.weight_tier_terms(placement, tokens) if whole_layers
                 else [(1.0, self.weight_terms(placement, tokens))])
        total: Any = 0.0
        for share, weights in tiers:
            total = total + share * self.layer_seconds(batches + weights.scaled(block_weight))
        return total

    def head_seconds(self, phase: str, rows: Any, length: Any, block_rows: Any = None) -> Any:
        """Embedding, final norm and LM head for one GPU batch, plus the per-step overhead.

        The head weights (embeddings, final norm, LM head) always live on the gpu tier. Logits
        are computed for the last position only, also in prefill. The runner multiplies the LM
        head once per step over the last positions of the block's ``block_rows`` rows (default:
        this batch's alone); a batch is charged its ``rows``' share of that one product, so the
        charges of a step's batches add up to it.
        """
        product = self.lm_head_seconds(rows) if block_rows is None else \
            _fraction(rows, block_rows) * self.lm_head_seconds(block_rows)
        return product + self.embed_seconds(phase, rows, length)

    def embed_seconds(self, phase: str, rows: Any, length: Any) -> Any:
        """The embedding gather of one GPU batch, plus the per-step overhead (each batch's own).

        Priced with the layer fit's per-token cost when there is one (a gather is one of the
        element-wise passes that coefficient covers), else with the memory roof if known."""
        spec = self.spec
        tokens = rows * length if phase == "prefill" else rows
        fit = self.profile.layer_fit(self._fit_name, phase, spec.dtype)
        if fit is not None and "tokens" in fit.features:
            embed = fit.coef[fit.features.index("tokens")] * tokens
        else:
            embed = _op_seconds(self.profile, "mm", 0.0 * tokens, tokens * spec.act_bytes_per_token)
        return embed * self.factor("head") + self.overhead_s("step_overhead_s")

    def lm_head_seconds(self, rows: Any) -> Any:
        """One LM head product over ``rows`` rows (floats or arrays)."""
        spec, prof = self.spec, self.profile
        head_flops = rows * spec.lm_head_flops_per_token()
        head_bytes = spec.vocab_size * spec.hidden * self.dtype_bytes
        head_fit = prof.head_fit(self._fit_name, spec.dtype)
        if head_fit is not None:
            # Measured on this machine at each power of two of rows, in the layout the runner keeps.
            return head_fit.predict_s(rows) * self.factor("head")
        if prof.compute_device == "cpu" and prof.mem_bytes_per_s > 0:
            # Without a measured fit (a profile taken without the model): on a CPU the few-row
            # LM head GEMM is neither purely compute- nor memory-bound: for opt-125m (1 thread)
            # 2/4/8/16/32 rows took 30/36/44/55/86 ms, which the *sum* of the two roofs tracks
            # within ~10% after one calibration factor, while their max is flat up to 16 rows
            # (and made calibrated predictions of jobs with few active rows slow). Those times are
            # of the row-major matrix; the runner's layout is often up to 1.7x faster, hence HeadFit.
            gemm = head_flops / prof.mm_flops + head_bytes / prof.mem_bytes_per_s
            # One row is a matrix-vector product, a different kernel: it reads the weight once at
            # the memory roof (which the profiler measures on exactly such a product), about half
            # the 2-row GEMM's time (opt-125m, 1 thread: 1/2/4 rows 18/40/60 ms on a busy VM). It
            # is priced like the decode layers' memory-bound products (their calibration factor),
            # not with the head factor fitted to few-row GEMMs; between 1 and 2 expected rows
            # (the analytic path) the two are interpolated.
            gemv = _op_seconds(prof, "mm", head_flops, head_bytes) * self.factor("gpu_compute")
            one_row = np.clip(2.0 - np.asarray(rows, dtype=float), 0.0, 1.0)
            out = (1.0 - one_row) * gemm * self.factor("head") + one_row * gemv
            return float(out) if np.ndim(out) == 0 else out
        return _op_seconds(prof, "mm", head_flops, head_bytes) * self.factor("head")

    # ----------------------------------------------------------------- memory
    def memory(self, placement: Mapping[str, Any], gbs: int, nb: int, max_prompt: int,
               max_output: int, cache_positions: int | None = None) -> dict[str, MemoryTerms]:
        """Peak bytes per tier of a block of ``nb`` GPU batches of ``gbs`` rows; ``cache_positions``:
        the run's prefix cache's (:func:`prefix_cache_positions`; default one prompt's worth).

        Every buffer the runner allocates, by name (each must be allocated exactly so):

        gpu tier
          ``weights_home``   wg of every layer, as stored (compressed if compress_weight)
          ``head_weights``   embeddings, final norm and LM head (always on the gpu tier)
          ``kv_home``        cg of the block's rows x layers x (max_prompt + max_output) positions
          ``act_home``       hg of the block's hidden states between layers (max_prompt positions)
          ``weight_stage``   fetched non-resident weights of the current and the next layer
                             (whole layers: min(2, offloaded layers) slots; on a host without
                             CUDA a slot is the 4 KiB-rounded record, the target of O_DIRECT reads)
          ``weight_dequant`` one layer dequantised for compute (compress_weight only)
          ``kv_stage``       offloaded KV rows of the batch computing and the batch loading
                             (with cpu_attention only the prompt's KV on its way out)
          ``kv_dequant``     one batch's layer cache dequantised for attention (compress_cache,
                             except a float32 cache on a CPU, which attends over its codes)
          ``kv_centers``     each layer's mean K and V on calibration text, which a 4-bit cache
                             is stored around (compress_cache; real models)
          ``act_stage``      offloaded hidden states of the batch computing and the batch loading
          ``hidden_last``    the last position's hidden state of every row of the block, which
                             the LM head multiplies at once after the last layer
          transients (one at a time, for one GPU batch): ``qkv`` projections, ``attention``
          (expanded K/V, scores and probabilities), ``mlp`` intermediates, ``logits`` (fp32,
          every row of the block: the head runs once per step);
          ``qkv``, ``attention`` and ``mlp`` beside ``prefix_held``, one layer's results of prefixes
          that later GPU batches of the block take instead of computing them
          (``xrunner.prefix.plan_block``; at most max_prompt positions; on CUDA also a layer's
          copy of the cpu tier's ``prefix_cache``, cache_positions)
          alone (before anything else): ``head_weights`` and, on a CPU host, ``head_layout``,
                             the LM head's layouts being timed (:func:`head_layout_bytes`)
        cpu tier
          ``weights_home``, ``kv_home``, ``act_home`` for the wc/cc/hc fractions
          ``weight_relay``   disk-resident part of the current and next layer (disk -> cpu -> gpu),
                             on CUDA only (a CPU host reads records straight into weight_stage),
                             min(2, disk layers) slots of a 4 KiB-rounded layer (O_DIRECT)
          ``kv_relay``       disk-resident KV rows of one batch in each direction
          ``act_relay``      disk-resident hidden states of one batch in each direction
          ``prefix_cache``   keys and values of every layer of the prefixes a run's first prefills
                             computed, which its later ones take (``xrunner.prefix.PrefixCache``;
                             at most cache_positions)
          transient ``cpu_attention``: the offloaded rows' query, output and new K/V, in place a
                             copy of their context, and a float32 chunk of rows
                             (``cpu_attention_scratch_bytes``)
          transient ``layer_load``: while the weights are loaded, one layer as the source gives it
                             and its packing scratch (:func:`layer_load_bytes`)
        disk tier
          ``weights_home``, ``kv_home``, ``act_home`` for the wd/cd/hd fractions (a weight layer
          is one O_DIRECT record rounded up to 4 KiB)
        """
        p, spec, dt = placement, self.spec, self.dtype_bytes
        L, bls = spec.num_layers, gbs * nb
        ctx = max_prompt + max_output
        w_layer = self.layer_stored_bytes
        w_record = float(round_up(math.ceil(w_layer)))  # a disk-resident layer: one aligned record
        kv_row = ctx * spec.kv_bytes_per_token_per_layer * self.kv_stored_ratio  # one row, one layer
        act_row = max_prompt * spec.hidden * dt
        h, q, kvd, heads = spec.hidden, spec.q_dim, spec.kv_dim, spec.num_heads
        s = max_prompt
        # (a Qwen2-MoE's shared expert may be wider than its routed ones)
        ffn_width = (3 if spec.gated_mlp else 2) * max(spec.ffn, spec.shared_expert_ffn)
        attn_gpu = p["cg"] if self.cpu_attention else 1.0
        stage_ctx = max_prompt if self.cpu_attention else ctx

        gpu_res = {
            "weights_home": p["wg"] * (L * w_layer),
            "head_weights": float(spec.head_weight_bytes),
            "kv_home": p["cg"] * (bls * L * kv_row),
            "act_home": p["hg"] * (bls * act_row),
            "weight_stage": _stage_slots(p["wc"] + p["wd"], L) * (w_layer if self.profile.compute_device == "cuda"
                                                                  else w_record),
            "weight_dequant": float(self.layer_matmul_bytes if self.compress_weight else 0),
            "kv_stage": (p["cc"] + p["cd"]) * (2 * gbs * stage_ctx * spec.kv_bytes_per_token_per_layer
                                               * self.kv_stored_ratio),
            "kv_dequant": float(gbs * ctx * spec.kv_bytes_per_token_per_layer
                                if self.compress_cache and not self.fused_kv else 0),
            "kv_centers": float(L * spec.kv_bytes_per_token_per_layer if self.compress_cache else 0),
            "act_stage": (p["hc"] + p["hd"]) * (2 * gbs * act_row),
            "hidden_last": float(bls * h * dt),
        }
        # Scores: SDPA's two copies in the compute dtype; a softcap or sinks (model.explicit_attention)
        # hold the scores, their capped or masked copies and the float32 softmax with its cast.
        explicit = spec.attention_softcap is not None or spec.attention_sinks
        prefill_attn = (gbs * dt * (2 * s * q + 2 * s * q)
                        + gbs * heads * spec.prefill_scores(s) * ((3 * dt + 8) if explicit else 2 * dt))

        def decode_attn_bytes(elem: float) -> float:  # one step's query, expanded K/V and scores
            return gbs * elem * (2 * q + 2 * ctx * q) + gbs * heads * ctx * ((3 * elem + 8) if explicit else 2 * elem)

        decode_attn = decode_attn_bytes(dt)
        if self.fused_kv:
            # The query and output split by channel parity (float32: the kernel's), and the rows'
            # context gathered; a half-precision cache's per-group mins and scales go to float32 too.
            groups = spec.num_kv_heads * -(-spec.head_dim // QUANT_GROUP)
            convert = ctx * 2 * groups * 2 * 4 if dt < 4 else 0.0
            decode_attn = gbs * (8 * q * 4 + ctx * spec.kv_bytes_per_token_per_layer * self.kv_stored_ratio + convert)
        cuda = self.profile.compute_device == "cuda"
        # (and on CUDA, one layer's copy of the prefixes the run's cache keeps, which a prefill takes)
        cache = max_prompt if cache_positions is None else cache_positions
        held = float(max_prompt * (h + 2 * kvd) * dt if nb > 1 else 0) + float(cache * 2 * kvd * dt if cuda else 0)
        gpu_tr = {
            "qkv": float(gbs * s * (h + q + 2 * kvd) * dt) + held,
            "attention": float(prefill_attn) + held,
            "attention_decode": attn_gpu * float(decode_attn),
            # (a mixture of experts: one expert's rows at a time, at most every token, and the
            # router's float32 logits and softmax)
            "mlp": float(gbs * s * ((2 * h + ffn_width) * dt + 2 * spec.num_experts * 4)) + held,
            # (the block's rows at once, after the last layer: no prefix is held by then)
            "logits": float(bls * (spec.vocab_size * 4 + h * dt)),
        }
        # The runner's first allocation: the head, and on a CPU host its LM head re-laid out.
        gpu_alone = {"head_weights": float(spec.head_weight_bytes),
                     "head_layout": head_layout_bytes(spec, self.profile.compute_device, bls)}
        cpu_res = {
            "weights_home": p["wc"] * (L * w_layer),
            "kv_home": p["cc"] * (bls * L * kv_row),
            "act_home": p["hc"] * (bls * act_row),
            "weight_relay": _stage_slots(p["wd"], L) * w_record if self.profile.compute_device == "cuda" else 0.0,
            "kv_relay": p["cd"] * (2 * gbs * kv_row),
            "act_relay": p["hd"] * (2 * gbs * act_row),
            "prefix_cache": float(L * cache * 2 * kvd * dt),
        }
        # CPU attention (``cpu_attention_scratch_bytes``): per offloaded row its query, output and
        # new K/V on the host, and in place (float32) a copy of its context; and one float32 chunk
        # of rows for the rest. A chunk's m rows x T positions stay within gbs x ctx and within
        # CPU_ATTENTION_CHUNK_BYTES of float32 K/V, or one row of ctx (rows per chunk are floored,
        # so a shorter context can fill the chunk more than the longest one does).
        cpu_attn: Any = 0.0
        if self.cpu_attention:
            off = p["cc"] + p["cd"]
            per_row = gbs * (2 * q + 2 * kvd + q) * dt
            if dt >= 4:
                per_row = per_row + cpu_attention_scratch_bytes(gbs, ctx, kvd, q, heads, dt, in_place=True)
            positions = min(gbs * ctx, max(CPU_ATTENTION_CHUNK_BYTES / (8 * kvd), ctx))
            per_position = 2 * kvd * (4 + dt) + (2 * q * 4 if q != kvd else 0) + 2 * heads * 4
            cpu_attn = off * float(per_row) + float(positions * per_position + gbs * 2 * q * 4)
        cpu_tr = {"cpu_attention": cpu_attn,
                  "layer_load": layer_load_bytes(spec, self.compress_weight, self.profile.compute_device == "cuda",
                                                 w_layer)}
        disk_res = {
            "weights_home": p["wd"] * (L * w_record),
            "kv_home": p["cd"] * (bls * L * kv_row),
            "act_home": p["hd"] * (bls * act_row),
        }
        return {"gpu": MemoryTerms("gpu", gpu_res, gpu_tr, gpu_alone), "cpu": MemoryTerms("cpu", cpu_res, cpu_tr),
                "disk": MemoryTerms("disk", disk_res, {})}

    def peak_bytes(self, policy: Policy, max_prompt: int, max_output: int,
                   cache_positions: int | None = None) -> dict[str, float]:
        """Numeric peak bytes per tier for a concrete policy."""
        mem = self.memory(policy.placement(), policy.gbs, policy.nb, max_prompt, max_output, cache_positions)
        return {tier: m.peak_bytes() for tier, m in mem.items()}


def fits_in(peaks: Mapping[str, float], profile: HardwareProfile) -> dict[str, bool]:
    """Whether each tier's peak bytes stay within the profile's capacity for it."""
    return {tier: peaks[tier] <= profile.capacity_bytes(tier) for tier in TIERS}
