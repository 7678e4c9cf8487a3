"""torch, imported when first used: `from tracer.core.lazy import torch, F`.

The model's declarations (`tracer.model`) hold their forward code beside their facts, but listing
knobs or engines must not pay for torch (tests/unit/test_structure.py holds it). A name of these
stand-ins resolves on first attribute access and is the module itself from then on.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule:
    """A module imported on its first attribute access."""

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str):
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attribute)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (imported)'}>"


torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
