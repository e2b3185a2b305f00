"""Calibrate the cost model from real runs of the engine on this machine (issue 7).

FlexGen's policy-search notes say its constants "must be fitted to real runs, not
microbenchmarks", and its fitter never ran. Here a small designed set of short runs of
:class:`xrunner.engine.Engine` (random weights, few decode steps: FlexGen's ``cut_gen_len``,
and a cut copy of the model with fewer identical layers, since every layer costs the same)
excites every calibration term of :mod:`xsimulator.costmodel`; the discrete-event simulator,
given the exact request lengths of each run, predicts what the engine measured; and
``scipy.optimize.least_squares`` fits the terms to the *relative* errors.

What is compared (per run; :data:`METRICS`):

- busy seconds per resource, from ``EngineStats.busy_s`` and the compute-track events:
  ``layers`` (decoder layers incl. KV (de)quantisation and weight dequantisation, CPU
  attention excluded), ``head`` (LM head), ``cpu_compute``, ``ctog``, ``gtoc``, ``dtoc``,
  ``ctod``. They pin the multiplicative factors (:data:`FACTOR_TERMS`): each is the ratio of a
  measured to a predicted busy time, seen in isolation.
- wall seconds of the prefill steps and of the decode steps (from ``on_step`` time stamps).
  The busy times leave out what runs between the timed kernels (futures, sampling, bookkeeping),
  and the overlap of the groups decides how busy times become a step; so ``step_overhead_s``
  (per active GPU batch and step, outside the timed kernels) is fitted to the step wall times.
  ``layer_overhead_s`` (per layer and active GPU batch: the engine's per-batch work around the
  layer's kernels) and ``block_layer_overhead_s`` (per layer and block step: the engine's
  once-per-layer work for the block, weight hand-off and prefetch; the layer fits already read
  weights cold) are inside the engine's layer events, so inside ``layers``. They are told apart from each other and from the ``gpu_compute`` factor by designs
  with one, two and four GPU batches per block and with 1, 4 and 8 rows per batch; the two model
  depths separate the per-layer terms from ``step_overhead_s``. ``row_copy_s`` (per copy of a KV
  or hidden-state row between the cpu and gpu tiers) is told apart from the ``ctog``/``gtoc``
  factors by the weights-on-cpu run (a few whole-layer copies) against the runs with KV cache and
  activations on cpu (many small row copies). ``kv_codec_overhead_s`` (per layer and GPU batch of
  a decode step over a 4-bit cache: the codec's fixed work per call) is pinned by the
  compressed-cache run; on a CPU that kernel is priced as compute from the profile's probe.
  ``cpu_attention_overhead_s`` (per layer, GPU batch and tier of a decode step whose offloaded
  rows attend on the CPU) is told apart from the ``cpu_compute`` factor on the bytes by two
  CPU-attention runs, one over contexts about six times as long as the other's.
  ``dtoc`` (whole weight records, O_DIRECT) and ``dtoc_rows`` (KV-cache and activation rows read
  one at a time) both show in the ``dtoc`` metric and are told apart by the weights-on-disk run
  against the run with KV cache and activations on disk.

The predicted ``head`` busy time excludes ``step_overhead_s``, which runs outside the timed
kernels, so factors and overheads are not fighting over the same seconds: the fit is well
posed. Terms that no run excites (e.g. ``dtoc`` without a disk) keep their old value.

A shared or virtual machine does not keep one speed: on the 2-core VM this was built on, four
calibrations within two hours fitted ``gpu_compute`` between 0.83 and 1.13, and within ten
minutes the same short runs went from 1.09 to 1.69 x their calibrated time. ``xsched calibrate --refresh``
(:func:`refresh`) re-times only the all-gpu runs of the design (about 12 s for opt-125m) and rescales the
compute terms by one factor, so a profile can be brought back to the machine's current speed
right before planning, without refitting the I/O terms.

The calibrated profile also records how far real runs stray from the calibrated prediction
(:class:`xprofiler.profile.CalibrationError`): the run-to-run spread of the step wall times over
the repeats of each design and the fit's remaining error on them. ``xsched plan --margin auto``
turns that into the fraction of a latency bound to keep free.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from workloads.distributions import LengthDistribution
from workloads.workload import Workload
from xprofiler.profile import MARGIN_QUANTILE, CalibrationError, HardwareProfile
from xprofiler.specs import ModelSpec
from xsched.errors import UserError
from xsimulator.costmodel import FACTOR_TERMS, INTERFERENCE_TERMS, OVERHEAD_TERMS, workload_cache_positions
from xsimulator.discrete_event import simulate_timeline
from xsimulator.policy import Policy

METRICS: tuple[str, ...] = ("layers", "head", "cpu_compute", "ctog", "gtoc", "dtoc", "ctod", "prefill_wall",
                            "decode_wall")
WALL_METRICS: tuple[str, ...] = ("prefill_wall", "decode_wall")
TERMS: tuple[str, ...] = FACTOR_TERMS + OVERHEAD_TERMS + INTERFERENCE_TERMS
# A measured busy time below this is noise (a handful of timer reads), not a signal to fit.
MIN_MEASURED_S = 2e-3
FACTOR_BOUNDS = (0.05, 20.0)
# The terms a change of the machine's compute speed moves together (refresh scales them by one
# factor); the I/O channels keep their fitted values.
SPEED_TERMS: tuple[str, ...] = ("gpu_compute", "cpu_compute", "dequant", "quant", "head", "layer_overhead_s",
                                "step_overhead_s", "block_layer_overhead_s", "row_copy_s", "kv_codec_overhead_s",
                                "cpu_attention_overhead_s")
OVERHEAD_BOUNDS_S = (0.0, 0.05)
# Prompt positions of the long CPU-attention run (at most half the model's positions).
LONG_PROMPT = 192
INTERFERENCE_BOUNDS = (0.0, 1.0)


def _neutral(term: str) -> float:
    """The value that leaves the uncalibrated model as it is: 1 for a factor, 0 for the others."""
    return 1.0 if term in FACTOR_TERMS else 0.0


def _bounds(term: str) -> tuple[float, float]:
    if term in FACTOR_TERMS:
        return FACTOR_BOUNDS
    return INTERFERENCE_BOUNDS if term in INTERFERENCE_TERMS else OVERHEAD_BOUNDS_S


# --------------------------------------------------------------------------- the design
@dataclass(frozen=True)
class RunDesign:
    """One short run: a policy, the model depth it runs at, and its exact request lengths."""

    name: str
    policy: Policy
    num_layers: int
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    excites: tuple[str, ...]  # the terms this run is there for (documentation and the report)
    samples: int = 1  # requests come in runs of this many with one prompt (Workload.samples)
    prefix: int = 0  # leading tokens all prompts share (Workload.prefix_tokens)
    prefix_groups: int = 1  # distinct such prefixes, one drawn per prompt (Workload.prefix_groups)
    prefix_share: float = 1.0  # the prompts behind one; the others share nothing (Workload.prefix_share)
    prefix_lengths: tuple[int, ...] = ()  # each prefix's length and share, where they differ (Workload.prefix_lengths)
    prefix_weights: tuple[float, ...] = ()


def cut_spec(spec: ModelSpec, num_layers: int) -> ModelSpec:
    """``spec``'s first ``num_layers`` decoder layers (each with its own window, as Gemma's have):
    same name, so the profile's layer fits apply."""
    n = max(1, min(num_layers, spec.num_layers))
    return replace(spec, num_layers=n, window_layers=spec.window_layers[:n])


