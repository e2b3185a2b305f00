"""The offloading engine: runs a Policy over a stream of requests with weights, KV cache and
activations spread over the gpu, cpu and disk tiers (FlexGen Alg. 1 + ExeGPT refill).

One generation loop (:meth:`Engine._step`) serves prefill and decode, every placement and both
overlap settings: per layer, it runs the layer over every GPU batch of the block while three
single-thread I/O queues (weights, loads, stores; CUDA copy streams on a GPU) fetch the next
layer's weights, load the next GPU batch's offloaded KV cache and hidden states and store the
previous batch's. ``policy.overlap=False`` runs the very same tasks inline (ablation).

Buffers (names and sizes of ``CostModel.memory``), all allocated up front except transients:
gpu ``weights_home head_weights kv_home act_home weight_stage weight_dequant kv_stage kv_dequant
act_stage hidden_last`` + transients ``qkv attention attention_decode mlp logits`` (the first
three in a prefill beside ``prefix_held``, the prefixes later GPU batches take); cpu ``weights_home
kv_home act_home weight_relay kv_relay act_relay`` + transient ``cpu_attention``, and
``prefix_cache``, filled as prefills compute prefixes that later ones take; disk
``weights_home kv_home act_home``. Placement: weights by whole layers
(``Policy.layer_counts``), KV cache and hidden states by fixed row slots of each GPU batch
(``Policy.row_counts`` of ``gbs``: the first slots on gpu, then cpu, then disk).

Semantics follow docs/ARCHITECTURE.md "Shared execution semantics": blocks of ``gbs * nb``,
bucketing, left padding per GPU batch, early termination, refill every ``refill_every`` decode
steps, latency from the start of the prefill step to the end of the last token's step.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from contextlib import contextmanager, nullcontext
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from xprofiler.diskio import round_up
from xprofiler.profile import TIERS, HardwareProfile
from xprofiler.specs import ModelSpec
from xrunner.gptq import CENTER_SEQUENCES, GPTQCalibration, scratch_bytes as calibration_scratch_bytes
from xrunner.loaders import ModelSource
from xrunner.model import (attend_rows_on_cpu, attention, attn_in, attn_out_mlp, cpu_attention_chunk_rows,
                           cpu_head_layout, embed, final_logits, head_layout_of, is_range, lm_head_name,
                           layer_ropes, left_pad, position_ids_from_mask, torch_dtype)
from xrunner.prefix import Held, PrefixCache, PrefixPlan, plan_block, prefill_layer, prefix_order
from xrunner.sampling import SamplingParams, sample
from xrunner.stored_forms import KVCodec, WeightLayout
from xrunner.tiers import DiskSlice, MemoryLedger, Ref, TierStore, nbytes_of
from xsched.errors import UserError
from xsimulator.costmodel import (COPY_RUN_BYTES, CPU_ATTENTION_CHUNK_BYTES, CUDA_RUN_ROW_BYTES, SPAN_MAX_RATIO,
                                  CostModel, cpu_attention_scratch_bytes, head_layout_bytes, pack_scratch_bytes)
from xsimulator.policy import Policy
from xsimulator.trace import TRACKS, TraceEvent, TraceMarker

RESOURCES: tuple[str, ...] = TRACKS  # the simulator's trace tracks, so the two timelines line up


# --------------------------------------------------------------------------- public records
@dataclass(frozen=True)
class Request:
    """One prompt to generate for, as the engine takes it: already tokenized, with its own budget."""

    id: Any  # str or int (xsched run: a prompt's id, or (id, sample) for one of its "n" outputs); keys its draws
    prompt_ids: tuple[int, ...]  # already tokenized (chat template applied by the caller)
    max_new_tokens: int
    sampling: SamplingParams | None = None  # this request's own; None: the engine's


@dataclass(frozen=True)
class Finished:
    """A request's result, handed back as soon as its sequence stops (EOS or its budget)."""

    id: Any  # its Request's
    prompt_tokens: int
    output_ids: tuple[int, ...]  # generated tokens (includes the EOS token if it stopped on one)
    start_s: float  # job clock: start of the prefill step that included it
    end_s: float  # job clock: end of the step that produced its last token
    stopped_on_eos: bool
    # with ``Engine(logprobs=True)``: each output token's log-probability under the model (float32
    # log-softmax of its logits, before temperature, top-k and top-p); None otherwise
    logprobs: tuple[float, ...] | None = None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class EngineStats:
    """What a job measured, set beside the plan's prediction: wall time, tokens, peaks per tier, busy
    time per resource and the timeline (:meth:`Engine.run` returns it)."""

    wall_s: float
    generated_tokens: int
    prompt_tokens: int
    padded_prompt_tokens: int  # prefill positions computed incl. left padding (a repeated prompt or shared prefix once)
    num_prefill_steps: int
    num_decode_steps: int
    # Measured, per tier: during the run and since the policy in force at its start took effect (setup, or
    # the last reconfiguration before it), so it compares with planned_peak_bytes.
    peak_bytes: dict[str, int]
    planned_peak_bytes: dict[str, float]  # CostModel peak for the rounded policy / max lengths
    busy_s: dict[str, float]  # measured seconds per resource
    events: list[TraceEvent] = field(default_factory=list)
    markers: list[TraceMarker] = field(default_factory=list)
    reconfigurations: list["Reconfiguration"] = field(default_factory=list)  # applied during this run
    # Measured peak per tier since the last reconfiguration finished (the whole run when there was none).
    peak_bytes_since_change: dict[str, int] = field(default_factory=dict)
    # CUDA only: torch's caching allocator's peak reserved bytes during the run (None elsewhere). The
    # ledger counts what the engine allocates; this adds what the allocator kept around it.
    device_reserved_peak_bytes: int | None = None


@dataclass(frozen=True)
class BlockInfo:
    """What a ``between_blocks`` hook sees at a block boundary (docs/ARCHITECTURE.md "Adapting mid-job")."""

    block: int  # 0, 1, 2 ... boundaries seen so far in this run
    clock_s: float  # job clock at the boundary
    policy: Policy  # the policy in force
    planned_peak_bytes: dict[str, float] = field(default_factory=dict)  # of the policy in force, per tier
    capacity_bytes: dict[str, float] | None = None  # the budget the engine enforces (None: unchecked)


@dataclass(frozen=True)
class Reconfiguration:
    """One applied policy change (also a ``TraceMarker`` named "reconfigure" on the timeline)."""

    at_s: float  # job clock when it started
    stall_s: float  # wall seconds the job was stopped for it (drain excluded)
    old_policy: Policy
    new_policy: Policy
    reason: str  # free text from the caller
    moved_bytes: dict[str, int]  # bytes copied per channel, keys "gpu->cpu", "cpu->disk", ...
    reloaded_bytes: int  # bytes read again from the model source (weight compression changed)
    planned_peak_bytes: dict[str, float]  # planned peak per tier under the new policy
    freed_bytes: dict[str, int] = field(default_factory=dict)  # per tier: bytes given back (ledger) by the change
    transition_peak_bytes: dict[str, int] = field(default_factory=dict)  # measured peak per tier during the change
    capacity_bytes: dict[str, float] | None = None  # the budget checked (None: unchecked)
    peak_before_bytes: dict[str, int] = field(default_factory=dict)  # measured peak per tier under the old policy
    head_layout: str = ""  # the LM head matrix's layout after the change (xrunner.model.head_layout_of)
    head_retimed: bool = False  # the layouts were timed again at the new gbs (a CPU host with room for the copy)


HookAnswer = tuple[Policy, str] | tuple[Policy, str, Mapping[str, float]] | None


def rounded_policy(policy: Policy, num_layers: int) -> Policy:
    """The policy with its fractions replaced by what the runner places (whole layers and rows)."""
    g, c, d = policy.layer_counts(num_layers)
    cg, cc, cd = policy.row_counts("cache", policy.gbs)
    hg, hc, hd = policy.row_counts("act", policy.gbs)
    n, b = num_layers, policy.gbs
    return replace(policy, wg=g / n, wc=c / n, wd=d / n, cg=cg / b, cc=cc / b, cd=cd / b, hg=hg / b, hc=hc / b,
                   hd=hd / b)


# --------------------------------------------------------------------------- helpers
def _kv_time_dim(tier: str) -> int:
    """The positions dimension of a tier's KV home tensor (``Engine._alloc_buffers``)."""
    return 2 if tier == "gpu" else 1


def _index(idx: Sequence[int], device: torch.device) -> torch.Tensor:
    """``idx`` as a long tensor on ``device``, sent without waiting for the device.

    ``torch.tensor(idx, device=cuda)`` is a blocking copy: the compute thread would stop until the
    GPU had run every kernel queued so far, once per gather, and lose the lead that keeps the GPU
    busy. From pinned memory the copy is queued like a kernel.
    """
    t = torch.tensor(list(idx), dtype=torch.long)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _take(t: torch.Tensor, idx: Sequence[int], dim: int = 0) -> torch.Tensor:
    """Rows ``idx`` of ``t``: a view when they are a contiguous range, else a gather (a copy)."""
    if is_range(idx):
        return t.narrow(dim, idx[0], len(idx))
    return t.index_select(dim, _index(idx, t.device))


