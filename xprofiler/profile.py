"""HardwareProfile: what one machine can do, measured once (or taken from a preset).

The simulator and scheduler read only this file, never the hardware. Units are SI in every
name: ``_bytes``, ``_bytes_per_s``, ``_flops`` (FLOP/s), ``_s``. On a host with no GPU the
compute device is the CPU and the ``gpu`` tier is a declared RAM budget; its "bandwidths"
are then real memcpy rates inside RAM.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from xsched.contract import Contract

if TYPE_CHECKING:
    from xprofiler.specs import ModelSpec

Channel = Literal["ctog", "gtoc", "dtoc", "ctod"]
CHANNELS: tuple[str, ...] = ("ctog", "gtoc", "dtoc", "ctod")
TIERS: tuple[str, ...] = ("gpu", "cpu", "disk")


@dataclass(frozen=True)
class Fingerprint:
    """Identifies a machine well enough to warn when a profile is used elsewhere."""

    cpu_model: str
    cpu_cores: int
    ram_bytes: int
    gpu_name: str | None
    gpu_mem_bytes: int
    torch_version: str
    offload_fs: str

    def differences(self, other: "Fingerprint", ignore: tuple[str, ...] = ()) -> list[str]:
        """Human-readable list of fields that differ (RAM within 5% counts as equal).

        ``ignore`` names fields not to compare, e.g. ``offload_fs`` when the caller does not
        know which offload directory will be used.
        """
        out = []
        for key in ("cpu_model", "cpu_cores", "gpu_name", "torch_version", "offload_fs"):
            if key in ignore:
                continue
            a, b = getattr(self, key), getattr(other, key)
            if a != b:
                out.append(f"{key}: profile {a!r}, this machine {b!r}")
        for key in ("ram_bytes", "gpu_mem_bytes"):
            if key in ignore:
                continue
            a, b = getattr(self, key), getattr(other, key)
            if abs(a - b) > 0.05 * max(a, b, 1):
                out.append(f"{key}: profile {a / 2**30:.1f} GiB, this machine {b / 2**30:.1f} GiB")
        return out


@dataclass(frozen=True)
class BandwidthCurve:
    """Copy bandwidth as a function of transfer size, plus its large-transfer value.

    ``time_s(n)`` interpolates bandwidth linearly in log(size) between measured points; below
    the smallest point it keeps the smallest point's bandwidth, above the largest it uses
    ``large_bytes_per_s``.
    """

    sizes_bytes: tuple[int, ...]
    bytes_per_s: tuple[float, ...]
    large_bytes_per_s: float

    def __post_init__(self) -> None:
        if len(self.sizes_bytes) != len(self.bytes_per_s):
            raise ValueError("sizes_bytes and bytes_per_s differ in length")
        if any(b <= 0 for b in self.sizes_bytes) or list(self.sizes_bytes) != sorted(set(self.sizes_bytes)):
            raise ValueError("sizes_bytes must be positive and strictly increasing")
        # Below 1 byte/s is no measurement (1e-300 turned every transfer time into inf, then NaN).
        if any(not (1 <= b < math.inf) for b in (self.large_bytes_per_s, *self.bytes_per_s)):
            raise ValueError("bandwidths must be finite numbers of at least 1 byte/s")

    @classmethod
    def flat(cls, bytes_per_s: float) -> "BandwidthCurve":
        return cls(sizes_bytes=(), bytes_per_s=(), large_bytes_per_s=float(bytes_per_s))

    def at(self, size_bytes: float) -> float:
        sizes = self.sizes_bytes
        if not sizes or size_bytes >= sizes[-1]:
            return self.large_bytes_per_s
        if size_bytes <= sizes[0]:
            return self.bytes_per_s[0]
        i = bisect.bisect_right(sizes, size_bytes)
        x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
        t = (math.log(size_bytes) - x0) / (x1 - x0)
        return self.bytes_per_s[i - 1] + t * (self.bytes_per_s[i] - self.bytes_per_s[i - 1])

    def time_s(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else nbytes / self.at(nbytes)


LAYER_FEATURES: dict[str, tuple[str, ...]] = {
    "prefill": ("const", "tokens", "linear_flops", "attn_flops"),
    "decode": ("const", "tokens", "linear_flops", "attn_flops", "kv_bytes"),
}


ATTENTION_FEATURES: tuple[str, ...] = ("attn_flops", "kv_bytes")  # terms that scale with the context


def layer_features(spec: "ModelSpec", phase: str, batch: Any, length: Any) -> dict[str, Any]:
    """Features of one layer step whose weighted sum predicts its time.

    ``length`` is the padded prompt length for prefill and the context length (keys attended
    to) for decode. Works on floats and on numpy arrays alike, so the simulator can evaluate
    many steps at once. ``tokens`` stands for element-wise work (norms, activations, copies).
    """
    if phase == "prefill":
        tokens = batch * length
        return {"const": 1.0 + 0.0 * tokens, "tokens": tokens,
                "linear_flops": tokens * spec.linear_flops_per_token(),
                "attn_flops": tokens * spec.attention_flops_per_token(1) * spec.prefill_context(length)}
    if phase == "decode":
        read = spec.decode_context(length)  # a windowed layer's query reads its window only
        return {"const": 1.0 + 0.0 * batch, "tokens": batch + 0.0 * length,
                "linear_flops": batch * spec.linear_flops_per_token() + 0.0 * length,
                "attn_flops": batch * spec.attention_flops_per_token(1) * read,
                "kv_bytes": batch * read * spec.kv_bytes_per_token_per_layer}
    raise ValueError(f"unknown phase {phase!r}")


@dataclass(frozen=True)
class LayerFit:
    """Fitted time of one decoder layer for one model and phase, from a measured sweep.

    ``predict_s`` is a linear model ``sum(coef[i] * feature_i(batch, length))`` over the named
    features of ``layer_features`` (non-negative coefficients: 1 / coef reads as a rate), times
    a correction factor for effects no linear model in work has (caches, kernel choice). The
    factor is ``measured / linear`` at each node of the measured grid, interpolated bilinearly
    in (log batch, log length) and held at the edge value outside the grid, so predictions are
    exact at measured points, smooth between them and extrapolate linearly in FLOPs and bytes.
    A fit without ``grid_ratio`` is the linear model alone.

    ``median_rel_error``/``max_rel_error`` are in-sample errors of the linear model (how much the
    correction had to do); the accuracy at unmeasured points is what
    ``benchmarks/profile_accuracy.py`` reports. ``samples_csv`` names the raw measurements
    stored beside the profile JSON.
    """

    model: str
    phase: Literal["prefill", "decode"]
    dtype: str
    features: tuple[str, ...]
    coef: tuple[float, ...]
    n_samples: int
    median_rel_error: float
    max_rel_error: float
    samples_csv: str = ""
    grid_batches: tuple[int, ...] = ()
    grid_lengths: tuple[int, ...] = ()
    grid_ratio: tuple[tuple[float, ...], ...] = ()  # [batch index][length index]

    def __post_init__(self) -> None:
        if len(self.features) != len(self.coef):
            raise ValueError("features and coef differ in length")
        unknown = [f for f in self.features if f not in LAYER_FEATURES.get(self.phase, ())]
        if unknown:
            raise ValueError(f"unknown {self.phase} feature(s) {', '.join(unknown)}")
        if any(not 0 <= c < math.inf for c in self.coef):  # NaN too
            raise ValueError("coefficients must be finite and >= 0 (seconds per unit)")
        if self.grid_ratio:
            if len(self.grid_ratio) != len(self.grid_batches) or any(
                    len(row) != len(self.grid_lengths) for row in self.grid_ratio):
                raise ValueError("grid_ratio must be len(grid_batches) x len(grid_lengths)")
            if any(not 0 < r < math.inf for row in self.grid_ratio for r in row):
                raise ValueError("grid_ratio values must be positive and finite")
            for axis in (self.grid_batches, self.grid_lengths):
                if any(a <= 0 for a in axis) or list(axis) != sorted(set(axis)):
                    raise ValueError("grid axes must be positive and strictly increasing")

    def linear_s(self, spec: "ModelSpec", batch: Any, length: Any) -> Any:
        """The linear model alone (floats or numpy arrays)."""
        feats = layer_features(spec, self.phase, batch, length)
        total = 0.0
        for name, c in zip(self.features, self.coef):
            total = total + c * feats[name]
        return total

    def correction(self, batch: Any, length: Any) -> Any:
        """Grid correction factor at (batch, length); 1.0 without a grid."""
        if not self.grid_ratio:
            return 1.0
        import numpy as np

        ratio = np.log(np.asarray(self.grid_ratio, dtype=float))
        ib, wb = _bracket(self.grid_batches, batch)
        il, wl = _bracket(self.grid_lengths, length)
        jb = np.minimum(ib + 1, len(self.grid_batches) - 1)
        jl = np.minimum(il + 1, len(self.grid_lengths) - 1)
        log_r = ((1 - wb) * ((1 - wl) * ratio[ib, il] + wl * ratio[ib, jl])
                 + wb * ((1 - wl) * ratio[jb, il] + wl * ratio[jb, jl]))
        out = np.exp(log_r)
        return float(out) if np.ndim(out) == 0 else out

    def predict_s(self, spec: "ModelSpec", batch: Any, length: Any) -> Any:
        """Predicted seconds of one layer step (floats or numpy arrays)."""
        return self.linear_s(spec, batch, length) * self.correction(batch, length)

    def parts_s(self, spec: "ModelSpec", batch: Any, length: Any) -> tuple[Any, Any]:
        """``predict_s`` split into (attention-free part, attention part), both corrected.

        The attention part is the terms in ``ATTENTION_FEATURES``; a caller that moves attention
        elsewhere (CPU delegation) replaces that part and keeps the other.
        """
        feats = layer_features(spec, self.phase, batch, length)
        other, attn = 0.0, 0.0
        for name, c in zip(self.features, self.coef):
            if name in ATTENTION_FEATURES:
                attn = attn + c * feats[name]
            else:
                other = other + c * feats[name]
        k = self.correction(batch, length)
        return other * k, attn * k


@dataclass(frozen=True)
class HeadFit:
    """Measured time of one GPU batch's logits product for one model: ``rows`` rows times the LM
    head matrix, in the layout the runner keeps it in (on a CPU the faster of the stored and the
    transposed one at each row count, as ``xrunner.model.cpu_head_layout`` chooses; ``layouts``
    says which). The product's time is far from linear in rows at the few rows a decode step
    has (one row is a matrix-vector product, a different kernel), so it is measured at each
    power of two and interpolated, linearly in log rows between them and linearly in rows past
    the last one; below one row (an expected count) it scales down to 0.
    """

    model: str
    dtype: str
    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    layouts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.rows or len(self.seconds) != len(self.rows):
            raise ValueError("a head fit needs one time per row count")
        if any(r < 1 for r in self.rows) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError("head fit rows must be >= 1 and strictly increasing")
        if any(not 0 < s < math.inf for s in self.seconds):
            raise ValueError("head fit seconds must be positive and finite")
        if self.layouts and (len(self.layouts) != len(self.rows)
                             or not set(self.layouts) <= {"rows", "transposed"}):
            raise ValueError("head fit layouts must name one layout, rows or transposed, per row count")

    def predict_s(self, rows: Any) -> Any:
        """Seconds of the product for ``rows`` rows (floats or numpy arrays)."""
        return _rows_curve(self.rows, self.seconds, rows, extend=True)


@dataclass(frozen=True)
class WarmFit:
    """Seconds one decode layer step of ``rows`` rows saves when the layer's weights are already in
    the CPU's last-level cache (``saved_s``: the step with its weights read from memory minus the
    step with them cached, both over a KV cache read from memory).

    The layer fits read every layer's weights from memory, as the first GPU batch of a block does.
    The block's later batches reread the same layer (FlexGen's block schedule: that is how it
    amortises weight loads), and with 4-bit weights every batch reads the buffer the layer was
    just dequantized into; where the layer fits the cache those reads hit it. Measured on the
    project's VM (opt-125m, 1 thread): 8 rows' projections 4.6 ms from memory, 3.1 ms cached;
    compute-bound steps (hundreds of rows) save nothing. Interpolated like ``HeadFit``, linearly
    in log rows, held at the last row count and scaled down to 0 below the first.
    """

    model: str
    dtype: str
    rows: tuple[int, ...]
    saved_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rows or len(self.saved_s) != len(self.rows):
            raise ValueError("a warm fit needs one saving per row count")
        if any(r < 1 for r in self.rows) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError("warm fit rows must be >= 1 and strictly increasing")
        if any(not 0 <= s < math.inf for s in self.saved_s):
            raise ValueError("warm fit savings must be finite and >= 0")

    def predict_s(self, rows: Any) -> Any:
        """Seconds saved at ``rows`` rows (floats or numpy arrays)."""
        return _rows_curve(self.rows, self.saved_s, rows, extend=False)


def _of_model(fits: tuple[Any, ...], model: str, dtype: str | None) -> Any:
    """The first of ``fits`` for ``model`` (and ``dtype`` unless None), or None."""
    return next((f for f in fits if f.model == model and (dtype is None or f.dtype == dtype)), None)


def _rows_curve(axis: tuple[int, ...], values: tuple[float, ...], rows: Any, extend: bool) -> Any:
    """``values`` at row counts ``axis``, interpolated linearly in log rows; below the first row
    count scaled down to 0 with the rows; past the last, held (``extend``: continued at the
    slope of the last two points, never downwards)."""
    import numpy as np

    r = np.asarray(rows, dtype=float)
    xs, ys = np.log(np.asarray(axis, dtype=float)), np.asarray(values, dtype=float)
    out = np.interp(np.log(np.clip(r, axis[0], axis[-1])), xs, ys)
    if extend:
        slope = (ys[-1] - ys[-2]) / (axis[-1] - axis[-2]) if len(ys) > 1 else ys[-1] / axis[-1]
        out = out + max(slope, 0.0) * np.maximum(r - axis[-1], 0.0)
    out = np.where(r < axis[0], ys[0] * np.clip(r, 0.0, None) / axis[0], out)
    return float(out) if np.ndim(out) == 0 else out


def _bracket(axis: tuple[int, ...], value: Any) -> tuple[Any, Any]:
    """Index of the grid cell holding ``value`` and its weight, in log space, clamped to the grid."""
    import numpy as np

    xs = np.log(np.asarray(axis, dtype=float))
    x = np.log(np.clip(np.asarray(value, dtype=float), axis[0], axis[-1]))
    if len(xs) == 1:
        return np.zeros_like(x, dtype=int), np.zeros_like(x)
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return i, w


# The largest factor or seconds a profile's latency and calibration terms may hold: a fit gives
# factors near 1 and seconds far below 1; 1e20 broke the placement LP and 1e308 the search.
MAX_TERM = 1e6
MARGIN_QUANTILE = 0.9  # of the calibration's wall-time errors; see CalibrationError
MAX_AUTO_MARGIN = 0.5  # a derived margin above this says the calibration is unusable, not "plan at half"


@dataclass(frozen=True)
class CalibrationError:
    """How far one real run strays from the calibrated prediction, seen by ``xsched calibrate``.

    Both numbers are relative errors of the step wall seconds (prefill and decode, per designed
    run), the quantity request latencies are sums of, at the ``quantile`` (0.9) over the
    (run, phase) pairs: the median is what the fit minimises and understates what a given plan
    sees, the maximum of ~20 pairs is one outlier. ``repeat_rel_spread`` is the run-to-run
    spread, (max - min) / median over the ``repeats`` of one design: how much a run of the same
    plan moves on this machine (None with a single repeat). ``fit_rel_error`` is |predicted /
    measured - 1| after the fit: what the cost model still cannot express. ``planning_margin``
    turns them into the fraction of a latency bound the planner keeps free.
    """

    quantile: float
    repeats: int
    pairs: int  # (run, phase) pairs the quantiles are over
    repeat_rel_spread: float | None
    fit_rel_error: float

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if self.repeats < 1 or self.pairs < 1:
            raise ValueError(f"repeats and pairs must be >= 1, got {self.repeats} and {self.pairs}")
        for name in ("repeat_rel_spread", "fit_rel_error"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v < math.inf:  # inf made the margin inf / inf = NaN
                raise ValueError(f"{name} must be finite and >= 0, got {v}")

    def planning_margin(self) -> float:
        """Fraction of the bound to keep free: ``e / (1 + e)``, ``e = hypot(spread, fit error)``.

        A plan predicted at ``bound * (1 - m)`` and run ``(1 + e)`` slower than predicted lands
        exactly on the bound; the two errors are independent (noise of the machine, bias of the
        model), so they add in quadrature. Capped at ``MAX_AUTO_MARGIN``.
        """
        e = math.hypot(self.repeat_rel_spread or 0.0, self.fit_rel_error)
        return min(e / (1.0 + e), MAX_AUTO_MARGIN)


@dataclass(frozen=True)
class HardwareProfile(Contract):
    """Capacities, bandwidths, flop rates and per-layer fits of one machine."""

    SCHEMA: ClassVar[str] = "xsched.HardwareProfile/1"

    name: str
    source: Literal["measured", "preset"]
    fingerprint: Fingerprint
    compute_device: Literal["cuda", "cpu"]
    gpu_bytes: int
    cpu_bytes: int
    disk_bytes: int
    ctog: BandwidthCurve
    gtoc: BandwidthCurve
    dtoc: BandwidthCurve
    ctod: BandwidthCurve
    # Flop rates at compute-bound shapes the model uses: GEMM of a prefill chunk through an MLP
    # projection (mm) and prefill attention scores + weighted sum (bmm), on the compute device
    # and on the host CPU. Memory-bound steps (decode) use the roofs below via ``compute_s``.
    mm_flops: float
    bmm_flops: float
    cpu_mm_flops: float
    cpu_bmm_flops: float
    # Group-wise 4-bit (de)quantization on the compute device, in bytes of the uncompressed
    # tensor per second.
    quant_bytes_per_s: float
    dequant_bytes_per_s: float
    layer_fits: tuple[LayerFit, ...] = ()
    # Multiplicative time factors fitted from real runs (xsched calibrate); 1.0 = as measured.
    calibration: dict[str, float] = field(default_factory=dict)
    # How far real runs strayed from the calibrated prediction (xsched calibrate); None before.
    calibration_error: CalibrationError | None = None
    notes: str = ""
    # Measured logits products per model (``xsched profile --model``); the cost model falls back to
    # the roofs below without one.
    head_fits: tuple[HeadFit, ...] = ()
    # Memory roofs for the flop-rate model (0.0 = unknown): the read bandwidth of the compute
    # device's memory and of host RAM, as seen by a matrix-vector product over a large weight.
    # Decode-shaped GEMMs and attention are bound by these, not by the flop rates above.
    mem_bytes_per_s: float = 0.0
    cpu_mem_bytes_per_s: float = 0.0
    # On a CUDA host ctog/gtoc above use pinned host memory; these are the pageable rates.
    ctog_pageable: BandwidthCurve | None = None
    gtoc_pageable: BandwidthCurve | None = None
    compute_dtype: str = ""  # dtype of the GEMM/attention/layer measurements
    compute_threads: int = 0  # torch intra-op threads during the measurements (0 = unknown)
    disk_io: Literal["o_direct", "fadvise", ""] = ""  # how dtoc/ctod bypassed the page cache
    # KV-cache and activation rows in their offload file (4 KiB rows on reserved, never-written
    # space, page cache bypassed; 0.0 = unknown). The engine reads them one row at a time (drop +
    # read: ``disk_row_read_s`` each) and writes a store's rows, then flushes once (fdatasync +
    # drop): ``disk_sync_s`` per store plus ``disk_row_write_s`` per row. Latency, not
    # bandwidth, prices them.
    disk_row_write_s: float = 0.0
    disk_row_read_s: float = 0.0
    disk_sync_s: float = 0.0
    # Decode attention straight over a 4-bit KV cache on a CPU (``xrunner.kvattend``), in bytes of
    # the K and V attended over per second, counted in the compute dtype (0.0 = unknown: priced
    # as a dequantize pass, then attention over the float copy, as on a GPU).
    kv_attend_bytes_per_s: float = 0.0
    # Decode attention that the engine delegates to the host CPU (``xrunner.model.
    # attend_rows_on_cpu``: a half-precision cache converted to float32 a few rows at a time), in
    # bytes of the stored K and V attended over per second, one query head per kv head (0.0 =
    # unknown: priced by the host's float32 roofline, which misses the conversion; stop 39: a
    # bfloat16 cache took 2.5x the roofline's time on the 2-core VM).
    cpu_attend_bytes_per_s: float = 0.0
    # Per model, what a decode layer step saves when the layer's weights are in the CPU's cache
    # (``WarmFit``; measured on CPU compute devices only, none: nothing saved).
    warm_fits: tuple[WarmFit, ...] = ()
    # ModelSpec.cost_key of each model the fits above were measured for: a spec of another name
    # and the same key uses them (fit_name). Empty in profiles made before stop 65.
    fit_keys: dict[str, str] = field(default_factory=dict)
    created: str = ""  # ISO time of the measurement
    wall_s: float = 0.0  # how long the profiling took

    def __post_init__(self) -> None:
        for key in ("gpu_bytes", "cpu_bytes", "disk_bytes"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0")
        for key in ("mm_flops", "bmm_flops", "cpu_mm_flops", "cpu_bmm_flops", "quant_bytes_per_s",
                    "dequant_bytes_per_s"):
            if not 1 <= getattr(self, key) < math.inf:  # 1e-300 priced a step at inf seconds, then NaN
                raise ValueError(f"{key} must be a finite rate of at least 1 per second")
        for key in ("mem_bytes_per_s", "cpu_mem_bytes_per_s", "wall_s", "disk_row_write_s", "disk_row_read_s",
                    "disk_sync_s", "kv_attend_bytes_per_s", "cpu_attend_bytes_per_s"):
            v = getattr(self, key)
            if not 0 <= v < math.inf or (key.endswith("_per_s") and 0 < v < 1):
                raise ValueError(f"{key} must be finite and >= 0" + (" (0, or a rate of at least 1 per second)"
                                                                    if key.endswith("_per_s") else ""))
            if key.startswith("disk_") and v > MAX_TERM:
                raise ValueError(f"{key}={v:.4g} s is past any disk's latency (a finite number of at most {MAX_TERM:g} s)")
        if not isinstance(self.compute_threads, int) or self.compute_threads < 0:
            raise ValueError(f"compute_threads must be a whole number >= 0 (0: unknown), got {self.compute_threads!r}")
        for term, value in self.calibration.items():
            if not 0 <= value <= MAX_TERM:  # (1e20 overflowed the placement LP)
                raise ValueError(f"calibration term {term}={value:.4g} must be a finite number from 0 to {MAX_TERM:g} "
                                 "(a factor, or seconds)")

    def model_for(self, spec: "ModelSpec") -> "ModelSpec":
        """``spec`` in the dtype this machine computes in (float32 on a CPU host).

        Plans, simulations and runs on this machine use that dtype for weights, KV cache and
        activations, so byte counts and the per-layer fits (stored per dtype) line up.
        """
        if self.compute_dtype and self.compute_dtype != spec.dtype:
            return spec.with_dtype(self.compute_dtype)
        return spec

    def capacity_bytes(self, tier: str) -> int:
        return {"gpu": self.gpu_bytes, "cpu": self.cpu_bytes, "disk": self.disk_bytes}[tier]

    def bandwidth(self, channel: str) -> BandwidthCurve:
        if channel not in CHANNELS:
            raise KeyError(channel)
        return getattr(self, channel)

    def layer_fit(self, model: str, phase: str, dtype: str | None = None) -> LayerFit | None:
        for fit in self.layer_fits:
            if fit.model == model and fit.phase == phase and (dtype is None or fit.dtype == dtype):
                return fit
        return None

    def fit_name(self, spec: "ModelSpec") -> str:
        """The model name this profile's fits for ``spec`` are under: its own where it has any,
        else one measured for the same shape (``xsched profile --model FILE.gguf``, then a plan
        for the registry's name of it had priced from the flop rates)."""
        names = {f.model for fits in (self.layer_fits, self.head_fits, self.warm_fits) for f in fits}
        if spec.name in names or not self.fit_keys:
            return spec.name
        key = spec.cost_key()
        return next((n for n, k in sorted(self.fit_keys.items()) if k == key and n in names), spec.name)

    def unfitted_note(self, spec: "ModelSpec") -> str | None:
        """What a plan on this measured profile assumes when it has no layer fits for ``spec``
        (None where it has them, or for a preset, which never has any): its layers are then priced
        from the GEMM rates and memory roofs, and calibration factors fitted to another model's
        runs scale those (3x off for SmolLM2 under an opt-125m calibration)."""
        if self.source != "measured" or all(self.layer_fit(self.fit_name(spec), phase, spec.dtype)
                                            for phase in ("prefill", "decode")):
            return None
        have = sorted({f"{f.model} ({f.dtype})" for f in self.layer_fits}) or ["none"]
        return (f"profile {self.name!r} has no layer fits for {spec.name} ({spec.dtype}; it has: {', '.join(have)}), so "
                f"its layers are priced from the GEMM rates and memory roofs; measure them with `xsched profile "
                f"--model {spec.name}`")

    def head_fit(self, model: str, dtype: str | None = None) -> HeadFit | None:
        return _of_model(self.head_fits, model, dtype)

    def warm_fit(self, model: str, dtype: str | None = None) -> WarmFit | None:
        return _of_model(self.warm_fits, model, dtype)

    def calibration_factor(self, term: str) -> float:
        return float(self.calibration.get(term, 1.0))

    def compute_s(self, kind: str, flops: Any, read_bytes: Any = 0.0) -> Any:
        """Roofline time of one operation: ``max(flops / rate, read_bytes / memory roof)``.

        ``kind`` is ``mm`` or ``bmm`` (compute device) or ``cpu_mm`` or ``cpu_bmm`` (host CPU).
        The memory term is skipped when the profile does not know that roof (0.0). Works on
        floats and numpy arrays.
        """
        rate = {"mm": self.mm_flops, "bmm": self.bmm_flops, "cpu_mm": self.cpu_mm_flops,
                "cpu_bmm": self.cpu_bmm_flops}[kind]
        roof = self.cpu_mem_bytes_per_s if kind.startswith("cpu_") else self.mem_bytes_per_s
        t = flops / rate
        if roof > 0:
            mem_t = read_bytes / roof
            t = t + (mem_t - t) * (mem_t > t)  # max() that also works element-wise on arrays
        return t
