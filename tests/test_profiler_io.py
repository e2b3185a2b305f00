"""Disk I/O around the page cache, fingerprints and the mismatch warning (no torch needed)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from xprofiler.diskio import ALIGN_BYTES, DirectFile, aligned_empty, is_aligned, probe_method, round_up
from xprofiler.fingerprint import detect_fingerprint, filesystem_type, machine_differences
from xprofiler.presets import ProfileMismatchWarning, load_preset, load_profile
from xsched.errors import UserError


def test_aligned_buffers_are_aligned_and_rounded():
    for n in (1, 4095, 4096, 10_000):
        buf = aligned_empty(n)
        assert buf.ctypes.data % ALIGN_BYTES == 0
        assert buf.nbytes == round_up(n) and buf.nbytes >= n and buf.nbytes % ALIGN_BYTES == 0
        assert buf.dtype == np.uint8


@pytest.mark.parametrize("direct", [None, False])
def test_direct_file_round_trip(tmp_path, direct):
    data = aligned_empty(3 * ALIGN_BYTES)
    data[:] = np.random.default_rng(1).integers(0, 256, data.size, dtype=np.uint8)
    with DirectFile(tmp_path / "f.bin", "rw", direct=direct) as f:
        assert f.method == "fadvise" if direct is False else f.method in ("o_direct", "fadvise")
        f.allocate(8 * ALIGN_BYTES)
        f.write_at(data, 2 * ALIGN_BYTES)
        back = aligned_empty(3 * ALIGN_BYTES)
        assert f.read_into(back, 2 * ALIGN_BYTES) == back.nbytes
        assert np.array_equal(back, data)
        # reading past the end returns only what is there
        tail = aligned_empty(4 * ALIGN_BYTES)
        assert f.read_into(tail, 6 * ALIGN_BYTES) == 2 * ALIGN_BYTES


def test_o_direct_is_used_on_this_disk(tmp_path):
    # The offload tier's figures are only honest if reads bypass the page cache; on ext4 (this
    # project's machines) that must be O_DIRECT, not the fallback.
    if filesystem_type(tmp_path) not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"tmp_path is on {filesystem_type(tmp_path)}")
    assert probe_method(tmp_path) == "o_direct"


def test_o_direct_rejects_unaligned_transfers(tmp_path):
    with DirectFile(tmp_path / "f.bin", "rw") as f:
        if f.method != "o_direct":
            pytest.skip("filesystem refuses O_DIRECT")
        buf = aligned_empty(ALIGN_BYTES)
        with pytest.raises(ValueError, match="aligned"):
            f.write_at(buf, 100)
        with pytest.raises(ValueError, match="aligned"):
            f.write_at(buf[:100], 0)
    assert is_aligned(aligned_empty(ALIGN_BYTES), 0)


def test_direct_file_errors_are_one_line_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        DirectFile(tmp_path / "missing" / "f.bin", "w")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:  # root ignores permissions, but sysfs refuses new files even to root
        with pytest.raises(UserError, match="not writable"):
            DirectFile((Path("/sys") if os.access(ro, os.W_OK) else ro) / "f.bin", "w")
    finally:
        ro.chmod(0o700)


def test_fingerprint_detects_this_machine_without_torch():
    fp = detect_fingerprint(".")
    assert fp.cpu_cores >= 1 and fp.ram_bytes > 2**28 and fp.cpu_model
    assert fp.offload_fs != ""
    assert filesystem_type("/proc") == "proc"


def test_mismatch_warning_names_the_difference(tmp_path):
    here = detect_fingerprint()
    other = dataclasses.replace(here, cpu_model="Imaginary CPU 9000", ram_bytes=here.ram_bytes * 4)
    base = load_preset("t4")
    measured = dataclasses.replace(base, source="measured", fingerprint=other)
    path = tmp_path / "p.json"
    measured.save(path)
    with pytest.warns(ProfileMismatchWarning, match="cpu_model: profile 'Imaginary CPU 9000'") as rec:
        load_profile(path)
    assert "ram_bytes" in str(rec[0].message)
    same = dataclasses.replace(measured, fingerprint=here)
    same.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(path)  # same machine: no warning
    assert machine_differences(base) == []  # presets never warn
    # the offload filesystem is compared only when the caller says which directory it uses
    # every field that changes a measurement is named: the device, its memory and torch too
    for key, value in (("gpu_name", "Imaginary GPU"), ("torch_version", "0.0.1"), ("cpu_cores", here.cpu_cores + 8),
                       ("gpu_mem_bytes", here.gpu_mem_bytes + 16 * 2**30)):
        changed = dataclasses.replace(same, fingerprint=dataclasses.replace(here, **{key: value}))
        assert [d.split(":")[0] for d in machine_differences(changed)] == [key], key
    moved = dataclasses.replace(same, fingerprint=dataclasses.replace(here, offload_fs="nfs4"))
    assert machine_differences(moved) == []
    assert any("offload_fs" in d for d in machine_differences(moved, offload_dir=tmp_path))


def test_harness_interleaves_passes_and_honours_the_deadline():
    import time

    from xprofiler.samples import Point, bandwidth_curve, rate, run_points, sample_meta, wall_clock

    calls = []
    points = [Point(sample_meta("ctog", size_bytes=2**20, count=3), lambda: calls.append("a")),
              Point(sample_meta("ctog", size_bytes=2**22, count=1), lambda: calls.append("b"))]
    rows = run_points(points, wall_clock, passes=4, warmup=1, seed=0)
    assert len(rows) == 8 and sorted(r["pass"] for r in rows) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert calls.count("a") == 3 * 5 and calls.count("b") == 5  # count calls per sample, warm-up included
    past = time.monotonic() - 1
    rows = run_points(points, wall_clock, passes=10, warmup=0, deadline=past, min_passes=2)
    assert len(rows) == 4  # only the guaranteed passes

    # summaries: a rate is amount / (statistic of the per-call time), per size
    fake = [dict(sample_meta("dtoc", size_bytes=2**20, count=2), time_s=t) for t in (2e-3, 4e-3, 8e-3)]
    fake += [dict(sample_meta("dtoc", size_bytes=2**22, count=1), time_s=t) for t in (2e-3, 3e-3, 9e-3)]
    med = bandwidth_curve(fake, "dtoc")
    assert med.sizes_bytes == (2**20, 2**22)
    assert med.bytes_per_s[0] == pytest.approx(2**20 / 2e-3) and med.large_bytes_per_s == pytest.approx(2**22 / 3e-3)
    assert bandwidth_curve(fake, "dtoc", "min").bytes_per_s[0] == pytest.approx(2**20 / 1e-3)
    flops = [dict(sample_meta("mm", shape=s, flops=f), time_s=t) for s, f, t in
             (("a", 1e9, 0.01), ("a", 1e9, 0.02), ("a", 1e9, 0.03), ("b", 4e9, 0.01))]
    assert rate(flops, "mm") == pytest.approx(np.median([1e9 / 0.02, 4e9 / 0.01]))
    with pytest.raises(ValueError, match="no samples"):
        rate(flops, "bmm")


def test_profiler_imports_without_torch_except_the_benchmarks():
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, sys, xprofiler\n"
        "for m in pkgutil.walk_packages(xprofiler.__path__, 'xprofiler.'):\n"
        "    if m.name != 'xprofiler.bench':\n"
        "        importlib.import_module(m.name)\n"
        "p = xprofiler.load_profile('t4')\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_profiles_refuse_values_that_price_steps_at_nan(tmp_path):
    """A review's hand-edited profiles: an infinite fit error gave a NaN planning margin and a
    traceback in `plan`, an infinite head time NaN throughputs (exit 0), a rate of 1e-300 or a
    transfer curve with a size of 0 NaN or log warnings. Each is now refused when read."""
    t4 = load_preset("t4").to_dict()
    cases = [
        ({"calibration_error": {"quantile": 0.9, "repeats": 3, "pairs": 20, "repeat_rel_spread": 0.1,
                                "fit_rel_error": "inf"}}, "fit_rel_error"),
        ({"calibration_error": {"quantile": 0.9, "repeats": -3, "pairs": 20, "repeat_rel_spread": None,
                                "fit_rel_error": 0.1}}, "repeats"),
        ({"mm_flops": 1e-300}, "mm_flops"),
        ({"mem_bytes_per_s": 1e-300}, "mem_bytes_per_s"),
        ({"ctog": {**t4["ctog"], "sizes_bytes": [0, 100], "bytes_per_s": [1e9, 2e9]}}, "sizes_bytes"),
        ({"ctog": {**t4["ctog"], "sizes_bytes": [100, 100], "bytes_per_s": [1e9, 2e9]}}, "sizes_bytes"),
    ]
    for change, what in cases:
        path = tmp_path / "p.json"
        path.write_text(__import__("json").dumps({**t4, **change}).replace('"inf"', "Infinity"))
        with pytest.raises(UserError, match=what):
            load_profile(path)
