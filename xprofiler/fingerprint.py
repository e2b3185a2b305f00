"""Identify this machine without importing torch.

The simulator and scheduler load profiles in processes that never import torch, yet they must
warn when a profile was measured elsewhere. So the fingerprint comes from ``/proc``,
``os.sysconf``, package metadata and ``nvidia-smi`` (when present), never from torch itself.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from xprofiler.profile import Fingerprint, HardwareProfile

NVIDIA_SMI_TIMEOUT_S = 10.0


def cpu_model() -> str:
    """The ``model name`` line of /proc/cpuinfo (falls back to ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_cores() -> int:
    """CPUs this process may run on (the affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def ram_bytes() -> int:
    """Physical memory in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return ram_bytes()


def last_level_cache_bytes() -> int:
    """Size of the CPU's largest cache level per sysfs (0 when the kernel does not say).

    The layer sweeps rotate through enough distinct weights to spill it (``xprofiler.sweeps``).
    """
    best = (0, 0)
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((entry / "level").read_text().strip())
            size = (entry / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        try:
            nbytes = int(size.rstrip("KMG")) * scale
        except ValueError:
            continue
        best = max(best, (level, nbytes))
    return best[1]


def torch_version() -> str:
    """Installed torch version from package metadata, without importing torch."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def gpu_info() -> tuple[str | None, int]:
    """Name and memory in bytes of the first NVIDIA GPU per ``nvidia-smi``, or ``(None, 0)``."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, 0
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None, 0
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[1].isdigit():
            return parts[0], int(parts[1]) * 2**20  # nvidia-smi reports MiB
    return None, 0


def filesystem_type(path: str | Path) -> str:
    """Type of the filesystem holding ``path`` (``ext4``, ``tmpfs``...), from /proc/mounts."""
    try:
        target = os.path.realpath(path)
        best, fstype = "", "unknown"
        with open("/proc/mounts", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, fields[2]
        return fstype
    except OSError:
        return "unknown"


def detect_fingerprint(offload_dir: str | Path | None = None) -> Fingerprint:
    """This machine's fingerprint; ``offload_fs`` is that of ``offload_dir`` (or the cwd)."""
    gpu_name, gpu_mem = gpu_info()
    return Fingerprint(cpu_model=cpu_model(), cpu_cores=cpu_cores(), ram_bytes=ram_bytes(), gpu_name=gpu_name,
                       gpu_mem_bytes=gpu_mem, torch_version=torch_version(),
                       offload_fs=filesystem_type(offload_dir if offload_dir is not None else "."))


def machine_differences(profile: HardwareProfile, offload_dir: str | Path | None = None) -> list[str]:
    """How this machine differs from the one ``profile`` was measured on (empty for presets).

    The offload filesystem is compared only when ``offload_dir`` is given, because a profile is
    often loaded by a stage that does not use the disk.
    """
    if profile.source != "measured":
        return []
    here = detect_fingerprint(offload_dir)
    ignore = () if offload_dir is not None else ("offload_fs",)
    return profile.fingerprint.differences(here, ignore=ignore)
