"""In-memory reference generation: a left-padded batch, a preallocated KV cache, one loop.

This is the simplest correct way to run the model core end to end (``xsched generate``, the
tests against ``transformers``, the speed benchmark). The offloading engine reuses the same
layer functions with weights and caches spread over tiers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from xrunner.model import (ModelWeights, embed, final_logits, layer_forward, layer_ropes, left_pad,
                           position_ids_from_mask)
from xrunner.sampling import SamplingParams, sample
from xsched.errors import UserError


@dataclass
class GenerationResult:
    """New tokens per prompt (a stop token, when hit, is the last one kept) and timings."""

    tokens: list[list[int]]
    prefill_s: float
    decode_s: float
    logits: list[torch.Tensor] = field(default_factory=list)  # per step [b, V], if asked for

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


@torch.inference_mode()
def generate(model: ModelWeights, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), stop_token_ids: Sequence[int] = (),
             return_logits: bool = False, on_step: Callable[[int], None] | None = None,
             request_ids: Sequence[object] | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` for each prompt; a row stops at a stop token.

    The batch keeps running until every row stopped or the budget is spent (rows that stopped
    are still computed, their outputs discarded). ``on_step(n)`` is called after each token.
    ``request_ids`` key each row's sampling draws (default: the row numbers); the engine keys a
    request by its id, so the same ids sample the same tokens here and there.
    """
    spec = model.spec
    if max_new_tokens < 1:
        raise UserError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    ids_of_rows = list(range(len(prompts))) if request_ids is None else list(request_ids)
    if len(ids_of_rows) != len(prompts):
        raise ValueError(f"{len(ids_of_rows)} request ids for {len(prompts)} prompts")
    device = model.head["embed_tokens.weight"].device
    dtype = model.head["embed_tokens.weight"].dtype
    ids, mask = left_pad(prompts, device=device)
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < spec.vocab_size:  # (an IndexError in torch)
        raise UserError(f"a prompt's token ids must lie in {spec.name}'s vocabulary 0..{spec.vocab_size - 1}; got "
                        f"{int(ids.min())}..{int(ids.max())}")
    b, width = ids.shape
    capacity = width + max_new_tokens
    if capacity > spec.max_positions:
        raise UserError(f"prompt ({width} tokens) + {max_new_tokens} new tokens exceed the model's "
                        f"{spec.max_positions} positions; shorten the prompt or ask for fewer tokens")
    ropes = layer_ropes(spec, capacity, device, dtype)
    specs = spec.layer_specs()
    cache_shape = (b, spec.num_kv_heads, capacity, spec.head_dim)
    caches = [(torch.empty(cache_shape, dtype=dtype, device=device),
               torch.empty(cache_shape, dtype=dtype, device=device)) for _ in model.layers]
    full_mask = torch.zeros((b, capacity), dtype=torch.bool, device=device)
    full_mask[:, :width] = mask
    padded = not bool(mask.all())  # without padding, attention needs no mask (faster kernels)
    positions = position_ids_from_mask(mask)
    stop = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    out = torch.empty((b, max_new_tokens), dtype=torch.long, device=device)
    step_logits: list[torch.Tensor] = []

    t0 = time.perf_counter()
    start, inputs, steps = 0, ids, 0
    prefill_s = 0.0
    for step in range(max_new_tokens):
        t = inputs.shape[1]
        hidden = embed(spec, model.head, inputs, positions)
        for w, (k_cache, v_cache), s, rope in zip(model.layers, caches, specs, ropes):
            hidden = layer_forward(s, w, hidden, positions, rope, k_cache, v_cache,
                                   full_mask[:, :start + t] if padded else None, start)
        logits = final_logits(spec, model.head, hidden[:, -1])
        if return_logits:
            step_logits.append(logits.float().cpu())
        token = sample(logits, sampling, [(rid, step) for rid in ids_of_rows] if not sampling.greedy else ())
        out[:, step] = token
        steps = step + 1
        if step == 0:
            _sync(device)
            prefill_s = time.perf_counter() - t0
        if on_step is not None:
            on_step(steps)
        if len(stop):
            done |= torch.isin(token, stop)
            if bool(done.all()):
                break
        start += t
        full_mask[:, start] = True
        positions = positions[:, -1:] + 1
        inputs = token[:, None]
    _sync(device)
    decode_s = time.perf_counter() - t0 - prefill_s

    rows = out[:, :steps].tolist()
    stops = set(int(s) for s in stop_token_ids)
    tokens = [_cut_at_stop(r, stops) for r in rows]
    return GenerationResult(tokens=tokens, prefill_s=prefill_s, decode_s=decode_s, logits=step_logits)


def _cut_at_stop(row: list[int], stops: set[int]) -> list[int]:
    for i, tok in enumerate(row):
        if tok in stops:
            return row[:i + 1]
    return row


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work so that wall-clock timings include it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
