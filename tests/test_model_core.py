"""Model core and sampling, checked against transformers' own OPT, Llama, Qwen2, Qwen3 and Mistral models.

The reference is built from the same random weights: the test maps our tensor names to HF's
with its own table (not the loader's), loads them into an HF model created from an
OPTConfig/LlamaConfig/..., and runs each prompt alone (no padding) through HF's greedy generate.
Ours runs all prompts as one left-padded batch.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from xprofiler.specs import ModelSpec, spec_from_hf_dict
from xrunner.loaders import RandomSource, load_weights
from xrunner.model import (attention, embed, final_logits, layer_forward, layer_ropes, left_pad,
                           position_ids_from_mask, rope_tables)
from xrunner.reference import generate
from xrunner.sampling import SamplingParams, filter_logits, sample
from xsched.errors import UserError

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These check correctness, not speed: on a shared, oversubscribed 2-core machine two spinning
    OpenMP threads made them up to 6x slower than one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

STEPS = 32
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [101, 3, 250, 77, 12, 8, 90, 1]]

SHAPES = {
    "opt-mha": ("opt", dict(vocab_size=503, hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=128, word_embed_proj_dim=64)),
    "opt-untied": ("opt", dict(vocab_size=389, hidden_size=48, ffn_dim=100, num_hidden_layers=3,
                               num_attention_heads=6, max_position_embeddings=96, word_embed_proj_dim=48,
                               tie_word_embeddings=False)),
    "llama-mha": ("llama", dict(vocab_size=503, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                                rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "llama-gqa": ("llama", dict(vocab_size=611, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-gqa-tied-wide-heads": ("llama", dict(vocab_size=400, hidden_size=64, intermediate_size=160,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=32, max_position_embeddings=128, rope_theta=10000.0,
                                                tie_word_embeddings=True)),
    "llama-attention-bias": ("llama", dict(vocab_size=350, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                           attention_bias=True, tie_word_embeddings=False)),
    "llama-mlp-bias": ("llama", dict(vocab_size=350, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     mlp_bias=True, tie_word_embeddings=False)),
    "qwen2-gqa-tied": ("qwen2", dict(vocab_size=480, hidden_size=64, intermediate_size=144, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "mistral-gqa": ("mistral", dict(vocab_size=420, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                    max_position_embeddings=128, sliding_window=None, tie_word_embeddings=False)),
    # Qwen3: an RMSNorm over each head's q and k; head_dim 32 with 4 heads on hidden 64 (q_dim != hidden)
    "qwen3-qk-norm": ("qwen3", dict(vocab_size=360, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                    tie_word_embeddings=True)),
    # Llama 3.1's rope scaling, its wavelength bounds (64 / 4, 64 / 1) placed so that head_dim 16 has
    # frequencies kept, blended and divided
    "llama3-rope-scaling": ("llama", dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          rope_theta=500000.0, tie_word_embeddings=True,
                                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0,
                                                            original_max_position_embeddings=64))),
    # Qwen2.5's YaRN recipe (factor 4 over the original 32 here): head_dim 16 keeps, blends and divides
    # frequencies, and cos/sin are scaled by 0.1 ln 4 + 1
    "qwen2-yarn": ("qwen2", dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 rope_theta=10000.0, tie_word_embeddings=True,
                                 rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32))),
    "llama-linear-rope-scaling": ("llama", dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                                max_position_embeddings=128, tie_word_embeddings=False,
                                                rope_scaling=dict(rope_type="linear", factor=4.0))),
    # Phi-3-mini: fused qkv and gate/up projections in the checkpoint, every layer windowed (2047 there)
    "phi3-fused-window": ("phi3", dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       sliding_window=7, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                                       tie_word_embeddings=False)),
    # Mistral-7B-v0.1's window (4096) shrunk below the prompts: prefill and decode both slide
    "mistral-sliding-window": ("mistral", dict(vocab_size=420, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=128, sliding_window=6,
                                               tie_word_embeddings=False)),
    # Qwen2 with use_sliding_window: the layers from max_window_layers on windowed
    "qwen2-some-layers-windowed": ("qwen2", dict(vocab_size=480, hidden_size=64, intermediate_size=144,
                                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=128, use_sliding_window=True,
                                                 max_window_layers=1, sliding_window=4, tie_word_embeddings=False)),
    # Gemma: norms scaled by 1 + weight, embeddings by sqrt(hidden), a GeGLU MLP, tied head
    "gemma": ("gemma", dict(vocab_size=330, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)),
    # Gemma 2: sandwich norms, every other layer windowed (window 5, shorter than the prompts),
    # scores and logits soft-capped (caps lowered so that they bend these small models' values),
    # a query scale other than head_dim's
    "gemma2-softcap-windows": ("gemma2", dict(vocab_size=330, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=16, max_position_embeddings=128, sliding_window=5,
                                              query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                              final_logit_softcapping=3.0)),
    # Gemma 3: q/k norms, windowed layers with their own rotary base, a full layer with linear scaling
    "gemma3-local-rope": ("gemma3_text", dict(vocab_size=330, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=16, max_position_embeddings=128, sliding_window=4,
                                              layer_types=["sliding_attention", "full_attention",
                                                           "sliding_attention"],
                                              rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                     "rope_theta": 100.0},
                                                               "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                                  "rope_theta": 10000.0}})),
}
# HF model_type -> (config class, model class) names in transformers.
HF_CLASSES = {"opt": ("OPTConfig", "OPTForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
              "gemma": ("GemmaConfig", "GemmaForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
              "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}

# Our names -> HF names, written independently of xrunner.loaders.
HF_NAMES = {
    "llama": {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
              "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
              "down_proj": "mlp.down_proj", "attn_norm": "input_layernorm",
              "mlp_norm": "post_attention_layernorm", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
              "embed_tokens": "model.embed_tokens", "final_norm": "model.norm",
              "lm_head": "lm_head", "layers": "model.layers"},
    "opt": {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
            "o_proj": "self_attn.out_proj", "fc1": "fc1", "fc2": "fc2", "attn_norm": "self_attn_layer_norm",
            "mlp_norm": "final_layer_norm", "embed_tokens": "model.decoder.embed_tokens",
            "embed_positions": "model.decoder.embed_positions", "final_norm": "model.decoder.final_layer_norm",
            "lm_head": "lm_head", "layers": "model.decoder.layers"},
}


def hf_model_and_ours(kind: str, seed: int = 0, **changes):
    model_type, kwargs = SHAPES[kind]
    kwargs = {**kwargs, **changes}
    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[model_type])
    config = config_cls(**kwargs, attn_implementation="eager")
    spec = spec_from_hf_dict(config.to_dict(), name=kind, dtype="float32")
    ours = load_weights(RandomSource(spec, seed=seed))
    names = dict(HF_NAMES[spec.family])
    if model_type in ("gemma2", "gemma3_text"):  # a norm after attention and after the MLP
        names.update(attn_post_norm="post_attention_layernorm", mlp_norm="pre_feedforward_layernorm",
                     mlp_post_norm="post_feedforward_layernorm")
    state = {}
    for name, t in ours.head.items():
        module, param = name.split(".", 1)
        state[f"{names[module]}.{param}"] = t
    for i, layer in enumerate(ours.layers):
        for name, t in layer.items():
            module, param = name.split(".", 1)
            state[f"{names['layers']}.{i}.{names[module]}.{param}"] = t
    if spec.tied_embeddings:
        state["lm_head.weight"] = state[f"{names['embed_tokens']}.weight"]
    if model_type == "phi3":  # its checkpoints stack q, k, v into qkv_proj and gate above up in gate_up_proj
        for i in range(spec.num_layers):
            pre = f"{names['layers']}.{i}."
            for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                 ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
                state[f"{pre}{fused}.weight"] = torch.cat([state.pop(f"{pre}{names[p]}.weight") for p in parts])
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    hf.load_state_dict(state, strict=True)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return spec, ours, hf


@pytest.mark.parametrize("kind", ["opt-mha", "opt-untied"])
@pytest.mark.parametrize("faster", ["rows", "transposed"])
def test_the_lm_head_takes_the_layout_measured_faster_with_the_same_values(kind, faster, monkeypatch):
    """``load_weights`` keeps the LM head matrix in whichever layout its logits product timed faster
    (``[h, vocab]`` in memory when transposed), under the same name and values; the logits equal
    those of the stored matrix, and an untied model's embedding table stays row-major for the lookup."""
    import xrunner.model as model_core

    timed = []

    def fake_seconds(layouts, rows, repeats=3):
        timed.append((sorted(layouts), rows))
        return {name: 1.0 if name == faster else 2.0 for name in layouts}

    monkeypatch.setattr(model_core, "head_layout_seconds", fake_seconds)
    spec, _, _ = hf_model_and_ours(kind)
    timed.clear()
    ours = load_weights(RandomSource(spec, seed=0), head_rows=3)
    assert timed == [(["rows", "transposed"], [3, 2, 1])]  # the batch's row counts as it drains
    name = "embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
    w = ours.head[name]
    assert w.shape == (spec.vocab_size, spec.hidden)
    assert w.is_contiguous() == (faster == "rows") and w.t().is_contiguous() == (faster == "transposed")
    row_major = RandomSource(spec, seed=0).load_head()[name]
    assert row_major.is_contiguous() and torch.equal(w, row_major)
    x = torch.randn(3, spec.hidden, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(final_logits(spec, ours.head, x), final_logits(spec, {**ours.head, name: row_major}, x),
                          atol=1e-5, rtol=1e-5)
    assert spec.tied_embeddings or ours.head["embed_tokens.weight"].is_contiguous()


def test_head_layout_seconds_times_every_layout():
    """Both layouts of a head are timed, each a positive finite time, for the rows asked."""
    from xrunner.model import head_layout_seconds, head_layouts

    w = torch.randn(512, 64)
    layouts = head_layouts(w)
    assert torch.equal(layouts["transposed"], w) and layouts["transposed"].t().is_contiguous()
    seconds = head_layout_seconds(layouts, rows=[4], repeats=2)
    assert set(seconds) == {"rows", "transposed"} and all(0 < s < 1 for s in seconds.values())
    # Several row counts: still one (summed) time per layout.
    several = head_layout_seconds(layouts, rows=[4, 3, 1], repeats=2)
    assert set(several) == {"rows", "transposed"} and all(0 < s < 1 for s in several.values())


def test_the_head_layout_is_chosen_over_the_row_counts_a_batch_drains_through(monkeypatch):
    """A layout fast at the full batch but slow once rows finish loses to one fast at every
    count (opt-125m on the VM: row-major 27 ms at 16 rows, 63-66 ms at 13-15; transposed 24-25 ms)."""
    import xrunner.model as model_core
    from xrunner.model import cpu_head_layout, drain_rows, head_layout_of

    assert drain_rows(16) == [16, 14, 10, 6] and drain_rows(1) == [1]
    ms = {"rows": {16: 27.0, 14: 64.0, 10: 50.0, 6: 30.0}, "transposed": {16: 28.0, 14: 25.0, 10: 24.0, 6: 23.0}}
    spec, _, _ = hf_model_and_ours("opt-untied")
    monkeypatch.setattr(model_core, "head_layout_seconds",
                        lambda layouts, rows, repeats=3: {n: sum(ms[n][r] for r in rows) for n in layouts})
    head = {"lm_head.weight": torch.randn(spec.vocab_size, spec.hidden)}
    assert head_layout_of(cpu_head_layout(spec, head, 16)["lm_head.weight"]) == "transposed"
    ms["rows"].update({14: 26.0, 10: 22.0, 6: 20.0})  # now row-major is faster overall
    assert head_layout_of(cpu_head_layout(spec, head, 16)["lm_head.weight"]) == "rows"


def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([l[0] for l in out.logits])


@pytest.mark.parametrize("kind", list(SHAPES))
def test_padded_batch_matches_transformers(kind):
    spec, ours, hf = hf_model_and_ours(kind)
    result = generate(ours, PROMPTS, STEPS, return_logits=True)
    ours_logits = torch.stack(result.logits, dim=1)  # [b, steps, V]
    for row, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, STEPS)
        assert result.tokens[row] == ref_tokens, f"{kind} row {row}"
        rel = (ours_logits[row] - ref_logits).abs().max() / ref_logits.abs().max()
        assert rel < 1e-4, f"{kind} row {row}: relative logit error {rel:.2e}"


