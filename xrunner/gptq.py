"""Calibrated 4-bit weights: GPTQ over real text, layer by layer as the engine packs them.

Rounding each weight to its nearest code (``compression.quantize``) minimises the weight's own
error; GPTQ (Frantar et al., 2023; ``compression.gptq_quantize``) instead minimises the error
of the layer's *output* on calibration inputs, which is what the next layer sees. The inputs
of each projection are those of the model as quantized so far: calibration text is embedded
once, then every layer, in order, is quantized (q/k/v, then o, then the MLP's input
projections, then its down projection, each from the activations of the parts before it
already quantized) and the hidden states are carried through the quantized layer.

The stored format is the engine's (``stored_forms.WeightLayout``: rotated row groups of 64, each
range chosen by the range search, here on the column as GPTQ's updates left it), so nothing
downstream changes. It needs text, so real models only: random-weight models keep nearest
rounding.

The same pass records each layer's mean K and V on the text, the centers a 4-bit KV cache is
stored around (``stored_forms.KVCodec``); with weights not quantized it only observes. (All the
sequences: on SmolLM2, 16 windows of held-out text, the cache's perplexity cost was +1.71% with
means over 4 sequences, +1.14% over 16, +1.45% over 64, and +2.39% uncentered.)

The calibration text is the docstrings of a fixed list of standard-library modules (English
prose that ships with Python); ``pydoc_data.topics``, which ``benchmarks/compression_ppl.py``
scores on, is not among them.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch

from xprofiler.specs import ModelSpec
from xrunner.compression import DEFAULT_GROUP_SIZE, QuantizedTensor
from xrunner.model import (Weights, attention, attn_in, embed, layer_ropes, linear, mlp, norm,
                           position_ids_from_mask)
from xsched.errors import UserError
from xsimulator.costmodel import input_rotated

CALIBRATION_MODULES = ("os", "json", "re", "collections", "functools", "itertools", "pathlib", "subprocess",
                       "threading", "asyncio", "typing", "dataclasses", "argparse", "logging", "unittest", "email",
                       "http.client", "urllib.request", "csv", "sqlite3", "decimal", "fractions", "statistics",
                       "random", "socket", "zipfile", "tarfile", "shutil", "tempfile", "textwrap", "difflib",
                       "heapq", "bisect", "contextlib", "inspect", "pickle", "copy", "enum", "abc")
CALIBRATION_SEQUENCES = 64  # docs/BENCHMARKS.md, stop 28: +4.4% perplexity vs +5.2% with 16
# A pass that only records K/V centers (plain weights, 4-bit cache) takes the first 16: means settle
# there (module docstring) and the pass costs a quarter of 64's (docs/BENCHMARKS.md, stop 32).
CENTER_SEQUENCES = 16
CALIBRATION_LENGTH = 256


def calibration_text() -> str:
    """Module and (long) member docstrings of :data:`CALIBRATION_MODULES`, each once, in a fixed order."""
    docs: list[str] = []
    with warnings.catch_warnings():  # reading typing's deprecated aliases (typing.io, typing.re) warns
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in CALIBRATION_MODULES:
            mod = importlib.import_module(name)
            if mod.__doc__:
                docs.append(mod.__doc__)
            for attr in sorted(dir(mod)):
                member = getattr(mod, attr, None)
                doc = getattr(member, "__doc__", None)
                if callable(member) and isinstance(doc, str) and len(doc) > 200:
                    docs.append(doc)
    return "\n\n".join(dict.fromkeys(docs))


def calibration_ids(tokenizer: Any, sequences: int = CALIBRATION_SEQUENCES, length: int = CALIBRATION_LENGTH,
                    first: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """``[sequences, length]`` token ids: those of ``first`` (texts of the job's own kind, already
    tokenized: its prompts), in a fixed shuffled order so that a long file's first prompts do
    not stand for all of it, then :func:`calibration_text`'s for ``tokenizer`` where they fall
    short. GPTQ fits the codes to the text it sees: on SmolLM2, 64 sequences of
    ``pydoc_data.topics`` apart from the scored windows took 4-bit weights from +4.7% to +3.4-3.7%
    perplexity on them (docs/BENCHMARKS.md, stop 64)."""
    need = sequences * length
    ids: list[int] = []
    for i in np.random.default_rng(0).permutation(len(first)):
        if len(ids) >= need:  # (a job of 10^6 prompts copies only what the pass reads)
            break
        ids.extend(first[i])
    del ids[need:]
    if len(ids) < need:
        ids += tokenizer(calibration_text(), add_special_tokens=False)["input_ids"][:need - len(ids)]
    if len(ids) < need:
        raise UserError(f"the calibration text has only {len(ids)} tokens for this tokenizer, {sequences} x "
                        f"{length} needed; pass fewer --calibration-sequences or --weight-rounding nearest")
    return torch.tensor(ids).view(sequences, length)


GRAM_ROWS = 1024  # activation rows converted to float64 at a time by _gram


def _gram(x: torch.Tensor) -> torch.Tensor:
    """``X^T X`` of activations ``[..., in]`` (the GPTQ Hessian up to scale), in float64.

    Summed over chunks of :data:`GRAM_ROWS` rows, so the float64 copy is one chunk, not all of X."""
    x = x.reshape(-1, x.shape[-1])
    g = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
    for i in range(0, x.shape[0], GRAM_ROWS):
        c = x[i:i + GRAM_ROWS].double()
        g.addmm_(c.T, c)
    return g.div_(x.shape[0])


def _tensor_bytes(out_rows: int, in_cols: int, group: int, in_rotated: bool = False) -> int:
    """Bytes ``compression.gptq_quantize`` (behind ``WeightLayout.quantize_tensor``) holds for one
    ``[out, in]`` weight: the caller's float64 Hessian and two more in its Cholesky chain plus the
    float32 factor, beside the rotated float32 copy and the transposed + reordered weight with its
    codes (a column's range search is a few candidates of one column). A weight whose inputs are
    rotated (``costmodel.input_rotated``) holds one more Hessian (the rotated one) and weight copy."""
    n = -(-out_rows // group) * group * in_cols
    extra = in_cols * in_cols * 8 + n * 4 if in_rotated else 0
    return 3 * in_cols * in_cols * 8 + in_cols * in_cols * 4 + 2 * n * 4 + n + extra


def scratch_bytes(spec: ModelSpec, sequences: int, length: int, group: int = DEFAULT_GROUP_SIZE, fit: bool = True,
                  copies_layer: bool = True) -> int:
    """Upper bound on the bytes a :class:`GPTQCalibration` of ``sequences x length`` tokens holds at
    once on its device, beyond the model's own weights: the calibration hidden states, a float32
    copy of the layer, and the largest of its steps (a projection group's inputs, Hessian and
    quantization; the attention; the MLP). ``fit=False``: a pass that only observes (no Hessians,
    no quantization), which copies the layer only when ``copies_layer`` (the source's layer is not
    float32 on the pass's device). The engine plans and accounts this as ``calibration``.
    """
    # (a Qwen2-MoE's shared expert may be wider than its routed ones)
    t, h, q, kv, f = sequences * length, spec.hidden, spec.q_dim, spec.kv_dim, max(spec.ffn, spec.shared_expert_ffn)
    f4 = 4
    numel = sum(math.prod(s) for s in spec.layer_tensor_shapes().values())
    if fit:  # the dequantized float32 layer builds up beside the source's, with the 4-bit records made
        layer = numel * f4 + numel // 2 + 2 * (numel // group) * f4
    else:
        layer = numel * f4 if copies_layer else 0
    gram = min(t, GRAM_ROWS) * max(h, q, f) * 8 if fit else 0

    def quant(out_rows: int, in_cols: int, rotated: bool = False) -> int:
        return _tensor_bytes(out_rows, in_cols, group, rotated) if fit else 0

    qkv = t * h * f4 + max(quant(q, h), quant(kv, h)) + gram
    # normed input, q/k/v, rotary temporaries (products and the rotated half) or SDPA's output
    attend = t * h * f4 + t * (q + 2 * kv) * f4 + 4 * t * q * f4
    o_proj = t * q * f4 + quant(h, q) + gram
    mlp_in = t * h * f4 + quant(f, h) + gram
    mlp = t * h * f4 + (3 if spec.gated_mlp else 2) * t * f * f4
    down = t * f * f4 + quant(h, f, bool(input_rotated(spec.layer_tensor_shapes()))) + gram
    return 2 * t * h * f4 + layer + max(qkv, attend, o_proj, mlp_in, mlp, down)


class GPTQCalibration:
    """Carries calibration hidden states through a model's layers in order: quantizing each with
    GPTQ (:meth:`quantize_layer`) or as it is (:meth:`observe_layer`), and recording each layer's
    mean K and V over the text (``kv_centers``, ``[Hkv, d]`` each, K after the rotary embedding
    as the cache holds it), which ``stored_forms.KVCodec`` subtracts before quantizing the cache.

    ``quantize_tensor(name, w, hessian) -> QuantizedTensor`` and ``dequantize_tensor(name, q)``
    are the layout's (``WeightLayout.quantize_tensor`` / ``dequantize_tensor``): rotation and
    range rule live there, once. Without them the pass can only observe.
    """

    def __init__(self, spec: ModelSpec, head: Weights, ids: torch.Tensor,
                 quantize_tensor: Callable[[str, torch.Tensor, torch.Tensor], QuantizedTensor] | None = None,
                 dequantize_tensor: Callable[[str, QuantizedTensor], torch.Tensor] | None = None):
        self.spec = spec
        self._quantize, self._dequantize = quantize_tensor, dequantize_tensor
        self.device = head["embed_tokens.weight"].device  # where the head lives, the pass runs (float32)
        ids = ids.to(self.device)
        self.pos = position_ids_from_mask(torch.ones_like(ids, dtype=torch.bool))
        self.ropes = layer_ropes(spec, ids.shape[1], self.device)
        self.specs = spec.layer_specs()
        with torch.inference_mode():
            self.hidden = embed(spec, head, ids, self.pos).float()
        self.next_layer = 0
        self.kv_centers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def quantize_layer(self, index: int, w: Weights) -> dict[str, QuantizedTensor]:
        """GPTQ codes for every 2-D tensor of layer ``index`` (layers must come in order)."""
        if self._quantize is None or self._dequantize is None:
            raise RuntimeError("this calibration pass was made without a quantizer: it can only observe")
        return self._layer(index, w, fit=True)

    def observe_layer(self, index: int, w: Weights) -> None:
        """Carry the hidden states through layer ``index`` as it is, recording its K/V centers."""
        self._layer(index, w, fit=False)

    @torch.inference_mode()
    def _layer(self, index: int, w: Weights, fit: bool) -> dict[str, QuantizedTensor]:
        if index != self.next_layer:
            raise RuntimeError(f"GPTQ calibration needs layers in order: got {index}, expected {self.next_layer}")
        spec, h = self.specs[index], self.hidden
        wq = {k: v.to(self.device, torch.float32) for k, v in w.items()}
        out: dict[str, QuantizedTensor] = {}

        def quantize(names: tuple[str, ...], x: torch.Tensor | None) -> None:
            if not fit:
                return
            hessian = None if x is None else _gram(x)
            for name in names:
                out[name] = self._quantize(name, wq[name], hessian)
                wq[name] = self._dequantize(name, out[name]).float()

        if fit:  # (attn_in norms again below; an observing pass needs only that)
            quantize(("q_proj.weight", "k_proj.weight", "v_proj.weight"), norm(spec, h, wq, "attn_norm"))
        # Activations are dropped as soon as they are used: scratch_bytes counts only the live ones.
        q, k, v = attn_in(spec, wq, h, self.pos, self.ropes[index])
        # A softcap (Gemma 2) or a sink (GPT-OSS) is not blind to a shift shared by all keys, so K
        # keeps no center there; with a sink the keys' weights do not sum to 1, so V keeps none either.
        blind = spec.attention_softcap is None and not spec.attention_sinks
        zero = torch.zeros_like(k[0, :, 0])
        self.kv_centers.append((k.mean(dim=(0, 2)) if blind else zero,
                                zero if spec.attention_sinks else v.mean(dim=(0, 2))))
        a = attention(spec, q, k, v, None, causal=True, sinks=wq.get("sinks.weight"))
        del q, k, v
        quantize(("o_proj.weight",), a)
        branch = linear(a, wq, "o_proj")
        h = h + (norm(spec, branch, wq, "attn_post_norm") if spec.sandwich_norms else branch)
        del a, branch
        x = norm(spec, h, wq, "mlp_norm")
        # each MLP weight (an expert's: from the tokens the quantized router sends it) quantized
        # on the inputs it multiplies, just before it does
        branch = mlp(spec, wq, x, before=quantize)
        del x
        self.hidden = h + (norm(spec, branch, wq, "mlp_post_norm") if spec.sandwich_norms else branch)
        self.next_layer += 1
        return out
