"""Per-layer sweeps: time the runner's own decoder layer over (batch, length) grids.

The simulator's compute time comes from these fits, so they time exactly the function the
runner calls — ``xrunner.model.layer_forward`` on weights resident on the compute device,
with a preallocated KV cache sliced the way the runner slices it — and not a copy of the
math. Prefill points run ``length`` new tokens (causal, cache written at 0..length); decode
points run one new token per row attending to ``length`` keys.

Calls rotate through distinct copies of their operands (layers' weights, KV caches, LM head
matrices) until the copies together are twice the device's last-level cache: in a run, the other
layers pass through the cache between two uses of one layer, so its weights come from memory.
Timing one layer's weights over and over would leave a small model's layer in a large cache
(a 28 MB opt-125m layer in this VM's 260 MB L3) and price its decode 1.2-1.9x too cheap. The
copies never exceed the model's own layer count, so a model that does fit the cache stays warm
as it does in a run, and the KV copies share one pool sized for the costliest point, so memory
stays about that of the largest point or twice the cache, whichever is more.

The number of passes is chosen from a time budget using a rough per-point estimate (FLOPs over
the measured GEMM rate, bytes over the memory roof); points that would not fit the budget even
with the minimum passes are dropped, the most expensive first, and reported.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from xprofiler.samples import Point, Row, sample_meta, summarize_by
from xprofiler.profile import HeadFit, LayerFit, WarmFit
from xprofiler.specs import ModelSpec

PHASES: tuple[str, ...] = ("prefill", "decode")
CALL_OVERHEAD_S = 3e-4  # rough fixed cost of one layer call on the CPU, for budgeting only
MIN_SAMPLE_S = 0.05  # short layer steps are repeated back-to-back up to about this long per sample
FALLBACK_CACHE_BYTES = 256 << 20  # a CPU whose sysfs names no cache: the largest L3 seen on the project's VMs


@dataclass(frozen=True)
class Grid:
    """Batch sizes and lengths (prompt length for prefill, context length for decode).

    ``max_tokens`` (batch x length) trims the rectangle's costly corner, so that large batches
    can be measured at the short lengths plans give them. The fit holds its edge correction past
    the last batch, and that edge was wrong there: at 2048 tokens an opt-125m prefill layer of
    16-64 short prompts ran 1.14-1.16 x the linear model, of 4-8 long ones 1.05-1.10 (2-core
    VM), so a grid ending at 8 rows priced a 32 x 64 prefill 8-10% short.
    """

    batches: tuple[int, ...]
    lengths: tuple[int, ...]
    max_tokens: int | None = None

    def points(self, max_length: int) -> list[tuple[int, int]]:
        return [(b, n) for b in self.batches for n in self.lengths
                if n <= max_length and (self.max_tokens is None or b * n <= self.max_tokens)]


# Decode batches between the powers of two too: a partly finished batch decodes with any row
# count, and the layer's time is not monotone in rows (smollm2-135m at 256 positions on the 2-core
# VM: 8 rows 4.0 ms, 12 rows 5.0 ms, 16 rows 3.8 ms), which interpolating between powers of two
# missed by 13% at 10-12 rows.
# Decode rows up to 256: offloading plans decode 128-256 rows at once, and the GEMM rate still
# rises there (fp32, 2-core VM: 1024 x 4096 at 64 rows 210 GFLOP/s, 192 rows 228, 512 rows 301);
# ``max_tokens`` keeps those rows to the short contexts they are planned with. The 32-position
# column pins each batch's attention-free part: the fit's one linear_flops rate over-prices a
# 192-row plan's projections, and at short contexts the fit gave attention too large a share,
# which CPU-attention plans (priced without it) were predicted fast by (stop 30, sim_vs_run:
# +7-13% -> +5-11%). At stop 29 the column priced small batches 10-15% slow, because a block's
# later batches, warm in the cache, were not priced warm yet (``WarmFit``); docs/BENCHMARKS.md.
# Prefill rows up to 256 (at short prompts; ``max_tokens`` 8192): an offloading plan prefills its
# whole block at once, 192 x 32 in benchmarks/offload_vs_accelerate.py, and a grid ending at 32
# rows held the 32-row correction there and priced that layer 8% short (float32 0.51B OPT, 2-core
# VM, benchmarks/profile_accuracy.py --compare-prefill-rows 32; -0% with these rows).
QUICK_GRIDS: dict[str, Grid] = {
    "prefill": Grid((1, 2, 4, 8, 16, 32, 64, 128, 256), (16, 64, 256, 512), max_tokens=8192),
    "decode": Grid((1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256), (32, 128, 512, 2048),
                   max_tokens=131072),
}
FULL_GRIDS: dict[str, Grid] = {
    "prefill": Grid((1, 2, 4, 8, 16, 32, 64, 128, 256), (16, 32, 64, 128, 256, 512, 1024), max_tokens=16384),
    "decode": Grid((1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256),
                   (64, 128, 256, 512, 1024, 2048, 4096), max_tokens=524288),
}

# A GPU runs the CPU grids' layers in about the time it takes to launch their kernels. On the
# H100 of stop 31 every quick-grid layer of opt-125m and opt-1.3b took 0.3-0.6 ms, so the fits
# were a constant with a linear-flops rate of 3.4-4.1 PFLOP/s (four times the chip's peak) and
# would price a large prefill several times too fast. The GPU grids add the compute-bound
# shapes GPU plans run: prefill up to 64K tokens a call, decode up to 512 rows.
CUDA_QUICK_GRIDS: dict[str, Grid] = {
    "prefill": Grid((1, 2, 4, 8, 16, 32, 64, 128, 256), (16, 64, 256, 512, 1024), max_tokens=65536),
    "decode": Grid((1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512),
                   (32, 128, 512, 2048), max_tokens=262144),
}
CUDA_FULL_GRIDS: dict[str, Grid] = {
    "prefill": Grid((1, 2, 4, 8, 16, 32, 64, 128, 256), (16, 32, 64, 128, 256, 512, 1024, 2048),
                    max_tokens=262144),
    "decode": Grid((1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024),
                   (64, 128, 256, 512, 1024, 2048, 4096), max_tokens=1048576),
}


def cache_bytes_of(device: Any) -> int:
    """The compute device's last-level cache: a CUDA GPU's L2, else the CPU's largest level."""
    import torch

    from xprofiler.fingerprint import last_level_cache_bytes

    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).L2_cache_size)
    return last_level_cache_bytes() or FALLBACK_CACHE_BYTES


