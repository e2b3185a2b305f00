"""The ``xsched`` command: one entry point that dispatches to the stages.

Each stage package has a ``cli`` module with ``register(subparsers)``; registering must not
import torch, so handlers import their heavy modules when they run. A handler returns an exit
status; :class:`UserError` becomes a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import signal
import sys
import threading
import warnings

from xsched.errors import EXIT_USER_ERROR, UserError
from xsched.fileio import describe_os_error

# Stage CLI modules, in pipeline order; each adds its subcommands.
STAGE_CLIS: tuple[str, ...] = (
    "xprofiler.cli",
    "workloads.cli",
    "xsimulator.cli",
    "xscheduler.cli",
    "xrunner.cli",
)


class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line, like every other error (argparse prints the usage block)."""

    def error(self, message: str):  # noqa: ANN201
        self.exit(EXIT_USER_ERROR, f"xsched: error: {message}; see `{self.prog} --help`\n")


def whole_number(text: str) -> int:
    """An integer option's value; not one: argparse's "invalid <function name> value" said less."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def seed_arg(text: str) -> int:
    """``--seed``: numpy's generators take only seeds >= 0, torch's only seeds below 2**64."""
    value = whole_number(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**64), got {value}")
    return value


def json_object_arg(text: str) -> dict:
    """``--chat-template-kwargs``: a JSON object, e.g. ``{"enable_thinking": false}`` for Qwen3."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise argparse.ArgumentTypeError(f"is not valid JSON: {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"enable_thinking\": false}}', "
                                         f"got {text[:80]!r}")
    return value


def directory_arg(text: str) -> str:
    """``--offload-dir``: an empty value would be the current directory to one check and the
    system temporary directory to the code that then used it; ``~`` is the user's home."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; name a directory, or leave the option out for the system "
                                         "temporary directory")
    return os.path.expanduser(text)


# A simulated job of more requests needs gigabytes of arrays and minutes per simulation (about
# 450k requests/s); latency percentiles settle long before. `workload sample` caps at 1e8.
MAX_REQUESTS = 10**7


SAMPLES_HELP = ('outputs sampled per prompt (`xsched run`\'s "n"): requests come in runs of N with one prompt, '
                'prefilled once per GPU batch (default: the workload\'s own: a prompts file\'s mean "n", else 1)')


PREFIX_HELP = ("leading tokens the prompts share (a system prompt, the same few-shot examples; counted in the "
               "prompt lengths): prefilled once per run (default: the workload's own: the mean leading tokens "
               "a prompts file's prompts share with others, as `xsched workload fit --tokenizer` finds them, else 0)")


PREFIX_GROUPS_HELP = ("distinct prefixes of --prefix-tokens tokens that the prompts begin with, one drawn per prompt "
                      "(a job mixing task templates or system prompts): each is prefilled once per block that "
                      "holds it, once per run while the run's prefix cache has room (default: the workload's own, "
                      "as `xsched workload fit --tokenizer` finds it, else 1)")


PREFIX_SHARE_HELP = ("fraction (0..1] of the prompts that begin with one of the prefixes; the others share nothing "
                     "(default: the workload's own, as `xsched workload fit --tokenizer` finds it, else 1)")


def whole_in(text: str, lo: int, hi: int) -> int:
    """A whole-number option from ``lo`` to ``hi`` (the upper bounds keep 10^20 from a traceback)."""
    value = whole_number(text)
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"must be a whole number from {lo} to {hi:,}, got {value}")
    return value


def prefix_arg(text: str) -> int:
    """``--prefix-tokens``: a whole number >= 0 (the workload holds it to its longest prompt)."""
    from workloads.distributions import MAX_LEN_TOKENS

    return whole_in(text, 0, MAX_LEN_TOKENS)


def groups_arg(text: str) -> int:
    """``--prefix-groups``: distinct prefixes, 1 to ``MAX_PREFIX_GROUPS``."""
    from workloads.workload import MAX_PREFIX_GROUPS

    return whole_in(text, 1, MAX_PREFIX_GROUPS)


def share_arg(text: str) -> float:
    """``--prefix-share``: a fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1] (0.25, not 25), got {text}")
    return value


def samples_arg(text: str) -> int:
    """``--samples`` and ``run --n``: outputs per prompt, 1 to ``MAX_SAMPLES``."""
    from workloads.workload import MAX_SAMPLES

    return whole_in(text, 1, MAX_SAMPLES)


def requests_arg(text: str) -> int:
    """``--requests``: a job size the simulator can price, 1 to ``MAX_REQUESTS``."""
    value = whole_number(text)
    if not 1 <= value <= MAX_REQUESTS:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_REQUESTS:,}, got {value}")
    return value


def plan_requests(value: int, where: str) -> int:
    """A plan's own job size, which ``replan`` and ``simulate --plan`` price without ``--requests``:
    held to what ``--requests`` takes (a plan edited to 10^9 requests raised MemoryError)."""
    if not 1 <= value <= MAX_REQUESTS:
        raise UserError(f"{where}: the plan prices a job of {value:,} requests, outside the 1 to {MAX_REQUESTS:,} "
                        "the simulator takes; pass --requests N")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="xsched",
        description="Plan and run offline LLM batch generation under a latency SLA on limited hardware.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in STAGE_CLIS:
        importlib.import_module(name).register(sub)
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001
    return f"xsched: warning: {message}\n"


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``, a batch scheduler) unwinds like Ctrl-C: results already
    written stay, offload files are removed, and the exit status is 128 + 15."""


def _terminate(signum, frame) -> None:  # noqa: ANN001
    raise Terminated()


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not fail on the same
    full disk again ("Exception ignored ...", exit 120)."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):  # no file descriptor behind stdout (a test's capture)
        pass


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning  # warnings reach the user as one line, like errors
    for name in ("stdout", "stderr"):  # closed (`>&-`): Python leaves None, and a flush failed with a traceback
        if getattr(sys, name) is None:  # (opened now, /dev/null takes the free descriptor before any output file)
            setattr(sys, name, open(os.devnull, "w"))
    parser = build_parser()
    args = parser.parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        status = int(args.handler(args) or 0)
        sys.stdout.flush()  # buffered output meets a full disk here, not at exit
        return status
    except UserError as exc:
        print(f"xsched: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Terminated:
        print("xsched: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("xsched: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `xsched models | head`
        return 0
    except OSError as exc:  # the disk behind stdout is full (`xsched plan --json > plan.json`)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        _discard_stdout()
        print(f"xsched: error: {describe_os_error(exc, exc.filename or 'standard output')}", file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
