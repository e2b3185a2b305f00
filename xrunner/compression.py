"""Group-wise asymmetric 4-bit quantization (FlexGen §5) for weights and KV cache.

Values are cut into groups of ``group_size`` consecutive elements along one dimension (FlexGen
groups weights along the output channels and the KV cache along the head dimension). Each
group stores a minimum and a scale; a value becomes ``round((x - min) / scale)`` clamped to
0..15, and two values share a byte. Dequantization is ``min + q * scale``. A constant group has
scale 0 and dequantizes exactly to its value (no division by zero).

How each group's range is chosen is a pack-time decision that leaves the stored bytes and the
dequant path unchanged. Plain min/max (``clip_steps=0``, the KV cache's rule) covers every
value, so the error per value is at most ``scale / 2``. The default (weights) searches
``clip_steps`` ranges shrunk about the centre of [min, max] and keeps, per group, the one with
the least squared error of the values as dequantized (min/max itself is a candidate, so the
group's error never grows): one outlier no longer stretches the step of its 63 neighbours. On
SmolLM2-135M this cuts the perplexity cost of 4-bit weights from +40.9% to +23.6%
(benchmarks/compression_ppl.py).

Both are rotated before they are quantized (:func:`hadamard_rotation`, orthonormal Hadamard
matrices, QuaRot-style incoherence processing), so that one outlier is spread over its group
instead of stretching the group's step. Weights: each group of 64 output rows is multiplied by
one (:func:`rotate_groups`); the layer's output is rotated back per block (``model.linear``),
64 multiply-adds per output value. KV cache: each head's vector; attention is invariant to it
(``(qR)(kR)^T = qk^T``, and attending to rotated values gives the output rotated), so the
engine rotates the query and un-rotates the output instead of un-rotating the cache
(``KVCodec.attend``). The MLP's output projection also has its input channels rotated per
512 (:func:`rotate_inputs`, ``stored_forms.WeightLayout.in_rotated``), since its input activation
has outlier channels. :func:`gptq_quantize` chooses the codes with GPTQ, each column's ranges
searched as here on its updated values (``xrunner.gptq`` feeds it calibration text). On
SmolLM2-135M, 4-bit weights cost +9.9% perplexity rotated (+23.6% not) and +2.9% with GPTQ on
top (4 windows; +4.4% on 16, a mean over calibration draws); the 4-bit KV cache +2.4% rotated
(+7.0% not), +0.5% also centered on calibration means (``stored_forms.KVCodec``)
(benchmarks/compression_ppl.py; docs/BENCHMARKS.md).

Used by the engine to store and move compressed tensors, and by the profiler to time
(de)quantization; everything is vectorised torch, on whatever device the tensor lives, except on a
CPU, where min/max quantization (every KV cache write) makes its float32 copy and its codes with
numba kernels, and decode attention reads a 4-bit cache without dequantizing it (``xrunner.kvattend``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS = 4
LEVELS = 2**BITS - 1  # 15: largest code
DEFAULT_GROUP_SIZE = 64
# Range search at pack time: candidates shrink [min, max] about its centre by factors evenly
# spaced from 1 down to CLIP_MIN_SHRINK (see benchmarks/compression_ppl.py for the measurements).
DEFAULT_CLIP_STEPS = 10
CLIP_MIN_SHRINK = 0.7
# GPTQ's damping, a fraction of the Hessian's mean diagonal (gptq_quantize says why 0.1).
GPTQ_DAMP = 0.1
# The KV cache's ranges stay plain min/max: on SmolLM2-135M the least-squared-error search
# raised the perplexity cost of 4-bit K/V instead of lowering it (less squared error is not
# less attention error), and it would run on every cache write (benchmarks/compression_ppl.py
# measures both).
KV_CLIP_STEPS = 0
# On a CPU, dequantize in slices of about this many output bytes, so that a slice's codes are still
# in the L2 cache when the scale and min are applied: 33 MB of KV values (128 rows x 64 positions)
# 17.6-25.8 ms in one pass, 10.7 ms in 1 MiB slices (stop 26; the values are bit-identical).
DEQUANT_CHUNK_BYTES = 2**20


def hadamard_rotation(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """Orthonormal ``n x n`` Hadamard matrix (Sylvester), or None when ``n`` is not a power of two."""
    if n < 1 or n & (n - 1):
        return None
    from scipy.linalg import hadamard

    return torch.from_numpy(hadamard(n)).to(torch.float64).div_(math.sqrt(n)).to(dtype)


class Rotation:
    """An orthonormal matrix (float32) and its copy per (device, dtype), each made once."""

    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix
        self._copies: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def like(self, x: torch.Tensor) -> torch.Tensor:
        """The matrix on ``x``'s device in ``x``'s dtype."""
        key = (x.device, x.dtype)
        if key not in self._copies:
            self._copies[key] = self.matrix.to(device=x.device, dtype=x.dtype)
        return self._copies[key]


def hadamard(n: int) -> Rotation | None:
    """:func:`hadamard_rotation` as a :class:`Rotation`, or None when ``n`` is not a power of two."""
    r = hadamard_rotation(n)
    return None if r is None else Rotation(r)


def rotate_groups(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x`` with each block of ``len(r)`` consecutive rows (dim 0) multiplied by ``r`` from the left.

    For a weight ``[out, in]`` quantized in groups along the output channels, this mixes the
    rows of each group; the layer's output then comes out rotated the same way per block, and
    ``y @ r`` per block rotates it back (``r`` orthonormal, see ``model.linear``).
    """
    g = r.shape[0]
    return torch.einsum("ij,bjk->bik", r.to(x.dtype), x.reshape(-1, g, *x.shape[1:])).reshape(x.shape)


