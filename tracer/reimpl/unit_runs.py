"""Runs of the reimplementation advanced one unit at a time from outside (the embedding, each
block, the head), so that a driver can step several of them together over the same weights
(`tracer.pipeline.lockstep`).

`FreeRun` is `Model.forward` cut at its units (each block on the previous block's output);
`TeacherForced` is the local run (each block on the reference's input to it,
`tracer.reimpl.forced_runs.teacher_forced_points`). Both record exactly what the whole forward
records, in the same order: stepping them is only a change of who calls the next unit.
"""

from __future__ import annotations

import torch

from tracer.comparison.trace import Trace
from tracer.model.points import EMBED, layer_point
from tracer.reimpl.forward import Model


class FreeRun:
    """`Model.forward(tokens, recorder, positions=positions)` (no cache), one unit per call."""

    def __init__(self, model: Model, tokens: list[int], recorder, positions: torch.Tensor):
        self.model, self.tokens, self.recorder = model, tokens, recorder
        self.at = model.positions(positions)  # the tables `forward` builds for the same positions
        self.h: torch.Tensor | None = None
        self.layers = model.spec.num_hidden_layers

    def embed(self) -> None:
        self.h = self.model.embed(torch.tensor(self.tokens), self.recorder)  # (1, T, C)

    def block(self, layer: int) -> None:
        if layer < self.layers:
            self.h = self.model.block(layer, self.h, self.at, None, self.recorder)  # (1, T, C)

    def head(self) -> torch.Tensor:
        """The logits (T, V), as `forward` returns them."""
        logits, self.h = self.model.head(self.h, self.recorder)[0], None
        return logits


class TeacherForced:
    """The local run: every block fed the reference's input to that block, and each point of the
    head (a chain: final norm, logits, capped logits) the reference's value of the point before it.
    `reference` may still be growing (a driver steps this run as the reference records): a unit
    reads only points the reference recorded before it."""

    def __init__(self, model: Model, reference: Trace, recorder, positions: torch.Tensor, cache=None):
        self.model, self.reference, self.recorder, self.cache = model, reference, recorder, cache
        # with a cache holding a decode step's past (`cached_step_points`) the positions come from it, as in the
        # model's own decode (where a wrong position is made)
        self.at = model.positions(positions) if cache is None or cache.length == 0 else \
            model.positions(count=len(reference.tokens), cache=cache)
        self.block_input: str | None = EMBED  # None once the reference lacks a block's input
        self.layers = model.spec.num_hidden_layers

    def embed(self) -> None:
        self.model.embed(torch.tensor(self.reference.tokens), self.recorder)

    def block(self, layer: int) -> None:
        if layer >= self.layers or self.block_input is None or self.block_input not in self.reference:
            self.block_input = None  # and every block after it: they follow from this one's output
            return
        self.model.block(layer, self._input(self.block_input), self.at, self.cache, self.recorder)
        self.block_input = layer_point(layer, "")

    def head(self) -> None:
        previous = layer_point(self.layers - 1, "")
        for point in self.model.family.head.points(self.model.family):
            if previous in self.reference:
                self.model.head_step(point.name, self._input(previous), self.recorder)
            previous = point.name

    def _input(self, point: str) -> torch.Tensor:
        return self.reference[point][None].to(dtype=self.model.steps.dtype, device=self.model.device)  # (1, T, C)
