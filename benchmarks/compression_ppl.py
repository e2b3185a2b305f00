"""Perplexity of SmolLM2-135M on real English text: fp32 vs the engine's 4-bit weights and KV cache.

The text is the Python standard library's ``pydoc_data.topics`` (the help topics: English prose
with some code), tokenized with the model's own tokenizer and cut into windows. Each window is
scored the way the engine computes: the first half is a prefill (attention over the fresh K/V,
which are then stored), the second half is teacher-forced decode, one token per step, attending
to the stored cache (and to its own position's K/V exactly, as the engine and FlexGen do). The
compressed path uses the engine's own stored forms: ``xrunner.stored_forms.WeightLayout`` (2-D layer
weights quantized along the output channels, groups of 64, dequantized before compute; the tied
embedding / LM head stays fp32, as in the engine) and ``xrunner.stored_forms.KVCodec`` (K/V quantized
along the head dimension when written, dequantized for attention). It scores each way of
choosing a group's 4-bit form: plain min/max (FlexGen's), the least-squared-error range search,
each with and without the Hadamard rotation; for weights also GPTQ codes, and for the KV cache
also centering on each layer's mean K/V, both fitted on the engine's calibration text
(``xrunner.gptq``, which is not this text); then weights and KV cache together for FlexGen's
plain format, earlier defaults and the engine's defaults for random-weight and real models. It
also times one KV write (a 128-token prefill and a decode step) per rule, since the KV range is
chosen on the write path. Goal: increase <= 2%.

    OMP_NUM_THREADS=1 python benchmarks/compression_ppl.py [--windows 4 --window 256] [--json]
    # GPTQ and the K/V centers calibrated on the help topics after the scored windows (in-domain text,
    # as `xsched run --calibration-text prompts` calibrates on a job's own prompts):
    python benchmarks/compression_ppl.py --windows 16 --calibration in-domain
    # plain min/max weights on FlexGen's grid and on the shipped GGUF's own (Q4_1: 32 along the inputs):
    python benchmarks/compression_ppl.py --windows 16 --grids
    # one run on 16 windows, another range search:
    python benchmarks/compression_ppl.py --windows 16 --clip-steps 20 --only "weights: range search (20 shrinks), rotated, GPTQ"
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time

import torch
import torch.nn.functional as F


def text_tokens(tok, count: int) -> tuple[list[int], list[int]]:
    """The first ``count`` tokens of ``pydoc_data.topics`` (scored) and the rest (in-domain
    calibration text that is not scored)."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < count:
        raise SystemExit(f"pydoc_data.topics has only {len(ids)} tokens, {count} asked")
    return list(ids[:count]), list(ids[count:])


def quantized_layers(weights, clip_steps: int, rotate: bool, calibration=None):
    """Every layer packed into the engine's 4-bit record and unpacked for compute (GPTQ codes when
    ``calibration`` token ids are given, as the engine does with them); and the pass's K/V centers
    (None without calibration)."""
    from xrunner.stored_forms import WeightLayout
    from xrunner.gptq import GPTQCalibration

    spec = weights.spec
    layout = WeightLayout(spec.layer_tensor_shapes(), torch.float32, compress=True, clip_steps=clip_steps,
                          rotate=rotate, rotate_inputs=calibration is not None)
    gptq = None if calibration is None else GPTQCalibration(spec, weights.head, calibration, layout.quantize_tensor,
                                                            layout.dequantize_tensor)
    out = []
    for i, w in enumerate(weights.layers):
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.pack(w, flat, gptq.quantize_layer(i, w) if gptq else None)
        dequant = {n: torch.empty(s) for n, s in layout.dequant_shapes().items()}
        out.append({k: v.clone() for k, v in layout.unpack(flat, dequant).items()})
    return out, (gptq.kv_centers if gptq else None)