@pytest.mark.parametrize("kind", ["mistral-sliding-window", "gemma2-softcap-windows", "gemma3-local-rope"])
def test_prompts_past_the_prefill_band_match_transformers(kind):
    """Prompts of 300 and 170 tokens, windows of 4-6: a windowed layer's prefill attends in bands
    of 128 queries (``xrunner.model.banded_prefill``), the rows left-padded apart, and its logits
    and greedy tokens still are transformers'."""
    spec, ours, hf = hf_model_and_ours(kind, max_position_embeddings=512)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, spec.vocab_size, (n,), generator=g).tolist() for n in (300, 170)]
    result = generate(ours, prompts, 4, return_logits=True)
    ours_logits = torch.stack(result.logits, dim=1)
    for row, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, 4)
        assert result.tokens[row] == ref_tokens, f"{kind} row {row}"
        rel = (ours_logits[row] - ref_logits).abs().max() / ref_logits.abs().max()
        assert rel < 1e-4, f"{kind} row {row}: relative logit error {rel:.2e}"


@pytest.mark.parametrize("window", [5, 128, 200])
def test_banded_prefill_equals_the_masked_full_attention(window, monkeypatch):
    """Grouped-query heads, left padding, attention sinks, a prompt that is no multiple of the band:
    the banded prefill computes what one masked attention over the whole prompt does."""
    import xrunner.model as model_core
    from xprofiler.specs import prefill_band
    from xrunner.model import explicit_attention, visible_keys

    spec = spec_from_hf_dict({"model_type": "mistral", **SHAPES["mistral-sliding-window"][1],
                              "sliding_window": window, "max_position_embeddings": 512}, name="m")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)
    g = torch.Generator().manual_seed(4)
    T = 333
    q = torch.randn(2, 4, T, 16, generator=g)
    k, v = torch.randn(2, 2, T, 16, generator=g), torch.randn(2, 2, T, 16, generator=g)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, :150] = False
    sinks = torch.randn(4, generator=g)
    allowed = visible_keys(mask, T, T, True, window)
    want = explicit_attention(q, k, v, allowed, None, None, sinks).transpose(1, 2).reshape(2, T, 64)
    keys, scores = [], []

    def recording(q, k, v, allowed, *args):
        keys.append(k.shape[2])
        scores.append(q.shape[2] * k.shape[2])
        return explicit_attention(q, k, v, allowed, *args)

    monkeypatch.setattr(model_core, "explicit_attention", recording)
    got = attention(spec, q, k, v, mask, causal=True, sinks=sinks)
    assert max(keys) <= window - 1 + prefill_band(window) and max(keys) < T  # no call scored the whole prompt
    # what the planner prices: keys scored per query, and the scores one call holds
    assert sum(scores) / T == pytest.approx(spec.prefill_context(T))
    assert max(scores) == spec.prefill_scores(T)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1, 150:], want[1, 150:])


