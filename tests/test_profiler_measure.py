"""End-to-end profiling on a tiny model, the CLI, and the failure paths (errors, Ctrl-C, disk)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from xprofiler import HardwareProfile
from xprofiler.measure import ProfileOptions, Settings, measure_profile, parse_bytes, profile_machine
from xprofiler.specs import ModelSpec
from xprofiler.sweeps import HEAD_ROWS, Grid
from xsched.errors import UserError

KiB, MiB = 2**10, 2**20

TINY = ModelSpec(name="tiny-llama", family="llama", num_layers=2, hidden=64, ffn=128, num_heads=4, num_kv_heads=2,
                 head_dim=16, vocab_size=100, max_positions=256, norm="rmsnorm", activation="silu",
                 position="rotary", tied_embeddings=True, dtype="float32")
TINY_SETTINGS = Settings(
    copy_sizes=(64 * KiB, 1 * MiB), disk_sizes=(64 * KiB, 1 * MiB), disk_file_bytes=4 * MiB, passes=2, warmup=1,
    gemm_tokens=32, gemv_bytes=1 * MiB, sweep_budget_s=4.0, sweep_min_passes=2, sweep_max_passes=3,
    grids={"prefill": Grid((1, 2, 4), (8, 32), max_tokens=64), "decode": Grid((1, 4), (16, 64))})


def _opts(tmp_path: Path, **kw) -> ProfileOptions:
    offload = tmp_path / "offload"
    offload.mkdir(exist_ok=True)
    base = dict(output=tmp_path / "p.json", offload_dir=offload, models=(TINY,), settings=TINY_SETTINGS,
                progress=False, gpu_mem_bytes=256 * MiB, cpu_mem_bytes=256 * MiB, threads=1)
    base.update(kw)
    return ProfileOptions(**base)


def test_tiny_profile_measures_every_field(tmp_path):
    opts = _opts(tmp_path)
    prof, json_path, csv_path = profile_machine(opts)
    assert list((tmp_path / "offload").iterdir()) == []  # the disk test file is gone
    again = HardwareProfile.load(json_path)
    assert again == prof
    assert prof.source == "measured" and prof.compute_device == "cpu" and prof.compute_dtype == "float32"
    assert prof.disk_io in ("o_direct", "fadvise") and prof.compute_threads >= 1 and prof.wall_s > 0
    assert (prof.gpu_bytes, prof.cpu_bytes) == (256 * MiB, 256 * MiB) and prof.disk_bytes > 0
    for ch in ("ctog", "gtoc", "dtoc", "ctod"):
        curve = prof.bandwidth(ch)
        assert curve.sizes_bytes == (64 * KiB, 1 * MiB)
        assert all(1e7 < b < 1e12 for b in curve.bytes_per_s), (ch, curve)
    for key in ("mm_flops", "bmm_flops", "cpu_mm_flops", "cpu_bmm_flops"):
        assert 1e8 < getattr(prof, key) < 1e14, key
    assert 1e6 < prof.quant_bytes_per_s and 1e6 < prof.dequant_bytes_per_s  # tiny tensors, loaded 2-core VM
    assert 1e6 < prof.kv_attend_bytes_per_s  # CPU host: the fused 4-bit decode attention is timed
    # the engine's CPU attention, on the model's kv heads: the rate of its samples' stored K/V bytes
    cpu_att = pd.read_csv(csv_path).query("bench == 'cpu_attend'")
    assert set(cpu_att["shape"]) == {f"tiny-llama:32x{TINY.num_kv_heads}x256x{TINY.head_dim}"}
    per_call = cpu_att["time_s"] / cpu_att["count"]
    assert prof.cpu_attend_bytes_per_s == pytest.approx(cpu_att["bytes"].iloc[0] / per_call.median())
    assert 1e8 < prof.mem_bytes_per_s and prof.cpu_mem_bytes_per_s == prof.mem_bytes_per_s
    assert prof.fingerprint.cpu_cores >= 1 and prof.fingerprint.offload_fs
    assert {(f.model, f.phase) for f in prof.layer_fits} == {("tiny-llama", "prefill"), ("tiny-llama", "decode")}
    assert prof.fit_keys == {"tiny-llama": TINY.cost_key()}  # so a spec of its shape under another name uses them
    for fit in prof.layer_fits:
        assert fit.n_samples == (5 if fit.phase == "prefill" else 4) and fit.samples_csv == csv_path.name
        assert fit.predict_s(TINY, 2, 32) > 0 and fit.max_rel_error >= fit.median_rel_error >= 0
    # the model's logits product: per row count, the faster of the two layouts the runner chooses from
    (head,) = prof.head_fits
    assert (head.model, head.dtype, head.rows) == ("tiny-llama", "float32", HEAD_ROWS)
    assert set(head.layouts) <= {"rows", "transposed"} and all(0 < t < 0.1 for t in head.seconds)
    # the raw samples: every repeat of every point, enough to recompute the profile
    df = pd.read_csv(csv_path)
    timed = df[df.bench == "head"].assign(t=lambda d: d.time_s / d["count"]).groupby("shape").t.median()
    assert len(timed) == 2 * len(HEAD_ROWS)
    for r, t, layout in zip(head.rows, head.seconds, head.layouts):
        mine = {k.split(":")[0]: v for k, v in timed.items() if k.split(":")[1].startswith(f"{r}x")}
        assert t == pytest.approx(min(mine.values())) and mine[layout] == pytest.approx(t)
    assert {"bench", "model", "phase", "batch", "length", "size_bytes", "count", "pass", "time_s"} <= set(df.columns)
    layer = df[df.bench == "layer"]
    assert len(layer) == 9 * layer["pass"].nunique() and layer["pass"].nunique() >= 2
    # a decode layer's saving with its weights cached, at the decode grid's rows and shortest context
    (warm,) = prof.warm_fits
    assert (warm.model, warm.dtype, warm.rows) == ("tiny-llama", "float32", (1, 4)) and min(warm.saved_s) >= 0
    assert set(df[df.bench == "warm"]["shape"]) == {"cold:1x16", "warm:1x16", "cold:4x16", "warm:4x16"}
    # The prefill grid's corner past max_tokens (4 x 32) is not measured; its correction is the
    # nearest measured node's (2 x 32), so predictions stay continuous there.
    assert not ((layer.phase == "prefill") & (layer.batch == 4) & (layer.length == 32)).any()
    (pre,) = [f for f in prof.layer_fits if f.phase == "prefill"]
    assert (pre.grid_batches, pre.grid_lengths) == ((1, 2, 4), (8, 32))
    assert pre.grid_ratio[2][1] == pre.grid_ratio[1][1] and pre.grid_ratio[2][0] != pre.grid_ratio[1][0]
    assert (df.time_s > 0).all()
    assert set(df.bench) >= {"ctog", "gtoc", "dtoc", "ctod", "mm", "bmm", "mem", "quant", "dequant", "layer",
                             "row_store", "row_dtoc", "kv_attend", "cpu_attend"}
    # KV/activation rows: a read's latency; a store's flush + per-row cost, a line through its two sizes
    per = df[df.bench == "row_dtoc"].eval("time_s / count")
    assert prof.disk_row_read_s == pytest.approx(per.median()) and 0 < per.median() < 0.1
    store = df[df.bench == "row_store"].assign(t=lambda d: d.time_s / d["count"]).groupby("batch").t.median()
    assert list(store.index) == [1, 16] and 0 < prof.disk_row_write_s < 0.1 and 0 <= prof.disk_sync_s < 0.1
    assert prof.disk_sync_s + 16 * prof.disk_row_write_s == pytest.approx(store[16])


def test_min_statistic_and_fadvise_fallback(tmp_path):
    settings = dataclasses.replace(TINY_SETTINGS, stat="min", grids={})
    prof, rows = measure_profile(_opts(tmp_path, models=(), settings=settings, direct_io=False))
    assert prof.disk_io == "fadvise" and prof.layer_fits == ()
    times = [r["time_s"] / r["count"] for r in rows if r["bench"] == "dtoc" and r["size_bytes"] == MiB]
    assert prof.dtoc.bytes_per_s[-1] == pytest.approx(MiB / min(times))
    assert "the min of" in prof.notes


def test_error_mid_run_removes_the_test_file(tmp_path, monkeypatch):
    from xprofiler import bench

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(bench, "gemm_point", boom)  # fails after the disk test file was written
    with pytest.raises(RuntimeError, match="injected"):
        profile_machine(_opts(tmp_path))
    assert list((tmp_path / "offload").iterdir()) == []
    assert not (tmp_path / "p.json").exists()  # nothing half-written


def test_ctrl_c_just_after_the_test_file_is_created_removes_it(tmp_path, monkeypatch):
    """The signal lands at the worst instant: the file exists and its descriptor is being closed
    (test_ctrl_c_removes_the_test_file found this window by chance, in one CI run of many)."""
    real_close = os.close

    def interrupted_close(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        real_close(fd)
        if Path(name).name.startswith("xsched-profile-"):
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "close", interrupted_close)
    with pytest.raises(KeyboardInterrupt):
        profile_machine(_opts(tmp_path))
    monkeypatch.undo()
    assert list((tmp_path / "offload").iterdir()) == []


def test_a_scratch_file_of_another_process_is_left_alone(tmp_path, monkeypatch):
    from xsched import fileio

    monkeypatch.setattr(fileio.secrets, "token_hex", lambda n: "same")
    (tmp_path / "x-same").write_text("theirs")
    with pytest.raises(FileExistsError):
        with fileio.scratch_file(tmp_path, "x-"):
            pass
    assert (tmp_path / "x-same").read_text() == "theirs"
    monkeypatch.undo()
    with fileio.scratch_file(tmp_path, "x-", ".bin") as path:
        assert path.exists() and path.stat().st_size == 0 and path.suffix == ".bin"
    assert not path.exists()


def test_offload_dir_problems_are_one_line_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        measure_profile(_opts(tmp_path, offload_dir=tmp_path / "missing"))
    with pytest.raises(UserError, match="not a directory"):
        (tmp_path / "file").write_text("x")
        measure_profile(_opts(tmp_path, offload_dir=tmp_path / "file"))
    with pytest.raises(UserError, match="MiB free but the disk test needs"):
        measure_profile(_opts(tmp_path, disk_test_bytes=2**60))
    with pytest.raises(UserError, match="exceed"):
        measure_profile(_opts(tmp_path, gpu_mem_bytes=2**50))
    with pytest.raises(UserError, match="directory .* does not exist"):
        profile_machine(_opts(tmp_path, output=tmp_path / "nope" / "p.json"))


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("512MiB") == 512 * MiB
    assert parse_bytes("16GB") == 16 * 10**9 and parse_bytes("8e9") == 8 * 10**9 and parse_bytes("4096") == 4096
    for bad in ("lots", "-1GiB", "0", "0.5", "nan"):  # 0.5 once truncated to 0, which read as "not given"
        with pytest.raises(UserError):
            parse_bytes(bad)


def _xsched(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xsched", *args], capture_output=True, text=True, **kw)


def _unwritable_dir(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        return Path("/sys")  # sysfs refuses new files even to root
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    return d


def test_cli_errors_exit_2_with_one_line(tmp_path):
    cases = [
        (["profile", "--offload-dir", str(_unwritable_dir(tmp_path)), "-o", str(tmp_path / "p.json")],
         "not usable"),
        (["profile", "--offload-dir", str(tmp_path), "--disk-test-bytes", "1PiB", "-o", str(tmp_path / "p.json")],
         "is not a size"),
        (["profile", "--offload-dir", str(tmp_path), "--disk-test-bytes", "1000TiB", "-o", str(tmp_path / "p.json")],
         "MiB free but the disk test needs"),
        (["profile", "--model", "gpt-9", "-o", str(tmp_path / "p.json")], "unknown model"),
        # more threads than cores: torch segfaulted at 100000, and 3 of 2 cores measured oversubscribed
        (["profile", "--quick", "--threads", "100000", "-o", str(tmp_path / "p.json")], "pass at most"),
        (["profile"], "-o profile.json"),
        (["profile", "--offload-dir", "", "-o", str(tmp_path / "p.json")], "--offload-dir: is empty"),
        (["profile", "show", str(tmp_path / "missing.json")], "neither a profile file nor a preset"),
        # a unit left off: 1 byte of RAM is no budget, and the profile would plan nothing into it
        (["profile", "--cpu-mem", "16", "-o", str(tmp_path / "p.json")], "give a unit, e.g. --cpu-mem 16GiB"),
        (["profile", "--gpu-mem", "0.5MiB", "-o", str(tmp_path / "p.json")], "give at least 1MiB"),
        (["profile", "--disk-test-bytes", "1", "-o", str(tmp_path / "p.json")], "give a unit, e.g. --disk-test-bytes 1GiB"),
        # the flag is named (it said only "'-5': a size must be at least 1 byte")
        (["profile", "--gpu-mem", "-5", "-o", str(tmp_path / "p.json")], "--gpu-mem '-5': a size must be at least 1"),
    ]
    # a gpu tier past the cpu tier's default share left a profile with 0 bytes of cpu tier
    from xprofiler.fingerprint import available_ram_bytes

    cases.append((["profile", "--gpu-mem", str(int(0.85 * available_ram_bytes())), "-o", str(tmp_path / "p.json")],
                  "leaves no cpu tier"))
    (tmp_path / "bad.json").write_text("{not json")
    cases.append((["profile", "show", str(tmp_path / "bad.json")], "not valid JSON"))
    # -o onto a file of the model it measures replaced that model's config.json with the profile
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    cases.append((["profile", "--quick", "--model", str(model), "-o", str(model / "config.json")],
                  "-o and --model are the same file"))
    # a calibration term of 1e20 broke the placement LP with a traceback (a fault audit)
    from xprofiler.presets import load_preset

    huge = json.loads(load_preset("t4").to_json())
    huge["calibration"] = {"ctog": 1e20}
    (tmp_path / "huge.json").write_text(json.dumps(huge))
    cases.append((["profile", "show", str(tmp_path / "huge.json")], "calibration term ctog=1e+20 must be a finite number from 0"))
    for args, message in cases:
        r = _xsched(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert list(tmp_path.glob("xsched-profile-*")) == []


def test_cli_show_list_and_mismatch_warning(tmp_path):
    r = _xsched("profile", "list")
    assert r.returncode == 0 and all(n in r.stdout for n in ("t4", "rtx3090", "a100-80gb",
                                                               "h100-80gb"))
    r = _xsched("profile", "list", "--json")
    assert set(json.loads(r.stdout)) == {"t4", "rtx3090", "a100-80gb", "h100-80gb"}
    r = _xsched("profile", "show", "t4")
    assert r.returncode == 0 and "Tesla T4" in r.stdout and "1.6 GB/s" in r.stdout and "Table 24" in r.stdout
    # a measured profile from another machine: shown, with a one-line warning naming the difference
    from xprofiler.fingerprint import detect_fingerprint
    from xprofiler.presets import load_preset

    here = detect_fingerprint()
    other = dataclasses.replace(load_preset("t4"), source="measured",
                                fingerprint=dataclasses.replace(here, cpu_cores=here.cpu_cores + 62))
    other.save(tmp_path / "other.json")
    r = _xsched("profile", "show", str(tmp_path / "other.json"), "--json")
    assert r.returncode == 0 and HardwareProfile.from_json(r.stdout) == other
    assert r.stderr.startswith("xsched: warning:") and "cpu_cores" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # calibration terms in seconds read as ms, factors as "x" (an overhead once read "x0.00109")
    # and a term the solver left at its bound of zero reads 0 (was "1.9e-13 ms", "x1.02e-13")
    cal = dataclasses.replace(load_preset("t4"), calibration={"layer_overhead_s": 0.00109, "gpu_compute": 1.3,
                                                              "block_layer_overhead_s": 1.9e-16,
                                                              "copy_interference": 1.02e-13})
    cal.save(tmp_path / "cal.json")
    r = _xsched("profile", "show", str(tmp_path / "cal.json"))
    assert "gpu_compute x1.3" in r.stdout and "layer_overhead_s 1.09 ms" in r.stdout, r.stdout
    assert "block_layer_overhead_s 0 ms" in r.stdout and "copy_interference x0," in r.stdout, r.stdout


def test_ctrl_c_removes_the_test_file(tmp_path):
    offload = tmp_path / "offload"
    offload.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "xsched", "profile", "--quick", "--quiet", "--offload-dir",
                             str(offload), "--disk-test-bytes", "64MiB", "-o", str(tmp_path / "p.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # default SIGINT in the child even if this session ignores it (started in the background)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not list(offload.glob("xsched-profile-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert list(offload.glob("xsched-profile-*")), "the profile never created its test file"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert list(offload.iterdir()) == [] and not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_cli_quick_profile_end_to_end(tmp_path):
    out = tmp_path / "p.json"
    r = _xsched("profile", "--quick", "--quiet", "--model", "smollm2-135m", "--offload-dir", str(tmp_path),
                "-o", str(out), timeout=400)
    assert r.returncode == 0, r.stderr
    prof = HardwareProfile.load(out)
    assert prof.layer_fit("smollm2-135m", "prefill") and prof.layer_fit("smollm2-135m", "decode")
    assert prof.wall_s <= 180 * 1.5  # goal 180 s on an idle 2-core machine; slack for a loaded one
    assert (tmp_path / "p.samples.csv").exists() and list(tmp_path.glob("xsched-profile-*")) == []


def test_rotation_copies_spill_the_cache_but_never_exceed_the_runs_own_count():
    from xprofiler.sweeps import rotation_copies

    assert rotation_copies(28e6, 260 * 2**20, 12) == 12  # opt-125m layer vs a 260 MiB L3: all layers
    assert rotation_copies(28e6, 4 * 2**20, 12) == 1  # a 4 MiB cache: one layer spills it
    assert rotation_copies(1e6, 10e6, 100) == 20  # twice the cache
    assert rotation_copies(0, 10e6, 5) == 1 and rotation_copies(1e6, 10e6, 0) == 1


def test_layer_sweep_calls_rotate_through_distinct_layers_and_caches(monkeypatch):
    """Timing one layer's weights again and again leaves them in the cache, which a run's layer
    never finds there: successive calls must read other layers' weights and KV caches."""
    import xrunner.model
    from xprofiler.sweeps import layer_points

    spec = dataclasses.replace(TINY, num_layers=4)
    seen = []
    real = xrunner.model.layer_forward

    def spy(spec_, w, hidden, pos, rope, kc, vc, mask, start):
        seen.append((id(w), kc.data_ptr(), vc.data_ptr(), tuple(kc.shape)))
        return real(spec_, w, hidden, pos, rope, kc, vc, mask, start)

    monkeypatch.setattr(xrunner.model, "layer_forward", spy)
    call_bytes = spec.with_dtype("float32").weight_bytes_per_layer + 2 * 8 * 64 * spec.kv_dim * 4
    (dec,) = layer_points(spec, "decode", [(8, 64)], "cpu", "float32", cache_bytes=int(1.2 * call_bytes))
    assert dec.meta["copies"] == 3  # 2.4 calls' operands would not spill the cache, 3 do
    for _ in range(6):
        dec.fn()
    assert seen[:3] == seen[3:]  # a cycle of three ...
    assert len({s[0] for s in seen}) == 3 and len({s[1] for s in seen} | {s[2] for s in seen}) == 6  # ... all distinct
    assert {s[3] for s in seen} == {(8, 2, 64, 16)}
    seen.clear()
    (big,) = layer_points(spec, "decode", [(8, 64)], "cpu", "float32", cache_bytes=100 * call_bytes)
    assert big.meta["copies"] == 4  # capped at the model's layer count: a run has no more to cycle through
    (small,) = layer_points(spec, "decode", [(8, 64)], "cpu", "float32", cache_bytes=0)
    small.fn(), small.fn()
    assert small.meta["copies"] == 1 and seen[0] == seen[1]
    # WarmFit's points: the same cycle cold, and with one layer's weights over the rotating caches.
    seen.clear()
    cold, warm = layer_points(spec, "decode", [(8, 64)], "cpu", "float32", cache_bytes=int(1.2 * call_bytes),
                              warm=True)
    assert (cold.meta["bench"], cold.meta["shape"], warm.meta["shape"]) == ("warm", "cold:8x64", "warm:8x64")
    for p in (cold, warm):
        for _ in range(3):
            p.fn()
    assert len({s[0] for s in seen[:3]}) == 3 and len({s[0] for s in seen[3:]}) == 1
    assert [s[1:] for s in seen[:3]] == [s[1:] for s in seen[3:]]  # the same KV caches in both


