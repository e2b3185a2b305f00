"""Small file helpers shared by every stage: atomic writes with one-line errors."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from xsched.errors import UserError


def describe_os_error(exc: OSError, path: Path | str) -> str:
    """One line that says what went wrong with ``path`` and what to do about it."""
    if exc.errno == errno.ENOSPC:
        return f"{path}: no space left on the device; free some space or write elsewhere"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{path}: not writable ({exc.strerror}); choose another location"
    if exc.errno == errno.ENOENT:
        if Path(path).is_dir():  # (/proc: it exists, but a file cannot be created in it)
            return f"{path}: files cannot be created there ({exc.strerror}); choose another location"
        return f"{path}: directory does not exist; create it first"
    return f"{path}: {exc.strerror or exc}"


@contextmanager
def scratch_file(directory: Path | str, prefix: str, suffix: str = "") -> Iterator[Path]:
    """A new empty file in ``directory``, removed on leaving the block. Its name is drawn before
    the file is created, and the removal covers the creation: a Ctrl-C at any instant leaves
    nothing behind (``tempfile.mkstemp`` creates the file before its caller knows the name)."""
    path = Path(directory) / f"{prefix}{secrets.token_hex(8)}{suffix}"
    ours = True
    try:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:  # another process's file of the same random name is not ours to remove
            ours = False
            raise
        yield path
    finally:
        if ours:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def check_writable(path: Path | str, flag: str) -> None:
    """Fail before long work if ``path`` (given as ``flag``) cannot be written: its directory is
    missing or read-only, or it is a directory itself."""
    if not str(path):
        raise UserError(f"{flag} needs a file path, got an empty string")
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode  # follows a symlink: the output goes to its target
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # a name too long, a symlink loop, a file used as a directory
        raise UserError(f"{path}: cannot be written ({exc.strerror or exc}); pass another {flag}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise UserError(f"{path}: is a directory; pass a file path to {flag}")
    if mode is not None and not stat.S_ISREG(mode):  # a device or FIFO would be replaced by a plain file
        raise UserError(f"{path}: is not a regular file; pass a file path to {flag}")
    parent = p.resolve().parent
    if not parent.is_dir():
        raise UserError(f"{path}: directory {parent} does not exist; create it or pass another {flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{path}: directory {parent} is not writable; pass another {flag}")
    try:  # permission bits do not tell for root, a read-only mount or a pseudo-filesystem (/proc)
        with scratch_file(parent, ".xsched-check-"):
            pass
    except OSError as exc:
        raise UserError(f"{path}: cannot create a file in {parent} ({exc.strerror or exc}); "
                        f"pass another {flag}") from None


def atomic_write_all(files: Sequence[tuple[Path | str, bytes]]) -> None:
    """Write several files all or none: each goes to a temporary file beside it (fsynced) and
    only when every one is staged are they renamed into place, so a full disk while writing the
    last one leaves every earlier output as it was."""
    staged: list[Path] = []
    path: Path | str = ""
    # A symlink is written through (its target replaced), never replaced by a plain file; "~" is
    # the home directory, as check_writable took it.
    files = [(Path(os.path.realpath(os.path.expanduser(p))), data) for p, data in files]
    try:
        for path, data in files:
            target = Path(path)
            tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
            # The mode open() would give, or the replaced file's (both less the umask); mkstemp's is 0o600.
            mode = target.stat().st_mode & 0o777 if target.exists() else 0o666
            staged.append(tmp)  # before it exists: a Ctrl-C just after the open still removes it
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        for tmp, (path, _) in zip(staged, files):
            os.replace(tmp, path)
        staged = []
    except OSError as exc:
        raise UserError(describe_os_error(exc, path)) from None
    finally:
        for tmp in staged:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def read_text(path: Path | str, encoding: str = "utf-8-sig", what: str = "file") -> str:
    """A text file's contents, or a one-line UserError for any reason it cannot be read (``what``:
    the kind of file the command wanted, for its words). A UTF-8 byte-order mark (editors on
    Windows write one) is dropped: json refused it in Python's words."""
    try:
        return Path(path).read_text(encoding=encoding)
    except FileNotFoundError:
        raise UserError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise UserError(f"{path}: a directory, not a {what}; pass the {what}'s path") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except OSError as exc:  # no permission, a name too long, a symlink loop, ...
        raise UserError(f"{path}: cannot read ({exc.strerror or exc.__class__.__name__})") from None


