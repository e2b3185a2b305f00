"""Contracts, model specs and the package layout (foundation issue)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from xprofiler.specs import ModelSpec, get_model_spec, model_names, spec_from_hf_dict
from xsched.errors import UserError
from xsimulator.policy import Policy

GB = 10**9


def test_opt175b_sizes_match_flexgen_section3():
    spec = get_model_spec("opt-175b")
    # FlexGen §3: 325 GB of fp16 weights (their "GB" is GiB: l(8h^2+4h*h2) = 324 GiB).
    assert spec.weight_bytes / 2**30 == pytest.approx(325, rel=0.02)
    # KV cache for b=512, s=512, n=32: 1.2 TB (TiB), 3.8x the weights.
    kv = spec.kv_cache_bytes(batch=512, tokens=512 + 32)
    assert kv / 2**40 == pytest.approx(1.2, rel=0.03)
    assert kv / spec.weight_bytes == pytest.approx(3.8, rel=0.05)


def test_flexgen_approximation_and_exact_count_agree():
    spec = get_model_spec("opt-30b")
    h1, h2 = spec.hidden, spec.ffn
    flexgen = 8 * h1**2 + 4 * h1 * h2  # bytes per layer in fp16, no biases
    assert spec.weight_bytes_per_layer == pytest.approx(flexgen, rel=0.001)
    assert spec.kv_bytes_per_token_per_layer == 4 * h1
    assert spec.act_bytes_per_token == 2 * h1


@pytest.mark.parametrize("name,params_b", [
    ("opt-125m", 0.125), ("opt-1.3b", 1.3), ("opt-6.7b", 6.7), ("opt-13b", 13), ("opt-30b", 30),
    ("opt-66b", 66), ("opt-175b", 175), ("llama-2-7b", 6.74), ("llama-2-13b", 13.0),
    ("llama-2-70b", 69.0), ("llama-3-8b", 8.03), ("smollm2-135m", 0.135),
])
def test_registry_parameter_counts(name, params_b):
    assert get_model_spec(name).num_params / 1e9 == pytest.approx(params_b, rel=0.04)


def test_gqa_shrinks_kv_cache():
    llama70 = get_model_spec("llama-2-70b")
    assert llama70.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2
    smol = get_model_spec("smollm2-135m")
    assert smol.kv_dim == 3 * 64


def test_flops_formulas():
    spec = get_model_spec("opt-6.7b")
    lin = 2 * spec.matmul_params_per_layer
    assert spec.decode_flops_per_layer(8, 100) == 8 * (lin + 4 * spec.hidden * 100)
    assert spec.prefill_flops_per_layer(2, 64) == 2 * 64 * (lin + 4 * spec.hidden * 64)
    assert spec.decode_flops_per_layer(4, 200) > spec.decode_flops_per_layer(4, 100)


@pytest.mark.parametrize("name", model_names())
def test_model_spec_json_round_trip(name):
    spec = get_model_spec(name)
    again = ModelSpec.from_json(spec.to_json())
    assert again == spec
    assert json.loads(spec.to_json())["schema"] == ModelSpec.SCHEMA


def test_a_missing_model_file_is_named_as_such_and_a_typo_gets_the_registry(tmp_path):
    """`--model /tmp/x/nothere.gguf` was an "unknown model" beside the whole registry list."""
    from xsched.errors import UserError

    for missing in (str(tmp_path / "nothere.gguf"), str(tmp_path / "nodir"), "x/nothere.gguf"):
        with pytest.raises(UserError, match="no such file or directory"):
            get_model_spec(missing)
    with pytest.raises(UserError, match="unknown model 'opt-1.3bb'; known models: opt-125m"):
        get_model_spec("opt-1.3bb")


def test_from_hf_config_llama_and_opt(tmp_path):
    llama = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
             "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
             "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    spec = ModelSpec.from_hf_config(tmp_path, name="smol")
    ref = get_model_spec("smollm2-135m")
    assert spec.num_params == ref.num_params
    assert (spec.num_kv_heads, spec.rope_theta, spec.dtype) == (3, 100000.0, "bfloat16")
    opt = {"model_type": "opt", "hidden_size": 768, "ffn_dim": 3072, "num_attention_heads": 12,
           "num_hidden_layers": 12, "vocab_size": 50272, "max_position_embeddings": 2048,
           "do_layer_norm_before": True, "word_embed_proj_dim": 768, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(opt))
    assert ModelSpec.from_hf_config(tmp_path).num_params == get_model_spec("opt-125m").num_params


def test_mistral_and_qwen_configs_read_as_llama_layers():
    """Their config.json files (as published, trimmed) give Llama-family specs with the published
    parameter counts (Mistral-7B 7,241,732,096; Qwen2.5-7B 7,615,616,512, q/k/v biases included;
    Qwen3-8B 8,190,735,360, q/k norms included). Mistral's sliding window is kept for the engine to
    mask; Qwen2's, which covers only some layers, becomes the longest sequence the engine runs (it
    attends to every key there)."""
    mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
               "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000, "hidden_act": "silu",
               "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
               "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    qwen = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
            "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064, "hidden_act": "silu",
            "max_position_embeddings": 32768, "max_window_layers": 28, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    qwen3 = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36, "vocab_size": 151936,
             "hidden_act": "silu", "max_position_embeddings": 40960, "max_window_layers": 36, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False, "attention_bias": False,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 151645}
    for cfg, params, registry in [(mistral, 7_241_732_096, "mistral-7b"), (qwen, 7_615_616_512, "qwen2.5-7b"),
                                  (qwen3, 8_190_735_360, "qwen3-8b")]:
        spec = spec_from_hf_dict(cfg, name="m")
        assert (spec.family, spec.num_params) == ("llama", params)
        assert spec.max_positions == cfg["max_position_embeddings"]
        assert spec.num_params == get_model_spec(registry).num_params
        assert spec.qkv_bias == (cfg is qwen) and spec.qk_norm == (cfg is qwen3) and not spec.bias
    assert spec_from_hf_dict(qwen3, name="qwen3-8b") == replace(get_model_spec("qwen3-8b"), dtype="bfloat16")
    v01 = spec_from_hf_dict({**mistral, "sliding_window": 4096}, name="v0.1")  # every layer windowed: masked
    assert (v01.sliding_window, v01.max_positions) == (4096, 32768)
    assert ModelSpec.from_json(v01.to_json()) == v01
    assert spec_from_hf_dict({**mistral, "sliding_window": 32768}, name="m").sliding_window is None  # no slide
    # Qwen2 windows the layers from max_window_layers on, or those its layer_types name
    some = spec_from_hf_dict({**qwen, "use_sliding_window": True, "max_window_layers": 21, "sliding_window": 4096},
                             name="q")
    assert (some.max_positions, some.sliding_window, some.window_layers) == (32768, 4096, (False,) * 21 + (True,) * 7)
    last = spec_from_hf_dict({**qwen, "layer_types": ["full_attention"] * 27 + ["sliding_attention"],
                              "sliding_window": 2048}, name="q")
    assert (last.sliding_window, last.window_layers) == (2048, (False,) * 27 + (True,))
    full = spec_from_hf_dict({**qwen, "use_sliding_window": True}, name="q")  # max_window_layers 28: none slides
    assert (full.max_positions, full.sliding_window) == (32768, None)
    biased = spec_from_hf_dict({**mistral, "model_type": "llama", "attention_bias": True}, name="b")
    assert biased.bias and "o_proj.bias" in biased.layer_tensor_shapes()
    assert "o_proj.bias" not in spec_from_hf_dict(qwen, name="q").layer_tensor_shapes()
    mlp_biased = spec_from_hf_dict({**mistral, "model_type": "llama", "mlp_bias": True}, name="b")
    assert mlp_biased.mlp_bias and mlp_biased.layer_tensor_shapes()["down_proj.bias"] == (4096,)
    for change, message in [({"sliding_window": 0}, "sliding_window=0 must be a whole number >= 1"),
                            ({"sliding_window": "4k"}, "sliding_window='4k' must be")]:
        with pytest.raises(UserError, match=message):
            spec_from_hf_dict({**mistral, **change}, name="m")
    with pytest.raises(UserError, match="model_type 'gpt_neox' is not supported; xsched runs 'opt', 'llama', "
                                        "'mistral', 'qwen2', 'qwen3', 'phi3', 'gemma', 'gemma2', 'gemma3_text', "
                                        "'mixtral', 'qwen2_moe', 'qwen3_moe', 'gpt_oss', 'gemma3' models"):
        spec_from_hf_dict({**mistral, "model_type": "gpt_neox"}, name="g")


def test_bad_configs_give_user_errors(tmp_path):
    with pytest.raises(UserError, match="missing config.json"):
        ModelSpec.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError, match="not supported"):
        ModelSpec.from_hf_config(tmp_path)
    with pytest.raises(UserError, match="known models: opt-125m"):
        get_model_spec("gpt-5")
    opt = {"model_type": "opt", "hidden_size": 64, "ffn_dim": 256, "num_attention_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 64}
    for change, message in [({"num_hidden_layers": 2.5}, "num_hidden_layers=2.5 must be whole"),
                            ({"hidden_size": "64"}, "hidden_size='64' must be whole"),
                            ({"vocab_size": True}, "vocab_size=True must be whole"),
                            ({"num_hidden_layers": -1}, "no valid model .num_layers must be positive"),
                            ({"model_type": "llama", "intermediate_size": 256, "num_key_value_heads": 3},
                             "not a multiple of num_kv_heads")]:
        (tmp_path / "config.json").write_text(json.dumps({**opt, **change}))
        with pytest.raises(UserError, match=message):
            ModelSpec.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(UserError, match="must be a JSON object"):
        ModelSpec.from_hf_config(tmp_path)


def test_the_larger_gemma_3_entries_have_the_published_sizes():
    """gemma-3-4b/12b/27b: their non-embedding parameters are the Gemma 3 technical report's
    (3,209M, 10,759M, 25,600M; table 1) and with its 417M vision encoder each model is the size its
    model card gives (4.3B, 12.2B, 27.4B); 5 of 6 layers windowed to 1024, the full layers' rotary
    positions divided by 8, and gemma-3-27b's queries scaled by 168 ** -0.5 (its heads are 128 wide)."""
    for name, body_m, total_b in (("gemma-3-4b", 3_209, 4.3), ("gemma-3-12b", 10_759, 12.2),
                                  ("gemma-3-27b", 25_600, 27.4)):
        spec = get_model_spec(name)
        embed = spec.vocab_size * spec.hidden
        assert round((spec.num_params - embed) / 1e6) == body_m, name
        assert round((spec.num_params + 417e6) / 1e9, 1) == total_b, name
        assert spec.window_layers == tuple((i + 1) % 6 != 0 for i in range(spec.num_layers)), name
        local, full = spec.layer_spec(0), spec.layer_spec(5)
        assert (local.sliding_window, local.rope_theta, local.rope_divisors) == (1024, 1e4, ()), name
        assert (full.sliding_window, full.rope_theta, set(full.rope_divisors)) == (None, 1e6, {8.0}), name
    assert get_model_spec("gemma-3-27b").attention_scale == 168 ** -0.5
    assert get_model_spec("gemma-3-12b").attention_scale is None  # 256 ** -0.5, the head width's


