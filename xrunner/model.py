"""The one copy of the transformer math: OPT and Llama decoder layers as plain functions.

Weights are passed in as ``dict[str, Tensor]`` keyed by ``ModelSpec.layer_tensor_shapes()`` /
``head_tensor_shapes()`` names, so the profiler can time exactly these functions and the
offloading engine can call them on weights fetched from any tier. A layer is split in three
(``attn_in``, ``attention``, ``attn_out_mlp``) because FlexGen's CPU delegation runs
``attention`` next to a CPU-resident KV cache while the projections run on the GPU.

Conventions: hidden ``[b, t, h]``; q ``[b, H, t, d]``; k, v ``[b, Hkv, T, d]`` covering the
whole context, left padded, with the boolean mask ``[b, T]`` True for real tokens; position ids
``cumsum(mask) - 1`` (0 for padding), to which OPT adds its embedding offset of 2.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from xprofiler.specs import ModelSpec, prefill_band
from xrunner.compression import rotate_inputs
from xsched.errors import UserError
from xsimulator.costmodel import cpu_attention_chunk

Weights = dict[str, torch.Tensor]

OPT_POSITION_OFFSET = 2  # OPT's learned position table starts at index 2 (fairseq legacy)


@dataclass(frozen=True)
class Rope:
    """Rotary tables ``cos, sin`` of shape ``[positions, head_dim]`` (HF rotate-half layout)."""

    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class ModelWeights:
    """A whole model held in memory: the reference path for generation and tests."""

    spec: ModelSpec
    head: Weights
    layers: list[Weights]


def torch_dtype(name: str) -> torch.dtype:
    """``"float16"`` -> ``torch.float16`` (ModelSpec dtype names are torch's)."""
    return getattr(torch, name)


def rope_tables(spec: ModelSpec, length: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Rope | None:
    """Rotary cos/sin for positions ``0..length-1``, or None for learned positions (OPT).

    Computed in float32 and then cast, like the reference implementation, so fp32 results agree
    to rounding.
    """
    if spec.position != "rotary":
        return None
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if spec.rope_divisors:  # rope scaling (Llama 3.1's "llama3", "linear", "yarn")
        inv_freq = inv_freq / torch.tensor(spec.rope_divisors, dtype=torch.float32, device=device)
    freqs = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = spec.rope_attention_factor  # YaRN's
    if scale != 1.0:
        return Rope(cos=(emb.cos() * scale).to(dtype), sin=(emb.sin() * scale).to(dtype))
    return Rope(cos=emb.cos().to(dtype), sin=emb.sin().to(dtype))


def layer_ropes(spec: ModelSpec, length: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> list[Rope | None]:
    """:func:`rope_tables` of each layer's :meth:`~xprofiler.specs.ModelSpec.layer_spec` (Gemma 3's
    windowed layers have their own base), one table per distinct base shared between layers."""
    tables: dict[tuple[float, tuple[float, ...], float], Rope | None] = {}
    out = []
    for s in spec.layer_specs():
        key = (s.rope_theta, s.rope_divisors, s.rope_attention_factor)
        if key not in tables:
            tables[key] = rope_tables(s, length, device, dtype)
        out.append(tables[key])
    return out


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[b, P]`` left padded to the longest prompt, and the mask ``[b, P]``."""
    if not prompts:
        raise UserError("no prompts given")
    if any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[row, width - len(p):] = True
    return ids.to(device), mask.to(device)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions of real tokens counted from 0 per row; padding gets 0."""
    return (mask.long().cumsum(-1) - 1).clamp_(min=0)


def norm(spec: ModelSpec, x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    if spec.norm == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), w[f"{name}.weight"], w[f"{name}.bias"], spec.norm_eps)
    if spec.norm_offset:  # Gemma: scaled by offset + weight in float32, then cast
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=spec.norm_eps)
        return (y * (w[f"{name}.weight"].float() + spec.norm_offset)).to(x.dtype)
    # RMSNorm in float32, then scale in the input dtype (as Llama does).
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=spec.norm_eps).to(x.dtype)
    return w[f"{name}.weight"] * y