def test_layer_functions_compose_to_layer_forward():
    """Calling attn_in / attention / attn_out_mlp by hand (the engine's path) equals layer_forward."""
    from xrunner.model import attn_in, attn_out_mlp

    spec, ours, _ = hf_model_and_ours("llama-gqa")
    ids, mask = left_pad(PROMPTS)
    pos = position_ids_from_mask(mask)
    rope = rope_tables(spec, ids.shape[1])
    hidden = embed(spec, ours.head, ids, pos)
    w = ours.layers[0]
    cache = torch.zeros(ids.shape[0], spec.num_kv_heads, ids.shape[1], spec.head_dim)
    expected = layer_forward(spec, w, hidden, pos, rope, cache, cache.clone(), mask, 0)
    q, k, v = attn_in(spec, w, hidden, pos, rope)
    got = attn_out_mlp(spec, w, attention(spec, q, k, v, mask, causal=True), hidden)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.isfinite(final_logits(spec, ours.head, got)).all()


def test_attention_ignores_padding_and_is_finite_on_padding_rows():
    spec, _, _ = hf_model_and_ours("opt-mha")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 16, generator=g)
    k = torch.randn(1, 4, 6, 16, generator=g)
    v = torch.randn(1, 4, 6, 16, generator=g)
    mask = torch.tensor([[False, False, True, True, True, True]])
    out = attention(spec, q, k, v, mask, causal=True)
    assert torch.isfinite(out).all()
    # Changing padded keys/values must not change the real rows.
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :2] = 100.0
    v2[:, :, :2] = -100.0
    out2 = attention(spec, q, k2, v2, mask, causal=True)
    torch.testing.assert_close(out[:, 2:], out2[:, 2:])