def observed_centers(weights, calibration):
    """K/V centers as the engine records them when weights stay plain: a pass that only observes,
    over the first ``CENTER_SEQUENCES`` sequences of the calibration text (``Engine._calibration``;
    all 64 gave +0.71% against the engine's +0.56% on 4 windows)."""
    from xrunner.gptq import CENTER_SEQUENCES, GPTQCalibration

    cal = GPTQCalibration(weights.spec, weights.head, calibration[:CENTER_SEQUENCES])
    for i, w in enumerate(weights.layers):
        cal.observe_layer(i, w)
    return cal.kv_centers


@torch.inference_mode()
def window_nll(spec, head, layers, ids: list[int], codec) -> tuple[float, int, float, int]:
    """Summed negative log-likelihood of ids[1:] (prefill half, then teacher-forced decode), and
    of the decoded half's tokens alone: a prefill attends to its own exact K/V, as the engine's
    does, so only the decoded tokens read the stored cache."""
    from xrunner.model import attention, attn_in, attn_out_mlp, embed, final_logits, rope_tables

    n = len(ids)
    half = n // 2
    x = torch.tensor([ids])
    rope = rope_tables(spec, n, "cpu", torch.float32)
    caches: list[list[torch.Tensor]] = []
    pos = torch.arange(half)[None]
    h = embed(spec, head, x[:, :half], pos)
    for i, w in enumerate(layers):
        q, k, v = attn_in(spec, w, h, pos, rope)
        caches.append(codec.encode(k, v, i))
        h = attn_out_mlp(spec, w, attention(spec, q, k, v, None, causal=True), h)
    logits = [final_logits(spec, head, h)[0]]
    for t in range(half, n - 1):
        p = torch.tensor([[t]])
        h = embed(spec, head, x[:, t:t + 1], p)
        for i, w in enumerate(layers):
            q, k, v = attn_in(spec, w, h, p, rope)
            k, v = codec.prepare(k, v, i)
            caches[i] = [torch.cat((c, e), dim=2) for c, e in zip(caches[i], codec.pack(k, v))]
            # the step's own K/V exact; a 4-bit cache attended over its codes on a CPU, as the engine
            h = attn_out_mlp(spec, w, codec.attend_stored(spec, q, caches[i], (k, v), None, layer=i), h)
        logits.append(final_logits(spec, head, h)[0])
    all_logits = torch.cat(logits).float()
    target = x[0, 1:]
    each = F.cross_entropy(all_logits, target, reduction="none")
    decoded = each[half:]  # the tokens predicted by decode steps (the first is the prefill's last position's)
    return float(each.sum()), len(target), float(decoded.sum()), len(decoded)


def score(spec, head, layers, ids: list[int], windows: int, window: int, codec) -> tuple[float, float]:
    """Perplexity over ``windows`` consecutive windows of ``ids``, and over their decoded halves."""
    nll, count, nll_d, count_d = 0.0, 0, 0.0, 0
    for wi in range(windows):
        a, c, ad, cd = window_nll(spec, head, layers, ids[wi * window:(wi + 1) * window], codec)
        nll, count, nll_d, count_d = nll + a, count + c, nll_d + ad, count_d + cd
    return math.exp(nll / count), math.exp(nll_d / count_d)


