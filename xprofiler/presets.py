"""Resolve a profile argument: a built-in preset name or a profile JSON file."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from xprofiler.profile import HardwareProfile
from xsched.errors import UserError


def _preset_dir():
    return resources.files("xprofiler") / "presets"


def preset_names() -> list[str]:
    """Names of the presets shipped in the package (file stems under xprofiler/presets/)."""
    return sorted(p.name[: -len(".json")] for p in _preset_dir().iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> HardwareProfile:
    path = _preset_dir() / f"{name}.json"
    if not path.is_file():
        raise UserError(f"unknown profile preset {name!r}; presets: {', '.join(preset_names()) or 'none'}")
    return HardwareProfile.from_json(path.read_text(), where=f"preset {name}")


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A preset by name, else a profile file written by ``xsched profile``."""
    text = str(name_or_path)
    if text in preset_names():
        return load_preset(text)
    path = Path(text)
    if path.exists():
        return HardwareProfile.load(path)
    raise UserError(f"{text}: neither a profile file nor a preset; presets: {', '.join(preset_names()) or 'none'}")
