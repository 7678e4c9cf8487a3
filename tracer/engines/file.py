"""The `file:PATH` engine: a trace saved earlier, by tracer or another runtime. It can be compared,
not run again."""

from __future__ import annotations

from pathlib import Path

from tracer.core.errors import TracerError, ids_text
from tracer.engines.base import EngineBase
from tracer.engines.registry import ENGINES
from tracer.files.sources import ModelSource
from tracer.traces.trace import Trace


class FileEngine(EngineBase):
    entry = ENGINES["file"]

    def __init__(self, trace: Trace, path: str | Path | None = None):
        self.trace, self.path = trace, path
        self.variant = self.trace.variant

    def record(self, tokens: list[int], recorder=None, *, positions=None) -> Trace:
        """The saved trace itself (it is already on disk or in memory; `recorder` has nothing to do)."""
        self.first_position(tokens, positions)  # its tokens run from 0: other positions are refused
        recorded = self.trace.tokens
        if recorded is not None and tokens and list(recorded) != list(tokens):
            if self.path is None:  # two traces compared as they are
                raise TracerError(f"the traces ran other token ids: {ids_text(tokens)} vs {ids_text(recorded)}")
            raise TracerError(f"trace {self.path} ran {ids_text(recorded)}, not {ids_text(tokens)}")
        return self.trace


def load(source: ModelSource, variant: dict, *, argument: str | None = None, device="cpu",
         stream: bool = False) -> FileEngine:
    if variant:
        raise TracerError("a saved trace (file:PATH) cannot take variant knobs")
    return FileEngine(Trace.load(argument), argument)  # another runtime's dump: names mapped onto points
