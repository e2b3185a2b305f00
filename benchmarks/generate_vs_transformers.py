"""Generation speed of xrunner's in-memory loop against transformers' ``generate``.

Same OPT-shaped random model for both (one copy of the weights, shared), same prompts, greedy,
a fixed number of new tokens, same process, runs alternating so machine noise hits both
alike. Throughput counts generated tokens over the whole call (prefill included). The real
opt-350m projects its embeddings, which xsched does not support, so the default shape is a
custom OPT of similar size (24 layers, hidden 1024, 16 heads, ffn 4096: about 356M params).

    .venv/bin/python benchmarks/generate_vs_transformers.py            # the issue's setting
    .venv/bin/python benchmarks/generate_vs_transformers.py --json     # machine-readable
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def build(args: argparse.Namespace):
    from transformers import OPTConfig, OPTForCausalLM

    from xprofiler.specs import ModelSpec
    from xrunner.loaders import RandomSource, hf_state_dict, load_weights

    spec = ModelSpec(name="opt-bench", family="opt", num_layers=args.layers, hidden=args.hidden, ffn=args.ffn,
                     num_heads=args.heads, num_kv_heads=args.heads, head_dim=args.hidden // args.heads,
                     vocab_size=50272, max_positions=2048, norm="layernorm", activation="relu",
                     position="learned", tied_embeddings=True, bias=True, dtype=args.dtype)
    ours = load_weights(RandomSource(spec, seed=0))
    config = OPTConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden, ffn_dim=spec.ffn,
                       num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                       max_position_embeddings=spec.max_positions, word_embed_proj_dim=spec.hidden,
                       tie_word_embeddings=True, dtype=args.dtype)
    with torch.device("meta"):
        hf = OPTForCausalLM(config)
    hf.load_state_dict(hf_state_dict(ours), strict=True, assign=True)  # shares our tensors
    hf.tie_weights()
    hf.eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 1
    return spec, ours, hf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="timed runs of each, alternating (after a warm-up)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from xrunner.reference import generate

    spec, ours, hf = build(args)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, spec.vocab_size, (args.batch, args.prompt_len), generator=g)
    n_new = args.batch * args.new_tokens

    def run_ours() -> list[list[int]]:
        return generate(ours, prompts.tolist(), args.new_tokens).tokens

    def run_hf() -> list[list[int]]:
        with torch.inference_mode():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        return out[:, args.prompt_len:].tolist()

    same = run_ours() == run_hf()  # also the warm-up
    times: dict[str, list[float]] = {"xrunner": [], "transformers": []}
    cpu: dict[str, list[float]] = {"xrunner": [], "transformers": []}
    runs = [("xrunner", run_ours), ("transformers", run_hf)]
    for i in range(args.rounds):
        for name, fn in (runs if i % 2 == 0 else runs[::-1]):  # ABBA order cancels slow drifts
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    tps = {k: [n_new / t for t in v] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in tps.items()}
    # Each round's pair ran back to back, so the per-round ratio is the least noisy figure.
    round_ratios = [a / b for a, b in zip(tps["xrunner"], tps["transformers"])]
    ratio = statistics.median(round_ratios)
    # CPU seconds are less disturbed by other processes competing for the cores (exact with --threads 1).
    cpu_ratio = statistics.median(b / a for a, b in zip(cpu["xrunner"], cpu["transformers"]))
    report = {
        "model": {"layers": spec.num_layers, "hidden": spec.hidden, "heads": spec.num_heads, "ffn": spec.ffn,
                  "params": spec.num_params, "dtype": spec.dtype},
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "torch_threads": torch.get_num_threads(), "identical_greedy_tokens": same,
        "tokens_per_s": tps, "median_tokens_per_s": med, "round_ratios": round_ratios,
        "ratio_xrunner_over_transformers": ratio, "cpu_s": cpu, "cpu_time_ratio": cpu_ratio,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"OPT-shaped random model, {spec.num_params / 1e6:.0f}M params, {spec.dtype}, "
          f"{torch.get_num_threads()} threads; batch {args.batch} x {args.prompt_len} prompt tokens, "
          f"{args.new_tokens} new tokens; identical greedy tokens: {same}")
    print(f"{'run':<14}" + "".join(f"{'round ' + str(i + 1):>10}" for i in range(args.rounds)) + f"{'median':>10}")
    for name, values in tps.items():
        print(f"{name:<14}" + "".join(f"{v:>10.1f}" for v in values) + f"{med[name]:>10.1f}   tokens/s")
    print(f"{'ratio':<14}" + "".join(f"{r:>10.3f}" for r in round_ratios) + f"{ratio:>10.3f}   xrunner / transformers")
    print(f"ratio xrunner / transformers (median of per-round ratios): {ratio:.3f} "
          f"(range {min(round_ratios):.3f}..{max(round_ratios):.3f}); by CPU seconds: {cpu_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