def rotate_inputs(x: torch.Tensor, outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """``x`` times ``kron(outer, inner)`` per block of ``len(outer) * len(inner)`` along its last dim.

    For Sylvester Hadamard factors that is the Hadamard matrix of the block's size (512 = 8 x 64),
    applied in ``len(outer) + len(inner)`` multiply-adds per value instead of 512. A weight whose
    input channels are rotated this way (``W kron``) gives the same product with rotated inputs;
    the transposed factors rotate back.
    """
    a, b = outer.shape[0], inner.shape[0]
    v = x.unflatten(-1, (-1, a, b)) @ inner.to(x.dtype)
    return (outer.to(x.dtype).T @ v).flatten(-3)


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor compressed to 4 bits per value plus a (min, scale) pair per group.

    ``packed`` is uint8 ``[..., groups, group_size // 2]`` with the grouped dimension moved last;
    ``mins`` and ``scales`` are ``[..., groups]`` in the original dtype.
    """

    packed: torch.Tensor
    mins: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    dim: int
    group_size: int

    @property
    def dtype(self) -> torch.dtype:
        return self.mins.dtype

    @property
    def nbytes(self) -> int:
        """Bytes stored (packed codes plus per-group metadata)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.mins, self.scales))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "QuantizedTensor":
        """The same compressed tensor on another device (moves the compressed bytes only)."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return QuantizedTensor(move(self.packed), move(self.mins), move(self.scales), self.shape, self.dim,
                               self.group_size)


def quantized_nbytes(shape: tuple[int, ...], dim: int, dtype_bytes: int,
                     group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """Bytes :func:`quantize` will use for a tensor of ``shape`` (for sizing without the data)."""
    length = shape[dim]
    groups = -(-length // group_size)
    others = 1
    for i, s in enumerate(shape):
        if i != dim % len(shape):
            others *= s
    return others * groups * (group_size // 2 + 2 * dtype_bytes)


def quantize(x: torch.Tensor, dim: int = -1, group_size: int = DEFAULT_GROUP_SIZE,
             clip_steps: int = DEFAULT_CLIP_STEPS) -> QuantizedTensor:
    """Compress a floating-point tensor to 4 bits per value, grouped along ``dim``.

    The grouped dimension is padded (with its last value) to a multiple of ``group_size``.
    ``clip_steps`` shrunk ranges are tried per group besides plain min/max (0: min/max only);
    each candidate is scored with the min and scale exactly as stored, so the kept one's squared
    error is never above min/max's. Min and scale are stored in ``x.dtype`` and rounded outward
    so the stored pair still covers the candidate range.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize needs a floating-point tensor, got {x.dtype}")
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be even and >= 2, got {group_size}")
    if clip_steps < 0:
        raise ValueError(f"clip_steps must be >= 0, got {clip_steps}")
    dim = dim % x.dim()
    moved = x.movedim(dim, -1)
    length = moved.shape[-1]
    pad = -length % group_size
    if pad:
        moved = torch.cat((moved, moved[..., -1:].expand(*moved.shape[:-1], pad)), dim=-1)
    if not clip_steps and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        return _quantize_min_max_cpu(moved, x, dim, group_size)
    # One contiguous float32 copy: grouping along dim 0 would otherwise leave every op strided.
    groups = moved.reshape(*moved.shape[:-1], -1, group_size).to(torch.float32,
                                                                  memory_format=torch.contiguous_format)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # aminmax: 6x slower over 64 values on a CPU
    mins, scales, codes = _fit(groups, lo, hi, x.dtype)
    if clip_steps:
        centre, half = (lo + hi) / 2, (hi - lo) / 2
        # Padding copies must not count: score only the real values of a partial last group.
        real = (torch.arange(groups.shape[-2] * group_size, device=x.device) < length).view(-1, group_size)
        best_err = _squared_error(groups, mins, scales, codes, x.dtype, real)
        for shrink in _shrinks(clip_steps):
            c_mins, c_scales, c_codes = _fit(groups, centre - shrink * half, centre + shrink * half, x.dtype)
            err = _squared_error(groups, c_mins, c_scales, c_codes, x.dtype, real)
            better = err < best_err  # strict: ties keep the wider range
            best_err = torch.where(better, err, best_err)
            mins = torch.where(better, c_mins, mins)
            scales = torch.where(better, c_scales, scales)
            codes = torch.where(better[..., None], c_codes, codes)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedTensor(packed=packed.contiguous(), mins=mins, scales=scales, shape=tuple(x.shape), dim=dim,
                           group_size=group_size)


