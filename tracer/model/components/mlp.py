"""The gated MLP: down(act(gate(x)) · up(x)), with separate gate/up projections (Llama) or one fused
gate_up_proj (Phi-3). A mixture of experts is another component in the same place (the block asks an
MLP for its points, weights, steps and output point only)."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.core.lazy import F, torch
from tracer.model.component import Component, ConfigField, Point
from tracer.model.knobs import Knob, choice, fixed, setting
from tracer.model.points import BIAS, DOWN_PROJ, GATE_PROJ, GATE_UP_PROJ, MLP_ACT, UP_PROJ, WEIGHT


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh (Gemma's GeGLU)."""
    return F.gelu(x, approximate="tanh")


def _activations() -> dict:
    return {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "gelu_pytorch_tanh": gelu_tanh}


ACTIVATION_NAMES = ("silu", "gelu", "relu", "gelu_pytorch_tanh")


def activation(hidden_act: str):
    """transformers' ACT2FN[hidden_act] for the activations tracer's forward computes."""
    return _activations()[hidden_act]


def gated_activation(gate: torch.Tensor, up: torch.Tensor, hidden_act: str) -> torch.Tensor:
    """The MLP's act(gate) * up, (1, T, I) each."""
    return activation(hidden_act)(gate) * up


def gate_up_separate(x, run):
    """x (1, T, C) -> gate, up (1, T, I) each: two projections."""
    w, linear = run.weights, run.steps.linear
    gate = linear(x, w[GATE_PROJ + WEIGHT], w.get(GATE_PROJ + BIAS))  # (1, T, I)
    run.record(GATE_PROJ, gate)
    up = linear(x, w[UP_PROJ + WEIGHT], w.get(UP_PROJ + BIAS))  # (1, T, I)
    run.record(UP_PROJ, up)
    return gate, up


def gate_up_fused(x, run):
    """Phi-3: one gate_up_proj (1, T, 2·I), chunked gate first (swapped by gate_up=up_gate)."""
    fused = run.steps.linear(x, run.weights[GATE_UP_PROJ + WEIGHT])  # (1, T, 2·I)
    run.record(GATE_UP_PROJ, fused)
    first, second = fused.chunk(2, dim=-1)  # (1, T, I) each
    return (first, second) if run.steps.gate_first else (second, first)


GATE_UP = Knob("gate_up", choice("gate_up", "up_gate"), "gate_up | up_gate", "gate_up",
               "the fused gate_up_proj output split up-first (Phi-3 stores the gate first)",
               fixed("gate_up=up_gate"), expected=f"layers.0.{MLP_ACT}", kind="semantic", after="qkv_split")

@dataclass(frozen=True)
class GatedMLP(Component):
    """down(act(gate(x)) · up(x)); `fused`: one gate_up_proj, the gate first (Phi-3); `fields`: the config
    keys it reads as written (Llama's mlp_bias)."""

    fused: bool = False
    fields: tuple[ConfigField, ...] = ()
    spec_fields = {"mlp_bias": False}  # no biases where the config sets none

    @property
    def config_fields(self) -> tuple[ConfigField, ...]:
        return self.fields

    @property
    def knobs(self) -> tuple:
        return (GATE_UP,) if self.fused else ()

    @property
    def output(self) -> str:
        """The point that is the MLP's output (what the residual add takes)."""
        return DOWN_PROJ

    def points(self, source: str) -> tuple[Point, ...]:
        """Its points in execution order, the projections reading `source`."""
        if self.fused:
            projections = (Point(GATE_UP_PROJ, "gate_up", "rows", "projection",
                                 "fused gate | up projection (Phi-3), (T, 2·I)", source),)
        else:
            projections = (Point(GATE_PROJ, "gate", "rows", "projection", "MLP gate projection", source),
                           Point(UP_PROJ, "up", "rows", "projection", "MLP up projection", source))
        return (*projections,
                Point(MLP_ACT, "act", "rows", "activation", "act(gate)·up (input of down_proj)", projections[0].name,
                      f"input:{DOWN_PROJ}"),
                Point(DOWN_PROJ, "down", "rows", "projection", "MLP output", MLP_ACT))

    def weights(self, spec) -> dict:
        c, i = spec.hidden_size, spec.intermediate_size
        shapes = ({GATE_UP_PROJ + WEIGHT: (2 * i, c)} if self.fused
                  else {GATE_PROJ + WEIGHT: (i, c), UP_PROJ + WEIGHT: (i, c)})
        shapes[DOWN_PROJ + WEIGHT] = (c, i)
        if spec.mlp_bias:
            shapes |= {GATE_PROJ + BIAS: (i,), UP_PROJ + BIAS: (i,), DOWN_PROJ + BIAS: (c,)}
        return shapes

    def steps(self, knobs: dict, spec) -> dict:
        return {"gate_up": gate_up_fused if self.fused else gate_up_separate,
                "gate_first": setting(knobs, "gate_up") == "gate_up" if self.fused else True,
                "glu": gated_activation}

    def forward(self, x: torch.Tensor, run) -> torch.Tensor:
        """x (1, T, C) -> (1, T, C): down(act(gate(x)) * up(x))."""
        gate, up = run.steps.gate_up(x, run)  # (1, T, I) each
        act = run.steps.glu(gate, up, run.spec.hidden_act)
        run.record(MLP_ACT, act)
        down = run.steps.linear(act, run.weights[DOWN_PROJ + WEIGHT], run.weights.get(DOWN_PROJ + BIAS))  # (1, T, C)
        run.record(DOWN_PROJ, down)
        return down
