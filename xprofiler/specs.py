"""ModelSpec: the shape of a decoder-only transformer, and the sizes and FLOPs derived from it.

Every stage sizes things from this one description: the profiler times layers of this shape,
the simulator and scheduler turn it into bytes and seconds, the runner builds the model from
it. Byte and FLOP formulas follow FlexGen §3 (weights ``l(8h^2 + 4h*h2)`` bytes in fp16, KV
cache ``4*b*l*h*(s+n)`` bytes) generalised to grouped-query attention, gated MLPs and biases;
they count every parameter exactly instead of FlexGen's approximation.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from xsched.contract import Contract
from xsched.errors import UserError
from xsched.fileio import json_error_text, path_exists, read_text

Family = Literal["opt", "llama"]
DType = Literal["float16", "bfloat16", "float32"]

DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}

# ModelSpec fields that change no step's cost (ModelSpec.cost_key).
COST_FREE_FIELDS = ("name", "dtype", "norm_eps", "rope_theta", "local_rope_theta", "max_positions", "eos_token_id")


# Query chunk of a windowed layer's banded prefill attention: at least this many queries per call,
# so a small window does not become many small kernels.
PREFILL_BAND_MIN = 128


def prefill_band(window: int) -> int:
    """Queries per chunk of a windowed layer's prefill (``xrunner.model.attention``): each chunk
    attends to its own columns and the ``window - 1`` before them, so a prompt of ``n`` tokens
    computes about ``n (window + chunk)`` scores instead of ``n^2``."""
    return max(window, PREFILL_BAND_MIN)


@dataclass(frozen=True)
class ModelSpec(Contract):
    """Architecture of an OPT- or Llama-family model (frozen, JSON round-trip). Mistral, Qwen2,
    Qwen3, Phi-3 and Gemma checkpoints are Llama-family specs: Qwen2 adds biases to q/k/v
    (``qkv_bias``), Qwen3 an RMSNorm over each head's q and k (``qk_norm``), and Mistral-7B-v0.1
    and Phi-3-mini let every layer attend to its last ``sliding_window`` positions only (Phi-3's
    fused projections are a checkpoint layout, which the loader splits). Gemma scales its norms
    by ``1 + weight`` and its embeddings by ``sqrt(hidden)``, gates its MLP with tanh-GELU, and
    Gemma 2 and 3 add norms after attention and the MLP (``sandwich_norms``), window only some
    layers (``window_layers``), cap attention scores and logits with ``tanh`` and (Gemma 3) give
    the windowed layers their own rotary base (``local_rope_theta``). :meth:`layer_spec` is one
    layer's view, with its own window and rotary base. Mixtral, Qwen2/3-MoE and GPT-OSS replace
    the MLP by a mixture of experts (``num_experts``); GPT-OSS adds attention sinks and biases on
    its router and experts (``attention_sinks``, ``mlp_bias``)."""

    SCHEMA: ClassVar[str] = "xsched.ModelSpec/1"

    name: str
    family: Family
    num_layers: int
    hidden: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    norm: Literal["layernorm", "rmsnorm"]
    activation: Literal["relu", "silu", "gelu_tanh", "swiglu_clamped"]
    position: Literal["learned", "rotary"]
    tied_embeddings: bool
    dtype: DType = "float16"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    bias: bool = False  # biases on the q/k/v/o and MLP projections (OPT; q/k/v/o only for a gated MLP)
    qkv_bias: bool = False  # biases on q/k/v alone (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's q and k, before rotary (Qwen3)
    # Every layer's query sees its own and the previous sliding_window - 1 positions (Mistral v0.1)
    sliding_window: int | None = None
    # Rotary inverse frequency i is rope_theta ** (-2i / head_dim) / rope_divisors[i]: a rope
    # scaling ("linear", Llama 3.1's "llama3", "yarn") or a GGUF's rope_freqs tensor; () when unscaled
    rope_divisors: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0  # cos and sin scaled by it (YaRN's 0.1 ln(factor) + 1)
    # Which layers sliding_window applies to (Gemma 2: every other one); () when it applies to all
    window_layers: tuple[bool, ...] = ()
    # The windowed layers' rotary base, unscaled (Gemma 3's local layers); None: rope_theta as the others
    local_rope_theta: float | None = None
    norm_offset: float = 0.0  # RMSNorm scales by offset + weight (Gemma: 1)
    embed_scale: float = 1.0  # token embeddings multiplied by it (Gemma: sqrt(hidden), in the model's dtype)
    sandwich_norms: bool = False  # norms on attention's and the MLP's outputs too (Gemma 2, 3)
    attention_scale: float | None = None  # multiplies q.k; None: 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar)
    attention_softcap: float | None = None  # scores become cap * tanh(score / cap) (Gemma 2's 50)
    logit_softcap: float | None = None  # the same on the final logits (Gemma 2's 30)
    # Mixture of experts (Mixtral, Qwen3-MoE): num_experts gated MLPs of width ffn, a linear router
    # sending each token to experts_per_token of them, their outputs summed by the router's softmax
    # weights (renormalized over the chosen ones with expert_weights_renormalized); 0: a dense MLP
    num_experts: int = 0
    experts_per_token: int = 0
    expert_weights_renormalized: bool = True
    # Qwen2-MoE: a gated MLP of this width that every token goes through, its output scaled by
    # sigmoid(shared_expert_gate . x), beside the routed experts; 0: none
    shared_expert_ffn: int = 0
    # GPT-OSS: a learned logit per head that joins every query's softmax and takes weight from the
    # keys without giving a value (layer tensor sinks.weight); biases on the router and every expert
    # (or the dense MLP's projections); and its clamped SwiGLU, (up + 1) * g * sigmoid(alpha g)
    # with g = min(gate, limit) and up clamped to +-limit (activation "swiglu_clamped")
    attention_sinks: bool = False
    mlp_bias: bool = False
    glu_alpha: float = 1.702
    glu_limit: float = 7.0
    eos_token_id: int | None = None
    # More end-of-sequence ids (a config's list after its first, generation_config.json's):
    # Llama-3.1-Instruct ends turns with any of three, and HF's generate stops at each.
    extra_eos_token_ids: tuple[int, ...] = ()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence, the main one first."""
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return first + tuple(t for t in self.extra_eos_token_ids if t != self.eos_token_id)

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden", "ffn", "num_heads", "num_kv_heads", "head_dim",
                    "vocab_size", "max_positions"):
            if not 0 < getattr(self, key) < 2**31:  # 1e20 overflowed numpy; no model is near 2**31
                raise ValueError(f"{key} must be positive and below 2**31, got {getattr(self, key)}")
        if self.sliding_window is not None and not (0 < self.sliding_window < 2**31 and self.family == "llama"):
            raise ValueError(f"sliding_window must be a positive whole number on a Llama-family model, "
                             f"got {self.sliding_window}")
        if self.rope_divisors and not (self.position == "rotary" and len(self.rope_divisors) == self.head_dim // 2
                                       and all(0 < x < math.inf for x in self.rope_divisors)):
            raise ValueError(f"rope_divisors must hold head_dim / 2 = {self.head_dim // 2} positive numbers on a "
                             f"rotary model, got {len(self.rope_divisors)}")
        if not 0 < self.rope_attention_factor < math.inf or (self.rope_attention_factor != 1.0
                                                             and self.position != "rotary"):
            raise ValueError(f"rope_attention_factor must be positive on a rotary model, got "
                             f"{self.rope_attention_factor}")
        if self.window_layers and (self.sliding_window is None or len(self.window_layers) != self.num_layers):
            raise ValueError(f"window_layers needs a sliding_window and one flag per layer ({self.num_layers}), "
                             f"got {len(self.window_layers)}")
        if not 0 < self.norm_eps < 1:  # NaN or -1 normed every hidden state to NaN: every token came out 0
            raise ValueError(f"norm_eps must be a small positive number, got {self.norm_eps}")
        if self.position == "rotary" and not 1 < self.rope_theta < math.inf:  # (0, -5, NaN: NaN rotations too)
            raise ValueError(f"rope_theta must be above 1 on a rotary model, got {self.rope_theta}")
        if self.local_rope_theta is not None and not (self.sliding_window is not None and self.position == "rotary"
                                                      and 1 < self.local_rope_theta < math.inf):
            raise ValueError(f"local_rope_theta must be above 1, on a rotary model with a sliding_window, got "
                             f"{self.local_rope_theta}")
        for key in ("attention_scale", "attention_softcap", "logit_softcap"):
            value = getattr(self, key)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{key} must be a positive number or None, got {value}")
        if not 0 < self.embed_scale < math.inf or not 0 <= self.norm_offset < math.inf:
            raise ValueError(f"embed_scale must be positive and norm_offset >= 0, got {self.embed_scale}, "
                             f"{self.norm_offset}")
        if (self.norm_offset or self.sandwich_norms) and self.norm != "rmsnorm":
            raise ValueError("norm_offset and sandwich_norms are Gemma's: they need norm='rmsnorm'")
        if self.num_experts and not (self.family == "llama" and 0 < self.experts_per_token <= self.num_experts):
            raise ValueError(f"a mixture of experts needs a Llama-family model and 1 <= experts_per_token <= "
                             f"num_experts, got {self.experts_per_token} of {self.num_experts}")
        if (self.experts_per_token or self.shared_expert_ffn) and not self.num_experts:
            raise ValueError("experts_per_token and shared_expert_ffn need num_experts")
        if not 0 <= self.shared_expert_ffn < 2**31:
            raise ValueError(f"shared_expert_ffn must be >= 0, got {self.shared_expert_ffn}")
        if self.qk_norm and self.norm != "rmsnorm":
            raise ValueError("qk_norm is an RMSNorm over each head (Qwen3): it needs norm='rmsnorm'")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.family == "opt" and (self.norm, self.activation, self.position) != ("layernorm", "relu", "learned"):
            raise ValueError("OPT models use layernorm, relu and learned positions")
        if self.family == "llama" and (self.norm, self.position) != ("rmsnorm", "rotary") or \
                self.family == "llama" and self.activation not in ("silu", "gelu_tanh", "swiglu_clamped"):
            raise ValueError("Llama models use rmsnorm, rotary positions and silu (SwiGLU), gelu_tanh (Gemma's "
                             "GeGLU) or swiglu_clamped (GPT-OSS's)")

    def windowed(self, layer: int) -> bool:
        """Whether ``layer`` attends through ``sliding_window``."""
        return self.sliding_window is not None and (not self.window_layers or self.window_layers[layer])

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer attends alike (one window, one rotary base): :meth:`layer_spec` is self."""
        return not self.window_layers and self.local_rope_theta is None

    def layer_spec(self, layer: int) -> "ModelSpec":
        """This spec as ``layer`` sees it: its own window (or none) and rotary base on every layer,
        so that attention and rotary code need no layer index. Callers keep the list
        (:meth:`layer_specs`): building one validates it again."""
        if self.uniform_layers:
            return self
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} of a {self.num_layers}-layer model")
        local = self.windowed(layer)
        rope: dict[str, Any] = {}
        if local and self.local_rope_theta is not None:
            rope = dict(rope_theta=self.local_rope_theta, rope_divisors=(), rope_attention_factor=1.0)
        return replace(self, sliding_window=self.sliding_window if local else None, window_layers=(),
                       local_rope_theta=None, **rope)

    def layer_specs(self) -> list["ModelSpec"]:
        """:meth:`layer_spec` of every layer (one object, ``self``, when the layers are uniform)."""
        return [self.layer_spec(i) for i in range(self.num_layers)]

    # ----------------------------------------------------------------- sizes
    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    def layer_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of one decoder layer (the runner's naming)."""
        h, f = self.hidden, self.ffn
        shapes: dict[str, tuple[int, ...]] = {
            "q_proj.weight": (self.q_dim, h),
            "k_proj.weight": (self.kv_dim, h),
            "v_proj.weight": (self.kv_dim, h),
            "o_proj.weight": (h, self.q_dim),
        }
        if self.num_experts:
            shapes["router.weight"] = (self.num_experts, h)
            for e in range(self.num_experts):
                shapes.update({f"experts.{e}.gate_proj.weight": (f, h), f"experts.{e}.up_proj.weight": (f, h),
                               f"experts.{e}.down_proj.weight": (h, f)})
            if self.shared_expert_ffn:
                fs = self.shared_expert_ffn
                shapes.update({"shared_expert.gate_proj.weight": (fs, h), "shared_expert.up_proj.weight": (fs, h),
                               "shared_expert.down_proj.weight": (h, fs), "shared_expert_gate.weight": (1, h)})
        elif self.gated_mlp:
            shapes.update({"gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f)})
        else:
            shapes.update({"fc1.weight": (f, h), "fc2.weight": (h, f)})
        if self.bias or self.qkv_bias:
            shapes.update({"q_proj.bias": (self.q_dim,), "k_proj.bias": (self.kv_dim,),
                           "v_proj.bias": (self.kv_dim,)})
        if self.bias:
            shapes["o_proj.bias"] = (h,)
            shapes.update({"fc1.bias": (f,), "fc2.bias": (h,)} if not self.gated_mlp else
                          {})
        if self.qk_norm:
            shapes.update({"q_norm.weight": (self.head_dim,), "k_norm.weight": (self.head_dim,)})
        if self.attention_sinks:
            shapes["sinks.weight"] = (self.num_heads,)
        if self.mlp_bias:  # the router's and each expert's, or the dense MLP's
            mlp_biases = {n[:-len("weight")] + "bias": (s[0],) for n, s in shapes.items()
                          if n == "router.weight" or n.startswith(("experts.", "gate_proj", "up_proj", "down_proj"))}
            shapes.update(mlp_biases)
        if self.norm == "layernorm":
            shapes.update({"attn_norm.weight": (h,), "attn_norm.bias": (h,),
                           "mlp_norm.weight": (h,), "mlp_norm.bias": (h,)})
        else:
            shapes.update({"attn_norm.weight": (h,), "mlp_norm.weight": (h,)})
        if self.sandwich_norms:
            shapes.update({"attn_post_norm.weight": (h,), "mlp_post_norm.weight": (h,)})
        return shapes

    def head_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the tensors outside the decoder layers (embeddings, final norm, head)."""
        h = self.hidden
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (self.vocab_size, h)}
        if self.position == "learned":
            shapes["embed_positions.weight"] = (self.max_positions + 2, h)  # OPT's offset of 2
        shapes["final_norm.weight"] = (h,)
        if self.norm == "layernorm":
            shapes["final_norm.bias"] = (h,)
        if not self.tied_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    @property
    def params_per_layer(self) -> int:
        return sum(_numel(s) for s in self.layer_tensor_shapes().values())

    @property
    def matmul_params_per_layer(self) -> int:
        """Parameters of the layer's projections (every expert's, with a mixture of experts)."""
        return sum(_numel(s) for n, s in self.layer_tensor_shapes().items() if len(s) == 2)

    @property
    def active_matmul_params_per_layer(self) -> int:
        """Projection parameters one token multiplies by: the router, its ``experts_per_token``
        experts (not all of them) and any shared expert, with a mixture of experts."""
        return self.matmul_params_per_layer - (self.num_experts - self.experts_per_token) * self.expert_params

    @property
    def expert_params(self) -> int:
        """Projection parameters of one routed expert (0 without a mixture of experts)."""
        return 3 * self.ffn * self.hidden if self.num_experts else 0

    def experts_reached(self, tokens: Any) -> Any:
        """Expected distinct routed experts that ``tokens`` tokens (a number or numpy array) send
        work to, each token choosing ``experts_per_token`` of ``num_experts`` uniformly at random:
        ``E (1 - (1 - k / E) ** tokens)``. A trained router's favourites make it fewer, so this
        prices the most that a step's tokens can reach on average."""
        e = self.num_experts
        return e * (1.0 - (1.0 - self.experts_per_token / e) ** tokens) if e else 0.0

    @property
    def head_params(self) -> int:
        return sum(_numel(s) for s in self.head_tensor_shapes().values())

    @property
    def num_params(self) -> int:
        return self.params_per_layer * self.num_layers + self.head_params

    @property
    def weight_bytes_per_layer(self) -> int:
        return self.params_per_layer * self.dtype_bytes

    @property
    def head_weight_bytes(self) -> int:
        return self.head_params * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """All weights, decoder layers plus embeddings and head."""
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """Key plus value for one token in one layer (FlexGen's 4*h bytes in fp16 for MHA)."""
        return 2 * self.kv_dim * self.dtype_bytes

    def decode_context(self, context: Any) -> Any:
        """Positions a decode query reads and attends to at ``context`` positions, averaged over the
        layers: a windowed layer reads its last ``sliding_window`` only (the runner loads and
        attends to no older column); the cache still holds them all. Numbers or numpy arrays.
        A refilled prompt longer than its batch's context leaves masked columns inside the other
        rows' windows, which the runner reads too; this count leaves them out."""
        if self.sliding_window is None:
            return context
        share = (sum(self.window_layers) if self.window_layers else self.num_layers) / self.num_layers
        over = context - self.sliding_window
        return context - share * over * (over > 0)

    def prefill_context(self, length: Any) -> Any:
        """Keys a prefill query's attention computes scores for over a prompt padded to ``length``,
        averaged over the queries and the layers: ``length`` in a full-attention layer; in a
        windowed one the runner attends a band of query chunks (:func:`prefill_band`), each over
        its own columns and the ``sliding_window - 1`` before. Numbers or numpy arrays."""
        if self.sliding_window is None:
            return length
        share = (sum(self.window_layers) if self.window_layers else self.num_layers) / self.num_layers
        w, c = self.sliding_window, prefill_band(self.sliding_window)
        first, full, r = self._bands(length)
        # (the simulator prices idle batches at length 0: no keys, no division by zero)
        keys = (first * first + full * c * (w - 1 + c) + r * (w - 1 + r)) / (length + (length < 1))
        return length - share * (length - keys)

    def prefill_scores(self, length: int) -> int:
        """Scores one call of a prefill's attention holds per head and row, over the layers' most:
        ``length^2`` unless every layer is windowed, then a band's chunk of queries over its keys."""
        if self.sliding_window is None or (self.window_layers and not all(self.window_layers)):
            return length * length
        w, c = self.sliding_window, prefill_band(self.sliding_window)
        first, full, r = self._bands(length)
        return max(first * first, c * (w - 1 + c) if full else 0, r * (w - 1 + r))

    def _bands(self, length: Any) -> tuple[Any, Any, Any]:
        """A windowed prefill's query chunks over ``length`` positions: the first chunk's queries
        (``min(length, band)``, over themselves alone), the whole chunks after it and the last
        partial chunk's queries. Numbers or numpy arrays."""
        c = prefill_band(self.sliding_window)
        first = length - (length - c) * (length > c)
        full = (length - first) // c
        return first, full, length - first - full * c

    def kv_cache_bytes(self, batch: int, tokens: int) -> int:
        """KV cache of ``batch`` sequences of ``tokens`` positions over all layers."""
        return self.kv_bytes_per_token_per_layer * self.num_layers * batch * tokens

    @property
    def act_bytes_per_token(self) -> int:
        """Hidden state passed between layers for one token (FlexGen's 2*h bytes in fp16)."""
        return self.hidden * self.dtype_bytes

    # ----------------------------------------------------------------- FLOPs
    def attention_flops_per_token(self, context: int) -> int:
        """Scores and weighted sum for one query token over ``context`` keys in one layer."""
        return 4 * self.q_dim * context

    def linear_flops_per_token(self) -> int:
        """All projections of one layer for one token (multiply-add = 2 FLOPs); with a mixture of
        experts, those of the experts it is routed to."""
        return 2 * self.active_matmul_params_per_layer

    def prefill_flops_per_layer(self, batch: int, prompt_len: int) -> int:
        """One layer over ``batch`` prompts padded to ``prompt_len``: dense s x s attention, a
        windowed layer's banded (:meth:`prefill_context`), averaged over the layers."""
        return int(batch * prompt_len * (self.linear_flops_per_token()
                                         + self.attention_flops_per_token(1) * self.prefill_context(prompt_len)))

    def decode_flops_per_layer(self, batch: int, context: int) -> int:
        """One layer, one new token for each of ``batch`` sequences attending to ``context`` keys."""
        return batch * (self.linear_flops_per_token() + self.attention_flops_per_token(context))

    def lm_head_flops_per_token(self) -> int:
        return 2 * self.vocab_size * self.hidden

    # ----------------------------------------------------------------- helpers
    def cost_key(self) -> str:
        """A digest of the fields that price this model's steps: a profile's fits for one spec
        serve another with the same key (a GGUF file and the registry entry of its shape),
        whatever their names. Values that change no step's work (names, epsilons, rope bases,
        the position limit, token ids, the dtype, fitted per dtype) are left out."""
        shape = {k: v for k, v in asdict(self).items() if k not in COST_FREE_FIELDS}
        return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def with_dtype(self, dtype: str) -> "ModelSpec":
        if dtype not in DTYPE_BYTES:
            raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
        return replace(self, dtype=dtype)  # type: ignore[arg-type]

    def summary(self) -> str:
        gib = self.weight_bytes / 2**30
        kv = self.kv_bytes_per_token_per_layer * self.num_layers / 2**20
        attn = "MHA" if self.num_kv_heads == self.num_heads else f"GQA {self.num_heads}/{self.num_kv_heads}"
        if self.num_experts:
            attn += f", {self.experts_per_token} of {self.num_experts} experts per token"
        return (f"{self.name}: {self.family}, {self.num_params / 1e9:.2f}B params, {self.num_layers} layers, "
                f"hidden {self.hidden}, {attn}, {self.dtype} weights {gib:.1f} GiB, "
                f"KV {kv:.2f} MiB/token")

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None, dtype: str | None = None) -> "ModelSpec":
        """Read a Hugging Face ``config.json`` (a file or the directory holding it)."""
        p = Path(path)
        cfg_path = p / "config.json" if p.is_dir() else p
        if not path_exists(cfg_path):
            raise UserError(f"{cfg_path}: missing config.json; a model directory needs config.json and *.safetensors")
        try:
            cfg = json.loads(read_text(cfg_path))
        except (ValueError, RecursionError) as exc:  # ValueError: also a 5000-digit integer
            raise UserError(f"{cfg_path}: not a valid JSON config ({json_error_text(exc)})") from None
        spec = spec_from_hf_dict(cfg, name=name or (p.name if p.is_dir() else p.parent.name), dtype=dtype)
        gen_path = cfg_path.parent / "generation_config.json"
        if not gen_path.is_file():
            return spec
        try:
            gen = json.loads(read_text(gen_path))
        except (ValueError, RecursionError) as exc:
            raise UserError(f"{gen_path}: not valid JSON ({json_error_text(exc)})") from None
        more = _eos_ids(gen.get("eos_token_id") if isinstance(gen, dict) else None, gen_path)
        return replace(spec, **_eos_fields(spec.eos_token_ids + more))

    @classmethod
    def from_gguf(cls, path: str | Path, name: str | None = None, dtype: str = "float32") -> "ModelSpec":
        """Read the architecture from a GGUF file's metadata (llama.cpp's ``llama`` architecture).

        ``dtype`` is the precision the weights are dequantized to (GGUF stores them quantized).
        """
        p = Path(path)
        reader = read_gguf(p)
        return spec_from_gguf_reader(reader, name=name or p.stem, dtype=dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _hf_dtype(cfg: dict) -> str:
    raw = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16").replace("torch.", "")
    return raw if raw in DTYPE_BYTES else "float16"


# config.json sizes that must be whole numbers (a string or 2.5 would fail deep inside the loaders)
_HF_COUNTS = ("num_hidden_layers", "hidden_size", "ffn_dim", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "word_embed_proj_dim")


def _eos_ids(value: Any, where: object) -> tuple[int, ...]:
    """A config's ``eos_token_id``: absent, one id or a list of ids."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise UserError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def _eos_fields(ids: tuple[int, ...]) -> dict[str, Any]:
    """ModelSpec's eos fields for ``ids`` in order: the first is the main one, repeats dropped."""
    unique = tuple(dict.fromkeys(ids))
    return dict(eos_token_id=unique[0] if unique else None, extra_eos_token_ids=unique[1:])


def spec_from_hf_dict(cfg: dict, name: str, dtype: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a parsed HF config dict of the OPT or Llama family."""
    if not isinstance(cfg, dict):
        raise UserError(f"{name}: config.json must be a JSON object, not {type(cfg).__name__}")
    bad = [k for k in _HF_COUNTS if k in cfg and cfg[k] is not None
           and (isinstance(cfg[k], bool) or not isinstance(cfg[k], int))]
    if bad:
        raise UserError(f"{name}: config.json's {', '.join(f'{k}={cfg[k]!r}' for k in bad)} must be whole numbers")
    if (heads := cfg.get("num_attention_heads")) is not None and heads < 1:  # hidden_size is divided by it
        raise UserError(f"{name}: config.json's num_attention_heads={heads} must be >= 1")
    for key in ("rope_scaling", "rope_parameters"):  # read with .get() below
        if cfg.get(key) and not isinstance(cfg[key], dict):
            raise UserError(f"{name}: config.json's {key}={cfg[key]!r} must be a JSON object")
    model_type = cfg.get("model_type")
    if model_type == "gemma3":  # Gemma 3 4B-27B: a vision tower beside the text decoder, which is what runs here
        return spec_from_hf_dict(_gemma3_text_config(cfg, name), name, dtype)
    eos_fields = _eos_fields(_eos_ids(cfg.get("eos_token_id"), f"{name}: config.json"))
    try:
        if model_type == "opt":
            if not cfg.get("do_layer_norm_before", True):
                raise UserError(f"{name}: OPT with post-layer-norm (opt-350m) is not supported")
            if cfg.get("word_embed_proj_dim", cfg["hidden_size"]) != cfg["hidden_size"]:
                raise UserError(f"{name}: OPT with a projected embedding (opt-350m) is not supported")
            if cfg.get("activation_function", "relu") != "relu":
                raise UserError(f"{name}: OPT activation {cfg.get('activation_function')!r} is not supported")
            heads = cfg["num_attention_heads"]
            return ModelSpec(
                name=name, family="opt", num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
                ffn=cfg["ffn_dim"], num_heads=heads, num_kv_heads=heads, head_dim=cfg["hidden_size"] // heads,
                vocab_size=cfg["vocab_size"], max_positions=cfg["max_position_embeddings"],
                norm="layernorm", activation="relu", position="learned",
                tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                dtype=dtype or _hf_dtype(cfg), norm_eps=1e-5, bias=bool(cfg.get("enable_bias", True)),
                **eos_fields,
            )
        if model_type in _LLAMA_TYPES:
            kind = _LLAMA_TYPES[model_type]
            gemma = _gemma_fields(cfg, model_type, name) if model_type in _GEMMA_TYPES else {}
            if not gemma and cfg.get("hidden_act", "silu") != "silu":
                raise UserError(f"{name}: {kind} activation {cfg.get('hidden_act')!r} is not supported")
            heads = cfg["num_attention_heads"]
            rope = cfg.get("rope_parameters") or {}
            if model_type == "gemma3_text" and "full_attention" in rope:  # transformers 5: per layer type
                rope = rope["full_attention"]
                cfg = {**cfg, "rope_parameters": rope}
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
            if partial != 1.0:  # Phi-4-mini's 0.75
                raise UserError(f"{name}: partial rotary embeddings (partial_rotary_factor={partial!r}) are not "
                                "supported")
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
            reach = _attention_reach(cfg, model_type, name)
            moe = _moe_fields(cfg, model_type, name)
            if "sliding_window" not in reach:  # a Gemma 3 with no windowed layer has no local rotary base
                gemma.pop("local_rope_theta", None)
            return ModelSpec(
                name=name, family="llama", num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
                ffn=cfg["moe_intermediate_size" if model_type in ("qwen3_moe", "qwen2_moe") else "intermediate_size"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=head_dim, vocab_size=cfg["vocab_size"], **reach,
                norm="rmsnorm", position="rotary",
                activation="gelu_tanh" if gemma else "swiglu_clamped" if model_type == "gpt_oss" else "silu",
                tied_embeddings=bool(cfg.get("tie_word_embeddings", bool(gemma))),
                dtype=dtype or _hf_dtype(cfg), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta, **_rope_scaling(cfg, name, head_dim, theta),
                bias=bool(cfg.get("attention_bias")),
                qkv_bias=model_type == "qwen2" or model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True)),
                qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"), **gemma, **moe, **eos_fields,
                mlp_bias=bool(cfg.get("mlp_bias")) or model_type == "gpt_oss", **_gpt_oss_fields(cfg, model_type),
            )
    except KeyError as exc:
        raise UserError(f"{name}: config.json lacks {exc.args[0]!r}") from None
    except (ValueError, TypeError) as exc:  # ModelSpec's own checks (sizes > 0, ...); float() of a list
        raise UserError(f"{name}: config.json describes no valid model ({exc})") from None
    raise UserError(f"{name}: model_type {model_type!r} is not supported; xsched runs "
                    f"{', '.join(repr(t) for t in ('opt', *_LLAMA_TYPES, 'gemma3'))} models")


# Checkpoints with Llama's layer (RMSNorm, rotary positions, gated MLP) under their HF model_type.
_LLAMA_TYPES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
                "gemma": "Gemma", "gemma2": "Gemma2", "gemma3_text": "Gemma3", "mixtral": "Mixtral",
                "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "gpt_oss": "GPT-OSS"}
_GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")


def _moe_fields(cfg: dict, model_type: str, name: str) -> dict[str, Any]:
    """A mixture of experts' ModelSpec fields: Mixtral's (always renormalized), Qwen2-MoE's and
    Qwen3-MoE's (``norm_topk_prob``; every layer sparse; Qwen2-MoE's shared expert)."""
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"):
        return {}
    kind = _LLAMA_TYPES[model_type]
    qwen = model_type in ("qwen2_moe", "qwen3_moe")
    if qwen and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
        raise UserError(f"{name}: a {kind} with dense layers among the sparse ones (mlp_only_layers, "
                        "decoder_sparse_step) is not supported")
    if qwen and cfg.get("use_sliding_window"):
        raise UserError(f"{name}: a {kind} with use_sliding_window is not supported")
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))  # transformers 5 writes the first for both
    if experts is None:
        raise UserError(f"{name}: config.json lacks 'num_local_experts' (or 'num_experts')")
    per_token = cfg["num_experts_per_tok"]
    if any(isinstance(x, bool) or not isinstance(x, int) for x in (experts, per_token)):
        raise UserError(f"{name}: config.json's expert counts {experts!r}, {per_token!r} must be whole numbers")
    shared = cfg.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return dict(num_experts=experts, experts_per_token=per_token,
                expert_weights_renormalized=not qwen or bool(cfg.get("norm_topk_prob", False)),
                shared_expert_ffn=shared)


def _gpt_oss_fields(cfg: dict, model_type: str) -> dict[str, Any]:
    """GPT-OSS's attention sinks and clamped SwiGLU (its experts and biases: _moe_fields, mlp_bias)."""
    if model_type != "gpt_oss":
        return {}
    return dict(attention_sinks=True, glu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                glu_limit=float(cfg.get("swiglu_limit", 7.0)))


def _gemma_fields(cfg: dict, model_type: str, name: str) -> dict[str, Any]:
    """The ModelSpec fields by which a Gemma config differs from Llama's (see ModelSpec)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu"):  # Gemma 1's configs say "gelu" and transformers runs tanh-GELU
        raise UserError(f"{name}: Gemma activation {act!r} is not supported (xsched runs tanh-GELU)")
    if cfg.get("use_bidirectional_attention"):
        raise UserError(f"{name}: bidirectional attention (an embedding model) is not supported")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    scalar = cfg.get("query_pre_attn_scalar") if model_type != "gemma" else None
    fields: dict[str, Any] = dict(norm_offset=1.0, embed_scale=math.sqrt(cfg["hidden_size"]),
                                  sandwich_norms=model_type != "gemma",
                                  attention_scale=None if scalar in (None, head_dim) else float(scalar) ** -0.5)
    if model_type == "gemma":
        return fields
    for key, field in (("attn_logit_softcapping", "attention_softcap"), ("final_logit_softcapping", "logit_softcap")):
        fields[field] = None if cfg.get(key) is None else float(cfg[key])
    if model_type == "gemma3_text":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
        fields["local_rope_theta"] = float(local or cfg.get("rope_local_base_freq") or 10000.0)
        if (cfg.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_type", "default") != "default":
            raise UserError(f"{name}: rope scaling on Gemma 3's sliding layers is not supported")
    return fields
# Those whose sliding_window, when set, applies to every layer (the engine masks it)
_WINDOWED_TYPES = ("mistral", "phi3", "mixtral")


def _rope_scaling(cfg: dict, name: str, head_dim: int, theta: float) -> dict[str, Any]:
    """``ModelSpec.rope_divisors`` and ``rope_attention_factor`` for a config's rope scaling
    (``rope_scaling``, or transformers 5's ``rope_parameters``), each frequency ``f`` becoming
    ``f / divisor``:

    - "linear": every divisor is ``factor``;
    - "llama3" (Llama 3.1, 3.2): ``factor`` for wavelengths above ``original / low_freq_factor``,
      1 below ``original / high_freq_factor``, blended between;
    - "yarn" (Qwen2.5/Qwen3 past 32K; the YaRN paper): ``factor`` for frequencies that turn fewer
      than ``beta_slow`` times over the original length, 1 for those that turn more than
      ``beta_fast`` times, a ramp between over whole frequency indices (``truncate``, transformers'
      default), and cos/sin scaled by ``attention_factor`` (``0.1 ln(factor) + 1`` by default).

    ``original`` is the config's ``original_max_position_embeddings`` (top level first, as
    transformers reads Phi-3's), else the scaling's, else ``max_position_embeddings``. Other kinds
    (dynamic NTK, LongRoPE) are refused: silently ignoring one would change every token."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return {}
    if kind not in ("linear", "llama3", "yarn"):
        raise UserError(f"{name}: rope scaling {kind!r} is not supported (xsched runs 'linear', 'llama3' and 'yarn')")
    attention_factor = 1.0
    try:
        original = float(cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                         or cfg["max_position_embeddings"])
        factor = scaling.get("factor")
        factor = float(cfg["max_position_embeddings"] / original if factor is None and kind == "yarn" else factor)
        inv_freq = [theta ** (-i / head_dim) for i in range(0, head_dim - 1, 2)]
        if kind == "linear":
            divisors = [factor] * len(inv_freq)
        elif kind == "llama3":
            low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
            divisors = []
            for f in inv_freq:
                wavelength = 2 * math.pi / f
                if wavelength < original / high:
                    divisors.append(1.0)
                elif wavelength > original / low:
                    divisors.append(factor)
                else:  # the frequency becomes (1 - s) f / factor + s f
                    s = (original / wavelength - low) / (high - low)
                    divisors.append(1.0 / ((1 - s) / factor + s))
        else:
            divisors, attention_factor = _yarn(scaling, factor, original, head_dim, theta)
    except KeyError as exc:
        raise UserError(f"{name}: rope scaling {kind!r} lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError):
        raise UserError(f"{name}: rope scaling {scaling!r} holds no valid numbers") from None
    if not all(0 < d < math.inf for d in divisors) or not 0 < attention_factor < math.inf:
        raise UserError(f"{name}: rope scaling {scaling!r} gives a non-positive frequency; factor must be > 0")
    return {"rope_divisors": tuple(divisors), "rope_attention_factor": attention_factor}


def _yarn(scaling: dict, factor: float, original: float, head_dim: int, theta: float) -> tuple[list[float], float]:
    """YaRN's divisors and attention factor (see :func:`_rope_scaling`)."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def index_turning(turns: float) -> float:  # the frequency index that turns `turns` times over `original`
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_turning(scaling.get("beta_fast") or 32), index_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    divisors = []
    for i in range(head_dim // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: kept, 1: divided by factor
        divisors.append(1.0 / ((1 - ramp) + ramp / factor))
    return divisors, float(attention)


def _attention_reach(cfg: dict, model_type: str, name: str) -> dict[str, Any]:
    """``max_positions``, ``sliding_window`` and ``window_layers`` of a Llama-family config.
    Mistral's and Phi-3's ``sliding_window`` applies to every layer; Gemma 2's, Gemma 3's and (with
    ``use_sliding_window``) Qwen2's and Qwen3's to some (:func:`_layer_windows`)."""
    longest = cfg["max_position_embeddings"]
    window = cfg.get("sliding_window")
    if model_type in _LAYER_WINDOWED_TYPES:
        return _layer_windows(cfg, model_type, name)
    if model_type not in _WINDOWED_TYPES or window is None:
        return {"max_positions": longest}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UserError(f"{name}: config.json's sliding_window={window!r} must be a whole number >= 1")
    return {"max_positions": longest, "sliding_window": window if window < longest else None}


# transformers' Gemma3TextConfig defaults, which a multimodal Gemma 3's text_config leaves out
# (gemma-3-4b-it's gives only hidden and MLP widths, layers, rope scaling and window)
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                         "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                         "sliding_window": 4096, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                         "sliding_window_pattern": 6, "tie_word_embeddings": True}


def _gemma3_text_config(cfg: dict, name: str) -> dict:
    """The text decoder's config of a multimodal Gemma 3 (``model_type`` gemma3): its
    ``text_config`` over transformers' defaults, with the top level's eos ids and dtype."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"{name}: a Gemma 3 config.json (model_type 'gemma3') needs a text_config object")
    merged = {**_GEMMA3_TEXT_DEFAULTS, **text, "model_type": "gemma3_text"}
    for key in ("eos_token_id", "torch_dtype", "dtype"):  # gemma-3-4b-it lists its eos ids at the top only
        if cfg.get(key) is not None:
            merged[key] = cfg[key]
    return merged


# Types whose window covers only some layers: their layer_types, else a fixed rule (_layer_windows)
_LAYER_WINDOWED_TYPES = ("gemma2", "gemma3_text", "qwen2", "qwen3", "gpt_oss")


def _layer_windows(cfg: dict, model_type: str, name: str) -> dict[str, Any]:
    """Which layers attend through the window: the config's ``layer_types``, else Gemma 2's every
    other layer from the first, Gemma 3's all but every ``sliding_window_pattern``-th (6), or
    Qwen2/Qwen3's layers from ``max_window_layers`` on when ``use_sliding_window`` (28 layers by
    default, as transformers' configs)."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or \
                not set(types) <= {"sliding_attention", "full_attention"}:
            raise UserError(f"{name}: config.json's layer_types must list 'sliding_attention' or 'full_attention' "
                            f"for each of the {layers} layers")
        flags = [t == "sliding_attention" for t in types]
    elif model_type in ("gemma2", "gpt_oss"):
        flags = [i % 2 == 0 for i in range(layers)]
    elif model_type == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise UserError(f"{name}: config.json's sliding_window_pattern={pattern!r} must be a whole number >= 1")
        flags = [(i + 1) % pattern != 0 for i in range(layers)]
    else:
        first = cfg.get("max_window_layers", 28)
        flags = [bool(cfg.get("use_sliding_window")) and i >= first for i in range(layers)]
    window = cfg.get("sliding_window")
    reach: dict[str, Any] = {"max_positions": cfg["max_position_embeddings"]}
    if not any(flags):
        return reach
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UserError(f"{name}: config.json's sliding_window={window!r} must be a whole number >= 1")
    return {**reach, "sliding_window": window, "window_layers": () if all(flags) else tuple(flags)}


def _opt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name=name, family="opt", num_layers=layers, hidden=hidden, ffn=4 * hidden,
                     num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, vocab_size=50272,
                     max_positions=2048, norm="layernorm", activation="relu", position="learned",
                     tied_embeddings=True, bias=True, eos_token_id=2)


def _llama(name: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int,
           max_pos: int, theta: float, tied: bool = False, eps: float = 1e-5, eos: int = 2,
           qkv_bias: bool = False, extra_eos: tuple[int, ...] = (), llama3_factor: float | None = None,
           head_dim: int | None = None, qk_norm: bool = False, window: int | None = None,
           experts: tuple[int, int, bool] = (0, 0, True)) -> ModelSpec:
    """A Llama-family registry entry; ``llama3_factor``: Llama 3.1's rope scaling with that factor
    (low/high frequency factors 1 and 4 over 8192 original positions, as all 3.1 and 3.2 models);
    ``experts``: a mixture of experts' count, experts per token and whether their weights are
    renormalized (``ffn`` is then each expert's width)."""
    scaling = None if llama3_factor is None else {
        "rope_type": "llama3", "factor": llama3_factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    head_dim = head_dim or hidden // heads
    return ModelSpec(name=name, family="llama", num_layers=layers, hidden=hidden, ffn=ffn, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, max_positions=max_pos,
                     norm="rmsnorm", activation="silu", position="rotary", tied_embeddings=tied,
                     norm_eps=eps, rope_theta=theta, eos_token_id=eos, qkv_bias=qkv_bias,
                     extra_eos_token_ids=extra_eos,
                     **_rope_scaling({"rope_scaling": scaling, "max_position_embeddings": max_pos}, name, head_dim,
                                     theta),
                     qk_norm=qk_norm,
                     sliding_window=window, num_experts=experts[0], experts_per_token=experts[1],
                     expert_weights_renormalized=experts[2])


def _gemma(name: str, model_type: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int,
           max_pos: int, window: int, eos: list[int], head_dim: int = 256, query_scalar: int = 256,
           **more: Any) -> ModelSpec:
    """A Gemma registry entry, read through :func:`spec_from_hf_dict` from the fields of its
    config.json that differ between sizes (head_dim and query_pre_attn_scalar 256 but in gemma-3-27b)."""
    cfg = dict(model_type=model_type, num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn,
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
               query_pre_attn_scalar=query_scalar,
               vocab_size=vocab, max_position_embeddings=max_pos, sliding_window=window, rms_norm_eps=1e-6,
               eos_token_id=eos, torch_dtype="bfloat16", hidden_activation="gelu_pytorch_tanh", **more)
    return replace(spec_from_hf_dict(cfg, name), dtype="float16")


def _gemma3(name: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, **dims: int) -> ModelSpec:
    """A Gemma 3 size from 4B up: 5 of 6 layers windowed to 1024 on rotary base 10^4, the full
    layers on 10^6 with positions divided by 8 (linear scaling), the multimodal models' vocabulary."""
    return _gemma(name, "gemma3_text", layers, hidden, ffn, heads, kv_heads, 262208, 131072, 1024, [1, 106],
                  rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6,
                  rope_scaling={"rope_type": "linear", "factor": 8.0}, **dims)


def _gpt_oss(name: str, layers: int, experts: int) -> ModelSpec:
    """A gpt-oss registry entry: the two sizes differ only in their layer and expert counts."""
    return replace(spec_from_hf_dict(dict(
        model_type="gpt_oss", num_hidden_layers=layers, hidden_size=2880, intermediate_size=2880,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
        max_position_embeddings=131072, sliding_window=128, num_local_experts=experts, num_experts_per_tok=4,
        rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False, eos_token_id=[200002, 200012],
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                          original_max_position_embeddings=4096), rope_theta=150000.0), name), dtype="float16")


def _registry() -> dict[str, ModelSpec]:
    specs = [
        _opt("opt-125m", 12, 768, 12),
        _opt("opt-1.3b", 24, 2048, 32),
        _opt("opt-6.7b", 32, 4096, 32),
        _opt("opt-13b", 40, 5120, 40),
        _opt("opt-30b", 48, 7168, 56),
        _opt("opt-66b", 64, 9216, 72),
        _opt("opt-175b", 96, 12288, 96),
        _llama("llama-2-7b", 32, 4096, 11008, 32, 32, 32000, 4096, 10000.0),
        _llama("llama-2-13b", 40, 5120, 13824, 40, 40, 32000, 4096, 10000.0),
        _llama("llama-2-70b", 80, 8192, 28672, 64, 8, 32000, 4096, 10000.0),
        _llama("llama-3-8b", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0, eos=128001),
        # Llama-3.1-8B-Instruct and Llama-3.2-1B/3B-Instruct, from their config.json (rope scaling, 3 eos ids)
        _llama("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128256, 131072, 500000.0, eos=128001,
               extra_eos=(128008, 128009), llama3_factor=8.0),
        _llama("llama-3.2-1b", 16, 2048, 8192, 32, 8, 128256, 131072, 500000.0, tied=True, eos=128001,
               extra_eos=(128008, 128009), llama3_factor=32.0),
        _llama("llama-3.2-3b", 28, 3072, 8192, 24, 8, 128256, 131072, 500000.0, tied=True, eos=128001,
               extra_eos=(128008, 128009), llama3_factor=32.0),
        _llama("smollm2-135m", 30, 576, 1536, 9, 3, 49152, 8192, 100000.0, tied=True, eos=2),
        # Mistral-7B-Instruct-v0.2 (no sliding window) and Qwen2.5-7B-Instruct, from their config.json
        _llama("mistral-7b", 32, 4096, 14336, 32, 8, 32000, 32768, 1000000.0),
        _llama("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, 32768, 1000000.0, eps=1e-6, eos=151645,
               qkv_bias=True),
        # Qwen3-0.6B and Qwen3-8B, from their config.json (q/k norms; heads of 128 on any width)
        _llama("qwen3-0.6b", 28, 1024, 3072, 16, 8, 151936, 40960, 1000000.0, tied=True, eps=1e-6, eos=151645,
               head_dim=128, qk_norm=True),
        _llama("qwen3-8b", 36, 4096, 12288, 32, 8, 151936, 40960, 1000000.0, eps=1e-6, eos=151645,
               head_dim=128, qk_norm=True),
        # Phi-3-mini-4k-instruct (every layer windowed to 2047) and Phi-4 (fused projections in their files)
        _llama("phi-3-mini", 32, 3072, 8192, 32, 32, 32064, 4096, 10000.0, eos=32000, extra_eos=(32001, 32007),
               window=2047),
        _llama("phi-4", 40, 5120, 17920, 40, 10, 100352, 16384, 250000.0, eos=100265),
        # Mixtral-8x7B-Instruct-v0.1 and Qwen3-30B-A3B, from their config.json (mixtures of experts)
        _llama("mixtral-8x7b", 32, 4096, 14336, 32, 8, 32000, 32768, 1000000.0, experts=(8, 2, True)),
        _llama("qwen3-30b-a3b", 48, 2048, 768, 32, 4, 151936, 40960, 1000000.0, eps=1e-6, eos=151645,
               head_dim=128, qk_norm=True, experts=(128, 8, True)),
        # gpt-oss-20b and gpt-oss-120b, from their config.json: 4 of 32 (128) biased experts per
        # token, attention sinks, every other layer windowed to 128 positions, YaRN to 131072
        _gpt_oss("gpt-oss-20b", 24, 32),
        _gpt_oss("gpt-oss-120b", 36, 128),
        # gemma-2-2b-it, gemma-2-9b-it (every other layer windowed to 4096, softcaps 50 and 30) and
        # gemma-3-1b-it (5 of 6 layers windowed to 512 on rotary base 10^4, the others on 10^6)
        _gemma("gemma-2-2b", "gemma2", 26, 2304, 9216, 8, 4, 256000, 8192, 4096, [1, 107], rope_theta=10000.0,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        _gemma("gemma-2-9b", "gemma2", 42, 3584, 14336, 16, 8, 256000, 8192, 4096, [1, 107], rope_theta=10000.0,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        _gemma("gemma-3-1b", "gemma3_text", 26, 1152, 6912, 4, 1, 262144, 32768, 512, [1, 106],
               rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6),
        # gemma-3-4b/12b/27b-it's text models (their config.json's text_config)
        _gemma3("gemma-3-4b", 34, 2560, 10240, 8, 4),
        _gemma3("gemma-3-12b", 48, 3840, 15360, 16, 8),
        _gemma3("gemma-3-27b", 62, 5376, 21504, 32, 16, head_dim=128, query_scalar=168),
    ]
    return {s.name: s for s in specs}


def model_names() -> list[str]:
    """The registry's model names, in its order (``get_model_spec`` takes each)."""
    return list(_registry())


RANDOM_PREFIX = "random:"  # `--model random:NAME`: seeded random weights of NAME's shape (xrunner.loaders)


def get_model_spec(name: str) -> ModelSpec:
    """The registry entry ``name``, or the spec read from a config.json / model directory path or a
    .gguf file (as `xsched profile --model` names its fits; it was read as a config.json: "not UTF-8").
    ``random:NAME`` is NAME's shape, which is what a plan or simulation of its random weights prices."""
    registry = _registry()
    if name.startswith(RANDOM_PREFIX):
        name = name[len(RANDOM_PREFIX):]
    if name in registry:
        return registry[name]
    p = Path(name)
    if p.suffix == ".gguf" and path_exists(p) and p.is_file():
        return ModelSpec.from_gguf(p)
    if path_exists(p):
        return ModelSpec.from_hf_config(p)
    if p.suffix in (".json", ".gguf") and p.name != "config.json" or name.startswith(("/", "./", "../", "~")):
        raise UserError(f"{name}: no such file or directory (a model is a registry name, a directory with its "
                        "config.json, or a .gguf file)")
    raise UserError(f"unknown model {name!r}; known models: {', '.join(registry)} (or a model directory or .gguf file)")


def read_gguf(path: Path) -> "gguf.GGUFReader":  # type: ignore[name-defined]  # noqa: F821
    """Open a GGUF file (memory-mapped) or raise a one-line UserError."""
    try:
        import gguf
    except ImportError:
        raise UserError("reading GGUF files needs the gguf package: pip install gguf") from None
    if not path.is_file():
        raise UserError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise UserError(f"{path}: not a readable GGUF file ({exc})") from None


# llama.cpp architectures with Llama's layer; qwen2 adds q/k/v biases (its GGUF tensors ``attn_q.bias``...).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "phi3", "gemma", "gemma2", "gemma3",
                      "gpt-oss")


def spec_from_gguf_reader(reader, name: str, dtype: str = "float32") -> ModelSpec:
    """Build a ModelSpec from an open ``gguf.GGUFReader`` (metadata keys ``<arch>.*``)."""

    def field(key: str, default=None):
        f = reader.get_field(key)
        if f is None:
            if default is None:
                raise UserError(f"{name}: GGUF metadata lacks {key!r}")
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UserError(f"{name}: GGUF architecture {arch!r} is not supported; xsched reads "
                        f"{', '.join(repr(a) for a in GGUF_ARCHITECTURES)} GGUF files")
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    if int(field(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise UserError(f"{name}: partial rotary embeddings are not supported")
    moe = _gguf_moe_fields(reader, arch, name)
    tensor_names = {t.name for t in reader.tensors}
    vocab = field(f"{arch}.vocab_size", 0) or len(field("tokenizer.ggml.tokens"))
    eos = reader.get_field("tokenizer.ggml.eos_token_id")
    window = reader.get_field(f"{arch}.attention.sliding_window")  # llama.cpp writes none for Mistral
    label = reader.get_field("general.name")
    label = str(label.contents()) if label is not None else ""
    if window is None and arch == "llama" and re.search(r"mistral.*v0\.1", label, re.IGNORECASE):
        warnings.warn(f"{name}: {label!r} looks like Mistral-7B-v0.1, whose 4096-key sliding window this GGUF "
                      "does not record; past 4096 positions it attends to every key, unlike the original",
                      UserWarning, stacklevel=2)
    theta = float(field(f"{arch}.rope.freq_base", 10000.0))
    rope = _gguf_rope_scaling(reader, arch, name, head_dim, theta)
    layers = int(field(f"{arch}.block_count"))
    gemma = _gguf_gemma_fields(reader, arch, name, hidden, heads, head_dim, layers) if arch.startswith("gemma") else {}
    if arch == "gpt-oss":  # llama.cpp's fixed rules for what the file leaves out: which layers, the GLU's clamp
        reach: dict[str, Any] = dict(sliding_window=int(window.contents()), window_layers=tuple(
            i % 2 == 0 for i in range(layers))) if window is not None else {}
        reach.update(activation="swiglu_clamped", glu_alpha=1.702, glu_limit=7.0, attention_sinks=True, bias=True,
                     mlp_bias=True, **_eos_fields(_gguf_stop_ids(reader, eos, ("<|return|>", "<|call|>"))))
    else:
        reach = gemma or {"sliding_window": int(window.contents()) if window is not None and arch in ("llama", "phi3")
                          else None}
        reach.update(activation="gelu_tanh" if gemma else "silu",
                     eos_token_id=int(eos.contents()) if eos is not None else None)
    return ModelSpec(
        name=name, family="llama", num_layers=layers, hidden=hidden,
        ffn=int(field(f"{arch}.expert_feed_forward_length" if moe and arch in ("qwen2moe", "qwen3moe", "gpt-oss")
                      else f"{arch}.feed_forward_length")), num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)), head_dim=head_dim,
        vocab_size=int(vocab), max_positions=int(field(f"{arch}.context_length")),
        norm="rmsnorm", position="rotary",
        tied_embeddings="output.weight" not in tensor_names, dtype=dtype,  # type: ignore[arg-type]
        norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=theta, qkv_bias=arch in ("qwen2", "qwen2moe"),
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"), **rope, **moe, **reach,
    )


def _gguf_stop_ids(reader, eos, texts: tuple[str, ...]) -> tuple[int, ...]:
    """The file's ``eos_token_id`` and the ids of the tokens spelled ``texts`` in its vocabulary
    (GPT-OSS ends a reply with ``<|return|>`` or a tool call with ``<|call|>``; its HF generation
    config stops at both, and llama.cpp finds them by their text)."""
    ids = [int(eos.contents())] if eos is not None else []
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab = tokens.contents()
        ids += [vocab.index(t) for t in texts if t in vocab]
    return tuple(dict.fromkeys(ids))


def _gguf_moe_fields(reader, arch: str, name: str) -> dict[str, Any]:
    """A mixture of experts' ModelSpec fields from a GGUF file (Mixtral as ``llama``, ``qwen2moe``,
    ``qwen3moe``, ``gpt-oss``): ``expert_count`` and ``expert_used_count``, the weights
    renormalized unless ``expert_weights_norm`` says not (llama.cpp renormalizes by default, but
    not a qwen2moe's: Qwen1.5-MoE and Qwen2-MoE have ``norm_topk_prob`` false), and a qwen2moe's
    one shared expert of ``expert_shared_feed_forward_length``; softmax gating only."""

    def value(key: str) -> Any:
        f = reader.get_field(f"{arch}.{key}")
        return None if f is None else f.contents()

    experts = int(value("expert_count") or 0)
    if not experts:
        return {}
    shared = int(value("expert_shared_count") or 0)
    if shared and (arch != "qwen2moe" or shared != 1):  # Qwen2-MoE's one, gated by sigmoid(shared_expert_gate . x)
        raise UserError(f"{name}: a GGUF mixture of experts with {shared} shared experts is not supported "
                        "(xsched reads a qwen2moe file's one)")
    if arch == "qwen2moe" and value("expert_shared_feed_forward_length") is None:
        raise UserError(f"{name}: GGUF metadata lacks 'qwen2moe.expert_shared_feed_forward_length'")
    if value("expert_gating_func") not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UserError(f"{name}: GGUF expert gating {value('expert_gating_func')!r} is not supported (softmax only)")
    norm = value("expert_weights_norm")
    return dict(num_experts=experts, experts_per_token=int(value("expert_used_count") or 0),
                expert_weights_renormalized=(arch != "qwen2moe") if norm is None else bool(norm),
                shared_expert_ffn=int(value("expert_shared_feed_forward_length") or 0) if arch == "qwen2moe" else 0)


def _gguf_gemma_fields(reader, arch: str, name: str, hidden: int, heads: int, head_dim: int,
                       layers: int) -> dict[str, Any]:
    """The Gemma fields of a ModelSpec (see ``_gemma_fields``) from a GGUF file, by llama.cpp's
    rules where the file is silent: Gemma 2 windows every other layer from the first, Gemma 3 all
    but every 6th (unless ``<arch>.attention.sliding_window_pattern`` says otherwise), Gemma 3's
    windowed layers rotate on base 10^4 (or ``<arch>.rope.freq_base_swa``), and queries scale by
    ``head_dim`` except in the 27B models (46 or 62 layers), which use ``hidden / heads``, as
    their ``query_pre_attn_scalar`` does. The file's norm weights already hold ``1 + weight``
    (llama.cpp's converter adds the 1), which the loader takes back off."""

    def value(key: str) -> Any:
        f = reader.get_field(f"{arch}.{key}")
        return None if f is None else f.contents()

    fields: dict[str, Any] = dict(norm_offset=1.0, embed_scale=math.sqrt(hidden), sandwich_norms=arch != "gemma")
    if arch == "gemma":
        return fields
    big = layers == (46 if arch == "gemma2" else 62)
    fields["attention_scale"] = (hidden / heads) ** -0.5 if big and hidden // heads != head_dim else None
    caps = [value("attn_logit_softcapping"), value("final_logit_softcapping")]
    fields.update(attention_softcap=None if not caps[0] else float(caps[0]),
                  logit_softcap=None if not caps[1] else float(caps[1]))
    window = value("attention.sliding_window")
    if window is None:
        return fields
    pattern = value("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer
        flags = [bool(x) for x in pattern]
    else:
        period = int(pattern) if pattern else 2 if arch == "gemma2" else 6
        flags = [i % period < period - 1 for i in range(layers)]
    if len(flags) != layers or not any(flags):
        raise UserError(f"{name}: GGUF sliding_window_pattern {pattern!r} does not fit {layers} layers")
    fields.update(sliding_window=int(window), window_layers=() if all(flags) else tuple(flags))
    if arch == "gemma3":
        fields["local_rope_theta"] = float(value("rope.freq_base_swa") or 10000.0)
    return fields


def _gguf_rope_scaling(reader, arch: str, name: str, head_dim: int, theta: float) -> dict[str, Any]:
    """``ModelSpec.rope_divisors`` and ``rope_attention_factor`` of a GGUF file. llama.cpp stores
    Llama 3.1's scaling as a ``rope_freqs.weight`` tensor of per-frequency divisors, a linear one as
    ``<arch>.rope.scaling.type`` "linear" with its ``factor`` (which divides every frequency), and
    YaRN (GPT-OSS; Qwen2.5/Qwen3 past 32K) as "yarn" with ``factor``, ``original_context_length``
    and, where not llama.cpp's 32 and 1, ``yarn_beta_fast`` / ``yarn_beta_slow`` (:func:`_yarn`).
    llama.cpp rounds YaRN's ramp ends to whole frequency indices; GPT-OSS was trained without that
    rounding (its config's ``truncate: false``, which transformers and vLLM follow), so a gpt-oss
    file ramps as the model does and any other as llama.cpp."""

    def value(key: str) -> Any:
        f = reader.get_field(f"{arch}.rope.scaling.{key}")
        return None if f is None else f.contents()

    kind = str(value("type") or "none")
    if kind not in ("none", "linear", "yarn"):
        raise UserError(f"{name}: GGUF rope scaling {kind!r} is not supported (xsched runs 'linear', 'yarn' and "
                        "Llama 3.1's rope_freqs)")
    factor = float(value("factor") or 1.0)
    if any(t.name.startswith("rope_factors_") for t in reader.tensors):  # Phi-3-128k's short/long factors
        raise UserError(f"{name}: GGUF rope scaling LongRoPE (rope_factors_long/short) is not supported")
    if kind == "yarn":
        unusual = {k: value(k) for k, usual in (("yarn_log_multiplier", (0,)), ("yarn_ext_factor", (-1, 1)),
                                                ("yarn_attn_factor", (1,)), ("attn_factor", (1,)))
                   if value(k) is not None and float(value(k)) not in usual}
        if unusual:  # DeepSeek's mscale variant, a partial ramp or a rescaled attention: not read
            raise UserError(f"{name}: GGUF YaRN with {', '.join(f'{k}={float(v):g}' for k, v in unusual.items())} "
                            "is not supported (xsched reads its factor, original length and betas)")
        original = value("original_context_length")
        if original is None or not factor > 1:
            raise UserError(f"{name}: GGUF YaRN needs rope.scaling.factor > 1 and original_context_length, "
                            f"got {factor} and {original}")
        scaling = dict(beta_fast=value("yarn_beta_fast"), beta_slow=value("yarn_beta_slow"),
                       truncate=arch != "gpt-oss")
        divisors, attention = _yarn(scaling, factor, float(original), head_dim, theta)
        return {"rope_divisors": tuple(divisors), "rope_attention_factor": attention}
    linear = factor if kind == "linear" else 1.0
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None and linear == 1.0:
        return {}
    values = [linear] * (head_dim // 2) if freqs is None else [float(x) * linear for x in freqs.data.reshape(-1)]
    if len(values) != head_dim // 2 or not all(0 < x < math.inf for x in values):
        raise UserError(f"{name}: GGUF rope scaling needs head_dim / 2 = {head_dim // 2} positive divisors "
                        f"(rope_freqs.weight, rope.scaling.factor), got {len(values)}: {values[:4]}")
    return {"rope_divisors": tuple(values)}
