"""Weight loaders: HF directories, GGUF files (tiny written here, and the real SmolLM2-135M)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_model_core import PROMPTS, hf_greedy, one_torch_thread  # noqa: F401  (autouse fixture)

from xprofiler.specs import ModelSpec, get_model_spec, spec_from_hf_dict
from xrunner.reference import generate
from xrunner.loaders import (GGUFSource, HFDirectorySource, RandomSource, default_model_path, load_weights,
                             open_model, unpermute_rope_rows)
from xsched.errors import UserError

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

STEPS = 8
CHAT_PROMPTS = ["What is the capital of France?", "Hi!",
                "Explain in two sentences why the sky looks blue during the day and red at sunset."]


def tiny_hf(family: str, tied: bool = True, seed: int = 0, **config):
    """A random HF model with HF's own initialisation (independent of our RandomSource)."""
    torch.manual_seed(seed)
    if family == "opt":
        config = transformers.OPTConfig(vocab_size=300, hidden_size=32, ffn_dim=80, num_hidden_layers=3,
                                        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                        tie_word_embeddings=tied, attn_implementation="eager")
        model = transformers.OPTForCausalLM(config)
    else:  # llama, qwen2 (q/k/v biases), qwen3 (q/k norms), mistral or phi3 (fused projections, a window),
        # gemma2 and gemma3_text (norms after each branch; windows on some layers; softcaps; a local rotary base)
        # mixtral and qwen3_moe (a mixture of 4 experts, 2 per token; Qwen3-MoE's weights not renormalized)
        prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3",
                  "gemma2": "Gemma2", "gemma3_text": "Gemma3Text", "mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe",
                  "qwen2_moe": "Qwen2Moe", "gpt_oss": "GptOss"}[family]
        if family == "phi3":  # its default token ids lie beyond this vocabulary
            config = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 9, **config}
        if family == "gemma2":
            config = {"sliding_window": 4, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0, **config}
        if family == "gemma3_text":
            config = {"sliding_window": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                      "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                                          "full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                      **config}
        if family == "mixtral":
            config = {"num_local_experts": 4, "num_experts_per_tok": 2, **config}
        if family in ("qwen3_moe", "qwen2_moe"):  # Qwen2-MoE's shared expert beside them
            config = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, **config}
        if family == "qwen2_moe":
            config = {"shared_expert_intermediate_size": 80, **config}
        if family == "gpt_oss":  # attention sinks, windows on every other layer, biased experts, YaRN
            config = {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 3,
                      "intermediate_size": 64, **config}
        model_cls = "Gemma3ForCausalLM" if family == "gemma3_text" else f"{prefix}ForCausalLM"
        config = getattr(transformers, f"{prefix}Config")(**{
            "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
            "tie_word_embeddings": tied, "attn_implementation": "eager", **config})
        model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; perturb them so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # a router: logits far apart, so no
                p.mul_(100)  # near-tie flips a choice
            if name.endswith("sinks"):  # logits of the same order as the scores, so that they take weight
                p.normal_(0.0, 1.0)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def assert_matches_hf(weights, hf, steps: int = STEPS):
    result = generate(weights, PROMPTS, steps, return_logits=True)
    ours = torch.stack(result.logits, dim=1)
    for row, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, steps)
        assert result.tokens[row] == ref_tokens
        assert (ours[row] - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4


# ----------------------------------------------------------------------------- HF directories
@pytest.mark.parametrize("family,tied", [("opt", True), ("llama", False), ("qwen2", True), ("qwen3", True),
                                         ("mistral", False), ("phi3", False), ("gemma2", True),
                                         ("gemma3_text", False), ("mixtral", False), ("qwen3_moe", True),
                                         ("qwen2_moe", False), ("gpt_oss", False)])
def test_sharded_hf_directory_loads_and_matches_transformers(tmp_path, family, tied):
    hf = tiny_hf(family, tied)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    source = open_model(tmp_path, dtype="float32")
    assert isinstance(source, HFDirectorySource) and source.spec.family == ("opt" if family == "opt" else "llama")
    assert source.spec.qkv_bias == (family in ("qwen2", "qwen2_moe"))
    assert ("k_proj.bias" in source.load_layer(2)) == (family in ("opt", "qwen2", "qwen2_moe", "gpt_oss"))
    assert_matches_hf(load_weights(source), hf)


def test_a_multimodal_gemma3_directory_runs_its_text_decoder_as_transformers_does(tmp_path):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration (model_type gemma3): a vision tower
    beside the text decoder, whose tensors sit under language_model. The text decoder is read
    from its text_config and gives the whole model's greedy tokens and logits on text prompts."""
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=3,
                                         max_position_embeddings=64,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299, boi_token_index=297, eoi_token_index=298,
                                       eos_token_id=[1, 106], attn_implementation="eager")
    hf = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    hf.eval().save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    source = open_model(tmp_path, dtype="float32")
    assert isinstance(source, HFDirectorySource) and source.spec.qk_norm and source.spec.eos_token_ids == (1, 106)
    assert source.spec.window_layers == (True, False, True) and source.spec.tied_embeddings
    assert_matches_hf(load_weights(source), hf)


