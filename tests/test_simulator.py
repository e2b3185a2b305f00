"""xsimulator: cost model (FlexGen A.3), discrete-event timeline, analytic path, LP-compatibility."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pulp
import pytest
from bench_scripts import load_benchmark
from sim_profiles import GB, cpu_host, t4_like

from workloads import LengthDistribution, Workload, get_workload
from xprofiler.profile import BandwidthCurve, LayerFit, layer_features
from xprofiler.specs import get_model_spec
from xsched.errors import UserError
from xsimulator import PLACEMENT_VARS, CostModel, Policy, simulate, simulate_analytic, simulate_timeline, trace_events
from xsimulator.costmodel import (bandwidth_at, compression_ratio, parallel_groups,
                                  step_seconds)

OPT30 = get_model_spec("opt-30b")


def offload_policy(**kw) -> Policy:
    """Weights mostly on the CPU tier, KV cache on the CPU with CPU attention (an I/O-bound setting)."""
    base = dict(gbs=16, nb=4, wg=0.2, wc=0.8, wd=0.0, cg=0.0, cc=1.0, cd=0.0, hg=1.0, hc=0.0, hd=0.0,
                cpu_attention=True)
    base.update(kw)
    return Policy(**base)


# --------------------------------------------------------------------------- closed forms
def flexgen_comp(spec, bls, s, ctx, prof):
    """FlexGen A.3 compute terms per layer: prefill (s tokens) and decode (context ctx)."""
    h1, h2 = spec.hidden, spec.ffn
    pre = bls * (8 * s * h1**2 + 4 * s * h1 * h2) / prof.mm_flops + 4 * bls * s**2 * h1 / prof.bmm_flops
    gen = bls * (8 * h1**2 + 4 * h1 * h2) / prof.mm_flops + 4 * bls * ctx * h1 / prof.bmm_flops
    return pre, gen


@pytest.mark.parametrize("gbs,nb,n_blocks", [(8, 2, 3), (4, 1, 5)])
def test_fixed_workload_reproduces_flexgen_closed_form_compute_bound(gbs, nb, n_blocks):
    """T = Tpre*l + Tgen*(n-1)*l per block, Tgen at the average context s + n/2 (FlexGen §4.3)."""
    prof = t4_like()
    s, n = 128, 16
    pol = Policy(gbs=gbs, nb=nb)  # everything on the gpu tier: compute-bound
    res = simulate(OPT30, prof, pol, get_workload(f"fixed:{s}:{n}"), num_requests=gbs * nb * n_blocks)
    bls = gbs * nb
    t_pre, t_gen = flexgen_comp(OPT30, bls, s, s + n / 2, prof)
    head = gbs * 2 * OPT30.vocab_size * OPT30.hidden / prof.mm_flops  # LM head per GPU batch per step
    block = OPT30.num_layers * (t_pre + t_gen * (n - 1)) + n * nb * head
    assert res.wall_s == pytest.approx(n_blocks * block, rel=1e-9)
    assert res.latency_p50_s == pytest.approx(block, rel=1e-9)  # all rows of a block finish together
    assert res.latency_max_s == pytest.approx(block, rel=1e-9)
    assert res.latency_p99_length_s == pytest.approx(block, rel=1e-9)
    assert res.throughput_tokens_per_s == pytest.approx(n * bls / block, rel=1e-9)
    assert res.padded_throughput_tokens_per_s == pytest.approx((s + n) * bls / block, rel=1e-9)


def test_fixed_workload_reproduces_flexgen_closed_form_io_bound():
    """Weights on disk: Tpre = Tgen = max(dtoc, ctog, compute) with A.3's weight terms."""
    prof = t4_like()
    s, n, gbs, nb = 64, 8, 4, 2
    pol = Policy(gbs=gbs, nb=nb, wg=0.0, wc=0.0, wd=1.0)
    res = simulate(OPT30, prof, pol, get_workload(f"fixed:{s}:{n}"), num_requests=gbs * nb)
    w = OPT30.weight_bytes_per_layer
    dtoc, ctog = w / (2 * GB), w / (12 * GB)
    pre_c, gen_c = flexgen_comp(OPT30, gbs * nb, s, s + n / 2, prof)
    t_pre, t_gen = max(dtoc, ctog, pre_c), max(dtoc, ctog, gen_c)
    assert t_gen == dtoc  # disk-bound: the step time is the disk read of one layer
    head = gbs * 2 * OPT30.vocab_size * OPT30.hidden / prof.mm_flops
    expected = OPT30.num_layers * (t_pre + t_gen * (n - 1)) + n * nb * head
    assert res.wall_s == pytest.approx(expected, rel=1e-9)
    assert res.busy_s["dtoc"] == pytest.approx(OPT30.num_layers * n * dtoc, rel=1e-9)
    assert res.stall_s > 0.9 * res.wall_s  # the compute device mostly waits for the disk


def test_hand_worked_timeline_with_early_termination():
    """Two requests in one GPU batch: padding, shrinking batch and growing context by hand."""
    prof = t4_like()
    pol = Policy(gbs=2, nb=1)
    w = get_workload("fixed:8:8")  # only used for its p99 length; requests given explicitly
    res, tl = simulate_timeline(OPT30, prof, pol, w, requests=([3, 5], [1, 3]))
    assert tl.prefill_rows.tolist() == [[2]] and tl.prefill_len.tolist() == [[5]]
    assert tl.decode_rows[0, 0, :].tolist() == [1, 1]  # the 1-token request left after prefill
    assert tl.decode_len[0, 0, :].tolist() == [6, 7]  # context of the remaining row only
    cm = CostModel.for_policy(OPT30, prof, pol)
    pre = cm.block_step("prefill", np.array([2]), np.array([5]), pol.placement(), np.array([1]), 1)
    d1 = cm.block_step("decode", np.array([1]), np.array([6]), pol.placement(), np.array([1]), 1)
    d2 = cm.block_step("decode", np.array([1]), np.array([7]), pol.placement(), np.array([1]), 1)
    assert tl.latency_s.tolist() == pytest.approx([float(pre.seconds), float(pre.seconds + d1.seconds + d2.seconds)])
    assert res.padded_prompt_tokens == 10 and res.prompt_tokens == 8 and res.generated_tokens == 4


def test_hand_worked_refill_timeline():
    """R=1, one slot: each request joins when the slot frees; a 1-token request ends at prefill."""
    pol = Policy(gbs=1, nb=1, refill_every=1, bucket=False)
    res, tl = simulate_timeline(OPT30, t4_like(), pol, get_workload("fixed:8:8"),
                                requests=([2, 3, 4], [2, 1, 3]))
    assert tl.schedule.join.tolist() == [0, 1, 2]
    assert tl.prefill_len[0, :].tolist() == [2, 3, 4, 0]
    assert tl.decode_rows[0, :, 0].tolist() == [1, 0, 1, 1]
    assert tl.decode_len[0, :, 0].tolist() == [3, 0, 5, 6]
    pre, dec = tl.prefill.seconds, tl.decode.seconds[:, 0]
    assert dec[1] == 0 and pre[3] == 0
    assert tl.latency_s.tolist() == pytest.approx([pre[0] + dec[0], pre[1], pre[2] + dec[2] + dec[3]])
    assert res.wall_s == pytest.approx(pre.sum() + dec.sum())


def test_the_p99_length_latency_is_that_of_a_typical_request_of_that_length():
    """ExeGPT's SLA (b): the latency of a request whose output is the workload's p99 length,
    averaged over the requests that long, here both (one slot: the second waits for the first).
    A mutation that counted only longer requests returned the slowest request's latency instead."""
    res, tl = simulate_timeline(OPT30, t4_like(), Policy(gbs=1, nb=1), get_workload("fixed:8:3"),
                                requests=([3, 9], [3, 3]))
    assert res.p99_output_len == 3 and tl.latency_s[1] > 1.2 * tl.latency_s[0]
    assert res.latency_p99_length_s == pytest.approx(tl.latency_s.mean(), rel=1e-9)


def test_a_job_too_small_to_hold_a_p99_length_request_extends_its_longest_one():
    """With no request as long as the p99 length (8 requests of G), the p99-length latency was
    the longest request's, a request of 339 tokens named as one of 417 (an audit): it now runs the
    longest on at the mean seconds per decode step it took, and so exceeds every request's latency."""
    short, tl = simulate_timeline(OPT30, t4_like(), Policy(gbs=1, nb=1), get_workload("fixed:8:9"),
                                  requests=([8, 8], [3, 5]))
    longest = tl.latency_s[1]
    per_step = (longest - tl.prefill.seconds[tl.schedule.join[1]]) / 4
    assert short.p99_output_len == 9 and short.latency_max_s == pytest.approx(longest)
    assert short.latency_p99_length_s == pytest.approx(longest + 4 * per_step, rel=1e-9)


def test_no_request_outlasts_its_job_on_either_path():
    """The analytic path's latency spread, fitted to large jobs, gave the one request of a
    1-request job a p99 of twice the job's wall time (an audit)."""
    for requests in (1, 3):
        for sim in (simulate, simulate_analytic):
            res = sim(OPT30, t4_like(), Policy(gbs=8, nb=2), get_workload("G"), requests)
            assert res.latency_p50_s <= res.latency_p99_s <= res.latency_max_s <= res.wall_s * (1 + 1e-12), \
                (sim.__name__, requests, res.latency_max_s, res.wall_s)


# --------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("refill", [0, 3])
def test_every_request_completes_and_tokens_add_up(refill):
    w = get_workload("T@0.25")
    pol = offload_policy(gbs=8, nb=3, refill_every=refill)
    prompt, output = w.sample(500, seed=5)
    res, tl = simulate_timeline(OPT30, t4_like(), pol, w, requests=(prompt, output))
    assert len(tl.latency_s) == 500 and np.all(np.isfinite(tl.latency_s)) and np.all(tl.latency_s > 0)
    # Each step makes one token per active row: prefill makes the first, decode steps the rest.
    assert tl.prefill_rows.sum() + tl.decode_rows.sum() == output.sum() == res.generated_tokens
    assert tl.prefill_rows.sum() == 500
    assert res.prompt_tokens == prompt.sum() and res.padded_prompt_tokens >= prompt.sum()
    assert res.latency_max_s <= res.wall_s
    # Longer outputs of the same interval finish later.
    same = tl.schedule.join == tl.schedule.join[0]
    order = np.argsort(output[same], kind="stable")
    assert np.all(np.diff(tl.latency_s[same][order]) >= -1e-12)


def test_same_seed_same_result_and_seed_matters():
    w = get_workload("C1")
    pol = offload_policy(refill_every=4)
    a = simulate(OPT30, t4_like(), pol, w, num_requests=400, seed=3)
    b = simulate(OPT30, t4_like(), pol, w, num_requests=400, seed=3)
    c = simulate(OPT30, t4_like(), pol, w, num_requests=400, seed=4)
    assert a == b
    assert a.latency_p99_s != c.latency_p99_s
    assert a.to_json() == type(a).from_json(a.to_json()).to_json()


def test_throughput_and_latency_monotone_in_gbs_and_nb_when_io_bound():
    """ExeGPT Table 5: within 5% tolerance, bigger batches raise throughput and latency."""
    w = get_workload("G@0.25")
    tol = 0.05
    grid = {}
    for gbs in (2, 4, 8, 16):
        for nb in (1, 2, 4, 8):
            r = simulate(OPT30, t4_like(), offload_policy(gbs=gbs, nb=nb), w, num_requests=512, seed=1)
            grid[gbs, nb] = (r.throughput_tokens_per_s, r.latency_p99_s)
    violations = 0
    for (gbs, nb), (tput, lat) in grid.items():
        for nxt in ((gbs * 2, nb), (gbs, nb * 2)):
            if nxt in grid:
                t2, l2 = grid[nxt]
                violations += t2 < tput * (1 - tol)
                violations += l2 < lat * (1 - tol)
    assert violations == 0