def by_kind(args) -> int:
    """Which tensors cost the most: each 2-D weight kind quantized alone, under each range rule."""
    from tqdm import tqdm

    from xrunner.compression import DEFAULT_CLIP_STEPS
    from xrunner.stored_forms import KVCodec, WeightLayout
    from xrunner.loaders import default_model_path, load_weights, open_model

    src = open_model(default_model_path())
    ids, _ = text_tokens(src.tokenizer(), args.windows * args.window)
    weights = load_weights(src)
    spec = weights.spec
    codec = KVCodec(spec.head_dim, torch.float32, compress=False)
    base = score(spec, weights.head, weights.layers, ids, args.windows, args.window, codec)[0]
    kinds = [n for n, s in spec.layer_tensor_shapes().items() if len(s) == 2] + ["embed_tokens.weight"]
    shapes = {k: tuple(v.shape) for k, v in {**weights.layers[0], **weights.head}.items()}
    rows: dict[str, dict[str, float]] = {}
    for kind in tqdm(kinds, desc="tensor kinds", file=sys.stderr):
        for rule, steps in (("min/max", 0), ("range search", DEFAULT_CLIP_STEPS)):
            layout = WeightLayout(shapes, torch.float32, compress=True, clip_steps=steps)  # as the engine stores

            def rq(k: str, v: torch.Tensor) -> torch.Tensor:
                return layout.dequantize_tensor(k, layout.quantize_tensor(k, v)) if k == kind else v

            head = {k: rq(k, v) for k, v in weights.head.items()}
            layers = [{k: rq(k, v) for k, v in w.items()} for w in weights.layers]
            rows.setdefault(kind, {})[rule] = score(spec, head, layers, ids, args.windows, args.window,
                                                    codec)[0] / base - 1.0
    if args.json:
        print(json.dumps({"fp32_perplexity": base, "increase": rows}, indent=2))
        return 0
    print(f"SmolLM2-135M-Instruct, fp32 perplexity {base:.3f}; perplexity increase with one kind 4-bit "
          "(row groups rotated as the engine stores them, nearest codes, no GPTQ):")
    print(f"{'tensor kind':24}{'min/max':>10}{'search':>10}")
    for kind, cells in rows.items():
        print(f"{kind:24}{cells['min/max']:>+10.3f}{cells['range search']:>+10.3f}")
    return 0


def grids(args) -> int:
    """Why the goal is hard on this checkpoint: plain 4-bit min/max groups (nearest codes, no rotation,
    no GPTQ) along the output channels, as FlexGen's format and the engine's, and along the input
    channels in groups of 64 and of 32. The shipped GGUF is Q4_1, 4-bit groups of 32 along the input
    channels; on that grid re-quantizing gives back the same weights."""
    from xrunner.stored_forms import KVCodec
    from xrunner.loaders import default_model_path, load_weights, open_model

    def minmax(w: torch.Tensor, axis: int, group: int) -> torch.Tensor:
        x = w if axis == 1 else w.t()  # groups of consecutive elements along the last axis
        g = x.reshape(x.shape[0], -1, group)
        low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = (high - low).clamp_min(torch.finfo(w.dtype).tiny) / 15
        y = (((g - low) / scale).round().clamp(0, 15) * scale + low).reshape(x.shape)
        return y if axis == 1 else y.t()

    src = open_model(default_model_path())
    ids, _ = text_tokens(src.tokenizer(), args.windows * args.window)
    weights = load_weights(src)
    spec = weights.spec
    codec = KVCodec(spec.head_dim, torch.float32, compress=False)
    base = score(spec, weights.head, weights.layers, ids, args.windows, args.window, codec)
    rows = {}
    for name, axis, group in (("output channels, groups of 64 (FlexGen's)", 0, 64),
                              ("input channels, groups of 64", 1, 64), ("input channels, groups of 32 (Q4_1's)", 1, 32)):
        layers = [{k: minmax(v, axis, group) if v.dim() == 2 else v for k, v in w.items()} for w in weights.layers]
        ppl = score(spec, weights.head, layers, ids, args.windows, args.window, codec)
        rows[name] = {"whole": ppl[0] / base[0] - 1.0, "decoded": ppl[1] / base[1] - 1.0}
    if args.json:
        print(json.dumps({"fp32_perplexity": base[0], "increase": rows}, indent=2))
        return 0
    print(f"SmolLM2-135M-Instruct, fp32 perplexity {base[0]:.3f}; 4-bit weights by plain min/max groups (KV fp32):")
    for name, cells in rows.items():
        print(f"  {name:44}{cells['whole']:>+9.2%} whole windows{cells['decoded']:>+9.2%} decoded halves")
    return 0