def design_runs(spec: ModelSpec, gen_len: int = 6, depth: int = 4) -> list[RunDesign]:
    """The calibration set: every placement the cost model prices differently, each run short.

    ``depth`` layers for most runs (a cut copy of the model) and ``2 * depth`` for two all-gpu
    runs, which separates the per-layer from the per-step overhead; ``gen_len`` decode tokens.
    Prompt lengths vary inside a batch so padding and bucketing are exercised as in real jobs.
    """
    d1, d2 = max(1, min(depth, spec.num_layers)), max(1, min(2 * depth, spec.num_layers))
    if d1 == d2 and spec.num_layers > 1:
        d1 = max(1, d2 // 2)
    g = max(2, gen_len)

    def lens(n: int, prompt: int, spread: int, out: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        p = tuple(max(1, prompt - (i * spread) // max(1, n - 1)) for i in range(n))
        o = tuple(max(2, out - (i % 3)) for i in range(n))
        return p, o

    def run(name: str, layers: int, n: int, prompt: int, spread: int, out: int, excites: tuple[str, ...],
            **pol: Any) -> RunDesign:
        p, o = lens(n, prompt, spread, out)
        return RunDesign(name, Policy(**pol), layers, p, o, excites)

    # Weights: all but one layer offloaded. The engine keeps up to two fetched layers in its two
    # stage slots, so with <= 2 offloaded layers nothing is fetched again after the first step
    # (and the cost model charges nothing per step); three or more are fetched every step, which
    # is what excites ctog/dtoc here.
    frac = (d1 - 1) / d1 if d1 >= 4 else 1.0
    long_prompt = max(32, min(LONG_PROMPT, spec.max_positions // 2))
    designs = [
        run("gpu-prefill", d2, 8, 48, 16, 2, ("gpu_compute", "head", "layer_overhead_s"), gbs=4, nb=2),
        run("gpu-decode", d2, 4, 16, 8, g + 2, ("gpu_compute", "head", "step_overhead_s"), gbs=4, nb=1),
        run("gpu-decode-cut", d1, 8, 24, 8, g, ("gpu_compute", "layer_overhead_s", "step_overhead_s"), gbs=4,
            nb=2, refill_every=2),
        run("weights-cpu", d1, 4, 16, 8, g, ("ctog",), gbs=4, nb=1, wg=1 - frac, wc=frac),
        run("weights-disk", d1, 4, 16, 8, g, ("dtoc", "ctog"), gbs=4, nb=1, wg=1 - frac, wd=frac),
        run("kv-cpu-cpu-attention", d1, 8, 32, 8, g, ("cpu_attention_overhead_s", "gtoc", "ctog"), gbs=8, nb=1,
            cg=0.0, cc=1.0, cpu_attention=True),
        run("kv-act-cpu", d1, 8, 32, 8, g, ("ctog", "gtoc"), gbs=4, nb=2, cg=0.0, cc=1.0, hg=0.0, hc=1.0),
        run("kv-act-disk", d1, 4, 32, 8, g, ("dtoc_rows", "ctod"), gbs=4, nb=1, cg=0.0, cd=1.0, hg=0.5, hd=0.5),
        run("compress-weights", d1, 4, 16, 8, g, ("dequant",), gbs=4, nb=1, compress_weight=True),
        run("compress-cache", d1, 8, 32, 8, g, ("quant", "dequant", "kv_codec_overhead_s"), gbs=8, nb=1,
            compress_cache=True),
        # Many one-row GPU batches per block: the only run where a per-batch cost (layer_overhead_s)
        # and a per-block one (block_layer_overhead_s) differ by more than 2x, so the fit can tell
        # them apart; with nb <= 2 everywhere it put the whole per-layer overhead on the block
        # (opt-125m: 0.64 ms per block, ~0), while the engine's one-row batches each paid 0.6-0.7 ms.
        run("one-row-batches", d1, 8, 16, 8, g, ("layer_overhead_s", "block_layer_overhead_s", "head"), gbs=1,
            nb=4),
        # kv-cpu-cpu-attention over contexts about six times as long: the bytes' share of CPU
        # attention (the cpu_compute factor) grows with the context, the per-call share does not,
        # so the two runs tell them apart.
        run("kv-cpu-cpu-attention-long", d1, 8, long_prompt, 8, g, ("cpu_compute",), gbs=8, nb=1, cg=0.0,
            cc=1.0, cpu_attention=True),
    ]
    # The engine refused such a run with "max prompt ... exceed ... positions; lower them", which
    # named neither the flag nor a value: the prompts are the design's, only gen_len is the user's.
    longest = max(max(d.prompt_lens) + max(d.output_lens) for d in designs)
    if longest > spec.max_positions:
        raise UserError(f"--gen-len {gen_len}: the calibration runs would reach {longest} positions, beyond "
                        f"{spec.name}'s {spec.max_positions}; pass at most {gen_len - (longest - spec.max_positions)}")
    return designs


# --------------------------------------------------------------------------- measuring
@dataclass(frozen=True)
class Measurement:
    """What one run of the engine measured (seconds; see :data:`METRICS`)."""

    design: RunDesign
    metrics: dict[str, float]
    wall_s: float
    step_s: tuple[float, ...]  # wall seconds of every step, in order
    step_is_prefill: tuple[bool, ...]
    latency_s: dict[str, float]  # per request id
    peak_bytes: dict[str, float]
    planned_peak_bytes: dict[str, float]
    repeat_metrics: tuple[dict[str, float], ...] = ()  # every repeat's metrics (``metrics`` is their median)


def request_ids(n: int) -> list[str]:
    return [f"r{i}" for i in range(n)]


def run_engine(source: Any, policy: Policy, prompt_lens: Sequence[int], output_lens: Sequence[int], *,
               offload_dir: str | Path | None = None, profile: HardwareProfile | None = None, seed: int = 0,
               max_prompt: int | None = None, max_output: int | None = None, warmup: bool = False,
               head_layouts: dict[int, str] | None = None, samples: int = 1, prefix: int = 0,
               prefix_groups: int = 1, prefix_share: float = 1.0, prefix_lengths: Sequence[int] = (),
               prefix_weights: Sequence[float] = ()) -> Measurement:
    """Run ``policy`` once over requests of exactly these lengths (random token ids, EOS ignored;
    with ``samples`` k, requests come in runs of k with one prompt, as ``Workload.samples`` says;
    every prompt begins with the same ``prefix`` tokens, as ``Workload.prefix_tokens`` says, each
    keeping at least one token of its own; with ``prefix_groups`` G, with one of G such prefixes,
    the one ``Workload.prefix_ids`` draws for it, as the simulator does; ``prefix_share`` of the
    prompts only, the others all their own tokens; ``prefix_lengths`` and ``prefix_weights``:
    prefixes of these lengths and shares instead, drawn as the simulator draws them for these
    prompt lengths).

    Returns busy seconds per metric, per-step wall seconds, per-request latencies and peak
    bytes. ``max_prompt``/``max_output`` size the KV cache (default: the longest of the job),
    as a plan's workload would. ``warmup`` first runs one untimed short block on the same engine:
    a calibration run is a few steps long, so the engine's first-step costs (allocator, thread
    pools, caches) would weigh far more in it than in a real job. ``head_layouts`` (block size
    ``gbs * nb`` -> CPU LM head layout) is shared by the runs of one calibration: the first engine of a
    block size times the two layouts, the others reuse its choice (timing them was a fifth of a
    calibration's wall time on the 2-core VM).
    """
    from xrunner.engine import Engine, Request

    spec = source.spec
    rng = np.random.default_rng(seed)
    ids = request_ids(len(prompt_lens))
    prompts: list[tuple[int, ...]] = []
    wl = workload_of(prompt_lens, output_lens, samples=samples, prefix=prefix, prefix_groups=prefix_groups,
                     prefix_share=prefix_share, prefix_lengths=prefix_lengths, prefix_weights=prefix_weights)
    systems = [tuple(int(t) for t in rng.integers(0, spec.vocab_size, n)) for n in wl.prefix_table[0].tolist()]
    which = wl.prefix_ids(len(prompt_lens), prompt_lens=np.asarray(prompt_lens))
    for k, p in enumerate(prompt_lens):
        shared = k % samples and len(prompts[-1]) == int(p)
        head = systems[which[k]][:int(p) - 1] if which[k] < wl.prefix_groups else ()
        prompts.append(prompts[-1] if shared else
                       head + tuple(int(t) for t in rng.integers(0, spec.vocab_size, int(p) - len(head))))
    reqs = [Request(i, ids_, int(o)) for i, ids_, o in zip(ids, prompts, output_lens)]
    if offload_dir is None:
        import tempfile

        offload_dir = tempfile.gettempdir()
    mp = max_prompt or max(prompt_lens)
    mo = max_output or max(output_lens)
    latency: dict[str, float] = {}
    stamps: list[float] = []
    kinds: list[bool] = []
    layouts = {} if head_layouts is None else head_layouts
    cache = workload_cache_positions(wl, mp)  # as the simulator sizes it
    with Engine(source, policy, max_prompt=mp, max_output=mo, offload_dir=offload_dir, record_trace=True,
                profile=profile, head_layout=layouts.get(policy.block_size), prefix_cache_positions=cache) as eng:
        layouts.setdefault(policy.block_size, eng.head_layout)
        seen = [0]

        def on_step(_n: int) -> None:
            stamps.append(time.perf_counter())
            kinds.append(eng.stats.num_prefill_steps > seen[0])
            seen[0] = eng.stats.num_prefill_steps

        def on_finished(done: list[Any]) -> None:
            latency.update({f.id: f.latency_s for f in done})

        if warmup:  # one untimed prefill + decode step of a full block on this engine
            n = min(len(reqs), policy.gbs * policy.nb)
            eng.run([replace(r, id=f"warm{i}", max_new_tokens=min(2, mo)) for i, r in enumerate(reqs[:n])])
            stamps.clear(), kinds.clear()
        t0 = time.perf_counter()
        stats = eng.run(reqs, on_finished=on_finished, on_step=on_step)
    steps = np.diff(np.asarray([t0] + stamps))
    head = sum(e.dur_s for e in stats.events if e.track == "compute" and e.name == "head")
    metrics = {
        "layers": stats.busy_s["compute"] - head, "head": head, "cpu_compute": stats.busy_s["cpu_compute"],
        **{ch: stats.busy_s[ch] for ch in ("ctog", "gtoc", "dtoc", "ctod")},
        "prefill_wall": float(steps[np.asarray(kinds, bool)].sum()),
        "decode_wall": float(steps[~np.asarray(kinds, bool)].sum()),
    }
    design = RunDesign("run", policy, spec.num_layers, tuple(int(p) for p in prompt_lens),
                       tuple(int(o) for o in output_lens), ())
    return Measurement(design, metrics, stats.wall_s, tuple(float(s) for s in steps), tuple(kinds), latency,
                       {k: float(v) for k, v in stats.peak_bytes.items()},
                       {k: float(v) for k, v in stats.planned_peak_bytes.items()})


def measure_design(spec: ModelSpec, runs: Sequence[RunDesign], *, profile: HardwareProfile, repeats: int = 3,
                   offload_dir: str | Path | None = None, source_for: Callable[[ModelSpec], Any] | None = None,
                   progress: bool = False) -> list[Measurement]:
    """Run every design ``repeats`` times, round-robin, after one untimed warm-up run.

    Each metric is the median over the repeats: on a shared machine a neighbour's burst hits
    one repeat, not the fit. Round-robin order spreads slow phases of the machine over designs.
    """
    from tqdm import tqdm

    from xrunner.loaders import RandomSource

    make = source_for or (lambda s: RandomSource(s, seed=0))
    warm = runs[0]
    layouts: dict[int, str] = {}  # one LM head layout per GPU batch size, timed once (run_engine)
    run_engine(make(cut_spec(spec, 1)), warm.policy, warm.prompt_lens[:2], (2, 2), offload_dir=offload_dir,
               profile=profile, head_layouts=layouts)
    got: list[list[Measurement]] = [[] for _ in runs]
    with tqdm(total=len(runs) * repeats, desc="calibration runs", unit="run", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        for _ in range(max(1, repeats)):
            for i, d in enumerate(runs):
                got[i].append(run_engine(make(cut_spec(spec, d.num_layers)), d.policy, d.prompt_lens,
                                         d.output_lens, offload_dir=offload_dir, profile=profile, warmup=True,
                                         head_layouts=layouts, samples=d.samples, prefix=d.prefix,
                                         prefix_groups=d.prefix_groups, prefix_share=d.prefix_share,
                                         prefix_lengths=d.prefix_lengths, prefix_weights=d.prefix_weights))
                bar.update(1)
    out = []
    for d, ms in zip(runs, got):
        metrics = {k: float(np.median([m.metrics[k] for m in ms])) for k in METRICS}
        typical = sorted(ms, key=lambda m: m.wall_s)[len(ms) // 2]
        out.append(replace(typical, design=d, metrics=metrics, repeat_metrics=tuple(m.metrics for m in ms)))
    return out


# --------------------------------------------------------------------------- predicting
def workload_of(prompt_lens: Sequence[int], output_lens: Sequence[int], name: str = "calibration",
                samples: int = 1, prefix: int = 0, prefix_groups: int = 1, prefix_share: float = 1.0,
                prefix_lengths: Sequence[int] = (), prefix_weights: Sequence[float] = ()) -> Workload:
    """The empirical workload of exactly these requests (its maxima size the KV cache); with
    ``prefix_lengths`` (and ``prefix_weights``, default equal shares of ``prefix_share``), its
    prefixes are those, ``prefix`` and ``prefix_groups`` following from them."""
    if prefix_lengths:
        weights = tuple(prefix_weights) or (prefix_share / len(prefix_lengths),) * len(prefix_lengths)
        prefix_share = float(sum(weights))
        prefix = round(sum(n * w for n, w in zip(prefix_lengths, weights)) / prefix_share)
        prefix_groups, prefix_lengths, prefix_weights = len(prefix_lengths), tuple(prefix_lengths), weights
    return Workload(name=name, prompt=LengthDistribution.empirical(list(prompt_lens)),
                    output=LengthDistribution.empirical(list(output_lens)), source="measured run", samples=samples,
                    prefix_tokens=prefix, prefix_groups=prefix_groups, prefix_share=prefix_share,
                    prefix_lengths=tuple(prefix_lengths), prefix_weights=tuple(prefix_weights))


def predict(spec: ModelSpec, profile: HardwareProfile, design: RunDesign) -> dict[str, float]:
    """The simulator's value of every metric for this run (same request lengths, same policy).

    ``head`` leaves out ``step_overhead_s``, which is not inside a timed kernel; ``layers`` keeps
    ``layer_overhead_s``, which is (the engine times each batch's whole layer step).
    """
    s = cut_spec(spec, design.num_layers)
    prompt, output = np.asarray(design.prompt_lens), np.asarray(design.output_lens)
    res, tl = simulate_timeline(s, profile, design.policy,
                                workload_of(prompt, output, samples=design.samples, prefix=design.prefix,
                                            prefix_groups=design.prefix_groups, prefix_share=design.prefix_share,
                                            prefix_lengths=design.prefix_lengths,
                                            prefix_weights=design.prefix_weights),
                                requests=(prompt, output))
    batch_steps = float(np.count_nonzero(tl.prefill_rows) + np.count_nonzero(tl.decode_rows))
    cal = profile.calibration
    b = res.busy_s
    return {
        "layers": b["gpu_compute"] + b["dequant"] + b["quant"],
        "head": b["head"] - cal.get("step_overhead_s", 0.0) * batch_steps,
        "cpu_compute": b["cpu_compute"], "ctog": b["ctog"], "gtoc": b["gtoc"], "dtoc": b["dtoc"],
        "ctod": b["ctod"], "prefill_wall": res.prefill_s, "decode_wall": res.decode_s,
    }


def with_terms(profile: HardwareProfile, values: Mapping[str, float]) -> HardwareProfile:
    cal = dict(profile.calibration)
    cal.update({k: float(v) for k, v in values.items()})
    return replace(profile, calibration=cal)


# --------------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class TermReport:
    """One calibration term: its value before and after, and the error of what it drives."""

    term: str
    before: float
    after: float
    fitted: bool
    residuals: int  # how many (run, metric) residuals depend on it
    error_before: float  # median |relative error| of those residuals
    error_after: float


@dataclass
class Fit:
    profile: HardwareProfile
    terms: list[TermReport]
    rows: list[dict[str, Any]]  # per (run, metric): measured, predicted before, after
    error_before: float  # median |relative error| over every residual
    error_after: float
    wall_error_before: float  # median |relative error| of the step wall times
    wall_error_after: float
    runs_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        from xsched.contract import to_jsonable

        err = self.profile.calibration_error
        return {"calibration": dict(self.profile.calibration), "calibration_error": to_jsonable(err),
                "planning_margin": err.planning_margin() if err is not None else 0.0,
                "terms": [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in t.__dict__.items()}
                          for t in self.terms], "residuals": self.rows,
                "error_before": self.error_before, "error_after": self.error_after,
                "wall_error_before": self.wall_error_before, "wall_error_after": self.wall_error_after,
                "runs_s": self.runs_s, "notes": self.notes}


def _residual_keys(spec: ModelSpec, profile: HardwareProfile,
                   measurements: Sequence[Measurement]) -> list[tuple[int, str]]:
    """(run, metric) pairs worth fitting: measured above the noise floor, or predicted so."""
    keys = []
    for i, m in enumerate(measurements):
        pred = predict(spec, profile, m.design)
        for k in METRICS:
            if m.metrics[k] >= MIN_MEASURED_S:
                keys.append((i, k))
            elif pred[k] >= MIN_MEASURED_S:  # the model says busy, the run says idle: still an error
                keys.append((i, k))
    return keys


def _dependence(spec: ModelSpec, profile: HardwareProfile, measurements: Sequence[Measurement],
                keys: Sequence[tuple[int, str]]) -> dict[str, list[int]]:
    """For each term, the residuals whose prediction moves when the term moves (finite difference)."""
    base = [predict(spec, profile, m.design) for m in measurements]
    out: dict[str, list[int]] = {}
    for t in TERMS:
        step = 0.5 if t in FACTOR_TERMS else 1e-3
        cur = profile.calibration.get(t, _neutral(t))
        moved_prof = with_terms(profile, {t: cur + step})
        moved = [predict(spec, moved_prof, m.design) for m in measurements]
        out[t] = [j for j, (i, k) in enumerate(keys) if abs(moved[i][k] - base[i][k]) > 1e-12 * max(1.0, base[i][k])]
    return out


def _errors(spec: ModelSpec, profile: HardwareProfile, measurements: Sequence[Measurement],
            keys: Sequence[tuple[int, str]]) -> tuple[np.ndarray, list[dict[str, float]]]:
    preds = [predict(spec, profile, m.design) for m in measurements]
    r = np.array([(preds[i][k] - measurements[i].metrics[k]) / max(measurements[i].metrics[k], MIN_MEASURED_S)
                  for i, k in keys])
    return r, preds


def fit_calibration(spec: ModelSpec, profile: HardwareProfile, measurements: Sequence[Measurement],
                    start: Mapping[str, float] | None = None) -> Fit:
    """Least squares on relative errors of busy times and step wall times (see module docstring).

    ``start`` sets the starting values (default: all factors 1, overheads 0, i.e. the raw
    profile). Terms that no residual depends on keep the profile's value.
    """
    from scipy.optimize import least_squares

    init = {t: _neutral(t) for t in TERMS}
    init.update(start or {})
    p0 = with_terms(profile, init)
    keys = _residual_keys(spec, p0, measurements)
    if not keys:
        raise UserError("the calibration runs measured nothing to fit (every busy time is below "
                        f"{MIN_MEASURED_S * 1e3:.0f} ms); use a larger model")
    deps = _dependence(spec, p0, measurements, keys)
    free = [t for t in TERMS if deps[t]]
    # Runs that cannot see a term say nothing of it: a calibrated profile's value stays (it was
    # reset to the start value, and the report called it kept).
    init.update({t: profile.calibration[t] for t in TERMS if not deps[t] and t in profile.calibration})
    p0 = with_terms(profile, init)
    lo = [_bounds(t)[0] for t in free]
    hi = [_bounds(t)[1] for t in free]
    scale = [1.0 if t in FACTOR_TERMS else 0.1 if t in INTERFERENCE_TERMS else 1e-4 for t in free]

    def residuals(x: np.ndarray) -> np.ndarray:
        return _errors(spec, with_terms(p0, dict(zip(free, x))), measurements, keys)[0]

    x0 = np.clip([init[t] for t in free], lo, hi)
    sol = least_squares(residuals, x0, bounds=(lo, hi), x_scale=scale, diff_step=1e-3, method="trf")
    fitted = with_terms(p0, dict(zip(free, sol.x)))
    r0, pred0 = _errors(spec, p0, measurements, keys)
    r1, pred1 = _errors(spec, fitted, measurements, keys)
    terms = []
    for t in TERMS:
        idx = deps[t]
        terms.append(TermReport(
            t, float(init[t]), float(fitted.calibration.get(t, init[t])), t in free, len(idx),
            float(np.median(np.abs(r0[idx]))) if idx else math.nan,
            float(np.median(np.abs(r1[idx]))) if idx else math.nan))
    rows = [{"run": measurements[i].design.name, "metric": k, "measured_s": measurements[i].metrics[k],
             "before_s": pred0[i][k], "after_s": pred1[i][k]} for i, k in keys]
    wall = np.array([k in WALL_METRICS for _i, k in keys])
    fitted = replace(fitted, calibration_error=calibration_error(measurements, r1[wall]))
    return Fit(profile=fitted, terms=terms, rows=rows, error_before=float(np.median(np.abs(r0))),
               error_after=float(np.median(np.abs(r1))),
               wall_error_before=float(np.median(np.abs(r0[wall]))) if wall.any() else math.nan,
               wall_error_after=float(np.median(np.abs(r1[wall]))) if wall.any() else math.nan,
               notes=at_bounds(free, sol.x))


def at_bounds(free: Sequence[str], values: Sequence[float]) -> list[str]:
    """A note per term the fit left at an end of its range (an overhead or fraction at 0 is none).

    Nothing else says so: on a GPU-shaped profile of opt-125m, 1% noise on the measured times put
    ``quant``, ``dequant`` or ``cpu_compute`` at 0.05 or 20 in every seed, with the wall times
    fitted within 1%, since those runs barely move with them; a plan that leans on the term is
    then priced 20 times too fast or slow.
    """
    out = []
    for t, v in zip(free, values):
        lo, hi = _bounds(t)
        if v >= hi * (1 - 1e-6) or (t in FACTOR_TERMS and v <= lo * (1 + 1e-6)):
            out.append(f"fitted to the end of its range: {t} = {v:g} (range {lo:g}..{hi:g}); the runs cannot pin it "
                       "or want it beyond, and plans that lean on it are priced with that value")
    return out


def repeat_spreads(measurements: Sequence[Measurement]) -> list[float]:
    """(max - min) / median of each step wall time over the repeats of its design (>= 2 repeats,
    median above the noise floor)."""
    out = []
    for m in measurements:
        if len(m.repeat_metrics) < 2:
            continue
        for k in WALL_METRICS:
            xs = np.array([r[k] for r in m.repeat_metrics])
            med = float(np.median(xs))
            if med >= MIN_MEASURED_S:
                out.append(float((xs.max() - xs.min()) / med))
    return out


def calibration_error(measurements: Sequence[Measurement], wall_residuals: np.ndarray,
                      quantile: float = MARGIN_QUANTILE) -> CalibrationError | None:
    """The evidence ``--margin auto`` plans with (see :class:`CalibrationError`); None without wall residuals."""
    if not len(wall_residuals):
        return None
    spreads = repeat_spreads(measurements)
    return CalibrationError(
        quantile=quantile, repeats=max((len(m.repeat_metrics) for m in measurements), default=1) or 1,
        pairs=len(wall_residuals),
        repeat_rel_spread=float(np.quantile(spreads, quantile)) if spreads else None,
        fit_rel_error=float(np.quantile(np.abs(wall_residuals), quantile)))


# --------------------------------------------------------------------------- the command's core
def check_profile_for(profile: HardwareProfile, spec: ModelSpec, model_arg: str, profile_arg: str) -> None:
    """Calibration needs this machine's measured profile with per-layer fits of this model."""
    hint = (f"measure one first: xsched profile --quick --model {model_arg} --threads 1 -o profile.json "
            "(about 2 minutes), then calibrate that file")
    if profile.source != "measured":
        raise UserError(f"{profile_arg} is a preset; calibration fits a profile measured on this machine: {hint}")
    for phase in ("prefill", "decode"):
        if profile.layer_fit(profile.fit_name(spec), phase, profile.compute_dtype or spec.dtype) is None:
            have = sorted({f.model for f in profile.layer_fits}) or ["none"]
            raise UserError(f"{profile_arg} has no {phase} layer fit for {spec.name} (it has: {', '.join(have)}); "
                            f"{hint}")


def resolve_model(model: "str | ModelSpec", profile: HardwareProfile) -> tuple[ModelSpec, Callable[[ModelSpec], Any]]:
    """(spec in the profile's compute dtype, a source factory for cut copies of it).

    A registry name or ``random:NAME`` runs seeded random weights (timing does not depend on
    the values); a local HF directory or .gguf file gives its spec and, for cut copies, random
    weights of that shape too (only the first layers would be read otherwise).
    """
    from xprofiler.specs import get_model_spec, model_names
    from xrunner.loaders import RANDOM_PREFIX, RandomSource, open_model

    dtype = profile.compute_dtype or None
    if isinstance(model, ModelSpec):
        return profile.model_for(model), (lambda s: RandomSource(s, seed=0, dtype=dtype))
    name = model[len(RANDOM_PREFIX):] if model.startswith(RANDOM_PREFIX) else model
    if name in model_names():
        spec = get_model_spec(name)
    else:
        spec = open_model(model, dtype=dtype).spec
    spec = profile.model_for(spec)
    return spec, (lambda s: RandomSource(s, seed=0, dtype=dtype))


def _measure_as_profiled(spec: ModelSpec, runs: Sequence[RunDesign], profile: HardwareProfile,
                         **kwargs: Any) -> tuple[list[Measurement], float]:
    """:func:`measure_design` with torch at the profile's thread count (restored after); (runs, seconds)."""
    import torch

    threads = torch.get_num_threads()
    if profile.compute_threads:
        torch.set_num_threads(profile.compute_threads)  # run as the profile measured
    try:
        t0 = time.perf_counter()
        return measure_design(spec, runs, profile=profile, **kwargs), time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)


def calibrate(profile: HardwareProfile, model: "str | ModelSpec", *, profile_arg: str = "profile", gen_len: int = 6,
              depth: int = 4, repeats: int = 3, offload_dir: str | Path | None = None,
              progress: bool = False) -> Fit:
    """Run the design on this machine and fit; the returned ``Fit.profile`` is the calibrated one."""
    spec, source_for = resolve_model(model, profile)
    check_profile_for(profile, spec, model if isinstance(model, str) else spec.name, profile_arg)
    runs = design_runs(spec, gen_len=gen_len, depth=depth)
    ms, runs_s = _measure_as_profiled(spec, runs, profile, repeats=repeats, offload_dir=offload_dir,
                                      source_for=source_for, progress=progress)
    fit = fit_calibration(spec, profile, ms)
    fit.runs_s = runs_s
    fit.notes.append(f"{len(runs)} runs x {repeats} of {spec.name} ({spec.dtype}) cut to {runs[-1].num_layers}/"
                     f"{runs[0].num_layers} of {spec.num_layers} layers in {runs_s:.1f} s")
    return fit


# --------------------------------------------------------------------------- re-anchoring the speed
@dataclass(frozen=True)
class Refresh:
    """A calibrated profile re-anchored to the machine's current compute speed."""

    profile: HardwareProfile
    speed_ratio: float  # measured / predicted step wall time before the refresh (> 1: slower now)
    ratios: tuple[float, ...]  # the per (run, phase) ratios it is the geometric median of
    runs_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"calibration": dict(self.profile.calibration), "speed_ratio": self.speed_ratio,
                "ratios": list(self.ratios), "runs_s": self.runs_s}

    def summary(self) -> str:
        way = "slower" if self.speed_ratio >= 1 else "faster"
        spread = (max(self.ratios) / min(self.ratios) - 1) if self.ratios else 0.0
        return (f"this machine now runs {abs(self.speed_ratio - 1):.1%} {way} than the profile predicts "
                f"(median of {len(self.ratios)} step wall times, spread {spread:.1%}); compute terms "
                f"({', '.join(SPEED_TERMS)}) scaled by {self.speed_ratio:.3f}, I/O terms kept; "
                f"{self.runs_s:.1f} s of runs")


def anchor_designs(spec: ModelSpec, gen_len: int = 6, depth: int = 4) -> list[RunDesign]:
    """The all-gpu runs of the calibration design: their step times are compute and overheads only."""
    return [d for d in design_runs(spec, gen_len=gen_len, depth=depth) if d.name.startswith("gpu-")]


def speed_ratio(spec: ModelSpec, profile: HardwareProfile,
                measurements: Sequence[Measurement]) -> tuple[float, list[float]]:
    """Measured / predicted step wall time over the anchor runs: (median of the log ratios, ratios)."""
    ratios = []
    for m in measurements:
        pred = predict(spec, profile, m.design)
        for k in WALL_METRICS:
            if m.metrics[k] >= MIN_MEASURED_S and pred[k] > 0:
                ratios.append(m.metrics[k] / pred[k])
    if not ratios:
        raise UserError("the speed check measured no step above "
                        f"{MIN_MEASURED_S * 1e3:.0f} ms; use a larger model")
    return float(np.exp(np.median(np.log(ratios)))), ratios


def rescaled(profile: HardwareProfile, ratio: float) -> HardwareProfile:
    """``profile`` with every compute term (:data:`SPEED_TERMS`) multiplied by ``ratio``.

    For a run on the gpu tier alone a step is compute plus overheads, so this scales its
    predicted step time by exactly ``ratio``.
    """
    cal = profile.calibration
    return with_terms(profile, {t: cal.get(t, _neutral(t)) * ratio for t in SPEED_TERMS})


def refresh(profile: HardwareProfile, model: "str | ModelSpec", *, profile_arg: str = "profile", gen_len: int = 6,
            depth: int = 4, repeats: int = 2, progress: bool = False,
            source_for: Callable[[ModelSpec], Any] | None = None) -> Refresh:
    """Re-time the anchor runs and rescale the compute terms of a calibrated profile to match."""
    if not profile.calibration:
        raise UserError(f"{profile_arg} is not calibrated; --refresh re-anchors a calibrated profile: run "
                        f"xsched calibrate --profile {profile_arg} --model ... -o calibrated.json first")
    spec, default_source = resolve_model(model, profile)
    check_profile_for(profile, spec, model if isinstance(model, str) else spec.name, profile_arg)
    ms, runs_s = _measure_as_profiled(spec, anchor_designs(spec, gen_len=gen_len, depth=depth), profile,
                                      repeats=repeats, source_for=source_for or default_source, progress=progress)
    ratio, ratios = speed_ratio(spec, profile, ms)
    return Refresh(rescaled(profile, ratio), ratio, tuple(ratios), runs_s)


def report(fit: Fit) -> str:
    """The fit error per term, before and after, as a table."""
    w = max([len("term")] + [len(t.term) for t in fit.terms])  # block_layer_overhead_s is 22
    lines = [f"{'term':<{w}} {'before':>10} {'after':>10} {'residuals':>9} {'err before':>10} {'err after':>10}"]
    for t in fit.terms:
        if not t.fitted:
            lines.append(f"{t.term:<{w}} {t.before:>10.4g} {'(kept)':>10} {0:>9}")
            continue
        lines.append(f"{t.term:<{w}} {t.before:>10.4g} {t.after:>10.4g} {t.residuals:>9} "
                     f"{t.error_before:>10.1%} {t.error_after:>10.1%}")
    lines.append(f"median |relative error|: all {fit.error_before:.1%} -> {fit.error_after:.1%}; "
                 f"step wall times {fit.wall_error_before:.1%} -> {fit.wall_error_after:.1%}")
    err = fit.profile.calibration_error
    if err is not None:
        spread = "unknown (one repeat)" if err.repeat_rel_spread is None else f"{err.repeat_rel_spread:.1%}"
        lines.append(f"step wall times, {err.quantile:.0%} quantile over {err.pairs} (run, phase) pairs: run-to-run "
                     f"spread over {err.repeats} repeats {spread}, fit error after {err.fit_rel_error:.1%}; "
                     f"xsched plan --margin auto keeps {err.planning_margin():.1%} of a latency bound free")
    lines.extend(fit.notes)
    return "\n".join(lines)