def linear(x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    """``x W^T + b``. A weight stored with its rows rotated per block (4-bit weights, key
    ``<name>.out_rotation``: see ``stored_forms.WeightLayout``) gives a rotated output; ``y @ r`` per
    block of output channels rotates it back, before the bias. One stored with its input
    channels rotated too (``<name>.in_rotation`` and ``.in_rotation_inner``, Kronecker factors)
    takes its input rotated the same way."""
    outer = w.get(f"{name}.in_rotation")
    if outer is not None:
        x = rotate_inputs(x, outer, w[f"{name}.in_rotation_inner"])
    r = w.get(f"{name}.out_rotation")
    if r is None:
        return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))
    y = (F.linear(x, w[f"{name}.weight"]).unflatten(-1, (-1, r.shape[0])) @ r).flatten(-2)
    bias = w.get(f"{name}.bias")
    return y if bias is None else y + bias


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def embed(spec: ModelSpec, head_w: Weights, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Token (plus learned position, OPT) embeddings: ``[b, t]`` ids -> ``[b, t, h]``."""
    hidden = F.embedding(input_ids, head_w["embed_tokens.weight"])
    if spec.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to the model's dtype first as transformers does
        hidden = hidden * torch.tensor(spec.embed_scale, dtype=hidden.dtype)
    if spec.position == "learned":
        hidden = hidden + F.embedding(position_ids + OPT_POSITION_OFFSET, head_w["embed_positions.weight"])
    return hidden


def attn_in(spec: ModelSpec, w: Weights, hidden: torch.Tensor, position_ids: torch.Tensor,
            rope: Rope | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-attention norm, q/k/v projections and rotary: returns q ``[b,H,t,d]``, k, v ``[b,Hkv,t,d]``."""
    b, t, _ = hidden.shape
    d = spec.head_dim
    x = norm(spec, hidden, w, "attn_norm")
    q = linear(x, w, "q_proj").view(b, t, spec.num_heads, d)
    k = linear(x, w, "k_proj").view(b, t, spec.num_kv_heads, d)
    if spec.qk_norm:  # Qwen3
        q, k = norm(spec, q, w, "q_norm"), norm(spec, k, w, "k_norm")
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = linear(x, w, "v_proj").view(b, t, spec.num_kv_heads, d).transpose(1, 2)
    if rope is not None:
        cos = rope.cos[position_ids].unsqueeze(1)  # [b, 1, t, d]
        sin = rope.sin[position_ids].unsqueeze(1)
        q = _apply_rope(q, cos, sin)
        k = _apply_rope(k, cos, sin)
    return q, k, v


def attention(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention of ``t`` queries over a left-padded context of ``T`` keys.

    The queries are the last ``t`` positions of the context. ``mask [b, T]`` hides padding keys
    (None: no padding, which lets SDPA pick its fastest kernels); ``causal`` additionally hides
    later keys (prefill), and a sliding window (:func:`visible_keys`) earlier ones. Grouped-query
    attention shares each kv head among ``H / Hkv`` query heads. ``spec`` is the layer's
    (``ModelSpec.layer_spec``): its window, score scale and softcap apply; ``sinks [H]`` are the
    layer's attention sinks (GPT-OSS), a logit per head that joins each softmax with no value.
    """
    b, n_heads, t, d = q.shape
    T = k.shape[2]
    gqa = spec.num_kv_heads != spec.num_heads
    causal = causal and t > 1
    window = spec.sliding_window if spec.sliding_window is not None and spec.sliding_window < T else None
    if causal and window is not None and t == T and T > prefill_band(window):
        return banded_prefill(spec, q, k, v, mask, window, sinks)
    if spec.attention_softcap is not None or sinks is not None:
        allowed = visible_keys(mask, t, T, causal, window, q.device)
        out = explicit_attention(q, k, v, allowed, spec.attention_scale, spec.attention_softcap, sinks)
    elif mask is None and window is None and (not causal or t == T):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, scale=spec.attention_scale)
    else:
        allowed = visible_keys(mask, t, T, causal, window, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa, scale=spec.attention_scale)
    return out.transpose(1, 2).reshape(b, t, n_heads * d)


def banded_prefill(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   window: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """A windowed layer's prefill (:func:`attention`'s arguments, queries = keys) a chunk of
    :func:`xprofiler.specs.prefill_band` queries at a time, each over its own columns and the
    ``window - 1`` before them: a prompt's tokens are contiguous columns after its left padding,
    so no query's window reaches further. The masked full attention computed every query against
    every key: ``n^2`` scores (and their scratch) where this computes about ``n (window + chunk)``."""
    T, c = q.shape[2], prefill_band(window)
    outs = []
    for s in range(0, T, c):
        e, ks = min(T, s + c), max(0, s - window + 1)
        outs.append(attention(spec, q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e],
                              None if mask is None else mask[:, ks:e], causal=True, sinks=sinks))
    return torch.cat(outs, dim=1)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                       scale: float | None, cap: float | None = None, sinks: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """Attention that SDPA cannot do: scores through ``cap * tanh(score / cap)`` before the mask
    (Gemma 2), and a sink logit per head in each softmax whose weight goes to no value (GPT-OSS).
    Scores in the inputs' dtype, softmax in float32, as transformers does. ``q [b, H, t, d]``,
    ``k, v [b, Hkv, T, d]``, ``allowed [b or 1, 1, t, T]``, ``sinks [H]``; returns ``[b, H, t, d]``."""
    b, n_heads, t, d = q.shape
    hkv, T = k.shape[1], k.shape[2]
    rep = n_heads // hkv
    qg = q.reshape(b, hkv, rep * t, d)  # each kv head's query heads, stacked
    scores = (qg @ k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.view(b, hkv, rep, t, T).masked_fill(~allowed[:, :, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, hkv, rep, 1, 1).expand(b, hkv, rep, t, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :T]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return (probs.to(q.dtype).reshape(b, hkv, rep * t, T) @ v).view(b, n_heads, t, d)


def visible_keys(mask: torch.Tensor | None, t: int, T: int, causal: bool, window: int | None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Which of ``T`` keys each of the last ``t`` positions attends to: ``[b or 1, 1, t, T]`` bool.

    ``mask [b, T]`` marks real tokens (None: all real); ``causal`` hides later keys; ``window``
    keeps the query's own and the ``window - 1`` real tokens before it (HF Mistral's
    ``kv_idx > q_idx - sliding_window``; counting real tokens, not columns, is the same for a
    sequence's contiguous tokens and holds after a refilled slot's older, masked columns). A padding
    query would see no key at all, so every query may always see its own position: its output is
    ignored but stays finite.
    """
    q_pos = torch.arange(T - t, T, device=device)[:, None]
    k_pos = torch.arange(T, device=device)[None, :]
    allowed = torch.ones((1, 1, t, T), dtype=torch.bool, device=device) if mask is None else mask[:, None, None, :]
    if causal:
        allowed = allowed & (k_pos <= q_pos)
    if window is not None:
        real = torch.ones((1, T), dtype=torch.long, device=device) if mask is None else mask.long()
        seen = real.cumsum(-1)  # real tokens in columns [0, j]
        # real tokens in [key, query] for a real key: seen[query] - seen[key] + 1
        allowed = allowed & ((seen[:, T - t:, None] - seen[:, None, :]) < window)[:, None]
    return allowed | (k_pos == q_pos)


def is_range(idx: Sequence[int]) -> bool:
    """Whether ``idx`` is a non-empty run of consecutive indices (a slice, not a gather)."""
    return len(idx) > 0 and list(idx) == list(range(idx[0], idx[0] + len(idx)))


def cpu_attention_chunk_rows(q: torch.Tensor, ctx: Sequence[torch.Tensor], idx: Sequence[int], chunk_bytes: int
                             ) -> int:
    """Rows per float32 chunk of :func:`attend_rows_on_cpu`; 0: none (float32 rows that are a
    range attend over the cache in place)."""
    if q.dtype == torch.float32 and is_range(idx):
        return 0
    return cpu_attention_chunk(len(idx), sum(4 * x[0].numel() for x in ctx), chunk_bytes)


def attend_rows_on_cpu(spec: ModelSpec, q: torch.Tensor, ctx: Sequence[torch.Tensor], idx: Sequence[int],
                       mask: torch.Tensor, chunk_bytes: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of ``q [n, H, 1, d]`` over rows ``idx`` of the K/V context ``ctx`` (each
    ``[rows, T, Hkv, d]``, positions-major as the engine's cpu tier and relay keep it), on the CPU.

    Half precision attends in float32 (as FlexGen does: CPU half kernels are slow, and the
    profile's CPU rates are float32 ones), and rows that are no range must be gathered. Both go
    through a float32 buffer of about ``chunk_bytes``, a few rows at a time, so each chunk is
    attended while it is still in the cache. Converting the whole context at once wrote a fresh
    float32 copy that the kernel read back from memory, and every such copy was a new mapping
    that page-faulted in: 64 rows x 256 positions of opt-1.3b in bfloat16 took 181-262 ms that
    way and 23-44 ms in 4-8 MiB chunks (2 threads, the 2-core VM of stop 39).
    """
    m = cpu_attention_chunk_rows(q, ctx, idx, chunk_bytes)
    if m == 0:
        views = [x.narrow(0, idx[0], len(idx)).transpose(1, 2) for x in ctx]
        return attention(spec, q, *views, None if bool(mask.all()) else mask, causal=False, sinks=sinks)
    n = len(idx)
    bufs = [torch.empty((m,) + tuple(x.shape[1:]), dtype=torch.float32) for x in ctx]
    out = torch.empty((n, 1, q.shape[1] * q.shape[3]), dtype=q.dtype)
    for i in range(0, n, m):
        sel = list(idx[i:i + m])
        j = len(sel)
        for buf, x in zip(bufs, ctx):
            if is_range(sel):
                buf[:j].copy_(x[sel[0]:sel[0] + j])
            else:
                buf[:j].copy_(x.index_select(0, torch.tensor(sel, dtype=torch.long)))
        mk = mask[i:i + j]
        out[i:i + j] = attention(spec, q[i:i + j].float(), *(buf[:j].transpose(1, 2) for buf in bufs),
                                 None if bool(mk.all()) else mk, causal=False, sinks=sinks)
    return out


def mlp_hidden(spec: ModelSpec, w: Weights, x: torch.Tensor, prefix: str = "") -> torch.Tensor:
    """The MLP's inner activation (the input of its down projection) for normed input ``x``;
    ``prefix`` names an expert's (``experts.3.``)."""
    if spec.activation == "gelu_tanh":  # Gemma's GeGLU
        return F.gelu(linear(x, w, f"{prefix}gate_proj"), approximate="tanh") * linear(x, w, f"{prefix}up_proj")
    if spec.activation == "swiglu_clamped":  # GPT-OSS's
        gate = linear(x, w, f"{prefix}gate_proj").clamp(max=spec.glu_limit)
        up = linear(x, w, f"{prefix}up_proj").clamp(-spec.glu_limit, spec.glu_limit)
        return (up + 1) * gate * torch.sigmoid(gate * spec.glu_alpha)
    if spec.gated_mlp:
        return F.silu(linear(x, w, f"{prefix}gate_proj")) * linear(x, w, f"{prefix}up_proj")
    return F.relu(linear(x, w, "fc1"))


def route(spec: ModelSpec, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' routing of tokens ``x [n, h]``: the ``experts_per_token`` experts of
    each (``[n, k]`` ids) and their weights (the router's softmax in float32, renormalized over the
    chosen ones where the spec says, then in ``x``'s dtype), as Mixtral and Qwen3-MoE route."""
    probs = torch.softmax(linear(x, w, "router").float(), dim=-1)
    weights, experts = probs.topk(spec.experts_per_token, dim=-1)
    if spec.expert_weights_renormalized:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(x.dtype)


def expert_rows(experts: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, the tokens routed to it, which of their choices it is) for each expert chosen at
    least once in ``experts [n, k]``, in expert order."""
    out = []
    for e in torch.unique(experts).tolist():
        rows, slot = (experts == e).nonzero(as_tuple=True)
        out.append((e, rows, slot))
    return out


# ``before(names, inputs)``: called by :func:`mlp` before weights ``names`` multiply ``inputs``
# (None: no token reaches them); the GPTQ pass quantizes them there, on the inputs it sees
BeforeWeights = Callable[[tuple[str, ...], "torch.Tensor | None"], None]


def mlp(spec: ModelSpec, w: Weights, x: torch.Tensor, before: BeforeWeights | None = None) -> torch.Tensor:
    """The MLP's output for normed input ``x [..., h]``: dense, or each token's experts' outputs
    summed by its routing weights (:func:`route`; only the tokens routed to an expert go through
    it), plus Qwen2-MoE's shared expert scaled by ``sigmoid(shared_expert_gate . x)``."""
    def see(names: tuple[str, ...], inputs: torch.Tensor | None) -> None:
        if before is not None:
            before(names, inputs)

    def branch(prefix: str, inputs: torch.Tensor, gate: tuple[str, ...] = ()) -> torch.Tensor:
        down = f"{prefix}down_proj" if spec.gated_mlp else "fc2"
        see((f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight") + gate if spec.gated_mlp else ("fc1.weight",),
            inputs)
        act = mlp_hidden(spec, w, inputs, prefix)
        see((f"{down}.weight",), act)
        return linear(act, w, down)

    if not spec.num_experts:
        return branch("", x)
    flat = x.reshape(-1, x.shape[-1])
    see(("router.weight",), flat)
    experts, weights = route(spec, w, flat)
    out = torch.zeros_like(flat)
    chosen = {e: (rows, slot) for e, rows, slot in expert_rows(experts)}
    for e in range(spec.num_experts) if before is not None else sorted(chosen):
        if e not in chosen:
            see(tuple(f"experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")), None)
            continue
        rows, slot = chosen[e]
        out.index_add_(0, rows, branch(f"experts.{e}.", flat[rows]) * weights[rows, slot, None])
    if spec.shared_expert_ffn:
        shared = branch("shared_expert.", flat, gate=("shared_expert_gate.weight",))
        out += torch.sigmoid(linear(flat, w, "shared_expert_gate")) * shared
    return out.view(x.shape)


def attn_out_mlp(spec: ModelSpec, w: Weights, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Output projection and residual, then pre-norm MLP (ReLU, SwiGLU, GeGLU or a mixture of
    experts, :func:`mlp`) and residual; with
    ``sandwich_norms`` (Gemma 2, 3) each branch's output is normed before it joins the residual."""
    out = linear(attn, w, "o_proj")
    if spec.sandwich_norms:
        out = norm(spec, out, w, "attn_post_norm")
    hidden = hidden + out
    out = mlp(spec, w, norm(spec, hidden, w, "mlp_norm"))
    if spec.sandwich_norms:
        out = norm(spec, out, w, "mlp_post_norm")
    return hidden + out


def layer_forward(spec: ModelSpec, w: Weights, hidden: torch.Tensor, position_ids: torch.Tensor,
                  rope: Rope | None, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor | None,
                  start: int) -> torch.Tensor:
    """One decoder layer over ``t`` new positions with a preallocated KV cache.

    ``k_cache, v_cache [b, Hkv, capacity, d]`` receive the new keys/values at
    ``[start, start + t)``; attention runs over ``[0, start + t)`` with ``mask [b, start + t]``
    (None when no row has padding). Prefill is ``start == 0`` (causal); decode is ``t == 1``.
    """
    t = hidden.shape[1]
    q, k, v = attn_in(spec, w, hidden, position_ids, rope)
    end = start + t
    k_cache[:, :, start:end] = k
    v_cache[:, :, start:end] = v
    attn = attention(spec, q, k_cache[:, :, :end], v_cache[:, :, :end], mask, causal=t > 1, sinks=w.get("sinks.weight"))
    return attn_out_mlp(spec, w, attn, hidden)


def lm_head_name(spec: ModelSpec) -> str:
    """The head tensor the logits GEMM reads: the token embedding when tied."""
    return "embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"


def head_layouts(matrix: torch.Tensor) -> dict[str, torch.Tensor]:
    """The LM head matrix (``[vocab, h]``) in each memory layout a logits product can read: ``rows``
    (``[vocab, h]`` in memory) and ``transposed`` (``[h, vocab]`` in memory, the same ``[vocab, h]``
    tensor to every caller). The layout ``matrix`` already has is itself, not a copy."""
    return {"rows": matrix.contiguous(), "transposed": matrix.t().contiguous().t()}


def head_layout_of(matrix: torch.Tensor) -> str:
    """Which of :func:`head_layouts` ``matrix`` is in ("" for neither)."""
    return "rows" if matrix.is_contiguous() else "transposed" if matrix.t().is_contiguous() else ""


def head_product_points(layouts: dict[str, torch.Tensor | Sequence[torch.Tensor]], row_counts: Sequence[int],
                        seed: int = 0, **meta: Any) -> list[Any]:
    """Profiler points (``xprofiler.samples.Point``, bench ``head``) of the logits product of each
    row count with each of ``layouts``; the shape column says which (:func:`head_point_of`).
    A layout given as several copies cycles through them call by call. ``meta`` fills the other
    sample columns (model, dtype)."""
    from xprofiler.samples import Point, sample_meta

    copies = {name: [w] if isinstance(w, torch.Tensor) else list(w) for name, w in layouts.items()}
    any_w = next(iter(copies.values()))[0]
    vocab, h = any_w.shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    points = []
    for r in row_counts:
        x = torch.randn(r, h, generator=gen).to(device=any_w.device, dtype=any_w.dtype)
        for name, ws in copies.items():
            row = sample_meta("head", shape=f"{name}:{r}x{h}x{vocab}", batch=r, flops=2.0 * r * h * vocab, **meta)
            cycle = itertools.cycle(ws)
            points.append(Point(row, lambda x=x, cycle=cycle: F.linear(x, next(cycle))))
    return points


def head_point_of(shape: str) -> tuple[str, int]:
    """(layout, rows) of a :func:`head_product_points` sample's shape."""
    layout, dims = shape.split(":")
    return layout, int(dims.split("x")[0])


def drain_rows(rows: int) -> list[int]:
    """Row counts at which a batch of ``rows`` slots multiplies by the LM head: full, and a few
    counts it passes through as its sequences finish. The layout is chosen over all of them:
    on the project's VM (opt-125m's head, 1 thread) the row-major layout ran 16 rows in 27 ms
    but 13-15 rows in 63-66 ms, while the transposed one took 24-25 ms at each."""
    return sorted({rows} | {max(1, round(rows * f)) for f in (0.875, 0.625, 0.375)}, reverse=True)


def head_layout_seconds(layouts: dict[str, torch.Tensor], rows: Sequence[int], repeats: int = 3
                        ) -> dict[str, float]:
    """Per layout in ``layouts``, the fastest of ``repeats`` timed logits products summed over the
    row counts ``rows``, with the profiler's harness (warm-up, passes in shuffled order, so that
    drift hits every layout).

    Which layout is faster depends on the shape and the row count, so it is measured, not
    assumed: on the project's VM (1 thread) the transposed one is 1.7x faster for one row of every
    shape tried, 1.2-1.6x for 4-64 rows of a 768- or 1024-wide head, and 0.8-0.9x for 4-64 rows
    of SmolLM2's 576-wide one.
    """
    from xprofiler.samples import run_points, summarize_by, wall_clock

    with torch.inference_mode():
        samples = run_points(head_product_points(layouts, list(rows)), wall_clock, passes=repeats)
    best = summarize_by(samples, "shape", lambda r: r["time_s"] / r["count"], stat="min")
    total: dict[str, float] = {}
    for shape, t in best.items():
        name = head_point_of(shape)[0]
        total[name] = total.get(name, 0.0) + t
    return total


def cpu_head_layout(spec: ModelSpec, head_w: Weights, rows: int, layout: str | None = None) -> Weights:
    """``head_w`` with the LM head matrix in the layout (:func:`head_layouts`) that multiplies a
    batch of ``rows`` slots fastest as it drains (:func:`drain_rows`), measured here, when it
    lives on the CPU; CUDA keeps the stored one.

    A decode step multiplies a few rows by the whole matrix, and torch's CPU GEMM streams it up to
    1.7x faster transposed for most shapes (:func:`head_layout_seconds`). The embedding lookup
    then reads strided rows, 0.3 ms for 32 tokens. Choosing holds a second copy of the matrix for
    a moment (``CostModel.memory``: ``head_layout``). ``head_w`` may hold either layout, so a
    runner whose batch size changes can choose again. ``layout`` ("rows" or "transposed") skips
    the timing: a caller that builds many runners of one model and batch size chose it before.
    """
    name = lm_head_name(spec)
    w = head_w[name]
    if w.device.type != "cpu" or w.dim() != 2 or not head_layout_of(w):
        return head_w
    layouts = head_layouts(w)
    if layout is None:
        seconds = head_layout_seconds(layouts, drain_rows(rows))
        layout = min(seconds, key=seconds.get)
    return {**head_w, name: layouts[layout]}


def final_logits(spec: ModelSpec, head_w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head (the token embedding when tied): ``[..., h]`` -> ``[..., vocab]``."""
    x = norm(spec, hidden, head_w, "final_norm")
    logits = F.linear(x, head_w[lm_head_name(spec)])
    if spec.logit_softcap is not None:  # Gemma 2
        logits = torch.tanh(logits / spec.logit_softcap) * spec.logit_softcap
    return logits
