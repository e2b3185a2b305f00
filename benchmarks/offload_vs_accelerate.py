"""Tokens/s of ``xsched run`` against HF Accelerate ``disk_offload`` + transformers ``generate``.

The issue's setting: an OPT-shaped model of about 0.5B parameters with random weights, saved
once as a local HF directory (config.json + safetensors) so both sides load the same weights;
the weights live on disk; the same RAM budget is enforced on both sides by a memory cgroup that
also counts the page cache (cgroup v1 ``memory.limit_in_bytes``, else cgroup v2 ``memory.max``);
workload fixed at 32 prompt + 64 new tokens per request, greedy, EOS ignored so every request
generates all 64. Accelerate runs at a few batch sizes (its fastest is reported, with a warning
unless a larger batch tried was slower or failed: ``best_accelerate``); ``xsched run``
runs a plan whose placement fits the same budget (``CostModel.memory`` plus the measured
footprint of a bare engine process). Before each run the page cache of the weight files is
dropped (``POSIX_FADV_DONTNEED``), so reads really come from the disk.

Throughput = generated tokens / wall time of the generation (prefill included), model setup
excluded on both sides. Each side runs in its own process inside a fresh cgroup; Accelerate with
glibc's mmap threshold fixed at 1 MiB, without which it outgrows the budget (``--malloc-fix``).
With ``--profile`` (this machine's calibrated profile of the model) the xsched side runs the
fitting policy, fp32 or 4-bit KV cache, that the simulator predicts fastest.

It also prints the compute ceiling: the FLOPs of one request (prefill, then each decode step
over its growing context, LM head once per token) at the best fp32 GEMM rate measured with its threads.
No fp32 engine can beat that tokens/s with this many threads, so ceiling / Accelerate bounds the
speed-up any engine can show here, whatever it does about I/O. A second line prices the same FLOPs
at the rate of products of the xsched block's GPU batch: where the cores run 1024-row products
faster than a batch that fits the budget (bfloat16 on AMX, stop 70: 1.9-2.1 TFLOP/s against
1.1-1.2 at 128 rows), that is the bound that speaks to the run.

Both sides use every core by default (``--threads``; stop 27's final code on 2 cores, 1 -> 2
threads: Accelerate 8.60 -> 10.72 tokens/s, xsched 71.43 -> 133.15).

``--dtype bfloat16`` runs both sides in bfloat16 (weights saved so, half the bytes on disk; on a
CPU with AVX512-BF16 its GEMMs ran 2.5x the float32 rate at stop 32). Accelerate then needs more
memory per row, not less: transformers' bfloat16 LM head on the CPU expands the tied weight per
sequence during the prefill (a ``[batch, prompt, vocab]`` copy, 3.1 GB at batch 32), so batch 16
is OOM-killed in 2 GiB and its best batch is 12.

    python benchmarks/offload_vs_accelerate.py --profile cal.json   # Accelerate at 32, 48, 64 (64: OOM in 2 GiB)
    python benchmarks/offload_vs_accelerate.py                       # no profile: largest block
    python benchmarks/offload_vs_accelerate.py --accelerate-batches 8 --rows 64  # shorter (best batch unknown)
    python benchmarks/offload_vs_accelerate.py --dtype bfloat16 --accelerate-batches 8,12,16 --profile calbf.json

Accelerate's ``disk_offload`` re-reads every weight for every token, so its decode step costs about
the same at any batch that fits (32 and 48 rows: 6.3 s each, 1 thread, 2 GiB) and its tokens/s
grows with the batch until memory runs out: only a list that reaches a batch that is OOM-killed
or slower finds its best (fp32, 2 GiB: 48 rows fit with the full 96-position cache, 56 do not).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30
MiB = 2**20
# Accelerate copies every offloaded weight into a fresh tensor per forward pass. glibc's dynamic
# mmap threshold then serves those 4-16 MiB buffers from the heap and keeps the freed memory:
# measured +0.7 GiB of anonymous memory per forward pass of this model (OOM-killed within a 2 GiB
# budget in the first decode steps). A fixed threshold keeps its RSS flat (~0.3 GiB), so Accelerate
# runs with it by default. xsched does not need it (its buffers are allocated once and it stays
# within the budget without it) and is slowed by it: every transient over 1 MiB becomes a fresh
# mmap, page-faulted anew (stop 26, 128-row 4-bit-cache plan: 17.6M minor faults, 35.5 tok/s,
# against 1.7M and 40.4 tok/s with glibc's default). ``--malloc-fix`` picks the sides.
MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"
MALLOC_MMAP_THRESHOLD_BYTES = 1 * MiB
REPO = Path(__file__).resolve().parents[1]
DTYPE_SUFFIX = {"float32": "fp32", "bfloat16": "bf16"}


# ----------------------------------------------------------------------------- model on disk
def bench_spec(args: argparse.Namespace):
    from xprofiler.specs import ModelSpec

    suffix = "" if args.dtype == "float32" else "-" + DTYPE_SUFFIX[args.dtype]
    return ModelSpec(name="opt-0.5b-random" + suffix, family="opt", num_layers=args.layers, hidden=args.hidden,
                     ffn=4 * args.hidden, num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64, head_dim=64,
                     vocab_size=50272, max_positions=2048, norm="layernorm", activation="relu",
                     position="learned", tied_embeddings=True, bias=True, dtype=args.dtype, eos_token_id=2)


def make_model_dir(spec, path: Path) -> None:
    """config.json + one safetensors file per layer group, from xrunner's seeded random weights."""
    import torch
    from safetensors.torch import save_file
    from transformers import OPTConfig

    from xrunner.loaders import RandomSource, hf_state_dict, load_weights

    if (path / "config.json").exists():  # made by an earlier run: only if it is this shape
        differs = model_dir_mismatch(spec, json.loads((path / "config.json").read_text()))
        if differs:
            raise SystemExit(f"{path} holds another model ({differs}); pass another --workdir, or remove "
                             f"{path.parent} (its Accelerate offload folder too)")
        return
    path.mkdir(parents=True, exist_ok=True)
    state = hf_state_dict(load_weights(RandomSource(spec, seed=0)))
    state.pop("lm_head.weight", None)  # tied to the embeddings
    weight_map: dict[str, str] = {}
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        part = name.split(".layers.")[1].split(".")[0] if ".layers." in name else "head"
        shards.setdefault(f"model-{part}.safetensors", {})[name] = t.contiguous()
    for fname, tensors in shards.items():
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    OPTConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden, ffn_dim=spec.ffn,
              num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
              max_position_embeddings=spec.max_positions, word_embed_proj_dim=spec.hidden,
              tie_word_embeddings=True, eos_token_id=spec.eos_token_id, dtype=spec.dtype).save_pretrained(path)
    _sync_dir(path)


