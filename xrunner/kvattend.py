"""numba kernels of the 4-bit KV cache on a CPU: decode attention straight over the codes (no
dequantized copy of the cache), and the 4-bit form of new K/V (:func:`quantize_groups`).

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
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

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


# The encode kernel runs on the calling thread below PARALLEL_MIN_VALUES: after a parallel call
# numba's OpenMP pool keeps spinning, and it slowed the next torch operations (a 64-row linear after
# a small quantize: 0.37 ms more per switch, stop 45). A decode step's K/V write (256 rows x 16
# heads x 64 = 262k values) stays serial; a prefill's (8.4M) gains from both cores: the bfloat16
# offload run measured 148.8 tokens/s with parallel kernels, 140.7 and 144.6 with serial ones.
PARALLEL_MIN_VALUES = 2**20
_CHUNKS = 64  # parallel iterations of a large call


@intrinsic
def _float_bits(typingctx, x):
    """float32 -> its uint32 bits (an LLVM bitcast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _bits_float(typingctx, u):
    """Integer bits (low 32 kept) -> the float32 they encode."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        low = context.cast(builder, args[0], u, types.uint32)  # numba widens uint32 arithmetic to 64 bits
        return builder.bitcast(low, ir.FloatType())
    return types.float32(u), codegen


def _value(src, i, j):
    """float32 of ``src[i, j]``: float32 as it is, bfloat16 bits (uint16) widened (exact). Only
    for numba-compiled code, which uses :func:`_value_impl`."""
    raise TypeError("_value is compiled by numba through its overload; call it from an njit function")


@overload(_value, inline="always")
def _value_impl(src, i, j):
    if src.dtype == types.uint16:
        return lambda src, i, j: _bits_float(np.uint32(src[i, j]) << np.uint32(16))
    return lambda src, i, j: src[i, j]


@njit(cache=True, inline="always")
def _step(x, up, unit):
    """The next value of x's dtype toward +inf (``up``) or -inf, as torch.nextafter; ``unit`` is
    that dtype's last bit within float32's bits (1, or 0x10000 for bfloat16)."""
    if x == np.float32(0.0):
        return _bits_float(np.uint32(unit) if up else np.uint32(0x80000000 | unit))
    if np.isinf(x) and (x > 0) == up:
        return x
    bits = _float_bits(x)
    return _bits_float(bits + np.uint32(unit) if (x > 0) == up else bits - np.uint32(unit))


@njit(cache=True, inline="always")
def _stored(x, up, bf16):
    """float32 ``x`` cast to the stored dtype (bfloat16: nearest, ties to even, as torch) and
    stepped one ulp where that lands on the wrong side of ``x``: ``compression._round_toward``."""
    y = x
    if bf16 and not np.isnan(x):
        bits = _float_bits(x)
        y = _bits_float((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
    if (y < x) if up else (y > x):
        return _step(y, up, 0x10000 if bf16 else 1)
    return y


@njit(cache=True, nogil=True)
def _quantize_rows(src, bf16, mins, scales, out, start, stop):
    """Groups ``start..stop`` of ``src`` (float32, or bfloat16 bits as uint16): min and max, the
    stored min and scale (``compression._range``: rounded outward to the dtype, the scale widened
    one ulp if 15 steps still fall short of the max), and the codes ``round((x - min) / scale)``
    clamped to 0..15 (float32, ties to even), two per byte, low nibble first. No fastmath: the
    result must be the tensor path's to the bit."""
    top = np.float32(15.0)
    zero = np.float32(0.0)
    n = src.shape[1]
    for i in range(start, stop):
        lo = hi = _value(src, i, 0)
        nan = False
        for j in range(n):
            v = _value(src, i, j)
            nan |= v != v
            lo = min(lo, v)
            hi = max(hi, v)
        if nan:  # as torch's amin/amax
            lo = hi = np.float32(np.nan)
        m = _stored(lo, False, bf16)
        s = _stored((hi - m) / top, True, bf16)
        if m + top * s < hi:
            s = _step(s, True, 0x10000 if bf16 else 1)
        inv = np.float32(1.0) / s if s > zero else zero
        mins[i], scales[i] = m, s
        for j in range(n // 2):
            low = min(max(np.rint((_value(src, i, 2 * j) - m) * inv), zero), top)
            high = min(max(np.rint((_value(src, i, 2 * j + 1) - m) * inv), zero), top)
            out[i, j] = np.uint8(low) | (np.uint8(high) << np.uint8(4))


@njit(parallel=True, cache=True, nogil=True)
def _quantize_parallel(src, bf16, mins, scales, out):
    step = -(-src.shape[0] // _CHUNKS)
    for c in prange(_CHUNKS):
        _quantize_rows(src, bf16, mins, scales, out, c * step, min((c + 1) * step, src.shape[0]))


def quantize_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain min/max 4-bit form of ``groups [n, group_size]`` (float32 or bfloat16, on a CPU):
    stored mins and scales (float32 ``[n]``, each exactly a value of ``groups``' dtype) and packed
    codes ``[n, group_size / 2]``, bit-identical to ``compression._fit`` (tested), in one pass over
    the values instead of a float32 copy and a dozen tensor operations. ``KVCodec.pack`` of a
    decode step's K and V (256 rows x 16 heads x 64; 2 threads, stop 46): bfloat16 1.05-1.12 ->
    0.68-0.74 ms, a 32-position prefill 28.8 -> 10.7 ms; float32 0.43 -> 0.51 ms (its min/max
    loop is scalar where torch's amin/amax were vectorised), prefill 7.6-9.5 -> 7.3-7.7 ms."""
    groups = groups.contiguous()
    bf16 = groups.dtype == torch.bfloat16
    src = groups.view(torch.int16).numpy().view(np.uint16) if bf16 else groups.numpy()
    n = src.shape[0]
    mins, scales = np.empty(n, np.float32), np.empty(n, np.float32)
    out = np.empty((n, src.shape[1] // 2), np.uint8)
    if src.size < PARALLEL_MIN_VALUES:
        _quantize_rows(src, bf16, mins, scales, out, 0, n)
    else:
        with _torch_threads():
            _quantize_parallel(src, bf16, mins, scales, out)
    return torch.from_numpy(mins), torch.from_numpy(scales), torch.from_numpy(out)


# The softmax's sum keeps one order: numba's freshly compiled parallel code and the code it loads
# from its cache are not the same machine code, and with fastmath's reassociation they summed a
# row's exponentials in different orders, so a cold and a warm cache generated different tokens
# (stop 47 traced it to one call: equal inputs and scores, different totals). Without "reassoc",
# LLVM keeps this function's order (its flags stay on its instructions when it is inlined): 16
# lanes added elementwise, then a fixed tree. nnan and nsz still let max vectorise. The scores'
# dot products still reassociate (in order, they ran 2x slower); fresh and cached code gave equal
# scores in every call of that run and in tests/test_compression.py.
_SOFTMAX_FASTMATH = {"nnan", "nsz", "contract"}
_LANES = 16  # the tree at the end of _softmax_row is written out for 16


@njit(fastmath=_SOFTMAX_FASTMATH, cache=True, nogil=True)
def _softmax_row(x, own, sink, lane):
    """``x <- exp(x - top) / total`` in place over ``x`` and the own score ``own``, with ``sink`` in
    the total only (an attention sink; -inf: none); returns the own position's probability.
    ``lane`` is 16 floats of scratch."""
    T = x.shape[0]
    top = max(own, sink)
    for t in range(T):
        top = max(top, x[t])
    lane[:] = 0.0
    full = T - T % _LANES
    for t0 in range(0, full, _LANES):
        for i in range(_LANES):
            e = np.exp(x[t0 + i] - top)
            x[t0 + i] = e
            lane[i] += e
    for t in range(full, T):
        e = np.exp(x[t] - top)
        x[t] = e
        lane[t - full] += e
    e_own = np.exp(own - top)
    a0, a1, a2, a3 = lane[0] + lane[8], lane[1] + lane[9], lane[2] + lane[10], lane[3] + lane[11]
    a4, a5, a6, a7 = lane[4] + lane[12], lane[5] + lane[13], lane[6] + lane[14], lane[7] + lane[15]
    inv = np.float32(1.0) / (e_own + np.exp(sink - top) + (((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))))
    for t in range(T):
        x[t] *= inv
    return e_own * inv


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _attend_kernel(q_e, q_o, pk, mk, sk, pv, mv, sv, s_own, mask, scale, cap, sinks, out_e, out_o, p_own):
    """One (row, kv head) per parallel iteration: scores (``cap * tanh(score / cap)`` when ``cap``
    is above 0, Gemma 2's softcap), softmax with the own score and the head's sink logit (-inf:
    none), output.
    Compiled once into numba's cache beside this file (about 4 s, by a child process: see
    :func:`_pinned_attend_kernel`), and loaded from there."""
    B, H, G, half = q_e.shape
    Hkv, T = pk.shape[1], pk.shape[2]
    rep = H // Hkv
    for bk in prange(B * Hkv):
        b = bk // Hkv
        kh = bk % Hkv
        s = np.empty((rep, T), np.float32)
        qsum = np.zeros((rep, G), np.float32)
        lane = np.empty(_LANES, np.float32)
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
        if cap > 0:  # apart from the scores' loop, which then compiles as it did without a cap
            for t in range(T):
                if mask[b, t]:
                    for r in range(rep):
                        s[r, t] = cap * np.tanh(s[r, t] / cap)
        for r in range(rep):
            h = kh * rep + r
            p_own[b, h] = _softmax_row(s[r], s_own[b, h], sinks[h], lane)
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


_F32_C, _F32_A = types.Array(types.float32, 4, "C"), types.Array(types.float32, 4, "A")
_CODES_A = types.Array(types.uint8, 5, "A")
# The kernel's one compiled form. A cache slice's codes, mins and scales come strided, except where
# the slice is its whole buffer or a bfloat16 cache's mins were converted; left to itself, numba
# compiles a specialization per layout (its cache held three), whose reassociated score sums
# vectorise, and so round, differently, and a call's result would hang on its slice's layout and
# on the forms already compiled or cached.
_ATTEND_SIGNATURE = types.void(_F32_C, _F32_C, _CODES_A, _F32_A, _F32_A, _CODES_A, _F32_A, _F32_A,
                               types.Array(types.float32, 2, "C"), types.Array(types.boolean, 2, "C"),
                               types.float32, types.float32, types.Array(types.float32, 1, "C"), _F32_C, _F32_C,
                               types.Array(types.float32, 2, "C"))


def _pinned_attend_kernel():
    """``_attend_kernel`` for ``_ATTEND_SIGNATURE`` alone, on first use rather than at import;
    contiguous arrays then convert to it instead of compiling.

    Loaded from numba's cache, never compiled in this process where the cache works: the code
    numba compiles and the code it loads are not the same machine code (numba issue 10617), and
    on stop 69's host their reassociated dot products rounded differently (4.8e-6), so a process
    with a cold cache and one with a warm cache generated different tokens. A cold cache is filled
    by a child process first. (Summing in one fixed order instead made the kernel 1.2-2x slower.)"""
    if not _attend_kernel.signatures:
        if _in_cache(_attend_kernel, _ATTEND_SIGNATURE) is False:
            import subprocess
            import sys

            try:
                subprocess.run([sys.executable, "-c", "from xrunner.kvattend import _ATTEND_SIGNATURE, _attend_kernel; "
                                "_attend_kernel.compile(_ATTEND_SIGNATURE)"], capture_output=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired):
                pass  # (compiled here then)
        _attend_kernel.compile(_ATTEND_SIGNATURE)  # (where the child could not fill the cache: compiled here)
        _attend_kernel.disable_compile()
    return _attend_kernel


def _in_cache(kernel, sig) -> bool | None:  # noqa: ANN001
    """Whether numba's on-disk cache holds ``kernel`` for ``sig`` for this machine; None where numba's
    internals it reads have moved (then nothing is done about it)."""
    try:
        return kernel._cache._index_key(sig, kernel.targetctx.codegen()) in kernel._cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - private API of numba 0.59-0.68
        return None


def attend_quantized(q: torch.Tensor, k: QuantizedTensor, v: QuantizedTensor, own_k: torch.Tensor,
                     own_v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per row over a 4-bit cache plus each row's own exact K and V.

    ``q [B, H, d]``; ``k``, ``v`` of shape ``[B, Hkv, T, d]`` grouped along ``d`` (the cache
    before the step's own position); ``own_k``, ``own_v [B, Hkv, d]``; ``mask [B, T]`` (True: a
    real token; None: all are). Grouped-query attention shares each kv head among ``H / Hkv``
    query heads. Returns ``[B, H, d]`` float32, as ``softmax(q k^T / sqrt(d)) v`` over the
    dequantized cache followed by the own position (``scale`` instead of ``1 / sqrt(d)`` when
    given; ``softcap``: scores through ``softcap * tanh(score / softcap)``; ``sinks [H]``: a logit
    per head in each softmax that weighs no value, GPT-OSS's).

    The kernel computes in float32: a half-precision model's query, own K/V and the cache's
    mins and scales are converted first (a min and a scale per 64 values: the conversion reads
    1/8 of the codes' bytes); the codes are read as they are.
    """
    q, own_k, own_v = q.float(), own_k.float(), own_v.float()
    B, H, d = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G, half = k.packed.shape[-2], k.packed.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rep = H // Hkv
    s_own = (q.reshape(B, Hkv, rep, d) * own_k[:, :, None]).sum(-1).reshape(B, H) * scale
    if softcap is not None:
        s_own = torch.tanh(s_own / softcap) * softcap
    qp = q if G * 2 * half == d else torch.nn.functional.pad(q, (0, G * 2 * half - d))
    qp = qp.reshape(B, H, G, half, 2)
    q_e, q_o = qp[..., 0].contiguous(), qp[..., 1].contiguous()
    out_e, out_o, p_own = torch.empty(B, H, G, half), torch.empty(B, H, G, half), torch.empty(B, H)
    keep = (torch.ones(B, T, dtype=torch.bool) if mask is None else mask).contiguous()
    sink = (torch.full((H,), -math.inf) if sinks is None else sinks.float()).contiguous()
    mk, sk, mv, sv = (x.float().numpy() for x in (k.mins, k.scales, v.mins, v.scales))
    with _torch_threads():  # compiling starts numba's thread pool too
        kernel = _pinned_attend_kernel()
        kernel(q_e.numpy(), q_o.numpy(), k.packed.numpy(), mk, sk, v.packed.numpy(), mv, sv, s_own.numpy(),
               keep.numpy(), np.float32(scale), np.float32(softcap or 0.0), sink.numpy(), out_e.numpy(),
               out_o.numpy(), p_own.numpy())
    res = torch.stack((out_e, out_o), dim=-1).view(B, H, -1)[..., :d]
    return res + p_own[..., None] * own_v.repeat_interleave(rep, dim=1)