def test_gpt_oss_experts_in_mxfp4_as_published_load_as_transformers_dequantizes_them(tmp_path):
    """GPT-OSS ships its experts in MXFP4 (``*_blocks`` of 4-bit e2m1 codes, ``*_scales`` of
    power-of-two exponents per 32 values). Random codes and exponents, dequantized by
    transformers' own converter into the HF model: ours reads the packed file to the same model."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = tiny_hf("gpt_oss", tied=False, seed=5)
    cfg = hf.config
    e, h, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    gen = torch.Generator().manual_seed(0)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for name, rows, cols in (("gate_up_proj", 2 * f, h), ("down_proj", h, f)):
                blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
                scales = torch.randint(122, 128, (e, rows, cols // 32), generator=gen, dtype=torch.uint8)
                getattr(layer.mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state = {k: v for k, v in state.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, tmp_path / "model.safetensors")
    source = open_model(tmp_path, dtype="float32")
    assert source._mxfp4
    assert_matches_hf(load_weights(source), hf)


def test_a_published_multimodal_gemma3_config_reads_its_text_decoder_over_the_defaults():
    """gemma-3-4b-it's config.json gives only a few text_config fields; the rest are
    transformers' defaults (head_dim 256, 8 heads over 4 kv heads, vocabulary 262,208)."""
    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
           "torch_dtype": "bfloat16", "mm_tokens_per_image": 256,
           "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896}}
    spec = spec_from_hf_dict(cfg, name="gemma-3-4b-it")
    assert (spec.num_layers, spec.hidden, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (34, 2560, 8, 4, 256)
    assert (spec.vocab_size, spec.sliding_window, spec.dtype) == (262208, 1024, "bfloat16")
    assert spec.eos_token_ids == (1, 106)
    assert spec.window_layers == tuple((i + 1) % 6 != 0 for i in range(34))
    assert spec.layer_spec(5).rope_divisors == (8.0,) * 128 and spec.layer_spec(0).rope_theta == 10000.0
    with pytest.raises(UserError, match="needs a text_config object"):
        spec_from_hf_dict({**cfg, "text_config": None}, name="g")


def test_single_file_hf_directory_in_bfloat16(tmp_path):
    hf = tiny_hf("llama", tied=True)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    source = HFDirectorySource(tmp_path)
    assert source.spec.dtype == "bfloat16"
    layer = source.load_layer(1)
    assert layer["q_proj.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(layer["up_proj.weight"], hf.model.layers[1].mlp.up_proj.weight, rtol=0, atol=0)
    assert HFDirectorySource(tmp_path, dtype="float32").load_head()["final_norm.weight"].dtype == torch.float32


def test_hf_directory_errors_name_the_problem(tmp_path):
    with pytest.raises(UserError, match="missing config.json"):
        HFDirectorySource(tmp_path)
    hf = tiny_hf("llama")
    hf.config.save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"missing weights, no \*\.safetensors"):
        HFDirectorySource(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(UserError, match="never unpickles"):
        HFDirectorySource(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape \(96, 64\) "
                                        r"but the config implies \(100, 64\)"):
        HFDirectorySource(tmp_path)
    cfg["intermediate_size"], cfg["num_hidden_layers"] = 96, 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"lacks tensor model\.layers\.3\."):
        HFDirectorySource(tmp_path)
    # a malformed shard index (review: AttributeError, TypeError, UnicodeDecodeError tracebacks)
    for index, what in (('{"weight_map": []}', "weight_map must map"), ('{"weight_map": {"a": 5}}', "weight_map must map"),
                        (b"\xff\xfe{", "not UTF-8")):
        path = tmp_path / "model.safetensors.index.json"
        path.write_bytes(index if isinstance(index, bytes) else index.encode())
        with pytest.raises(UserError, match=what):
            HFDirectorySource(tmp_path)


def test_missing_or_corrupt_shard_is_reported(tmp_path):
    tiny_hf("opt").save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    shards[0].write_bytes(b"\xff" * 64)  # a corrupt header
    with pytest.raises(UserError, match=f"{shards[0].name}: not a readable safetensors file"):
        HFDirectorySource(tmp_path)
    shards[1].unlink()
    with pytest.raises(UserError, match=f"missing shard {shards[1].name}"):
        HFDirectorySource(tmp_path)


# ----------------------------------------------------------------------------- GGUF
def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter layout for q/k rows (written from its description, for the test)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_with_shapes(path, arch: str, cfg) -> "gguf.GGUFWriter":
    """A GGUF writer for ``arch`` holding the HF config's layer count, widths and heads."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:  # Qwen3's 128 on any width
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    return writer


def write_tiny_gguf(path, hf, sliding_window: int | None = None, rope_freqs: torch.Tensor | None = None,
                    name: str | None = None, yarn: tuple[float, int] | None = None,
                    floats: dict[str, float] | None = None) -> None:
    """Write an HF Llama or Qwen2 as a llama.cpp GGUF: F32 norms and biases, Q8_0 projections,
    a Llama's q/k rows permuted (llama.cpp keeps a Qwen2's, which its rope kernel reads as they are).
    A Gemma's norms are written as 1 + weight, as llama.cpp's converter writes them, with its
    softcaps and window. ``yarn``: YaRN's factor and original length, as llama.cpp records them;
    ``floats``: further float32 metadata."""
    cfg = hf.config
    arch = {"gemma3_text": "gemma3", "mixtral": "llama", "qwen3_moe": "qwen3moe",
            "qwen2_moe": "qwen2moe"}.get(cfg.model_type, cfg.model_type)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    gemma = arch.startswith("gemma")
    writer = gguf_with_shapes(path, arch, cfg)
    if name is not None:
        writer.add_name(name)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: one per layer type
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn[0])
        writer.add_rope_scaling_orig_ctx_len(yarn[1])
    for key, value in (floats or {}).items():
        writer.add_float32(key, value)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(2)
    if arch == "phi3":  # else transformers' reader pads with Phi-3's 32000, beyond this vocabulary
        writer.add_pad_token_id(0)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if experts:  # llama.cpp's mixture of experts: its counts, and Qwen3-MoE's expert width and renormalization
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            writer.add_expert_weights_norm(cfg.norm_topk_prob)
        if arch == "qwen2moe":  # its expert widths; no expert_weights_norm, as llama.cpp's converter writes it
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if gemma:
        writer.add_sliding_window(cfg.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def add(name: str, t: torch.Tensor, quantize: bool) -> None:
        arr = t.detach().float().numpy() + (1.0 if gemma and name.endswith("norm.weight") else 0.0)
        if quantize:
            writer.add_tensor(name, gguf.quants.quantize(arr, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, arr)

    if rope_freqs is not None:  # llama.cpp's form of Llama 3.1's rope scaling: a divisor per frequency
        add("rope_freqs.weight", rope_freqs, False)
    add("token_embd.weight", hf.model.embed_tokens.weight, True)
    add("output_norm.weight", hf.model.norm.weight, False)
    if not cfg.tie_word_embeddings:
        add("output.weight", hf.lm_head.weight, True)
    for i, layer in enumerate(hf.model.layers):
        att, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, False)
        if gemma:  # its MLP's norm is ffn_norm; the norms after attention and the MLP have their own names
            add(f"blk.{i}.ffn_norm.weight", layer.pre_feedforward_layernorm.weight, False)
            add(f"blk.{i}.post_attention_norm.weight", layer.post_attention_layernorm.weight, False)
            add(f"blk.{i}.post_ffw_norm.weight", layer.post_feedforward_layernorm.weight, False)
        else:
            add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, False)
        add(f"blk.{i}.attn_output.weight", att.o_proj.weight, True)
        if not experts:
            add(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight, True)
        if arch == "phi3":  # llama.cpp keeps its fused tensors: q, k, v in attn_qkv, gate above up in ffn_up
            add(f"blk.{i}.attn_qkv.weight", att.qkv_proj.weight, True)
            add(f"blk.{i}.ffn_up.weight", mlp.gate_up_proj.weight, True)
            continue
        q, k = att.q_proj.weight.detach().numpy(), att.k_proj.weight.detach().numpy()
        if arch == "llama":
            q, k = llamacpp_permute(q, cfg.num_attention_heads), llamacpp_permute(k, cfg.num_key_value_heads)
        add(f"blk.{i}.attn_q.weight", torch.from_numpy(q), True)
        add(f"blk.{i}.attn_k.weight", torch.from_numpy(k), True)
        if arch in ("qwen2", "qwen2moe"):
            for name, module in (("attn_q", att.q_proj), ("attn_k", att.k_proj), ("attn_v", att.v_proj)):
                add(f"blk.{i}.{name}.bias", module.bias, False)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            add(f"blk.{i}.attn_q_norm.weight", att.q_norm.weight, False)
            add(f"blk.{i}.attn_k_norm.weight", att.k_norm.weight, False)
        add(f"blk.{i}.attn_v.weight", att.v_proj.weight, True)
        if experts:  # the router, and each kind of expert projection stacked [experts, out, in] (F32)
            add(f"blk.{i}.ffn_gate_inp.weight", mlp.gate.weight, True)
            f = mlp.experts.down_proj.shape[-1]
            add(f"blk.{i}.ffn_gate_exps.weight", mlp.experts.gate_up_proj[:, :f], False)
            add(f"blk.{i}.ffn_up_exps.weight", mlp.experts.gate_up_proj[:, f:], False)
            add(f"blk.{i}.ffn_down_exps.weight", mlp.experts.down_proj, False)
            if arch == "qwen2moe":  # the shared expert and its gate (a [1, hidden] weight, written as a vector)
                for name, module in (("ffn_gate_shexp", mlp.shared_expert.gate_proj),
                                     ("ffn_up_shexp", mlp.shared_expert.up_proj),
                                     ("ffn_down_shexp", mlp.shared_expert.down_proj)):
                    add(f"blk.{i}.{name}.weight", module.weight, True)
                add(f"blk.{i}.ffn_gate_inp_shexp.weight", mlp.shared_expert_gate.weight[0], True)
            continue
        for name, t in (("ffn_gate", mlp.gate_proj.weight), ("ffn_up", mlp.up_proj.weight)):
            add(f"blk.{i}.{name}.weight", t, True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q8_round_trip(hf) -> None:
    """Replace the HF model's quantized tensors by their Q8_0 round trip (what the GGUF holds)."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                arr = gguf.quants.dequantize(gguf.quants.quantize(p.float().numpy(), q8), q8)
                p.copy_(torch.from_numpy(arr.reshape(p.shape)))


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_unpermutes_and_matches_transformers(tmp_path, tied):
    hf = tiny_hf("llama", tied=tied, seed=3)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, hf)
    q8_round_trip(hf)
    source = open_model(path)
    assert isinstance(source, GGUFSource)
    assert ModelSpec.from_gguf(path, dtype="float16") == source.spec.with_dtype("float16")
    assert (source.spec.num_kv_heads, source.spec.tied_embeddings, source.spec.eos_token_id) == (2, tied, 2)
    assert source.spec.sliding_window is None
    assert_matches_hf(load_weights(source), hf)