def _runs(rows: Sequence[int], row_bytes: int, cuda: bool = False) -> list[tuple[int, int, int]]:
    """``(k, r, m)``: ``rows[k:k + m]`` are the consecutive rows ``r .. r + m - 1``, with at most
    ``COPY_RUN_BYTES`` (or one row) in a run; with ``cuda``, rows of ``CUDA_RUN_ROW_BYTES`` or
    more one at a time (each is one DMA from pinned memory; a run over part of its rows'
    positions is strided, and torch gathers it through pageable memory).

    The engine moves offloaded KV-cache and activation rows between a tier's home and the stage
    slots. One copy per row cost 0.25-0.3 ms each on an H200 host (stop 38: 186 copies per decode
    item at 31 rows of a 4-bit cache), mostly Python and synchronisation, not bytes; a run of
    rows is one strided copy. The cap bounds the contiguous temporaries that a CUDA copy between
    differently laid-out tensors makes on each side.
    """
    cap = 1 if cuda and row_bytes >= CUDA_RUN_ROW_BYTES else max(1, COPY_RUN_BYTES // max(1, row_bytes))
    out: list[tuple[int, int, int]] = []
    for k, r in enumerate(rows):
        if out and out[-1][1] + out[-1][2] == r and out[-1][2] < cap:
            k0, r0, m = out[-1]
            out[-1] = (k0, r0, m + 1)
        else:
            out.append((k, r, 1))
    return out


def attention_span(rows: Sequence[int]) -> tuple[int, int] | None:
    """``(first, end)`` slots over which decode attention runs in place, for sorted ``rows`` that
    are no contiguous range but fill at least 1 / ``SPAN_MAX_RATIO`` of their span; else None.

    Once some rows of a GPU batch have finished, the rest are no contiguous range of the KV cache.
    Copying their context out (``_take``) moves it three times over on a CPU, and then attention
    reads the copy; attending over the whole span in place reads the idle slots' context once
    instead. opt-125m shapes, 1 thread, per layer: 20 of 32 slots at 1024 positions 65 -> 17 ms,
    8 of 16 at 1024 20 -> 5 ms, 14 of 32 at 64 1.6 -> 1.5 ms. CPU attention over the cpu tier
    does the same (20 of 32 at 1024: 73 -> 21 ms). The cost model prices both ways
    (``CostModel._scattered_rows_s``).
    """
    if len(rows) < 2 or list(rows) != sorted(rows):
        return None
    lo, hi = rows[0], rows[-1] + 1
    if hi - lo == len(rows) or hi - lo > SPAN_MAX_RATIO * len(rows):
        return None
    return lo, hi


def _spread(span: tuple[int, int], rows: Sequence[int], q: torch.Tensor, mask: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and mask of ``rows`` laid out over the slots of ``span``, and the rows' positions
    in it (to pick their outputs): idle slots get zero queries and all-ones masks, so their
    outputs stay finite."""
    lo, hi = span
    at = _index([r - lo for r in rows], q.device)

    def fill(x: torch.Tensor, value: int) -> torch.Tensor:
        return torch.full((hi - lo,) + tuple(x.shape[1:]), value, dtype=x.dtype, device=x.device).index_copy_(0, at, x)

    return fill(q, 0), fill(mask, 1), at


def _window_start(mask: torch.Tensor, window: int | None) -> int:
    """The first of ``mask``'s columns (``[rows, T]``, True where a row has a token) holding one
    of any row's last ``window`` tokens (0 without a window). A row's tokens are not always
    contiguous: a refill whose prompt is longer than the batch's context moves every row's next
    column past masked ones, so the last ``window`` columns may hold fewer than ``window``."""
    if window is None or mask.shape[1] <= window:
        return 0
    seen = mask.flip(-1).cumsum(-1)  # [rows, T]: tokens in the last j + 1 columns
    need = seen[:, -1:].clamp(max=window)  # each row's tokens in its window
    last = (seen >= need).int().argmax(-1)  # the first j reaching it: its oldest windowed token
    return mask.shape[1] - 1 - int(last.max())


def _repeats(prompts: Sequence[tuple[int, ...]]) -> tuple[list[int], list[int]] | None:
    """``_Work.share`` for rows with these prompts: (the first row of each distinct prompt, each
    row's index among those), or None when no prompt repeats."""
    index: dict[tuple[int, ...], int] = {}
    firsts: list[int] = []
    of_row = []
    for i, p in enumerate(prompts):
        u = index.setdefault(p, len(firsts))
        if u == len(firsts):
            firsts.append(i)
        of_row.append(u)
    return None if len(firsts) == len(prompts) else (firsts, of_row)


def _done() -> Future:
    """A future that has already completed (a task with nothing to do)."""
    fut: Future = Future()
    fut.set_result(None)
    return fut


def _settle(fut: Future, error: BaseException | None) -> None:
    """Complete ``fut`` (with ``error`` if given) unless it already is."""
    try:
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
    except InvalidStateError:
        pass


class _SignalGate:
    """Ctrl-C and SIGTERM recorded as they arrive and delivered (their handlers run, raising
    KeyboardInterrupt or the CLI's Terminated) at :meth:`check`, the engine's safe points, or when
    the gate closes. Raised wherever they landed, the exception could fall between a Python-level
    lock's acquire and its ``with`` block (``threading.Condition`` in the I/O pools' ``submit``):
    the lock stayed held and the cleanup's next ``submit`` waited on it for ever (a Ctrl-C test hung
    in 1 of 8 local runs and in a CI run, stop 64; 0 of 12 with the gate). Loading the weights
    (with the calibration pass) checks between layers. Closing the engine holds them too: a second
    Ctrl-C during the first one's cleanup left the offload files behind (review). Only the main
    thread can change handlers, and only Python's can be put back; elsewhere the gate does nothing."""

    HELD = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.caught: list[int] = []
        self.previous: dict[int, Any] | None = None

    def __enter__(self) -> "_SignalGate":
        if threading.current_thread() is threading.main_thread() and None not in map(signal.getsignal, self.HELD):
            self.previous = {s: signal.signal(s, lambda signum, frame: self.caught.append(signum)) for s in self.HELD}
        return self

    def check(self) -> None:
        """Deliver a signal that arrived (the gate is then open: later ones act at once)."""
        if self.caught:
            self.__exit__()

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            for s, handler in self.previous.items():
                signal.signal(s, handler)
            self.previous = None
        caught, self.caught = list(dict.fromkeys(self.caught)), []
        for s in caught:
            signal.raise_signal(s)


def _refuse_unsupported(policy: Policy) -> None:
    if policy.compress_cache and policy.cpu_attention:
        raise UserError("compress_cache with cpu_attention is not supported; turn one of them off")


def _refuse_over_capacity(planned: Mapping[str, float], caps: Mapping[str, float] | None) -> None:
    """UserError naming the first tier whose planned peak exceeds its capacity, and by how much."""
    for tier in TIERS:
        if caps is not None and tier in caps and planned[tier] > caps[tier]:
            short = planned[tier] - caps[tier]
            raise UserError(f"the plan needs {planned[tier]:,.0f} bytes ({planned[tier] / 2**30:,.2f} GiB) on the {tier} "
                            f"tier but {caps[tier]:,.0f} are available (short by {short:,.0f} bytes); pick a plan "
                            "that fits this machine or raise the tier's capacity")


def _layer_tiers(policy: Policy, num_layers: int) -> list[str]:
    g, c, d = policy.layer_counts(num_layers)
    return ["gpu"] * g + ["cpu"] * c + ["disk"] * d


def _move_order(move: tuple[int, str, str]) -> tuple[int, int, int]:
    """Order weight moves so each tier first shrinks, then grows: demotions to the slowest tier first,
    then promotions to the fastest first (a tier's transition peak stays near max(old, new))."""
    i, src, dst = move
    a, b = TIERS.index(src), TIERS.index(dst)
    return (0, -b, i) if b > a else (1, b, i)


def _split(counts: tuple[int, int, int]) -> list[tuple[str, int, int]]:
    """(tier, first slot, slots) for a (gpu, cpu, disk) row split of a GPU batch."""
    out, start = [], 0
    for tier, n in zip(TIERS, counts):
        out.append((tier, start, n))
        start += n
    return out


class _Queue:
    """The request stream with one request of look-ahead, so the engine knows whether any remain."""

    def __init__(self, requests: Iterable[Request]):
        self._it = iter(requests)
        self._next: list[Request] = []

    def empty(self) -> bool:
        if not self._next:
            self._next = list(itertools.islice(self._it, 1))
        return not self._next

    def take(self, n: int) -> list[Request]:
        out, self._next = self._next[:n], self._next[n:]
        return out + list(itertools.islice(self._it, n - len(out)))


@dataclass
class _Row:
    req: Request
    out: list[int]
    start_s: float
    n_ctx: int = 0  # tokens in this row's cache
    first_col: int = 0  # column of its first real token in the batch's KV tensor
    logprobs: list[float] | None = None  # of ``out``'s tokens, when the engine records them


@dataclass
class _Batch:
    """A GPU batch of ``gbs`` slots: its rows and the column geometry of its KV tensors."""

    rows: list[_Row | None]
    mask: torch.Tensor  # [gbs, cap] bool on the CPU: column holds a real token of the slot
    end: int = 0  # next free column

    def active(self) -> list[int]:
        return [s for s, r in enumerate(self.rows) if r is not None]

    def begin(self) -> int:
        cols = [r.first_col for r in self.rows if r is not None]
        return min(cols) if cols else 0


@dataclass
class _Work:
    """One GPU batch's part of a step: which slots compute, their inputs and cache columns."""

    batch: int
    slots: list[int]  # local slot indices, ascending
    ids: torch.Tensor  # [n, t] on the device
    pos: torch.Tensor  # [n, t]
    col: int  # first column written (prefill: c0; decode: the new column)
    begin: int  # first context column (decode)
    mask: torch.Tensor | None  # prefill: [n, t] padding mask; decode: [n, T+1] context mask (device)
    cpu_mask: torch.Tensor | None = None  # decode context mask on the CPU (CPU attention; all-real test)
    window_begin: int = 0  # decode: first column holding any row's last ``sliding_window`` tokens
    # Prefill: (positions computed, each row's index among them) when rows repeat a prompt (a prompt's
    # "n" samples): equal padded inputs give equal K, V and hidden states, so each is computed once.
    share: tuple[list[int], list[int]] | None = None
    prefix: PrefixPlan | None = None  # prefill: prefixes the computed rows share (xrunner.prefix)

    @property
    def t(self) -> int:
        return self.ids.shape[1]

    def computed(self, pos: list[int]) -> list[int]:
        """Which computed rows hold the rows at positions ``pos`` (themselves unless shared)."""
        return pos if self.share is None else [self.share[1][p] for p in pos]

    def first_col(self, window: int | None) -> int:
        """First context column a decode step loads and attends to in a layer with a sliding
        ``window`` (None: all from ``begin``). Older columns hold no row's windowed tokens; the
        attention's own window mask still picks each row's among the kept ones."""
        return self.begin if window is None else max(self.begin, self.window_begin)

    def context_mask(self, window: int | None, cpu: bool = False) -> torch.Tensor | None:
        """The decode context mask (``cpu``: its host copy) from :meth:`first_col` on."""
        mask = self.cpu_mask if cpu else self.mask
        return None if mask is None else mask[:, self.first_col(window) - self.begin:]


# --------------------------------------------------------------------------- the engine
class Engine:
    """Executes a :class:`Policy` on a model from a :class:`ModelSource` (see module docstring).

    ``cuda_sync`` ("item" or "step") picks how the compute thread waits for a CUDA device; see
    :meth:`_tock`. Ignored on a CPU host. ``head_layout`` fixes the CPU LM head's layout instead
    of timing both (:func:`xrunner.model.cpu_head_layout`); :attr:`head_layout` is the one in use.
    ``notice`` gets one line before a reconfiguration does more than re-make its empty buffers
    (reads the weights again, runs a calibration pass, moves layers), so a caller can say why the
    job pauses."""

    def __init__(self, source: ModelSource, policy: Policy, *, max_prompt: int, max_output: int,
                 capacity_bytes: Mapping[str, float] | None = None, offload_dir: str | Path | None = None,
                 sampling: SamplingParams | None = None, stop_token_ids: Sequence[int] = (),
                 record_trace: bool = False, profile: HardwareProfile | None = None,
                 device: str | torch.device | None = None, progress: bool = False,
                 calibration_ids: torch.Tensor | Callable[[], torch.Tensor] | None = None,
                 cuda_sync: str = "item", head_layout: str | None = None,
                 notice: Callable[[str], None] | None = None,
                 stop_check: Callable[[Request, Sequence[int]], bool] | None = None, logprobs: bool = False,
                 share_prefixes: bool = True, order_by_prefix: bool = True, prefixes_across_batches: bool = True,
                 prefix_cache: bool = True, prefix_cache_positions: int | None = None,
                 default_cache_positions: int | None = None):
        spec = source.spec
        if head_layout not in (None, "rows", "transposed"):
            raise UserError(f"head_layout must be 'rows' or 'transposed', got {head_layout!r}")
        self._head_layout_given = head_layout
        if cuda_sync not in ("item", "step"):
            raise UserError(f"cuda_sync must be 'item' or 'step', got {cuda_sync!r}")
        # CUDA only. "item": the host waits for the device after every (layer, GPU batch) item, as
        # measured at stop 31. "step": CUDA events, one wait per step (:meth:`_tock`); an ablation.
        self.cuda_sync = cuda_sync
        self.spec, self.source = spec, source
        self.layer_specs = spec.layer_specs()  # each layer's window and rotary base (Gemma 2, 3)
        if max_prompt < 1 or max_output < 1:
            raise UserError(f"max_prompt and max_output must be >= 1, got {max_prompt} and {max_output}")
        if max_prompt + max_output > spec.max_positions:
            raise UserError(f"max prompt {max_prompt} + max output {max_output} exceed {spec.name}'s "
                            f"{spec.max_positions} positions; lower them")
        self.policy = policy
        self.max_prompt, self.max_output = max_prompt, max_output
        self.cap = max_prompt + max_output
        self.sampling = sampling or SamplingParams()
        self.stop = frozenset(int(t) for t in stop_token_ids)
        # Ends a request on its output so far (stop strings, which need the caller's tokenizer)
        self.stop_check = stop_check
        self.logprobs = logprobs  # record each output token's log-probability (Finished.logprobs)
        # Compute a prefix that prompts of one prefill share (a system prompt) once (xrunner.prefix);
        # off: every row computes all its columns (an ablation).
        self.share_prefixes = share_prefixes
        # With bucketing and sharing: order a block's prompts so that those beginning alike join one
        # GPU batch, where that computes fewer prefill positions than length order (prefix_order);
        # off: length order only (an ablation).
        self.order_by_prefix = order_by_prefix
        # A later GPU batch of the block takes a prefix an earlier one computed in the same layer
        # (xrunner.prefix.plan_block), holding at most max_prompt positions of them at a time;
        # off: each batch computes its own (an ablation).
        self.prefixes_across_batches = prefixes_across_batches
        self._held: dict[int, Held] = {}  # the current layer's prefix results held for later batches
        # The run's later prefills (refills, later blocks) take the prefixes its first ones computed
        # (xrunner.prefix.PrefixCache: keys and values of every layer, on the cpu tier; room for
        # prefix_cache_positions, default the policy's, else default_cache_positions, else max_prompt:
        # xsimulator.costmodel.run_cache_positions sizes it to a plan's); off: each prefill
        # computes its own (an ablation). default_cache_positions also sizes it for a re-plan's
        # policy that names no size (reconfigure).
        self.prefix_cache = prefix_cache
        for name, value in (("prefix_cache_positions", prefix_cache_positions),
                            ("default_cache_positions", default_cache_positions)):
            if value is not None and value < 1:
                raise UserError(f"{name} must be >= 1, got {value}")
        self.default_cache_positions = max_prompt if default_cache_positions is None else default_cache_positions
        self.cache_positions = self._cache_size_of(policy) if prefix_cache_positions is None \
            else prefix_cache_positions
        self._cache = PrefixCache(0)
        # Token ids [sequences, length] of calibration text (or a function giving them, called the
        # first time a calibration pass runs, while weights load): 4-bit weights then get GPTQ codes
        # (xrunner.gptq) instead of nearest rounding, and a 4-bit KV cache is stored around each
        # layer's mean K/V on the text (KVCodec centers). None: nearest rounding, no centers.
        self.calibration_ids = calibration_ids
        self.kv_centers: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # in force (4-bit cache)
        # The centers of the last calibration pass over the weights stored now, kept while the cache
        # is plain (off the ledger, like the rope tables: L x 2 x kv_dim values, 46 KB for SmolLM2),
        # so switching a 4-bit cache on again adopts them instead of a pass (20 s for SmolLM2).
        self._pass_centers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.notice = notice
        self.record_trace = record_trace
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        self.dtype = torch_dtype(spec.dtype)
        _refuse_unsupported(policy)

        # Planned peak per tier for what this runner places (whole layers and rows), then the refusal.
        if profile is None:
            from xprofiler.presets import load_preset, preset_names
            profile = load_preset(preset_names()[0])
        # The memory terms depend on the machine only through its compute device (stage slot
        # sizes), so they follow the device this engine runs on, whatever the plan's profile says.
        self.profile = replace(profile, compute_device="cuda" if self.device.type == "cuda" else "cpu")
        self.capacity_bytes: dict[str, float] | None = dict(capacity_bytes) if capacity_bytes is not None else None
        self.rounded = rounded_policy(policy, spec.num_layers)
        self.planned_peak_bytes = self._planned_peak(
            self.rounded, self.capacity_bytes, self._calibration_bytes(self.rounded.compress_weight,
                                                                       self.rounded.compress_cache))

        self.ledger = MemoryLedger()
        self._lock = threading.Lock()
        self._gate = _SignalGate()  # entered by run(); outside it, check() finds nothing
        self.busy_s = {r: 0.0 for r in RESOURCES}
        self.events: list[TraceEvent] = []
        self.markers: list[TraceMarker] = []
        self.reconfigurations: list[Reconfiguration] = []
        self._t0 = time.perf_counter()
        # CUDA compute intervals: queued (start, end) events, booked at the step's one synchronisation.
        self._last_ev: Any = None  # the latest compute point queued; each I/O task waits for it
        self._pending: list[tuple[tuple[float, Any], Any, str, dict[str, Any], float]] = []
        self._anchor: tuple[float, Any] | None = None  # (host time, event) of one idle-stream instant
        self.store = TierStore(self.device, offload_dir, self.ledger, on_copy=self._on_copy)
        self._pools: list[ThreadPoolExecutor] = []
        self._closed = False
        self._in_flight = False  # rows are in the batches (reconfigure is refused then)
        self._running = False  # inside run(): a callback's run() or close() is refused
        self._broken: str | None = None  # why the engine can no longer run (a change that stopped half-way)
        try:
            self._allocate(progress)
        except BaseException:
            self.close()
            raise

    def _cache_size_of(self, policy: Policy) -> int:
        """The prefix cache size ``policy`` names, else the engine's default."""
        named = policy.prefix_cache_positions
        return self.default_cache_positions if named is None else named

    def _planned_peak(self, rounded: Policy, caps: Mapping[str, float] | None, scratch: int,
                      cache_positions: int | None = None) -> dict[str, float]:
        """Planned peak bytes per tier of ``rounded``, refused (``UserError``) if over ``caps``.

        ``scratch``: the calibration pass this setup runs (GPTQ for 4-bit weights, KV centers for
        a 4-bit cache; 0: none), added to the gpu tier's resident buffers while the weights load;
        that is checked after the plan itself, so the error can say that no pass would fit.
        ``cache_positions``: the prefix cache's size (default: the engine's).
        """
        cache = self.cache_positions if cache_positions is None else cache_positions
        mem = CostModel.for_policy(self.spec, self.profile, rounded).memory(
            rounded.placement(), rounded.gbs, rounded.nb, self.max_prompt, self.max_output, cache)
        peaks = {tier: m.peak_bytes() for tier, m in mem.items()}
        _refuse_over_capacity(peaks, caps)
        if scratch:
            loading = sum(float(v) for v in mem["gpu"].resident.values()) + scratch
            if caps is not None and "gpu" in caps and loading > caps["gpu"]:
                raise UserError(f"the calibration pass (GPTQ codes, KV centers) needs {scratch:.0f} bytes on the gpu "
                                f"tier while the weights load, {loading - caps['gpu']:.0f} more than the plan leaves "
                                "free; pass fewer --calibration-sequences or skip it (xsched run "
                                "--weight-rounding nearest)")
            peaks["gpu"] = max(peaks["gpu"], loading)
        return peaks

    def _calibration(self, fit: bool) -> torch.Tensor:
        """The calibration ids of a pass: all of them for GPTQ (``fit``), the first
        :data:`~xrunner.gptq.CENTER_SEQUENCES` for one that only records K/V centers."""
        if callable(self.calibration_ids):
            self.calibration_ids = self.calibration_ids()
        return self.calibration_ids if fit else self.calibration_ids[:CENTER_SEQUENCES]

    def _calibration_bytes(self, compress_weight: bool, compress_cache: bool) -> int:
        """Scratch bytes on the gpu tier of the calibration pass a load runs (0: none): GPTQ (and
        K/V centers) for 4-bit weights, K/V centers only for a 4-bit cache with plain weights."""
        if self.calibration_ids is None or not (compress_weight or compress_cache):
            return 0
        copies = self.device.type != "cpu" or self.dtype != torch.float32  # sources give CPU tensors in spec.dtype
        return calibration_scratch_bytes(self.spec, *self._calibration(compress_weight).shape, fit=compress_weight,
                                         copies_layer=copies)

    # ----------------------------------------------------------------- setup
    def _allocate(self, progress: bool) -> None:
        spec, p, st = self.spec, self.policy, self.store
        L = spec.num_layers
        self.layout = WeightLayout(spec.layer_tensor_shapes(), self.dtype, p.compress_weight,
                                    rotate_inputs=self.calibration_ids is not None)
        self.layer_tier = _layer_tiers(p, L)

        # Head weights (always on the gpu tier), then every layer into its home tier.
        self.head = {k: st.adopt("gpu", "head_weights", v.to(self.device)) for k, v in self.source.load_head().items()}
        self._choose_head_layout(p.block_size, layout=self._head_layout_given)
        self.w_relays = [self._new_relay() for _ in range(self._relay_count(self.layer_tier))]
        self.w_home: list[torch.Tensor | DiskSlice] = [self._new_home(t) for t in self.layer_tier]
        self._bufs: list[tuple[str, str, Any]] = []
        self._alloc_buffers()

        self._load_weights(p.compress_cache, progress)
        self.ropes = layer_ropes(spec, self.cap, self.device, self.dtype)
        self._set_overlap(p.overlap)
        self._reset_fetch_state()

    def _choose_head_layout(self, rows: int, room_bytes: float | None = None, layout: str | None = None) -> bool:
        """On a CPU, put the LM head in the layout its GEMM of ``rows`` rows (a block's: the head
        runs once per step over every GPU batch) runs fastest in, timed with one more copy for a
        moment (none on CUDA), or in ``layout`` when given; skipped, returning False, when that
        copy would take the gpu tier's live bytes over ``room_bytes``."""
        need = head_layout_bytes(self.spec, self.profile.compute_device, rows)
        if need == 0 or (room_bytes is not None and self.ledger.live["gpu"] + need > room_bytes):
            return False
        with self.ledger.transient("gpu", "head_layout", need):
            self.head = cpu_head_layout(self.spec, self.head, rows, layout)
        return True

    @property
    def head_layout(self) -> str:
        """The LM head matrix's layout in use ("rows" or "transposed")."""
        return head_layout_of(self.head[lm_head_name(self.spec)])

    def _new_relay(self) -> torch.Tensor:
        return self.store.empty("cpu", "weight_relay", (round_up(self.layout.nbytes),), torch.uint8)

    def _relay_count(self, tiers: Sequence[str], moves_via_disk: bool = False) -> int:
        """Weight relays (cpu tier) for disk-resident layers: one per in-flight disk layer on CUDA
        (the one being staged and the next one's read), at least one while layers move via disk.
        A CPU host has none: its gpu tier is host RAM, so disk records go straight to and from
        aligned gpu-tier buffers (:meth:`_record_buffer`)."""
        if self.device.type != "cuda":
            return 0
        return max(min(2, list(tiers).count("disk")), 1 if moves_via_disk else 0)

    @contextmanager
    def _record_buffer(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A 4 KiB-aligned buffer (tier, tensor) for one weight record on its way to or from disk.

        On CUDA the cpu relay. On a CPU host a gpu-tier record, which O_DIRECT reads and writes
        directly: a stage slot while the buffers exist (they are empty while weights load), else
        a temporary one (a reload during a reconfiguration, after the old buffers are freed; a layer
        that only changes tier goes between its aligned homes and the file in place).
        """
        if self.w_relays:
            yield "cpu", self.w_relays[0]
        elif getattr(self, "w_stage", None):
            yield "gpu", self.w_stage[0]
        else:
            buf = self.store.empty("gpu", "weight_stage", (round_up(self.layout.nbytes),), torch.uint8)
            try:
                yield "gpu", buf
            finally:
                self.store.release("gpu", "weight_stage", buf)

    def _new_home(self, tier: str) -> torch.Tensor | DiskSlice:
        if tier == "disk":
            return self.store.disk_region("weights", "weights_home", (self.layout.nbytes,), torch.uint8, align=True)
        return self.store.empty(tier, "weights_home", (self.layout.nbytes,), torch.uint8)

    def _free_home(self, home: torch.Tensor | DiskSlice, tier: str) -> None:
        if isinstance(home, DiskSlice):
            self.store.free_region("weights_home", home, align=True)
        else:
            self.store.release(tier, "weights_home", home)

    def _load_weights(self, compress_cache: bool, progress: bool = False) -> int:
        """Read every layer from the source into its home, in order; returns the bytes read.

        With calibration text, one pass (``xrunner.gptq``) carries its hidden states through the
        layers as they load, on the head's (gpu) tier: it chooses 4-bit weights' codes by GPTQ
        and records each layer's K/V centers for a 4-bit cache (``kv_centers``). It is dropped at
        the end; its scratch is accounted as ``calibration`` while it lives.
        """
        import sys

        from tqdm import tqdm

        scratch = self._calibration_bytes(self.layout.compress, compress_cache)
        calib = GPTQCalibration(self.spec, self.head, self._calibration(self.layout.compress),
                                self.layout.quantize_tensor, self.layout.dequantize_tensor) if scratch else None
        nread = 0
        what = "" if calib is None else " (GPTQ)" if self.layout.compress else " (KV centers)"
        # Ctrl-C between layers, not inside one: a layer of random weights fills in a thread pool,
        # whose submit a signal could leave with a lock held (see _SignalGate). Inside run() (a
        # change of policy) its gate holds the signals: a gate of its own would hand them to the
        # run's, which delivered them only after every layer was read.
        with self.ledger.transient("gpu", "calibration", scratch), self._between_layers() as gate:
            for i in tqdm(range(self.spec.num_layers), desc=f"loading {self.spec.name}{what}", unit="layer",
                          file=sys.stderr, disable=not progress, leave=False):
                gate.check()
                nread += self._load_layer(i, calib)
        self._adopt_centers(calib, compress_cache)  # no pass: any centers kept were of other weights
        return nread

    def _between_layers(self) -> Any:
        """The signal gate a pass over the layers checks between them: the run's while one runs."""
        return nullcontext(self._gate) if self._running else _SignalGate()

    def _observe_centers(self) -> None:
        """K/V centers for a 4-bit cache switched on by a reconfiguration that keeps the weights:
        an observe-only calibration pass over the source's layers (the stored weights stay put)."""
        calib = GPTQCalibration(self.spec, self.head, self._calibration(False))
        with self.ledger.transient("gpu", "calibration", self._calibration_bytes(False, True)), \
                self._between_layers() as gate:
            for i in range(self.spec.num_layers):
                gate.check()
                w = self.source.load_layer(i)
                with self.ledger.transient("cpu", "layer_load", nbytes_of(*w.values())):
                    calib.observe_layer(i, w)
                del w
        self._adopt_centers(calib, True)

    def _adopt_centers(self, calib: GPTQCalibration | None, compress_cache: bool) -> None:
        """Keep a pass's K/V centers (None: no pass ran over the weights now stored), in force
        only with a 4-bit cache (a plain cache has no use for them)."""
        self._pass_centers = None if calib is None else [(k.to(self.dtype), v.to(self.dtype))
                                                         for k, v in calib.kv_centers]
        self._set_kv_centers(self._pass_centers if compress_cache else None)
        self.codec = self._new_codec(self.codec.compress)

    def _set_kv_centers(self, centers: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Keep (or drop: None) the K/V centers, accounted as ``kv_centers`` on the gpu tier."""
        if centers is self.kv_centers:
            return
        for pairs, account in ((self.kv_centers, self.ledger.sub), (centers, self.ledger.add)):
            if pairs is not None:
                account("gpu", "kv_centers", nbytes_of(*[t for pair in pairs for t in pair]))
        self.kv_centers = centers

    def _new_codec(self, compress_cache: bool) -> KVCodec:
        return KVCodec(self.spec.head_dim, self.dtype, compress_cache, centers=self.kv_centers,
                       fused=self.device.type == "cpu")

    def _load_layer(self, i: int, calib: GPTQCalibration | None) -> int:
        """Read layer ``i`` from the source into its home (packed, compressed if asked); returns bytes read.

        The source's copy, the packer's scratch (nearest rounding; GPTQ quantizes in its own pass)
        and a CUDA host's staged record are accounted on the cpu tier as ``layer_load``."""
        st, wbytes = self.store, self.layout.nbytes
        w = self.source.load_layer(i)
        nread = nbytes_of(*w.values())
        home = self.w_home[i]
        staged = self.layer_tier[i] == "gpu" and self.device.type == "cuda"
        fit = calib is not None and self.layout.compress  # GPTQ quantizes in its own pass
        scratch = pack_scratch_bytes(self.spec) if self.layout.compress and not fit else 0
        with self.ledger.transient("cpu", "layer_load", nread + scratch + (wbytes if staged else 0)):
            quantized = calib.quantize_layer(i, w) if fit else None
            if calib is not None and not fit:
                calib.observe_layer(i, w)
            if isinstance(home, DiskSlice):
                with self._record_buffer() as (tier, buf):
                    self.layout.pack(w, buf[:wbytes], quantized)
                    st.copy(Ref("disk", home), Ref(tier, buf))
            elif staged:
                tmp = torch.empty(wbytes, dtype=torch.uint8)
                self.layout.pack(w, tmp, quantized)
                home.copy_(tmp)
            else:
                self.layout.pack(w, home, quantized)
        return nread

    def _buf(self, tier: str, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A per-policy working buffer (KV/act homes, stages, relays): freed and re-made by a reconfiguration."""
        t = self.store.empty(tier, name, shape, dtype)
        self._bufs.append((tier, name, t))
        return t

    def _region(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> DiskSlice:
        ds = self.store.disk_region("rows", name, shape, dtype)
        self._bufs.append(("disk", name, ds))
        return ds

    def _alloc_buffers(self) -> None:
        """KV cache and hidden-state homes per GPU batch, stage slots, dequant buffers and relays of the policy.

        Between blocks they hold nothing (a block's rows have all finished), which is what lets a
        reconfiguration free and re-make them for another gbs, nb or row split.
        """
        spec, p, dt = self.spec, self.policy, self.dtype
        L, gbs, nb = spec.num_layers, p.gbs, p.nb
        self.cache_split = _split(p.row_counts("cache", gbs))
        self.act_split = _split(p.row_counts("act", gbs))
        self._set_kv_centers(self._pass_centers if p.compress_cache else None)  # a plain cache has no use for them
        self.codec = self._new_codec(p.compress_cache)
        hkv, cap, h, wbytes = spec.num_kv_heads, self.cap, spec.hidden, self.layout.nbytes
        self.kv_home: list[list[dict[str, list[Any]]]] = []  # [batch][layer][tier] -> parts
        self.act_home: list[dict[str, Any]] = []
        for _ in range(nb):
            per_layer = []
            for _l in range(L):
                tiers: dict[str, list[Any]] = {}
                for tier, _s, n in self.cache_split:
                    if not n:
                        continue
                    # Off the gpu tier a row's columns are positions-major (``[cap, hkv, ...]``), so a
                    # span of positions is one contiguous piece: one DMA from pinned memory on CUDA
                    # (a heads-major span is hkv strided pieces, which torch gathers through pageable
                    # memory). The gpu tier is heads-major, as attention reads it.
                    if tier == "disk":
                        tiers[tier] = [self._region("kv_home", (n, cap, hkv) + rest, pdt)
                                       for rest, pdt in self.codec.rests]
                    else:
                        shape = (n, hkv, cap) if tier == "gpu" else (n, cap, hkv)
                        tiers[tier] = [self._buf(tier, "kv_home", shape + rest, pdt) for rest, pdt in self.codec.rests]
                per_layer.append(tiers)
            self.kv_home.append(per_layer)
            acts: dict[str, Any] = {}
            for tier, _s, n in self.act_split:
                if not n:
                    continue
                if tier == "disk":
                    acts[tier] = self._region("act_home", (n, self.max_prompt, h), dt)
                else:
                    acts[tier] = self._buf(tier, "act_home", (n, self.max_prompt, h), dt)
            self.act_home.append(acts)
        self.store.reserve()

        n_off_c = sum(n for t, _s, n in self.cache_split if t != "gpu")
        n_disk_c = dict((t, n) for t, _s, n in self.cache_split)["disk"]
        n_off_h = sum(n for t, _s, n in self.act_split if t != "gpu")
        n_disk_h = dict((t, n) for t, _s, n in self.act_split)["disk"]
        n_staged = sum(1 for t in self.layer_tier if t != "gpu")
        # On a CPU host a slot is a whole 4 KiB-rounded record, so disk reads land in it directly.
        slot_bytes = wbytes if self.device.type == "cuda" else round_up(wbytes)
        self.w_stage = [self._buf("gpu", "weight_stage", (slot_bytes,), torch.uint8) for _ in range(min(2, n_staged))]
        self.w_dequant = None
        if p.compress_weight:
            self.w_dequant = {n: self._buf("gpu", "weight_dequant", s, dt)
                              for n, s in self.layout.dequant_shapes().items()}
        stage_ctx = self.max_prompt if p.cpu_attention else cap
        self.kv_stage = [[self._buf("gpu", "kv_stage", (n_off_c, hkv, stage_ctx) + rest, pdt)
                          for rest, pdt in self.codec.rests] for _ in range(2)] if n_off_c else []
        self.kv_dequant = None
        if p.compress_cache and not self.codec.fused:
            shape = (gbs, hkv, cap, spec.head_dim)
            self.kv_dequant = (self._buf("gpu", "kv_dequant", shape, dt), self._buf("gpu", "kv_dequant", shape, dt))
        self.act_stage = [self._buf("gpu", "act_stage", (n_off_h, self.max_prompt, h), dt)
                          for _ in range(2)] if n_off_h else []
        self.hidden_last = self._buf("gpu", "hidden_last", (nb * gbs, h), dt)
        self.kv_relay = ([[self._buf("cpu", "kv_relay", (n_disk_c, cap, hkv) + rest, pdt)
                           for rest, pdt in self.codec.rests] for _ in range(2)] if n_disk_c else [])
        self.act_relay = ([self._buf("cpu", "act_relay", (n_disk_h, self.max_prompt, h), dt) for _ in range(2)]
                          if n_disk_h else [])

    def _free_buffers(self) -> None:
        """Free everything :meth:`_alloc_buffers` made (largest first is irrelevant: all go at once)."""
        for tier, name, obj in self._bufs:
            if isinstance(obj, DiskSlice):
                self.store.free_region(name, obj)
            else:
                self.store.release(tier, name, obj)
        self._bufs = []
        self.kv_home, self.act_home, self.w_stage, self.kv_stage, self.act_stage = [], [], [], [], []
        self.kv_relay, self.act_relay, self.w_dequant, self.kv_dequant = [], [], None, None
        self.hidden_last = None

    def _set_overlap(self, overlap: bool) -> None:
        self.overlap = overlap
        if overlap and not self._pools:
            self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"xsched-{n}", initializer=self.store.mark_io_thread)
                           for n in ("weights", "load", "store")]
        elif not overlap and self._pools:
            for pool in self._pools:
                pool.shutdown(wait=True)
            self._pools = []

    def _reset_fetch_state(self) -> None:
        self.w_slot_layer: list[int | None] = [None] * len(self.w_stage)
        self._wfutures: dict[int, Future] = {}
        self._to_stage: dict[int, torch.Tensor] = {}  # CPU host: fetched layers awaiting their memcpy
        self._fetches = 0
        self._current_layer = -1
        self._inner_dequant_s = 0.0  # host seconds of experts dequantized inside layer compute
        self._store_done: list[Future] = []
        self._item = 0
        # Views of plain weights per buffer (a gpu-tier home, or a stage slot whatever layer it holds),
        # made once: the buffers stay put until a reconfiguration, which calls this again.
        self._views: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    # ----------------------------------------------------------------- adapting mid-job
    def reconfigure(self, policy: Policy, reason: str = "",
                    capacity_bytes: Mapping[str, float] | None = None) -> Reconfiguration:
        """Switch to ``policy`` between blocks, moving only what changed (docs: "Adapting mid-job").

        Weight layers whose tier is unchanged stay put; a layer whose tier changed is copied tier to
        tier with ``TierStore.copy`` (new home allocated, copied, old home freed, one layer at a
        time, tiers that shrink first); only a change of weight compression re-reads layers from the
        source. The KV cache, hidden-state, stage and relay buffers (empty between blocks) are freed
        and re-made for the new gbs/nb/row split. ``capacity_bytes`` (default: the budget in force)
        is checked before anything moves: a policy whose planned peak exceeds it is refused with a
        ``UserError`` and the engine keeps its old policy. The prefix cache is emptied, and takes
        the new policy's size where that differs from the old policy's.
        """
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if self._in_flight:
            raise RuntimeError("reconfigure between blocks only: rows are in flight (return the policy from "
                               "between_blocks instead, the engine drains them first)")
        # Buffers made inside run()'s inference mode would be inference tensors the I/O threads cannot write.
        with torch.inference_mode(False):
            return self._reconfigure(policy, reason, capacity_bytes)

    def _reconfigure(self, policy: Policy, reason: str, capacity_bytes: Mapping[str, float] | None
                     ) -> Reconfiguration:
        t_start = time.perf_counter()
        at_s = self._clock()
        spec, L = self.spec, self.spec.num_layers
        _refuse_unsupported(policy)
        caps = dict(capacity_bytes) if capacity_bytes is not None else self.capacity_bytes
        rounded = rounded_policy(policy, L)
        reload = policy.compress_weight != self.layout.compress
        # A 4-bit cache switched on without a reload still needs centers: an observing pass makes
        # them, unless a pass over these weights made them before (the load's GPTQ, or an earlier switch).
        observe = (not reload and policy.compress_cache and self._pass_centers is None
                   and self.calibration_ids is not None)
        scratch = (self._calibration_bytes(policy.compress_weight, policy.compress_cache) if reload
                   else self._calibration_bytes(False, True) if observe else 0)
        # A policy whose prefix cache size differs from the running one's (a re-plan grew it, or
        # went back to the default to make room) gets it; the same size keeps the engine's (a size
        # the caller gave the engine stays).
        cache = self._cache_size_of(policy)
        if cache == self._cache_size_of(self.policy):
            cache = self.cache_positions
        planned = self._planned_peak(rounded, caps, scratch, cache)
        new_tiers = _layer_tiers(policy, L)
        moves = [] if reload else sorted(((i, a, b) for i, (a, b) in enumerate(zip(self.layer_tier, new_tiers))
                                          if a != b), key=_move_order)
        if self.notice is not None and (reload or observe or moves):
            self.notice(self._slow_work(policy, reload, observe, len(moves)))

        self._settle_fetches()  # prefetches of the next step's first two layers may be pending
        freed_before = dict(self.ledger.freed_total)
        peak_before = self.ledger.reset_window()  # the old policy's peak since the run or the last change
        old = self.policy
        try:  # past this point the old buffers are gone: a change that stops half-way cannot run
            self._free_buffers()
            self.cache_positions = cache
            self._clear_cache()  # (new weights or a new dtype of them would compute other keys and values)
            moved: dict[str, int] = {}
            reloaded = 0
            if reload:  # the stored form changes: read from the source
                for relay in self.w_relays:
                    self.store.release("cpu", "weight_relay", relay)
                for i, tier in enumerate(self.layer_tier):
                    self._free_home(self.w_home[i], tier)
                self.layout = WeightLayout(spec.layer_tensor_shapes(), self.dtype, policy.compress_weight,
                                           rotate_inputs=self.calibration_ids is not None)
                self.layer_tier = new_tiers
                self.w_relays = [self._new_relay() for _ in range(self._relay_count(new_tiers))]
                self.w_home = [self._new_home(tier) for tier in new_tiers]
                reloaded = self._load_weights(policy.compress_cache)
            else:
                want = self._relay_count(new_tiers)
                keep = self._relay_count(new_tiers, moves_via_disk=any("disk" in (a, b) for _i, a, b in moves))
                while len(self.w_relays) > keep:
                    self.store.release("cpu", "weight_relay", self.w_relays.pop())
                if len(self.w_relays) < keep:
                    self.w_relays.append(self._new_relay())
                for i, a, b in moves:
                    home = self._new_home(b)
                    dst, src = Ref(b, home), Ref(a, self.w_home[i])
                    if self.store.needs_relay(dst, src):  # a CUDA device's record: through a cpu relay
                        with self._record_buffer() as (_tier, buf):
                            self.store.copy(dst, src, relay=buf)
                    else:  # host memory (a CPU host's gpu tier too) reads and writes its aligned home in place
                        self.store.copy(dst, src)
                    self._free_home(self.w_home[i], a)
                    self.w_home[i] = home
                    self.layer_tier[i] = b
                    moved[f"{a}->{b}"] = moved.get(f"{a}->{b}", 0) + self.layout.nbytes
                while len(self.w_relays) > want:
                    self.store.release("cpu", "weight_relay", self.w_relays.pop())
                while len(self.w_relays) < want:
                    self.w_relays.append(self._new_relay())
            if observe:
                self._observe_centers()
            # The head's faster layout depends on the rows it multiplies: time it again at a new block
            # size while the buffers are freed, if its second copy fits the new plan (else keep the
            # old one); a layout the caller gave stays.
            retimed = (policy.block_size != old.block_size and self._head_layout_given is None
                       and self._choose_head_layout(policy.block_size, planned["gpu"]))
            self.policy, self.rounded, self.planned_peak_bytes, self.capacity_bytes = policy, rounded, planned, caps
            self._alloc_buffers()
            self._set_overlap(policy.overlap)
            self._reset_fetch_state()
            self._sync()
        except BaseException as exc:
            self._broken = (f"this engine's change of policy stopped half-way ({exc.__class__.__name__}: {exc}); "
                            "close it and build a new one")
            raise
        transition = self.ledger.reset_window()  # from here on: the peak under the new policy
        rec = Reconfiguration(at_s=at_s, stall_s=time.perf_counter() - t_start, old_policy=old, new_policy=policy,
                              reason=reason, moved_bytes=moved, reloaded_bytes=reloaded,
                              planned_peak_bytes=dict(planned),
                              freed_bytes={t: self.ledger.freed_total[t] - freed_before[t] for t in TIERS},
                              transition_peak_bytes=transition, capacity_bytes=caps,
                              peak_before_bytes=peak_before,
                              head_layout=head_layout_of(self.head[lm_head_name(spec)]), head_retimed=retimed)
        self.reconfigurations.append(rec)
        marker = TraceMarker("reconfigure", at_s, {"reason": reason, "stall_s": rec.stall_s,
                                                   "moved_bytes": sum(moved.values()), "reloaded_bytes": reloaded,
                                                   "old": old.to_dict(), "new": policy.to_dict(),
                                                   "head_layout": rec.head_layout, "head_retimed": retimed})
        with self._lock:
            self.markers.append(marker)
            if self.record_trace:
                self.events.append(TraceEvent("compute", "reconfigure", t_start - self._t0, rec.stall_s,
                                              {"reason": reason}))
        return rec

    def _slow_work(self, policy: Policy, reload: bool, observe: bool, moves: int) -> str:
        """What a change to ``policy`` does beyond re-making the empty buffers, in words, for
        ``notice``: the job waits for it (on 2 busy cores a pass of 16 calibration sequences
        through SmolLM2's 30 layers took 20 s, reading them again with GPTQ on 8 sequences 117 s)."""
        L, name = self.spec.num_layers, self.spec.name
        if reload:
            fit = policy.compress_weight
            passing = self._calibration_bytes(fit, policy.compress_cache) > 0
            n = len(self._calibration(fit)) if passing else 0
            form = "4-bit" if fit else "plain"
            return (f"reading the {L} layers of {name} again to store them {form}"
                    + (f", their 4-bit codes fitted by GPTQ on {n} calibration sequences" if passing and fit else
                       f", recording the 4-bit KV cache's K/V centers on {n} calibration sequences" if passing
                       else ""))
        parts = [f"moving {moves} weight layer(s) to other tiers"] if moves else []
        if observe:
            parts.append(f"recording each layer's K/V centers for the 4-bit KV cache: a pass of "
                         f"{len(self._calibration(False))} calibration sequences through the {L} layers")
        return "; ".join(parts)

    def _ask(self, hook: Callable[[BlockInfo], HookAnswer], block: int) -> tuple[Policy, str, Any] | None:
        """Call a between-blocks hook; a change of what the runner places comes back, else None."""
        answer = hook(BlockInfo(block, self._clock(), self.policy, dict(self.planned_peak_bytes),
                                dict(self.capacity_bytes) if self.capacity_bytes is not None else None))
        if answer is None:
            return None
        policy, reason, *rest = answer
        caps = dict(rest[0]) if rest and rest[0] is not None else None
        if rounded_policy(policy, self.spec.num_layers) == self.rounded:
            if caps is not None:  # a new budget the placement already meets: enforce it from now on
                _refuse_over_capacity(self.planned_peak_bytes, caps)
                self.capacity_bytes = caps
            return None
        return policy, reason, caps

    # ----------------------------------------------------------------- accounting
    def _clock(self) -> float:
        return time.perf_counter() - self._t0

    def _on_copy(self, channel: str, start: float, end: float, nbytes: int) -> None:
        with self._lock:
            self.busy_s[channel] += end - start
            if self.record_trace:
                self.events.append(TraceEvent(channel, channel, start - self._t0, end - start, {"bytes": nbytes}))

    def _busy(self, resource: str, name: str, start: float, args: dict[str, Any], end: float | None = None,
              minus_s: float = 0.0) -> None:
        """Book ``start``..``end`` (default: now) as busy ``resource``, less ``minus_s`` (host work
        inside it, booked elsewhere), and as a trace event."""
        end = time.perf_counter() if end is None else end
        with self._lock:
            self.busy_s[resource] += end - start - minus_s
            if self.record_trace:
                self.events.append(TraceEvent(resource, name, start - self._t0, end - start, args))

    def _submit(self, queue: int, fn: Callable[[], None]) -> Future:
        """Run ``fn`` on I/O queue ``queue`` (0 weights, 1 loads, 2 stores), or inline without overlap.

        With ``cuda_sync="step"`` a queued task's copies first wait, on the device, for the compute
        queued so far (the producer of its rows, the last reader of its slot), and the compute
        thread yields the GIL so that the task starts now rather than at the next switch interval
        (it holds the GIL while it launches kernels, and no longer blocks in a synchronisation)."""
        if self.overlap:
            ev = self._last_ev
            if ev is None:
                return self._pools[queue].submit(fn)

            def after() -> None:
                with self.store.after(ev):
                    fn()
            fut = self._pools[queue].submit(after)
            time.sleep(0)
            return fut
        fn()
        return _done()

    # ----------------------------------------------------------------- weights
    def _fetch(self, layer: int, slot: int) -> None:
        """The weights queue's part of fetching ``layer`` into stage slot ``slot``.

        On CUDA the whole path runs here (disk -> relay -> device on the copy stream). On a CPU
        host a disk record is read straight into the stage slot (host RAM either way, see
        ``TierStore._host_side``); a cpu-tier layer's cpu -> "gpu" copy is a memcpy on the compute
        cores (the cost model puts ctog in the compute group there), so :meth:`_weights` does it
        on the compute thread instead of a concurrent copy slowing every kernel down.
        """
        home = self.w_home[layer]
        relay = self.w_relays[slot % len(self.w_relays)] if self.w_relays else None
        if self.device.type == "cuda":
            tier = "disk" if isinstance(home, DiskSlice) else "cpu"
            self.store.copy(Ref("gpu", self.w_stage[slot]), Ref(tier, home), relay=relay)
            return
        if isinstance(home, DiskSlice):
            self.store.copy(Ref("gpu", self.w_stage[slot]), Ref("disk", home))
        else:
            self._to_stage[layer] = home

    def _start_fetch(self, layer: int) -> bool:
        """Fetch ``layer`` into a stage slot not holding the layer being computed."""
        free = [k for k, held in enumerate(self.w_slot_layer) if held is None or held != self._current_layer]
        if not free:
            return False
        slot = free[self._fetches % len(free)]
        self._fetches += 1
        self.w_slot_layer[slot] = layer
        self._wfutures[layer] = self._submit(0, lambda: self._fetch(layer, slot))
        return True

    def _forget_fetch(self, layer: int) -> None:
        """The slot meant for ``layer`` does not hold it (its fetch failed): free it for any layer."""
        if layer in self.w_slot_layer:
            self.w_slot_layer[self.w_slot_layer.index(layer)] = None
        self._to_stage.pop(layer, None)

    def _settle_fetches(self) -> None:
        """Wait for the weight fetches still queued (a run's last step prefetches the next step's
        first two layers, which outlive the run: a change of policy waits for their reads) and
        forget the slot of any that failed, so that a later step fetches that layer again: its
        error belonged to no step, and its slot held other bytes."""
        for layer, fut in list(self._wfutures.items()):
            del self._wfutures[layer]
            try:
                fut.result()
            except Exception:
                self._forget_fetch(layer)

    def _prefetch(self, layer: int) -> None:
        """Start fetching ``layer`` while the current one computes (overlap only)."""
        if self.overlap and self.layer_tier[layer] != "gpu" and layer not in self.w_slot_layer:
            self._start_fetch(layer)

    def _after_layer(self, layer: int) -> None:
        """``layer`` has computed for every GPU batch, so its stage slot is free: queue the fetch of
        the layer after the next one now, rather than when the next one starts (which waits for
        its own fetch first). The weights queue then reads on through the LM head and the step's
        end, where it used to idle (2-core VM, 12 disk layers of 48 MiB: about 40 ms a step)."""
        nxt = (layer + 1) % self.spec.num_layers
        if self.layer_tier[nxt] == "gpu" or nxt in self.w_slot_layer:  # (else nxt still needs a slot)
            self._current_layer = nxt
            self._prefetch((layer + 2) % self.spec.num_layers)

    def _weights(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s weights on the gpu tier: its home, or a stage slot (fetched now if needed)."""
        if self.layer_tier[layer] == "gpu":
            flat, key = self.w_home[layer], ("home", layer)
        else:
            if layer not in self.w_slot_layer:
                self._current_layer = -1  # nothing computes between layers: any slot may be reused
                self._start_fetch(layer)
                self._current_layer = layer
            fut = self._wfutures.pop(layer, None)
            if fut is not None:
                try:
                    fut.result()
                except BaseException:
                    self._forget_fetch(layer)  # (the slot claimed the layer: a later run computed with stale bytes)
                    raise
            slot = self.w_slot_layer.index(layer)
            flat, key = self.w_stage[slot][:self.layout.nbytes], ("stage", slot)
            src = self._to_stage.pop(layer, None)
            if src is not None:
                self.store.copy(Ref("gpu", flat), Ref("cpu", src))
        if not self.layout.compress:  # plain weights are views at fixed offsets of their buffer
            views = self._views.get(key)
            if views is None:
                views = self._views[key] = self.layout.unpack(flat, None)
            return views
        start = self._tick()
        w = self.layout.unpack(flat, self.w_dequant)
        self._tock(start, "dequant_weights", {"layer": layer})
        w.on_expert = lambda thunk: self._expert_dequant(layer, thunk)
        return w

    def _expert_dequant(self, layer: int, thunk: Callable[[], Any]) -> Any:
        """Dequantize a routed expert's weights when a batch first reaches it, inside the layer's
        compute: booked as dequantization, and left out of the layer's compute interval. With
        ``cuda_sync="step"`` the kernels stay in the layer's device-timed interval."""
        if self.device.type == "cuda" and self.cuda_sync == "step":
            return thunk()
        self._sync()  # the layer's kernels queued so far are compute, not this
        start = time.perf_counter()
        out = thunk()
        self._sync()
        end = time.perf_counter()
        self._busy("compute", "dequant_weights", start, {"layer": layer, "expert": True}, end=end)
        self._inner_dequant_s += end - start
        return out

    # ----------------------------------------------------------------- row groups
    def _groups(self, split: list[tuple[str, int, int]], slots: list[int]) -> list[tuple[str, list[int], list[int]]]:
        """(tier, positions in ``slots``, tier-local row indices) for each tier with rows."""
        out = []
        for tier, start, n in split:
            pos = [i for i, s in enumerate(slots) if start <= s < start + n]
            if pos:
                out.append((tier, pos, [slots[i] - start for i in pos]))
        return out

    def _offloaded(self, split: list[tuple[str, int, int]], slots: list[int]) -> list[tuple[str, int, list[int]]]:
        """(tier, first stage row, tier-local rows) for the offloaded groups, in stage-row order."""
        out, k = [], 0
        for tier, _pos, rows in self._groups(split, slots):
            if tier != "gpu":
                out.append((tier, k, rows))
                k += len(rows)
        return out

    # ----------------------------------------------------------------- I/O tasks
    def _load(self, layer: int, work: _Work, slot: int, decode: bool) -> None:
        """Bring a GPU batch's offloaded hidden states (layer > 0) and KV context (decode) in."""
        st, t, cuda = self.store, work.t, self.device.type == "cuda"
        acts = self.act_home[work.batch]
        if layer > 0:
            for tier, k0, rows in self._offloaded(self.act_split, work.slots):
                if tier == "cpu":
                    for k, r, m in _runs(rows, nbytes_of(acts["cpu"][0, :t]), cuda):
                        st.copy(Ref("gpu", self.act_stage[slot][k0 + k:k0 + k + m, :t]),
                                Ref("cpu", acts["cpu"][r:r + m, :t]))
                    continue
                for k, r in enumerate(rows):
                    st.copy(Ref("gpu", self.act_stage[slot][k0 + k, :t]),
                            Ref("disk", acts["disk"].row(r).span(0, t)), relay=self.act_relay[0][0])
        if not decode:
            return
        b, c = work.first_col(self.layer_specs[layer].sliding_window), work.col
        homes = self.kv_home[work.batch][layer]
        for tier, k0, rows in self._offloaded(self.cache_split, work.slots):
            for part, (home, stage) in enumerate(zip(homes[tier], self.kv_stage[slot] if self.kv_stage else
                                                      [None] * len(homes[tier]))):
                if tier == "cpu":
                    if not self.policy.cpu_attention:  # (CPU attention reads the cpu tier in place)
                        for k, r, m in _runs(rows, nbytes_of(home[0, b:c]), cuda):
                            st.copy(Ref("gpu", stage[k0 + k:k0 + k + m, :, :c - b].transpose(1, 2)),
                                    Ref("cpu", home[r:r + m, b:c]))
                    continue
                for k, r in enumerate(rows):
                    if self.policy.cpu_attention:  # CPU attention reads the context in the relay
                        st.copy(Ref("cpu", self.kv_relay[0][part][k][:c - b]), Ref("disk", home.row(r).span(b, c)))
                    else:
                        st.copy(Ref("gpu", stage[k0 + k, :, :c - b].transpose(0, 1)),
                                Ref("disk", home.row(r).span(b, c)), relay=self.kv_relay[0][part][k])

    def _store(self, layer: int, work: _Work, slot: int, decode: bool, store_act: bool) -> None:
        """Write a GPU batch's new KV entries and (for the next layer) hidden states out."""
        st, t, cuda = self.store, work.t, self.device.type == "cuda"
        if store_act:
            acts = self.act_home[work.batch]
            for tier, k0, rows in self._offloaded(self.act_split, work.slots):
                if tier == "cpu":
                    for k, r, m in _runs(rows, nbytes_of(acts["cpu"][0, :t]), cuda):
                        st.copy(Ref("cpu", acts["cpu"][r:r + m, :t]),
                                Ref("gpu", self.act_stage[slot][k0 + k:k0 + k + m, :t]))
                    continue
                for k, r in enumerate(rows):
                    st.copy(Ref("disk", acts["disk"].row(r).span(0, t)), Ref("gpu", self.act_stage[slot][k0 + k, :t]),
                            relay=self.act_relay[1][0])
        homes = self.kv_home[work.batch][layer]
        c0 = work.col
        width = 1 if decode else t
        src_col = (work.col - work.first_col(self.layer_specs[layer].sliding_window)) if decode else 0
        for tier, k0, rows in self._offloaded(self.cache_split, work.slots):
            for part, home in enumerate(homes[tier]):
                if decode and self.policy.cpu_attention:
                    # the compute wrote the new column into the cpu tier, or into the store relay
                    for k, r in enumerate(rows if tier == "disk" else ()):
                        st.copy(Ref("disk", home.row(r).span(c0, c0 + 1)), Ref("cpu", self.kv_relay[1][part][k][:1]))
                    continue
                src = self.kv_stage[slot][part][:, :, src_col:src_col + width]
                if tier == "cpu":
                    for k, r, m in _runs(rows, nbytes_of(home[0, c0:c0 + width]), cuda):
                        st.copy(Ref("cpu", home[r:r + m, c0:c0 + width]),
                                Ref("gpu", src[k0 + k:k0 + k + m].transpose(1, 2)))
                    continue
                for k, r in enumerate(rows):
                    st.copy(Ref("disk", home.row(r).span(c0, c0 + width)), Ref("gpu", src[k0 + k].transpose(0, 1)),
                            relay=self.kv_relay[1][part][k])

    # ----------------------------------------------------------------- compute
    def _hidden_in(self, layer: int, work: _Work, slot: int) -> torch.Tensor:
        if layer == 0:
            return embed(self.spec, self.head, work.ids, work.pos)
        t, parts = work.t, []
        acts = self.act_home[work.batch]
        k0 = 0
        for tier, pos, rows in self._groups(self.act_split, work.slots):
            if tier == "gpu":
                parts.append(_take(acts["gpu"], rows)[:, :t])
            else:
                parts.append(self.act_stage[slot][k0:k0 + len(rows), :t])
                k0 += len(rows)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _hidden_out(self, work: _Work, hidden: torch.Tensor, slot: int) -> None:
        t = work.t
        acts = self.act_home[work.batch]
        k0 = 0
        for tier, pos, rows in self._groups(self.act_split, work.slots):
            src = _take(hidden, work.computed(pos))
            if tier == "gpu":
                if is_range(rows):
                    acts["gpu"][rows[0]:rows[0] + len(rows), :t] = src
                else:
                    acts["gpu"][_index(rows, self.device), :t] = src
            else:
                self.act_stage[slot][k0:k0 + len(rows), :t] = src
                k0 += len(rows)

    def _put_cols(self, parts: list[torch.Tensor], rows: list[int], c0: int, new: list[torch.Tensor],
                  tier: str = "gpu") -> None:
        """Write ``new`` (``[rows, hkv, width, ...]``) at positions ``c0:`` of ``rows`` of a tier's
        KV home (positions-major off the gpu tier: ``_alloc_buffers``)."""
        for dst, src in zip(parts, new):
            if tier != "gpu":
                src = src.transpose(1, 2)
            view = dst.narrow(_kv_time_dim(tier), c0, src.shape[_kv_time_dim(tier)])
            if is_range(rows):
                view[rows[0]:rows[0] + len(rows)] = src
            else:
                view.index_copy_(0, _index(rows, dst.device), src.to(dst.device))

    def _compute(self, layer: int, work: _Work, w: dict[str, torch.Tensor], slot: int, decode: bool,
                 last: bool) -> torch.Tensor | None:
        """One layer for one GPU batch; returns the last position's hidden state after the last layer."""
        spec, led = self.layer_specs[layer], self.ledger
        start = self._tick()
        hidden, pos, mask = self._hidden_in(layer, work, slot), work.pos, work.mask
        if work.share is not None:
            first = work.share[0]
            hidden, pos, mask = _take(hidden, first), _take(pos, first), None if mask is None else _take(mask, first)
        prefix = None if decode else work.prefix
        if prefix is None:
            q, k, v = attn_in(spec, w, hidden, pos, self.ropes[layer])
        else:
            # its q/k/v, attention and MLP in turn; the plain layer's largest (MLP) working set bounds them
            taken = self._sources(layer, prefix)
            copies = sum(e.nbytes for i, e in taken.items() if i not in self._held) if self.device.type == "cuda" else 0
            with led.transient("gpu", "prefix", 2 * nbytes_of(hidden) + nbytes_of(hidden) // spec.hidden * spec.q_dim
                               + copies):
                shared, k, v, lent = prefill_layer(spec, w, hidden, pos, mask, self.ropes[layer], prefix,
                                                   sinks=w.get("sinks.weight"), held=taken)
            del taken
            stores = {ident for _g, ident in prefix.share.stores}
            for ident, results in lent.items():  # kept until the last batch taking them has computed
                if ident in stores:  # kept for the run's later prefills
                    self._keep(layer, ident, results)
                else:
                    led.add("gpu", "prefix_held", results.nbytes)
                    self._held[ident] = results
            self._release_held(prefix.share.releases)
            q = k.new_empty(0)
        n, t = hidden.shape[0], hidden.shape[1]
        homes = self.kv_home[work.batch][layer]
        cpu_s, inner0 = 0.0, self._inner_dequant_s
        # Working sets are accounted phase by phase (CostModel.memory transients: one at a time).
        with led.transient("gpu", "qkv", nbytes_of(hidden, q, k, v)):
            pass
        if not decode:
            if prefix is None:
                with led.transient("gpu", "attention", 2 * nbytes_of(q) + nbytes_of(k, v)):
                    attn = attention(spec, q, k, v, mask, causal=True, sinks=w.get("sinks.weight"))
            enc = self.codec.encode(k, v, layer)
            k_off = 0
            for tier, at, rows in self._groups(self.cache_split, work.slots):
                sel = [_take(e, work.computed(at)) for e in enc]
                if tier == "gpu":
                    self._put_cols(homes["gpu"], rows, work.col, sel)
                else:  # to the stage slot; the store queue takes it home
                    for dst, src in zip(self.kv_stage[slot], sel):
                        dst[k_off:k_off + len(rows), :, :t] = src
                    k_off += len(rows)
        else:
            attn = torch.empty((n, 1, spec.q_dim), dtype=self.dtype, device=self.device)
            cpu_s = self._decode_attention(layer, work, homes, q, k, v, attn, slot, w.get("sinks.weight"))
        del q, k, v
        if prefix is None:
            with led.transient("gpu", "mlp", 2 * nbytes_of(hidden) + nbytes_of(attn)):
                hidden = attn_out_mlp(spec, w, attn, hidden)
        else:
            hidden = shared
        out = None
        if last:
            out = hidden[:, -1]
        else:
            self._hidden_out(work, hidden, slot)
        self._tock(start, "decode" if decode else "prefill",
                   {"layer": layer, "batch": work.batch, "rows": n,
                    "length": work.col + 1 - work.first_col(spec.sliding_window) if decode else t,
                    **({} if prefix is None else {"positions": prefix.positions})},
                   minus_s=cpu_s + self._inner_dequant_s - inner0)
        return out

    def _decode_attention(self, layer: int, work: _Work, homes: dict[str, list[Any]], q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, attn: torch.Tensor, slot: int,
                          sinks: torch.Tensor | None = None) -> float:
        """Attention of one new token per row, tier group by tier group; returns CPU-attention
        seconds. ``sinks``: the layer's attention sinks (GPT-OSS)."""
        spec, led, codec = self.layer_specs[layer], self.ledger, self.codec
        b, c = work.first_col(spec.sliding_window), work.col
        T1 = c + 1 - b
        work_mask, work_cpu_mask = work.context_mask(spec.sliding_window), work.context_mask(spec.sliding_window, True)
        k, v = codec.prepare(k, v, layer)  # once: the cache stores them, and they attend as the own K/V
        enc = codec.pack(k, v)
        cpu_s, k_off = 0.0, 0
        for tier, pos, rows in self._groups(self.cache_split, work.slots):
            qs = _take(q, pos)
            new = [_take(e, pos) for e in enc]
            own = (_take(k, pos), _take(v, pos))
            mask = _take(work_mask, pos)
            full = bool(_take(work_cpu_mask, pos).all())  # read on the host: no wait for the device
            span = None
            if tier == "gpu":
                self._put_cols(homes["gpu"], rows, c, new)
                span = None if codec.compress else attention_span(rows)
                if span is None:
                    ctx = [_take(part[:, :, b:c + 1], rows) for part in homes["gpu"]]
                else:  # the slots from the first row to the last attend in place; the others' outputs are dropped
                    ctx = [part[span[0]:span[1], :, b:c + 1] for part in homes["gpu"]]
                    qs, mask, at = _spread(span, rows, qs, mask)
            elif not self.policy.cpu_attention:
                stage = [s[k_off:k_off + len(rows)] for s in self.kv_stage[slot]]
                for dst, src in zip(stage, new):
                    dst[:, :, T1 - 1:T1] = src
                ctx = [s[:, :, :T1] for s in stage]
                k_off += len(rows)
            else:
                cpu_s += self._cpu_attention(spec, tier, work, homes, qs, new, pos, rows, attn, sinks)
                continue
            # the query and output (split into even and odd channels, in float32, when fused), a
            # gathered context, and a half-precision cache's mins and scales in float32 for the kernel
            scratch = (8 * 4 * qs.numel() if codec.fused else 2 * nbytes_of(qs)) + (0 if span else nbytes_of(*ctx))
            if codec.fused and self.dtype != torch.float32:
                scratch += sum(4 * x.numel() for part in (ctx[1:3], ctx[4:6]) for x in part)
            with led.transient("gpu", "attention_decode", scratch):
                out = codec.attend_stored(spec, qs, ctx, own, None if full else mask, self.kv_dequant,
                                          layer, sinks)
            if span:
                out = out.index_select(0, at)
            self._put_rows(attn, pos, out)
        return cpu_s

    def _put_rows(self, dst: torch.Tensor, pos: list[int], src: torch.Tensor) -> None:
        if is_range(pos):
            dst[pos[0]:pos[0] + len(pos)] = src
        else:
            dst.index_copy_(0, _index(pos, dst.device), src)

    def _cpu_attention(self, spec: ModelSpec, tier: str, work: _Work, homes: dict[str, list[Any]], q: torch.Tensor,
                       new: list[torch.Tensor], pos: list[int], rows: list[int], attn: torch.Tensor,
                       sinks: torch.Tensor | None = None) -> float:
        """FlexGen §4.2: rows whose cache is not on the gpu tier attend on the CPU, next to their
        cache. ``spec``: the layer's (its window and softcap)."""
        st, led = self.store, self.ledger
        b, c = work.first_col(spec.sliding_window), work.col
        T1 = c + 1 - b
        cpu = torch.device("cpu")
        qc = torch.empty(q.shape, dtype=q.dtype, device=cpu)
        newc = [torch.empty(x.shape, dtype=x.dtype, device=cpu) for x in new]
        st.copy(Ref("cpu", qc), Ref("gpu", q))
        for dst, src in zip(newc, new):
            st.copy(Ref("cpu", dst), Ref("gpu", src))
        t0 = time.perf_counter()
        mask = _take(work.context_mask(spec.sliding_window, cpu=True), pos)
        span = None
        if tier == "cpu":
            self._put_cols(homes["cpu"], rows, c, newc, tier="cpu")
            span = attention_span(rows)
            ctx = [part[:, b:c + 1] for part in homes["cpu"]]
            idx = rows
            if span is not None:  # in place over the span, as on the gpu tier (same cache layout)
                ctx = [x[span[0]:span[1]] for x in ctx]
                idx = list(range(span[1] - span[0]))
                qc, mask, at = _spread(span, rows, qc, mask)
        else:  # disk rows: the load queue read their context into the load relay
            if self._item >= 1:
                self._store_done[self._item - 1].result()  # the store relay is free again
            ctx = []
            for part, src in enumerate(newc):
                relay = self.kv_relay[0][part][:len(rows)]
                relay[:, T1 - 1] = src[:, :, 0]
                self.kv_relay[1][part][:len(rows), :1] = src.transpose(1, 2)  # the store queue writes it
                ctx.append(relay[:, :T1])
            idx = list(range(len(rows)))
        with led.transient("cpu", "cpu_attention", 2 * nbytes_of(qc) + nbytes_of(*newc)
                           + self._cpu_attention_scratch(qc, ctx, idx)):
            out = attend_rows_on_cpu(spec, qc, ctx, idx, mask, CPU_ATTENTION_CHUNK_BYTES,
                                     sinks=None if sinks is None else sinks.cpu())  # (one logit per head)
        if span:
            out = out.index_select(0, at)
        cpu_s = time.perf_counter() - t0
        self._busy("cpu_compute", "cpu_attention", t0, {"batch": work.batch, "rows": len(rows)})
        res = torch.empty(out.shape, dtype=out.dtype, device=self.device)
        st.copy(Ref("gpu", res), Ref("cpu", out))
        self._put_rows(attn, pos, res)
        return cpu_s

    @staticmethod
    def _cpu_attention_scratch(qc: torch.Tensor, ctx: list[torch.Tensor], idx: list[int]) -> float:
        """Bytes :func:`attend_rows_on_cpu` allocates for this call (``cpu_attention_scratch_bytes``)."""
        m = cpu_attention_chunk_rows(qc, ctx, idx, CPU_ATTENTION_CHUNK_BYTES)
        _rows, T, hkv, d = ctx[0].shape
        return cpu_attention_scratch_bytes(len(idx), T, hkv * d, qc.shape[1] * qc.shape[3], qc.shape[1],
                                           qc.element_size(), in_place=m == 0, chunk_bytes=CPU_ATTENTION_CHUNK_BYTES)

    def _sync(self) -> None:
        """Wait for the compute stream's kernels (not the copy streams': their own tasks wait for
        those) and book the compute intervals they ended."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            if self.cuda_sync == "step":
                self._book_pending()

    def _tick(self) -> tuple[float, Any]:
        """The start of a compute interval: host time, and with ``cuda_sync="step"`` an event
        queued on the stream."""
        if self.device.type != "cuda" or self.cuda_sync == "item":
            return time.perf_counter(), None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return time.perf_counter(), ev

    def _tock(self, start: tuple[float, Any], name: str, args: dict[str, Any], minus_s: float = 0.0) -> None:
        """The end of a compute interval, booked as busy ``compute`` (less ``minus_s``, host work in it
        booked elsewhere) and as a trace event.

        On a CPU it is booked now. On CUDA with ``cuda_sync="item"`` (the default) the host first
        waits for the device, which also makes every I/O task submitted afterwards see the item's
        output complete; the GPU then idles while Python launches the next item's kernels (H100,
        OPT-1.3B shape, weights on cpu: compute busy 0.95 s where the in-memory loop took 0.39 s).
        With ``"step"`` an end event is queued and the interval is booked from the two events at
        the step's one wait (:meth:`_sync`); I/O tasks wait for the latest such event on the device
        instead (:meth:`_submit`). Its one measurement (stop 31) was slower; see docs/BENCHMARKS.md.
        """
        if start[1] is None:
            self._sync()
            self._busy("compute", name, start[0], args, minus_s=minus_s)
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._last_ev = ev
        self._pending.append((start, ev, name, args, minus_s))

    def _book_pending(self) -> None:
        """Book the queued CUDA intervals (the stream is idle): device durations, placed on the host
        clock through the anchor event recorded at the last idle instant."""
        pending, self._pending, anchor = self._pending, [], self._anchor
        for (h0, e0), e1, name, args, minus_s in pending:
            t0 = anchor[0] + anchor[1].elapsed_time(e0) / 1e3 if anchor is not None else h0
            self._busy("compute", name, t0, args, end=t0 + e0.elapsed_time(e1) / 1e3, minus_s=minus_s)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._anchor, self._last_ev = (time.perf_counter(), ev), None

    # ----------------------------------------------------------------- the one loop
    def _step(self, works: list[_Work], decode: bool) -> list[torch.Tensor]:
        """One prefill or decode step over the block (FlexGen Alg. 1); returns logits per work.

        Item ``j`` = (layer, GPU batch) in loop order. While item ``j`` computes, the load queue
        fills stage slot ``(j + 1) % 2`` for item ``j + 1`` (after the store of item ``j - 1``,
        the slot's last user, and of item ``j + 1 - nb``, which produced its input) and the store
        queue drains item ``j - 1``. Without overlap the same tasks run inline, in order.

        The LM head runs once, after the last layer, over every batch's last hidden state
        (``hidden_last``): one product reads the matrix once per step, not once per GPU batch
        (2-core VM, ``benchmarks/roofline.py``'s 8 rows in two batches: 30 ms a step where two took 52),
        and the weights queue reads the next step's first layers meanwhile (:meth:`_after_layer`).
        """
        L, nb = self.spec.num_layers, len(works)
        items = [(l, i) for l in range(L) for i in range(nb)]
        # A batch with every row's KV and hidden state on the gpu tier loads and stores nothing:
        # its tasks are not queued, so its compute does not wait on two thread hand-offs.
        moves = [bool(self._offloaded(self.act_split, w.slots) or self._offloaded(self.cache_split, w.slots))
                 for w in works]
        store_done = [Future() for _ in items]
        compute_done = [threading.Event() for _ in items]
        self._store_done, self._item = store_done, 0
        loads: dict[int, Future] = {}
        logits: list[torch.Tensor | None] = [None] * nb
        outs: list[tuple[int, int, int]] = []  # (batch, first row, rows) of each batch's hidden_last rows

        def load(j: int) -> Future:
            """Queue item ``j``'s load task (a done future for a batch with nothing to move)."""
            l, i = items[j]
            if not moves[i]:
                return _done()

            def run() -> None:
                for dep in (j - 2, j - nb):
                    if dep >= 0:
                        store_done[dep].result()
                if self.policy.cpu_attention and j >= 1:
                    compute_done[j - 1].wait()  # CPU attention of item j-1 reads the load relay
                with self.store.deferred_sync():
                    self._load(l, works[i], j % 2, decode)
            return self._submit(1, run)

        def store(j: int) -> None:
            """Queue item ``j``'s store task (``store_done[j]`` is settled at once if nothing moves)."""
            l, i = items[j]
            if not moves[i]:
                _settle(store_done[j], None)
                return

            def run() -> None:
                try:
                    with self.store.deferred_sync():
                        self._store(l, works[i], j % 2, decode, store_act=l < L - 1)
                    _settle(store_done[j], None)
                except BaseException as exc:
                    _settle(store_done[j], exc)
                    raise
            self._submit(2, run)

        try:
            w: dict[str, torch.Tensor] = {}
            for j, (l, i) in enumerate(items):
                self._gate.check()  # (a Ctrl-C raises here, between items, not inside a queue's lock)
                if i == 0:
                    self._current_layer = l
                    w = self._weights(l)
                    self._prefetch((l + 1) % L)
                if j not in loads:
                    loads[j] = load(j)
                if self.overlap and j + 1 < len(items):
                    loads[j + 1] = load(j + 1)
                loads.pop(j).result()
                self._item = j
                out = self._compute(l, works[i], w, j % 2, decode, last=l == L - 1)
                compute_done[j].set()
                if out is not None:
                    k = outs[-1][1] + outs[-1][2] if outs else 0
                    self.hidden_last[k:k + out.shape[0]].copy_(out)
                    outs.append((i, k, out.shape[0]))
                store(j)
                if i == nb - 1:
                    self._after_layer(l)
            if outs:
                whole = self._head(self.hidden_last[:outs[-1][1] + outs[-1][2]])
                for i, k, n in outs:
                    logits[i] = whole[k:k + n] if works[i].share is None else _take(whole[k:k + n], works[i].share[1])
            for f in store_done:
                f.result()
            for f in loads.values():
                f.result()
            self._sync()  # the step's one wait for its kernels; books their intervals
        finally:  # never leave a load task waiting after an error (close() joins the queues)
            self._release_held(list(self._held))  # (each layer releases its own; an error leaves some)
            for e in compute_done:
                e.set()
            for f in store_done:
                _settle(f, RuntimeError("step aborted"))
        return [x for x in logits if x is not None]

    def _release_held(self, ids: Sequence[int]) -> None:
        for ident in ids:
            self.ledger.sub("gpu", "prefix_held", self._held.pop(ident).nbytes)

    def _sources(self, layer: int, plan: PrefixPlan) -> dict[int, Held]:
        """The held and cached prefix results ``plan`` takes in ``layer`` (cached ones on the
        compute device: on CUDA a copy for this layer, within ``prefix_held``'s room)."""
        kept = self._cache.layers.get(layer, {})
        out = {}
        for src in plan.share.sources:
            if src is None or src in out:
                continue
            if src in self._held:
                out[src] = self._held[src]
            else:
                e = kept[src]
                out[src] = e if self.device.type != "cuda" else \
                    Held(None, e.k.to(self.device, non_blocking=True), e.v.to(self.device, non_blocking=True))
        return out

    def _keep(self, layer: int, ident: int, results: Held) -> None:
        """Keep one layer's keys and values of a prefix in the run's cache (cpu tier)."""
        k, v = results.k, results.v
        if self.device.type == "cuda":  # one copy each, straight into pinned memory
            k, v = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in (k, v))
        entry = Held(None, k, v)
        self.ledger.add("cpu", "prefix_cache", entry.nbytes)
        self._cache.layers.setdefault(layer, {})[ident] = entry

    def _clear_cache(self) -> None:
        """Forget the run's kept prefixes (a new run, or new weights or policy)."""
        for entries in self._cache.layers.values():
            for entry in entries.values():
                self.ledger.sub("cpu", "prefix_cache", entry.nbytes)
        self._cache = PrefixCache(self.cache_positions if self.share_prefixes and self.prefix_cache else 0)

    def _head(self, hidden_last: torch.Tensor) -> torch.Tensor:
        with self.ledger.transient("gpu", "logits", nbytes_of(hidden_last) + hidden_last.shape[0] *
                                   self.spec.vocab_size * 4):
            start = self._tick()
            logits = final_logits(self.spec, self.head, hidden_last)
            self._tock(start, "head", {})
            return logits

    # ----------------------------------------------------------------- job
    def run(self, requests: Iterable[Request], on_finished: Callable[[list[Finished]], None] | None = None,
            on_step: Callable[[int], None] | None = None,
            between_blocks: Callable[[BlockInfo], HookAnswer] | None = None) -> EngineStats:
        """Generate for every request (consumed lazily, in order); see the module docstring.

        ``between_blocks`` is called at every block boundary (``refill_every == 0``: after each
        block drained; with refill: after each refill interval) while requests remain. Returning
        ``(policy, reason)`` (optionally ``(policy, reason, capacity_bytes)``, a new budget to
        enforce) stops admission, lets the rows in flight finish under the old policy, then
        :meth:`reconfigure` s and goes on with the remaining requests in order.
        """
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._running:
            raise RuntimeError("run() is already running on this engine: a callback may not start another run "
                               "(its rows would overwrite the running one's caches)")
        if self._broken is not None:
            raise RuntimeError(self._broken)
        self._settle_fetches()
        queue = _Queue(requests)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t0 = time.perf_counter()
        self._pending, self._anchor = [], None
        self._sync()  # an idle stream: the anchor of the run's CUDA compute intervals
        with self._lock:
            self.busy_s = {r: 0.0 for r in RESOURCES}
            self.events = []
            self.markers = []
        # The peak since the policy in force took effect (the engine's setup, or the last change) counts
        # for this run: its plan is that policy's. The ledger's lifetime peak would carry older policies'.
        peak = self.ledger.reset_window()
        first_change = len(self.reconfigurations)
        self.stats = EngineStats(0.0, 0, 0, 0, 0, 0, {}, dict(self.planned_peak_bytes), {}, [], [])
        self._ids: set[Any] = set()  # a run's request ids: two alike share a sampling stream and a result
        self._clear_cache()
        boundary = 0
        self._running = True
        try:
            with torch.inference_mode(), _SignalGate() as self._gate:
                while True:
                    p = self.policy
                    gbs, nb, R = p.gbs, p.nb, p.refill_every
                    batches = [_Batch([None] * gbs, torch.zeros((gbs, self.cap), dtype=torch.bool)) for _ in range(nb)]
                    first, change = True, None
                    while True:
                        joining: list[tuple[int, Request]] = []
                        if change is None and (first or R > 0):
                            free = [s for s in range(gbs * nb) if batches[s // gbs].rows[s % gbs] is None]
                            reqs = [self._check(r) for r in queue.take(len(free))]
                            if p.bucket:
                                reqs = self._bucket(reqs, [s // gbs for s in free[:len(reqs)]])
                            joining = list(zip(free, reqs))
                        first = False
                        if not joining and not any(b.active() for b in batches):
                            break
                        self._in_flight = True
                        finished: list[Finished] = []
                        if joining:
                            self._prefill(batches, joining, finished, on_step)
                        steps = 0
                        while (R == 0 or steps < R) and any(b.active() for b in batches):
                            self._decode(batches, finished, on_step)
                            steps += 1
                        self._in_flight = any(b.active() for b in batches)
                        if on_finished is not None:  # every interval, so a caller can flush per block
                            on_finished(finished)
                        if R > 0 and change is None and between_blocks is not None and not queue.empty():
                            change = self._ask(between_blocks, boundary)
                            boundary += 1
                    self._in_flight = False
                    if queue.empty():
                        break
                    if R == 0 and between_blocks is not None:
                        change = self._ask(between_blocks, boundary)
                        boundary += 1
                    if change is not None:
                        self.reconfigure(change[0], change[1], change[2])
        except BaseException:
            # The run's rows end with it. Once the I/O queues have done the tasks it queued (nothing
            # writes its buffers afterwards), the engine may be reconfigured or run again.
            with _SignalGate():  # (a second Ctrl-C waits for the drain, as in close())
                for pool in self._pools:
                    pool.submit(lambda: None).result()
                self._in_flight = False
                self._reset_fetch_state()  # (a failed fetch's slot held other bytes than its claim)
            raise
        finally:
            self._running = False
            self._clear_cache()
        s = self.stats
        s.wall_s = self._clock()
        s.peak_bytes_since_change = dict(self.ledger.window_peak)
        for window in [s.peak_bytes_since_change] + [w for rec in self.reconfigurations[first_change:]
                                                     for w in (rec.peak_before_bytes, rec.transition_peak_bytes)]:
            peak = {t: max(peak[t], window[t]) for t in TIERS}
        s.peak_bytes = peak
        if self.device.type == "cuda":
            s.device_reserved_peak_bytes = int(torch.cuda.max_memory_reserved(self.device))
        s.busy_s = dict(self.busy_s)
        s.events = list(self.events)
        s.markers = list(self.markers)
        s.reconfigurations = self.reconfigurations[first_change:]
        for rec in s.reconfigurations:  # the plan of every policy that was in force during the run
            s.planned_peak_bytes = {t: max(s.planned_peak_bytes[t], rec.planned_peak_bytes[t]) for t in TIERS}
        return s

    def _bucket(self, reqs: list[Request], batch_of: list[int]) -> list[Request]:
        """A block's joining requests sorted by prompt length (less padding), or in the order that
        puts prompts beginning alike into one GPU batch when that computes fewer positions."""
        reqs = sorted(reqs, key=lambda r: len(r.prompt_ids))
        if not (self.share_prefixes and self.order_by_prefix):
            return reqs
        order = prefix_order([r.prompt_ids for r in reqs], batch_of, self._hold_positions, self._cache)
        return reqs if order is None else [reqs[i] for i in order]

    @property
    def _hold_positions(self) -> int:
        """Prefix positions a block's GPU batches may hold for later ones (``CostModel.memory``'s
        ``prefix_held``: one prompt's worth)."""
        return self.max_prompt if self.share_prefixes and self.prefixes_across_batches else 0

    def _check(self, r: Request) -> Request:
        if r.id in self._ids:
            raise UserError(f"request id {r.id!r} is given twice in one run; ids must be unique")
        self._ids.add(r.id)
        if not r.prompt_ids:
            raise UserError(f"request {r.id}: empty prompt")
        if not isinstance(r.prompt_ids, tuple):  # a tokenizer's list: a tuple keys the prefix caches (hashable)
            r = replace(r, prompt_ids=tuple(int(t) for t in r.prompt_ids))
        # (was an IndexError deep in torch; `xsched run` checks its files' ids already, this is for library callers,
        # and min/max run in C: a per-token Python loop cost every admitted prompt its length in bytecode)
        if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.spec.vocab_size:
            bad = next(t for t in r.prompt_ids if not 0 <= t < self.spec.vocab_size)
            raise UserError(f"request {r.id}: token id {bad} is outside {self.spec.name}'s vocabulary "
                            f"0..{self.spec.vocab_size - 1}")
        if len(r.prompt_ids) > self.max_prompt:
            raise UserError(f"request {r.id}: prompt of {len(r.prompt_ids)} tokens is longer than the plan's max "
                            f"prompt {self.max_prompt}; re-plan for longer prompts or shorten it")
        if not 1 <= r.max_new_tokens <= self.max_output:
            raise UserError(f"request {r.id}: max_new_tokens {r.max_new_tokens} is outside 1..{self.max_output} "
                            "(the plan's max output)")
        return r

    def _prefill(self, batches: list[_Batch], joining: list[tuple[int, Request]], finished: list[Finished],
                 on_step: Callable[[int], None] | None) -> None:
        gbs = self.policy.gbs
        start = self._clock()
        works, distinct = [], []
        for j, batch in enumerate(batches):
            new = sorted((s % gbs, r) for s, r in joining if s // gbs == j)
            if not new:
                continue
            P = max(len(r.prompt_ids) for _s, r in new)
            if not batch.active():
                batch.end = 0
                batch.mask.zero_()
            end = max(batch.end, P)
            c0 = end - P
            ids, mask = left_pad([r.prompt_ids for _s, r in new])
            for i, (slot, r) in enumerate(new):
                n = len(r.prompt_ids)
                batch.rows[slot] = _Row(r, [], start, n_ctx=n, first_col=c0 + P - n,
                                        logprobs=[] if self.logprobs else None)
                batch.mask[slot] = False
                batch.mask[slot, c0:end] = mask[i]
            batch.end = end
            pos = position_ids_from_mask(mask)
            dev_mask = None if bool(mask.all()) else mask.to(self.device)
            prompts = [r.prompt_ids for _s, r in new]
            share = _repeats(prompts)
            distinct.append(prompts if share is None else [prompts[i] for i in share[0]])
            works.append(_Work(j, [s for s, _r in new], ids.to(self.device), pos.to(self.device), c0, c0, dev_mask,
                               share=share))
            self.stats.prompt_tokens += sum(len(r.prompt_ids) for _s, r in new)
        plans = (plan_block(distinct, self._hold_positions, self.device, self._cache) if self.share_prefixes
                 else [None] * len(works))
        for work, rows, prefix in zip(works, distinct, plans):
            work.prefix = prefix
            self.stats.padded_prompt_tokens += len(rows) * work.t if prefix is None else prefix.positions
        logits = self._step(works, decode=False)
        for ident in self._cache.drop_retired():  # replaced by a longer run of their tokens
            for entries in self._cache.layers.values():
                self.ledger.sub("cpu", "prefix_cache", entries.pop(ident).nbytes)
        self.stats.num_prefill_steps += 1
        self._finish_step(batches, works, logits, finished, on_step)

    def _decode(self, batches: list[_Batch], finished: list[Finished], on_step: Callable[[int], None] | None) -> None:
        works = []
        for j, batch in enumerate(batches):
            slots = batch.active()
            if not slots:
                continue
            if batch.end >= self.cap:
                with self.store.deferred_sync():
                    self._compact(j, batch)
            b, c = batch.begin(), batch.end
            rows = [batch.rows[s] for s in slots]
            ids = torch.tensor([[r.out[-1]] for r in rows], dtype=torch.long)  # type: ignore[union-attr]
            pos = torch.tensor([[r.n_ctx] for r in rows], dtype=torch.long)  # type: ignore[union-attr]
            for s in slots:
                batch.mask[s, c] = True
            cmask = batch.mask[slots][:, b:c + 1]
            works.append(_Work(j, slots, ids.to(self.device), pos.to(self.device), c, b, cmask.to(self.device),
                               cpu_mask=cmask, window_begin=b + _window_start(cmask, self.spec.sliding_window)))
            batch.end = c + 1
            for r in rows:
                r.n_ctx += 1  # type: ignore[union-attr]
        logits = self._step(works, decode=True)
        self.stats.num_decode_steps += 1
        self._finish_step(batches, works, logits, finished, on_step)

    def _finish_step(self, batches: list[_Batch], works: list[_Work], logits: list[torch.Tensor],
                     finished: list[Finished], on_step: Callable[[int], None] | None) -> None:
        now = self._clock()
        produced = 0
        for work, lg in zip(works, logits):
            batch = batches[work.batch]
            tokens = self._sample(lg, [batch.rows[slot] for slot in work.slots])
            logprobs = self._logprobs(lg, tokens) if self.logprobs else None
            for i, (slot, tok) in enumerate(zip(work.slots, tokens)):
                row = batch.rows[slot]
                assert row is not None
                row.out.append(int(tok))
                if row.logprobs is not None and logprobs is not None:
                    row.logprobs.append(logprobs[i])
                produced += 1
                eos = int(tok) in self.stop
                if (eos or len(row.out) >= row.req.max_new_tokens
                        or (self.stop_check is not None and self.stop_check(row.req, row.out))):
                    finished.append(Finished(row.req.id, len(row.req.prompt_ids), tuple(row.out), row.start_s, now,
                                             eos, None if row.logprobs is None else tuple(row.logprobs)))
                    batch.rows[slot] = None
                    batch.mask[slot] = False
        self.stats.generated_tokens += produced
        if on_step is not None:
            on_step(produced)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
        """Log-probability of each row's ``tokens`` entry under its logits, in float32."""
        picked = torch.tensor(tokens, dtype=torch.long, device=logits.device).unsqueeze(1)
        return torch.log_softmax(logits.float(), dim=-1).gather(1, picked).squeeze(1).tolist()

    def _sample(self, logits: torch.Tensor, rows: list[Any]) -> list[int]:
        """Each row's next token under its request's sampling parameters (the engine's by default),
        one :func:`sample` call per distinct set; draws keyed by request id and token index."""
        params = [row.req.sampling or self.sampling for row in rows]
        tokens = [0] * len(rows)
        for p in dict.fromkeys(params):
            idx = [i for i, q in enumerate(params) if q == p]
            keys = () if p.greedy else [(rows[i].req.id, len(rows[i].out)) for i in idx]
            picked = sample(logits if len(idx) == len(rows) else logits[torch.tensor(idx, device=logits.device)],
                            p, keys).tolist()
            for i, t in zip(idx, picked):
                tokens[i] = t
        return tokens

    def _compact(self, j: int, batch: _Batch) -> None:
        """Shift a batch's KV columns ``[begin, end)`` to ``[0, T)`` on every tier (refill can run long)."""
        b, e = batch.begin(), batch.end
        T = e - b
        assert b > 0, "a batch's context cannot exceed max_prompt + max_output"
        for layer in range(self.spec.num_layers):
            for tier, parts in self.kv_home[j][layer].items():
                for part, home in enumerate(parts):
                    if tier == "disk":
                        for r in range(home.shape[0]):
                            relay = self.kv_relay[0][part][0][:T]
                            self.store.copy(Ref("cpu", relay), Ref("disk", home.row(r).span(b, e)))
                            self.store.copy(Ref("disk", home.row(r).span(0, T)), Ref("cpu", relay))
                    else:
                        d = _kv_time_dim(tier)
                        for s in range(0, T, b):  # chunks of width <= b never overlap their source
                            w = min(b, T - s)
                            home.narrow(d, s, w).copy_(home.narrow(d, b + s, w))
        batch.mask[:, :T] = batch.mask[:, b:e].clone()
        batch.mask[:, T:] = False
        for r in batch.rows:
            if r is not None:
                r.first_col -= b
        batch.end = T

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop the I/O threads, free the tiers and delete the offload files (idempotent)."""
        if self._closed:
            return
        if self._running:
            raise RuntimeError("close() inside run() (from a callback): return from it, and close after the run")
        self._closed = True
        with _SignalGate():
            for pool in self._pools:
                pool.shutdown(wait=True, cancel_futures=True)
            self._pools = []
            self.store.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def offload_path(self) -> Path | None:
        """The private directory holding this engine's offload files (None without disk data)."""
        return self.store.dir