def model_dir_mismatch(spec, config: dict) -> str | None:
    """How a model folder's config.json differs from ``spec`` ("field found vs wanted", None if not).

    The work folder is reused between runs under one name whatever --layers / --hidden say."""
    want = {"num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden, "ffn_dim": spec.ffn,
            "num_attention_heads": spec.num_heads, "vocab_size": spec.vocab_size,
            "max_position_embeddings": spec.max_positions, "dtype": spec.dtype}
    got = {**config, "dtype": config.get("dtype", config.get("torch_dtype"))}
    return ", ".join(f"{k} {got.get(k)} vs {v}" for k, v in want.items() if got.get(k) != v) or None


def offload_index_mismatch(shapes: dict[str, tuple[int, ...]], index: dict) -> str | None:
    """How an Accelerate offload index differs from the model's tensor shapes (None: it matches)."""
    missing = sorted(set(shapes) - set(index))
    extra = sorted(set(index) - set(shapes))
    wrong = [k for k in shapes if k in index and tuple(index[k]["shape"]) != tuple(shapes[k])]
    parts = ([f"missing {missing[0]} (+{len(missing) - 1})"] if missing else []) + (
        [f"extra {extra[0]} (+{len(extra) - 1})"] if extra else []) + (
        [f"{wrong[0]} {tuple(index[wrong[0]]['shape'])} vs {tuple(shapes[wrong[0]])}"] if wrong else [])
    return "; ".join(parts) or None