@pytest.mark.parametrize("t,T,causal", [(6, 6, True), (3, 7, True), (1, 9, False)])
def test_attention_without_a_mask_equals_an_all_true_mask(t, T, causal):
    spec, _, _ = hf_model_and_ours("llama-gqa")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, spec.num_heads, t, spec.head_dim, generator=g)
    k = torch.randn(2, spec.num_kv_heads, T, spec.head_dim, generator=g)
    v = torch.randn(2, spec.num_kv_heads, T, spec.head_dim, generator=g)
    full = attention(spec, q, k, v, torch.ones(2, T, dtype=torch.bool), causal)
    torch.testing.assert_close(attention(spec, q, k, v, None, causal), full)


def test_unpadded_batch_matches_transformers():
    _, ours, hf = hf_model_and_ours("opt-untied", seed=5)
    prompts = [[4, 8, 15, 16, 23, 42], [1, 1, 2, 3, 5, 8]]
    result = generate(ours, prompts, 12)
    assert result.tokens == [hf_greedy(hf, p, 12)[0] for p in prompts]


def test_generate_rejects_contexts_longer_than_the_model():
    spec, ours, _ = hf_model_and_ours("opt-mha")
    with pytest.raises(UserError, match="positions"):
        generate(ours, [[1] * 100], max_new_tokens=spec.max_positions)
    with pytest.raises(UserError, match="at least one token"):
        generate(ours, [[1, 2], []], max_new_tokens=2)


