"""Group-wise asymmetric 4-bit quantization (FlexGen §5) for weights and KV cache.

Values are cut into groups of ``group_size`` consecutive elements along one dimension (FlexGen
groups weights along the output channels and the KV cache along the head dimension). Each
group stores its minimum and scale ``(max - min) / 15``; a value becomes
``round((x - min) / scale)`` in 0..15, and two values share a byte. Dequantization is
``min + q * scale``, so the error per value is at most ``scale / 2`` (plus half an ulp when
the result is rounded to a 16-bit dtype). A constant group has scale
0 and dequantizes exactly to its value (no division by zero).

Used by the engine to store and move compressed tensors, and by the profiler to time
(de)quantization; everything is vectorised torch, on whatever device the tensor lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = 4
LEVELS = 2**BITS - 1  # 15: largest code
DEFAULT_GROUP_SIZE = 64


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


def quantize(x: torch.Tensor, dim: int = -1, group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedTensor:
    """Compress a floating-point tensor to 4 bits per value, grouped along ``dim``.

    The grouped dimension is padded (with its last value) to a multiple of ``group_size``.
    Min and scale are stored in ``x.dtype`` and rounded outward so the stored pair still covers
    the group: the ``scale / 2`` error bound holds for the stored scale.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize needs a floating-point tensor, got {x.dtype}")
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be even and >= 2, got {group_size}")
    dim = dim % x.dim()
    moved = x.movedim(dim, -1)
    length = moved.shape[-1]
    pad = -length % group_size
    if pad:
        moved = torch.cat((moved, moved[..., -1:].expand(*moved.shape[:-1], pad)), dim=-1)
    # One contiguous float32 copy: grouping along dim 0 would otherwise leave every op strided.
    groups = moved.reshape(*moved.shape[:-1], -1, group_size).to(torch.float32,
                                                                  memory_format=torch.contiguous_format)
    lo, hi = groups.aminmax(dim=-1)
    mins = _round_toward(lo, x.dtype, up=False)
    scales = _round_toward((hi - mins.float()) / LEVELS, x.dtype, up=True)
    mins_f, scales_f = mins.float(), scales.float()
    # Stored scale may still be one ulp short of covering the top value: widen it if so.
    short = mins_f + LEVELS * scales_f < hi
    scales = torch.where(short, torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales)
    scales_f = scales.float()
    inv = torch.where(scales_f > 0, 1.0 / scales_f, torch.zeros_like(scales_f))
    codes = (groups - mins_f[..., None]).mul_(inv[..., None]).round_().clamp_(0, LEVELS).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedTensor(packed=packed.contiguous(), mins=mins, scales=scales, shape=tuple(x.shape), dim=dim,
                           group_size=group_size)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rebuild the tensor (in ``dtype``, default the original dtype) from its 4-bit form."""
    dtype = dtype or q.dtype
    codes = torch.stack((q.packed & 0x0F, q.packed >> 4), dim=-1).reshape(*q.packed.shape[:-1], q.group_size)
    # float32 arithmetic, one rounding at the end: error <= scale/2 + half an ulp of ``dtype``.
    values = codes.float().mul_(q.scales.float()[..., None]).add_(q.mins.float()[..., None]).to(dtype)
    values = values.reshape(*values.shape[:-2], -1)[..., :q.shape[q.dim]]
    return values.movedim(-1, q.dim).contiguous()


def _round_toward(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Cast float32 ``x`` to ``dtype``, stepping one ulp so the result is >= x (up) or <= x."""
    y = x.to(dtype)
    wrong = y.float() < x if up else y.float() > x
    target = torch.full_like(y, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(y, target), y)
