"""Layer fits recover known curves; profiles round-trip through JSON; presets validate."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from xprofiler import HardwareProfile, LayerFit
from xprofiler.fit import fit_layer, independent_columns, feature_matrix
from xprofiler.presets import load_preset, load_profile, preset_names
from xprofiler.profile import LAYER_FEATURES, BandwidthCurve, layer_features
from xprofiler.specs import get_model_spec
from xsched.errors import UserError

SPEC = get_model_spec("opt-1.3b").with_dtype("float32")  # the dtype the fits below are timed in
PB, PN = (np.array(g, dtype=float).ravel() for g in np.meshgrid([1, 2, 4, 8, 16], [16, 64, 128, 256, 512]))
DB, DN = (np.array(g, dtype=float).ravel() for g in np.meshgrid([1, 2, 4, 16, 64], [128, 256, 512, 1024, 2048]))


def prefill_truth(b, n):
    """A roofline-like layer: 0.4 ms launch cost, GEMMs at 200 GFLOP/s, attention at 50 GFLOP/s."""
    f = layer_features(SPEC, "prefill", b, n)
    return 4e-4 + f["linear_flops"] / 200e9 + f["attn_flops"] / 50e9


def decode_truth(b, n):
    """1.5 ms (weights read), per-row work at 20 GFLOP/s, KV read at 8 GB/s."""
    f = layer_features(SPEC, "decode", b, n)
    return 1.5e-3 + f["linear_flops"] / 20e9 + f["kv_bytes"] / 8e9


def test_a_sweep_cut_to_its_budget_keeps_two_lengths_so_the_fit_extrapolates_in_length():
    """Two 30-70B models under --quick on a 2-core CPU: the budget left opt-30b's prefill grid only
    prompts of 16 tokens; from one length the fit cannot tell attention from the rest, kept
    attn_flops alone, and priced a prefill of 512 tokens 29x slow."""
    from xprofiler.sweeps import QUICK_GRIDS, plan_points

    spec = get_model_spec("opt-30b").with_dtype("float32")
    pts, _passes, dropped = plan_points(spec, "prefill", QUICK_GRIDS["prefill"], 110.0 / 4, 60e9, 10e9, 4, 5, 15, 1,
                                        kv_limit_bytes=1.5e9)
    assert {n for _, n in pts} == {16, 64} and dropped
    b, n = (np.array(x, dtype=float) for x in zip(*pts))
    truth = lambda b, n: 4e-4 + sum(layer_features(spec, "prefill", b, n)[k] / r  # noqa: E731
                                    for k, r in (("linear_flops", 200e9), ("attn_flops", 50e9)))
    fit = fit_layer(spec, "prefill", b, n, truth(b, n), model=spec.name, dtype="float32")
    assert "linear_flops" in fit.features
    assert fit.predict_s(spec, 1, 512) == pytest.approx(truth(1.0, 512.0), rel=0.05)


def test_byte_features_are_counted_in_the_dtype_the_samples_were_timed_in():
    """A registry spec (float16) with samples timed in float32, as a CPU profile measures: the fit
    must predict its own samples for the float32 spec that plans and simulations use."""
    half = SPEC.with_dtype("float16")
    fit = fit_layer(half, "decode", DB, DN, decode_truth(DB, DN), model="m", dtype="float32", correct=False)
    assert fit.coef == pytest.approx((1.5e-3, 1 / 20e9, 1 / 8e9), rel=1e-6)
    assert np.allclose(fit.predict_s(SPEC, DB, DN), decode_truth(DB, DN), rtol=1e-9)


def test_nnls_recovers_known_coefficients_exactly():
    fit = fit_layer(SPEC, "prefill", PB, PN, prefill_truth(PB, PN), model="m", dtype="float32", correct=False)
    assert fit.features == ("const", "linear_flops", "attn_flops")
    assert fit.coef == pytest.approx((4e-4, 1 / 200e9, 1 / 50e9), rel=1e-6)
    assert fit.max_rel_error < 1e-9
    fit = fit_layer(SPEC, "decode", DB, DN, decode_truth(DB, DN), model="m", dtype="float32", correct=False)
    assert fit.features == ("const", "linear_flops", "kv_bytes")
    assert fit.coef == pytest.approx((1.5e-3, 1 / 20e9, 1 / 8e9), rel=1e-6)
    # extrapolation far outside the grid stays exact for a curve the model can express
    assert fit.predict_s(SPEC, 256, 8192) == pytest.approx(decode_truth(256.0, 8192.0), rel=1e-6)


def test_collinear_features_are_dropped_keeping_the_rate_like_one():
    x = feature_matrix(SPEC, "prefill", PB, PN)
    names = independent_columns(x, LAYER_FEATURES["prefill"])
    assert "tokens" not in names and "linear_flops" in names  # tokens is proportional to linear_flops
    x = feature_matrix(SPEC, "decode", DB, DN)
    names = independent_columns(x, LAYER_FEATURES["decode"])
    assert "attn_flops" not in names and "kv_bytes" in names


def test_fit_with_noise_stays_close_and_minimises_relative_error():
    rng = np.random.default_rng(0)
    truth = prefill_truth(PB, PN)
    noisy = truth * rng.lognormal(0.0, 0.03, truth.shape)  # 3 % multiplicative noise
    fit = fit_layer(SPEC, "prefill", PB, PN, noisy, model="m", dtype="float32", correct=False)
    pred = fit.predict_s(SPEC, PB, PN)
    assert np.median(np.abs(pred - truth) / truth) < 0.02
    assert 0.005 < fit.median_rel_error < 0.05  # stored in-sample error reflects the noise
    # the small, fast points count as much as the big ones (relative, not absolute, error)
    assert abs(fit.predict_s(SPEC, 1, 16) / prefill_truth(1.0, 16.0) - 1) < 0.08


def test_grid_correction_is_exact_at_nodes_and_interpolates_between():
    # A curve no linear model expresses: 30 % slower whenever the batch is 2 or more (a kernel switch).
    def truth(b, n):
        return decode_truth(b, n) * np.where(np.asarray(b) >= 2, 1.3, 1.0)

    fit = fit_layer(SPEC, "decode", DB, DN, truth(DB, DN), model="m", dtype="float32")
    assert np.allclose(fit.predict_s(SPEC, DB, DN), truth(DB, DN), rtol=1e-9)
    lin = fit_layer(SPEC, "decode", DB, DN, truth(DB, DN), model="m", dtype="float32", correct=False)
    for b, n in [(4, 700), (32, 300), (8, 1500)]:  # between nodes, inside the slow regime
        assert abs(fit.predict_s(SPEC, b, n) / truth(b, n) - 1) < 0.02
        assert abs(lin.predict_s(SPEC, b, n) / truth(b, n) - 1) > abs(fit.predict_s(SPEC, b, n) / truth(b, n) - 1)
    # outside the grid the edge factor is held: still linear in work
    big = fit.predict_s(SPEC, np.array([128.0, 256.0]), np.array([4096.0, 4096.0]))
    assert big[1] / big[0] == pytest.approx(lin.linear_s(SPEC, 256.0, 4096.0) / lin.linear_s(SPEC, 128.0, 4096.0)
                                            * fit.correction(256, 4096) / fit.correction(128, 4096), rel=1e-9)
    assert fit.correction(256, 4096) == pytest.approx(fit.correction(64, 2048))


def test_grid_fills_missing_nodes_from_the_nearest_measured_one():
    keep = ~((DB == 64) & (DN == 2048))  # the biggest point was skipped for time
    fit = fit_layer(SPEC, "decode", DB[keep], DN[keep], decode_truth(DB[keep], DN[keep]) * 1.1, model="m",
                    dtype="float32")
    assert len(fit.grid_ratio) == 5 and all(len(r) == 5 for r in fit.grid_ratio)
    assert fit.predict_s(SPEC, 64, 2048) == pytest.approx(decode_truth(64.0, 2048.0) * 1.1, rel=0.02)
    # "nearest" in log batch and log length: the skipped node takes (64, 1024)'s correction, not
    # (32, 2048)'s, which is nearer in raw numbers; here the machine runs 64 rows 1.3x slower
    # (nearest in raw numbers predicted 0.77 of the truth)
    slow = decode_truth(DB[keep], DN[keep]) * np.where(DB[keep] >= 64, 1.3, 1.0)
    fit = fit_layer(SPEC, "decode", DB[keep], DN[keep], slow, model="m", dtype="float32")
    assert fit.predict_s(SPEC, 64, 2048) == pytest.approx(decode_truth(64.0, 2048.0) * 1.3, rel=0.03)


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError, match="positive"):
        fit_layer(SPEC, "decode", [1, 2], [128, 128], [1e-3, 0.0], model="m", dtype="float32")
    with pytest.raises(ValueError, match="differ in length"):
        fit_layer(SPEC, "decode", [1, 2], [128], [1e-3, 2e-3], model="m", dtype="float32")
    with pytest.raises(ValueError, match="grid_ratio"):
        LayerFit(model="m", phase="decode", dtype="float32", features=("const",), coef=(1.0,), n_samples=1,
                 median_rel_error=0, max_rel_error=0, grid_batches=(1, 2), grid_lengths=(8,), grid_ratio=((1.0,),))
    # a hand-edited profile: an unknown feature was a KeyError in `xsched plan`, a negative
    # coefficient a plan priced at negative seconds per layer
    for features, coef, match in ((("const", "bogus"), (1.0, 1.0), "unknown decode feature"),
                                  (("const",), (-1.0,), "finite and >= 0"), (("const",), (math.nan,), "finite")):
        with pytest.raises(ValueError, match=match):
            LayerFit(model="m", phase="decode", dtype="float32", features=features, coef=coef, n_samples=1,
                     median_rel_error=0, max_rel_error=0)


def _measured_profile() -> HardwareProfile:
    import dataclasses

    fit = fit_layer(SPEC, "decode", DB, DN, decode_truth(DB, DN) * np.where(DB > 4, 1.2, 1.0), model="opt-1.3b",
                    dtype="float32", samples_csv="p.samples.csv")
    base = load_preset("t4")
    return dataclasses.replace(
        base, source="measured", layer_fits=(fit,), calibration={"compute": 1.1},
        ctog=BandwidthCurve(sizes_bytes=(4096, 2**20), bytes_per_s=(1e9, 1e10), large_bytes_per_s=1.2e10),
        ctog_pageable=BandwidthCurve.flat(5e9), compute_threads=2, disk_io="o_direct", wall_s=12.5)


def test_profile_json_round_trip_with_fits_and_curves(tmp_path):
    prof = _measured_profile()
    again = HardwareProfile.from_json(prof.to_json())
    assert again == prof
    path = tmp_path / "p.json"
    prof.save(path)
    assert HardwareProfile.load(path) == prof
    fit = again.layer_fit("opt-1.3b", "decode", "float32")
    assert fit is not None and fit.predict_s(SPEC, 8, 512) == prof.layer_fits[0].predict_s(SPEC, 8, 512)
    assert json.loads(prof.to_json())["schema"] == "xsched.HardwareProfile/1"


def test_profile_rejects_malformed_values():
    data = _measured_profile().to_dict()
    data["mm_flops"] = -1
    with pytest.raises(UserError, match="mm_flops"):
        HardwareProfile.from_dict(data)
    data = _measured_profile().to_dict()
    data["disk_io"] = "mmap"
    with pytest.raises(UserError, match="disk_io"):
        HardwareProfile.from_dict(data)


def test_bandwidth_curve_interpolates_in_log_size():
    c = BandwidthCurve(sizes_bytes=(2**12, 2**20), bytes_per_s=(1e9, 9e9), large_bytes_per_s=1e10)
    assert c.at(2**16) == pytest.approx(5e9)  # halfway in log2 size
    assert c.at(100) == 1e9 and c.at(2**30) == 1e10
    assert c.time_s(2**30) == pytest.approx(2**30 / 1e10)


def test_compute_s_is_a_roofline():
    p = load_preset("t4")
    # compute bound: a big GEMM
    assert p.compute_s("mm", 1e12, 1e6) == pytest.approx(1e12 / p.mm_flops)
    # memory bound: a decode GEMV over 1 GB of weights
    assert p.compute_s("mm", 2e9, 1e9) == pytest.approx(1e9 / p.mem_bytes_per_s)
    arr = p.compute_s("cpu_bmm", np.array([1e9, 1e12]), np.array([1e10, 1.0]))
    assert arr[0] == pytest.approx(1e10 / p.cpu_mem_bytes_per_s) and arr[1] == pytest.approx(1e12 / p.cpu_bmm_flops)


@pytest.mark.parametrize("name", ["t4", "rtx3090", "a100-80gb", "h100-80gb"])
def test_presets_load_validate_and_cite_sources(name):
    assert name in preset_names()
    p = load_preset(name)
    assert p.source == "preset" and p.compute_device == "cuda" and p.layer_fits == ()
    assert HardwareProfile.from_json(p.to_json()) == p
    # every bandwidth and rate is physically plausible and ordered as on real machines
    assert 1e9 < p.dtoc.large_bytes_per_s < p.ctog.large_bytes_per_s < p.mem_bytes_per_s
    assert p.cpu_mm_flops < p.mm_flops and p.mem_bytes_per_s > 0 and p.cpu_mem_bytes_per_s > 0
    assert "datasheet" in p.notes and "x0." in p.notes  # sources and derating factors are stated
    assert load_profile(name.upper()) == p  # as workload presets fold case (`profile show T4` was refused)


def test_flexgen_t4_preset_matches_the_paper():
    p = load_preset("t4")
    assert p.gpu_bytes == 16 * 10**9 and p.cpu_bytes == 208 * 2**30 and p.disk_bytes == int(1.5e12)
    assert (p.dtoc.large_bytes_per_s, p.ctod.large_bytes_per_s) == (1.6e9, 1.3e9)  # FlexGen Table 24
    rtx = load_preset("rtx3090")
    assert (rtx.gpu_bytes, rtx.cpu_bytes, rtx.disk_bytes) == (24 * 10**9, 125 * 2**30, 10**12)  # Table 12


def test_fits_measured_for_a_file_price_the_registry_model_of_its_shape():
    """A profile measured with `--model SmolLM2...gguf` holds fits under the file's name; a plan
    for `--model smollm2-135m`, the same layers, priced them from the flop rates (a walkthrough:
    131 against 99 tokens/s on T). Fits now follow ModelSpec.cost_key, not the name alone."""
    from pathlib import Path

    from workloads import get_workload
    from xsimulator.analytic import simulate_analytic
    from xsimulator.policy import Policy

    prof = HardwareProfile.load(Path(__file__).parent / "data" / "perturbed_cpu_profile.json")
    spec = prof.model_for(get_model_spec("smollm2-135m"))
    gguf = "SmolLM2-135M-Instruct.Q4_1"

    def renamed(fits):
        return tuple(dataclasses.replace(f, model=gguf) if f.model == spec.name else f for f in fits)

    by_file = dataclasses.replace(prof, layer_fits=renamed(prof.layer_fits), head_fits=renamed(prof.head_fits),
                                  warm_fits=renamed(prof.warm_fits))
    keyed = dataclasses.replace(by_file, fit_keys={gguf: dataclasses.replace(spec, name=gguf, norm_eps=1e-6).cost_key()})
    assert HardwareProfile.from_json(keyed.to_json()) == keyed
    policy, work = Policy(gbs=8, nb=2, wg=1.0, wc=0.0, wd=0.0, cg=1.0, cc=0.0, cd=0.0), get_workload("T@0.5")

    def throughput(p):
        return simulate_analytic(spec, p, policy, work, 64).throughput_tokens_per_s

    assert keyed.fit_name(spec) == gguf and keyed.unfitted_note(spec) is None
    assert throughput(keyed) == throughput(prof)
    assert by_file.fit_name(spec) == spec.name and by_file.unfitted_note(spec) is not None  # an old profile
    assert throughput(by_file) != throughput(prof)
    other = prof.model_for(get_model_spec("opt-125m"))  # another shape keeps its own (missing) fits
    assert keyed.fit_name(other) == other.name


def test_parts_split_attention_and_keep_the_correction():
    fit = fit_layer(SPEC, "decode", DB, DN, decode_truth(DB, DN) * np.where(DB > 4, 1.2, 1.0), model="m",
                    dtype="float32")
    b, n = np.array([2.0, 16.0, 40.0]), np.array([300.0, 1000.0, 2048.0])
    other, attn = fit.parts_s(SPEC, b, n)
    assert np.allclose(other + attn, fit.predict_s(SPEC, b, n), rtol=1e-12)
    # the attention part is the KV-read term, corrected by the same factor
    assert np.allclose(attn, fit.coef[fit.features.index("kv_bytes")] * layer_features(SPEC, "decode", b, n)["kv_bytes"]
                       * fit.correction(b, n), rtol=1e-12)


def test_head_fit_interpolates_in_log_rows_and_round_trips():
    """Exact at the measured row counts, linear in log rows between them, linear in rows past the
    last (the last segment's slope), down to 0 below one row; kept through the profile's JSON."""
    from xprofiler.profile import HeadFit

    fit = HeadFit(model="m", dtype="float32", rows=(1, 2, 4, 8), seconds=(0.005, 0.01, 0.02, 0.024),
                  layouts=("transposed", "transposed", "rows", "rows"))
    assert fit.predict_s(np.array([1, 2, 4, 8])) == pytest.approx([0.005, 0.01, 0.02, 0.024])
    assert fit.predict_s(2 ** 1.5) == pytest.approx(0.015)  # halfway in log rows
    assert fit.predict_s(16) == pytest.approx(0.024 + 8 * 0.004 / 4)
    assert fit.predict_s(0.5) == pytest.approx(0.0025) and fit.predict_s(0) == 0.0
    assert isinstance(fit.predict_s(3), float)
    # a last measured point below the one before (noise) extends flat, never falls: a falling slope
    # priced 16 rows at 0.014 s and 1000 rows at -0.48 s
    noisy = dataclasses.replace(fit, seconds=(0.005, 0.01, 0.02, 0.018))
    assert noisy.predict_s(16) == pytest.approx(0.018) and noisy.predict_s(1000) == pytest.approx(0.018)
    for bad in (dict(rows=(2, 1)), dict(rows=(0, 1, 2, 3)), dict(seconds=(0.0, 1, 1, 1)), dict(layouts=("rows",)),
                dict(layouts=("rows", "rows", "rows", "columns"))):
        with pytest.raises(ValueError):
            HeadFit(**{**dataclasses.asdict(fit), **bad})
    prof = load_preset(preset_names()[0])
    with_fit = dataclasses.replace(prof, head_fits=(fit,))
    again = HardwareProfile.from_json(with_fit.to_json())
    assert again == with_fit and again.head_fit("m", "float32") == fit and again.head_fit("m", "float16") is None
    from xprofiler.show import summary

    assert "lm head      m (float32), ms per rows (T: transposed layout): 1: 5 T, 2: 10 T, 4: 20, 8: 24" in summary(again)


def test_warm_fit_holds_its_last_saving_and_round_trips():
    """Savings interpolate in log rows like the head fit but stop growing past the last row count
    (a compute-bound step saves no more with more rows); kept through the profile's JSON."""
    from xprofiler.profile import WarmFit

    fit = WarmFit(model="m", dtype="float32", rows=(1, 4, 16), saved_s=(0.001, 0.002, 0.0005))
    assert fit.predict_s(np.array([1, 4, 16])) == pytest.approx([0.001, 0.002, 0.0005])
    assert fit.predict_s(2) == pytest.approx(0.0015)
    assert fit.predict_s(256) == pytest.approx(0.0005) and fit.predict_s(0.5) == pytest.approx(0.0005)
    for bad in (dict(rows=(4, 1, 16)), dict(saved_s=(0.001, -1e-4, 0.0)), dict(rows=(1, 4))):
        with pytest.raises(ValueError):
            WarmFit(**{**dataclasses.asdict(fit), **bad})
    prof = dataclasses.replace(load_preset(preset_names()[0]), warm_fits=(fit,))
    again = HardwareProfile.from_json(prof.to_json())
    assert again == prof and again.warm_fit("m", "float32") == fit and again.warm_fit("m", "float16") is None
    from xprofiler.show import summary

    assert "warm weights m (float32), ms a decode layer saves with its weights cached, per rows: 1: 1, 4: 2, " \
        "16: 0.5" in summary(again)


def test_fit_warm_takes_cold_minus_warm_per_row_count_and_never_below_zero():
    from xprofiler.samples import sample_meta
    from xprofiler.sweeps import fit_warm

    spec = get_model_spec("opt-125m")

    def row(tag, b, t, count=2):
        return {**sample_meta("warm", model=spec.name, phase="decode", dtype="float32", batch=b, length=128,
                              shape=f"{tag}:{b}x128", count=count), "time_s": t * count}

    rows = [row("cold", 1, 0.002), row("warm", 1, 0.0011), row("cold", 1, 0.0022), row("warm", 1, 0.0013),
            row("cold", 8, 0.005), row("warm", 8, 0.0051),  # noise: no saving, not a negative one
            row("cold", 16, 0.006)]  # no warm sample: not fitted
    fit = fit_warm(spec, rows, "float32")
    assert fit.rows == (1, 8) and fit.saved_s == pytest.approx((0.0009, 0.0))
    assert fit_warm(spec, rows, "float16") is None


def test_fit_warm_never_saves_more_at_more_rows():
    """More rows only hide more of the weights' reads: a noisy saving at one row count between
    two of none is pooled with its neighbours (pool-adjacent-violators, worked by hand here)."""
    from xprofiler.samples import sample_meta
    from xprofiler.sweeps import fit_warm

    spec = get_model_spec("opt-125m")
    saved = {32: 0.001, 64: 0.0, 128: 0.003, 256: 0.0}  # (stop 70's profile had 1.06, 0, 2.73 and 0 ms)
    rows = [{**sample_meta("warm", model=spec.name, phase="decode", dtype="float32", batch=b, length=32,
                           shape=f"{tag}:{b}x32", count=1), "time_s": t}
            for b, s in saved.items() for tag, t in (("cold", 0.01 + s), ("warm", 0.01))]
    fit = fit_warm(spec, rows, "float32")
    assert fit.rows == (32, 64, 128, 256)
    assert fit.saved_s == pytest.approx((0.004 / 3, 0.004 / 3, 0.004 / 3, 0.0))


@pytest.mark.parametrize("edit", [
    lambda d: d["ctog"].update(large_bytes_per_s="nan"),  # was a PuLP traceback in `xsched plan`
    lambda d: d.update(disk_row_read_s="nan"),
    lambda d: d.update(mem_bytes_per_s="nan"),  # was a silent 1 x 1 plan
    lambda d: d.update(calibration={"ctog": -1.0}),  # was negative transfer times
    lambda d: d.update(calibration={"layer_overhead_s": "nan"}),
    lambda d: d.update(calibration={"ctog": 1e20}),  # was a PuLP traceback (a fault audit)
    lambda d: d.update(disk_sync_s=1e20),
])
def test_a_profile_with_a_nan_or_negative_number_is_refused(tmp_path, edit):
    from xprofiler.presets import load_profile
    from xsched.errors import UserError

    d = json.loads(dataclasses.replace(load_preset("t4"), source="measured").to_json())
    edit(d)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(UserError, match="invalid (HardwareProfile|BandwidthCurve): .*finite"):
        load_profile(str(path), check_machine=False)
