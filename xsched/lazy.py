"""Lazy package exports (PEP 562), shared by the stage packages.

A stage's public names resolve on first use, so ``import xsimulator`` costs nothing and the
torch-free stages stay torch-free whatever their neighbours import.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose names ``exports`` maps to the
    modules that define them; ``__dir__`` lists the lazy names too, for completion and help()."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
