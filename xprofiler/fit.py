"""Fit per-layer step times to an inspectable linear model in FLOPs and bytes.

A measured sweep gives the time of one prefill or decode layer at a grid of (batch, length)
points. The simulator needs times everywhere, including outside the grid, so we fit
``time = sum_i coef_i * feature_i`` over ``layer_features`` (constant, tokens, linear FLOPs,
attention FLOPs, KV bytes) with non-negative coefficients: each coefficient reads as seconds
per unit (1 / coef is a rate), nothing can predict a negative time, and the fit extrapolates
linearly in work. Rows are weighted by 1 / time so the fit minimises relative error, which
is what the plan's accuracy goal is stated in. What a linear model in work cannot express
(cache effects, kernel switches) is kept as a measured/linear ratio on the grid nodes, which
``LayerFit.predict_s`` interpolates.

No torch here: fits are refit and inspected by tools that must not need it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.optimize import nnls

from xprofiler.profile import LAYER_FEATURES, LayerFit, layer_features

# Two feature columns whose ratio varies by less than this are treated as the same column.
COLLINEAR_RTOL = 1e-9


def feature_matrix(spec: Any, phase: str, batch: Any, length: Any,
                   names: tuple[str, ...] | None = None) -> np.ndarray:
    """Rows = samples, columns = the named features (``LAYER_FEATURES[phase]`` by default)."""
    names = names or LAYER_FEATURES[phase]
    b = np.asarray(batch, dtype=float)
    n = np.asarray(length, dtype=float)
    feats = layer_features(spec, phase, b, n)
    return np.column_stack([np.broadcast_to(np.asarray(feats[k], dtype=float), b.shape) for k in names])


def independent_columns(x: np.ndarray, names: tuple[str, ...]) -> tuple[str, ...]:
    """Drop columns that are a constant multiple of an earlier one (or all zero).

    For one model, ``tokens`` and ``linear_flops`` are proportional (and so are decode's
    ``attn_flops`` and ``kv_bytes``); keeping both would make the split between them arbitrary.
    The last of each proportional group is kept (``linear_flops`` over ``tokens``, ``kv_bytes``
    over ``attn_flops``), so 1 / coefficient reads as a GEMM rate or a KV bandwidth.
    """
    keep: list[int] = []
    for j in reversed(range(x.shape[1])):
        col = x[:, j]
        if not np.any(col):
            continue
        dup = False
        for i in keep:
            ratio = col / np.where(x[:, i] == 0, np.nan, x[:, i])
            if np.all(np.isfinite(ratio)) and np.ptp(ratio) <= COLLINEAR_RTOL * abs(ratio[0]):
                dup = True
                break
        if not dup:
            keep.append(j)
    return tuple(names[j] for j in sorted(keep))


def nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the sum of squared relative errors ``(x@c - y) / y``."""
    w = x / y[:, None]
    scale = np.abs(w).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(w / scale, np.ones_like(y))
    return coef / scale


def relative_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return np.abs(np.asarray(predicted, dtype=float) - measured) / measured


def grid_ratio(batch: np.ndarray, length: np.ndarray, measured: np.ndarray, linear: np.ndarray
               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[float, ...], ...]]:
    """``measured / linear`` on the rectangle of distinct batches x lengths.

    A node that was not measured (skipped for time or memory) takes the ratio of the nearest
    measured node in (log batch, log length), so the correction stays continuous there.
    """
    bs = sorted({int(b) for b in batch})
    ns = sorted({int(n) for n in length})
    known = {(int(b), int(n)): m / lin for b, n, m, lin in zip(batch, length, measured, linear)}
    pts = np.log(np.array(list(known), dtype=float))
    vals = list(known.values())
    rows = []
    for b in bs:
        row = []
        for n in ns:
            if (b, n) in known:
                row.append(float(known[(b, n)]))
            else:
                d = np.hypot(*(pts - np.log([b, n])).T)
                row.append(float(vals[int(np.argmin(d))]))
        rows.append(tuple(row))
    return tuple(bs), tuple(ns), tuple(rows)


def fit_layer(spec: Any, phase: str, batch: Any, length: Any, time_s: Any, *, model: str, dtype: str,
              samples_csv: str = "", correct: bool = True) -> LayerFit:
    """Fit one phase of one model (one sample per grid point, e.g. the median over passes).

    With ``correct`` the fit also stores the measured/linear ratio on the grid (see
    ``LayerFit``). The stored errors are in-sample relative errors of the linear part.

    Byte features are counted in ``dtype``, the precision the samples were timed in, as every
    reader's spec (``HardwareProfile.model_for``) counts them: a registry spec in float16 once
    fitted a CPU's float32 decode on half its KV bytes, and the cost model priced long-context
    decode up to 1.8x slow.
    """
    spec = spec.with_dtype(dtype) if spec.dtype != dtype else spec
    b = np.asarray(batch, dtype=float).ravel()
    n = np.asarray(length, dtype=float).ravel()
    y = np.asarray(time_s, dtype=float).ravel()
    if not (len(b) == len(n) == len(y)):
        raise ValueError("batch, length and time_s differ in length")
    if len(y) == 0 or np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise ValueError("a fit needs at least one sample and positive finite times")
    names = independent_columns(feature_matrix(spec, phase, b, n), LAYER_FEATURES[phase])
    x = feature_matrix(spec, phase, b, n, names)
    coef = nnls_relative(x, y)
    linear = x @ coef
    if np.any(linear <= 0):
        raise ValueError("the linear fit predicts a non-positive time; measure more points")
    err = relative_errors(linear, y)
    grid = grid_ratio(b, n, y, linear) if correct else ((), (), ())
    return LayerFit(model=model, phase=phase, dtype=dtype, features=names,  # type: ignore[arg-type]
                    coef=tuple(float(c) for c in coef), n_samples=int(len(y)),
                    median_rel_error=float(np.median(err)), max_rel_error=float(np.max(err)),
                    samples_csv=samples_csv, grid_batches=grid[0], grid_lengths=grid[1], grid_ratio=grid[2])
