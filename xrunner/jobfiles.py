"""The files of an ``xsched run`` job: the prompt file it reads and the results file it appends to.

Results are one JSON line per finished request, appended and fsynced after every batch of
finished requests, so a crash (even SIGKILL) loses at most the requests in flight. A crash can
also leave half a line at the end; :meth:`ResultsWriter.open` with ``resume`` drops that torn
tail and truncates the file to its last complete line, then reports the ids already done, so a
resumed job writes each request exactly once: no duplicates, no gaps.

A job holds an advisory lock (``flock``) on the results file from :meth:`ResultsWriter.open` to
its end, so a second job on the same ``--out`` is refused up front instead of appending beside it
(two jobs at once wrote every id twice, and ``--resume`` then refused the file). The kernel drops
the lock of a killed process, so ``--resume`` after SIGKILL still opens it.

No torch here (the tokenizer is passed in).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from workloads.workload import MAX_SAMPLES
from xsched.errors import UserError
from xsched.fileio import (Messages, chat_messages, check_text, check_writable, describe_os_error, json_error_text,
                           jsonl_lines, read_text)
from xsched.openai_batch import openai_batch_row, openai_result_line, openai_result_rows

RequestId = str | int
# What an engine request and a results line are keyed by: the prompt's id, or (id, sample) for
# each of the ``"n"`` samples of a prompt that asks for several
ResultKey = RequestId | tuple[RequestId, int]


@dataclass(frozen=True)
class PromptRecord:
    """One line of the prompt file: text or chat messages to tokenize, or token ids given directly."""

    id: RequestId
    line: int
    prompt: str | None
    prompt_ids: tuple[int, ...] | None
    max_new_tokens: int | None
    messages: Messages | None = None
    stop: tuple[str, ...] = ()  # strings that end the request where they first appear in its text
    # this request's own "temperature", "top_k", "top_p", "seed" (over the command line's)
    sampling: tuple[tuple[str, float | int], ...] = ()
    n: int | None = None  # "n": outputs to sample for this prompt (None: the command line's --n)
    openai: bool = False  # the line was an OpenAI Batch API request
    chat_template: bool = True  # "chat_template": false feeds "prompt" text as it is (an OpenAI completion)
    logprobs: bool = False  # "logprobs": true adds this request's output tokens' log-probabilities

    def keys(self, default_n: int = 1) -> list[ResultKey]:
        """The result keys of this prompt: its id alone for one output, else ``(id, k)`` per sample."""
        n = self.n or default_n
        return [self.id] if n == 1 else [(self.id, k) for k in range(n)]

    @property
    def needs_tokenizer(self) -> bool:
        return self.prompt_ids is None

    def digest(self, options: Any = ()) -> str:
        """A short hash of the output this line asks for: its prompt, messages or ids and stop
        strings, and ``options`` (JSON-able), the settings in effect that change its tokens (the
        caller's: length, sampling, chat template; not its line number or ``"n"``, which the result
        keys tell apart, nor "logprobs", which adds to a result without changing it). Each results
        line carries it, so ``--resume`` refuses results made from another request under its id."""
        asked = (self.prompt, self.prompt_ids, self.messages, self.stop, options)
        return hashlib.sha256(json.dumps(asked, default=list).encode()).hexdigest()[:16]


def _id_key(value: ResultKey) -> str:
    """Ids compare by their JSON text, so 7 and "7" stay distinct and match what was written (a
    sample's ``(id, k)`` as ``[id, k]``, which no string or integer id spells)."""
    return json.dumps(value)


def _row_key(row: dict[str, Any]) -> str:
    """The key of a results line: its id, with its ``"sample"`` index when it has one."""
    return _id_key((row["id"], row["sample"]) if "sample" in row else row["id"])


def read_prompts(path: str | Path) -> list[PromptRecord]:
    """Parse a prompts JSONL file: ``{"id", "prompt" | "messages" | "prompt_ids", optional
    "max_new_tokens", optional "n", optional "stop", optional "temperature" / "top_k" / "top_p" / "seed",
    optional "chat_template": false (the text as it is, not as the user's turn), optional
    "logprobs": true (this request's output tokens' log-probabilities)}``;
    ``"messages"`` is a chat (``[{"role", "content"}, ...]``) that the tokenizer's chat template
    formats; ``"stop"`` a string or a list of them.

    A line of an OpenAI Batch API input file (``{"custom_id", "body": {...}}``) is read as that
    request (:func:`xsched.openai_batch.openai_batch_row`), so such a file runs as it is.

    Blank lines are skipped; other keys are allowed and ignored (a job's own metadata), but one
    spelled nearly like a key this reads (``"max_new_token"``) is warned about, once per key. Every
    problem is a one-line ``UserError`` naming the file and line.
    """
    import difflib

    p = Path(path)
    text = read_text(p, what="prompt file")
    records: list[PromptRecord] = []
    seen: dict[str, int] = {}
    near: dict[str, tuple[int, str]] = {}  # a key like one of PROMPT_KEYS: (first line, the key it is like)
    for lineno, raw in jsonl_lines(text):
        where = f"{p}:{lineno}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise UserError(f"{where}: nested too deeply; each line must be a JSON object") from None
        except ValueError as exc:  # an integer literal past Python's 4300 digits
            raise UserError(f"{where}: not valid JSON ({json_error_text(exc)})") from None
        if not isinstance(obj, dict):
            raise UserError(f"{where}: each line must be a JSON object with \"id\" and \"prompt\"")
        request = openai_batch_row(obj, where)
        openai, obj = request is not obj, request
        for k in obj.keys() - PROMPT_KEYS if not openai else ():
            if k not in near and (like := difflib.get_close_matches(str(k), sorted(PROMPT_KEYS), n=1, cutoff=0.8)):
                near[k] = (lineno, like[0])
        rid = obj.get("id")
        if "id" not in obj:  # `workload fit` and `plan` read such files; a run must tell its requests apart
            raise UserError(f"{where}: no \"id\"; give each request a unique \"id\" (a string or an integer), "
                            "by which the results and --resume tell them apart")
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise UserError(f"{where}: \"id\" must be a string or an integer, got {rid!r}")
        for name, value in (("id", rid), ("prompt", obj.get("prompt"))):
            if isinstance(value, str):  # else the results line cannot be written, after a block has run
                check_text(value, f"{where}: \"{name}\"")
        key = _id_key(rid)
        if key in seen:
            raise UserError(f"{where}: duplicate id {rid!r} (first on line {seen[key]}); ids must be unique")
        seen[key] = lineno
        prompt, ids, messages = obj.get("prompt"), obj.get("prompt_ids"), obj.get("messages")
        if sum(x is not None for x in (prompt, ids, messages)) != 1:
            raise UserError(f"{where}: give exactly one of \"prompt\" (text), \"messages\" (a chat) or "
                            "\"prompt_ids\" (token ids)")
        if messages is not None:
            messages = chat_messages(messages, where)
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise UserError(f"{where}: \"prompt\" must be a non-empty string")
        if ids is not None:
            if (not isinstance(ids, list) or not ids
                    or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
                raise UserError(f"{where}: \"prompt_ids\" must be a non-empty list of non-negative integers")
            ids = tuple(ids)
        template, logprobs = obj.get("chat_template", True), obj.get("logprobs", False)
        for name, value in (("chat_template", template), ("logprobs", logprobs)):
            if not isinstance(value, bool):
                raise UserError(f"{where}: \"{name}\" must be true or false, got {value!r}")
        mnt, n = obj.get("max_new_tokens"), obj.get("n")
        for name, value in (("max_new_tokens", mnt), ("n", n)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UserError(f"{where}: \"{name}\" must be an integer >= 1, got {value!r}")
        if n is not None and n > MAX_SAMPLES:
            raise UserError(f"{where}: \"n\" asks for {n:,} outputs of one prompt; at most {MAX_SAMPLES:,}")
        records.append(PromptRecord(id=rid, line=lineno, prompt=prompt, prompt_ids=ids, max_new_tokens=mnt,
                                    messages=messages, stop=_stop_strings(obj.get("stop"), where),
                                    sampling=_sampling_overrides(obj, where), n=n, openai=openai,
                                    chat_template=template, logprobs=logprobs))
    if not records:
        raise UserError(f"{p}: no prompts in the file (one JSON object per line)")
    for k, (lineno, like) in near.items():
        warnings.warn(f"{p}:{lineno}: key \"{k}\" is not one xsched reads and is ignored; did you mean \"{like}\"?",
                      UserWarning, stacklevel=2)
    return records


def _stop_strings(value: Any, where: str) -> tuple[str, ...]:
    """A request's ``"stop"``: one string or a list of them, each non-empty."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
        raise UserError(f"{where}: \"stop\" must be a non-empty string or a list of them, got {repr(value)[:80]}")
    return tuple(check_text(x, f"{where}: \"stop\"") for x in items)


SAMPLING_KEYS = {"temperature": float, "top_k": int, "top_p": float, "seed": int}
PROMPT_KEYS = frozenset({"id", "prompt", "prompt_ids", "messages", "max_new_tokens", "n", "stop", "chat_template",
                         "logprobs", *SAMPLING_KEYS})


def _sampling_overrides(obj: dict[str, Any], where: str) -> tuple[tuple[str, float | int], ...]:
    """A request's own sampling parameters: numbers, whole for ``top_k`` and ``seed`` (their
    ranges are checked with the command line's, when the run builds its ``SamplingParams``)."""
    out = []
    for key, kind in SAMPLING_KEYS.items():
        value = obj.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
            what = "a whole number" if kind is int else "a number"
            raise UserError(f"{where}: \"{key}\" must be {what}, got {value!r}")
        out.append((key, kind(value)))
    return tuple(out)


def tokenize_prompts(records: Iterable[PromptRecord], encode: Callable[[str | Messages, bool], list[int]] | None,
                     vocab_size: int, where: str) -> list[tuple[int, ...]]:
    """Token ids of every record: ``encode(prompt, chat_template)`` for text or messages, the
    given ids otherwise.

    ``encode`` is None for a model without a tokenizer (``random:``), which then needs
    ``prompt_ids``; ids must be below the model's vocabulary size.
    """
    out = []
    for r in records:
        if r.prompt_ids is not None:
            ids = r.prompt_ids
        elif encode is None:
            raise UserError(f"{where}:{r.line}: this model has no tokenizer (random weights); give "
                            "\"prompt_ids\" (a list of token ids) instead of \"prompt\" or \"messages\", or "
                            "pass --tokenizer DIR")
        else:
            try:
                ids = tuple(encode(r.prompt if r.messages is None else r.messages, r.chat_template))
            except UserError as exc:
                raise UserError(f"{where}:{r.line}: {exc}") from None
            if not ids:
                raise UserError(f"{where}:{r.line}: the prompt tokenizes to no tokens")
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise UserError(f"{where}:{r.line}: token id {bad[0]} is outside the model's vocabulary "
                            f"(size {vocab_size})")
        out.append(ids)
    return out


@dataclass(frozen=True)
class OpenAIOutput:
    """Results written as OpenAI Batch API output lines: one per prompt, its samples its choices."""

    model: str
    chat: frozenset[str]  # id keys of the prompts given as chats ("messages"): chat completions
    samples: dict[str, int]  # id key -> the prompt's number of outputs (its line waits for all)

    @classmethod
    def of(cls, records: Iterable[PromptRecord], default_n: int, model: str) -> "OpenAIOutput":
        records = list(records)
        return cls(model, frozenset(_id_key(r.id) for r in records if r.messages is not None),
                   {_id_key(r.id): len(r.keys(default_n)) for r in records})


class ResultsWriter:
    """Append-only JSONL of finished requests, fsynced per batch; see the module docstring.

    With ``openai``, a prompt's results wait in memory until all its samples are done, then go
    out as one OpenAI output line (a crash loses the waiting ones; ``--resume`` runs them again).
    """

    def __init__(self, path: Path, done: dict[str, dict[str, Any]], fd: int, created: bool,
                 openai: OpenAIOutput | None = None):
        self.path = path
        self._fd: int | None = fd  # locked for the writer's life
        self._created = created  # this writer created the file and has written nothing yet
        self.done = done  # id key -> the row already in the file
        self.openai = openai
        self._waiting: dict[str, list[dict[str, Any]]] = {}  # prompt id key -> its samples' rows so far

    @classmethod
    def open(cls, path: str | Path, resume: bool, openai: OpenAIOutput | None = None,
             model: str | None = None) -> "ResultsWriter":
        """Open and lock ``path`` for appending; refuse a non-empty file unless ``resume``, and a
        file another job holds, one in the other format, or one whose lines name a ``model``
        other than this job's (resumed, one file would hold two models' outputs)."""
        p = Path(path).expanduser()  # as check_writable takes it
        if p.exists() and not p.is_file() and not p.is_dir():
            raise UserError(f"{p}: not a regular file; pass another --out")
        check_writable(p, "--out")
        fd, created = _open_locked(p)
        try:
            size = os.fstat(fd).st_size
            if size and not resume:
                raise UserError(f"{p} already has results; pass --resume to continue that job or another --out path")
            done: dict[str, dict[str, Any]] = {}
            if size:
                done, keep = _read_done(p, openai is not None)
                other = next((r["model"] for r in done.values() if r.get("model", model) != model), None)
                if model is not None and other is not None:
                    raise UserError(f"{p} holds results of model {other}, this job runs {model}; resume with that "
                                    "model's plan or pass another --out")
                if keep < size:  # a torn last line from a crash: drop it
                    try:
                        os.ftruncate(fd, keep)
                    except OSError as exc:
                        raise UserError(describe_os_error(exc, p)) from None
        except BaseException:
            _release(fd, p if created else None)
            raise
        return cls(p, done, fd, created, openai)  # a job that ends before its first write removes the file it created

    def is_done(self, key: ResultKey) -> bool:
        return _id_key(key) in self.done

    def check_job(self, records: Sequence[PromptRecord], digests: Sequence[str], default_n: int,
                  prompts: str | Path) -> None:
        """Refuse rows this job does not ask for (resumed with another prompt file, ``--n`` or
        ``"n"``) and rows made from another request than this job's under their id: each row carries
        its request's :meth:`PromptRecord.digest` (``digests``, one per record; rows written before
        it existed carry none and are taken as they are)."""
        asked = {_id_key(key): (r, d) for r, d in zip(records, digests, strict=True) for key in r.keys(default_n)}
        foreign = [row for key, row in self.done.items() if key not in asked]
        if foreign:
            ids = {_id_key(r.id) for r in records}
            if all(_id_key(row["id"]) in ids for row in foreign):
                raise UserError(f"{self.path} has {len(foreign)} result(s) of samples this job does not ask for (its "
                                "prompts were run with another --n or \"n\"); resume with that job's --n or pass "
                                "another --out")
            raise UserError(f"{self.path} has {len(foreign)} result(s) whose ids are not in {prompts}; resume with "
                            "that job's prompt file or pass another --out")
        other = [(row, asked[key][0]) for key, row in self.done.items()
                 if row.get("request_digest", asked[key][1]) != asked[key][1]]
        if other and len(other) == len(self.done) > 1:  # every one: the flags, most likely, not the lines
            raise UserError(f"none of the {len(other)} results in {self.path} were made as this job asks (other "
                            "sampling, output-length, chat-template or --ignore-eos flags, or other request lines); "
                            "resume with the flags of that job or pass another --out")
        if other:
            row, r = other[0]
            more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
            raise UserError(f"{self.path}: the result of id {row['id']!r}{more} was made from another request than "
                            f"line {r.line} of {prompts} asks for (its prompt or options changed since); pass another "
                            f"--out, or delete those lines from {self.path} to run them again")

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        """Append rows (each with an ``id``), then fsync: they survive a crash. A failed append
        (a full disk) is cut back to the last complete line, so the file stays valid JSONL."""
        new: dict[str, dict[str, Any]] = {}
        lines = []
        for row in rows:
            key = _row_key(row)
            if key in self.done or key in new:
                raise RuntimeError(f"request {key} finished twice")  # an engine bug, not the user's
            new[key] = row
            if self.openai is None:
                lines.append(json.dumps(row, ensure_ascii=False) + "\n")
                continue
            prompt = _id_key(row["id"])
            waiting = self._waiting.setdefault(prompt, [])
            waiting.append(row)
            if len(waiting) == self.openai.samples[prompt]:
                del self._waiting[prompt]
                line = openai_result_line(row["id"], sorted(waiting, key=lambda r: r.get("sample", 0)),
                                          model=self.openai.model, chat=prompt in self.openai.chat,
                                          created=int(time.time()))
                lines.append(json.dumps(line, ensure_ascii=False) + "\n")
        if self.openai is not None:  # the samples still waiting for their prompt's line are not written yet
            new = {k: r for k, r in new.items() if _id_key(r["id"]) not in self._waiting}
        if not lines:
            return
        data = "".join(lines).encode("utf-8")
        if self._fd is None:
            raise RuntimeError(f"{self.path}: written after close")  # a caller's bug
        start = None
        try:
            start = os.fstat(self._fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError as exc:
            self._undo(start)
            raise UserError(describe_os_error(exc, self.path)) from None
        self.done.update(new)
        self._created = False

    def _undo(self, start: int | None) -> None:
        """Cut a failed append back to ``start`` bytes; remove a file this writer created."""
        try:
            if self._fd is not None and start is not None:
                os.ftruncate(self._fd, start)
        except OSError:
            pass
        if self._created:
            self.close()

    def close(self) -> None:
        """Release the lock; a file this writer created and never wrote to is removed first."""
        if self._fd is None:
            return
        _release(self._fd, self.path if self._created else None)
        self._fd = None

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
        if exc[0] is None and self._waiting:  # a job that ended well has every prompt's samples
            raise RuntimeError(f"{self.path}: samples of {sorted(self._waiting)[:3]} never completed their line")


def _open_locked(p: Path) -> tuple[int, bool]:
    """An append descriptor of ``p`` holding its exclusive lock, and whether this call created the
    file. Another job's lock is a one-line ``UserError``; a file unlinked between our open and our
    lock (a job that ended before writing removes its file) is opened again."""
    target = Path(os.path.realpath(p))  # a symlink is written through; the file removed is its target
    for _ in range(8):
        try:
            fd, created = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            try:
                fd, created = os.open(target, os.O_WRONLY | os.O_APPEND), False
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise UserError(describe_os_error(exc, p)) from None
        except OSError as exc:
            raise UserError(describe_os_error(exc, p)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # a filesystem without locks: go on unlocked
                return fd, created
            os.close(fd)
            raise UserError(f"{p}: another xsched run is writing this file (it holds its lock); wait for that job "
                            "to end, then --resume, or pass another --out") from None
        if _same_file(fd, target):
            return fd, created
        os.close(fd)
    raise UserError(f"{p}: the file keeps being removed and created by another process; pass another --out")


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _release(fd: int, remove: Path | None) -> None:
    """Close ``fd`` (dropping its lock), unlinking ``remove`` first while the lock still guards it."""
    try:
        target = Path(os.path.realpath(remove)) if remove is not None else None
        if target is not None and _same_file(fd, target):
            os.unlink(target)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_done(p: Path, openai: bool = False) -> tuple[dict[str, dict[str, Any]], int]:
    """Rows already in a results file and the byte length of its complete lines (``openai``: the
    file holds OpenAI output lines, each read back as its rows).

    Only the last line may be torn: a crash in the middle of an append leaves the start of a
    row (``{...``) without its newline. Any other line that is not a results row means the file
    is not ours (a one-line notes file passed as ``--out --resume`` was truncated to nothing).
    """
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise UserError(describe_os_error(exc, p)) from None
    done: dict[str, dict[str, Any]] = {}
    pos, keep = 0, 0
    lineno = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        last = end == -1
        chunk = data[pos:] if last else data[pos:end]
        lineno += 1
        row = None
        if not last:
            try:
                row = json.loads(chunk.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):  # (a JSONDecodeError is a ValueError,
                row = None  # as is an integer literal past Python's 4300 digits)
        if row is None or not isinstance(row, dict) or "id" not in row:
            if last and (not chunk.strip() or chunk.lstrip().startswith(b"{")):
                break  # a torn tail: truncate to the lines before it
            if not chunk.strip():
                pos, keep = end + 1, end + 1
                continue
            raise UserError(f"{p}:{lineno}: not a results line; pass another --out or repair the file")
        rows = openai_result_rows(row, f"{p}:{lineno}")
        if (rows is not None) != openai:
            raise UserError(f"{p}:{lineno}: a results line in {'OpenAI' if rows is not None else 'xsched'}'s format; "
                            f"resume with --out-format {'openai' if rows is not None else 'xsched'} or pass another "
                            "--out")
        for row in rows or [row]:
            key = _row_key(row)
            if key in done:
                what = f"id {row['id']!r}" + (f" sample {row['sample']!r}" if "sample" in row else "")
                raise UserError(f"{p}:{lineno}: {what} appears twice; pass another --out")
            done[key] = row
        pos = keep = end + 1
    return done, keep
