"""How the engine stores a decoder layer's weights and the KV cache, 4-bit or not.

``WeightLayout`` lays one layer out as a flat byte record (the unit every tier stores and the
copy routine moves); ``KVCodec`` is the cache's stored form and attention over it. Both apply
the group-wise 4-bit format of ``xrunner.compression`` (FlexGen §5) with the rotations and
centering that cut its error; the reasons and measurements are in the class docstrings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch

from xprofiler.specs import ModelSpec
from xrunner.compression import (DEFAULT_CLIP_STEPS, DEFAULT_GROUP_SIZE, KV_CLIP_STEPS, QuantizedTensor,
                                 dequantize, gptq_quantize, hadamard, quantize, rotate_groups, rotate_inputs)
from xrunner.kvattend import attend_quantized
from xrunner.model import attention, visible_keys
from xsimulator.costmodel import IN_ROTATION_BLOCK, input_rotated


@dataclass(frozen=True)
class _Part:
    name: str
    kind: str  # plain | packed | mins | scales
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class WeightLayout:
    """One decoder layer as a flat byte record: every tensor (or its 4-bit parts) at an offset.

    The record is what every tier stores and what the copy routine moves, so a layer is one
    transfer whatever its tier. 2-D weights are quantized along the output channels (dim 0)
    when ``compress``, each group's range searched over ``clip_steps`` shrinks at pack time (0:
    plain min/max); 1-D tensors stay as they are. With ``rotate``, each group of rows is first
    multiplied by an orthonormal Hadamard matrix (outlier rows no longer stretch their group's
    range); :meth:`unpack` then adds ``<module>.out_rotation`` and ``model.linear`` rotates the
    layer's output back, ``group`` multiply-adds per output value instead of one per weight.
    ``rotate_inputs`` (for GPTQ codes) rotates the MLP output projection's input channels too
    (``in_rotated``; keys ``<module>.in_rotation`` and ``.in_rotation_inner``).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, compress: bool,
                 group: int = DEFAULT_GROUP_SIZE, clip_steps: int = DEFAULT_CLIP_STEPS, rotate: bool = True,
                 rotate_inputs: bool = False):
        self.dtype, self.compress, self.group, self.clip_steps = dtype, compress, group, clip_steps
        self.shapes = dict(shapes)
        self.rotation = hadamard(group) if compress and rotate else None
        # Only whole groups are rotated: a partial last group would mix padding into real rows.
        self.rotated = ({n for n, s in shapes.items() if len(s) == 2 and s[0] % group == 0}
                        if self.rotation is not None else set())
        # With GPTQ (``rotate_inputs``), the MLP's output projection also rotates its input channels
        # (costmodel.input_rotated). Not with nearest rounding: on SmolLM2 that took 4-bit weights
        # from +9.9% to +22.9% perplexity (4 windows; the error spreads onto the outlier channels).
        self.in_rotation = hadamard(IN_ROTATION_BLOCK // group) if self.rotation is not None and rotate_inputs else None
        self.in_rotated = input_rotated(self.shapes) if self.in_rotation is not None else set()
        parts: list[_Part] = []
        off = 0

        def add(name: str, kind: str, shape: tuple[int, ...], dt: torch.dtype) -> None:
            nonlocal off
            size = torch.empty((), dtype=dt).element_size()
            off = -(-off // size) * size
            parts.append(_Part(name, kind, off, shape, dt))
            off += math.prod(shape) * size

        for name, shape in shapes.items():
            if compress and len(shape) == 2:
                out, inp = shape
                groups = -(-out // group)
                add(name, "packed", (inp, groups, group // 2), torch.uint8)
                add(name, "mins", (inp, groups), dtype)
                add(name, "scales", (inp, groups), dtype)
            else:
                add(name, "plain", tuple(shape), dtype)
        self.parts = parts
        self.nbytes = off

    def _view(self, flat: torch.Tensor, p: _Part) -> torch.Tensor:
        return flat[p.offset:p.offset + math.prod(p.shape) * p.dtype.itemsize].view(p.dtype).view(p.shape)

    def quantize_tensor(self, name: str, x: torch.Tensor, hessian: torch.Tensor | None = None) -> QuantizedTensor:
        """The stored 4-bit form of 2-D weight ``name`` (rows rotated if it is in ``rotated``);
        with ``hessian`` (``X^T X`` of its inputs) the codes come from GPTQ (``xrunner.gptq``)."""
        if name in self.rotated:
            x = rotate_groups(x.float(), self.rotation.matrix).to(x.dtype)
        if name in self.in_rotated:
            x = self._rotate_in(x.float()).to(x.dtype)
            if hessian is not None:  # of the rotated inputs: R^T H R
                hessian = self._rotate_in(self._rotate_in(hessian).T)
        if hessian is None:
            return quantize(x, dim=0, group_size=self.group, clip_steps=self.clip_steps)
        return gptq_quantize(x, hessian, group_size=self.group, clip_steps=self.clip_steps)

    def dequantize_tensor(self, name: str, q: QuantizedTensor) -> torch.Tensor:
        """The weight ``q`` stands for, rotated back (a reference path; compute uses :meth:`unpack`)."""
        x = dequantize(q)
        if name in self.in_rotated:
            x = self._rotate_in(x, back=True)
        return rotate_groups(x, self.rotation.matrix.T) if name in self.rotated else x

    def _rotate_in(self, x: torch.Tensor, back: bool = False) -> torch.Tensor:
        """``x`` (last dim: input channels) rotated as :meth:`unpack`'s ``in_rotation`` rotates inputs."""
        outer, inner = self.in_rotation.like(x), self.rotation.like(x)
        return rotate_inputs(x, outer.T, inner.T) if back else rotate_inputs(x, outer, inner)

    def pack(self, w: Mapping[str, torch.Tensor], flat: torch.Tensor,
             quantized: Mapping[str, QuantizedTensor] | None = None) -> None:
        """Write a layer's tensors (quantizing 2-D ones if asked, unless given in ``quantized``) into ``flat``."""
        done: dict[str, QuantizedTensor] = dict(quantized or {})
        for p in self.parts:
            dst = self._view(flat, p)
            if p.kind == "plain":
                dst.copy_(w[p.name])
                continue
            if p.name not in done:
                done[p.name] = self.quantize_tensor(p.name, w[p.name])
            dst.copy_(getattr(done[p.name], p.kind))

    def dequant_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the buffers :meth:`unpack` dequantizes 4-bit weights into: ``[in, out]``, the
        stored layout (``compression.stored_shape``), so dequantization writes them in place."""
        return {n: (s[1], s[0]) for n, s in self.shapes.items() if len(s) == 2}

    def unpack(self, flat: torch.Tensor, dequant: Mapping[str, torch.Tensor] | None) -> "LayerWeights":
        """The layer's weights for compute: views of ``flat``; 4-bit ones dequantized into ``dequant``
        (buffers of :meth:`dequant_shapes`; each weight is an ``[out, in]`` view of its buffer).
        A mixture of experts' 4-bit expert weights wait until a token is routed to the expert
        (:class:`LayerWeights`)."""
        ready: dict[str, torch.Tensor] = {}
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for p in self.parts:
            if p.kind == "plain":
                ready[p.name] = self._view(flat, p)
            else:
                parts.setdefault(p.name, {})[p.kind] = self._view(flat, p)
        experts: dict[str, list[str]] = {}
        for name in parts:
            prefix = expert_prefix(name)
            if prefix is None:
                ready.update(self._dequantized(name, parts[name], dequant))
            else:
                experts.setdefault(prefix, []).append(name)

        def expert(names: list[str]) -> tuple[list[str], Callable[[], dict[str, torch.Tensor]]]:
            """The keys an expert's tensors ``names`` will give, and what dequantizes them."""
            return ([k for n in names for k in self._dequantized_keys(n)],
                    lambda: {k: v for n in names for k, v in self._dequantized(n, parts[n], dequant).items()})
        return LayerWeights(ready, {prefix: expert(names) for prefix, names in experts.items()})

    def _dequantized_keys(self, name: str) -> list[str]:
        """The keys :meth:`_dequantized` gives for 4-bit weight ``name``."""
        module = name.rsplit(".", 1)[0]
        return ([name] + ([module + ".out_rotation"] if name in self.rotated else [])
                + ([module + ".in_rotation", module + ".in_rotation_inner"] if name in self.in_rotated else []))

    def _dequantized(self, name: str, q: Mapping[str, torch.Tensor], dequant: Mapping[str, torch.Tensor] | None
                     ) -> dict[str, torch.Tensor]:
        """4-bit weight ``name`` (its packed, mins and scales views) dequantized into its buffer,
        with the rotations ``model.linear`` applies to it (:meth:`_dequantized_keys`)."""
        assert dequant is not None
        qt = QuantizedTensor(q["packed"], q["mins"], q["scales"], tuple(self.shapes[name]), 0, self.group)
        w = dequantize(qt, out=dequant[name])  # [out, in] view of an [in, out] buffer
        rotations = [self.rotation] * (name in self.rotated)
        if name in self.in_rotated:
            rotations += [self.in_rotation, self.rotation]
        return dict(zip(self._dequantized_keys(name), [w] + [r.like(w) for r in rotations]))


def expert_prefix(name: str) -> str | None:
    """``experts.5.`` for a routed expert's tensor (``experts.5.up_proj.weight``), else None."""
    head, _, rest = name.partition(".")
    index = rest.partition(".")[0]
    return f"experts.{index}." if head == "experts" and index.isdigit() else None


class LayerWeights(Mapping[str, torch.Tensor]):
    """A layer's weights for compute, keyed as ``xrunner.model`` reads them, where each routed
    expert's 4-bit tensors are dequantized on the first read of any of its keys.

    A decode step of a few rows reaches few experts. On a random 4-layer model with 64 experts,
    4 per token, 4-bit weights and 1 row, the engine spent 1.05 s dequantizing and 0.07 s
    computing the decode when every expert was rebuilt each layer step (stop 52). ``on_expert``
    runs each deferred dequantization (the engine times it) and ``experts_dequantized`` counts them.
    """

    def __init__(self, ready: dict[str, torch.Tensor],
                 deferred: dict[str, tuple[list[str], Callable[[], dict[str, torch.Tensor]]]]):
        self._ready, self._deferred = ready, deferred
        self._pending = {k: prefix for prefix, (keys, _f) in deferred.items() for k in keys}
        self.on_expert: Callable[[Callable[[], dict[str, torch.Tensor]]], dict[str, torch.Tensor]] = lambda f: f()
        self.experts_dequantized = 0

    def __getitem__(self, key: str) -> torch.Tensor:
        prefix = self._pending.get(key)
        if prefix is not None:
            keys, thunk = self._deferred.pop(prefix)
            self._ready.update(self.on_expert(thunk))
            for k in keys:
                del self._pending[k]
            self.experts_dequantized += 1
        return self._ready[key]

    def __contains__(self, key: object) -> bool:
        return key in self._ready or key in self._pending

    def __iter__(self) -> Iterator[str]:
        return iter([*self._ready, *self._pending])

    def __len__(self) -> int:
        return len(self._ready) + len(self._pending)


class KVCodec:
    """The KV cache's stored form: ``parts`` tensors ``[rows, Hkv, T, *rest]`` per layer.

    Plain: ``(k, v)`` with ``rest = (d,)``. 4-bit: packed codes, mins and scales of k, then of
    v, grouped along the head dimension, each head's vector first rotated by an orthonormal
    Hadamard matrix (``xrunner.compression``: it spreads outlier channels over the group).
    ``decode`` gives the cache in that rotated space and :meth:`attend` rotates the query and
    un-rotates the output to match, which costs one ``d x d`` product per query instead of one
    per cached position. Position is always dim 2, so a column range of every part is one slice.

    ``centers`` (4-bit only): per layer, the mean K and V ``[Hkv, d]`` of calibration text,
    subtracted before a vector is quantized. A per-channel offset that every key shares (a
    bias-like outlier) otherwise widens every group's range; attention does not change, since
    softmax ignores a shift common to all keys (``q.(k - c)`` differs from ``q.k`` by the same
    ``q.c`` at every position) and the attention weights sum to 1, so :meth:`attend` adds the V
    center back to the output. Measured on SmolLM2 (16 windows): KV cache +2.39% -> +1.14% perplexity.
    """

    def __init__(self, head_dim: int, dtype: torch.dtype, compress: bool, group: int = DEFAULT_GROUP_SIZE,
                 clip_steps: int = KV_CLIP_STEPS, rotate: bool = True,
                 centers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, fused: bool = False):
        self.compress, self.group, self.d, self.dtype = compress, group, head_dim, dtype
        # A 4-bit cache on a CPU attends over its codes (xrunner.kvattend, in float32 whatever the
        # model's dtype), with no dequantized copy: :meth:`attend_stored`.
        self.fused = fused and compress
        self.clip_steps = clip_steps
        self.centers = list(centers) if compress and centers is not None else None
        self.rotation = hadamard(head_dim) if compress and rotate else None
        if compress:
            g = -(-head_dim // group)
            one = [((g, group // 2), torch.uint8), ((g,), dtype), ((g,), dtype)]
            self.rests = one + one
        else:
            self.rests = [((head_dim,), dtype), ((head_dim,), dtype)]

    def _rotate(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        if self.rotation is None:
            return x
        r = self.rotation.like(x)
        # One [n, d] x [d, d] product: a batched [.., 1, d] one ran 2.4x slower on [b, 1, H, d] (CPU).
        return (x.reshape(-1, self.d) @ (r.T if inverse else r)).view(x.shape)

    def _centered(self, x: torch.Tensor, layer: int | None, which: int) -> torch.Tensor:
        """``x [b, Hkv, t, d]`` minus the layer's K (0) or V (1) center, rotated."""
        if self.centers is not None and layer is not None:
            x = x - self.centers[layer][which].to(x.device, x.dtype)[:, None, :]
        return self._rotate(x)

    def prepare(self, k: torch.Tensor, v: torch.Tensor, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` ``[b, Hkv, t, d]`` of ``layer`` in the stored space: centered and rotated
        for a 4-bit cache, as they are for a plain one. A decode step's own K/V go to
        :meth:`pack` and, prepared once, to :meth:`attend_stored` as ``fresh``."""
        if not self.compress:
            return k, v
        return self._centered(k, layer, 0), self._centered(v, layer, 1)

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        """Stored parts of K and V from :meth:`prepare`."""
        if not self.compress:
            return [k, v]
        out = []
        for x in (k, v):
            q = quantize(x, dim=-1, group_size=self.group, clip_steps=self.clip_steps)
            out += [q.packed, q.mins, q.scales]
        return out

    def encode(self, k: torch.Tensor, v: torch.Tensor, layer: int | None = None) -> list[torch.Tensor]:
        """Stored parts of ``k``, ``v`` ``[b, Hkv, t, d]`` of ``layer`` (whose centers apply)."""
        return self.pack(*self.prepare(k, v, layer))

    def decode(self, parts: Sequence[torch.Tensor], into: tuple[torch.Tensor, torch.Tensor] | None = None,
               fresh: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as stored, dequantized (still rotated: pass them to :meth:`attend`).

        ``fresh``: the decode step's own K and V (``[b, Hkv, 1, d]``, from :meth:`prepare`), which
        replace the last position's 4-bit copy, as FlexGen does: the new token attends to itself
        exactly and only the earlier positions carry the 4-bit error (measured on SmolLM2: KV cache
        +2.9% -> +2.4% perplexity, ``benchmarks/compression_ppl.py``).
        """
        if not self.compress:
            return parts[0], parts[1]
        res = []
        for i in range(2):
            packed, mins, scales = parts[3 * i:3 * i + 3]
            shape = tuple(mins.shape[:-1]) + (self.d,)
            q = QuantizedTensor(packed, mins, scales, shape, len(shape) - 1, self.group)
            # Into the front of the scratch buffer, viewed contiguous: no fresh tensor per layer step
            # (at 128 rows x 96 positions, 50 MB each for K and V, page-faulted anew every call).
            out = into[i].view(-1)[:math.prod(shape)].view(shape) if into is not None else None
            x = dequantize(q, out=out)
            if fresh is not None:
                x[:, :, -1:] = fresh[i]
            res.append(x)
        return res[0], res[1]

    def attend(self, spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None, layer: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of ``q`` over ``layer``'s cache from :meth:`decode` (as ``model.attention``)."""
        if self.rotation is None and self.centers is None:
            return attention(spec, q, k, v, mask, causal=False, sinks=sinks)
        out = attention(spec, self._rotate(q), k, v, mask, causal=False, sinks=sinks)
        b, t, _ = out.shape
        return self._unrotated(spec, out.view(b, t, -1, self.d), layer)

    def attend_stored(self, spec: ModelSpec, q: torch.Tensor, parts: Sequence[torch.Tensor],
                      fresh: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                      into: tuple[torch.Tensor, torch.Tensor] | None = None, layer: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of ``q [b, H, 1, d]`` over stored ``parts`` (``[b, Hkv, T, ...]``, the
        last position the step's own, whose exact K/V are ``fresh``, from :meth:`prepare`):
        :meth:`decode` (into ``into``) then :meth:`attend`, or with ``fused`` straight over the codes."""
        if not self.fused:
            kk, vv = self.decode(parts, into, fresh=fresh)
            return self.attend(spec, q, kk, vv, mask, layer, sinks)
        b, hkv, T = parts[0].shape[:3]
        shape = (b, hkv, T - 1, self.d)
        k, v = (QuantizedTensor(*(x[:, :, :T - 1] for x in parts[3 * i:3 * i + 3]), shape, 3, self.group)
                for i in range(2))
        own_k, own_v = (x[:, :, 0] for x in fresh)
        if spec.sliding_window is not None and spec.sliding_window < T:
            mask = visible_keys(mask, 1, T, False, spec.sliding_window, q.device)[:, 0, 0].expand(b, T)
        out = attend_quantized(self._rotate(q)[:, :, 0], k, v, own_k, own_v,
                               None if mask is None else mask[:, :T - 1], spec.attention_scale, spec.attention_softcap,
                               sinks)
        return self._unrotated(spec, out[:, None], layer).to(q.dtype)

    def _unrotated(self, spec: ModelSpec, out: torch.Tensor, layer: int | None) -> torch.Tensor:
        """Attention output ``[b, t, H, d]`` in the rotated, centered space back to ``[b, t, H * d]``."""
        b, t = out.shape[:2]
        out = self._rotate(out, inverse=True)  # [b, t, H, d]
        if self.centers is not None and layer is not None:
            center = self.centers[layer][1].to(out.device, out.dtype)  # [Hkv, d]
            out = out + center.repeat_interleave(spec.num_heads // spec.num_kv_heads, dim=0)
        return out.reshape(b, t, -1)