def make_accelerate_offload(model_dir: Path, out: Path) -> None:
    """Accelerate's own offload folder (one .dat memmap per tensor + index.json), from the same files."""
    import accelerate
    import transformers
    from accelerate.utils import offload_weight, save_offload_index
    from safetensors import safe_open

    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    model.tie_weights()
    if (out / "index.json").exists():  # made by an earlier run: only if it holds this model's tensors
        differs = offload_index_mismatch({k: tuple(v.shape) for k, v in model.state_dict().items()},
                                         json.loads((out / "index.json").read_text()))
        if differs:
            raise SystemExit(f"{out} was made for another model ({differs}); remove it")
        return
    out.mkdir(parents=True, exist_ok=True)
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    index: dict = {}
    for key in model.state_dict():
        name = key if key in weight_map else "model.decoder.embed_tokens.weight"  # the tied LM head
        with safe_open(str(model_dir / weight_map[name]), "pt") as f:
            index = offload_weight(f.get_tensor(name), key, str(out), index)
    save_offload_index(index, str(out))
    _sync_dir(out)


def _sync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def drop_page_cache(*dirs: Path) -> None:
    """Evict these files from the page cache, so the next reads hit the disk (and the cgroup)."""
    os.sync()
    for d in dirs:
        for f in d.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def prompt_ids(n: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(4, vocab, size=(n, prompt_len)).tolist()


# ----------------------------------------------------------------------------- the RAM budget
@dataclass
class MemoryCgroup:
    """A fresh memory cgroup with a hard limit (page cache included); children join it at exec."""

    kind: str  # "v1" or "v2"
    path: Path
    limit_bytes: int

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> "MemoryCgroup":
        v1 = Path("/sys/fs/cgroup/memory")
        if (v1 / "memory.limit_in_bytes").exists():
            path = v1 / name
            path.mkdir()
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            # v1's limit counts RAM only: on a host with swap the group would page out past it.
            if (path / "memory.memsw.limit_in_bytes").exists():
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            elif Path("/proc/swaps").read_text().count("\n") > 1:
                (path / "memory.swappiness").write_text("0")
            return cls("v1", path, limit_bytes)
        for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            if (root / "cgroup.controllers").exists() and "memory" in (root / "cgroup.controllers").read_text():
                try:
                    (root / "cgroup.subtree_control").write_text("+memory")
                except OSError:
                    pass
                path = root / name
                path.mkdir()
                (path / "memory.max").write_text(str(limit_bytes))
                (path / "memory.swap.max").write_text("0") if (path / "memory.swap.max").exists() else None
                return cls("v2", path, limit_bytes)
        raise SystemExit("no memory cgroup (v1 memory controller or v2 with memory) is available here; "
                         "the RAM budget cannot be enforced, so the comparison would not be fair")

    def describe(self) -> str:
        knob = "memory.limit_in_bytes (cgroup v1)" if self.kind == "v1" else "memory.max (cgroup v2)"
        return f"{self.limit_bytes / GiB:.2f} GiB via {knob}, page cache included, no swap"

    def join(self) -> None:  # preexec_fn of the child
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        f = self.path / ("memory.max_usage_in_bytes" if self.kind == "v1" else "memory.peak")
        return int(f.read_text()) if f.exists() else None

    def oom_kills(self) -> int:
        f = self.path / ("memory.oom_control" if self.kind == "v1" else "memory.events")
        for line in f.read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def run_limited(cmd: list[str], budget: int, name: str, threads: int, timeout_s: float, malloc_fix: bool) -> dict:
    cg = MemoryCgroup.create(f"xsched-bench-{os.getpid()}-{name}", budget)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    if malloc_fix:
        env[MALLOC_ENV] = str(MALLOC_MMAP_THRESHOLD_BYTES)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, preexec_fn=cg.join,
                              timeout=timeout_s)
        out = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
    except subprocess.TimeoutExpired as exc:
        out = {"returncode": None, "stdout": exc.stdout or "", "stderr": f"timed out after {timeout_s:.0f} s"}
    out.update(process_s=time.perf_counter() - t0, cgroup_peak_bytes=cg.peak_bytes(), oom_kills=cg.oom_kills(),
               cgroup=cg.describe())
    cg.remove()
    return out


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


