"""Per-layer sweeps: time the runner's own decoder layer over (batch, length) grids.

The simulator's compute time comes from these fits, so they time exactly the function the
runner calls — ``xrunner.model.layer_forward`` on weights resident on the compute device,
with a preallocated KV cache sliced the way the runner slices it — and not a copy of the
math. Prefill points run ``length`` new tokens (causal, cache written at 0..length); decode
points run one new token per row attending to ``length`` keys.

One KV buffer of the grid's largest (batch, length) is shared by all points of a phase, so
memory stays that of the largest point. The number of passes is chosen from a time budget
using a rough per-point estimate (FLOPs over the measured GEMM rate, bytes over the memory
roof); points that would not fit the budget even with the minimum passes are dropped, the
most expensive first, and reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from xprofiler.samples import Point, Row, sample_meta, summarize_by
from xprofiler.profile import HeadFit, LayerFit
from xprofiler.specs import ModelSpec

PHASES: tuple[str, ...] = ("prefill", "decode")
CALL_OVERHEAD_S = 3e-4  # rough fixed cost of one layer call on the CPU, for budgeting only
MIN_SAMPLE_S = 0.05  # short layer steps are repeated back-to-back up to about this long per sample


@dataclass(frozen=True)
class Grid:
    """Batch sizes and lengths (prompt length for prefill, context length for decode)."""

    batches: tuple[int, ...]
    lengths: tuple[int, ...]

    def points(self, max_length: int) -> list[tuple[int, int]]:
        return [(b, n) for b in self.batches for n in self.lengths if n <= max_length]


QUICK_GRIDS: dict[str, Grid] = {
    "prefill": Grid((1, 2, 4, 8), (16, 64, 256, 512)),
    "decode": Grid((1, 2, 3, 4, 8, 16, 32, 64), (128, 512, 2048)),
}
FULL_GRIDS: dict[str, Grid] = {
    "prefill": Grid((1, 2, 4, 8, 16), (16, 32, 64, 128, 256, 512, 1024)),
    "decode": Grid((1, 2, 4, 8, 16, 32, 64, 128), (64, 128, 256, 512, 1024, 2048, 4096)),
}


def estimate_s(spec: ModelSpec, phase: str, batch: int, length: int, flops_per_s: float,
               mem_bytes_per_s: float, dtype_bytes: int) -> float:
    """Rough seconds of one layer step, only to budget the sweep (not stored anywhere)."""
    if phase == "prefill":
        flops = spec.prefill_flops_per_layer(batch, length)
        kv = 0
    else:
        flops = spec.decode_flops_per_layer(batch, length)
        kv = batch * length * 2 * spec.kv_dim * dtype_bytes
    weights = spec.params_per_layer * dtype_bytes
    return CALL_OVERHEAD_S + flops / flops_per_s + (weights + kv) / mem_bytes_per_s


def sample_counts(estimates_s: dict[tuple[int, int], float], min_sample_s: float = MIN_SAMPLE_S
                  ) -> dict[tuple[int, int], int]:
    """Calls per sample so that each sample lasts about ``min_sample_s`` (at least one call)."""
    return {p: max(1, math.ceil(min_sample_s / est)) for p, est in estimates_s.items()}


def plan_points(spec: ModelSpec, phase: str, grid: Grid, budget_s: float, flops_per_s: float,
                mem_bytes_per_s: float, dtype_bytes: int, min_passes: int, max_passes: int, warmup: int,
                kv_limit_bytes: float, min_sample_s: float = MIN_SAMPLE_S,
                ) -> tuple[dict[tuple[int, int], int], int, list[tuple[int, int]]]:
    """Grid points to time (each with its calls per sample), passes, and the points dropped.

    A point is dropped when its KV cache exceeds ``kv_limit_bytes`` or when the grid would not
    fit the budget with ``min_passes`` (the most expensive points go first).
    """
    pts = grid.points(spec.max_positions)
    kv_per_token = 2 * spec.kv_dim * dtype_bytes
    dropped = [p for p in pts if p[0] * p[1] * kv_per_token > kv_limit_bytes]
    pts = [p for p in pts if p not in dropped]
    est = {p: estimate_s(spec, phase, *p, flops_per_s, mem_bytes_per_s, dtype_bytes) for p in pts}
    counts = sample_counts(est, min_sample_s)
    cost = {p: est[p] * counts[p] for p in pts}
    pts.sort(key=lambda p: cost[p])
    while pts and sum(cost[p] for p in pts) * (min_passes + warmup) > budget_s:
        dropped.append(pts.pop())
    total = sum(cost[p] for p in pts)
    passes = int(np.clip(budget_s / total - warmup, min_passes, max_passes)) if total > 0 else min_passes
    return {p: counts[p] for p in sorted(pts)}, passes, sorted(dropped)


def layer_points(spec: ModelSpec, phase: str, points: Sequence[tuple[int, int]] | dict[tuple[int, int], int],
                 device: Any, dtype: str, seed: int = 0) -> list[Point]:
    """One ``Point`` per (batch, length) calling ``xrunner.model.layer_forward``.

    ``points`` may map each (batch, length) to its calls per sample (from ``plan_points``).
    """
    counts = points if isinstance(points, dict) else {p: 1 for p in points}
    import torch

    from xrunner.loaders import RandomSource
    from xrunner.model import layer_forward, rope_tables, torch_dtype

    tdt = torch_dtype(dtype)
    spec = spec.with_dtype(dtype)
    weights = {k: v.to(device) for k, v in RandomSource(spec, seed=seed).load_layer(0).items()}
    b_max = max(b for b, _ in counts)
    t_max = max(n for _, n in counts)
    shape = (b_max, spec.num_kv_heads, t_max, spec.head_dim)
    k_cache = torch.zeros(shape, dtype=tdt, device=device)
    v_cache = torch.zeros(shape, dtype=tdt, device=device)
    rope = rope_tables(spec, t_max, device, tdt)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for (b, n), count in counts.items():
        t, start = (n, 0) if phase == "prefill" else (1, n - 1)
        hidden = torch.randn(b, t, spec.hidden, generator=gen).to(device=device, dtype=tdt)
        mask = torch.ones(b, n, dtype=torch.bool, device=device)
        pos = torch.arange(start, start + t, device=device).expand(b, t)
        kc, vc = k_cache[:b], v_cache[:b]

        def step(hidden: Any = hidden, pos: Any = pos, kc: Any = kc, vc: Any = vc, mask: Any = mask,
                 start: int = start) -> Any:
            with torch.inference_mode():
                return layer_forward(spec, weights, hidden, pos, rope, kc, vc, mask, start)

        out.append(Point(sample_meta("layer", model=spec.name, phase=phase, dtype=dtype, batch=b, length=n,
                               shape=f"{b}x{n}", count=count), step))
    return out


def point_times(rows: Sequence[Row], model: str, phase: str, stat: str = "median"
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batch, length, seconds) per measured grid point of one model and phase."""
    mine = [r for r in rows if r["bench"] == "layer" and r["model"] == model and r["phase"] == phase]
    med = summarize_by(mine, "shape", lambda r: r["time_s"] / r["count"], stat)
    first = {r["shape"]: (r["batch"], r["length"]) for r in mine}
    keys = sorted(med, key=lambda k: first[k])
    b = np.array([first[k][0] for k in keys], dtype=float)
    n = np.array([first[k][1] for k in keys], dtype=float)
    return b, n, np.array([med[k] for k in keys])


