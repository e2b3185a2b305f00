"""benchmarks/roofline.py: the bound it divides the engine's throughput by."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark


def _bench():
    return load_benchmark("roofline")


def _spec():
    from xprofiler.specs import ModelSpec

    return ModelSpec(name="opt-roofline", family="opt", num_layers=12, hidden=1024, ffn=4096, num_heads=16,
                     num_kv_heads=16, head_dim=64, vocab_size=50272, max_positions=2048, norm="layernorm",
                     activation="relu", position="learned", tied_embeddings=True, bias=True, dtype="float32")


def test_the_lm_head_overlaps_the_reads_of_a_disk_bound_step():
    """The default shape at the VM's rates (61.4 / 13.0 GFLOP/s, 28.3 ms per layer read): a decode step
    reads for 12 x 28.3 = 340 ms and computes 12 x 15.6 + 63 = 251 ms, so it takes 340 ms; adding
    the head after the reads (the old bound, 7.38 s) put the bound above the engine's 6.85 s."""
    spec, gemm, io = _spec(), {"prefill": 61.4e9, "decode": 13.0e9, "head": 13.0e9}, 0.0283
    bound = _bench().bound_seconds(spec, 8, 32, 16, gemm, io)
    head = 8 * 2 * 50272 * 1024 / 13.0e9
    layer = {ph: t * (spec.linear_flops_per_token() + spec.attention_flops_per_token(c)) / gemm[ph]
             for ph, t, c in (("prefill", 8 * 32, 32), ("decode", 8, 40))}
    prefill = 12 * layer["prefill"] + head  # compute-bound: 1.33 s against 0.34 s of reads
    decode = 12 * io  # disk-bound: the head hides under the reads
    assert 12 * layer["decode"] + head < decode < 12 * layer["prefill"]
    assert bound == pytest.approx(prefill + 15 * decode)
    assert bound == pytest.approx(6.42, abs=0.01)
    # Compute-bound throughout (fast disk): every FLOP, head included, is on the critical path.
    fast = _bench().bound_seconds(spec, 8, 32, 16, gemm, 1e-6)
    assert fast == pytest.approx(12 * layer["prefill"] + head + 15 * (12 * layer["decode"] + head))
    # The head is one product over the block's 8 rows, at its own rate (the engine runs it so).
    quick = _bench().bound_seconds(spec, 8, 32, 16, {**gemm, "head": 26.0e9}, 1e-6)
    assert fast - quick == pytest.approx(16 * head / 2)


def test_the_bounds_disk_rate_is_the_engines_own_where_it_read_faster_than_the_probe():
    """The probe before a run read 1.97 GB/s where the engine's reads went at 2.31: a bound on the
    probe's rate is one the engine can beat. The engine's rate is its reads' bytes over their
    seconds, from the run's trace (other tracks do not count)."""
    from types import SimpleNamespace

    from xsimulator.trace import TraceEvent

    events = [TraceEvent("dtoc", "dtoc", 0.0, 0.02, {"bytes": 46_000_000}),
              TraceEvent("dtoc", "dtoc", 0.05, 0.02, {"bytes": 46_000_000}),
              TraceEvent("compute", "layer", 0.0, 0.5, {"layer": 0})]
    assert _bench().achieved_read_bytes_per_s(SimpleNamespace(events=events)) == pytest.approx(2.3e9)
    assert _bench().achieved_read_bytes_per_s(SimpleNamespace(events=events[2:])) is None