def test_refill_keeps_batches_full_and_raises_throughput():
    w = get_workload("G@0.25")  # wide output distribution: early termination empties batches
    base = simulate(OPT30, t4_like(), offload_policy(gbs=16, nb=4), w, num_requests=1024, seed=2)
    refill = simulate(OPT30, t4_like(), offload_policy(gbs=16, nb=4, refill_every=4), w, num_requests=1024, seed=2)
    assert refill.throughput_tokens_per_s > 1.3 * base.throughput_tokens_per_s


def test_bucketing_cuts_padding():
    w = get_workload("S")  # prompts from 1 to 512 tokens
    args = dict(num_requests=1024, seed=1)
    sorted_ = simulate(OPT30, t4_like(), offload_policy(bucket=True), w, **args)
    unsorted = simulate(OPT30, t4_like(), offload_policy(bucket=False), w, **args)
    assert sorted_.prompt_tokens == unsorted.prompt_tokens
    assert sorted_.padded_prompt_tokens < 0.8 * unsorted.padded_prompt_tokens
    assert sorted_.prefill_s < unsorted.prefill_s


# --------------------------------------------------------------------------- memory
def test_explicit_attention_plans_its_float32_softmax():
    """A softcap (Gemma 2) or attention sinks (GPT-OSS) take attention off SDPA: the scores are
    held in the compute dtype and again as a float32 softmax, so the attention transients plan
    (3 x 2 + 8) bytes per score instead of SDPA's 2 x 2 in float16; the rest is unchanged."""
    from dataclasses import replace

    prof = t4_like()
    s, n, gbs, nb = 256, 32, 8, 2
    p = dict(wg=1.0, wc=0.0, wd=0.0, cg=1.0, cc=0.0, cd=0.0, hg=1.0, hc=0.0, hd=0.0)
    base = CostModel(OPT30, prof).memory(p, gbs, nb, s, n)["gpu"].transient
    for spec in (replace(OPT30, attention_softcap=50.0), replace(OPT30, attention_sinks=True)):
        got = CostModel(spec, prof).memory(p, gbs, nb, s, n)["gpu"].transient
        heads = OPT30.num_heads
        assert got["attention"] - base["attention"] == pytest.approx(gbs * heads * s * s * (14 - 4))
        assert got["attention_decode"] - base["attention_decode"] == pytest.approx(gbs * heads * (s + n) * (14 - 4))
        assert {k: v for k, v in got.items() if not k.startswith("attention")} == \
            {k: v for k, v in base.items() if not k.startswith("attention")}