def test_generation_stops_at_stop_tokens():
    _, ours, _ = hf_model_and_ours("llama-mha")
    free = generate(ours, PROMPTS, 12)
    stop = free.tokens[0][3]  # the 4th token of row 0 becomes a stop token
    stopped = generate(ours, PROMPTS, 12, stop_token_ids=[stop])
    assert stopped.tokens[0] == free.tokens[0][:free.tokens[0].index(stop) + 1]
    for ref, got in zip(free.tokens, stopped.tokens):
        assert got == (ref[:ref.index(stop) + 1] if stop in ref else ref)


# ----------------------------------------------------------------------------- random init
def _tiny_spec(layers: int = 4, dtype: str = "float32") -> ModelSpec:
    return ModelSpec(name="tiny", family="opt", num_layers=layers, hidden=32, ffn=64, num_heads=4, num_kv_heads=4,
                     head_dim=8, vocab_size=50, max_positions=64, norm="layernorm", activation="relu",
                     position="learned", tied_embeddings=True, bias=True, dtype=dtype)


def _digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_random_weights_are_reproducible_per_layer_across_processes():
    spec = _tiny_spec()
    src = RandomSource(spec, seed=7)
    here = _digest(src.load_layer(2))
    code = ("import sys, hashlib, torch\n"
            "from xprofiler.specs import ModelSpec\nfrom xrunner.loaders import RandomSource\n"
            f"spec = ModelSpec.from_json({spec.to_json(indent=None)!r})\n"
            "w = RandomSource(spec, seed=7).load_layer(2)\n"
            "h = hashlib.sha256()\n"
            "for n in sorted(w):\n"
            "    h.update(n.encode()); h.update(w[n].contiguous().view(torch.uint8).numpy().tobytes())\n"
            "print(h.hexdigest())\n")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there
    assert _digest(src.load_layer(1)) != here
    assert _digest(RandomSource(spec, seed=8).load_layer(2)) != here
    assert set(src.load_layer(0)) == set(spec.layer_tensor_shapes())
    assert {n: tuple(t.shape) for n, t in src.load_head().items()} == spec.head_tensor_shapes()


