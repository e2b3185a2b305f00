"""JSON round-trip for the frozen dataclasses that stages hand to each other.

A contract class sets ``SCHEMA = "xsched.<Name>/<version>"`` and inherits :class:`Contract`.
Encoding walks the dataclass fields; decoding is driven by the field type hints, so nested
contracts, tuples, optionals, literals and ``dict[str, X]`` need no per-class code. Unknown
or missing keys, a wrong schema, or a value of the wrong type raise :class:`UserError` naming
the field, because these files are written and edited by people.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

from xsched.errors import UserError
from xsched.fileio import atomic_write_bytes, check_text, json_error_text, read_text

T = TypeVar("T", bound="Contract")

_SCHEMA_KEY = "schema"
_FLOAT_MAX = sys.float_info.max


def to_jsonable(value: Any) -> Any:
    """Plain JSON value for a dataclass, tuple, dict or scalar (no schema key for nested)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan": JSON has no literal for them
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return to_jsonable(value.item())
    return value


_QUOTED_CHARS = 80  # of a wrong value in an error: a whole file's array made a 4 MB line


def _quoted(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "..."


def _fail(where: str, expected: Any, got: Any) -> UserError:
    name = getattr(expected, "__name__", str(expected))
    return UserError(f"{where}: expected {name}, got {_quoted(got)}")


def _too_large(where: str, value: int) -> UserError:
    return UserError(f"{where}: an integer of {len(str(abs(value)))} digits is too large for a number")


def from_jsonable(tp: Any, value: Any, where: str = "value") -> Any:
    """Rebuild a value of type ``tp`` from its JSON form, checking types as it goes."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return from_jsonable(arg, value, where)
            except UserError as exc:
                errors.append(str(exc))
        raise UserError(errors[0] if errors else f"{where}: unexpected {_quoted(value)}")
    if origin is typing.Literal:
        if value not in get_args(tp):
            allowed = ", ".join(repr(a) for a in get_args(tp))
            raise UserError(f"{where}: {_quoted(value)} is not one of {allowed}")
        return value
    if origin in (tuple,):
        if not isinstance(value, (list, tuple)):
            raise _fail(where, tp, value)
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_jsonable(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise UserError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(from_jsonable(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin in (dict, typing.Mapping) or tp is dict:
        if not isinstance(value, dict):
            raise _fail(where, dict, value)
        args = get_args(tp) or (str, Any)
        return {k: from_jsonable(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise _fail(where, list, value)
        (arg,) = get_args(tp) or (Any,)
        return [from_jsonable(arg, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(tp, type) and issubclass(tp, Contract):
            return tp._decode(value, where)
        return _build_dataclass(tp, value, where)
    if tp is float:
        if isinstance(value, str) and value in ("inf", "-inf", "nan"):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(where, float, value)
        try:
            return float(value)
        except OverflowError:  # JSON reads a long integer literal as an int
            raise _too_large(where, value) from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise _fail(where, int, value)
        if abs(value) > _FLOAT_MAX:  # the byte counts and sizes meet floats in the arithmetic: OverflowError
            raise _too_large(where, value)
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(where, bool, value)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _fail(where, str, value)
        return check_text(value, f"{where}:", "surrogateescape")  # a hand-edited name printed as a traceback
    return value


def _build_dataclass(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise _fail(where, cls, data)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields) - {_SCHEMA_KEY})
    if unknown:
        raise UserError(f"{where}: unknown field(s) {', '.join(unknown)} for {cls.__name__}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = from_jsonable(hints[name], data[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UserError(f"{where}: missing field {name!r} for {cls.__name__}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: invalid {cls.__name__}: {exc}") from None
    except UserError as exc:  # a check of the contract's own: say which file and field it read
        raise UserError(f"{where}: {exc}") from None


def check_schema(data: Any, schema: str, where: str) -> None:
    """Refuse a JSON object whose ``schema`` key is not ``schema`` (one without the key, written by
    hand, passes): for readers that take such an object apart without decoding all of it."""
    if not isinstance(data, dict) or _SCHEMA_KEY not in data or data[_SCHEMA_KEY] == schema:
        return
    got, want = data[_SCHEMA_KEY], schema.partition("/")[0].removeprefix("xsched.")
    if isinstance(got, str) and got.startswith("xsched.") and got.partition("/")[0] != f"xsched.{want}":
        kind = got.partition("/")[0].removeprefix("xsched.")  # another contract: a new version would not help
        raise UserError(f"{where}: holds a {kind} (schema {got!r}), not a {want}; pass a {want} file")
    raise UserError(f"{where}: schema {got!r} is not {schema!r}; regenerate the file with this version of xsched")


class Contract:
    """Mixin for frozen dataclasses passed between stages; subclasses set ``SCHEMA``."""

    SCHEMA: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        data = to_jsonable(self)
        return {_SCHEMA_KEY: self.SCHEMA, **data}

    @classmethod
    def from_dict(cls: type[T], data: Any, where: str | None = None) -> T:
        where = where or cls.__name__
        try:
            return cls._decode(data, where)
        except RecursionError:  # JSON the parser took, nested deeper than decoding it can recurse
            raise UserError(f"{where}: nested too deeply to be a {cls.__name__}") from None

    @classmethod
    def _decode(cls: type[T], data: Any, where: str) -> T:
        """``from_dict`` less the recursion guard: nested contracts, so that the outermost reports."""
        check_schema(data, cls.SCHEMA, where)
        return _build_dataclass(cls, data, where)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls: type[T], text: str, where: str | None = None) -> T:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # nesting too deep for the parser; a 5000-digit integer
            raise UserError(f"{where or cls.__name__}: not valid JSON ({json_error_text(exc)})") from None
        return cls.from_dict(data, where)

    def file_bytes(self) -> bytes:
        """What :meth:`save` writes (to write it together with other files: ``atomic_write_all``)."""
        return (self.to_json() + "\n").encode()

    def save(self, path: str | Path) -> Path:
        """Write atomically: a crash or full disk never leaves a half-written file."""
        return atomic_write_bytes(Path(path), self.file_bytes())

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        p = Path(path)
        return cls.from_json(read_text(p), where=str(p))