def test_a_llama31_gguf_applies_its_rope_freqs_and_matches_transformers(tmp_path):
    """Llama 3.1's "llama3" rope scaling (here with bounds that keep, blend and divide frequencies
    of head_dim 16) as llama.cpp stores it: divisors taken from transformers' own scaled frequencies."""
    hf = tiny_hf("llama", tied=True, seed=4, rope_theta=500000.0,
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=64))
    d = hf.config.head_dim
    plain = 1.0 / 500000.0 ** (torch.arange(0, d, 2).float() / d)
    divisors = plain / hf.model.rotary_emb.inv_freq
    assert (divisors == 1).any() and (divisors == 8).any() and ((divisors > 1) & (divisors < 8)).any()
    path = tmp_path / "llama31.gguf"
    write_tiny_gguf(path, hf, rope_freqs=divisors)
    q8_round_trip(hf)
    source = open_model(path)
    assert source.spec.rope_divisors == pytest.approx(divisors.tolist(), rel=1e-6)
    assert_matches_hf(load_weights(source), hf)


def test_a_gguf_that_records_a_sliding_window_keeps_it(tmp_path):
    """...and one named like Mistral-7B-v0.1 without it (as llama.cpp converts it) gets a warning."""
    path = tmp_path / "windowed.gguf"
    write_tiny_gguf(path, tiny_hf("llama", tied=True, seed=3), sliding_window=16, name="Mistral-7B-v0.1")
    assert open_model(path).spec.sliding_window == 16
    plain = tmp_path / "v01.gguf"
    write_tiny_gguf(plain, tiny_hf("llama", tied=True, seed=3), name="mistralai_mistral-7b-v0.1")
    with pytest.warns(UserWarning, match="looks like Mistral-7B-v0.1, whose 4096-key sliding window"):
        assert open_model(plain).spec.sliding_window is None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_tiny_qwen_or_phi3_gguf_keeps_its_rows_reads_its_biases_or_norms_and_matches_transformers(tmp_path, arch):
    """A qwen2 / qwen3 / phi3 GGUF: q/k rows as stored, Qwen2's q/k/v biases and Qwen3's q/k norms
    read, Phi-3's fused tensors split; transformers' own GGUF reader, given the same file, builds the
    same model, so the file is laid out as llama.cpp lays out these models."""
    hf = tiny_hf(arch, tied=False, seed=3, **({"sliding_window": None} if arch == "phi3" else {}))
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, hf)
    q8_round_trip(hf)
    source = open_model(path)
    assert isinstance(source, GGUFSource) and not source.spec.bias
    assert (source.spec.qkv_bias, source.spec.qk_norm) == (arch == "qwen2", arch == "qwen3")
    from_config = spec_from_hf_dict(hf.config.to_dict(), name="c")
    assert (source.spec.num_params, source.spec.rope_theta) == (from_config.num_params, from_config.rope_theta)
    weights = load_weights(source)
    assert_matches_hf(weights, hf)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    theirs.generation_config.eos_token_id = None
    theirs.generation_config.pad_token_id = 0
    assert_matches_hf(weights, theirs.eval())


