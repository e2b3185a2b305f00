"""Engine throughput with weights on disk, against the roofline bound of the same plan.

The model (an OPT-shaped random model, default ~150M parameters in fp32, about 600 MB) lives
entirely on the disk tier, so every step streams every layer from disk (O_DIRECT) through the
cpu relay into the gpu-tier stage buffers while the previous layer computes. The bound, for
exactly the engine's schedule (one block, a prefill step and ``new - 1`` decode steps, each
``num_layers`` layer steps), is computed from three rates measured here, in this process, right
before the run (our own small measurement, in the style of ``xsched profile --quick``):

- disk read bandwidth: O_DIRECT reads of layer-sized records from a file in the offload dir
  (``xprofiler.diskio.DirectFile``, file filled with random bytes first), or the engine's own
  reads in its run where those went faster (the bound must not assume a slower disk than the
  engine met: ``achieved_read_bytes_per_s``);
- GEMM rate: ``F.linear`` at the step's token count through the layer's largest projection.

On a CPU host the engine reads each record straight into its stage slot (no relay memcpy), so
per step the bound is ``max(flops / gemm_rate, layers x layer_bytes / disk_bw)`` with the layers'
projection and attention FLOPs and the LM head of every row at the GEMM rate (``bound_seconds``). Norms,
activations, sampling and Python are left out, so the bound is optimistic and the ratio
honest. The same block through the in-memory loop (``xrunner.reference``, weights in RAM) is
timed too: it shows how much of the gap is compute the engine cannot avoid. Goal: measured /
bound >= 0.8.

On a CUDA device (``--device cuda``, fp16 by default) the layers stream into GPU memory: from
the pinned cpu tier (``--weights cpu``) or from disk through a pinned relay (``--weights disk``).
The bound's I/O rate is then the pinned host-to-device copy rate (cpu) or the lower of it and the
disk's (disk; optimistic: the two legs of different layers overlap at best), and the GEMM rate is
the device's. ``--ablate-overlap`` also times the engine with ``overlap=False`` (the same tasks
inline): what the copy streams and I/O threads buy.

    OMP_NUM_THREADS=1 python benchmarks/roofline.py [--layers 12 --hidden 1024 ...] [--json]
    python benchmarks/roofline.py --device cuda --weights cpu --layers 32 --hidden 4096 --ffn 16384 \\
        --heads 32 --gbs 64 --nb 4 --ablate-overlap          # an OPT-6.7B shape on one GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
import time
from pathlib import Path

import numpy as np
import torch

def measure_disk_read_bytes_per_s(directory: Path, record_bytes: int, records: int = 4,
                                  passes: int = 3) -> tuple[float, str]:
    """Best of ``passes`` O_DIRECT reads of ``records`` layer-sized records (one pass of 4 x 48 MiB
    read 2.2-2.7 GB/s on the VM, one after another)."""
    from xprofiler.diskio import DirectFile, aligned_empty, round_up

    size = round_up(record_bytes)
    buf = aligned_empty(size)
    buf[:] = np.random.default_rng(0).integers(0, 256, buf.size, dtype=np.uint8)
    path = directory / "roofline-disk-probe.bin"
    try:
        with DirectFile(path, "rw") as f:
            f.allocate(size * records)
            for i in range(records):
                f.write_at(buf, i * size)
            best = float("inf")
            for _ in range(passes):
                t0 = time.perf_counter()
                for i in range(records):
                    f.read_into(buf, i * size)
                best = min(best, time.perf_counter() - t0)
            return size * records / best, f.method
    finally:
        path.unlink(missing_ok=True)


def achieved_read_bytes_per_s(stats) -> float | None:
    """The engine's own disk reads in a run: bytes over the seconds its reads took (trace events).

    The bound must not assume a slower disk than the run itself saw: the probe before a run read
    1.97 GB/s where the engine's reads went at 2.31 (after stop 42), which made a bound the engine
    could beat (the ratio read 0.975 where the engine's own rate gives about 0.86)."""
    reads = [e for e in stats.events if e.track == "dtoc"]
    seconds, nbytes = sum(e.dur_s for e in reads), sum(e.args.get("bytes", 0) for e in reads)
    return nbytes / seconds if seconds > 0 and nbytes > 0 else None


def bound_seconds(spec, rows: int, prompt: int, new: int, gemm: dict[str, float], layer_io_s: float) -> float:
    """The roofline time of the engine's schedule: one prefill step and ``new - 1`` decode steps of
    the block, each ``max(compute, I/O)``. Compute: every layer's projection and attention FLOPs
    at the phase's GEMM rate, plus the LM head of the last position of every row (one GEMM over
    the block's rows, as the engine runs it, at ``gemm["head"]``); I/O: every layer's weights
    once (``layer_io_s`` each).

    The LM head is in the step's compute, not added after it: the engine reads the next step's
    first layers into the stage slots while it runs, so on a disk-bound plan its time hides under
    the reads (adding it outright put the bound 8% above the engine's own time on the 2-core VM:
    a ratio of 1.078)."""
    def layer_compute_s(phase: str) -> float:
        tokens = rows * (prompt if phase == "prefill" else 1)
        context = prompt if phase == "prefill" else prompt + new // 2
        return tokens * (spec.linear_flops_per_token() + spec.attention_flops_per_token(context)) / gemm[phase]

    def step_s(phase: str) -> float:
        head = rows * spec.lm_head_flops_per_token() / gemm["head"]
        return max(spec.num_layers * layer_compute_s(phase) + head, spec.num_layers * layer_io_s)

    return step_s("prefill") + (new - 1) * step_s("decode")


def measure_gemm_flops(tokens: int, d_in: int, d_out: int, dtype: torch.dtype, device: torch.device,
                       transposed: bool = False) -> float:
    """FLOP/s of ``F.linear`` of ``tokens`` rows through a ``d_out x d_in`` matrix, best of 10;
    ``transposed``: the matrix stored column-major (a layout the engine may keep its LM head in)."""
    x = torch.randn(tokens, d_in, device=device).to(dtype)
    w = (torch.randn(d_out, d_in, device=device) * 0.02).to(dtype)
    if transposed:
        w = w.t().contiguous().t()
    torch.nn.functional.linear(x, w)
    reps = 20 if device.type == "cuda" else 1  # one GPU GEMM is too short to time alone
    best = float("inf")
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(x, w)
        sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2.0 * tokens * d_in * d_out / best


def measure_ctog_bytes_per_s(nbytes: int, device: torch.device) -> float:
    """Pinned host -> device copy of one layer's bytes, best of 5 (the engine's cpu tier is pinned)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--gbs", type=int, default=4)
    ap.add_argument("--nb", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each side; the best counts")
    ap.add_argument("--offload-dir", default=None, help="directory on the disk to test (default: a temp dir)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--weights", choices=("disk", "cpu"), default="disk",
                    help="tier of every layer's weights (cpu only makes sense with --device cuda)")
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                    help="weights and compute (default: float16 on cuda, else float32)")
    ap.add_argument("--ablate-overlap", action="store_true", help="also time the engine with overlap off")
    ap.add_argument("--cuda-sync", choices=("item", "step"), default="item",
                    help="how the engine waits for a CUDA device (Engine's cuda_sync)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if args.weights == "cpu" and not cuda:
        raise SystemExit("--weights cpu: on a CPU host the cpu and gpu tiers are both RAM; use --device cuda")
    dtype_name = args.dtype or ("float16" if cuda else "float32")

    from xprofiler.specs import ModelSpec
    from xrunner.engine import Engine, Request
    from xrunner.loaders import RandomSource
    from xrunner.tiers import nbytes_of
    from xsimulator.policy import Policy

    spec = ModelSpec(name="opt-roofline", family="opt", num_layers=args.layers, hidden=args.hidden, ffn=args.ffn,
                     num_heads=args.heads, num_kv_heads=args.heads, head_dim=args.hidden // args.heads,
                     vocab_size=50272, max_positions=2048, norm="layernorm", activation="relu", position="learned",
                     tied_embeddings=True, bias=True, dtype=dtype_name)
    on_disk = args.weights == "disk"
    policy = Policy(gbs=args.gbs, nb=args.nb, wg=0.0, wc=0.0 if on_disk else 1.0, wd=1.0 if on_disk else 0.0)
    rows = args.gbs * args.nb
    rng = np.random.default_rng(0)
    requests = [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, spec.vocab_size, args.prompt)), args.new)
                for i in range(rows)]
    tmp = tempfile.TemporaryDirectory(dir=args.offload_dir)
    offload = Path(tmp.name)
    layer_bytes = spec.weight_bytes_per_layer
    dtype = getattr(torch, dtype_name)

    # Rates, measured now on this machine.
    disk_bw, method = (measure_disk_read_bytes_per_s(offload, layer_bytes, max(4, spec.num_layers)) if on_disk
                       else (None, "-"))
    ctog_bw = measure_ctog_bytes_per_s(layer_bytes, device) if cuda else None  # None: not on the path
    gemm = {phase: measure_gemm_flops(tokens, spec.hidden, spec.ffn, dtype, device)
            for phase, tokens in (("prefill", args.gbs * args.prompt), ("decode", args.gbs))}
    # The LM head: one product over the block's rows, in the faster of the two layouts.
    gemm["head"] = max(measure_gemm_flops(rows, spec.hidden, spec.vocab_size, dtype, device, transposed=t)
                       for t in (False, True))
    generated = rows * args.new

    # The same block through the in-memory loop (weights in RAM, nothing offloaded), GPU batch by
    # GPU batch: the compute the engine cannot avoid, attention, norms and LM head included.
    from xrunner.reference import generate
    from xrunner.loaders import load_weights

    # Runs alternate and each side keeps its best (fastest) repeat: the machine may be shared.
    weights = load_weights(RandomSource(spec, seed=0), device=device, head_rows=args.gbs)
    in_memory_s, stats, inline = float("inf"), None, None
    with Engine(RandomSource(spec, seed=0), policy, max_prompt=args.prompt, max_output=args.new,
                offload_dir=offload, device=device, cuda_sync=args.cuda_sync, record_trace=on_disk) as eng:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for b in range(args.nb):
                generate(weights, [r.prompt_ids for r in requests[b * args.gbs:(b + 1) * args.gbs]], args.new)
            sync(device)
            in_memory_s = min(in_memory_s, time.perf_counter() - t0)
            if cuda:  # hand the in-memory loop's cached blocks back: the engine's reservation is its own
                torch.cuda.empty_cache()
            run = eng.run(requests)
            if stats is None or run.wall_s < stats.wall_s:
                stats = run
            if args.ablate_overlap:
                eng.reconfigure(replace(policy, overlap=False))
                run = eng.run(requests)
                inline = run if inline is None or run.wall_s < inline.wall_s else inline
                eng.reconfigure(policy)
    # The in-memory weights stay allocated on the device during the engine's runs; not the engine's.
    resident_bytes = nbytes_of(*weights.head.values(), *(t for layer in weights.layers for t in layer.values()))
    engine_reserved = (stats.device_reserved_peak_bytes - resident_bytes) if stats.device_reserved_peak_bytes else None
    del weights
    tmp.cleanup()
    # The disk rate of the bound: the faster of the probe's and the engine's own reads in its best run.
    achieved_bw = achieved_read_bytes_per_s(stats) if on_disk else None
    disk_bound_bw = max(bw for bw in (disk_bw, achieved_bw) if bw is not None) if on_disk else None
    io_bw = min(bw for bw in (disk_bound_bw, ctog_bw) if bw is not None)
    bound_s = bound_seconds(spec, rows, args.prompt, args.new, gemm, layer_bytes / io_bw)
    measured_tps = stats.generated_tokens / stats.wall_s
    bound_tps = generated / bound_s
    ratio = measured_tps / bound_tps
    result = {
        "device": str(device), "dtype": dtype_name, "weights_tier": args.weights, "cuda_sync": args.cuda_sync,
        "model_bytes": layer_bytes * spec.num_layers, "disk_io": method,
        "disk_read_bytes_per_s": disk_bw, "engine_disk_read_bytes_per_s": achieved_bw, "ctog_bytes_per_s": ctog_bw,
        "gemm_flops_prefill": gemm["prefill"], "gemm_flops_decode": gemm["decode"], "gemm_flops_head": gemm["head"],
        "bound_s": bound_s, "in_memory_s": in_memory_s, "wall_s": stats.wall_s,
        "generated_tokens": stats.generated_tokens,
        "measured_tokens_per_s": measured_tps, "bound_tokens_per_s": bound_tps, "ratio": ratio,
        "busy_s": stats.busy_s, "peak_bytes": stats.peak_bytes, "planned_peak_bytes": stats.planned_peak_bytes,
        "engine_reserved_peak_bytes": engine_reserved,
        "overlap_off_wall_s": inline.wall_s if inline else None,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    where = f"on disk ({method})" if on_disk else "on the pinned cpu tier"
    print(f"model: {spec.num_layers} layers x {layer_bytes / 2**20:.1f} MiB {dtype_name} {where}, compute on "
          f"{device}; block {rows} rows, prompt {args.prompt}, {args.new} new tokens")
    rates = ([f"disk read {disk_bw / 1e9:.2f} GB/s (probe)"] if disk_bw else []) + (
        [f"{achieved_bw / 1e9:.2f} GB/s (the engine's own reads; the bound takes the faster)"] if achieved_bw else []) + (
        [f"pinned host->device {ctog_bw / 1e9:.2f} GB/s"] if ctog_bw else [])
    print(f"measured rates: {', '.join(rates)}, "
          f"GEMM {gemm['prefill'] / 1e9:.1f} GFLOP/s (prefill) / {gemm['decode'] / 1e9:.1f} (decode) / "
          f"{gemm['head'] / 1e9:.1f} (LM head, {rows} rows)")
    print(f"{'':24}{'wall s':>10}{'tokens/s':>12}")
    print(f"{'bound (same plan)':24}{bound_s:>10.2f}{bound_tps:>12.2f}")
    print(f"{'in-memory loop (RAM)':24}{in_memory_s:>10.2f}{generated / in_memory_s:>12.2f}")
    print(f"{'engine (measured)':24}{stats.wall_s:>10.2f}{measured_tps:>12.2f}")
    if inline is not None:
        print(f"{'engine, overlap off':24}{inline.wall_s:>10.2f}{generated / inline.wall_s:>12.2f}")
    print(f"ratio measured / bound: {ratio:.3f} (goal >= 0.8); engine / in-memory loop: "
          f"{in_memory_s / stats.wall_s:.3f}")
    print("busy seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in stats.busy_s.items()))
    mib = 2**20
    print("peak / planned bytes: " + ", ".join(f"{t} {stats.peak_bytes[t] / mib:.0f} / "
                                              f"{stats.planned_peak_bytes[t] / mib:.0f} MiB" for t in stats.peak_bytes)
          + (f"; CUDA allocator reserved for the engine {engine_reserved / mib:.0f} MiB "
             f"(the process's peak less the in-memory loop's weights)" if engine_reserved else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