def test_a_windowed_layers_decode_is_timed_over_its_window(monkeypatch):
    """The runner's decode step of a windowed layer reads its last ``sliding_window`` positions
    only; the sweep times the same call: a windowed layer's cache view and mask are the window,
    the unwindowed layers' the whole context, and the new position keeps its rotary index."""
    import xrunner.model
    from xprofiler.sweeps import layer_points

    spec = dataclasses.replace(TINY, num_layers=2, sliding_window=16, window_layers=(True, False))
    seen = []
    real = xrunner.model.layer_forward

    def spy(spec_, w, hidden, pos, rope, kc, vc, mask, start):
        seen.append((spec_.sliding_window, kc.shape[2], vc.shape[2], mask.shape[1], start, int(pos[0, 0])))
        return real(spec_, w, hidden, pos, rope, kc, vc, mask, start)

    monkeypatch.setattr(xrunner.model, "layer_forward", spy)
    (dec,) = layer_points(spec, "decode", [(4, 64)], "cpu", "float32", cache_bytes=0)
    (pre,) = layer_points(spec, "prefill", [(4, 64)], "cpu", "float32", cache_bytes=0)
    dec.fn(), pre.fn()
    assert seen == [(16, 16, 16, 16, 15, 63), (16, 64, 64, 64, 0, 0)]
    seen.clear()
    (dec,) = layer_points(dataclasses.replace(spec, window_layers=(False, True)), "decode", [(4, 64)], "cpu",
                          "float32", cache_bytes=0)
    dec.fn()
    assert seen == [(None, 64, 64, 64, 63, 63)]


