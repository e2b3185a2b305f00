"""numba kernels of the 4-bit KV cache on a CPU: decode attention straight over the codes (no
dequantized copy of the cache), and the codes of new K/V (:func:`pack_groups`).

The torch path dequantizes a batch's whole layer cache into a float32 buffer (one write, then
two read-modify passes of ``rows x context x Hkv x d x 4`` bytes per K and V) and then attends
over it. With one min ``m`` and scale ``s`` per group, a key's score is
``s * (q . codes) + m * sum(q)`` over each group, and the output is
``sum_t p_t m_t + sum_t (p_t s_t) codes_t`` per group, so the codes only need turning into
floats on the fly. One fused numba loop per (row, kv head) reads the packed bytes once; the
query's even and odd channels are split beforehand so that the low and high nibbles of a byte
meet their channels in two contiguous, vectorisable sums. At 128 rows x 64 positions x 16 heads
x 64 (stop 27, 2 threads) K and V took 3.2 ms this way against 14.6 ms dequantized then
attended (1 thread: 6.0 vs 26.6 ms).

The step's own position is not read from the cache: its exact K and V come in as ``own_k`` and
``own_v`` (FlexGen's rule, as ``stored_forms.KVCodec.decode``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import numba
from numba import njit, prange

from xrunner.compression import QuantizedTensor


@contextmanager
def _torch_threads() -> Iterator[None]:
    """Run a parallel kernel on as many threads as torch uses, and leave torch's count as it was:
    numba's OpenMP pool, started by the first call, sets the OpenMP thread count it shares with
    torch to every core, and a 1-thread profile or run would silently go on with 2."""
    threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


# The encode kernels run on the calling thread below PARALLEL_MIN_VALUES: after a parallel call
# numba's OpenMP pool keeps spinning, and it slowed the next torch operations (a 64-row linear after
# a small quantize: 0.37 ms more per switch, stop 45). A decode step's K/V write (256 rows x 16
# heads x 64 = 262k values) stays serial; a prefill's (8.4M) gains from both cores: the bfloat16
# offload run measured 148.8 tokens/s with parallel kernels, 140.7 and 144.6 with serial ones.
PARALLEL_MIN_VALUES = 2**20
_CHUNKS = 64  # parallel iterations of a large call


@njit(cache=True, nogil=True)
def _widen_rows(bits, out, start, stop):
    """bfloat16 is the top half of a float32: shift each value's 16 bits into place (exact)."""
    for i in range(start, stop):
        out[i] = np.uint32(bits[i]) << np.uint32(16)


