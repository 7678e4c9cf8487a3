"""Runs of the reimplementation advanced one unit at a time from outside (the embedding, each
block, the head), so that a driver can step several of them together over the same weights
(`tracer.pipeline.lockstep`).

`FreeRun` is `Model.forward` cut at its units (each block on the previous block's output);
`TeacherForced` is the local run (each block on the reference's input to it,
`tracer.reimpl.forced_runs.teacher_forced_points`). Both record exactly what the whole forward
records, in the same order: stepping them is only a change of who calls the next unit.

A local run stepped beside the candidate's free run of the same model (`beside`) does not run a
block whose input the free run already has, bit for bit: that block of the free run is the local
run's block (the same function of the same values), so its points are recorded into both. Until
a port first differs from the reference, this is every block: the local run then costs nothing.
"""

from __future__ import annotations

import torch

from tracer.model.points import EMBED, layer_point
from tracer.reimpl.forward import Model
from tracer.traces.trace import Trace


class FreeRun:
    """`Model.forward(tokens, recorder, positions=positions)` (no cache), one unit per call."""

    def __init__(self, model: Model, tokens: list[int], recorder, positions: torch.Tensor):
        self.model, self.tokens, self.recorder = model, tokens, recorder
        self.at = model.positions(positions)  # the tables `forward` builds for the same positions
        self.h: torch.Tensor | None = None
        self.layers = model.spec.num_hidden_layers
        self.also = None  # a local run's recorder that the next block's points go to as well

    def embed(self) -> None:
        self.h = self.model.embed(torch.tensor(self.tokens), self.recorder)  # (1, T, C)

    def block(self, layer: int) -> None:
        if layer < self.layers:
            recorder, also, self.also = self.recorder, self.also, None
            if also is not None:  # the local run's first: a long prompt's candidate judges a point by its local error
                recorder = _Both(also, recorder)
            self.h = self.model.block(layer, self.h, self.at, None, recorder)  # (1, T, C)

    def head(self) -> torch.Tensor:
        """The logits (T, V), as `forward` returns them."""
        logits, self.h = self.model.head(self.h, self.recorder)[0], None
        return logits


class TeacherForced:
    """The local run: every block fed the reference's input to that block, and each point of the
    head (a chain: final norm, logits, capped logits) the reference's value of the point before it.
    `reference` may still be growing (a driver steps this run as the reference records): a unit
    reads only points the reference recorded before it."""

    def __init__(self, model: Model, reference: Trace, recorder, positions: torch.Tensor, cache=None,
                 beside: FreeRun | None = None):
        self.model, self.reference, self.recorder, self.cache = model, reference, recorder, cache
        if beside is not None and (beside.model is not model or cache is not None):
            raise ValueError("a local run shares blocks only with a free run of its own model, uncached")
        self.beside = beside  # stepped right after this run, through the same units
        self.shared = 0  # blocks the free run ran for both
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
        x = self._input(self.block_input)
        if self.beside is not None and _same(self.beside.h, x):
            self.beside.also, self.shared = self.recorder, self.shared + 1
        else:
            self.model.block(layer, x, self.at, self.cache, self.recorder)
        self.block_input = layer_point(layer, "")

    def head(self) -> None:
        previous = layer_point(self.layers - 1, "")
        for point in self.model.family.head.points(self.model.family):
            if previous in self.reference:
                self.model.head_step(point.name, self._input(previous), self.recorder)
            previous = point.name

    def _input(self, point: str) -> torch.Tensor:
        return self.reference[point][None].to(dtype=self.model.steps.dtype, device=self.model.device)  # (1, T, C)


def _same(h: torch.Tensor | None, x: torch.Tensor) -> bool:
    """The same values bit for bit (NaN never counts as the same: such a block runs twice)."""
    return h is not None and h.dtype == x.dtype and h.shape == x.shape and h.device == x.device and torch.equal(h, x)


class _Both:
    """A recorder that hands each point to two."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        self.first(name, tensor)
        self.second(name, tensor)
