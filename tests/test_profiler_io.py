"""Disk I/O around the page cache, fingerprints and the mismatch warning (no torch needed)."""

from __future__ import annotations

import dataclasses
import os
import warnings

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
    try:
        if os.access(ro, os.W_OK):  # root ignores permissions
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(UserError, match="not writable"):
            DirectFile(ro / "f.bin", "w")
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
    base = load_preset("flexgen-t4")
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
    moved = dataclasses.replace(same, fingerprint=dataclasses.replace(here, offload_fs="nfs4"))
    assert machine_differences(moved) == []
    assert any("offload_fs" in d for d in machine_differences(moved, offload_dir=tmp_path))