@njit(cache=True, nogil=True)
def _pack_rows(groups, mins, inv, out, start, stop):
    """Codes ``round((x - min) * inv)`` clamped to 0..15 (float32, ties to even, as torch's
    ``round``), two per byte, low nibble first, for groups ``start..stop``."""
    top = np.float32(15.0)
    zero = np.float32(0.0)
    for i in range(start, stop):
        m, s = mins[i], inv[i]
        for j in range(groups.shape[1] // 2):
            low = min(max(np.rint((groups[i, 2 * j] - m) * s), zero), top)
            high = min(max(np.rint((groups[i, 2 * j + 1] - m) * s), zero), top)
            out[i, j] = np.uint8(low) | (np.uint8(high) << np.uint8(4))


@njit(parallel=True, cache=True, nogil=True)
def _widen_parallel(bits, out):
    step = -(-bits.shape[0] // _CHUNKS)
    for c in prange(_CHUNKS):
        _widen_rows(bits, out, c * step, min((c + 1) * step, bits.shape[0]))


@njit(parallel=True, cache=True, nogil=True)
def _pack_parallel(groups, mins, inv, out):
    step = -(-groups.shape[0] // _CHUNKS)
    for c in prange(_CHUNKS):
        _pack_rows(groups, mins, inv, out, c * step, min((c + 1) * step, groups.shape[0]))


def _run(rows, parallel, n: int, values: int, *args) -> None:
    """``rows(*args, 0, n)`` on this thread, or ``parallel(*args)`` on torch's thread count for a
    call of ``PARALLEL_MIN_VALUES`` or more."""
    if values < PARALLEL_MIN_VALUES:
        rows(*args, 0, n)
        return
    with _torch_threads():
        parallel(*args)


def float32_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x`` (on a CPU, last dim a multiple of ``group_size``) as contiguous float32
    ``[groups, group_size]``; bfloat16 converted here (1.4 ms for 8.4M values on 2 threads, where
    ``.float()`` took 12 ms), other dtypes by torch."""
    if x.dtype != torch.bfloat16:
        return x.reshape(-1, group_size).to(torch.float32, memory_format=torch.contiguous_format)
    bits = x.contiguous().view(torch.int16).reshape(-1).numpy().view(np.uint16)
    out = np.empty(bits.shape[0], np.uint32)
    _run(_widen_rows, _widen_parallel, bits.shape[0], bits.shape[0], bits, out)
    return torch.from_numpy(out.view(np.float32)).view(-1, group_size)


def pack_groups(groups: torch.Tensor, mins: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit codes ``[groups, group_size / 2]`` of float32 ``groups [n, group_size]`` with
    their stored mins and inverse scales (float32 ``[n]``): bit-identical to
    ``compression._fit``'s codes packed (tested), in one pass instead of eight tensor operations.
    With :func:`float32_groups`, a bfloat16 K of 256 rows x 16 heads x 32 positions x 64
    quantizes in 9 ms instead of 41 (2 threads, stop 45)."""
    out = np.empty((groups.shape[0], groups.shape[1] // 2), np.uint8)
    _run(_pack_rows, _pack_parallel, groups.shape[0], groups.numel(), groups.numpy(), mins.reshape(-1).contiguous().numpy(),
         inv.reshape(-1).contiguous().numpy(), out)
    return torch.from_numpy(out)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _attend_kernel(q_e, q_o, pk, mk, sk, pv, mv, sv, s_own, mask, scale, out_e, out_o, p_own):
    """One (row, kv head) per parallel iteration: scores, softmax with the own score, output.
    Compiled on first call (about 4 s), then cached beside this file."""
    B, H, G, half = q_e.shape
    Hkv, T = pk.shape[1], pk.shape[2]
    rep = H // Hkv
    for bk in prange(B * Hkv):
        b = bk // Hkv
        kh = bk % Hkv
        s = np.empty((rep, T), np.float32)
        qsum = np.zeros((rep, G), np.float32)
        for r in range(rep):
            h = kh * rep + r
            for gi in range(G):
                acc = np.float32(0.0)
                for j in range(half):
                    acc += q_e[b, h, gi, j] + q_o[b, h, gi, j]
                qsum[r, gi] = acc
        for t in range(T):
            if not mask[b, t]:
                for r in range(rep):
                    s[r, t] = -np.inf
                continue
            for r in range(rep):
                h = kh * rep + r
                acc = np.float32(0.0)
                for gi in range(G):
                    part = np.float32(0.0)
                    for j in range(half):
                        byte = pk[b, kh, t, gi, j]
                        part += (q_e[b, h, gi, j] * np.float32(byte & 15)
                                 + q_o[b, h, gi, j] * np.float32(byte >> 4))
                    acc += sk[b, kh, t, gi] * part + mk[b, kh, t, gi] * qsum[r, gi]
                s[r, t] = acc * scale
        for r in range(rep):
            h = kh * rep + r
            top = s_own[b, h]
            for t in range(T):
                top = max(top, s[r, t])
            e_own = np.exp(s_own[b, h] - top)
            total = e_own
            for t in range(T):
                e = np.exp(s[r, t] - top)
                s[r, t] = e
                total += e
            inv = np.float32(1.0) / total
            for t in range(T):
                s[r, t] *= inv
            p_own[b, h] = e_own * inv
            for gi in range(G):
                for j in range(half):
                    out_e[b, h, gi, j] = 0.0
                    out_o[b, h, gi, j] = 0.0
        for t in range(T):
            if not mask[b, t]:
                continue
            for r in range(rep):
                h = kh * rep + r
                p = s[r, t]
                for gi in range(G):
                    pm = p * mv[b, kh, t, gi]
                    ps = p * sv[b, kh, t, gi]
                    for j in range(half):
                        byte = pv[b, kh, t, gi, j]
                        out_e[b, h, gi, j] += pm + ps * np.float32(byte & 15)
                        out_o[b, h, gi, j] += pm + ps * np.float32(byte >> 4)


def attend_quantized(q: torch.Tensor, k: QuantizedTensor, v: QuantizedTensor, own_k: torch.Tensor,
                     own_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one query per row over a 4-bit cache plus each row's own exact K and V.

    ``q [B, H, d]``; ``k``, ``v`` of shape ``[B, Hkv, T, d]`` grouped along ``d`` (the cache
    before the step's own position); ``own_k``, ``own_v [B, Hkv, d]``; ``mask [B, T]`` (True: a
    real token; None: all are). Grouped-query attention shares each kv head among ``H / Hkv``
    query heads. Returns ``[B, H, d]`` float32, as ``softmax(q k^T / sqrt(d)) v`` over the
    dequantized cache followed by the own position.

    The kernel computes in float32: a half-precision model's query, own K/V and the cache's
    mins and scales are converted first (a min and a scale per 64 values: the conversion reads
    1/8 of the codes' bytes); the codes are read as they are.
    """
    q, own_k, own_v = q.float(), own_k.float(), own_v.float()
    B, H, d = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G, half = k.packed.shape[-2], k.packed.shape[-1]
    scale = 1.0 / math.sqrt(d)
    rep = H // Hkv
    s_own = (q.reshape(B, Hkv, rep, d) * own_k[:, :, None]).sum(-1).reshape(B, H) * scale
    qp = q if G * 2 * half == d else torch.nn.functional.pad(q, (0, G * 2 * half - d))
    qp = qp.reshape(B, H, G, half, 2)
    q_e, q_o = qp[..., 0].contiguous(), qp[..., 1].contiguous()
    out_e, out_o, p_own = torch.empty(B, H, G, half), torch.empty(B, H, G, half), torch.empty(B, H)
    keep = (torch.ones(B, T, dtype=torch.bool) if mask is None else mask).contiguous()
    mk, sk, mv, sv = (x.float().numpy() for x in (k.mins, k.scales, v.mins, v.scales))
    with _torch_threads():
        _attend_kernel(q_e.numpy(), q_o.numpy(), k.packed.numpy(), mk, sk, v.packed.numpy(), mv, sv, s_own.numpy(),
                       keep.numpy(), np.float32(scale), out_e.numpy(), out_o.numpy(), p_own.numpy())
    res = torch.stack((out_e, out_o), dim=-1).view(B, H, -1)[..., :d]
    return res + p_own[..., None] * own_v.repeat_interleave(rep, dim=1)
