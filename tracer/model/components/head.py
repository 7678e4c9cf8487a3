"""The model's head: the final norm, lm_head (on every position, or candle's last one) and, where the
family's configs may ask for it, Gemma's soft-capped logits (a virtual point under lm_head)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tracer.core.lazy import F, torch
from tracer.model.component import Component, Point
from tracer.model.components.attention import SOFTCAPS
from tracer.model.knobs import Knob, choice, fixed, setting
from tracer.model.points import FINAL_LOGITS, FINAL_NORM, LOGITS, WEIGHT


def logits_all(h: torch.Tensor, weight: torch.Tensor, linear: Callable | None = None) -> torch.Tensor:
    """(1, T, C) -> (1, T, V): every position, as transformers returns them (`linear`: F.linear)."""
    return _by_rows(linear or F.linear, h, weight)


def logits_last(h: torch.Tensor, weight: torch.Tensor, linear: Callable | None = None) -> torch.Tensor:
    """(1, T, C) -> (1, 1, V): candle's forward keeps the last position before lm_head."""
    return _by_rows(linear or F.linear, h[:, -1:], weight)


def _by_rows(linear: Callable, h: torch.Tensor, weight) -> torch.Tensor:
    """`linear(h, weight)`; a streamed weight that comes as chunks of rows (each converted as it is
    used, `tracer.reimpl.forward.RowChunks`) gives the same columns chunk by chunk."""
    if not getattr(weight, "in_row_chunks", False):  # a tensor, or a regime's own weight (quantized blocks)
        return linear(h, weight)
    return torch.cat([linear(h, rows) for rows in weight], dim=-1)  # (1, T, V)


LOGIT_STEPS = {"all": logits_all, "last": logits_last}
LOGITS_KNOB = Knob("logits", choice("all", "last"), "all | last", "all",
                   "candle computes lm_head on the last position only", fixed("logits=last"), kind="semantic",
                   after="bias")


@dataclass(frozen=True)
class Head(Component):
    """Final norm and lm_head; `softcap`: its configs may soft-cap the final logits (Gemma's
    final_logit_softcapping, `tracer.model.components.attention.SoftCap`)."""

    softcap: Component | None = None
    knobs = (LOGITS_KNOB,)
    spec_fields = {"final_logit_softcapping": None}  # no cap where the config sets none

    def parts(self) -> tuple[Component, ...]:
        return () if self.softcap is None else (self.softcap,)

    def points(self, family) -> tuple[Point, ...]:
        points = (Point(FINAL_NORM, "norm", "rows", "norm", "final RMSNorm", ""),
                  Point(LOGITS, "logits", "rows", "logits", "logits: the lm_head projection", ""))
        if self.softcap is not None:  # what the model returns: a field of its output, not a module's
            points += (Point(FINAL_LOGITS, "capped logits", "rows", "softcap",
                             "final logits soft-capped, cap·tanh(logits/cap) (Gemma)", LOGITS, "model:logits"),)
        return points

    def weights(self, spec) -> dict:
        shapes = {FINAL_NORM + WEIGHT: (spec.hidden_size,)}
        if not spec.tie_word_embeddings:
            shapes[LOGITS + WEIGHT] = (spec.vocab_size, spec.hidden_size)
        return shapes

    def steps(self, knobs: dict, spec) -> dict:
        return {"logits": LOGIT_STEPS[setting(knobs, "logits")], "softcap": SOFTCAPS[setting(knobs, "softcap")]}

    def forward(self, h: torch.Tensor, run) -> torch.Tensor:
        """(1, T, C) -> logits (1, T, V) ((1, 1, V) with logits=last), capped where the config says so."""
        return self.step(FINAL_LOGITS, self.step(LOGITS, self.step(FINAL_NORM, h, run), run), run)

    def step(self, point: str, x: torch.Tensor, run) -> torch.Tensor:
        """One of the head's points computed from its input (what teacher forcing feeds it), recorded;
        the capped logits only where the config caps them (else the logits pass through)."""
        steps, spec = run.steps, run.spec
        if point == FINAL_NORM:
            out = steps.norm(x, run.weights[FINAL_NORM + WEIGHT], spec.rms_norm_eps)
        elif point == LOGITS:
            out = steps.logits(x, run.weights[LOGITS + WEIGHT])  # (1, T, V), or (1, 1, V) for logits=last
        elif spec.final_logit_softcapping is not None:  # Gemma 2: the capped logits, a virtual point under lm_head
            out = steps.softcap(x, spec.final_logit_softcapping)
        else:
            return x
        run.record(point, out)
        return out