def test_random_weights_do_not_depend_on_the_number_of_filling_threads(monkeypatch):
    """Chunks are seeded by position, not by the thread that fills them: a machine with more
    cores (a GPU host's 16, this VM's 2) builds the same model."""
    src = RandomSource(_tiny_spec(), seed=7)
    src.CHUNK_ELEMS = 1000  # several chunks per projection
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    digests = []
    for cores in ({0}, {0, 1, 2, 3}):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: cores, raising=False)
        digests.append(_digest(src.load_layer(1)))
    assert digests[0] == digests[1]


@pytest.mark.parametrize("family,dtype", [("opt", "float16"), ("llama", "bfloat16"), ("gemma2", "bfloat16")])
def test_random_deep_models_stay_finite_in_16_bit(family, dtype):
    if family == "opt":
        spec = _tiny_spec(layers=96, dtype=dtype)
    else:
        spec = ModelSpec(name="deep", family="llama", num_layers=96, hidden=64, ffn=128, num_heads=4,
                         num_kv_heads=2, head_dim=16, vocab_size=50, max_positions=64, norm="rmsnorm",
                         activation="silu", position="rotary", tied_embeddings=False, dtype=dtype)
    if family == "gemma2":
        spec = replace(spec, activation="gelu_tanh", norm_offset=1.0, embed_scale=8.0, sandwich_norms=True,
                       attention_softcap=50.0, logit_softcap=30.0, sliding_window=4,
                       window_layers=tuple(i % 2 == 0 for i in range(96)), tied_embeddings=True)
    model = load_weights(RandomSource(spec, seed=3))
    ids, mask = left_pad([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]])
    pos = position_ids_from_mask(mask)
    ropes = layer_ropes(spec, ids.shape[1], dtype=getattr(torch, dtype))
    hidden = embed(spec, model.head, ids, pos)
    cache = torch.empty(2, spec.num_kv_heads, ids.shape[1], spec.head_dim, dtype=getattr(torch, dtype))
    with torch.inference_mode():
        for w, s, rope in zip(model.layers, spec.layer_specs(), ropes):
            hidden = layer_forward(s, w, hidden, pos, rope, cache, cache.clone(), mask, 0)
        logits = final_logits(spec, model.head, hidden)
    assert torch.isfinite(hidden).all() and torch.isfinite(logits).all()
    assert hidden[mask].float().std() < 50  # the residual stream does not blow up with depth


# ----------------------------------------------------------------------------- sampling
def keys(n: int) -> list[tuple[str, int]]:
    """A distinct (request id, token index) per row."""
    return [(f"r{i}", 0) for i in range(n)]


def test_a_request_draws_the_same_token_in_any_row_or_batch():
    """Each row's number comes from (seed, request id, token index): reordering or splitting the
    batch must not change any request's token (with one shared generator it did)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 300, generator=g) * 3
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=9)
    k = [(f"req-{i}", i % 7) for i in range(64)]
    whole = sample(logits, params, k)
    perm = torch.randperm(64, generator=g)
    assert torch.equal(sample(logits[perm], params, [k[i] for i in perm.tolist()]), whole[perm])
    assert torch.equal(torch.cat([sample(logits[i:i + 5], params, k[i:i + 5]) for i in range(0, 64, 5)]), whole)
    assert not torch.equal(sample(logits, SamplingParams(temperature=1.0, top_p=0.95, seed=10), k), whole)


def test_each_token_of_a_request_gets_its_own_uniform_draw():
    """A request's successive tokens must not reuse one draw (a sampled text would then pick the
    same quantile of every step's distribution): the draws over one request's 2,000 token indices
    are distinct and pass a chi-square test of uniformity on 20 bins, as do those over 2,000 ids
    at one index; another seed gives other draws."""
    from xrunner.sampling import uniforms

    for keys_ in ([("a", i) for i in range(2000)], [(f"r{i}", 0) for i in range(2000)]):
        u = np.array(uniforms(7, keys_))
        assert len(set(u.tolist())) == len(u) and ((0 <= u) & (u < 1)).all()
        counts = np.histogram(u, bins=20, range=(0.0, 1.0))[0]
        assert stats.chisquare(counts).pvalue > 1e-3, counts
        assert not np.array_equal(u, uniforms(8, keys_))


def test_ids_that_differ_only_in_json_type_draw_apart_and_broken_logits_are_an_error():
    """A job may hold ids 1 and "1" (two requests): their draws must differ. NaN or inf logits
    have no distribution; the draw used to return the last token id silently (review)."""
    from xrunner.sampling import uniforms

    assert len(set(uniforms(0, [(1, 0), ("1", 0), (2, 0), ("2", 0)]))) == 4
    params = SamplingParams(temperature=1.0)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(UserError, match="NaN or inf"):
            sample(torch.tensor([[0.0, bad, 1.0, 2.0]]), params, keys(1))


def test_a_uniform_next_to_one_never_picks_a_filtered_token(monkeypatch):
    """u x total can round up to the total; the draw then takes the last token still allowed,
    not one that top-k removed."""
    import xrunner.sampling as sampling

    monkeypatch.setattr(sampling, "uniforms", lambda seed, ks: [1.0] * len(ks))  # as if u x total rounded up
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0, -2.0]])
    params = SamplingParams(temperature=1.0, top_k=3, seed=0)
    assert sample(logits, params, keys(1)).tolist() == [4]  # tokens 1, 2, 4 remain; 4 is the last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_also_among_ties(dtype):
    """Greedy takes the first of tied maxima, as transformers' argmax does (few distinct values
    make ties in most rows; a NaN counts as the largest)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (64, 5000), generator=g).to(dtype)
    logits[::5, ::9] = float("nan")
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))
    logits = torch.randn(4, 100, generator=g).to(dtype)
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))


