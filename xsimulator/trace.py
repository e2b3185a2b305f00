"""Chrome Trace Event Format writer shared by the simulator (predicted) and the runner (measured).

One JSON file ``{"traceEvents": [...]}`` that Perfetto or chrome://tracing opens: complete events
(``ph: "X"``, microsecond ``ts``/``dur``) on one track (``tid``) per resource, and instant events
(``ph: "i"``) for markers such as re-plans. ``args`` carry ``block``, ``step``, ``layer``,
``batch``, ``bytes`` where known. Writing the predicted and the measured timeline in one format
lets the two be opened side by side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from xsched.errors import UserError
from xsched.fileio import atomic_write_text

TRACKS: tuple[str, ...] = ("compute", "cpu_compute", "ctog", "gtoc", "dtoc", "ctod")
_PID = 1


@dataclass(frozen=True)
class TraceEvent:
    """``track`` was busy with ``name`` from ``start_s`` for ``dur_s`` seconds."""

    track: str
    name: str
    start_s: float
    dur_s: float
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TraceMarker:
    """A point in time worth seeing on the timeline (a re-plan, a budget change)."""

    name: str
    time_s: float
    args: dict[str, Any] = field(default_factory=dict)


def chrome_trace(events: Iterable[TraceEvent], markers: Iterable[TraceMarker] = (),
                 process: str = "xsched", metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trace as a JSON-ready dict; tracks appear in :data:`TRACKS` order."""
    out: list[dict[str, Any]] = [{"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": process}}]
    for i, track in enumerate(TRACKS):
        out.append({"ph": "M", "pid": _PID, "tid": track, "name": "thread_name", "args": {"name": track}})
        out.append({"ph": "M", "pid": _PID, "tid": track, "name": "thread_sort_index", "args": {"sort_index": i}})
    for e in events:
        if e.track not in TRACKS:
            raise ValueError(f"unknown trace track {e.track!r}; tracks: {', '.join(TRACKS)}")
        out.append({"ph": "X", "pid": _PID, "tid": e.track, "name": e.name, "ts": e.start_s * 1e6,
                    "dur": e.dur_s * 1e6, "args": dict(e.args)})
    for m in markers:
        out.append({"ph": "i", "pid": _PID, "tid": "compute", "s": "g", "name": m.name, "ts": m.time_s * 1e6,
                    "args": dict(m.args)})
    trace: dict[str, Any] = {"traceEvents": out, "displayTimeUnit": "ms"}
    if metadata:
        trace["metadata"] = metadata
    return trace


def chrome_trace_text(events: Iterable[TraceEvent], markers: Iterable[TraceMarker] = (), process: str = "xsched",
                      metadata: dict[str, Any] | None = None) -> str:
    """The trace file's text (to write it together with other outputs)."""
    return json.dumps(chrome_trace(events, markers, process, metadata), separators=(",", ":")) + "\n"


def write_chrome_trace(path: str | Path, events: Iterable[TraceEvent], markers: Iterable[TraceMarker] = (),
                       process: str = "xsched", metadata: dict[str, Any] | None = None) -> Path:
    """Write the trace atomically (a crash never leaves half a file)."""
    return atomic_write_text(Path(path), chrome_trace_text(events, markers, process, metadata))


def read_chrome_trace(path: str | Path) -> tuple[list[TraceEvent], list[TraceMarker]]:
    """Events and markers of a trace written by :func:`write_chrome_trace` (for comparisons)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        raw = data["traceEvents"]
    except FileNotFoundError:
        raise UserError(f"{p}: no such trace file") from None
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        raise UserError(f"{p}: not a Chrome trace JSON with traceEvents") from None
    events = [TraceEvent(e["tid"], e["name"], e["ts"] / 1e6, e["dur"] / 1e6, e.get("args", {}))
              for e in raw if e.get("ph") == "X"]
    markers = [TraceMarker(e["name"], e["ts"] / 1e6, e.get("args", {})) for e in raw if e.get("ph") == "i"]
    return events, markers