# ----------------------------------------------------------------------------- children
def child_accelerate(args: argparse.Namespace) -> None:
    import accelerate
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    config = transformers.AutoConfig.from_pretrained(args.model_dir)
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))
    model.tie_weights()
    accelerate.disk_offload(model, args.offload_dir, execution_device=torch.device("cpu"))
    model.eval()
    ids = torch.tensor(prompt_ids(args.batch, args.prompt_len, config.vocab_size))
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=1)
    wall = time.perf_counter() - t0
    generated = (out.shape[1] - ids.shape[1]) * out.shape[0]
    print(json.dumps({"batch": args.batch, "generated_tokens": int(generated), "wall_s": wall,
                      "tokens_per_s": generated / wall, "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def child_baseline(args: argparse.Namespace) -> None:
    """Footprint of an engine process before it allocates anything (interpreter, torch, xsched)."""
    import torch  # noqa: F401

    import xrunner.engine  # noqa: F401
    import xrunner.loaders  # noqa: F401
    import xrunner.run_cli  # noqa: F401

    print(json.dumps({"maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def stored_forms(policy, dtype: str) -> str:
    """The forms a policy stores weights and KV cache in: ``"<weights> / <KV cache>"``."""
    return f"{'4-bit' if policy.compress_weight else dtype} / {'4-bit' if policy.compress_cache else dtype}"


def best_accelerate(rows: list[dict], new_tokens: int, timeout_s: float) -> tuple[dict | None, str | None]:
    """Accelerate's fastest row, and why it may not be its best batch size (None when a larger
    batch tried brackets it: ran slower, was OOM-killed, or timed out where even finishing at the
    timeout would have been slower). Its tokens/s grows with the batch while memory lasts, so the
    fastest of a list that stops short of that is only a lower bound on its best."""
    acc = [r for r in rows if r["side"] == "accelerate"]
    ok = [r for r in acc if r["tokens_per_s"]]
    if not ok:
        return None, None
    best = max(ok, key=lambda r: r["tokens_per_s"])
    for r in acc:
        if r["batch"] <= best["batch"]:
            continue
        if r["tokens_per_s"] and r["tokens_per_s"] <= best["tokens_per_s"]:
            return best, None
        if r["status"] == "OOM-killed":
            return best, None
        if r.get("timed_out") and r["batch"] * new_tokens / timeout_s <= best["tokens_per_s"]:
            return best, None
    return best, (f"batch {best['batch']} was Accelerate's fastest and no larger batch tried ran slower or "
                  "failed for memory; its tokens/s grows with the batch while memory lasts, so the speed-up "
                  "is an upper bound: add larger batches to --accelerate-batches until one is OOM-killed")


# ----------------------------------------------------------------------------- the compute ceiling
def job_flops_per_request(spec, prompt_len: int, new_tokens: int) -> int:
    """FLOPs one request needs whatever the engine: its prefill (LM head on the last position only),
    then one decode step per further token over a growing context."""
    L = spec.num_layers
    flops = L * spec.prefill_flops_per_layer(1, prompt_len) + spec.lm_head_flops_per_token()
    for t in range(1, new_tokens):
        flops += L * spec.decode_flops_per_layer(1, prompt_len + t) + spec.lm_head_flops_per_token()
    return flops


def child_gemm(args: argparse.Namespace) -> None:
    """Best GEMM rate of these cores on the model's two MLP projections (hidden -> 4 hidden and
    back) with 1024-row chunks (``--batch``: chunks of that many rows, a GPU batch's products): the
    most a dense engine can get out of them. The profiler's own
    probe and sampler, 7 passes each, the fastest pass of either: an upper bound must not come out
    low because the machine had a slow moment (stop 45: a median of 7 passes on one projection read
    97.8 GFLOP/s in float32, below the 104.6 the engine ran the whole job at, and 110-132 just after)."""
    import torch

    from xprofiler.bench import Timer, gemm_point
    from xprofiler.samples import run_points

    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    dtype, h = getattr(torch, args.dtype), args.hidden
    rows = args.batch or 1024
    points = [gemm_point("mm", cpu, dtype, rows, h, 4 * h), gemm_point("mm", cpu, dtype, rows, 4 * h, h)]
    timed = run_points(points, Timer(cpu), passes=7, warmup=2)
    flops = {p.meta["shape"]: p.meta["flops"] for p in points}
    best = max(flops[r["shape"]] * r["count"] / r["time_s"] for r in timed)
    print(json.dumps({"gemm_flops_per_s": best}))


# ----------------------------------------------------------------------------- the xsched side
def choose_policy(spec, profile, budget: int, overhead: int, max_prompt: int, max_output: int, max_rows: int,
                  compress_options: tuple[bool, ...] = (False, True), predict: bool = False):
    """A policy whose planned gpu+cpu peak fits the budget, with as many weights in RAM as fit.

    On this CPU host the gpu and cpu tiers are both RAM; weights that fit stay on the gpu tier (no
    copy), the rest on disk. ``predict``: of the candidates (KV cache 4-bit or not, GPU batch size,
    number of GPU batches), the one ``xsimulator`` predicts fastest with this ``profile`` (a
    measured one; what ``xsched plan`` would do). Otherwise the largest block, then the largest GPU
    batch (on a CPU each GPU batch re-reads the layer's weights from RAM), the KV cache compressed
    when that buys a larger block.
    """
    from workloads.workload import fixed_workload
    from xsimulator.costmodel import CostModel
    from xsimulator.discrete_event import simulate
    from xsimulator.policy import Policy

    room = budget - overhead
    L = spec.num_layers
    workload = fixed_workload(max_prompt, max_output)
    best = None
    for compress in compress_options:
        # smaller GPU batches re-read weights more often; --rows under 16: one batch of them all
        for gbs in [g for g in (16, 32, 48, 64, 96, 128, 192, 256) if g <= max_rows] or [max_rows]:
            for nb in (1, 2, 4, 8, 16):
                if gbs * nb > max_rows:
                    continue
                for k in range(L, -1, -1):
                    wg = k / L
                    pol = Policy(gbs=gbs, nb=nb, wg=wg, wc=0.0, wd=1.0 - wg, compress_cache=compress)
                    peak = CostModel.for_policy(spec, profile, pol).peak_bytes(pol, max_prompt, max_output)
                    if peak["gpu"] + peak["cpu"] <= room:
                        if predict:
                            key = (simulate(spec, profile, pol, workload, num_requests=gbs * nb)
                                   .throughput_tokens_per_s,)
                        else:
                            key = (gbs * nb, k, gbs, -int(compress))
                        if best is None or key > best[0]:
                            best = (key, pol, peak)
                        break
    if best is None:
        raise SystemExit(f"no policy fits {room / GiB:.2f} GiB of RAM after the process footprint")
    return best[1], best[2]


def build_plan(spec, profile, policy, prompt_len: int, new_tokens: int, rows: int, path: Path) -> None:
    from workloads.workload import fixed_workload
    from xprofiler.profile import Fingerprint
    from xscheduler.plan import SLA, Plan, SearchStats
    from xsimulator.discrete_event import simulate

    workload = fixed_workload(prompt_len, new_tokens)
    predicted = simulate(spec, profile, policy, workload, num_requests=rows)
    fp = profile.fingerprint if isinstance(profile.fingerprint, Fingerprint) else profile.fingerprint
    Plan(policy=policy, predicted=predicted, sla=SLA("p99", float("inf")), model=spec, workload=workload,
         profile_name=profile.name, profile_source=profile.source, profile_fingerprint=fp,
         search=SearchStats(method="exhaustive", evaluations=1, grid_points=1, lp_solves=0, wall_s=0.0),
         version="benchmark", notes=("offload_vs_accelerate: policy chosen to fit the RAM budget",)).save(path)


# ----------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/xsched-bench-offload"),
                    help="model, offload folders and results (reused between runs)")
    ap.add_argument("--budget-gib", type=float, default=2.0, help="RAM budget of each side, page cache included")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", choices=tuple(DTYPE_SUFFIX), default="float32",
                    help="weights on disk and compute, the same on both sides (bfloat16: half the bytes; on a CPU "
                         "with AVX512-BF16 or AMX its GEMMs also run faster); --profile must be measured in it")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--accelerate-batches", default="32,48,64",
                    help="comma-separated batch sizes to try; include one past Accelerate's best (OOM-killed or "
                         "slower), or its best is not known (default: brackets it for fp32 in 2 GiB)")
    ap.add_argument("--rows", type=int, default=256, help="most requests for xsched (one block; keeps the run short)")
    ap.add_argument("--kv-compression", choices=("auto", "on", "off"), default="auto",
                    help="4-bit KV cache in the budget search: auto tries both")
    ap.add_argument("--policy", default=None,
                    help="policy for xsched instead of the budget search: a JSON file, or the JSON itself")
    ap.add_argument("--profile", default=None,
                    help="measured profile of this machine with this model (xsched profile --model <workdir>/"
                         "opt-0.5b-random): the policy is then the one it predicts fastest among those that fit. "
                         "Default: the t4 preset, used only for the memory plan and the printed prediction")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", len(os.sched_getaffinity(0)))),
                    help="torch threads of each side (default OMP_NUM_THREADS, else every core this process may use); "
                         "--profile must have been measured with as many")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--malloc-fix", choices=("accelerate", "both", "none"), default="accelerate",
                    help=f"the sides run with {MALLOC_ENV}={MALLOC_MMAP_THRESHOLD_BYTES} (without it Accelerate "
                         "grows until the cgroup kills it; xsched does not need it and runs slower with it)")
    ap.add_argument("--skip-accelerate", action="store_true")
    ap.add_argument("--skip-xsched", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=("accelerate", "baseline", "gemm"), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--offload-dir", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "accelerate":
        return child_accelerate(args)
    if args.child == "baseline":
        return child_baseline(args)
    if args.child == "gemm":
        return child_gemm(args)

    from xprofiler.presets import load_profile
    from xsimulator.policy import Policy

    budget = int(args.budget_gib * GiB)
    work = args.workdir
    spec = bench_spec(args)
    model_dir = work / spec.name
    acc_dir = work / ("accelerate-offload" + ("" if args.dtype == "float32" else "-" + DTYPE_SUFFIX[args.dtype]))
    t = time.perf_counter()
    make_model_dir(spec, model_dir)
    make_accelerate_offload(model_dir, acc_dir)
    print(f"model: {spec.name}, {spec.num_layers} layers, hidden {spec.hidden}, "
          f"{spec.num_params / 1e9:.3f} B params, {spec.weight_bytes / GiB:.2f} GiB in {spec.dtype} on disk "
          f"(prepared in {time.perf_counter() - t:.0f} s)", file=sys.stderr)
    me = [sys.executable, str(Path(__file__).resolve())]
    rows: list[dict] = []
    enforced = None

    if not args.skip_accelerate:
        for b in [int(x) for x in args.accelerate_batches.split(",") if x]:
            drop_page_cache(acc_dir)
            r = run_limited(me + ["--child", "accelerate", "--model-dir", str(model_dir), "--offload-dir", str(acc_dir),
                                  "--batch", str(b), "--prompt-len", str(args.prompt_len), "--new-tokens",
                                  str(args.new_tokens), "--threads", str(args.threads), "--dtype", args.dtype],
                            budget, f"acc{b}", args.threads, args.timeout_s, args.malloc_fix != "none")
            enforced = r["cgroup"]
            res = last_json(r["stdout"]) if r["returncode"] == 0 else None
            row = {"side": "accelerate", "batch": b, "stored": f"{args.dtype} / {args.dtype}",
                   "tokens_per_s": res["tokens_per_s"] if res else None,
                   "wall_s": res["wall_s"] if res else None, "peak_bytes": r["cgroup_peak_bytes"],
                   "timed_out": r["returncode"] is None,
                   "status": "ok" if res else ("OOM-killed" if r["oom_kills"] else
                                               f"failed: {(r['stderr'].strip().splitlines() or ['?'])[-1][:120]}")}
            rows.append(row)
            print(f"accelerate batch {b}: {row['status']}, "
                  f"{row['tokens_per_s'] or 0:.2f} tok/s, cgroup peak {(row['peak_bytes'] or 0) / GiB:.2f} GiB",
                  file=sys.stderr)

    if not args.skip_xsched:
        profile = load_profile(args.profile or "t4")
        if args.profile and profile.compute_threads not in (0, args.threads):  # 0: an old profile, unknown
            raise SystemExit(f"error: {args.profile} was measured with {profile.compute_threads} thread(s), this run "
                             f"uses {args.threads}: pass --threads {profile.compute_threads}, or profile with "
                             f"--threads {args.threads}")
        if args.profile and profile.compute_dtype not in ("", args.dtype):
            raise SystemExit(f"error: {args.profile} was measured in {profile.compute_dtype}, this run computes in "
                             f"{args.dtype}: profile with --dtype {args.dtype}")
        base = run_limited(me + ["--child", "baseline"], budget, "base", args.threads, 300, args.malloc_fix == "both")
        overhead = last_json(base["stdout"])["maxrss_bytes"] if base["returncode"] == 0 else 600 * MiB
        overhead = int(overhead * 1.15) + 256 * MiB  # allocator slack, torch workspaces, the results writer
        max_prompt, max_output = args.prompt_len, args.new_tokens
        if args.policy:
            text = args.policy if args.policy.lstrip().startswith("{") else Path(args.policy).read_text()
            policy = Policy.from_json(text)
            peak = None
        else:
            options = {"auto": (False, True), "on": (True,), "off": (False,)}[args.kv_compression]
            policy, peak = choose_policy(spec, profile, budget, overhead, max_prompt, max_output, args.rows, options,
                                         predict=args.profile is not None)
        n = min(args.rows, policy.block_size) if not args.policy else args.rows
        print(f"xsched policy ({n} requests): " + policy.describe().replace("\n", "; ")
              + (f"; planned RAM {(peak['gpu'] + peak['cpu']) / GiB:.2f} GiB + process {overhead / GiB:.2f} GiB"
                 if peak else ""), file=sys.stderr)
        job = work / "xsched-job"
        job.mkdir(exist_ok=True)
        plan_path, prompts_path = job / "plan.json", job / "prompts.jsonl"
        build_plan(spec, profile, policy, args.prompt_len, args.new_tokens, n, plan_path)
        prompts_path.write_text("".join(json.dumps({"id": i, "prompt_ids": p, "max_new_tokens": args.new_tokens}) + "\n"
                                        for i, p in enumerate(prompt_ids(n, args.prompt_len, spec.vocab_size))))
        out, result = job / "results.jsonl", job / "run.json"
        for f in (out, result):
            f.unlink(missing_ok=True)
        offload = work / "xsched-offload"
        offload.mkdir(exist_ok=True)
        drop_page_cache(model_dir)
        r = run_limited([sys.executable, "-m", "xsched", "run", "--plan", str(plan_path), "--model", str(model_dir),
                         "--prompts", str(prompts_path), "--out", str(out), "--result", str(result),
                         "--offload-dir", str(offload), "--ignore-eos", "--quiet",
                         "--weight-rounding", "nearest"],  # random weights: no calibration text to fit
                        budget, "xsched", args.threads, args.timeout_s, args.malloc_fix == "both")
        enforced = r["cgroup"]
        ok = r["returncode"] == 0 and result.exists()
        res = json.loads(result.read_text()) if ok else None
        rows.append({"side": "xsched run", "batch": f"{policy.gbs}x{policy.nb}",
                     "stored": stored_forms(policy, args.dtype),
                     "tokens_per_s": res["throughput_tokens_per_s"] if res else None,
                     "wall_s": res["wall_s"] if res else None, "peak_bytes": r["cgroup_peak_bytes"],
                     "status": "ok" if ok else ("OOM-killed" if r["oom_kills"] else
                                                f"failed: {(r['stderr'].strip().splitlines() or ['?'])[-1][:160]}"),
                     "policy": policy.to_dict(), "engine_peak_bytes": res["peak_bytes"] if res else None,
                     "predicted_tokens_per_s": (res.get("predicted") or {}).get("throughput_tokens_per_s")
                     if res and args.profile else None})

    ours = [r for r in rows if r["side"] == "xsched run" and r["tokens_per_s"]]
    best_acc, not_bracketed = best_accelerate(rows, args.new_tokens, args.timeout_s)
    speedup = ours[0]["tokens_per_s"] / best_acc["tokens_per_s"] if ours and best_acc else None

    def gemm_flops_per_s(rows: int | None = None) -> float | None:
        gemm = subprocess.run(me + ["--child", "gemm", "--hidden", str(args.hidden), "--threads", str(args.threads),
                                    "--dtype", args.dtype] + (["--batch", str(rows)] if rows else []),
                              cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO)),
                              capture_output=True, text=True)
        return (last_json(gemm.stdout) or {}).get("gemm_flops_per_s") if gemm.returncode == 0 else None

    flops = job_flops_per_request(spec, args.prompt_len, args.new_tokens)
    gemm_rate = gemm_flops_per_s()
    ceiling = args.new_tokens * gemm_rate / flops if gemm_rate else None
    # The same at the xsched block's GPU batch (see the module docstring; the probe above when that is 1024 rows)
    gbs = ours[0]["policy"]["gbs"] if ours else None
    gbs_rate = (gemm_rate if gbs == 1024 else gemm_flops_per_s(gbs)) if gbs else None
    gbs_ceiling = args.new_tokens * gbs_rate / flops if gbs_rate else None
    summary = {"model": spec.name, "params": spec.num_params, "weight_bytes": spec.weight_bytes,
               "budget": enforced, "threads": args.threads, "malloc_fix": args.malloc_fix, "prompt_len": args.prompt_len,
               "new_tokens": args.new_tokens, "rows": rows,
               "best_accelerate_batch": best_acc["batch"] if best_acc else None,
               "accelerate_batches_tried": [r["batch"] for r in rows if r["side"] == "accelerate"],
               "best_accelerate_not_bracketed": not_bracketed, "speedup": speedup,
               "flops_per_request": flops, "gemm_flops_per_s": gemm_rate, "compute_ceiling_tokens_per_s": ceiling,
               "gemm_rows_xsched": gbs, "gemm_flops_per_s_xsched_rows": gbs_rate,
               "compute_ceiling_xsched_rows_tokens_per_s": gbs_ceiling}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"\nRAM budget enforced on each side: {enforced}; torch threads {args.threads}; "
          f"{MALLOC_ENV}={MALLOC_MMAP_THRESHOLD_BYTES} for {args.malloc_fix}; "
          f"workload {args.prompt_len} prompt + {args.new_tokens} new tokens, greedy, EOS ignored")
    print(f"{'side':<12} {'batch':>8} {'weights / KV':>19} {'tokens/s':>10} {'predicted':>10} {'wall s':>9} "
          f"{'cgroup peak GiB':>16}  status")
    for r in rows:
        pred = f"{r['predicted_tokens_per_s']:.2f}" if r.get("predicted_tokens_per_s") else "-"
        print(f"{r['side']:<12} {str(r['batch']):>8} {r['stored']:>19} {r['tokens_per_s'] or 0:>10.2f} {pred:>10} "
              f"{r['wall_s'] or 0:>9.1f} {(r['peak_bytes'] or 0) / GiB:>16.2f}  {r['status']}")
    if speedup is not None:
        tried = ",".join(str(r["batch"]) for r in rows if r["side"] == "accelerate")
        print(f"\nxsched run / Accelerate at the fastest of its batch sizes tried ({best_acc['batch']} of {tried}): "
              f"{speedup:.1f}x (goal >= 20x)")
        if not_bracketed:
            print(f"WARNING: Accelerate's best batch size is not known: {not_bracketed}")
        if "4-bit" in ours[0]["stored"]:
            print(f"xsched stores {ours[0]['stored']} (weights / KV cache), Accelerate {args.dtype}: the sides differ "
                  "in the lossy 4-bit form, not only in scheduling (--kv-compression off compares like with like)")
    if ceiling is not None:
        line = (f"compute ceiling: {flops / 1e9:.1f} GFLOP per request at the best GEMM rate "
                f"({gemm_rate / 1e9:.1f} GFLOP/s, {args.threads} thread(s)) = {ceiling:.1f} tokens/s for any engine")
        if ours:
            line += f"; xsched run reaches {ours[0]['tokens_per_s'] / ceiling:.2f} of it"
        if best_acc:
            line += f"; the most any engine can beat Accelerate by here is {ceiling / best_acc['tokens_per_s']:.1f}x"
        print(line)
    if gbs_ceiling is not None:
        line = (f"at xsched's GPU batch of {gbs} rows: {gbs_rate / 1e9:.1f} GFLOP/s = {gbs_ceiling:.1f} tokens/s; "
                f"xsched run reaches {ours[0]['tokens_per_s'] / gbs_ceiling:.2f} of it")
        if best_acc:
            line += f", {gbs_ceiling / best_acc['tokens_per_s']:.1f}x Accelerate"
        print(line)


if __name__ == "__main__":
    main()
