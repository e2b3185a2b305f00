"""Hardware profiles for simulator tests, built directly from the dataclass (no presets needed)."""

from __future__ import annotations

from dataclasses import replace

from xprofiler.profile import BandwidthCurve, Fingerprint, HardwareProfile

GB = 10**9


def t4_like(**overrides) -> HardwareProfile:
    """A CUDA host shaped like FlexGen's T4 machine (16 GB GPU, 208 GB RAM, NVMe)."""
    fp = Fingerprint("test-cpu", 32, 208 * GB, "Tesla T4", 16 * GB, "2.13", "ext4")
    prof = HardwareProfile(
        name="t4-test", source="preset", fingerprint=fp, compute_device="cuda",
        gpu_bytes=15 * GB, cpu_bytes=200 * GB, disk_bytes=1500 * GB,
        ctog=BandwidthCurve.flat(12 * GB), gtoc=BandwidthCurve.flat(12 * GB),
        dtoc=BandwidthCurve.flat(2 * GB), ctod=BandwidthCurve.flat(1.5 * GB),
        mm_flops=40e12, bmm_flops=20e12, cpu_mm_flops=1e12, cpu_bmm_flops=0.2e12,
        quant_bytes_per_s=100 * GB, dequant_bytes_per_s=200 * GB)
    return replace(prof, **overrides)


def cpu_host(**overrides) -> HardwareProfile:
    """A CPU-only host: the gpu tier is a RAM budget and ctog/gtoc are memcpys."""
    fp = Fingerprint("test-cpu", 2, 24 * GB, None, 0, "2.13", "ext4")
    prof = HardwareProfile(
        name="cpu-test", source="measured", fingerprint=fp, compute_device="cpu",
        gpu_bytes=4 * GB, cpu_bytes=16 * GB, disk_bytes=100 * GB,
        ctog=BandwidthCurve((4096, 1 << 20), (1 * GB, 6 * GB), 8 * GB),
        gtoc=BandwidthCurve((4096, 1 << 20), (1 * GB, 6 * GB), 8 * GB),
        dtoc=BandwidthCurve.flat(1 * GB), ctod=BandwidthCurve.flat(0.8 * GB),
        mm_flops=50e9, bmm_flops=20e9, cpu_mm_flops=50e9, cpu_bmm_flops=20e9,
        quant_bytes_per_s=2 * GB, dequant_bytes_per_s=4 * GB)
    return replace(prof, **overrides)