def gguf_of_tiny_hf(tmp_path, arch: str, tied: bool, config: dict):
    """A tiny HF model of ``arch``, written as a GGUF and rounded as the file holds it; the file's
    source and the spec its HF config gives."""
    hf = tiny_hf(arch, tied=tied, seed=3, **config)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, hf)
    q8_round_trip(hf)
    source = open_model(path)
    return hf, path, source, spec_from_hf_dict(hf.config.to_dict(), name=source.spec.name, dtype="float32")


@pytest.mark.parametrize("arch,config", [
    ("gemma2", dict(head_dim=16, query_pre_attn_scalar=16)),  # caps of 3 and 5 that bend these values
    ("gemma2", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    ("gemma3_text", dict(num_hidden_layers=6, layer_types=None, rope_parameters=None))],  # 5 of 6 windowed
    ids=["gemma2-caps", "gemma2-as-published", "gemma3"])
def test_a_gemma_gguf_takes_its_norms_windows_and_caps_as_llamacpp_writes_them(tmp_path, arch, config):
    """A gemma2 / gemma3 GGUF: norms stored as 1 + weight, Gemma 2's softcaps and window from its
    metadata, each layer's window and (Gemma 3) rotary base by llama.cpp's fixed patterns. Equal to
    the HF model written; where the file holds only what transformers' GGUF reader reads (head_dim
    256 as the published models, the default caps and rotary bases), also to the model that reader builds."""
    hf, path, source, want = gguf_of_tiny_hf(tmp_path, arch, True, config)
    assert source.spec.norm_eps == pytest.approx(want.norm_eps)  # a float32 in the file
    assert source.spec == replace(want, max_positions=source.spec.max_positions, eos_token_id=2,
                                  norm_eps=source.spec.norm_eps)
    weights = load_weights(source)
    assert_matches_hf(weights, hf)
    if config.get("head_dim") == 256 or arch == "gemma3_text":
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
        theirs.generation_config.eos_token_id = None
        theirs.generation_config.pad_token_id = 0
        assert_matches_hf(weights, theirs.eval())


@pytest.mark.parametrize("arch,config", [("mixtral", {}), ("qwen3_moe", dict(norm_topk_prob=False)),
                                         ("qwen3_moe", dict(norm_topk_prob=True)),
                                         ("qwen2_moe", dict(moe_intermediate_size=1408,
                                                            shared_expert_intermediate_size=5632))],
                         ids=["mixtral", "qwen3moe", "qwen3moe-renormalized", "qwen2moe"])
def test_a_mixture_of_experts_gguf_splits_its_stacked_experts_and_matches_transformers(tmp_path, arch, config):
    """llama.cpp's mixtures of experts (Mixtral as a ``llama`` file with expert counts, ``qwen3moe``,
    ``qwen2moe`` with its shared expert) stack each kind of expert projection in one 3-D tensor; the
    loader hands each expert its slice, and the router's renormalization follows
    ``expert_weights_norm`` (a qwen2moe file's default: off). transformers' own GGUF reader builds
    the same qwen2moe model from the file (it reads no expert widths, so the qwen2moe model has
    Qwen2-MoE's default ones, 1408 and 5632)."""
    hf, path, source, want = gguf_of_tiny_hf(tmp_path, arch, False, config)
    assert (source.spec.num_experts, source.spec.experts_per_token, source.spec.ffn) == (4, 2, want.ffn)
    assert source.spec.expert_weights_renormalized == want.expert_weights_renormalized
    assert (source.spec.shared_expert_ffn, source.spec.qkv_bias) == (want.shared_expert_ffn, want.qkv_bias)
    assert source.spec.num_params == want.num_params
    layer = source.load_layer(1)
    assert layer["experts.3.up_proj.weight"].shape == (want.ffn, want.hidden)
    weights = load_weights(source)
    assert_matches_hf(weights, hf)
    if arch == "qwen2_moe":
        assert want.shared_expert_ffn and layer["shared_expert_gate.weight"].shape == (1, want.hidden)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
        theirs.generation_config.eos_token_id = None
        theirs.generation_config.pad_token_id = 0
        assert_matches_hf(weights, theirs.eval())


def write_tiny_gpt_oss_gguf(path, hf, vocab: list[str]) -> None:
    """Write an HF GPT-OSS as llama.cpp's converter lays it out (from its description, for the
    test): q/k rows as stored, every attention projection with its bias, the sinks as
    ``attn_sinks``, the MLP's norm as ``post_attention_norm``, the router as ``ffn_gate_inp``, and
    each kind of expert projection stacked ``[experts, out, in]`` in MXFP4 (HF interleaves gate and
    up along one tensor's last dimension), their biases in float32; YaRN's factor and original
    length in the metadata, the window's length but not which layers it covers. The HF model's
    expert weights become the MXFP4 round trip the file holds."""
    cfg, mx = hf.config, gguf.GGMLQuantizationType.MXFP4
    writer = gguf_with_shapes(path, "gpt-oss", cfg)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_token_list(vocab)
    writer.add_eos_token_id(vocab.index("<|return|>"))

    def add(name: str, t: torch.Tensor) -> None:
        writer.add_tensor(name, t.detach().float().contiguous().numpy())

    def add_mxfp4(name: str, t: torch.Tensor) -> torch.Tensor:
        codes = gguf.quants.quantize(t.detach().float().contiguous().numpy(), mx)
        writer.add_tensor(name, codes, raw_dtype=mx)
        return torch.from_numpy(gguf.quants.dequantize(codes, mx).reshape(t.shape))

    add("token_embd.weight", hf.model.embed_tokens.weight)
    add("output_norm.weight", hf.model.norm.weight)
    add("output.weight", hf.lm_head.weight)
    for i, layer in enumerate(hf.model.layers):
        att, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.post_attention_norm.weight", layer.post_attention_layernorm.weight)
        for name, module in (("attn_q", att.q_proj), ("attn_k", att.k_proj), ("attn_v", att.v_proj),
                             ("attn_output", att.o_proj)):
            add(f"blk.{i}.{name}.weight", module.weight)
            add(f"blk.{i}.{name}.bias", module.bias)
        add(f"blk.{i}.attn_sinks.weight", att.sinks)
        add(f"blk.{i}.ffn_gate_inp.weight", mlp.router.weight)
        add(f"blk.{i}.ffn_gate_inp.bias", mlp.router.bias)
        ex = mlp.experts
        with torch.no_grad():
            ex.gate_up_proj[:, :, 0::2] = add_mxfp4(f"blk.{i}.ffn_gate_exps.weight",
                                                    ex.gate_up_proj[:, :, 0::2].transpose(1, 2)).transpose(1, 2)
            ex.gate_up_proj[:, :, 1::2] = add_mxfp4(f"blk.{i}.ffn_up_exps.weight",
                                                    ex.gate_up_proj[:, :, 1::2].transpose(1, 2)).transpose(1, 2)
            ex.down_proj.copy_(add_mxfp4(f"blk.{i}.ffn_down_exps.weight", ex.down_proj.transpose(1, 2)).transpose(1, 2))
        add(f"blk.{i}.ffn_gate_exps.bias", ex.gate_up_proj_bias[:, 0::2])
        add(f"blk.{i}.ffn_up_exps.bias", ex.gate_up_proj_bias[:, 1::2])
        add(f"blk.{i}.ffn_down_exps.bias", ex.down_proj_bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gpt_oss_gguf_reads_its_mxfp4_experts_sinks_windows_and_yarn_and_matches_transformers(tmp_path):
    """llama.cpp's gpt-oss file: experts in MXFP4 slices of stacks, biases everywhere, sinks, the
    window on every other layer (which the file does not say), YaRN unrounded as GPT-OSS was
    trained (the HF config's ``truncate: false``; llama.cpp rounds), and the stop tokens found by
    their text. The spec equals the one the HF config gives, and the tokens and logits equal
    transformers' on the weights the file holds (transformers cannot read this file itself)."""
    hf = tiny_hf("gpt_oss", tied=False, seed=5, max_position_embeddings=256)
    vocab = [f"t{i}" for i in range(hf.config.vocab_size)]
    vocab[7], vocab[9] = "<|return|>", "<|call|>"
    path = tmp_path / "tiny-gpt-oss.gguf"
    write_tiny_gpt_oss_gguf(path, hf, vocab)
    source = open_model(path)
    assert isinstance(source, GGUFSource)
    want = spec_from_hf_dict(hf.config.to_dict(), name=source.spec.name, dtype="float32")
    assert source.spec == replace(want, eos_token_id=7, extra_eos_token_ids=(9,), norm_eps=source.spec.norm_eps,
                                  rope_divisors=source.spec.rope_divisors)
    assert source.spec.rope_divisors == pytest.approx(want.rope_divisors, rel=1e-12)
    rounded = spec_from_hf_dict({**hf.config.to_dict(), "rope_parameters": {**hf.config.rope_parameters,
                                                                            "truncate": True}}, name="r")
    assert rounded.rope_divisors != pytest.approx(want.rope_divisors, rel=1e-6)  # the rounding shows here
    layer = source.load_layer(2)
    assert layer["experts.3.gate_proj.bias"].shape == (want.ffn,) and layer["sinks.weight"].shape == (4,)
    assert_matches_hf(load_weights(source), hf, steps=24)  # prompts and steps pass the window of 3


def test_a_qwen_gguf_with_yarn_ramps_as_llamacpp_and_its_hf_config_do(tmp_path):
    """Qwen2.5/Qwen3's YaRN recipe (factor 4 over 32K) in a GGUF: the same frequencies and attention
    factor as the HF config's (ramp ends rounded, transformers' default and llama.cpp's way)."""
    hf = tiny_hf("qwen3", tied=True, seed=3, max_position_embeddings=128)
    path = tmp_path / "yarn.gguf"
    write_tiny_gguf(path, hf, yarn=(4.0, 32))
    spec = open_model(path).spec
    cfg = {**hf.config.to_dict(), "rope_parameters": {**hf.config.rope_parameters, "rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 32}}
    want = spec_from_hf_dict(cfg, name="q")
    assert spec.rope_divisors == pytest.approx(want.rope_divisors, rel=1e-12)
    assert spec.rope_attention_factor == pytest.approx(want.rope_attention_factor, rel=1e-12) != 1.0
    assert 1.0 in spec.rope_divisors and 4.0 in spec.rope_divisors
    plain = tmp_path / "plain.gguf"
    write_tiny_gguf(plain, hf)
    assert open_model(plain).spec.rope_divisors == ()
    for key, value in (("qwen3.rope.scaling.yarn_log_multiplier", 0.1), ("qwen3.rope.scaling.attn_factor", 0.5)):
        odd = tmp_path / "odd.gguf"
        write_tiny_gguf(odd, hf, yarn=(4.0, 32), floats={key: value})
        with pytest.raises(UserError, match=f"GGUF YaRN with {key.rsplit('.', 1)[1]}={value} is not supported"):
            open_model(odd)


def test_plan_and_simulate_take_the_gguf_file_that_profile_and_calibrate_take(tmp_path, capsys):
    """`xsched profile --model X.gguf` names its fits after the file, but `plan --model X.gguf` read
    the file as a config.json ("not UTF-8 text"), so those fits could not be planned with (review)."""
    from xsched.cli import main

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_hf("llama", tied=True, seed=3))
    assert get_model_spec(str(path)) == ModelSpec.from_gguf(path)
    assert main(["plan", "--profile", "t4", "--model", str(path), "--workload", "fixed:8:4", "--requests", "20",
                 "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "tiny"
    assert main(["simulate", "--profile", "t4", "--model", str(path), "--workload", "fixed:8:4", "--requests", "20",
                 "--policy", '{"gbs": 4, "nb": 1}']) == 0
    # So do `random:` names, as `profile` and `run` take them: random weights have the named shape.
    capsys.readouterr()
    for name in ("opt-125m", "random:opt-125m", f"random:{path}"):
        assert main(["plan", "--profile", "t4", "--model", name, "--workload", "fixed:8:4", "--requests", "20",
                     "--quiet", "--json"]) == 0
        planned = json.loads(capsys.readouterr().out)
        assert planned["model"]["name"] == ("tiny" if str(path) in name else "opt-125m")
        assert main(["simulate", "--profile", "t4", "--model", name, "--workload", "fixed:8:4", "--requests", "20",
                     "--policy", '{"gbs": 4, "nb": 1}', "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["throughput_tokens_per_s"] > 0


def test_unpermute_inverts_the_llamacpp_layout():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    back = unpermute_rope_rows(torch.from_numpy(llamacpp_permute(w, 6)), 6)
    assert torch.equal(back, torch.from_numpy(w))


def test_gguf_errors(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(UserError, match="not a readable GGUF"):
        open_model(junk)
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match="architecture 'gpt2' is not supported"):
        GGUFSource(tmp_path / "gpt2.gguf")


# ----------------------------------------------------------------------------- opening by name
def test_open_model_by_name(tmp_path):
    with pytest.raises(UserError, match="registry entry without weights.*random:opt-30b"):
        open_model("opt-30b")
    with pytest.raises(UserError, match="unknown model 'gpt-9'; known models: opt-125m"):
        open_model("gpt-9")
    with pytest.raises(UserError, match="no such file or directory"):
        open_model(str(tmp_path / "nope.gguf"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="not a model"):
        open_model(tmp_path / "notes.txt")
    src = open_model("random:opt-125m", dtype="float32", seed=4)
    assert isinstance(src, RandomSource) and src.spec.num_layers == 12 and src.seed == 4
    with pytest.raises(UserError, match="no tokenizer"):
        src.tokenizer()
    # a config.json without weights: refused with the hint, and its shape runs as random:PATH
    (tmp_path / "shape").mkdir()
    (tmp_path / "shape" / "config.json").write_text(json.dumps(dict(
        model_type="mixtral", num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2)))
    with pytest.raises(UserError, match=f"no \\*.safetensors file; random:{tmp_path / 'shape'} runs seeded"):
        open_model(tmp_path / "shape")
    for where in (tmp_path / "shape", tmp_path / "shape" / "config.json"):
        src = open_model(f"random:{where}", dtype="float32")
        assert isinstance(src, RandomSource) and (src.spec.num_experts, src.spec.hidden) == (4, 64)
        assert set(src.load_layer(1)) >= {"router.weight", "experts.3.down_proj.weight"}


# ----------------------------------------------------------------------------- SmolLM2-135M, real weights
@pytest.fixture(scope="module")
def smollm2():
    """Our GGUF loader and transformers' GGUF loader on the same file, loaded once."""
    try:
        path = default_model_path()
    except UserError as exc:
        pytest.skip(str(exc))
    source = GGUFSource(path)
    tokenizer = source.tokenizer()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = tokenizer.pad_token_id
    return source, load_weights(source), tokenizer, hf


def test_smollm2_spec_from_gguf_matches_the_registry(smollm2):
    source = smollm2[0]
    registry = get_model_spec("smollm2-135m")
    assert source.spec.num_params == registry.num_params
    fields = ("num_layers", "hidden", "ffn", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "rope_theta",
              "tied_embeddings", "eos_token_id")
    assert all(getattr(source.spec, f) == getattr(registry, f) for f in fields)


def test_smollm2_greedy_tokens_match_transformers(smollm2):
    from xrunner.cli import encode_prompt

    _, weights, tokenizer, hf = smollm2
    prompts = [encode_prompt(tokenizer, p, chat=True) for p in CHAT_PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # uneven lengths: the batch is left padded
    ours = generate(weights, prompts, 32).tokens
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        assert got == ref[0, len(prompt):].tolist()
    assert "Paris" in tokenizer.decode(ours[0])


@pytest.mark.slow  # converts SmolLM2's vocabulary again (12 s); the smollm2 fixture still builds its tokenizer
def test_a_gguf_tokenizer_is_converted_once_and_then_read_from_the_cache(smollm2, tmp_path, monkeypatch):
    """The GGUF's tokenizer is converted by transformers once and kept in the cache directory; the
    next source loads the converted copy (no GGUF parse), which encodes and chat-templates exactly
    as the converted one. A cache that cannot be written (a file where the directory should be)
    costs time, not the tokenizer."""
    source, _, fresh, _ = smollm2
    monkeypatch.setenv("XSCHED_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append("gguf" if "gguf_file" in k else "cache") or real(*a, **k))
    first = source.tokenizer()
    second = GGUFSource(source.path).tokenizer()
    assert calls == ["gguf", "cache"]
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1  # no temporary directory left
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    for tok in (first, second):
        assert tok.apply_chat_template(chat, add_generation_prompt=True) == \
            fresh.apply_chat_template(chat, add_generation_prompt=True)
        assert tok("The capital of France is Paris.")["input_ids"] == \
            fresh("The capital of France is Paris.")["input_ids"]
        assert (tok.eos_token_id, tok.pad_token_id) == (fresh.eos_token_id, fresh.pad_token_id)
    (tmp_path / "blocked").write_text("not a directory")
    monkeypatch.setenv("XSCHED_CACHE_DIR", str(tmp_path / "blocked"))
    calls.clear()
    assert source.tokenizer()("hello")["input_ids"] == fresh("hello")["input_ids"]
    assert calls == ["gguf"]


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_every_eos_id_of_config_and_generation_config_stops_a_sequence(tmp_path, family):
    """config.json may list several EOS ids, and generation_config.json may add more
    (Llama-3.1-Instruct's three): HF's generate stops at each, so xsched must too. Only the first
    was kept for Llama, and an OPT list crashed the stop set (unhashable list) or made a plan file
    that `xsched run` refused."""
    from types import SimpleNamespace

    import transformers

    from xrunner.cli import stop_token_ids

    base = dict(llama=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=64),
                opt=dict(model_type="opt", hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=300, max_position_embeddings=64, do_layer_norm_before=True))[family]
    (tmp_path / "config.json").write_text(json.dumps({**base, "eos_token_id": [5, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "bos_token_id": 1}))
    spec = ModelSpec.from_hf_config(tmp_path)
    assert spec.eos_token_ids == (5, 7, 9)
    hf = transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id
    hf_stops = set(hf) | {5, 7}  # generate() stops at the model config's and the generation config's ids
    assert set(stop_token_ids(SimpleNamespace(spec=spec), None)) == hf_stops == {5, 7, 9}
    assert ModelSpec.from_json(spec.to_json()) == spec  # a plan keeps them
    (tmp_path / "config.json").write_text(json.dumps({**base, "eos_token_id": ["</s>"]}))
    with pytest.raises(UserError, match="eos_token_id must be a token id or a list of them"):
        ModelSpec.from_hf_config(tmp_path)


def test_the_tokenizers_eos_id_stops_a_sequence_too():
    """A tokenizer's own eos id joins the model's (the only end-to-end test had the two equal)."""
    from types import SimpleNamespace

    from xrunner.cli import stop_token_ids

    source = SimpleNamespace(spec=SimpleNamespace(eos_token_ids=(2,)))
    assert stop_token_ids(source, SimpleNamespace(eos_token_id=7)) == [2, 7]