def rotation_copies(call_bytes: float, cache_bytes: float, limit: int) -> int:
    """Copies of one call's operands to cycle through so that together they are at least twice
    ``cache_bytes`` (each call then reads its operands from memory), at least one and at most
    ``limit``, the number of distinct ones a run cycles through itself."""
    need = math.ceil(2 * cache_bytes / call_bytes) if call_bytes > 0 else 1
    return int(min(max(limit, 1), max(need, 1)))


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
    fit the budget with ``min_passes`` (the most expensive points go first, never the cheapest of
    the two shortest lengths).
    """
    pts = grid.points(spec.max_positions)
    kv_per_token = 2 * spec.kv_dim * dtype_bytes
    dropped = [p for p in pts if p[0] * p[1] * kv_per_token > kv_limit_bytes]
    pts = [p for p in pts if p not in dropped]
    est = {p: estimate_s(spec, phase, *p, flops_per_s, mem_bytes_per_s, dtype_bytes) for p in pts}
    counts = sample_counts(est, min_sample_s)
    cost = {p: est[p] * counts[p] for p in pts}
    pts.sort(key=lambda p: cost[p])
    # A fit tells attention from the rest of a layer only across lengths: from one length its
    # linear_flops and attn_flops columns are proportional, it keeps attn_flops, and priced a
    # prefill of 512 tokens 29x slow from a grid of 16 (two models of 30-70B on a 2-core CPU
    # under --quick). The cheapest point of each of the two shortest lengths stays.
    shortest = sorted({n for _, n in pts})[:2]
    keep = {min((p for p in pts if p[1] == n), key=cost.__getitem__) for n in shortest} if len(shortest) > 1 else set()
    while len(pts) > len(keep) and sum(cost[p] for p in pts) * (min_passes + warmup) > budget_s:
        drop = next(p for p in reversed(pts) if p not in keep)
        pts.remove(drop)
        dropped.append(drop)
    total = sum(cost[p] for p in pts)
    passes = int(np.clip(budget_s / total - warmup, min_passes, max_passes)) if total > 0 else min_passes
    return {p: counts[p] for p in sorted(pts)}, passes, sorted(dropped)


def layer_points(spec: ModelSpec, phase: str, points: Sequence[tuple[int, int]] | dict[tuple[int, int], int],
                 device: Any, dtype: str, seed: int = 0, cache_bytes: int | None = None,
                 warm: bool = False) -> list[Point]:
    """One ``Point`` per (batch, length) calling ``xrunner.model.layer_forward``.

    ``points`` may map each (batch, length) to its calls per sample (from ``plan_points``).
    Successive calls of a point use distinct layers' weights and KV caches (``rotation_copies``
    against ``cache_bytes``, by default the device's: ``cache_bytes_of``); the point's
    ``copies`` column says how many. With ``warm`` (bench ``warm``, for ``WarmFit``), each point
    comes twice, shapes ``cold:BxN`` as above and ``warm:BxN`` with one layer's weights reused
    by every call (the KV caches still rotate).
    """
    counts = points if isinstance(points, dict) else {p: 1 for p in points}
    import torch

    from xrunner.loaders import RandomSource
    from xrunner.model import layer_forward, layer_ropes, torch_dtype

    tdt = torch_dtype(dtype)
    spec = spec.with_dtype(dtype)
    cache = cache_bytes_of(device) if cache_bytes is None else cache_bytes
    kv_elems = {p: 2 * p[0] * p[1] * spec.kv_dim for p in counts}  # K and V of one call
    copies = {p: rotation_copies(spec.weight_bytes_per_layer + kv_elems[p] * tdt.itemsize, cache, spec.num_layers)
              for p in counts}
    source = RandomSource(spec, seed=seed)
    weights = [{k: v.to(device) for k, v in source.load_layer(i).items()} for i in range(max(copies.values()))]
    pool = torch.zeros(max(copies[p] * kv_elems[p] for p in counts), dtype=tdt, device=device)
    # copy j stands for layer j, as its own kind (a Gemma's windowed or full attention, rotary base)
    specs = spec.layer_specs()
    ropes = layer_ropes(spec, max(n for _, n in counts), device, tdt)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for (b, n), count in counts.items():
        t, start = (n, 0) if phase == "prefill" else (1, n - 1)
        hidden = torch.randn(b, t, spec.hidden, generator=gen).to(device=device, dtype=tdt)
        mask = torch.ones(b, n, dtype=torch.bool, device=device)
        pos = torch.arange(start, start + t, device=device).expand(b, t)
        shape = (b, spec.num_kv_heads, n, spec.head_dim)
        half = kv_elems[(b, n)] // 2
        for tag in ("cold:", "warm:") if warm else ("",):
            ops = itertools.cycle([(weights[0 if tag == "warm:" else j], specs[j % len(specs)],
                                    ropes[j % len(ropes)],
                                    pool[2 * j * half:(2 * j + 1) * half].view(shape),
                                    pool[(2 * j + 1) * half:(2 * j + 2) * half].view(shape))
                                   for j in range(copies[(b, n)])])

            def step(hidden: Any = hidden, pos: Any = pos, mask: Any = mask, start: int = start,
                     ops: Any = ops) -> Any:
                w, s, rope, kc, vc = next(ops)
                # a windowed layer's decode step reads its window only, as the runner's does
                lo = max(start + 1 - s.sliding_window, 0) if start and s.sliding_window else 0
                with torch.inference_mode():
                    return layer_forward(s, w, hidden, pos, rope, kc[:, :, lo:], vc[:, :, lo:], mask[:, lo:],
                                         start - lo)

            out.append(Point(sample_meta("warm" if warm else "layer", model=spec.name, phase=phase, dtype=dtype,
                                         batch=b, length=n, shape=f"{tag}{b}x{n}", count=count,
                                         copies=copies[(b, n)]), step))
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


def head_points(spec: ModelSpec, device: Any, dtype: str, rows: Sequence[int] = HEAD_ROWS, seed: int = 0,
                cache_bytes: int | None = None) -> list[Point]:
    """One ``Point`` per (row count, layout) for the model's logits product, random weights.

    On a CPU both layouts of ``xrunner.model.head_layouts`` are timed, because the runner keeps the
    faster one (``cpu_head_layout``); on CUDA only the stored one, which the runner keeps there.
    Calls rotate through copies of the matrix (``rotation_copies``, at most as many as the
    model's weights hold heads: the layers pass through the cache between two heads of a run).
    """
    import torch

    from xrunner.model import head_layouts, head_product_points, torch_dtype

    cache = cache_bytes_of(device) if cache_bytes is None else cache_bytes
    head_bytes = spec.vocab_size * spec.hidden * torch_dtype(dtype).itemsize
    copies = rotation_copies(head_bytes, cache, math.ceil(spec.with_dtype(dtype).weight_bytes / head_bytes))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    matrix = (torch.randn(spec.vocab_size, spec.hidden, generator=gen) * 0.02).to(device=device,
                                                                                  dtype=torch_dtype(dtype))
    mats = [matrix] + [matrix.clone() for _ in range(copies - 1)]
    if matrix.device.type == "cpu":
        per = [head_layouts(m) for m in mats]
        layouts = {name: [p[name] for p in per] for name in per[0]}
    else:
        layouts = {"rows": mats}
    return head_product_points(layouts, rows, seed=seed, model=spec.name, dtype=dtype, copies=copies)


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


# Decode rows at which ``WarmFit`` is timed, at the decode grid's shortest context.
WARM_ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def fit_warm(spec: ModelSpec, rows: Sequence[Row], dtype: str, stat: str = "median") -> WarmFit | None:
    """The model's ``WarmFit`` from its ``warm`` samples: per row count, cold minus warm seconds
    (at least 0: a saving below the noise is none), made non-increasing in rows by isotonic
    regression. A step saves the time its weights' reads from memory are not hidden behind its
    products, which more rows can only shrink; single differences are noisy, and on stop 70's
    AMX host one of 2.7 ms at 128 rows, between 0 at 64 and at 256, priced 128 x 2 GPU batches
    ahead of one of 256 rows, which ran 24-29% faster (stop 71)."""
    mine = [r for r in rows if r["bench"] == "warm" and r["model"] == spec.name and r["dtype"] == dtype]
    times = summarize_by(mine, "shape", lambda r: r["time_s"] / r["count"], stat)
    pairs = {int(r["batch"]): tuple(times.get(f"{t}:{r['batch']}x{r['length']}") for t in ("cold", "warm"))
             for r in mine}
    counts = sorted(b for b, (cold, warm) in pairs.items() if cold is not None and warm is not None)
    if not counts:
        return None
    from scipy.optimize import isotonic_regression

    saved = isotonic_regression([max(0.0, pairs[b][0] - pairs[b][1]) for b in counts], increasing=False).x
    return WarmFit(model=spec.name, dtype=dtype, rows=tuple(counts), saved_s=tuple(float(x) for x in saved))


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