def test_gemma_configs_read_their_windows_softcaps_and_rotary_bases():
    """gemma-2-9b-it's and gemma-3-1b-it's published configs (trimmed): 9,241,705,984 and
    999,885,952 parameters; Gemma 2 windows every other layer from the first and caps scores at 50
    and logits at 30; Gemma 3 windows 5 of every 6 layers, which rotate on their own base of 10^4,
    in either spelling of transformers 4 and 5."""
    g2 = {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
          "num_key_value_heads": 8, "head_dim": 256, "num_hidden_layers": 42, "vocab_size": 256000,
          "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
          "max_position_embeddings": 8192, "query_pre_attn_scalar": 256, "sliding_window": 4096,
          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "eos_token_id": [1, 107], "torch_dtype": "float32", "cache_implementation": "hybrid"}
    spec = spec_from_hf_dict(g2, name="gemma-2-9b")
    assert (spec.num_params, spec.activation, spec.norm_offset, spec.embed_scale) == (9_241_705_984, "gelu_tanh",
                                                                                        1.0, 3584 ** 0.5)
    assert spec.window_layers == tuple(i % 2 == 0 for i in range(42)) and spec.sliding_window == 4096
    assert (spec.attention_softcap, spec.logit_softcap, spec.attention_scale) == (50.0, 30.0, None)
    assert spec.tied_embeddings and spec.sandwich_norms and "mlp_post_norm.weight" in spec.layer_tensor_shapes()
    assert spec == replace(get_model_spec("gemma-2-9b"), dtype="float32")
    assert ModelSpec.from_json(spec.to_json()) == spec
    assert (spec.layer_spec(0).sliding_window, spec.layer_spec(1).sliding_window) == (4096, None)
    # Gemma-2-27B scales its queries by 144 ** -0.5, not head_dim's 128
    assert spec_from_hf_dict({**g2, "head_dim": 128, "query_pre_attn_scalar": 144}, "g").attention_scale == 144 ** -0.5
    g3 = {"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 256, "num_hidden_layers": 26, "vocab_size": 262144,
          "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
          "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
          "rope_scaling": None, "attn_logit_softcapping": None, "final_logit_softcapping": None,
          "rms_norm_eps": 1e-6, "eos_token_id": [1, 106], "torch_dtype": "bfloat16"}
    spec = spec_from_hf_dict(g3, name="gemma-3-1b")
    assert spec.num_params == 999_885_952 and spec.qk_norm and spec.attention_softcap is None
    assert spec.window_layers == tuple((i + 1) % 6 != 0 for i in range(26))
    assert spec == replace(get_model_spec("gemma-3-1b"), dtype="bfloat16")
    local, full = spec.layer_spec(0), spec.layer_spec(5)
    assert (local.rope_theta, local.sliding_window, full.rope_theta, full.sliding_window) == (1e4, 512, 1e6, None)
    # transformers 5's spelling: layer types and a rope per type, the full layers' scaled (Gemma-3-4B's factor 8)
    v5 = {k: v for k, v in g3.items() if k not in ("sliding_window_pattern", "rope_theta", "rope_local_base_freq",
                                                     "rope_scaling")}
    v5.update(layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    scaled = spec_from_hf_dict(v5, name="gemma-3-1b")
    assert scaled == replace(spec, rope_divisors=(8.0,) * 128)
    assert scaled.layer_spec(0).rope_divisors == () and scaled.layer_spec(5).rope_divisors == (8.0,) * 128
    for change, message in [({"hidden_activation": "relu"}, "Gemma activation 'relu' is not supported"),
                            ({"layer_types": ["full_attention"]}, "layer_types must list"),
                            ({"use_bidirectional_attention": True}, "bidirectional attention")]:
        with pytest.raises(UserError, match=message):
            spec_from_hf_dict({**g3, **change}, name="g")


def test_mixture_of_experts_configs_count_every_expert_and_flop_the_routed_ones():
    """Mixtral-8x7B-Instruct-v0.1's, Qwen3-30B-A3B's, gpt-oss-20b's and Qwen1.5-MoE-A2.7B's
    published configs (trimmed): 46,702,792,704, 30,532,122,624, 20,914,757,184 and 14,315,784,192
    parameters, of which a token multiplies by 12.9B, 3.35B, 4.19B and 2.69B (2 of 8, 8 of 128, 4 of
    32, 4 of 60 experts and the shared one; the embeddings counted once, both of gpt-oss's); a
    plan's flops are the routed ones, its bytes every expert's."""
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
               "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000, "hidden_act": "silu",
               "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
               "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 2}
    qwen = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
            "vocab_size": 151936, "max_position_embeddings": 40960, "max_window_layers": 48, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 151645}
    # Qwen1.5-MoE-A2.7B: 60 experts, 4 per token, and a shared expert every token goes through
    qwen15 = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 16,
              "num_hidden_layers": 24, "vocab_size": 151936, "max_position_embeddings": 8192, "num_experts": 60,
              "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1, "rope_theta": 1000000.0,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False}
    # gpt-oss-20b: 4 of 32 experts, each with biases, and attention sinks (3.03B active in its layers)
    oss = {"model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
           "max_position_embeddings": 131072, "sliding_window": 128, "num_local_experts": 32,
           "num_experts_per_tok": 4, "experts_per_token": 4, "rms_norm_eps": 1e-5, "attention_bias": True,
           "tie_word_embeddings": False, "eos_token_id": [200002, 200012], "swiglu_limit": 7.0,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "torch_dtype": "bfloat16",
           "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096}, "rope_theta": 150000.0}
    for cfg, params, active, registry in [(mixtral, 46_702_792_704, 12_879_663_104, "mixtral-8x7b"),
                                          (qwen, 30_532_122_624, 3_352_823_808, "qwen3-30b-a3b"),
                                          (oss, 20_914_757_184, 3_028_008_960 + 1_158_269_760, "gpt-oss-20b"),
                                          (qwen15, 14_315_784_192, 2_688_927_744, None)]:
        spec = spec_from_hf_dict(cfg, name=registry or "qwen1.5-moe")
        assert spec.num_params == params
        assert spec.active_matmul_params_per_layer * spec.num_layers + spec.head_params == active
        assert spec.linear_flops_per_token() == 2 * spec.active_matmul_params_per_layer
        if registry:
            assert spec == replace(get_model_spec(registry), dtype="bfloat16")
        assert ModelSpec.from_json(spec.to_json()) == spec
    assert spec.shared_expert_ffn == 5632 and spec.qkv_bias and not spec.expert_weights_renormalized
    # gpt-oss-120b: the same layers, 36 of them, 128 experts (116,829,156,672 params as published;
    # the 4 active experts of each of its 36 layers hold 3,584,424,960, as public counts have it)
    big = spec_from_hf_dict({**oss, "num_hidden_layers": 36, "num_local_experts": 128,
                             "layer_types": ["sliding_attention", "full_attention"] * 18}, name="gpt-oss-120b")
    expert = big.layer_tensor_shapes()
    expert_params = sum(math.prod(s) for k, s in expert.items() if k.startswith("experts.0."))
    assert big.num_params == 116_829_156_672 and 4 * expert_params * 36 == 3_584_424_960
    assert big == replace(get_model_spec("gpt-oss-120b"), dtype="bfloat16")
    oss_spec = get_model_spec("gpt-oss-20b")
    assert oss_spec.attention_sinks and oss_spec.mlp_bias and oss_spec.activation == "swiglu_clamped"
    assert "experts.31.down_proj.bias" in oss_spec.layer_tensor_shapes() and oss_spec.window_layers[:2] == (True, False)
    assert not spec_from_hf_dict({**qwen, "norm_topk_prob": False}, name="q").expert_weights_renormalized
    for change, message in [({"mlp_only_layers": [3]}, "dense layers among the sparse ones"),
                            ({"use_sliding_window": True}, "use_sliding_window is not supported"),
                            ({"num_experts": None}, "lacks 'num_local_experts'"),
                            ({"num_experts_per_tok": 200}, "experts_per_token <= num_experts")]:
        with pytest.raises(UserError, match=message):
            spec_from_hf_dict({**qwen, **change}, name="q")


def test_phi3_configs_read_as_windowed_llama_layers():
    """Phi-3-mini-4k-instruct's published config (trimmed): 3,821,079,552 parameters, every layer
    windowed to 2047 keys; Phi-4-mini's partial rotary embeddings and Phi-3-128k's LongRoPE are refused."""
    cfg = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
           "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 32064, "hidden_act": "silu",
           "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "rope_scaling": None, "sliding_window": 2047, "tie_word_embeddings": False,
           "eos_token_id": 32000, "pad_token_id": 32000, "torch_dtype": "bfloat16"}
    spec = spec_from_hf_dict(cfg, name="phi-3-mini")
    assert (spec.num_params, spec.sliding_window, spec.max_positions) == (3_821_079_552, 2047, 4096)
    assert spec == replace(get_model_spec("phi-3-mini"), dtype="bfloat16", extra_eos_token_ids=())
    with pytest.raises(UserError, match=r"partial rotary embeddings \(partial_rotary_factor=0.75\)"):
        spec_from_hf_dict({**cfg, "partial_rotary_factor": 0.75}, name="phi-4-mini")
    with pytest.raises(UserError, match="rope scaling 'longrope' is not supported"):
        spec_from_hf_dict({**cfg, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                                                   "long_factor": [1.0] * 48}}, name="phi-3-128k")