def test_peak_memory_contains_flexgen_home_terms_and_grows_with_block():
    prof = t4_like()
    cm = CostModel(OPT30, prof)
    s, n, gbs, nb = 512, 32, 8, 4
    p = dict(wg=0.3, wc=0.5, wd=0.2, cg=0.25, cc=0.5, cd=0.25, hg=0.5, hc=0.5, hd=0.0)
    mem = cm.memory(p, gbs, nb, s, n)
    h1, L, bls = OPT30.hidden, OPT30.num_layers, gbs * nb
    w = OPT30.weight_bytes_per_layer
    # FlexGen A.3 home terms (fp16): weights, activations 2*s*h1*bls, KV 4*(s+n)*h1*bls*l
    assert mem["gpu"].resident["weights_home"] == pytest.approx(0.3 * w * L)
    assert mem["gpu"].resident["act_home"] == pytest.approx(0.5 * 2 * s * h1 * bls)
    assert mem["gpu"].resident["kv_home"] == pytest.approx(0.25 * 4 * (s + n) * h1 * bls * L)
    assert mem["cpu"].resident["kv_home"] == pytest.approx(0.5 * 4 * (s + n) * h1 * bls * L)
    w_record = -(-w // 4096) * 4096  # a disk-resident layer is one 4 KiB-aligned O_DIRECT record
    assert mem["disk"].peak_bytes() == pytest.approx(0.2 * w_record * L + 0.25 * 4 * (s + n) * h1 * bls * L)
    # Double-buffered weight fetch: whole layers, two slots once two or more layers are offloaded.
    assert mem["gpu"].resident["weight_stage"] == pytest.approx(2 * w)
    peaks = []
    for g, b in ((4, 1), (8, 1), (8, 2), (16, 2), (16, 4)):
        peaks.append(CostModel(OPT30, prof).peak_bytes(Policy(gbs=g, nb=b, **p), s, n))
    for tier in ("gpu", "cpu", "disk"):
        seq = [pk[tier] for pk in peaks]
        assert seq == sorted(seq) and seq[-1] > seq[0]


def test_compression_shrinks_stored_bytes_and_adds_dequant_buffers():
    assert compression_ratio(2) == pytest.approx((4 + 2 * 16 / 64) / 16)
    prof = t4_like()
    pol = Policy(gbs=8, nb=2, wg=0.0, wc=1.0, wd=0.0, cg=0.0, cc=1.0, cd=0.0)
    plain = CostModel.for_policy(OPT30, prof, pol)
    packed = CostModel.for_policy(OPT30, prof, replace(pol, compress_weight=True, compress_cache=True))
    mp, mc = plain.memory(pol.placement(), 8, 2, 256, 64), packed.memory(pol.placement(), 8, 2, 256, 64)
    assert mc["cpu"].resident["kv_home"] == pytest.approx(mp["cpu"].resident["kv_home"] * compression_ratio(2))
    assert mc["gpu"].resident["weight_dequant"] == OPT30.matmul_params_per_layer * 2
    assert mc["gpu"].resident["kv_dequant"] > 0 and mp["gpu"].resident["kv_dequant"] == 0
    wp, wc_ = plain.weight_terms(pol.placement()), packed.weight_terms(pol.placement())
    assert wc_.ctog < 0.3 * wp.ctog
    assert wc_.dequant == pytest.approx(OPT30.matmul_params_per_layer * 2 / prof.dequant_bytes_per_s)
    bp = plain.batch_terms("decode", 8, 300, pol.placement())
    bc = packed.batch_terms("decode", 8, 300, pol.placement())
    assert bc.ctog == pytest.approx(bp.ctog * compression_ratio(2))
    assert bc.dequant == pytest.approx(8 * 300 * OPT30.kv_bytes_per_token_per_layer / prof.dequant_bytes_per_s)
    with pytest.raises(UserError, match="compress_cache with cpu_attention"):
        CostModel(OPT30, prof, compress_cache=True, cpu_attention=True)


def test_a_windowed_layers_decode_is_priced_over_its_window_only():
    """The runner loads and attends to a windowed layer's last ``sliding_window`` positions only,
    so a decode step at context ``T`` costs what an unwindowed model's does at ``min(T, W)``, averaged
    over the layers (Gemma 2 windows every other one); prefill's attention is priced over the keys
    its bands score (``ModelSpec.prefill_context``), its projections as the unwindowed model's."""
    base = get_model_spec("smollm2-135m").with_dtype("float32")
    every = replace(base, sliding_window=256)
    half = replace(every, window_layers=tuple(i % 2 == 0 for i in range(base.num_layers)))
    assert every.decode_context(100) == 100 and every.decode_context(1000) == 256
    assert half.decode_context(1000) == pytest.approx(628.0)
    assert list(half.decode_context(np.array([100.0, 1000.0]))) == pytest.approx([100.0, 628.0])
    # bands of 256 queries: 256^2 + 2 x 256 (255 + 256) + 232 (255 + 232) scores over 1000 queries
    banded = (256 ** 2 + 2 * 256 * 511 + 232 * 487) / 1000
    assert every.prefill_context(100) == 100 and every.prefill_context(1000) == pytest.approx(banded)
    assert list(half.prefill_context(np.array([0.0, 100.0, 1000.0]))) == pytest.approx([0.0, 100.0, (1000 + banded) / 2])
    assert every.prefill_context(0) == 0
    for pol in (Policy(gbs=8, nb=1, wg=1.0, cg=0.0, cc=1.0),  # the cache comes to the device
                Policy(gbs=8, nb=1, wg=1.0, cg=0.0, cc=1.0, cpu_attention=True)):  # attends on the host
        for spec in (every, half):
            windowed = CostModel.for_policy(spec, t4_like(), pol)
            plain = CostModel.for_policy(base, t4_like(), pol)
            got = windowed.batch_terms("decode", 8, 1000, pol.placement()).as_dict()
            assert got == pytest.approx(plain.batch_terms("decode", 8, spec.decode_context(1000),
                                                          pol.placement()).as_dict())
            assert got != pytest.approx(plain.batch_terms("decode", 8, 1000, pol.placement()).as_dict())
            w_other, w_attn = windowed._compute_parts("prefill", 8, 1000)
            p_other, p_attn = plain._compute_parts("prefill", 8, 1000)
            assert w_other == pytest.approx(p_other)
            assert w_attn == pytest.approx(p_attn * spec.prefill_context(1000) / 1000) and w_attn < p_attn
    feats = layer_features(half, "decode", 8, 1000)
    assert feats["kv_bytes"] == pytest.approx(8 * 628 * base.kv_bytes_per_token_per_layer)


def test_a_4bit_cache_on_a_cpu_attends_over_its_codes_without_a_dequant_buffer():
    """On a CPU host the engine attends over the 4-bit codes (xrunner.kvattend): the plan has no
    kv_dequant buffer, and decode attention is priced from the profile's kv_attend probe (per query
    head) as compute, in place of a dequantize pass plus attention; a profile without the probe keeps
    the old price."""
    spec = get_model_spec("smollm2-135m").with_dtype("float32")  # 9 query heads share 3 kv heads
    pol = Policy(gbs=8, nb=1, compress_cache=True)
    old = cpu_host()
    new = cpu_host(kv_attend_bytes_per_s=16 * GB)
    mem_old = CostModel.for_policy(spec, old, pol).memory(pol.placement(), 8, 1, 64, 32)
    mem_gpu = CostModel.for_policy(spec, t4_like(), pol).memory(pol.placement(), 8, 1, 64, 32)
    assert mem_old["gpu"].resident["kv_dequant"] == 0 and mem_gpu["gpu"].resident["kv_dequant"] > 0
    kv_ctx = 8 * 100 * spec.kv_bytes_per_token_per_layer
    fused = CostModel.for_policy(spec, new, pol).batch_terms("decode", 8, 100, pol.placement())
    kernel_s = kv_ctx * 3 / (16 * GB)
    assert fused.dequant == 0.0  # a compute kernel, not a dequantization
    before = CostModel.for_policy(spec, old, pol).batch_terms("decode", 8, 100, pol.placement())
    assert before.dequant == pytest.approx(kv_ctx / old.dequant_bytes_per_s)
    # the fused price replaces the float attention: compute without it is cheaper by that less the kernel
    plain = CostModel.for_policy(spec, new, replace(pol, compress_cache=False))
    _, attn_s = plain._compute_parts("decode", 8, 100)
    assert attn_s > 0
    assert before.gpu_compute - fused.gpu_compute == pytest.approx(attn_s - kernel_s)
    # the gpu_compute factor scales the kernel with the rest; the codec's fixed cost is added per call
    cal = replace(new, calibration={"gpu_compute": 2.0, "kv_codec_overhead_s": 1e-3})
    scaled = CostModel.for_policy(spec, cal, pol).batch_terms("decode", 8, 100, pol.placement())
    assert scaled.gpu_compute == pytest.approx(2 * fused.gpu_compute + 1e-3)
    prefill = CostModel.for_policy(spec, cal, pol).batch_terms("prefill", 8, 100, pol.placement())
    base_prefill = CostModel.for_policy(spec, new, pol).batch_terms("prefill", 8, 100, pol.placement())
    assert prefill.gpu_compute == pytest.approx(2 * base_prefill.gpu_compute)  # no codec call in a prefill


def test_a_half_precision_4bit_cache_on_a_cpu_is_priced_and_planned_as_the_fused_kernel():
    """A bfloat16 model's 4-bit cache on a CPU takes the fused kernel too: no kv_dequant buffer,
    the kernel's price per context byte (the profile's probe counts bytes in the compute dtype), and
    decode attention's scratch holds the float32 query and outputs plus the cache's mins and scales
    converted to float32 (4 bytes per group value, two per group, for K and V)."""
    spec = get_model_spec("smollm2-135m").with_dtype("bfloat16")
    pol = Policy(gbs=8, nb=1, compress_cache=True)
    prof = cpu_host(kv_attend_bytes_per_s=16 * GB)
    cm = CostModel.for_policy(spec, prof, pol)
    assert cm.fused_kv
    mem = cm.memory(pol.placement(), 8, 1, 64, 32)
    assert mem["gpu"].resident["kv_dequant"] == 0
    ctx, groups = 64 + 32, spec.num_kv_heads * -(-spec.head_dim // 64)
    context = ctx * spec.kv_bytes_per_token_per_layer * cm.kv_stored_ratio
    want = 8 * (8 * spec.q_dim * 4 + context + ctx * 2 * groups * 2 * 4)
    assert mem["gpu"].transient["attention_decode"] == pytest.approx(want)
    kv_ctx = 8 * 100 * spec.kv_bytes_per_token_per_layer
    plain = CostModel.for_policy(spec, prof, replace(pol, compress_cache=False))
    other_s, _ = plain._compute_parts("decode", 8, 100)
    fused = cm.batch_terms("decode", 8, 100, pol.placement())
    assert fused.dequant == 0.0 and fused.gpu_compute > other_s + kv_ctx * 3 / (16 * GB) * 0.999


def test_cpu_attention_is_priced_from_the_profiles_probe_of_it_when_it_has_one():
    """Delegated decode attention costs the cache's stored bytes at the profile's measured rate
    (one query head per kv head; a grouped-query model repeats it per query head of a group);
    a profile without the probe keeps the host's float32 roofline."""
    spec = get_model_spec("smollm2-135m").with_dtype("bfloat16")  # 9 query heads per 3 kv heads
    pol = Policy(gbs=8, nb=1, cg=0.0, cc=1.0, cpu_attention=True)
    rows, length = 8, 100
    kv_ctx = rows * length * spec.kv_bytes_per_token_per_layer
    probed = CostModel.for_policy(spec, cpu_host(cpu_attend_bytes_per_s=2 * GB), pol)
    roof = CostModel.for_policy(spec, cpu_host(cpu_mem_bytes_per_s=10 * GB), pol)
    got = probed.batch_terms("decode", rows, length, pol.placement()).cpu_compute
    assert got == pytest.approx(kv_ctx * 3 / (2 * GB))
    flops = rows * spec.attention_flops_per_token(length)
    want = max(flops / roof.profile.cpu_bmm_flops, kv_ctx / roof.profile.cpu_mem_bytes_per_s)
    assert roof.batch_terms("decode", rows, length, pol.placement()).cpu_compute == pytest.approx(want)


def test_cpu_attention_adds_its_fixed_cost_once_per_call_not_per_byte():
    """``cpu_attention_overhead_s`` is paid once per layer, GPU batch and tier whose rows attend on
    the CPU (a batch split over the cpu and disk tiers makes two calls), whatever the context; the
    bytes' share scales with the context alone. Without offloaded rows there is no call."""
    spec = get_model_spec("smollm2-135m").with_dtype("bfloat16")
    pol = Policy(gbs=8, nb=1, cg=0.0, cc=1.0, cpu_attention=True)
    over = 2e-4
    bare = cpu_host(cpu_attend_bytes_per_s=2 * GB)
    cal = replace(bare, calibration={"cpu_attention_overhead_s": over, "cpu_compute": 1.5})

    def cpu_s(prof, length, **place):
        cm = CostModel.for_policy(spec, prof, replace(pol, **place))
        return cm.batch_terms("decode", 8, length, replace(pol, **place).placement()).cpu_compute

    for length in (40, 400):
        assert cpu_s(cal, length) == pytest.approx(1.5 * cpu_s(bare, length) + over)
    assert cpu_s(cal, 400) - over == pytest.approx(10 * (cpu_s(cal, 40) - over))
    assert cpu_s(cal, 100, cc=0.5, cd=0.5) == pytest.approx(1.5 * cpu_s(bare, 100, cc=0.5, cd=0.5) + 2 * over)
    assert cpu_s(cal, 100, cg=1.0, cc=0.0) == 0.0
    split = replace(pol, cc=0.5, cd=0.5)  # a placement of numpy scalars counts calls alike
    as_np = {k: np.float32(v) for k, v in split.placement().items()}
    assert CostModel.for_policy(spec, cal, split).batch_terms("decode", 8, 100, as_np).cpu_compute == pytest.approx(
        cpu_s(cal, 100, cc=0.5, cd=0.5), rel=1e-6)


def test_4bit_experts_are_priced_as_dequantized_only_where_the_steps_tokens_reach():
    """With 4-bit weights a layer step dequantizes every projection but the routed experts, and of
    those the ones its tokens are expected to reach (``stored_forms.LayerWeights``): one decode row
    of qwen3-30b-a3b reaches 8 of 128 experts, a 64-row block of 4 GPU batches nearly all, a prefill
    all. A dense model's price does not depend on the tokens."""
    spec = get_model_spec("qwen3-30b-a3b").with_dtype("bfloat16")
    prof = cpu_host()
    pol = Policy(gbs=1, nb=1, wg=0.0, wc=1.0, compress_weight=True)
    cm = CostModel.for_policy(spec, prof, pol)
    expert = spec.expert_params * 2
    dense_part = cm.layer_matmul_bytes - spec.num_experts * expert
    assert cm.dequant_bytes(1) == pytest.approx(dense_part + 8 * expert)
    assert cm.dequant_bytes(None) == cm.layer_matmul_bytes
    rate = prof.dequant_bytes_per_s
    for phase, rows, length, nb, want in [("decode", 1, 300, 1, dense_part + 8 * expert),
                                          ("decode", 16, 300, 4, dense_part + spec.experts_reached(64) * expert),
                                          ("prefill", 1, 300, 1, cm.layer_matmul_bytes)]:
        assert cm.layer_terms(phase, rows, length, pol.placement(), nb).dequant == pytest.approx(want / rate)
        on = np.ones(nb)
        step = cm.block_step(phase, np.full(nb, rows), np.full(nb, length), pol.placement(), on, 1.0)
        assert step.terms.dequant == pytest.approx(want / rate)
    assert spec.experts_reached(64) > 0.95 * spec.num_experts
    dense = CostModel.for_policy(get_model_spec("smollm2-135m"), prof, pol)
    assert dense.layer_terms("decode", 1, 300, pol.placement(), 1).dequant == pytest.approx(
        dense.layer_matmul_bytes / rate)


def test_both_simulators_dequantize_the_experts_each_steps_tokens_reach():
    """Fixed lengths, 2 rows per block: each layer step of a prefill dequantizes what 64 prompt
    tokens reach, each of the 7 decode steps what 2 rows reach; the discrete-event and analytic
    simulators book exactly that (enough blocks that the discrete-event one prices its decode steps
    from its table of distinct batch shapes, ``price_steps``)."""
    spec = get_model_spec("qwen3-30b-a3b").with_dtype("bfloat16")
    prof = cpu_host()
    pol = Policy(gbs=2, nb=1, wg=0.0, wc=1.0, compress_weight=True)
    cm = CostModel.for_policy(spec, prof, pol)
    blocks = 100
    want = blocks * spec.num_layers * (cm.dequant_bytes(64) + 7 * cm.dequant_bytes(2)) / prof.dequant_bytes_per_s
    assert want < 0.3 * blocks * spec.num_layers * 8 * cm.dequant_bytes(None) / prof.dequant_bytes_per_s
    w = get_workload("fixed:32:8")
    for sim in (simulate, simulate_analytic):
        assert sim(spec, prof, pol, w, num_requests=2 * blocks).busy_s["dequant"] == pytest.approx(want, rel=1e-9)


def test_batches_that_reread_a_cached_layer_save_what_the_warm_fit_measured():
    """On a CPU a block's later GPU batches reread the layer its first batch just read, and with
    4-bit weights every batch reads the buffer the layer was just dequantized into: their decode
    steps save ``WarmFit.saved_s`` (never below half the attention-free time). Prefill, a block
    of one plain batch and a GPU keep the cold price."""
    from xprofiler.profile import WarmFit

    spec = get_model_spec("opt-125m").with_dtype("float32")
    warm = WarmFit(spec.name, "float32", rows=(1, 8), saved_s=(4e-4, 1e-3))
    plain, with_fit = cpu_host(), cpu_host(warm_fits=(warm,))
    p = Policy(gbs=8, nb=2).placement()

    def decode_s(prof, **kw):
        return CostModel.for_policy(spec, prof, Policy(gbs=8, **kw)).batch_terms("decode", 8, 100, p).gpu_compute

    cold = decode_s(plain, nb=2)
    assert decode_s(with_fit, nb=1) == pytest.approx(cold)
    assert decode_s(with_fit, nb=2) == pytest.approx(cold - 0.5 * 1e-3)
    assert decode_s(with_fit, nb=4) == pytest.approx(cold - 0.75 * 1e-3)
    cold_q = decode_s(plain, nb=1, compress_weight=True)
    rotation = CostModel.for_policy(spec, plain, Policy(gbs=8, nb=1, compress_weight=True))._rotation_factor
    assert decode_s(with_fit, nb=1, compress_weight=True) == pytest.approx(cold_q - 1e-3 * rotation)
    other_s, _ = CostModel.for_policy(spec, plain, Policy(gbs=8, nb=2))._compute_parts("decode", 8, 100)
    huge = cpu_host(warm_fits=(replace(warm, saved_s=(1.0, 1.0)),))
    assert decode_s(huge, nb=2) == pytest.approx(cold - 0.5 * other_s)
    pre = CostModel.for_policy(spec, with_fit, Policy(gbs=8, nb=2)).batch_terms("prefill", 8, 32, p)
    assert pre.gpu_compute == pytest.approx(CostModel.for_policy(spec, plain, Policy(gbs=8, nb=2))
                                            .batch_terms("prefill", 8, 32, p).gpu_compute)
    gpu = replace(t4_like(), warm_fits=(warm,))
    assert decode_s(gpu, nb=2) == pytest.approx(decode_s(t4_like(), nb=2))


# --------------------------------------------------------------------------- cost model details
def test_disk_kv_and_activation_rows_priced_per_row_transfer():
    """Disk rows move one row and KV part at a time: each read pays the profile's latency, a store one
    sync. Hidden states move between layers only (L - 1 of L layers), so their share is scaled."""
    p = dict(wg=1.0, wc=0.0, wd=0.0, cg=0.0, cc=0.0, cd=1.0, hg=0.0, hc=0.0, hd=1.0)
    base = t4_like()
    slow = replace(base, disk_row_write_s=1e-4, disk_row_read_s=4e-4, disk_sync_s=1e-3)
    between = (OPT30.num_layers - 1) / OPT30.num_layers
    for compress, parts in ((False, 2), (True, 6)):
        for phase in ("prefill", "decode"):
            b = CostModel(OPT30, base, compress_cache=compress).batch_terms(phase, 8, 300, p)
            s = CostModel(OPT30, slow, compress_cache=compress).batch_terms(phase, 8, 300, p)
            # a row write per KV part and activation row; one flush per kind (KV cache, activations)
            assert s.ctod - b.ctod == pytest.approx(8 * parts * 1e-4 + 1e-3 + between * (8 * 1e-4 + 1e-3))
            kv_reads = parts if phase == "decode" else 0  # prefill reads no cache
            assert s.dtoc - b.dtoc == pytest.approx(8 * (kv_reads + between) * 4e-4)
    # bytes are priced at the size of one row's transfer, not of the whole batch's
    act = 8 * 300 * OPT30.hidden * 2
    one = CostModel(OPT30, base).batch_terms("prefill", 8, 300, dict(p, cd=0.0))
    assert one.dtoc == pytest.approx(between * act / bandwidth_at(base.dtoc, act / 8))


def test_disk_reads_slow_the_compute_beside_them_by_the_calibrated_fraction():
    prof = cpu_host()
    p = dict(wg=0.5, wc=0.0, wd=0.5, cg=0.0, cc=0.0, cd=1.0, hg=1.0, hc=0.0, hd=0.0)
    plain = CostModel(OPT30, prof)
    slowed = CostModel(OPT30, replace(prof, calibration={"disk_interference": 0.25}))
    for terms in (lambda m: m.weight_terms(p), lambda m: m.batch_terms("decode", 8, 300, p)):
        a, b = terms(plain), terms(slowed)
        assert a.dtoc > 0 and b.dtoc == a.dtoc
        assert b.gpu_compute - a.gpu_compute == pytest.approx(0.25 * a.dtoc)
    with pytest.raises(UserError, match="unknown term"):
        CostModel(OPT30, replace(prof, calibration={"disk_interferense": 0.25}))


def test_copies_between_cpu_and_gpu_tiers_slow_the_compute_beside_them_by_the_calibrated_fraction():
    """On a host without CUDA the cpu <-> gpu tier copies are memcpys on the engine's I/O threads:
    ``copy_interference`` adds that fraction of their seconds (ctog and gtoc, not disk) to compute."""
    prof = cpu_host()
    p = dict(wg=0.5, wc=0.5, wd=0.0, cg=0.0, cc=1.0, cd=0.0, hg=0.0, hc=1.0, hd=0.0)
    plain = CostModel(OPT30, prof)
    slowed = CostModel(OPT30, replace(prof, calibration={"copy_interference": 0.3, "disk_interference": 0.9}))
    w_a, w_b = plain.weight_terms(p), slowed.weight_terms(p)
    assert w_a.ctog > 0 and w_b.gpu_compute - w_a.gpu_compute == pytest.approx(0.3 * w_a.ctog)
    b_a, b_b = plain.batch_terms("decode", 8, 300, p), slowed.batch_terms("decode", 8, 300, p)
    assert b_a.ctog > 0 and b_a.gtoc > 0 and b_a.dtoc == 0
    assert b_b.gpu_compute - b_a.gpu_compute == pytest.approx(0.3 * (b_a.ctog + b_a.gtoc))


def test_layers_on_different_weight_tiers_are_priced_apart():
    """The runner puts whole layers on a tier, so a step lasts the sum over layers of each one's
    max(compute, its own fetch), not L x the max over the average layer's terms (FlexGen's model,
    which splits every layer): reference computed per layer from the bandwidths."""
    for prof in (t4_like(), cpu_host()):
        cm = CostModel(OPT30, prof)
        p = dict(wg=0.5, wc=0.25, wd=0.25, cg=1.0, cc=0.0, cd=0.0, hg=1.0, hc=0.0, hd=0.0)
        batch = cm.batch_terms("prefill", 4, 64, p)
        w = cm.layer_stored_bytes
        ctog, dtoc = w / bandwidth_at(prof.ctog, w), w / bandwidth_at(prof.dtoc, w)
        cuda = prof.compute_device == "cuda"
        fetch = {"gpu": (0.0, 0.0), "cpu": (ctog, 0.0), "disk": (ctog if cuda else 0.0, dtoc)}
        tiers = ["gpu"] * 24 + ["cpu"] * 12 + ["disk"] * 12  # OPT-30B's 48 layers, as the runner splits them
        ref = 0.0
        for tier in tiers:
            c, d = fetch[tier]
            if cuda:
                ref += max(batch.gpu_compute, batch.ctog + c, batch.gtoc, batch.dtoc + d, batch.ctod)
            else:  # host copies share the cores with compute
                ref += max(batch.gpu_compute + batch.ctog + batch.gtoc + c, batch.dtoc + d, batch.ctod)
        head = cm.head_seconds("prefill", 4, 64)
        step = cm.block_step("prefill", 4, 64, p, 1.0, 1.0)
        assert step.seconds == pytest.approx(ref + head, rel=1e-9)
        averaged = OPT30.num_layers * cm.layer_seconds(batch + cm.weight_terms(p)) + head
        if cuda:  # (the CPU host computes OPT-30B for minutes a step: no layer waits on its read there)
            assert step.seconds > 1.05 * averaged  # the disk layers wait on their reads, the others do not
        assert step.terms.dtoc == pytest.approx(0.25 * dtoc)  # the mean layer's terms are unchanged
    # <= 2 offloaded layers stay in the stage slots: nothing is fetched per step, one price for all
    few = dict(p, wg=46 / 48, wc=1 / 48, wd=1 / 48)
    assert CostModel(OPT30, t4_like()).weight_tier_terms(few) == [(1.0, CostModel(OPT30, t4_like()).weight_terms(few))]


def test_decode_prices_the_rows_left_of_a_partly_finished_batch_as_the_engine_attends_them():
    """Two or more rows left of a GPU batch's slots are no contiguous range of the cache. The
    engine attends in place over their span when they fill a third of it (the idle slots cost
    attention, on the device or, with CPU attention over the cpu tier, on the CPU; the span is
    the expected range of the rows), else it copies their context out first (``_take``: three
    times the bytes at the memory roof on a CPU), as a 4-bit cache always does. One row or a
    full batch is a view."""
    prof = cpu_host(mem_bytes_per_s=15 * GB, cpu_mem_bytes_per_s=15 * GB)
    p = dict(wg=1.0, wc=0.0, wd=0.0, cg=0.75, cc=0.25, cd=0.0, hg=1.0, hc=0.0, hd=0.0)
    rows = np.array([1, 2, 9, 15, 16])
    kv = rows * 300 * OPT30.kv_bytes_per_token_per_layer
    scattered = (rows > 1) & (rows < 16)
    span = 17 * (rows - 1) / (rows + 1) + 1  # expected range of `rows` random slots of 16
    assert list(span[scattered] <= 3 * rows[scattered]) == [False, True, True]  # 2 rows: span 6.7 > 6

    bare = CostModel(OPT30, prof, cpu_attention=True)
    slotted = replace(bare, slots=16)
    a, b = bare.batch_terms("decode", rows, 300, p), slotted.batch_terms("decode", rows, 300, p)
    idle = bare._compute_parts("decode", span, 300)[1] - bare._compute_parts("decode", rows, 300)[1]
    gather = 3 * kv / prof.mem_bytes_per_s
    want = np.where(scattered, np.where(span <= 3 * rows, idle, gather), 0.0)
    assert np.allclose(b.gpu_compute - a.gpu_compute, 0.75 * want)
    assert np.all(want[2:4] > 0) and want[1] == pytest.approx(gather[1])
    cpu_attn = prof.compute_s("cpu_bmm", rows * OPT30.attention_flops_per_token(300), kv)
    cpu_gather = 3 * kv / prof.cpu_mem_bytes_per_s
    cpu_want = np.where(scattered, np.where(span <= 3 * rows, cpu_attn * (span - rows) / rows, cpu_gather), 0.0)
    assert np.allclose(b.cpu_compute - a.cpu_compute, 0.25 * cpu_want)
    assert np.all(cpu_want[2:4] > 0) and cpu_want[1] == pytest.approx(cpu_gather[1])

    packed = CostModel(OPT30, prof, compress_cache=True)  # 4-bit rows are always gathered
    kv4 = kv * packed.kv_stored_ratio
    q = dict(p, cg=1.0, cc=0.0)
    extra = replace(packed, slots=16).batch_terms("decode", rows, 300, q).gpu_compute \
        - packed.batch_terms("decode", rows, 300, q).gpu_compute
    assert np.allclose(extra, scattered * 3 * kv4 / prof.mem_bytes_per_s)
    # prefill writes the cache and attends over whole rows; the policy's gbs is the slot count
    assert slotted.batch_terms("prefill", 9, 300, p) == bare.batch_terms("prefill", 9, 300, p)
    assert CostModel.for_policy(OPT30, prof, Policy(gbs=24, nb=2)).slots == 24
    torch = pytest.importorskip("torch")
    from xrunner.engine import _take

    cache = torch.zeros(16, 2, 8, 4)
    assert _take(cache, [3, 4, 5])._base is cache and _take(cache, [7])._base is cache  # views
    assert _take(cache, [3, 5, 6])._base is None  # a copy


def test_cost_model_kv_parts_match_the_engines_stored_form():
    torch = pytest.importorskip("torch")
    from xrunner.stored_forms import KVCodec
    from xsimulator.costmodel import KV_PARTS, KV_PARTS_COMPRESSED

    assert len(KVCodec(64, torch.float32, compress=False).rests) == KV_PARTS
    assert len(KVCodec(64, torch.float32, compress=True).rests) == KV_PARTS_COMPRESSED


def test_cost_model_charges_the_output_rotation_of_the_weights_the_engine_rotates():
    """4-bit weights: the engine rotates whole groups of 64 output rows and rotates each output back
    (64 multiply-adds per output value), and rotates the MLP output projection's input per 512
    channels (8 + 64 per input value); the cost model adds exactly those flops to the matmuls'."""
    torch = pytest.importorskip("torch")
    from xrunner.stored_forms import WeightLayout
    from xsimulator.costmodel import rotation_flop_ratio

    odd = replace(OPT30, name="odd", hidden=1000, num_heads=8, num_kv_heads=8, head_dim=125, ffn=4096)
    rotated = {}
    for spec in (OPT30, odd):
        shapes = spec.layer_tensor_shapes()
        layout = WeightLayout(shapes, torch.float16, compress=True, rotate_inputs=True)
        rotated[spec.name] = layout.rotated
        assert layout.in_rotated == {"fc2.weight"}  # 4096 inputs: 8 blocks of 512
        extra = sum(shapes[n][0] * 64 for n in rotated[spec.name]) + sum(shapes[n][1] * (8 + 64)
                                                                          for n in layout.in_rotated)
        assert rotation_flop_ratio(spec) == pytest.approx(extra / spec.matmul_params_per_layer)
    assert rotated["odd"] == {"fc1.weight"}  # 1000-row tensors are not whole groups
    prof, p = t4_like(), dict(wg=1.0, wc=0.0, wd=0.0, cg=1.0, cc=0.0, cd=0.0, hg=1.0, hc=0.0, hd=0.0)
    plain = CostModel(OPT30, prof).batch_terms("decode", 16, 100, p).gpu_compute
    packed = CostModel(OPT30, prof, compress_weight=True).batch_terms("decode", 16, 100, p).gpu_compute
    matmuls, _attention = CostModel(OPT30, prof)._compute_parts("decode", 16, 100)
    assert packed - plain == pytest.approx(rotation_flop_ratio(OPT30) * matmuls)


def test_cpu_attention_moves_activations_instead_of_cache():
    prof = t4_like()
    p = dict(wg=1.0, wc=0.0, wd=0.0, cg=0.0, cc=1.0, cd=0.0, hg=1.0, hc=0.0, hd=0.0)
    gpu_attn = CostModel(OPT30, prof).batch_terms("decode", 16, 1000, p)
    cpu_attn = CostModel(OPT30, prof, cpu_attention=True).batch_terms("decode", 16, 1000, p)
    kv = 16 * 1000 * OPT30.kv_bytes_per_token_per_layer
    assert gpu_attn.ctog == pytest.approx(kv / (12 * GB))
    assert cpu_attn.ctog == pytest.approx(16 * OPT30.q_dim * 2 / (12 * GB))  # FlexGen §4.2: s x less I/O
    assert cpu_attn.cpu_compute == pytest.approx(16 * OPT30.attention_flops_per_token(1000) / prof.cpu_bmm_flops)
    assert cpu_attn.gpu_compute < gpu_attn.gpu_compute


def test_channel_combination_cuda_cpu_and_no_overlap():
    prof_cuda, prof_cpu = t4_like(), cpu_host()
    p = dict(wg=0.0, wc=1.0, wd=0.0, cg=1.0, cc=0.0, cd=0.0, hg=1.0, hc=0.0, hd=0.0)
    for prof, combine in ((prof_cuda, max), (prof_cpu, sum)):
        cm = CostModel(OPT30, prof)
        terms = cm.weight_terms(p) + cm.batch_terms("decode", 8, 200, p)
        compute = terms.gpu_compute
        assert cm.layer_seconds(terms) == pytest.approx(combine([compute, terms.ctog]))
    cm_serial = CostModel(OPT30, prof_cuda, overlap=False)
    t = cm_serial.weight_terms(p) + cm_serial.batch_terms("decode", 8, 200, p)
    assert cm_serial.layer_seconds(t) == pytest.approx(t.gpu_compute + t.ctog)


def test_bandwidth_curve_lookup_matches_profile_curve():
    curve = cpu_host().ctog
    sizes = np.array([100, 4096, 50_000, 1 << 20, 1 << 26])
    assert bandwidth_at(curve, sizes) == pytest.approx([curve.at(float(x)) for x in sizes])


def test_layer_fit_drives_compute_when_present():
    spec = get_model_spec("smollm2-135m")
    fit = LayerFit(model=spec.name, phase="decode", dtype=spec.dtype, features=("const", "tokens", "attn_flops"),
                   coef=(2e-4, 1e-6, 3e-13), n_samples=20, median_rel_error=0.01, max_rel_error=0.05)
    prof = cpu_host(layer_fits=(fit,))
    p = dict(wg=1.0, wc=0.0, wd=0.0, cg=1.0, cc=0.0, cd=0.0, hg=1.0, hc=0.0, hd=0.0)
    t = CostModel(spec, prof).batch_terms("decode", np.array([4, 8]), np.array([100, 300]), p)
    assert t.gpu_compute == pytest.approx(fit.predict_s(spec, np.array([4, 8]), np.array([100, 300])))
    # With CPU attention only the attention features move to the CPU side.
    q = dict(p, cg=0.25, cc=0.75)
    t2 = CostModel(spec, prof, cpu_attention=True).batch_terms("decode", 8, 300, q)
    feats = layer_features(spec, "decode", 8, 300)
    assert t2.gpu_compute == pytest.approx(2e-4 + 1e-6 * feats["tokens"] + 0.25 * 3e-13 * feats["attn_flops"])


def test_a_windowed_model_with_layer_fits_simulates_to_finite_times():
    """With refill the simulator prices idle batches at length 0 through the fits' features; a windowed
    model's banded prefill keys must come out 0 there, not NaN (stop 51's first banded pricing
    divided by the length, and calibrating the windowed model stopped on non-finite residuals)."""
    spec = replace(get_model_spec("smollm2-135m"), sliding_window=64)
    fits = tuple(LayerFit(model=spec.name, phase=phase, dtype=spec.dtype, features=("const", "tokens", "attn_flops"),
                          coef=(2e-4, 1e-6, 3e-13), n_samples=20, median_rel_error=0.01, max_rel_error=0.05)
                 for phase in ("prefill", "decode"))
    res = simulate(spec, cpu_host(layer_fits=fits), Policy(gbs=4, nb=2, refill_every=2), get_workload("C1@0.125"),
                   num_requests=12)
    assert np.isfinite(res.wall_s) and res.wall_s > 0 and np.isfinite(res.latency_p99_s)


def test_calibration_factors_and_overheads():
    pol = offload_policy(gbs=4, nb=2)
    w = get_workload("fixed:32:4")
    base = simulate(OPT30, t4_like(), pol, w, num_requests=8)
    slow_pcie = simulate(OPT30, t4_like(calibration={"ctog": 2.0}), pol, w, num_requests=8)
    assert slow_pcie.busy_s["ctog"] == pytest.approx(2 * base.busy_s["ctog"])
    over = simulate(OPT30, t4_like(calibration={"layer_overhead_s": 1e-3, "step_overhead_s": 0.01}), pol, w,
                    num_requests=8)
    steps, batches = 4, 2  # 1 prefill + 3 decode steps, 2 GPU batches each
    assert over.busy_s["head"] - base.busy_s["head"] == pytest.approx(steps * batches * 0.01)
    assert over.busy_s["gpu_compute"] - base.busy_s["gpu_compute"] == pytest.approx(
        steps * batches * OPT30.num_layers * 1e-3)
    with pytest.raises(UserError, match="unknown term"):
        CostModel(OPT30, t4_like(calibration={"pcie": 1.1}))


def test_one_row_lm_head_is_a_gemv_at_the_memory_roof_not_a_calibrated_gemm():
    """On a CPU a 1-row LM head is a matrix-vector product that reads the head weights once at the
    memory roof (the profiler measures the roof on such a product): about half the 2-row GEMM. The
    head factor fitted on few-row GEMMs must not price it; the decode layers' compute factor does."""
    spec = get_model_spec("opt-125m")
    prof = cpu_host(mem_bytes_per_s=11 * GB, calibration={"head": 1.8, "gpu_compute": 1.1})
    cm = CostModel(spec, prof)
    head_bytes = spec.vocab_size * spec.hidden * spec.dtype_bytes
    row_flops = spec.lm_head_flops_per_token()
    embed = spec.act_bytes_per_token / prof.mem_bytes_per_s  # one token's gather (no layer fit here)
    one, two = cm.head_seconds("decode", 1, 40), cm.head_seconds("decode", 2, 40)
    assert one == pytest.approx(1.1 * max(head_bytes / prof.mem_bytes_per_s, row_flops / prof.mm_flops)
                                + 1.8 * embed)
    assert two == pytest.approx(1.8 * (2 * row_flops / prof.mm_flops + head_bytes / prof.mem_bytes_per_s
                                       + 2 * embed))
    assert one < 0.6 * two
    # Arrays (the simulator's grids) and expected rows between 1 and 2 (the analytic path) agree.
    assert cm.head_seconds("decode", np.array([1, 2]), 40) == pytest.approx([one, two])
    assert one < cm.head_seconds("decode", 1.5, 40) < two
    # The head factor moves the 2-row head, the 1-row one only by its embedding gather.
    other = CostModel(spec, replace(prof, calibration={"head": 3.0, "gpu_compute": 1.1}))
    assert other.head_seconds("decode", 1, 40) - one == pytest.approx(1.2 * embed)
    assert other.head_seconds("decode", 2, 40) == pytest.approx(two * 3.0 / 1.8)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 3.3 deprecates its bundled CBC
def test_cost_model_is_affine_and_solvable_as_an_lp():
    """The scheduler's use: PuLP variables in, affine expressions out, minimax LP solves."""
    prof = t4_like()
    spec = OPT30
    cm = CostModel(spec, prof, cpu_attention=True)
    lp = pulp.LpProblem("placement", pulp.LpMinimize)
    x = {v: lp.add_variable(v, 0, 1) for v in PLACEMENT_VARS}
    gbs, nb, s, n = 8, 8, 256, 32
    pre = cm.layer_terms("prefill", gbs, s, x, nb)
    gen = cm.layer_terms("decode", gbs, s + n / 2, x, nb)
    assert isinstance(gen.ctog, pulp.LpAffineExpression)
    t_pre, t_gen = lp.add_variable("t_pre", 0), lp.add_variable("t_gen", 0)
    lp += (t_pre + (n - 1) * t_gen) * (1.0 / (gbs * nb))
    for g in cm.groups(pre):
        lp += t_pre >= g
    for g in cm.groups(gen):
        lp += t_gen >= g
    for trio in (("wg", "wc", "wd"), ("cg", "cc", "cd"), ("hg", "hc", "hd")):
        lp += pulp.lpSum(x[v] for v in trio) == 1
    for tier, mem in cm.memory(x, gbs, nb, s, n).items():
        for expr in mem.constraints():
            lp += expr <= prof.capacity_bytes(tier)
    assert lp.solve(pulp.PULP_CBC_CMD(msg=False)) == pulp.LpStatusOptimal
    sol = {v: x[v].value() for v in PLACEMENT_VARS}
    # The numeric model at the LP's placement gives the LP's step times and fits in memory.
    num_pre = step_seconds(cm.layer_terms("prefill", gbs, s, sol, nb), "cuda", True)
    num_gen = step_seconds(cm.layer_terms("decode", gbs, s + n / 2, sol, nb), "cuda", True)
    assert num_pre == pytest.approx(t_pre.value(), rel=1e-6)
    assert num_gen == pytest.approx(t_gen.value(), rel=1e-6)
    for tier, mem in cm.memory(sol, gbs, nb, s, n).items():
        assert mem.peak_bytes() <= prof.capacity_bytes(tier) * (1 + 1e-9)
    assert sol["wg"] < 1.0  # OPT-30B does not fit on a 15 GB gpu tier
    assert len(parallel_groups(pre, "cuda", True)) == 5


# --------------------------------------------------------------------------- analytic path
def _benchmark_cases() -> dict:
    """The (model, policy) cases of benchmarks/sim_speed.py: the agreement tested is the one benchmarked."""
    return load_benchmark("sim_speed").CASES


AGREEMENT_CASES = _benchmark_cases()  # I/O-bound offloading three ways and compute-bound small blocks
# Stated tolerance of the analytic path vs the discrete-event path at 3000 requests. Measured
# over seeds 1-5 x five presets x these four cases x refill 0/1/8 (300 jobs): throughput within
# 4.4%, mean latency 5.2%, p50 8.8%, p99 8.3%, p99-length 10.1% (worst: small blocks on the
# prefill-heavy preset S, where block-to-block variation is largest).
# Each bound sits just above its measured worst (one 0.12 for every quantile let a mutation that
# dropped the analytic path's latency spread through: p99 11.4% off on seed 1, against 4.7%).
THROUGHPUT_TOL = 0.05
MEAN_TOL = 0.07
QUANTILE_TOL = {"latency_p50_s": 0.10, "latency_p99_s": 0.09, "latency_p99_length_s": 0.12}


@pytest.mark.parametrize("preset", ["S", "T", "G", "C1", "C2"])
@pytest.mark.parametrize("refill", [0, 1, 8])
def test_analytic_agrees_with_discrete_event_on_presets(preset, refill):
    w = get_workload(preset)
    for name, (model, kw) in AGREEMENT_CASES.items():
        spec = get_model_spec(model)
        pol = Policy(**kw, refill_every=refill)
        des = simulate(spec, t4_like(), pol, w, num_requests=3000, seed=1)
        ana = simulate_analytic(spec, t4_like(), pol, w, num_requests=3000)
        assert ana.throughput_tokens_per_s == pytest.approx(des.throughput_tokens_per_s, rel=THROUGHPUT_TOL), name
        assert ana.latency_mean_s == pytest.approx(des.latency_mean_s, rel=MEAN_TOL), name
        for q in ("latency_p50_s", "latency_p99_s", "latency_p99_length_s"):
            assert getattr(ana, q) == pytest.approx(getattr(des, q), rel=QUANTILE_TOL[q]), (name, q)
        assert ana.peak_bytes == des.peak_bytes
        assert ana.padded_prompt_tokens == pytest.approx(des.padded_prompt_tokens, rel=0.15), name


@pytest.mark.parametrize("lengths", ["fixed:100:20", "fixed:16:1"])  # one-token outputs: no decode step at all
def test_analytic_is_exact_for_fixed_lengths(lengths):
    pol = offload_policy(gbs=8, nb=2)
    w = get_workload(lengths)
    des = simulate(OPT30, t4_like(), pol, w, num_requests=16 * 5 + 3)
    ana = simulate_analytic(OPT30, t4_like(), pol, w, num_requests=16 * 5 + 3)
    assert ana.wall_s == pytest.approx(des.wall_s, rel=1e-9)
    assert ana.latency_p99_s == pytest.approx(des.latency_p99_s, rel=1e-9)


@pytest.mark.parametrize("case", ["one row", "whole job", "interval past the longest output", "one output length"])
def test_refill_that_cannot_change_the_run_is_priced_as_no_refill(case):
    """A one-row block's slot frees as its request finishes; with a slot for every request none
    waits for a freed one; with every request done within one interval every slot is free at
    every refill; with one output length a block's rows all finish together. The discrete-event
    path runs these exactly as without refill, and the analytic path prices them so (its refill
    model was up to 16% off at one row, 31% for a whole job, 3.6x past the longest output, 36%
    at one output length)."""
    t = get_workload("T")
    for name, (model, kw) in AGREEMENT_CASES.items():
        spec = get_model_spec(model)
        base = Policy(**{**kw, "gbs": 1, "nb": 1}) if case == "one row" else Policy(**kw)
        w = (get_workload("S@0.125") if case.startswith("interval")  # S@0.125: outputs <= 10 tokens
             else Workload("t16", prompt=t.prompt, output=LengthDistribution.fixed(16)) if case == "one output length"
             else t)
        jobs = base.block_size if case == "whole job" else 600
        for refill in {"interval past the longest output": (16, 64), "one output length": (1, 4, 14)}.get(case, (1, 4, 64)):
            pol = replace(base, refill_every=refill)
            assert pol.refill_in_effect(jobs, w.output.max_len, w.output.min_len) == 0
            des, des0 = (simulate(spec, t4_like(), p, w, num_requests=jobs, seed=1) for p in (pol, base))
            assert des.throughput_tokens_per_s == pytest.approx(des0.throughput_tokens_per_s, rel=1e-12), name
            assert des.latency_p99_s == pytest.approx(des0.latency_p99_s, rel=1e-12), name
            ana, ana0 = (simulate_analytic(spec, t4_like(), p, w, num_requests=jobs) for p in (pol, base))
            assert ana.throughput_tokens_per_s == ana0.throughput_tokens_per_s, name
            assert ana.latency_p99_s == ana0.latency_p99_s and ana.policy.refill_every == refill, name
    # Where refill does change the run, the analytic path still prices it.
    spec, kw = get_model_spec(AGREEMENT_CASES["kv-moves"][0]), AGREEMENT_CASES["kv-moves"][1]
    base, w = Policy(**kw), get_workload("T")
    assert replace(base, refill_every=4).refill_in_effect(4 * base.block_size, w.output.max_len) == 4
    more, more0 = (simulate_analytic(spec, t4_like(), p, w, num_requests=4 * base.block_size)
                   for p in (replace(base, refill_every=4), base))
    assert more.throughput_tokens_per_s != more0.throughput_tokens_per_s


# --------------------------------------------------------------------------- bad input
def test_bad_requests_and_policies():
    w = get_workload("T")
    with pytest.raises(UserError, match="at least 1 token"):
        simulate(OPT30, t4_like(), offload_policy(), w, requests=([5, 0], [3, 3]))
    with pytest.raises(UserError, match="at least 1"):
        simulate(OPT30, t4_like(), offload_policy(), w, requests=([5, 4], [3, -2]))
    with pytest.raises(UserError, match=">= 1"):
        simulate(OPT30, t4_like(), offload_policy(), w, num_requests=0)
    with pytest.raises(UserError, match="sum to"):
        Policy.from_dict({"gbs": 4, "nb": 1, "cg": 0.5, "cc": 0.4, "cd": 0.0})


def test_a_policy_that_does_not_fit_is_flagged():
    res = simulate(OPT30, t4_like(), Policy(gbs=8, nb=1), get_workload("fixed:64:4"), num_requests=8)
    assert not res.fits
    assert res.peak_bytes["gpu"] > res.capacity_bytes["gpu"]
    small = simulate(get_model_spec("opt-1.3b"), t4_like(), Policy(gbs=8, nb=1), get_workload("fixed:64:4"),
                     num_requests=8)
    assert small.fits
    # each tier is checked, not only the gpu's: OPT-30B's weights on a 16 GiB cpu tier, or on a 16 GiB disk
    for tier, policy in (("cpu", Policy(gbs=8, nb=1, wg=0.0, wc=1.0)), ("disk", Policy(gbs=8, nb=1, wg=0.0, wd=1.0))):
        res = simulate(OPT30, replace(t4_like(), **{f"{tier}_bytes": 16 * 2**30}), policy, get_workload("fixed:64:4"),
                       num_requests=8)
        over = [t for t in ("gpu", "cpu", "disk") if res.peak_bytes[t] > res.capacity_bytes[t]]
        assert over == [tier] and not res.fits, (tier, over)


def test_workload_with_mixture_and_correlation_simulates():
    mix = LengthDistribution.mixture([LengthDistribution.fixed(4), LengthDistribution.truncnorm(60, 10, 100)],
                                     [0.5, 0.5])
    w = Workload("bimodal", prompt=get_workload("G@0.25").prompt, output=mix, correlation=0.5)
    res = simulate(OPT30, t4_like(), offload_policy(refill_every=2), w, num_requests=300)
    assert res.generated_tokens == pytest.approx(300 * mix.mean, rel=0.1)


def test_cpu_host_profile_with_bandwidth_curves():
    spec = get_model_spec("smollm2-135m")
    pol = Policy(gbs=4, nb=2, wg=0.5, wc=0.5, wd=0.0, cg=0.5, cc=0.5, cd=0.0)
    res = simulate(spec, cpu_host(), pol, get_workload("T@0.25"), num_requests=200)
    assert res.fits and res.throughput_tokens_per_s > 0
    assert res.busy_s["ctog"] > 0 and res.busy_s["gtoc"] > 0
    slower = simulate(spec, cpu_host(ctog=BandwidthCurve.flat(0.2 * GB)), pol, get_workload("T@0.25"),
                      num_requests=200)
    assert slower.wall_s > res.wall_s


def test_range_max_matches_brute_force():
    from xsimulator.discrete_event import range_max

    rng = np.random.default_rng(0)
    for n, scale in ((1, 1), (2, 1), (7, 1), (64, 1), (1000, 1), (1000, 2**40)):  # int32, and int64 past it
        lo = rng.integers(0, n, 60)
        hi = np.minimum(lo + rng.integers(0, n, 60), n - 1)
        value = rng.integers(-50, 100, 60) * scale  # negative keys occur (prompt - join * steps)
        got = range_max(n, lo, hi, value)
        assert got.dtype == (np.int32 if scale == 1 else np.int64)
        expected = np.full(n, np.iinfo(got.dtype).min, np.int64)  # (the result type's min where none)
        for a, b, v in zip(lo, hi, value):
            expected[a:b + 1] = np.maximum(expected[a:b + 1], v)
        assert np.array_equal(got, expected)


@pytest.mark.parametrize("busy", [1.0, 0.3])
def test_step_pricing_from_tables_equals_pricing_each_cell(busy):
    """``price_steps`` prices a grid of GPU batches x steps from a table of distinct batch shapes
    (the LM head per step from a table of row counts), and a mostly idle grid only at its busy
    steps (the prefills of a job refilled every step): the same seconds and terms, step by step,
    as the cost model pricing every cell (``CostModel.block_step``). On a CPU profile with a
    memory roof the head's price at 0 rows is not 0 (a weight read): a step where every batch
    is idle must still cost nothing."""
    from xsimulator.discrete_event import price_steps

    rng = np.random.default_rng(7)
    nb, steps = 3, 20_000
    rows = rng.integers(0, 5, (nb, steps)) * (rng.random(steps) < busy)  # (0 rows: an idle batch)
    length = np.where(rows > 0, rng.integers(1, 200, (nb, steps)), 0)
    for spec, prof, pol in ((get_model_spec("opt-1.3b"), t4_like(), Policy(gbs=4, nb=nb)),
                            (OPT30, t4_like(), Policy(gbs=4, nb=nb, wg=0.2, wc=0.8, cg=0.0, cc=1.0, hg=0.0, hc=1.0,
                                                      cpu_attention=True)),
                            (get_model_spec("opt-1.3b").with_dtype("float32"), cpu_host(mem_bytes_per_s=11 * GB),
                             Policy(gbs=4, nb=nb))):
        cm = CostModel.for_policy(spec, prof, pol)
        for phase in ("prefill", "decode"):
            on = rows > 0
            want = cm.block_step(phase, rows, length, pol.placement(), on, on.any(axis=0), batch_axis=0)
            got = price_steps(cm, phase, rows, length, pol.placement())
            assert np.allclose(got.seconds, want.seconds, rtol=1e-12, atol=0)
            assert np.allclose(got.head_s, want.head_s, rtol=1e-12, atol=0)
            for k, v in want.terms.as_dict().items():
                assert np.allclose(np.broadcast_to(getattr(got.terms, k), (steps,)), v, rtol=1e-12, atol=0), k


@pytest.mark.parametrize("refill", [0, 1, 3])
def test_padded_context_matches_its_definition(refill):
    """T = max over active rows of prompt + tokens so far, checked by brute force."""
    pol = Policy(gbs=4, nb=2, refill_every=refill)
    p, o = get_workload("S@0.1").sample(60, seed=refill)
    _, tl = simulate_timeline(OPT30, t4_like(), pol, get_workload("S@0.1"), requests=(p, o))
    sched, S = tl.schedule, tl.schedule.interval_steps
    rows = np.zeros_like(tl.decode_rows)
    ctx = np.zeros_like(tl.decode_len)
    for i in range(len(p)):
        k = sched.slot[i] // pol.gbs
        for t in range(1, o[i]):  # decode step t after joining makes token t + 1
            j, u = divmod(sched.join[i] * S + t - 1, S)
            rows[k, j, u] += 1
            ctx[k, j, u] = max(ctx[k, j, u], p[i] + t)
    assert np.array_equal(tl.decode_rows, rows)
    assert np.array_equal(tl.decode_len, ctx)


def test_split_counts_sums_and_exact_multiples():
    from xsimulator.policy import split_counts

    for n in (0, 1, 3, 7, 30, 96):
        for fr in ((1, 0, 0), (0.5, 0.5, 0), (0.2, 0.3, 0.5), (1 / 3, 1 / 3, 1 / 3), (0, 0, 1)):
            counts = split_counts(fr, n)
            assert sum(counts) == n
            assert all(abs(c - f * n) < 1 for c, f in zip(counts, fr))
    assert split_counts((6 / 30, 24 / 30, 0), 30) == (6, 24, 0)


def test_a_measured_head_fit_prices_the_lm_head_instead_of_the_roofs():
    """With the profiler's measured logits products for the model (``HeadFit``), the head costs the
    measured time (times the head factor) at every row count, one row included, whatever the
    roofs would say; another model's fit is not used."""
    from xprofiler.profile import HeadFit

    spec = get_model_spec("opt-125m")
    fit = HeadFit(model=spec.name, dtype=spec.dtype, rows=(1, 2, 4, 8), seconds=(0.006, 0.012, 0.02, 0.024),
                  layouts=("transposed",) * 4)
    base = cpu_host(mem_bytes_per_s=11 * GB, calibration={"head": 1.5, "gpu_compute": 1.1})
    roofs = CostModel(spec, base)
    measured = CostModel(spec, replace(base, head_fits=(fit,)))
    slower = CostModel(spec, replace(base, head_fits=(replace(fit, seconds=tuple(2 * t for t in fit.seconds)),)))
    rows = np.array([1, 2, 3, 4, 8, 16])
    extra = slower.head_seconds("decode", rows, 40) - measured.head_seconds("decode", rows, 40)
    assert extra == pytest.approx(1.5 * fit.predict_s(rows))
    assert measured.head_seconds("decode", 1, 40) != pytest.approx(roofs.head_seconds("decode", 1, 40))
    elsewhere = CostModel(spec, replace(base, head_fits=(replace(fit, model="other"),)))
    assert elsewhere.head_seconds("decode", rows, 40) == pytest.approx(roofs.head_seconds("decode", rows, 40))


def test_the_lm_head_is_one_product_over_the_blocks_rows_each_step():
    """The runner multiplies the LM head once per step over every GPU batch's rows (the matrix is
    read once, not once per batch), so a step's head is priced at the block's rows and each batch
    is charged its rows' share. With a measured product of 20 ms at 4 and at 8 rows, doubling it
    costs a block of two batches of 4 rows 20 ms more per step, not 40, in both simulators."""
    from xprofiler.profile import HeadFit

    spec = get_model_spec("opt-125m")
    fit = HeadFit(model=spec.name, dtype=spec.dtype, rows=(1, 4, 8), seconds=(0.01, 0.02, 0.02))
    fast, slow = (CostModel(spec, cpu_host(head_fits=(f,))) for f in (fit, replace(fit, seconds=(0.02, 0.04, 0.04))))
    extra = slow.head_seconds("decode", np.array([6, 2]), 40, 8) - fast.head_seconds("decode", np.array([6, 2]), 40, 8)
    assert extra == pytest.approx([0.015, 0.005])
    w, pol, steps = get_workload("fixed:32:4"), Policy(gbs=4, nb=2), 4  # one prefill and three decode steps
    for sim in (simulate, simulate_analytic):
        one, two = (sim(spec, cm.profile, pol, w, num_requests=8) for cm in (fast, slow))
        assert two.busy_s["head"] - one.busy_s["head"] == pytest.approx(steps * 0.02)
    # 40 blocks of 32 steps: the discrete-event simulator prices the decode steps from its table of
    # batch shapes (``price_steps``), the head per step from the step's rows.
    one, two = (simulate(spec, cm.profile, pol, get_workload("fixed:32:32"), num_requests=320) for cm in (fast, slow))
    assert two.busy_s["head"] - one.busy_s["head"] == pytest.approx(40 * 32 * 0.02)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 3.3 deprecates its bundled CBC
def test_the_head_relayout_on_a_cpu_host_is_planned_alone_not_on_top_of_the_rest():
    """A CPU runner's first step holds the LM head twice, with one product's input and logits (its
    layouts timed, ``xrunner.model.cpu_head_layout``), before anything else exists: planned as an
    ``alone`` sum, which can set the peak when the tier holds little else and never adds to the
    generation's peak; a CUDA runner has no copy."""
    spec = get_model_spec("opt-125m")
    head_matrix = (spec.vocab_size * spec.hidden + 1 * (spec.hidden + spec.vocab_size)) * spec.dtype_bytes
    placement = Policy(gbs=1, nb=1, wg=0.0, wc=1.0).placement()
    cpu = CostModel(spec, cpu_host()).memory(placement, 1, 1, 8, 8)["gpu"]
    assert cpu.alone == {"head_weights": spec.head_weight_bytes, "head_layout": head_matrix}
    generation = sum(cpu.resident.values()) + max(cpu.transient.values())
    assert generation < spec.head_weight_bytes + head_matrix  # a small plan: the re-layout is the peak
    assert cpu.peak_bytes() == spec.head_weight_bytes + head_matrix
    assert max(cpu.constraints()) == spec.head_weight_bytes + head_matrix
    big = CostModel(spec, cpu_host()).memory(Policy(gbs=64, nb=4).placement(), 64, 4, 512, 512)["gpu"]
    assert big.peak_bytes() == sum(big.resident.values()) + max(big.transient.values())  # nothing added
    assert CostModel(spec, t4_like()).memory(placement, 1, 1, 8, 8)["gpu"].alone["head_layout"] == 0
    # In the LP it is one more (constant) constraint: a gpu tier below it leaves no placement.
    lp = pulp.LpProblem("alone", pulp.LpMinimize)
    x = {v: lp.add_variable(v, 0, 1) for v in PLACEMENT_VARS}
    lp += x["wg"]
    for trio in (("wg", "wc", "wd"), ("cg", "cc", "cd"), ("hg", "hc", "hd")):
        lp += pulp.lpSum(x[v] for v in trio) == 1
    for expr in CostModel(spec, cpu_host()).memory(x, 1, 1, 8, 8)["gpu"].constraints():
        lp += expr <= spec.head_weight_bytes + head_matrix - 1
    assert lp.solve(pulp.PULP_CBC_CMD(msg=False)) == pulp.LpStatusInfeasible


def test_a_refill_interval_or_block_far_past_the_job_simulates_as_the_job_needs():
    """refill_every=1e9 built a 52 GiB step grid and gbs x nb = 2**32 a list of 4e9 slots (a
    review); past the longest output a refill changes nothing, and slots past the job stay empty."""
    w = get_workload("T@0.25")
    base = simulate(OPT30, t4_like(), Policy(gbs=8, nb=1), w, num_requests=50, seed=1)
    far = simulate(OPT30, t4_like(), Policy(gbs=8, nb=1, refill_every=10**9), w, num_requests=50, seed=1)
    assert far.wall_s == pytest.approx(base.wall_s, rel=1e-12) and far.latency_p99_s == pytest.approx(base.latency_p99_s)
    wide = simulate(OPT30, t4_like(), Policy(gbs=2**20, nb=2**12), w, num_requests=50, seed=1)
    assert wide.generated_tokens == far.generated_tokens


def test_row_copies_priced_as_the_runs_of_rows_left_spread_at_random():
    """The engine copies cpu-tier KV and hidden-state rows a run of consecutive slots at a time, and
    disk rows one at a time. The cost model's copy count is the mean over random spreads of the
    active rows (the draws here are the reference), and splits runs past ``COPY_RUN_BYTES``."""
    from xscheduler.placement import _var
    from xsimulator.costmodel import COPY_RUN_BYTES, CUDA_RUN_ROW_BYTES

    rng = np.random.default_rng(0)
    n, cpu = 16, 0.5  # slots 8..15 live on the cpu tier
    for rows in (1, 3, 8, 13, 16):
        cm = CostModel.for_policy(OPT30, cpu_host(), Policy(gbs=n, nb=1, cg=0.5, cc=cpu))
        draws = []
        for _ in range(4000):
            active = np.zeros(n, dtype=bool)
            active[rng.choice(n, rows, replace=False)] = True
            tier = active[8:]
            draws.append(int(tier[0]) + int(np.sum(tier[1:] & ~tier[:-1])))
        per_unit = cm._row_copies(cpu, rows, 2, nbytes=2 * rows * 1024)
        assert cpu * per_unit == pytest.approx(2 * np.mean(draws), rel=0.04, abs=0.02), rows
        assert cm._row_copies(cpu, rows, 2, 2 * rows * COPY_RUN_BYTES) == pytest.approx(2 * rows)  # a row each
        # an LP variable share scales the whole batch's runs (a linear term)
        on_cuda = CostModel.for_policy(OPT30, t4_like(), Policy(gbs=n, nb=1, cg=0.5, cc=cpu))
        big = 2 * rows * CUDA_RUN_ROW_BYTES  # rows that large move alone on CUDA, as the engine's do
        assert on_cuda._row_copies(cpu, rows, 2, big) == pytest.approx(2 * rows)
        assert on_cuda._row_copies(cpu, rows, 2, 2 * rows * 1024) == pytest.approx(per_unit)
        share = _var(pulp.LpProblem("p"), "cc", 0, 1)
        assert cm._row_copies(share, rows, 2, 2048) == pytest.approx(cm._row_copies(1.0, rows, 2, 2048))
    assert CostModel(OPT30, cpu_host())._row_copies(cpu, 5, 2, 1024) == pytest.approx(10)  # no slot count: per row


def test_row_copies_of_plain_numbers_equal_the_array_path():
    """The planner prices plain floats through math's path (numpy on scalars was a fifth of a
    plan's time); it must give the simulator's array answer exactly, on both hosts and codecs."""
    rng = np.random.default_rng(1)
    for prof in (cpu_host(), t4_like()):
        for slots in (0, 2, 16, 64):
            for compress in (False, True):
                pol = Policy(gbs=max(slots, 1), nb=1, cg=0.5, cc=0.5, compress_cache=compress)
                cm = CostModel.for_policy(OPT30, prof, pol) if slots else CostModel(OPT30, prof, compress_cache=compress)
                for _ in range(100):
                    rows = float(rng.integers(1, max(slots, 2) + 1))
                    cpu = float(rng.choice([0.0, rng.random(), 1.0]))
                    nbytes, parts = float(10 ** rng.uniform(2, 9)), int(rng.choice([1, 2, 6]))
                    plain = cm._row_copies(cpu, rows, parts, nbytes)
                    assert isinstance(plain, float)
                    assert plain == cm._row_copies(np.array(cpu), np.array([rows]), parts, np.array([nbytes]))[0]


@pytest.mark.parametrize("refill", [0, 8])
def test_a_prompts_samples_are_prefilled_once_and_both_paths_agree(refill):
    """A workload whose prompts each ask for 4 outputs: requests come in runs of 4 with one
    prompt length, and the discrete-event path computes a run's rows once per GPU batch and
    interval, so a prefill-heavy job computes far fewer prompt positions and runs faster than
    the same lengths with one output per prompt; the analytic path prices it alike."""
    spec, prof = get_model_spec("opt-1.3b"), t4_like()
    one = get_workload("S")
    four = replace(one, samples=4)
    p, o = four.sample(1000, seed=3)
    assert (p.reshape(-1, 4) == p[::4, None]).all() and len(set(o[:4].tolist())) > 1  # one prompt, own outputs
    pol = Policy(gbs=16, nb=4, refill_every=refill)
    des1 = simulate(spec, prof, pol, one, num_requests=3000, seed=1)
    des4 = simulate(spec, prof, pol, four, num_requests=3000, seed=1)
    saved = des4.padded_prompt_tokens / des1.padded_prompt_tokens
    assert saved < 0.6
    assert des4.throughput_tokens_per_s > 1.2 * des1.throughput_tokens_per_s
    _, tl = simulate_timeline(spec, prof, pol, four, num_requests=64, seed=1)  # the trace says what it computed
    pre = [e.args for e in trace_events(CostModel.for_policy(spec, prof, pol), tl) if e.args.get("phase") == "prefill"]
    assert pre and all(a["computed_rows"] < a["rows"] for a in pre)
    ana = simulate_analytic(spec, prof, pol, four, num_requests=3000)
    assert ana.throughput_tokens_per_s == pytest.approx(des4.throughput_tokens_per_s, rel=THROUGHPUT_TOL)
    assert ana.padded_prompt_tokens == pytest.approx(des4.padded_prompt_tokens, rel=0.15)
    assert ana.latency_mean_s == pytest.approx(des4.latency_mean_s, rel=MEAN_TOL)


@pytest.mark.parametrize("refill", [0, 2])
def test_prompts_mixing_system_prompts_compute_each_per_batch_and_both_paths_agree(refill):
    """Every prompt begins with one of G 150-token system prompts (Workload.prefix_groups) before a
    question of about 60 tokens: a GPU batch computes each of its prefixes once, so more of them
    compute more positions, between one shared prefix and none; sorting a block's joiners by prefix
    (as the engine does) keeps a full GPU batch to fewer than half as many prefixes as rows at
    G = 64; the analytic path prices it within the DES's tolerances, also with half the prompts
    behind none of them."""
    spec, prof = get_model_spec("opt-1.3b"), t4_like()
    plain = replace(get_workload("S@0.5"), prompt=LengthDistribution.truncnorm(210, 20, 280, min_len=151))
    pol = Policy(gbs=32, nb=4, refill_every=refill)
    des = {G: simulate(spec, prof, pol, replace(plain, prefix_tokens=150, prefix_groups=G), num_requests=3000, seed=1)
           for G in (1, 4, 64)}
    none = simulate(spec, prof, pol, plain, num_requests=3000, seed=1)
    positions = [des[1].padded_prompt_tokens, des[4].padded_prompt_tokens, des[64].padded_prompt_tokens,
                 none.padded_prompt_tokens]
    assert positions == sorted(positions) and positions[0] < positions[1], positions
    assert refill or positions[2] < 0.8 * positions[3], positions  # with refill, ~4 rows join a batch: few share
    rates = [r.throughput_tokens_per_s for r in (des[1], des[4], des[64], none)]
    assert rates[0] > rates[1] > rates[3] and rates[2] >= rates[3], rates
    _, tl = simulate_timeline(spec, prof, pol, replace(plain, prefix_tokens=150, prefix_groups=64), num_requests=3000,
                              seed=1)
    full = tl.prefill_rows >= 16
    assert np.mean(np.asarray(tl.prefix_groups)[full]) < 0.5 * np.mean(tl.prefill_rows[full]), "grouped by prefix"
    # A job's own prefixes, one per request (unsorted batches keep them where they are), or a one-line refusal:
    # two prefixes, each computed once however the two batches hold them (the second batch takes what the
    # first computed: one from the run's cache, one held), against a prefix of its own for every prompt.
    lengths, mine, queue = (np.full(64, 210), np.full(64, 16)), replace(plain, prefix_tokens=150, prefix_groups=2), \
        Policy(gbs=32, nb=2, bucket=False)
    ordered = simulate(spec, prof, queue, mine, requests=lengths, prefix_of=np.arange(64) // 32)
    mixed = simulate(spec, prof, queue, mine, requests=lengths, prefix_of=np.arange(64) % 2)
    alone = simulate(spec, prof, queue, mine, requests=lengths, prefix_of=np.arange(64))
    assert ordered.padded_prompt_tokens == mixed.padded_prompt_tokens == 2 * 150 + 64 * 60
    assert alone.padded_prompt_tokens == 64 * 210
    with pytest.raises(UserError, match="prefix_of gives 3 prefixes for 64 requests"):
        simulate(spec, prof, pol, mine, requests=lengths, prefix_of=[0, 1, 0])
    # Half the prompts behind one of the 4, the rest sharing nothing (Workload.prefix_share): between the two.
    half = replace(plain, prefix_tokens=150, prefix_groups=4, prefix_share=0.5)
    des["half"] = simulate(spec, prof, pol, half, num_requests=3000, seed=1)
    assert positions[1] < des["half"].padded_prompt_tokens < positions[3]
    for G in (4, 64, "half"):
        workload = half if G == "half" else replace(plain, prefix_tokens=150, prefix_groups=G)
        ana = simulate_analytic(spec, prof, pol, workload, num_requests=3000)
        assert ana.throughput_tokens_per_s == pytest.approx(des[G].throughput_tokens_per_s, rel=THROUGHPUT_TOL), G
        assert ana.padded_prompt_tokens == pytest.approx(des[G].padded_prompt_tokens, rel=0.05), G
        assert ana.latency_mean_s == pytest.approx(des[G].latency_mean_s, rel=MEAN_TOL), G


@pytest.mark.parametrize("refill", [0, 2])
def test_a_shared_system_prompt_is_prefilled_once_and_both_paths_agree(refill):
    """Every prompt begins with the same 150 tokens (Workload.prefix_tokens; S@0.5's prompts behind a
    150-token system prompt): the discrete-event path computes them once per GPU batch's prefill
    (as the engine does, where that cuts the positions to 0.8 or fewer), so the job computes fewer
    prompt positions and runs faster than the same lengths without; the trace says how many
    positions each prefill computed, and the analytic path prices it alike."""
    spec, prof = get_model_spec("opt-1.3b"), t4_like()
    s = get_workload("S@0.5").prompt
    plain = replace(get_workload("S@0.5"), prompt=LengthDistribution.truncnorm(s.mean + 150, s.std, s.max_len + 150,
                                                                                min_len=151))
    shared = replace(plain, prefix_tokens=150)
    assert "begin with 150 tokens they share" in shared.describe() and Workload.from_json(shared.to_json()) == shared
    pol = Policy(gbs=64, nb=2, refill_every=refill)
    des0 = simulate(spec, prof, pol, plain, num_requests=3000, seed=1)
    des = simulate(spec, prof, pol, shared, num_requests=3000, seed=1)
    assert des.padded_prompt_tokens < 0.75 * des0.padded_prompt_tokens
    assert des.throughput_tokens_per_s > 1.2 * des0.throughput_tokens_per_s
    _, tl = simulate_timeline(spec, prof, pol, shared, num_requests=256, seed=1)
    pre = [e.args for e in trace_events(CostModel.for_policy(spec, prof, pol), tl) if e.args.get("phase") == "prefill"]
    assert any(a["positions"] < a["rows"] * a["padded_len"] for a in pre)
    ana = simulate_analytic(spec, prof, pol, shared, num_requests=3000)
    assert ana.throughput_tokens_per_s == pytest.approx(des.throughput_tokens_per_s, rel=THROUGHPUT_TOL)
    assert ana.padded_prompt_tokens == pytest.approx(des.padded_prompt_tokens, rel=0.05)
    assert ana.latency_mean_s == pytest.approx(des.latency_mean_s, rel=MEAN_TOL)


def test_the_vectorised_prefix_taking_agrees_with_the_engines_replay():
    """``discrete_event._first_computes`` (every prefill at once) against ``_replay_prefixes`` (the
    engine's ``plan_block`` rule, one prefill's entries in batch order, no hold limit) on random
    prefills: 1-6 batches, 1-4 prefixes each, cells that share none (-1) or fewer tokens than a
    later one wants. Both say the same pair computes; a hold limit only ever adds computations."""
    from xsimulator.discrete_event import _first_computes, _replay_prefixes

    rng = np.random.default_rng(3)
    taken = 0
    for _ in range(200):
        batch, which, lend, need = [], [], [], []
        for b in range(rng.integers(1, 7)):
            cell_tokens = int(rng.integers(1, 9))
            shares = rng.random() < 0.8
            for w in sorted(rng.choice(5, rng.integers(1, 5), replace=False).tolist()):
                batch.append(b), which.append(w), need.append(cell_tokens)
                lend.append(cell_tokens if shares else -1)
        vec = _first_computes(np.array(batch), np.array(which), np.array(lend), np.array(need))
        assert vec.tolist() == _replay_prefixes(batch, which, lend, need, None)
        limited = _replay_prefixes(batch, which, lend, need, 6)
        assert all(a or not b for a, b in zip(limited, vec))
        taken += int((~vec).sum())
    assert taken > 100


def test_the_analytic_path_refuses_no_requests_as_the_sampling_one_does():
    """`simulate_analytic(..., num_requests=0)` divided by zero (an API walkthrough)."""
    from xprofiler.presets import load_preset
    from xprofiler.specs import get_model_spec
    from xsched.errors import UserError
    from xsimulator.analytic import simulate_analytic
    from xsimulator.policy import Policy

    prof = load_preset("t4")
    with pytest.raises(UserError, match="number of requests must be >= 1, got 0"):
        simulate_analytic(prof.model_for(get_model_spec("opt-1.3b")), prof, Policy(gbs=8, nb=1), get_workload("T"), 0)


def test_requests_longer_than_the_workload_are_priced_at_their_own_memory():
    """`simulate(..., requests=...)` sized memory for the workload's longest lengths: 8 prompts of
    100,000 tokens "fit" at the memory of 100-token ones (an API walkthrough). The engine sizes for
    the job's; so does the simulation now."""
    from xprofiler.presets import load_preset
    from xprofiler.specs import get_model_spec

    prof = load_preset("t4")
    spec, policy, w = prof.model_for(get_model_spec("opt-1.3b")), Policy(gbs=8, nb=1), get_workload("T")
    short = simulate(spec, prof, policy, w, requests=([100] * 8, [5] * 8))
    long = simulate(spec, prof, policy, w, requests=([1000] * 8, [5] * 8))
    assert short.peak_bytes == simulate(spec, prof, policy, w, requests=([200] * 8, [5] * 8)).peak_bytes  # T: to 256
    assert long.peak_bytes["gpu"] > short.peak_bytes["gpu"]
    wide = simulate(spec, prof, policy, get_workload("fixed:1000:320"), requests=([1000] * 8, [5] * 8))
    assert long.peak_bytes == wide.peak_bytes  # as if the workload itself reached 1000 tokens


def test_cpu_attention_stages_only_the_prompts_kv_on_the_gpu():
    """With CPU attention the gpu tier stages a batch's prompt K/V on its way out (max_prompt
    positions), not its whole context: over-counting it refused placements that fit (a mutation
    audit: the engine tests check only that real peaks stay under the plan)."""
    from xprofiler.presets import load_profile

    prof = load_profile("t4", check_machine=False)
    spec = prof.model_for(get_model_spec("opt-6.7b"))
    for cpu_attention, positions in ((True, 100), (False, 150)):
        pol = Policy(gbs=8, nb=2, cg=0.0, cc=1.0, cpu_attention=cpu_attention)
        mem = CostModel.for_policy(spec, prof, pol).memory(pol.placement(), 8, 2, 100, 50)
        assert mem["gpu"].resident["kv_stage"] == pytest.approx(2 * 8 * positions * spec.kv_bytes_per_token_per_layer)
