"""Resolve a profile argument: a built-in preset name or a profile JSON file.

Loading a measured profile on another machine is allowed (planning for a remote box is a use
case) but the numbers then describe that other machine, so it warns and names the difference.
"""

from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path

from xprofiler.profile import HardwareProfile
from xsched.errors import UserError
from xsched.fileio import path_exists


class ProfileMismatchWarning(UserWarning):
    """A measured profile is used on a machine whose fingerprint differs."""


def _preset_dir():
    return resources.files("xprofiler") / "presets"


def preset_names() -> list[str]:
    """Names of the presets shipped in the package (file stems under xprofiler/presets/)."""
    return sorted(p.name[: -len(".json")] for p in _preset_dir().iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> HardwareProfile:
    """The shipped profile preset ``name`` (``preset_names()``: machines from the papers, not measured)."""
    path = _preset_dir() / f"{name}.json"
    if not path.is_file():
        raise UserError(f"unknown profile preset {name!r}; presets: {', '.join(preset_names()) or 'none'}")
    return HardwareProfile.from_json(path.read_text(), where=f"preset {name}")


def warn_if_other_machine(profile: HardwareProfile, where: str, offload_dir: str | Path | None = None) -> list[str]:
    """Warn (``ProfileMismatchWarning``) when ``profile`` was measured on another machine."""
    from xprofiler.fingerprint import machine_differences

    diffs = machine_differences(profile, offload_dir)
    if diffs:
        warnings.warn(f"{where} was measured on a different machine ({'; '.join(diffs)}); "
                      "run `xsched profile` on this machine for trustworthy plans",
                      ProfileMismatchWarning, stacklevel=3)
    return diffs


def load_profile(name_or_path: str | Path, check_machine: bool = True) -> HardwareProfile:
    """A preset by name, else a profile file written by ``xsched profile``.

    With ``check_machine`` a measured profile whose fingerprint differs from this machine's
    emits a ``ProfileMismatchWarning`` naming each difference; presets never warn.
    """
    text = str(name_or_path)
    if text in preset_names():
        return load_preset(text)
    path = Path(text)
    if path_exists(path):
        profile = HardwareProfile.load(path)
        if check_machine:
            warn_if_other_machine(profile, str(path))
        return profile
    folded = {name.lower(): name for name in preset_names()}.get(text.lower())  # `T4` for t4, as workloads fold `t`
    if folded is not None:
        return load_preset(folded)
    raise UserError(f"{text}: neither a profile file nor a preset; presets: {', '.join(preset_names()) or 'none'}")