def fit_sweeps(spec: ModelSpec, rows: Sequence[Row], dtype: str, samples_csv: str = "", stat: str = "median"
               ) -> list[LayerFit]:
    """One ``LayerFit`` per phase that has samples for ``spec``."""
    from xprofiler.fit import fit_layer  # scipy: only when fitting

    fits = []
    for phase in PHASES:
        b, n, t = point_times(rows, spec.name, phase, stat)
        if len(t):
            fits.append(fit_layer(spec, phase, b, n, t, model=spec.name, dtype=dtype, samples_csv=samples_csv))
    return fits


HEAD_ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)  # rows of the logits products timed per model


def head_points(spec: ModelSpec, device: Any, dtype: str, rows: Sequence[int] = HEAD_ROWS, seed: int = 0
                ) -> list[Point]:
    """One ``Point`` per (row count, layout) for the model's logits product, random weights.

    On a CPU both layouts of ``xrunner.model.head_layouts`` are timed, because the runner keeps the
    faster one (``cpu_head_layout``); on CUDA only the stored one, which the runner keeps there.
    """
    import torch

    from xrunner.model import head_layouts, head_product_points, torch_dtype

    gen = torch.Generator(device="cpu").manual_seed(seed)
    matrix = (torch.randn(spec.vocab_size, spec.hidden, generator=gen) * 0.02).to(device=device,
                                                                                  dtype=torch_dtype(dtype))
    layouts = head_layouts(matrix) if matrix.device.type == "cpu" else {"rows": matrix}
    return head_product_points(layouts, rows, seed=seed, model=spec.name, dtype=dtype)


def fit_head(spec: ModelSpec, rows: Sequence[Row], dtype: str, stat: str = "median") -> HeadFit | None:
    """The model's ``HeadFit`` from its ``head`` samples: per row count, the faster layout's time."""
    from xrunner.model import head_point_of

    mine = [r for r in rows if r["bench"] == "head" and r["model"] == spec.name and r["dtype"] == dtype]
    if not mine:
        return None
    best: dict[int, tuple[float, str]] = {}
    for shape, t in summarize_by(mine, "shape", lambda r: r["time_s"] / r["count"], stat).items():
        layout, r = head_point_of(shape)
        if r not in best or t < best[r][0]:
            best[r] = (t, layout)
    counts = sorted(best)
    return HeadFit(model=spec.name, dtype=dtype, rows=tuple(counts), seconds=tuple(best[r][0] for r in counts),
                   layouts=tuple(best[r][1] for r in counts))


def describe_dropped(model: str, phase: str, dropped: Sequence[tuple[int, int]]) -> str:
    if not dropped:
        return ""
    shown = ", ".join(f"{b}x{n}" for b, n in dropped[:6]) + (" ..." if len(dropped) > 6 else "")
    return f"{model} {phase}: {len(dropped)} grid point(s) skipped for time or memory ({shown})"


def resolve_spec(model: str | ModelSpec) -> ModelSpec:
    """A ModelSpec, registry name (``random:`` prefix allowed), HF directory/config.json or .gguf file.

    Only the shape matters for timing: sweeps run on random weights of that shape.
    """
    from pathlib import Path

    from xprofiler.specs import get_model_spec

    if isinstance(model, ModelSpec):
        return model
    text = str(model).removeprefix("random:")
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSpec.from_gguf(path)
    return get_model_spec(text)