def kv_write_s(codec, spec, tokens: int, repeats: int = 20) -> float:
    """Median seconds of one layer's KV write (encode of k and v) for ``tokens`` positions."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, spec.num_kv_heads, tokens, spec.head_dim, generator=g) for _ in range(2))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        codec.encode(k, v)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=256, help="tokens per window (half prefill, half decode)")
    ap.add_argument("--by-kind", action="store_true",
                    help="instead: 4-bit weights of one tensor kind at a time (and the tied embedding / LM head, "
                         "which the engine keeps fp32), per range rule")
    ap.add_argument("--grids", action="store_true",
                    help="instead: plain min/max 4-bit weights grouped along the output channels (FlexGen's) and along "
                         "the input channels (the shipped GGUF's own Q4_1 grid is groups of 32 there)")
    ap.add_argument("--clip-steps", type=int, default=None,
                    help="shrinks of the range search (default: the engine's, xrunner.compression.DEFAULT_CLIP_STEPS)")
    ap.add_argument("--calibration-sequences", type=int, default=None,
                    help="sequences of 256 calibration tokens for GPTQ and the K/V centers (default: the engine's)")
    ap.add_argument("--only", default="",
                    help="substrings separated by ';': score only the runs whose 'section: rule' contains one "
                         "(e.g. 'weights: range search (10 shrinks), rotated, GPTQ'); fp32 always runs")
    ap.add_argument("--calibration", choices=("docstrings", "in-domain"), default="docstrings",
                    help="GPTQ's and the K/V centers' text: the engine's default (standard-library docstrings), or "
                         "the help topics after the scored windows, as `xsched run --calibration-text prompts` "
                         "calibrates on a job's own prompts")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.by_kind:
        return by_kind(args)
    if args.grids:
        return grids(args)

    from tqdm import tqdm

    from xrunner.compression import DEFAULT_CLIP_STEPS, KV_CLIP_STEPS
    from xrunner.stored_forms import KVCodec
    from xrunner.gptq import CALIBRATION_SEQUENCES, calibration_ids
    from xrunner.loaders import default_model_path, load_weights, open_model

    if args.clip_steps is None:
        args.clip_steps = DEFAULT_CLIP_STEPS
    if args.calibration_sequences is None:
        args.calibration_sequences = CALIBRATION_SEQUENCES

    src = open_model(default_model_path())
    tok = src.tokenizer()
    ids, rest = text_tokens(tok, args.windows * args.window)
    weights = load_weights(src)
    spec = weights.spec
    plain_kv = KVCodec(spec.head_dim, torch.float32, compress=False)
    search = f"range search ({args.clip_steps} shrinks)"
    rules = {"min/max": 0, search: args.clip_steps}
    calibration = calibration_ids(tok, sequences=args.calibration_sequences,
                                  first=[rest] if args.calibration == "in-domain" else ())
    weight_rules = {f"{rule}{', rotated' if rotate else ''}": (steps, rotate, None)
                    for rotate in (False, True) for rule, steps in rules.items()}
    gptq = f"{search}, rotated, GPTQ"
    weight_rules[gptq] = (args.clip_steps, True, calibration)
    pack_s = 0.0

    @functools.cache
    def packed(name: str):  # (layers, K/V centers), made the first time a selected run needs them
        nonlocal pack_s
        t0 = time.perf_counter()
        out = quantized_layers(weights, *weight_rules[name])
        pack_s += time.perf_counter() - t0
        return out

    kv_rules = {f"{rule}{', rotated' if rotate else ''}": KVCodec(spec.head_dim, torch.float32, compress=True,
                                                                 clip_steps=steps, rotate=rotate, fused=True)
                for rotate in (False, True) for rule, steps in rules.items()}
    kv_default = f"{[r for r, steps in rules.items() if steps == KV_CLIP_STEPS][0]}, rotated"

    def centered(centers):
        return KVCodec(spec.head_dim, torch.float32, compress=True, clip_steps=KV_CLIP_STEPS, centers=centers,
                       fused=True)

    kv_centered = f"{kv_default}, centered (real models)"
    # Each run: (what, rule) -> a function giving (layers, KV codec), called only if the run is selected.
    runs = {("none", "fp32"): lambda: (weights.layers, plain_kv)}
    runs.update({("weights", name): functools.partial(lambda n: (packed(n)[0], plain_kv), name)
                 for name in weight_rules})
    runs.update({("KV cache", name): functools.partial(lambda c: (weights.layers, c), codec)
                 for name, codec in kv_rules.items()})
    runs[("KV cache", kv_centered)] = lambda: (weights.layers, centered(observed_centers(weights, calibration)))
    mixes = {"FlexGen's plain format (min/max, min/max)": ("min/max", lambda: kv_rules["min/max"]),
             "stop 14's default (search, min/max)": (search, lambda: kv_rules["min/max"]),
             "engine default, random weights (no text)": (f"{search}, rotated", lambda: kv_rules[kv_default]),
             "stop 15's default, real model (GPTQ, KV not centered)": (gptq, lambda: kv_rules[kv_default]),
             "engine default, real model (GPTQ, KV centered)": (gptq, lambda: centered(packed(gptq)[1]))}
    runs.update({("both", mix): functools.partial(lambda w, c: (packed(w)[0], c()), w, codec)
                 for mix, (w, codec) in mixes.items()})
    only = [x.strip() for x in args.only.split(";")] if args.only else None
    selected = {key: make for key, make in runs.items()
                if key == ("none", "fp32") or only is None or any(o in f"{key[0]}: {key[1]}" for o in only)}
    rows = {}
    for (what, rule), make in tqdm(selected.items(), desc="perplexity", file=sys.stderr):
        lay, codec = make()
        t0 = time.perf_counter()
        perplexity, decoded = score(spec, weights.head, lay, ids, args.windows, args.window, codec)
        rows.setdefault(what, {})[rule] = {"perplexity": perplexity, "tokens": args.windows * (args.window - 1),
                                           "decoded_perplexity": decoded, "wall_s": time.perf_counter() - t0}
    base = rows["none"]["fp32"]["perplexity"]
    base_decoded = rows["none"]["fp32"]["decoded_perplexity"]
    for r in rows.values():
        for cell in r.values():
            cell["increase"] = cell["perplexity"] / base - 1.0
            cell["decoded_increase"] = cell["decoded_perplexity"] / base_decoded - 1.0
    kv_cost = {rule: {f"{n}_tokens_s": kv_write_s(codec, spec, n) for n in (1, 128)}
               for rule, codec in kv_rules.items() if rule in rows.get("KV cache", {})}
    if args.json:
        print(json.dumps({"perplexity": rows, "kv_write": kv_cost, "pack_s": pack_s,
                          "calibration": args.calibration}, indent=2))
        return 0
    print(f"SmolLM2-135M-Instruct on pydoc_data.topics: {args.windows} windows x {args.window} tokens, "
          f"fp32 perplexity {base:.3f} (decoded halves {base_decoded:.3f}); calibration text: "
          + ("the engine's (standard-library docstrings)" if args.calibration == "docstrings" else
             f"the {args.calibration_sequences} x 256 tokens after the scored windows (in-domain)"))
    for what, title in (("weights", "4-bit weights only"), ("KV cache", "4-bit KV cache only"),
                        ("both", "4-bit weights + KV cache")):
        if what not in rows:
            continue
        print(f"{title}: perplexity (increase over fp32); decoded halves alone")
        for rule, cell in rows[what].items():
            print(f"  {rule:56}{cell['perplexity']:>9.3f} ({cell['increase']:+.3f}){cell['decoded_perplexity']:>9.3f} "
                  f"({cell['decoded_increase']:+.3f})")
    if kv_cost:
        print("KV write (one layer, k and v), median seconds:")
    for rule, c in kv_cost.items():
        print(f"  {rule:56}{'decode step':>14}{c['1_tokens_s'] * 1e6:>9.0f} us{'128-token prefill':>20}"
              f"{c['128_tokens_s'] * 1e6:>9.0f} us")
    print("goal: increase <= 0.02 (4-bit weights + KV cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
