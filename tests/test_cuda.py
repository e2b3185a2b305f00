"""The engine's CUDA paths (streams, pinned host buffers, the allocator's peak) on a real device.

Skipped on a host without CUDA, which is where CI runs: these are the checks to run first on a
machine with a GPU (``python -m pytest -m cuda``). Each compares the engine on the device with
the in-memory reference loop on the same device, so kernel rounding cannot make them differ.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_engine import GEMMA2, GEMMA3, GPTOSS, LLAMA, MIXTRAL, POLICIES, make_requests, reference, run_engine

from xrunner.loaders import RandomSource, load_weights
from xrunner.model import ModelWeights
from xrunner.tiers import MemoryLedger, Ref, TierStore
from xsimulator.policy import Policy

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def on_device(w: ModelWeights, device: str) -> ModelWeights:
    return ModelWeights(w.spec, {k: v.to(device) for k, v in w.head.items()},
                        [{k: v.to(device) for k, v in layer.items()} for layer in w.layers])


@pytest.fixture(scope="module")
def llama_cuda():
    src = RandomSource(LLAMA, seed=3)
    reqs = make_requests(9, seed=1, vocab=LLAMA.vocab_size)
    return src, reqs, reference(on_device(load_weights(src), "cuda"), reqs)


@pytest.mark.parametrize("sync", ["item", "step"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_cuda_engine_outputs_equal_the_reference_on_the_device(llama_cuda, tmp_path, name, sync):
    """Both ways of waiting for the device: after every item (the default), or once per step with
    the I/O tasks ordered after the compute by CUDA events."""
    src, reqs, want = llama_cuda
    got, stats = run_engine(src, Policy(gbs=3, nb=2, **POLICIES[name]), reqs, tmp_path, device="cuda",
                            cuda_sync=sync)
    assert got == want  # run_engine also checks measured <= planned peak on every tier
    assert stats.device_reserved_peak_bytes is not None and stats.device_reserved_peak_bytes > 0


# Mistral-v0.1's sliding window, Qwen3's q/k norms and a scaled rope with YaRN's cos/sin factor in one
# spec: the masks built on the device, the per-head norms and the rotary tables in the device's dtype.
NEWER_KINDS = replace(LLAMA, name="tiny-newer-kinds", sliding_window=5, qk_norm=True,
                      rope_divisors=tuple(1.0 + i / 8 for i in range(LLAMA.head_dim // 2)), rope_attention_factor=1.1)


@pytest.mark.parametrize("spec", [NEWER_KINDS, GEMMA2, GEMMA3, MIXTRAL, GPTOSS],
                         ids=["newer-kinds", "gemma2", "gemma3", "mixtral", "gpt-oss"])
@pytest.mark.parametrize("name", ["all-gpu", "kv-cpu-cpu-attention", "everything-offloaded-refill"])
def test_cuda_newer_layer_kinds_equal_the_reference_on_the_device(tmp_path, name, spec):
    """Also Gemma 2's soft-capped attention (not SDPA) and per-layer windows, Gemma 3's two
    rotary tables, a mixture of experts' routing and GPT-OSS's sinks, on the device."""
    src = RandomSource(spec, seed=4)
    reqs = make_requests(7, seed=2, vocab=spec.vocab_size, min_prompt=3)
    want = reference(on_device(load_weights(src), "cuda"), reqs)
    got, _ = run_engine(src, Policy(gbs=3, nb=2, **POLICIES[name]), reqs, tmp_path, device="cuda")
    assert got == want


def test_cpu_tier_buffers_are_pinned_and_released_on_a_cuda_store():
    ledger = MemoryLedger()
    store = TierStore(torch.device("cuda"), None, ledger)
    t = store.empty("cpu", "kv_home", (64, 1024), torch.float16)
    assert t.is_pinned() and ledger.live["cpu"] == t.numel() * t.element_size()
    g = store.empty("gpu", "kv_home", (64, 1024), torch.float16)
    assert g.device.type == "cuda"
    store.release("cpu", "kv_home", t)
    store.release("gpu", "kv_home", g)
    assert ledger.live == {"gpu": 0, "cpu": 0, "disk": 0}
    store.close()


def test_row_copies_in_a_deferred_block_are_complete_when_it_returns():
    """Home <-> stage row copies inside ``deferred_sync`` share one stream synchronisation per
    channel (one timed event each), and the data is in place when the block returns: the host
    reads the cpu rows straight after it, with no synchronisation of its own."""
    events = []
    store = TierStore(torch.device("cuda"), None, MemoryLedger(), on_copy=lambda c, t0, t1, n: events.append((c, n)))
    store.mark_io_thread()
    rows, width = 16, 1 << 16
    home = store.empty("cpu", "kv_home", (rows, width), torch.float32)
    home.copy_(torch.randn(rows, width))
    stage = store.empty("gpu", "kv_stage", (rows, width), torch.float32)
    back = store.empty("cpu", "kv_home", (rows, width), torch.float32)
    with store.deferred_sync():
        for r in range(rows):
            store.copy(Ref("gpu", stage[r]), Ref("cpu", home[r]))
    with store.deferred_sync():
        for r in range(rows):
            store.copy(Ref("cpu", back[r]), Ref("gpu", stage[r]))
    assert torch.equal(back, home)
    assert events == [("ctog", rows * width * 4), ("gtoc", rows * width * 4)]
    store.close()