def test_llama31_rope_scaling_is_read_and_unknown_kinds_are_refused():
    """Llama-3.1-8B's published config (trimmed): its "llama3" scaling keeps the short wavelengths,
    divides the long ones by 8 and blends between, in either HF spelling; kinds xsched does not
    compute (dynamic NTK, LongRoPE) are refused rather than ignored, which would change every token.
    Qwen2.5's YaRN recipe (factor 4 over 32768 positions) scales cos/sin by 0.1 ln 4 + 1."""
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256, "rope_theta": 500000.0,
           "max_position_embeddings": 131072, "eos_token_id": [128001, 128008, 128009],
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    spec = spec_from_hf_dict(cfg, name="llama-3.1-8b")
    d = spec.rope_divisors
    assert len(d) == 64 and d[0] == 1.0 and d[-1] == 8.0 and list(d) == sorted(d)
    # wavelength 2 pi 500000^(i/64) of frequency i against 8192/4 = 2048 and 8192/1: below 2048 up to
    # i = 28 (500000^(28/64) = 311 < 2048 / 2 pi = 326), above 8192 from i = 35 (1308 > 8192 / 2 pi = 1304)
    assert set(d[:29]) == {1.0} and set(d[35:]) == {8.0} and all(1 < x < 8 for x in d[29:35])
    assert ModelSpec.from_json(spec.to_json()) == spec
    registry = get_model_spec("llama-3.1-8b")
    assert (registry.num_params, registry.rope_divisors, registry.eos_token_ids) == (8_030_261_248, d, (128001, 128008,
                                                                                                       128009))
    assert spec == replace(registry, dtype=spec.dtype, norm_eps=spec.norm_eps)
    v5 = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**cfg["rope_scaling"], "rope_theta": 500000.0}  # transformers 5's spelling
    assert spec_from_hf_dict(v5, name="llama-3.1-8b") == spec
    linear = spec_from_hf_dict({**cfg, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, name="l")
    assert linear.rope_divisors == (2.0,) * 64 and linear.rope_attention_factor == 1.0
    yarn = spec_from_hf_dict({**cfg, "rope_theta": 1000000.0, "max_position_embeddings": 131072, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, name="qwen2.5-7b-yarn")
    assert yarn.rope_attention_factor == pytest.approx(1.1386294)
    # frequency i turns 32768 theta^(-i/64) / 2 pi times: 32 times at i = 23.6 and once at i = 39.65; the
    # ramp runs over whole indices from floor(23.6) = 23 (kept) to ceil(39.65) = 40 (divided by 4)
    y = yarn.rope_divisors
    assert set(y[:24]) == {1.0} and set(y[40:]) == {4.0} and all(1 < x < 4 for x in y[24:40])
    for scaling, message in [({"rope_type": "dynamic", "factor": 2.0}, "rope scaling 'dynamic' is not supported"),
                             ({"type": "longrope", "short_factor": [1.0] * 64}, "rope scaling 'longrope' is not"),
                             ({"rope_type": "llama3", "factor": 8.0}, "lacks 'low_freq_factor'"),
                             ({"rope_type": "linear", "factor": "x"}, "holds no valid numbers"),
                             ({"rope_type": "linear", "factor": 0}, "factor must be > 0")]:
        with pytest.raises(UserError, match=message):
            spec_from_hf_dict({**cfg, "rope_scaling": scaling}, name="m")


def test_config_values_of_the_wrong_kind_give_user_errors(tmp_path):
    """Review: zero attention heads divided by zero, a rope_scaling or rope_parameters that is not
    an object and a list for rms_norm_eps each gave a traceback (xsched plan --model DIR)."""
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4,
             "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 64}
    for change, message in [({"num_attention_heads": 0}, "num_attention_heads=0 must be >= 1"),
                            ({"model_type": "opt", "ffn_dim": 256, "num_attention_heads": 0},
                             "num_attention_heads=0 must be >= 1"),
                            ({"rope_scaling": "linear"}, "rope_scaling='linear' must be a JSON object"),
                            ({"rope_parameters": [1]}, "rope_parameters=.1. must be a JSON object"),
                            ({"rms_norm_eps": [1e-6]}, "describes no valid model"),
                            # NaN or -1 eps, a 0 / -5 / NaN rotary base: every result line held token 0 (NaN
                            # logits) with exit 0 (a fault audit)
                            ({"rms_norm_eps": float("nan")}, "norm_eps must be a small positive number"),
                            ({"rms_norm_eps": -1}, "norm_eps must be a small positive number"),
                            ({"rope_theta": 0}, "rope_theta must be above 1 on a rotary model"),
                            ({"rope_theta": -5}, "rope_theta must be above 1"),
                            ({"rope_theta": float("nan")}, "rope_theta must be above 1")]:
        (tmp_path / "config.json").write_text(json.dumps({**llama, **change}))
        with pytest.raises(UserError, match=message):
            ModelSpec.from_hf_config(tmp_path)
    # a UTF-8 byte-order mark (Windows editors) is no error: refused "decode using utf-8-sig" before
    (tmp_path / "config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(llama).encode())
    assert ModelSpec.from_hf_config(tmp_path).num_layers == 2
    plan_like = tmp_path / "spec.json"
    plan_like.write_bytes(b"\xef\xbb\xbf" + get_model_spec("opt-125m").to_json().encode())
    assert ModelSpec.load(plan_like) == get_model_spec("opt-125m")


def test_contract_rejects_malformed_json():
    with pytest.raises(UserError, match="not valid JSON"):
        ModelSpec.from_json("{")
    data = get_model_spec("opt-125m").to_dict()
    data["num_layers"] = "twelve"
    with pytest.raises(UserError, match="num_layers"):
        ModelSpec.from_dict(data)
    data = get_model_spec("opt-125m").to_dict()
    data["schema"] = "xsched.ModelSpec/999"
    with pytest.raises(UserError, match="schema"):
        ModelSpec.from_dict(data)
    # Review: another kind of file (a plan given as a profile or a policy) was told to be regenerated
    data["schema"] = "xsched.Plan/1"
    with pytest.raises(UserError, match=r"holds a Plan \(schema 'xsched.Plan/1'\), not a ModelSpec; pass a ModelSpec"):
        ModelSpec.from_dict(data)


def test_policy_validates_fractions():
    p = Policy(gbs=8, nb=2, wg=0.25, wc=0.75, wd=0.0, cg=0, cc=1, cd=0, hg=1, hc=0, hd=0)
    assert Policy.from_json(p.to_json()) == p
    assert p.block_size == 16
    with pytest.raises(ValueError, match="sum to"):
        Policy(gbs=8, nb=1, wg=0.5, wc=0.0, wd=0.0)
    with pytest.raises(ValueError, match="not percents"):
        Policy(gbs=8, nb=1, wg=50, wc=50, wd=0)
    # a fraction computed as 1 - a - b carries float error; it is held to 0..1, not refused
    wg, wc = 0.8, 0.2
    assert 1 - wg - wc < 0
    computed = Policy(gbs=8, nb=1, wg=wg, wc=wc, wd=1 - wg - wc)
    assert computed.wd == 0.0 and computed.layer_counts(10) == (8, 2, 0)
    assert Policy.from_json(computed.to_json()) == computed
    # the types its JSON reading enforces (gbs=2.5 failed deep in a simulation; "yes" wrote JSON it could not read)
    for bad, message in ((dict(gbs=2.5), "gbs must be a whole number"), (dict(gbs=True), "gbs must be a whole number"),
                         (dict(compress_weight="yes"), "compress_weight must be true or false"),
                         (dict(wg="1"), "wg must be a number"),
                         # 1e308 positions overflowed the pricing with a traceback (a fault audit)
                         (dict(prefix_cache_positions=10**308), "prefix_cache_positions must be from 1 to 1,000,000,000")):
        with pytest.raises(ValueError, match=message):
            Policy(**{"gbs": 8, "nb": 1, **bad})
    bad = p.to_dict()
    bad["wc"] = 0.9
    with pytest.raises(UserError, match="sum to"):
        Policy.from_dict(bad)
    # the CPU-attention flag with every KV row on the gpu tier runs attention on the device
    assert "attention on the compute device" in Policy(gbs=8, nb=1, cpu_attention=True).describe()
    assert "attention on CPU" in Policy(gbs=8, nb=1, cg=0.5, cc=0.5, cpu_attention=True).describe()
    # a share that is neither none nor all never reads 0% or 100% (one row of 256 read "0% gpu, 100% cpu")
    assert "KV cache: 0.4% gpu, 99.6% cpu" in Policy(gbs=256, nb=1, cg=1 / 256, cc=255 / 256).describe()
    assert "KV cache: <0.1% gpu, >99.9% cpu" in Policy(gbs=4096, nb=1, cg=1 / 4096, cc=4095 / 4096).describe()
    assert "weights: 25% gpu, 75% cpu" in p.describe()
    with pytest.raises(UserError, match="at most 1048576 and 4096, got gbs=8 nb=100000000"):
        Policy.from_dict({"gbs": 8, "nb": 10**8})  # the simulator's arrays once took 24 GiB of RAM


def test_light_stages_import_without_torch():
    code = (
        "import importlib, pkgutil, sys\n"
        "import workloads, xsimulator, xscheduler, xprofiler.specs, xprofiler.profile\n"
        "for pkg in (workloads, xsimulator, xscheduler):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_of_each_package_is_what_it_exports():
    """`from xrunner import generate` gave the module xrunner/generate.py, not the function: a
    submodule of an export's name hides the export once imported. Each package's names resolve to
    the object in the module the package names, whatever was imported first."""
    code = (
        "import importlib\n"
        "import xrunner.engine, xrunner.cli\n"  # (imports submodules first, as a running CLI has)
        "for name in ('workloads', 'xprofiler', 'xsimulator', 'xscheduler', 'xrunner'):\n"
        "    pkg = importlib.import_module(name)\n"
        "    assert set(pkg.__all__) <= set(dir(pkg)), name\n"  # (the lazy names were missing from dir())
        "    for export in pkg.__all__:\n"
        "        got = getattr(pkg, export)\n"
        "        assert not isinstance(got, type(pkg)), (name, export)\n"
        "from xrunner import generate\n"
        "assert callable(generate) and generate.__module__ == 'xrunner.reference'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_engine_imports_without_scipys_fitting_modules():
    """An engine process's footprint counts against the RAM a plan may use: scipy.stats and
    scipy.optimize (about 45 MiB) are for fitting workloads, not for running a plan."""
    code = (
        "import sys\n"
        "import xrunner.engine, xrunner.loaders, xrunner.run_cli\n"
        "bad = sorted(m for m in ('scipy.stats', 'scipy.optimize') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_models_and_errors():
    out = subprocess.run([sys.executable, "-m", "xsched", "models"], capture_output=True, text=True, check=True)
    assert "opt-175b" in out.stdout and "smollm2-135m" in out.stdout
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert (rows["opt-30b"], rows["llama-2-7b"], rows["gemma-2-2b"]) == ("opt", "llama", "llama-like")  # (was "llama")
    # --json carries the table's derived columns too (it printed the raw specs only)
    specs = {d["name"]: d for d in json.loads(subprocess.run([sys.executable, "-m", "xsched", "models", "--json"],
                                                              capture_output=True, text=True, check=True).stdout)}
    opt = get_model_spec("opt-30b")
    assert (specs["opt-30b"]["num_params"], specs["opt-30b"]["weight_bytes"]) == (opt.num_params, opt.weight_bytes)
    assert specs["opt-30b"]["kv_bytes_per_token"] == opt.kv_bytes_per_token_per_layer * opt.num_layers
    bad = subprocess.run([sys.executable, "-m", "xsched", "nonsense"], capture_output=True, text=True)
    assert bad.returncode == 2


def test_ci_runs_the_readme_test_command_verbatim():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    blocks = readme.split("```bash\n")[1:]
    commands = [b.split("\n```")[0].strip() for b in blocks]
    test_cmds = [c for c in commands if "pytest" in c]
    assert len(test_cmds) == 1, test_cmds
    ci_lines = (root / ".ci" / "run").read_text().splitlines()
    assert test_cmds[0] in ci_lines


def test_outputs_are_written_all_or_none(tmp_path):
    """Several outputs of one command: a failure on the last leaves the earlier ones as they were
    and no temporary files; a new file gets the mode a plain open() gives, not mkstemp's 0600."""
    import os

    from xsched.fileio import atomic_write_all

    first = tmp_path / "plan.json"
    first.write_text("old")
    with pytest.raises(UserError, match="front.csv: directory does not exist"):
        atomic_write_all([(first, b"new"), (tmp_path / "missing" / "front.csv", b"x")])
    assert first.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    umask = os.umask(0o022)
    try:
        atomic_write_all([(first, b"new"), (tmp_path / "front.csv", b"x")])
    finally:
        os.umask(umask)
    assert first.read_text() == "new" and (tmp_path / "front.csv").stat().st_mode & 0o777 == 0o644


def run_cli(*argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``xsched ARGV`` in a fresh process (no traceback must leak)."""
    done = subprocess.run([sys.executable, "-m", "xsched.cli", *argv], capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr


def test_outputs_write_through_symlinks_and_refuse_devices_and_collisions(tmp_path):
    """A review found every writer renaming its temporary file over the path: `-o /dev/full`
    replaced the device with a plain file, a symlink was replaced instead of its target written,
    and `plan -o x.csv --frontier x` or `simulate -o f --trace f` lost one output silently."""
    import os

    target = tmp_path / "real.jsonl"
    target.write_text("old\n")
    (tmp_path / "link.jsonl").symlink_to(target)
    code, err = run_cli("workload", "sample", "fixed:8:4", "-n", "3", "-o", str(tmp_path / "link.jsonl"))
    assert code == 0, err
    assert (tmp_path / "link.jsonl").is_symlink() and len(target.read_text().splitlines()) == 3
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code, err = run_cli("workload", "sample", "fixed:8:4", "-n", "3", "-o", str(fifo))
    assert code == 2 and "is not a regular file" in err and err.count("\n") == 1, err
    assert fifo.exists() and not fifo.is_file()
    code, err = run_cli("plan", "--profile", "t4", "--model", "opt-1.3b", "--workload", "fixed:32:8", "--requests",
                        "20", "-o", str(tmp_path / "x.csv"), "--frontier", str(tmp_path / "x"), "--quiet")
    assert code == 2 and "both write" in err and err.count("\n") == 1, err
    code, err = run_cli("simulate", "--profile", "t4", "--model", "opt-1.3b", "--workload", "fixed:32:8",
                        "--policy", '{"gbs": 4, "nb": 1}', "-o", str(tmp_path / "s.json"), "--trace", str(tmp_path / "s.json"))
    assert code == 2 and "both write" in err, err
    assert not (tmp_path / "s.json").exists()


def test_a_lone_surrogate_in_a_contract_string_is_a_one_line_error(tmp_path, capsys):
    """A hand-edited "\\ud800" in a profile's or workload's name was decoded, then `profile show` and
    `workload show` printed it: a UnicodeEncodeError traceback (review). The bytes of a non-UTF-8
    file name or argument (\\udc80-\\udcff, which xsched writes into a workload's name) still load."""
    from xsched.cli import main
    from workloads import get_workload
    from xprofiler.presets import load_preset

    profile, workload = tmp_path / "p.json", tmp_path / "w.json"
    data = load_preset("t4").to_dict()
    profile.write_text(json.dumps({**data, "name": "vm\ud800"}))
    get_workload("fixed:8:4").save(workload)
    workload.write_text(workload.read_text().replace('"fixed:8:4"', '"fixed\\udfff"'))
    for argv, field in ((["profile", "show", str(profile)], "p.json.name"),
                        (["workload", "show", str(workload)], "w.json.name")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{field}: holds a lone surrogate" in err, err
    profile.write_text(json.dumps({**data, "name": "caf\udce9"}))
    assert main(["profile", "show", str(profile), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "caf\udce9"


def test_an_output_on_an_input_file_is_refused(tmp_path, capsys):
    """`plan -o` on its --profile replaced a measured profile with the plan, `simulate -o` or --trace
    on its --plan replaced the plan, `workload fit -o` on its file replaced the requests with the
    fitted Workload JSON (review); `xsched run` refused the same already."""
    from xsched.cli import main
    from xprofiler.presets import load_preset

    profile, plan, reqs = tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "reqs.jsonl"
    load_preset("t4").save(profile)
    reqs.write_text("".join(f'{{"prompt_tokens": {8 + i}, "output_tokens": {4 + i % 3}}}\n' for i in range(40)))
    assert main(["plan", "--profile", str(profile), "--model", "opt-1.3b", "--workload", "fixed:32:8",
                 "--requests", "20", "-o", str(plan), "--quiet"]) == 0
    capsys.readouterr()
    before = {f: f.read_bytes() for f in (profile, plan, reqs)}
    cases = [
        ["plan", "--profile", str(profile), "--model", "opt-1.3b", "--workload", "fixed:32:8", "--requests", "20",
         "-o", str(profile), "--quiet"],
        ["plan", "--profile", "t4", "--model", "opt-1.3b", "--workload", f"{reqs}@0.5", "--requests", "20",
         "--frontier", str(tmp_path / "reqs"), "-o", str(reqs), "--quiet"],
        ["simulate", "--plan", str(plan), "-o", str(plan)],
        ["simulate", "--plan", str(plan), "--profile", str(profile), "--trace", str(profile)],
        ["replan", "--plan", str(plan), "--observed", str(reqs), "-o", str(reqs)],
        ["workload", "fit", str(reqs), "-o", str(reqs)],
        ["workload", "sample", f"{reqs}@2", "-n", "5", "-o", str(reqs)],
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "are the same file" in err, (argv, err)
    assert {f: f.read_bytes() for f in before} == before


def test_unreadable_or_absurd_inputs_are_one_line_errors(tmp_path):
    """Names too long for the file system, a file used as a directory, JSON nested past the
    parser's recursion limit and a huge model dimension each gave a traceback."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"id": 1, "prompt_ids": [1, "a"], "max_new_tokens": 3}\n')  # was counted as 2 tokens
    for argv in (("profile", "show", "p" * 300), ("workload", "show", "w" * 300 + ".jsonl"),
                 ("simulate", "--profile", "t4", "--model", "m" * 300, "--workload", "T", "--policy", '{"gbs": 1, "nb": 1}'),
                 ("workload", "show", str(plan / "x.jsonl")), ("profile", "show", str(deep)), ("workload", "fit", str(deep)),
                 ("workload", "show", str(ids))):
        code, err = run_cli(*argv)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    # a directory where a file goes: said so, in the same words for every file a command reads
    # (it was "cannot read plan (IsADirectoryError)", "cannot read (Is a directory)", ...)
    for argv, what in ((("simulate", "--plan", str(tmp_path)), "plan file"),
                       (("workload", "show", str(tmp_path)), "file"), (("workload", "fit", str(tmp_path)), "file")):
        code, err = run_cli(*argv)
        assert code == 2 and err.count("\n") == 1 and f"a directory, not a {what}; pass the {what}'s path" in err, \
            (argv, err)
    from xrunner.jobfiles import read_prompts

    with pytest.raises(UserError, match="a directory, not a prompt file; pass the prompt file's path"):
        read_prompts(tmp_path)
    with pytest.raises(UserError, match="below 2\\*\\*31"):
        ModelSpec.from_dict({**get_model_spec("opt-125m").to_dict(), "vocab_size": 10**20})


def test_contract_nested_past_the_decoders_recursion_is_a_user_error():
    """Review: a mixture nested 200 deep is valid JSON (json.loads took it) but its decoding ran out
    of recursion: `xsched workload show deep.json` printed a RecursionError traceback."""
    from workloads import Workload

    dist = {"family": "fixed", "max_len": 3, "min_len": 3, "params": {"value": 3}}
    for _ in range(200):
        dist = {"family": "mixture", "max_len": 3, "min_len": 3, "weights": [1], "components": [dist]}
    text = json.dumps({"name": "deep", "prompt": dist, "output": dist})
    with pytest.raises(UserError, match="nested too deeply"):
        Workload.from_json(text)
    with pytest.raises(UserError, match="nested too deeply"):
        Workload.from_dict(json.loads(text))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_stdout_on_a_full_disk_is_a_one_line_error(unbuffered):
    """Review: `xsched workload show T > /dev/full` printed an OSError traceback (exit 1), or with
    buffered stdout "Exception ignored ... No space left on device" at exit (exit 120)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "xsched.cli", "workload", "show", "T"], stdout=full,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "xsched: error: standard output: no space left on the device; free some space or write " \
                          "elsewhere\n", done.stderr


def test_a_closed_standard_output_still_writes_the_output_file(tmp_path):
    """`xsched plan -o plan.json >&-` (a cron job that closes stdout) failed with an
    AttributeError traceback and wrote no plan (a fault audit)."""
    out = tmp_path / "plan.json"
    done = subprocess.run(f"{sys.executable} -m xsched.cli plan --profile t4 --model opt-125m --workload fixed:16:4 "
                          f"--requests 8 -o {out} >&-", shell=True, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert json.loads(out.read_text())["policy"]["gbs"] >= 1


def test_an_integer_too_large_for_a_float_field_is_a_user_error():
    """Review: JSON parses a 400-digit integer literal as an int, and float() of it raised
    OverflowError: `simulate --policy '{"gbs": 1, "nb": 1, "wg": 1000...0}'` and `profile show` of
    a profile with such an mm_flops printed tracebacks."""
    with pytest.raises(UserError, match=r"--policy.wg: an integer of 401 digits is too large for a number"):
        Policy.from_dict({"gbs": 1, "nb": 1, "wg": 10**400}, where="--policy")
    # an int field: a profile's gpu_bytes or a fingerprint's ram_bytes overflowed later arithmetic
    with pytest.raises(UserError, match=r"spec.vocab_size: an integer of 401 digits is too large"):
        ModelSpec.from_dict({**get_model_spec("opt-125m").to_dict(), "vocab_size": 10**400}, where="spec")
    # past Python's 4300-digit limit json.loads itself raises ValueError, not JSONDecodeError
    huge = '{"gbs": ' + "1" * 5000 + ', "nb": 1}'
    with pytest.raises(UserError, match="Exceeds the limit"):
        Policy.from_json(huge)


def test_integer_literals_past_pythons_digit_limit_are_one_line_errors(tmp_path, capsys):
    """The same 5000-digit literal in --policy text and in a model's config.json."""
    from xsched.cli import main

    huge = '{"gbs": ' + "1" * 5000 + ', "nb": 1}'
    assert main(["simulate", "--profile", "t4", "--model", "opt-125m", "--workload", "T", "--policy", huge]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--policy is not valid JSON (Exceeds the limit" in err[0], err
    (tmp_path / "config.json").write_text(huge)
    with pytest.raises(UserError, match="not a valid JSON config .Exceeds the limit"):
        ModelSpec.from_hf_config(tmp_path)


def test_a_wrong_type_error_quotes_only_the_start_of_the_value():
    """Review: a JSON array of 100,000 requests saved as w.json and given as a workload made
    `xsched workload show w.json` print a 4.3 MB 'one-line' error quoting the whole array."""
    from workloads import Workload

    text = json.dumps([{"prompt_tokens": 10, "output_tokens": 5}] * 100_000)
    with pytest.raises(UserError, match=r"w.json: expected Workload, got \[\{'prompt_tokens': 10") as info:
        Workload.from_json(text, where="w.json")
    assert len(str(info.value)) < 200


def test_the_experts_a_steps_tokens_reach_match_uniform_routing_drawn_at_random():
    """``experts_reached``, which prices how many experts a step's 4-bit weights dequantize, against
    counting the distinct experts of tokens that each draw k of E experts uniformly at random."""
    rng = np.random.default_rng(0)
    for name, tokens in [("qwen3-30b-a3b", (1, 4, 32, 256)), ("mixtral-8x7b", (1, 2, 8)), ("gpt-oss-120b", (1, 16))]:
        spec = get_model_spec(name)
        e, k = spec.num_experts, spec.experts_per_token
        for n in tokens:
            picks = rng.random((2000 if n <= 16 else 300, n, e)).argpartition(k, axis=-1)[..., :k]
            hit = np.zeros((len(picks), e), dtype=bool)
            np.put_along_axis(hit, picks.reshape(len(picks), -1), True, axis=-1)
            assert spec.experts_reached(n) == pytest.approx(hit.sum(axis=-1).mean(), rel=0.02), (name, n)
        assert spec.experts_reached(1) == pytest.approx(k)
        assert np.allclose(spec.experts_reached(np.array([0.0, 1e6])), [0.0, e])
    assert get_model_spec("smollm2-135m").experts_reached(8) == 0.0


def test_an_os_error_reads_as_what_to_do_about_the_path(tmp_path):
    """ENOENT from creating a file names a missing directory, except where the directory exists
    and takes no files (/proc said "directory does not exist; create it first")."""
    import errno

    from xsched.fileio import describe_os_error

    missing = OSError(errno.ENOENT, "No such file or directory")
    assert describe_os_error(missing, tmp_path / "nope") == f"{tmp_path / 'nope'}: directory does not exist; create it first"
    assert describe_os_error(missing, tmp_path).startswith(f"{tmp_path}: files cannot be created there")
    assert "no space left" in describe_os_error(OSError(errno.ENOSPC, "full"), tmp_path)


def test_every_output_is_fsynced_before_its_rename_and_keeps_the_mode_it_had(tmp_path, monkeypatch):
    """A crash right after `-o` must leave the old file or the whole new one: each file's bytes
    reach the disk (fsync, seen here with all its bytes) before the renames. A replaced file keeps
    its permissions (a 0600 plan stayed private). Neither was checked (a mutation audit)."""
    import xsched.fileio as fileio

    sizes, real = [], os.fsync
    monkeypatch.setattr(fileio.os, "fsync", lambda fd: (sizes.append(os.fstat(fd).st_size), real(fd)))
    fileio.atomic_write_all([(tmp_path / "a", b"x"), (tmp_path / "b", b"yy")])
    assert sizes == [1, 2]
    monkeypatch.undo()
    p = tmp_path / "plan.json"
    p.write_text("old")
    p.chmod(0o600)
    umask = os.umask(0o022)
    try:
        fileio.atomic_write_all([(p, b"new")])
    finally:
        os.umask(umask)
    assert p.read_text() == "new" and p.stat().st_mode & 0o777 == 0o600


def test_a_contract_refuses_unknown_fields_and_a_bool_for_a_number():
    """A misspelt key (gbz) silently meant the default, and true read as 1 (a mutation audit)."""
    with pytest.raises(UserError, match=r"--policy: unknown field\(s\) gbz for Policy"):
        Policy.from_dict({"gbs": 1, "nb": 1, "gbz": 2}, where="--policy")
    with pytest.raises(UserError, match=r"--policy.gbs: expected int, got True"):
        Policy.from_dict({"gbs": True, "nb": 1}, where="--policy")