def test_top_k_restricts_support_to_the_k_largest():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)).expand(4000, 50)
    params = SamplingParams(temperature=1.0, top_k=5, seed=3)
    drawn = sample(logits, params, keys(len(logits)))
    assert set(drawn.tolist()) == set(logits[0].topk(5).indices.tolist())


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    logits = probs.log()
    support = lambda p: set(torch.isfinite(filter_logits(logits, SamplingParams(1.0, top_p=p)))[0].nonzero()  # noqa: E731
                            .flatten().tolist())
    assert support(0.4) == {0}
    assert support(0.75) == {0, 1}
    assert support(0.85) == {0, 1, 2}
    assert support(1.0) == {0, 1, 2, 3, 4}
    params = SamplingParams(temperature=1.0, top_p=0.85, seed=0)
    drawn = sample(logits.expand(3000, 5), params, keys(3000))
    assert set(drawn.tolist()) == {0, 1, 2}


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    temperature = 0.7
    params = SamplingParams(temperature=temperature, seed=11)
    drawn = sample(logits.expand(20000, 5), params, keys(20000))
    observed = torch.bincount(drawn, minlength=5).numpy()
    expected = (logits[0].double() / temperature).softmax(-1).numpy() * len(drawn)
    assert stats.chisquare(observed, expected).pvalue > 1e-4


def test_seed_reproduces_generation():
    _, ours, _ = hf_model_and_ours("llama-gqa")
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=123)
    a = generate(ours, PROMPTS, 16, params).tokens
    b = generate(ours, PROMPTS, 16, params).tokens
    c = generate(ours, PROMPTS, 16, SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=124)).tokens
    assert a == b
    assert a != c


def test_sampling_params_reject_nonsense():
    for bad in (dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5),
                dict(temperature=1e-300), dict(temperature=1.0, seed=2**64), dict(seed=-1)):
        with pytest.raises(UserError):
            SamplingParams(**bad)


def test_a_tiny_temperature_samples_the_largest_logit():
    """Divided by 2e-38, a logit of 20 overflowed float32 to +inf and torch.multinomial refused the
    NaN probabilities (stop 36); each row is now shifted to a largest logit of 0 first."""
    logits = torch.tensor([[20.0, 1.0, 0.0, -3.0], [-5.0, 7.5, 7.0, 2.0]])
    params = SamplingParams(temperature=2e-38, seed=0)
    drawn = [sample(logits, params, [("a", i), ("b", i)]).tolist() for i in range(20)]
    assert drawn == [[0, 1]] * 20
    # the shift leaves the distribution as it was at an ordinary temperature
    p1 = SamplingParams(temperature=0.7)
    assert torch.allclose(filter_logits(logits, p1).softmax(-1), (logits / 0.7).softmax(-1), atol=1e-6)