def json_error_text(exc: ValueError | RecursionError) -> str:
    """What ``json.loads`` refused, for a one-line error: its message, less the advice to raise the
    interpreter's limit when an integer literal passes Python's 4300 digits (a ValueError, where
    malformed text is a JSONDecodeError)."""
    return str(exc).split(";")[0]


def path_exists(path: Path | str) -> bool:
    """``Path.exists`` that answers False, not OSError, for a name too long to be a file."""
    try:
        return Path(path).exists()
    except OSError:
        return False


def check_text(value: str, where: str, errors: str = "strict") -> str:
    """``value``, refused with one line if it holds a lone surrogate: a ``"\\ud800"`` escape is
    valid JSON but no text, and printing, writing or tokenizing it raised a traceback.
    ``errors="surrogateescape"`` lets through the escapes Python makes of bytes that are not UTF-8
    (file names, argv), which write back as the bytes they were."""
    try:
        value.encode("utf-8", errors)
    except UnicodeEncodeError:
        raise UserError(f"{where} holds a lone surrogate escape (\\ud800-\\udfff alone), which is not text; "
                        "fix or remove it") from None
    return value


Messages = tuple[tuple[str, str], ...]  # a chat request's (role, content) turns


def chat_messages(value: Any, where: str) -> Messages:
    """A request's ``"messages"`` (the chat form of OpenAI-style batch files: a list of
    ``{"role", "content"}`` objects, e.g. a system prompt then the user's turn) as (role, content)
    pairs, or a one-line error naming ``where``."""
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    turns = []
    for i, turn in enumerate(value, start=1):
        role = turn.get("role") if isinstance(turn, dict) else None
        content = turn.get("content") if isinstance(turn, dict) else None
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise UserError(f"{where}: message {i} must be an object with a \"role\" (non-empty text) and a "
                            f"\"content\" (text), got {str(turn)[:80]}")
        turns.append((check_text(role, f"{where}: message {i}'s role"),
                      check_text(content, f"{where}: message {i}'s content")))
    return tuple(turns)


def file_or_none(arg: str | None) -> str | None:
    """``arg`` where it names a regular file, else None (a preset name, JSON text, a directory)."""
    return arg if arg and path_exists(arg) and Path(arg).expanduser().is_file() else None


def files_of(flag: str, arg: str | None) -> list[tuple[str, Path]]:
    """An argument that may name a file or a directory (a model), as inputs for
    :func:`separate_files`: the file, or each file directly in the directory (`profile -o
    DIR/config.json` replaced the config of the model it measured). Anything else gives none."""
    if not arg or not path_exists(arg):
        return []
    path = Path(arg).expanduser()
    try:
        return [(flag, p) for p in path.iterdir() if p.is_file()] if path.is_dir() else [(flag, path)]
    except OSError:  # an unreadable directory: the command's own read says so
        return []


def separate_files(outputs: Sequence[tuple[str, Path | str | None]],
                   inputs: Sequence[tuple[str, Path | str | None]] = ()) -> None:
    """Refuse an output that names another output (one would overwrite the other) or one of the
    command's input files, which it would replace with another kind of file (`plan -o` on its
    `--profile` replaced a measured profile with the plan; `run --result` on `--out` every result
    line with the summary). Inputs are paths: pass an argument that may be a preset name or JSON
    text through :func:`file_or_none`."""
    files: dict[str, str] = {}
    for flag, path in inputs:
        if path:
            files.setdefault(os.path.realpath(Path(path).expanduser()), flag)
    written: dict[str, str] = {}
    for flag, path in outputs:
        if not path:
            continue
        key = os.path.realpath(Path(path).expanduser())
        if key in written:
            raise UserError(f"{written[key]} and {flag} both write {path}; give them different files")
        if key in files:
            raise UserError(f"{flag} and {files[key]} are the same file ({path}); give {flag} its own path")
        written[key] = flag


def jsonl_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) of each non-blank line. Lines end at "\\n" only: a JSON string
    may hold a raw U+2028 or U+0085 (``json.dumps(ensure_ascii=False)`` writes them), where
    ``str.splitlines()`` would break it."""
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield lineno, line


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename."""
    atomic_write_all([(path, data)])
    return Path(path)


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))
