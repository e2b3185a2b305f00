"""An independent plain-torch model of the 4-bit format, for tests to compare the engine against.

Written from the format's definition (groups of ``group`` values along ``dim``; per group a
range [lo, hi] -> step (hi - lo) / 15, code round((x - lo) / step) in 0..15, value lo + code * step;
the range kept is the least-squared-error one among [min, max] and ``steps`` shrinks of it about
its centre down to ``min_shrink``), not from ``xrunner.compression``'s code. float32 only.
"""

from __future__ import annotations

import torch


def reference_roundtrip(x: torch.Tensor, dim: int, group: int = 64, steps: int = 10,
                        min_shrink: float = 0.7) -> torch.Tensor:
    """``x`` after 4-bit quantization and back (float32)."""
    moved = x.float().movedim(dim, -1)
    n = moved.shape[-1]
    pad = -n % group
    padded = torch.cat([moved, moved[..., -1:].repeat_interleave(pad, dim=-1)], dim=-1)
    g = padded.unflatten(-1, (padded.shape[-1] // group, group))
    real = torch.arange(padded.shape[-1]).unflatten(0, (-1, group)) < n
    lo, hi = g.min(dim=-1, keepdim=True).values, g.max(dim=-1, keepdim=True).values
    ranges = [(lo, hi)]
    for i in range(1, steps + 1):
        a = 1.0 - (1.0 - min_shrink) * i / steps
        ranges.append(((lo + hi) / 2 - a * ((hi - lo) / 2), (lo + hi) / 2 + a * ((hi - lo) / 2)))
    best, best_err = None, None
    for a, b in ranges:
        step = (b - a) / 15
        code = torch.where(step > 0, torch.round((g - a) / torch.where(step > 0, step, 1.0)), 0.0).clamp(0, 15)
        y = a + code * step
        err = (((y - g) ** 2) * real).sum(dim=-1, keepdim=True)
        if best is None:
            best, best_err = y, err
        else:
            take = err < best_err
            best, best_err = torch.where(take, y, best), torch.where(take, err, best_err)
    out = best.flatten(-2)[..., :n]
    return out.movedim(-1, dim).to(x.dtype)


def reference_gptq(w: torch.Tensor, hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """``w [out, in]`` rounded column by column with optimal-brain-quantizer updates (float64).

    Columns go largest Hessian diagonal first; each is rounded, as the earlier columns' updates
    left it, by :func:`reference_roundtrip` along the rows (its own range search per group of 64
    rows), and its error moves the columns not yet rounded by ``-err / Hinv[c, c] * Hinv[c, :]``,
    after which column ``c`` is eliminated from the inverse Hessian (the OBS formulas, not GPTQ's
    Cholesky form). Returns the rounded weight.
    """
    W = w.double().clone()
    H = hessian.double().clone()
    dead = torch.diagonal(H) <= 0
    H[dead, dead] = 1.0
    H += damp * torch.diagonal(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    hinv = torch.linalg.inv(H)
    for c in torch.argsort(torch.diagonal(H), descending=True).tolist():
        q = reference_roundtrip(W[:, c:c + 1].float(), dim=0)[:, 0].double()
        err = (W[:, c] - q) / hinv[c, c]
        W -= err[:, None] * hinv[c][None, :]
        W[:, c] = q
        hinv -= hinv[:, c:c + 1] @ hinv[c:c + 1, :] / hinv[c, c]
    return W.float()