def _quantize_min_max_cpu(moved: torch.Tensor, x: torch.Tensor, dim: int, group_size: int) -> QuantizedTensor:
    """:func:`quantize` with plain min/max ranges on a CPU (the KV cache's every write) in one numba
    pass (``xrunner.kvattend.quantize_groups``); bit-identical to the tensor path (tested)."""
    from xrunner.kvattend import quantize_groups

    lead = moved.shape[:-1]
    mins, scales, packed = quantize_groups(moved.reshape(-1, group_size))
    groups_per_row = moved.shape[-1] // group_size
    return QuantizedTensor(packed=packed.view(*lead, groups_per_row, group_size // 2),
                           mins=mins.to(x.dtype).view(*lead, groups_per_row),
                           scales=scales.to(x.dtype).view(*lead, groups_per_row),
                           shape=tuple(x.shape), dim=dim, group_size=group_size)


def _shrinks(clip_steps: int) -> list[float]:
    """The range search's candidates besides min/max: half-widths shrunk from 1 towards
    :data:`CLIP_MIN_SHRINK` in ``clip_steps`` even steps (none for 0)."""
    return [1.0 - (1.0 - CLIP_MIN_SHRINK) * i / clip_steps for i in range(1, clip_steps + 1)]


def _fit(groups: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored min and scale (in ``dtype``) covering [lo, hi] per group, and the groups' codes."""
    mins, scales = _range(lo, hi, dtype)
    inv = _inverse(scales)
    codes = (groups - mins.float()[..., None]).mul_(inv[..., None]).round_().clamp_(0, LEVELS).to(torch.uint8)
    return mins, scales, codes


def _inverse(scales: torch.Tensor) -> torch.Tensor:
    """float32 ``1 / scale``, 0 for a constant group (whose codes are then all 0)."""
    scales_f = scales.float()
    return torch.where(scales_f > 0, 1.0 / scales_f, torch.zeros_like(scales_f))


def _range(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored min and scale (in ``dtype``) whose 16 levels cover [lo, hi]."""
    mins = _round_toward(lo, dtype, up=False)
    scales = _round_toward((hi - mins.float()) / LEVELS, dtype, up=True)
    # Stored scale may still be one ulp short of covering the top value: widen it if so.
    short = mins.float() + LEVELS * scales.float() < hi
    return mins, torch.where(short, torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales)


def _squared_error(groups: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor,
                   dtype: torch.dtype, real: torch.Tensor) -> torch.Tensor:
    """Per-group sum of squared errors of the real values exactly as :func:`dequantize` rebuilds them."""
    values = _dequant_groups(codes, mins, scales).to(dtype).float()
    return values.sub_(groups).square_().mul_(real).sum(dim=-1)


def _dequant_groups(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``min + code * scale`` per group (used to score ranges; :func:`dequantize` the same)."""
    return _dequant_in_place(codes.float(), mins, scales)


def _dequant_in_place(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes`` (float32 ``[..., groups, group_size]``) turned into ``min + code * scale`` in place:
    the one dequant formula."""
    return codes.mul_(scales.float()[..., None]).add_(mins.float()[..., None])


def stored_shape(q: QuantizedTensor) -> tuple[int, ...]:
    """The shape of ``q``'s values with the grouped dimension last: the layout ``dequantize(q, out=...)`` fills."""
    shape = list(q.shape)
    n = shape.pop(q.dim)
    return (*shape, n)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild the tensor (in ``dtype``, default the original dtype) from its 4-bit form.

    ``out`` (contiguous, of :func:`stored_shape`, in the result's dtype): the values are written
    there in the stored layout and the result is a view of it (grouped dimension moved back, so
    strided when that is not the last one). A float32 ``out`` is filled in place, with no
    temporary and no transposing copy: the engine gives a weight's view to ``F.linear``, whose
    matrix product reads either stride order. Without ``out`` the result is contiguous.
    """
    dtype = dtype or q.dtype
    lead, g, n = q.packed.shape[:-1], q.group_size, q.shape[q.dim]
    if out is not None and (tuple(out.shape) != stored_shape(q) or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous {dtype} of shape {stored_shape(q)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    direct = out is not None and dtype == torch.float32 and lead[-1] * g == n
    work = out.view(*lead, g) if direct else torch.empty(*lead, g, dtype=torch.float32, device=q.packed.device)
    pairs = work.view(*lead, g // 2, 2)
    step = len(work)
    if work.device.type == "cpu":  # slices of about DEQUANT_CHUNK_BYTES along dim 0
        step = max(1, DEQUANT_CHUNK_BYTES // (work[0].numel() * work.element_size()))
    for s in range(0, len(work), step):
        codes, packed = pairs[s:s + step], q.packed[s:s + step]
        codes[..., 0].copy_(packed & 0x0F)
        codes[..., 1].copy_(packed >> 4)
        # float32 arithmetic, one rounding at the end: error <= scale/2 + half an ulp of ``dtype``.
        _dequant_in_place(work[s:s + step], q.mins[s:s + step], q.scales[s:s + step])
    values = work.reshape(*lead[:-1], -1)[..., :n]
    if out is None:
        return values.to(dtype).movedim(-1, q.dim).contiguous()
    if not direct:
        out.copy_(values)
    return out.movedim(-1, q.dim)


def _round_toward(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Cast float32 ``x`` to ``dtype``, stepping one ulp so the result is >= x (up) or <= x."""
    y = x.to(dtype)
    wrong = y.float() < x if up else y.float() > x
    target = torch.full_like(y, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(y, target), y)


def _column_ranges(groups: torch.Tensor, real: torch.Tensor, dtype: torch.dtype, clip_steps: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize`'s range search for one small ``[groups, group_size]`` slice, every candidate
    at once (``[candidates, groups, group_size]``: GPTQ calls it once per column, so the candidates
    are batched rather than looped). Returns the kept (mins, scales, codes)."""
    lo, hi = groups.aminmax(dim=-1)
    centre, half = (lo + hi) / 2, (hi - lo) / 2
    shrink = torch.tensor(_shrinks(clip_steps), device=groups.device)
    c_lo = torch.cat((lo[None], centre - shrink[:, None] * half))  # min/max itself first: ties keep it
    c_hi = torch.cat((hi[None], centre + shrink[:, None] * half))
    mins, scales, codes = _fit(groups, c_lo, c_hi, dtype)
    best = _squared_error(groups, mins, scales, codes, dtype, real).argmin(dim=0)[None]
    return (mins.gather(0, best)[0], scales.gather(0, best)[0],
            codes.gather(0, best[..., None].expand(1, *groups.shape))[0])


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                  clip_steps: int = DEFAULT_CLIP_STEPS, damp: float = GPTQ_DAMP, block: int = 128
                  ) -> QuantizedTensor:
    """``quantize(w, dim=0)``'s stored form of a weight ``[out, in]``, chosen by GPTQ (Frantar et al., 2023).

    ``hessian`` is ``X^T X`` of calibration inputs ``X [tokens, in]`` of the layer (any positive
    scale). Input channels (columns) are rounded one at a time, largest ``hessian`` diagonal
    first (act order), and each column's rounding error is pushed onto the columns not yet
    rounded through the Cholesky factor of the inverse Hessian, so that ``X w^T`` moves least.
    Groups run along the output channels, so a column's groups hold nothing else: its ranges are
    searched (as :func:`quantize` does) on the column as the earlier columns' errors left it,
    just before it is rounded; fixing them from the original weight instead leaves the updated
    values clamped at the range ends. ``damp`` is a fraction of the mean diagonal added to the
    Hessian: 0.1 rather than GPTQ's usual 0.01 fits the calibration text less closely. Together
    they took SmolLM2-135M's 4-bit weights from +6.6% to +5.2% perplexity (mean of three
    calibration draws of 16 sequences; docs/BENCHMARKS.md, stop 28).
    """
    if w.dim() != 2 or hessian.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"gptq_quantize needs w [out, in] and hessian [in, in], got {tuple(w.shape)} and "
                         f"{tuple(hessian.shape)}")
    n, rows_real, dtype = w.shape[1], w.shape[0], w.dtype
    groups = -(-rows_real // group_size)
    rows = groups * group_size
    H = hessian.to(torch.float64, copy=True)
    dead = torch.diagonal(H) <= 0
    H[dead, dead] = 1.0  # a never-active input: its rounding error costs nothing
    H.diagonal().add_(damp * float(torch.diagonal(H).mean()))
    W = w.float().t().contiguous()  # [in, out]: one column of w is one contiguous row here
    if rows > rows_real:  # padded as quantize pads: copies of the last row, not scored
        W = torch.cat((W, W[:, -1:].expand(n, rows - rows_real)), dim=1)
    real = (torch.arange(rows, device=w.device) < rows_real).view(groups, group_size)
    order = torch.argsort(torch.diagonal(H), descending=True)
    # One float64 [in, in] at a time beside the one being made (the caller's hessian is a third):
    # scratch_bytes in xrunner.gptq counts this.
    H = H[order]
    H = H[:, order]
    H = torch.linalg.cholesky(H)
    H = torch.cholesky_inverse(H)
    H = torch.linalg.cholesky(H, upper=True)
    U = H.float()
    del H
    W = W[order]
    codes = torch.empty(n, rows, dtype=torch.uint8, device=w.device)
    mins = torch.empty(n, groups, dtype=dtype, device=w.device)
    scales = torch.empty_like(mins)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        err = torch.empty(i2 - i1, rows, device=w.device)
        for i in range(i1, i2):
            m, s, c = _column_ranges(W[i].view(groups, group_size), real, dtype, clip_steps)
            mins[i], scales[i], codes[i] = m, s, c.view(-1)
            e = (W[i] - _dequant_groups(c, m, s).view(-1)) / U[i, i]
            W[i + 1:i2] -= U[i, i + 1:i2, None] * e[None, :]
            err[i - i1] = e
        W[i2:] -= U[i1:i2, i2:].t() @ err
    back = torch.argsort(order)
    codes = codes[back].view(n, groups, group_size)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedTensor(packed=packed.contiguous(), mins=mins[back].contiguous(), scales=scales[back].contiguous(),
                           shape=tuple(w.shape), dim=0, group_size=group_size)