def test_head_sweep_rotates_through_copies_of_the_matrix():
    import torch

    from xprofiler.sweeps import head_points

    head_bytes = TINY.vocab_size * TINY.hidden * 4
    points = head_points(TINY, "cpu", "float32", rows=[2], cache_bytes=head_bytes)
    limit = -(-TINY.with_dtype("float32").weight_bytes // head_bytes)
    assert {p.meta["copies"] for p in points} == {min(2, limit)}
    assert {p.meta["shape"].split(":")[0] for p in points} == {"rows", "transposed"}
    out = [p.fn() for p in points for _ in range(2)]
    assert all(o.shape == (2, TINY.vocab_size) for o in out)
    assert torch.equal(out[0], out[1])  # copies hold the same values: only the addresses differ


def test_sweeps_time_the_runners_own_layer_forward(monkeypatch):
    import xrunner.model
    from xprofiler.sweeps import layer_points

    seen = []
    real = xrunner.model.layer_forward

    def spy(spec, w, hidden, pos, rope, kc, vc, mask, start):
        seen.append((tuple(hidden.shape), tuple(kc.shape), tuple(mask.shape), start))
        return real(spec, w, hidden, pos, rope, kc, vc, mask, start)

    monkeypatch.setattr(xrunner.model, "layer_forward", spy)
    pre = layer_points(TINY, "prefill", {(2, 32): 1, (1, 8): 1}, "cpu", "float32")
    dec = layer_points(TINY, "decode", [(4, 64)], "cpu", "float32")
    out = pre[0].fn()
    dec[0].fn()
    assert out.shape == (2, 32, TINY.hidden)
    # prefill: the whole prompt at cache position 0; decode: one token attending to `length` keys
    assert seen == [((2, 32, 64), (2, 2, 32, 16), (2, 32), 0), ((4, 1, 64), (4, 2, 64, 16), (4, 64), 63)]
    assert pre[0].meta["shape"] == "2x32" and dec[0].meta["phase"] == "decode"


def test_quantize_probe_times_the_kv_caches_own_write(monkeypatch):
    """The only quantization in a run's loop is the KV write, whose rotation costs about as much
    again as the quantizer: the probe times ``KVCodec.encode`` on K and V of the weight's bytes."""
    import torch

    import xrunner.engine
    from xprofiler.bench import quant_points

    calls = []
    real = xrunner.stored_forms.KVCodec.encode

    def spy(self, k, v, layer=None):
        calls.append((self.d, self.compress, tuple(k.shape), tuple(v.shape)))
        return real(self, k, v, layer)

    monkeypatch.setattr(xrunner.stored_forms.KVCodec, "encode", spy)
    points = {p.meta["bench"]: p for p in quant_points(torch.device("cpu"), torch.float32, [("m:", 64, 128, 64)])}
    parts = points["quant"].fn()
    assert calls == [(64, True, (1, 1, 64, 64), (1, 1, 64, 64))] and len(parts) == 6  # codes, mins, scales of K, V
    assert points["quant"].meta["bytes"] == points["dequant"].meta["bytes"] == 64 * 128 * 4


def test_a_gpu_profiles_compute_bound_shapes_and_keeps_the_cpu_probe_small():
    """On a GPU the CPU grids' layers are launch-bound (stop 31, H100: 0.3-0.6 ms each), which
    left the fits with no flop rate to speak of; the GPU grids reach compute-bound calls."""
    from xprofiler.measure import FULL, QUICK

    for st in (QUICK, FULL):
        assert st.for_device(False) is st
        gpu = st.for_device(True)
        for phase in ("prefill", "decode"):
            cpu_pts, gpu_pts = set(st.grids[phase].points(4096)), set(gpu.grids[phase].points(4096))
            assert cpu_pts < gpu_pts  # every CPU point, and more
            tokens = max(b * n if phase == "prefill" else b for b, n in gpu_pts)
            assert tokens > max(b * n if phase == "prefill" else b for b, n in cpu_pts)
        assert max(b * n for b, n in gpu.grids["prefill"].points(4096)) >= 65536
        assert gpu.gemm_tokens >= 4096 > st.gemm_tokens == gpu.cpu_gemm_tokens
    assert TINY_SETTINGS.for_device(True).grids == TINY_SETTINGS.grids  # no GPU grids given: the same


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_kv_probe_counts_context_bytes_in_the_compute_dtype(dtype):
    """The cost model prices the fused 4-bit attention per byte of context in the model's dtype, so
    a bfloat16 profile's probe quantizes a bfloat16 cache (mins and scales in it, as the engine's)
    and counts its K/V at 2 bytes a value: the same kernel then reads as twice as many bytes/s
    would in float32, never as the float32 rate applied to half the bytes."""
    import torch

    from xprofiler.bench import KV_PROBE_CONTEXT, KV_PROBE_HEAD_DIM, KV_PROBE_ROWS, kv_attend_point

    point = kv_attend_point("t", 2, getattr(torch, dtype))
    size = 4 if dtype == "float32" else 2
    assert point.meta["dtype"] == dtype
    assert point.meta["bytes"] == 2 * KV_PROBE_ROWS * 2 * KV_PROBE_CONTEXT * KV_PROBE_HEAD_DIM * size
    assert point.fn().shape == (KV_PROBE_ROWS, 2, KV_PROBE_HEAD_DIM)


# ------------------------------------------------------- measurement details (a fourth mutation audit)
def test_a_bandwidth_curves_large_transfer_rate_is_its_largest_sizes():
    """Past the measured sizes the rate is the largest size's, even when a middle size measured
    faster (a cache effect must not be extrapolated to gigabyte transfers)."""
    from xprofiler.samples import bandwidth_curve, sample_meta

    rows = [{**sample_meta("ctog", size_bytes=n, count=1), "time_s": t}
            for n, t in ((1024, 1e-6), (2**20, 1e-4), (2**24, 4e-3))]
    curve = bandwidth_curve(rows, "ctog")
    assert curve.large_bytes_per_s == pytest.approx(2**24 / 4e-3) and curve.large_bytes_per_s < max(curve.bytes_per_s)


def test_row_costs_with_a_negative_flush_cost_count_every_row_as_the_largest_stores_share():
    """Stores whose fitted line would give a negative fdatasync cost (noise) price no sync and each
    row at the largest store's share (no test called row_costs)."""
    from xprofiler.measure import row_costs
    from xprofiler.samples import sample_meta

    rows = [{**sample_meta("row_store", size_bytes=4096, batch=1, count=1), "time_s": 0.001},
            {**sample_meta("row_store", size_bytes=4096, batch=8, count=1), "time_s": 0.016},
            {**sample_meta("row_dtoc", size_bytes=4096, count=1), "time_s": 0.0005}]
    got = row_costs(rows)
    assert got["disk_sync_s"] == 0.0 and got["disk_row_write_s"] == pytest.approx(0.016 / 8)


def test_offload_dir_needs_the_margin_beside_the_disk_test_file(tmp_path, monkeypatch):
    """Free space for the test file but not the margin beside it is refused (the test used 2^60
    bytes, where the margin decides nothing)."""
    from collections import namedtuple

    from xprofiler import measure
    from xsched.errors import UserError

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(measure.shutil, "disk_usage", lambda p: usage(10**12, 0, 2**30 + 2**20))
    with pytest.raises(UserError, match="MiB free but the disk test needs"):
        measure.check_offload_dir(tmp_path, 2**30)


def test_disk_bench_wraps_within_its_test_file(tmp_path):
    """Timed writes wrap around inside the test file, never growing it past the bytes the
    offload-dir check reserved."""
    from xprofiler.bench import DiskBench

    n = 4096
    bench = DiskBench(tmp_path / "t.bin", 6 * n, [n], direct=False)
    try:
        bench.fill()
        write = next(p for p in bench.points() if p.meta["bench"] == "ctod")
        for _ in range(20):
            write.run()
    finally:
        bench.close()
    assert os.path.getsize(tmp_path / "t.bin") <= 6 * n
