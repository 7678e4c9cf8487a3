"""A made-up family that adds a component, as a user would add one: a toy mixture-of-experts MLP (one
component) and the family composed of it (one declaration), both here. Nothing in tracer/ names them.

The component mirrors transformers 5.25's `MixtralSparseMoeBlock` op by op (`modeling_mixtral.py`):
the router (`MixtralTopKRouter`: logits, softmax in f32, top-k, the top-k weights renormalized to sum
to 1) and the experts' eager loop (`MixtralExperts`: per expert hit, its tokens through the fused
gate | up projection, act(gate)·up, down, times the routing weight, added back with `index_add_`).
Its points are the modules transformers has (the router's logits, the experts' weighted sum, the
block's output); its weights are the names `save_pretrained` writes (`block_sparse_moe.*`); its
config fields are Mixtral's; its one knob is a porting mistake (routing weights not renormalized).
The family is a Mixtral under a model_type of its own ("toy_moe", which `register_toy_config` tells
transformers to read as Mixtral's config): Llama with this MLP and a sliding window where the config sets
one. It replaces nothing: tracer's own Mixtral (`tracer.model.moe_families`) stays registered beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.core.lazy import F, torch
from tracer.model.component import Component, ConfigField, Point
from tracer.model.components.attention import Attention
from tracer.model.components.mlp import activation
from tracer.model.config import REQUIRED, ROPE_KEYS, FamilyConfig, every_layer_window, rope_fields
from tracer.model.families import LLAMA
from tracer.model.knobs import Knob, choice, fixed, setting

ROUTER = "mlp.gate"  # MixtralTopKRouter: its first output, the router logits (T, E)
EXPERTS = "mlp.experts"  # MixtralExperts: the experts' outputs weighted and summed (T, C)
MOE = "mlp"  # MixtralSparseMoeBlock: the block's MLP output (1, T, C)
ROUTER_WEIGHT = "block_sparse_moe.gate.weight"


def expert_weight(expert: int, which: str) -> str:
    """w1 (gate), w3 (up), w2 (down) of one expert, as save_pretrained writes them."""
    return f"block_sparse_moe.experts.{expert}.{which}.weight"


def renormalized(top: torch.Tensor) -> torch.Tensor:
    """Mixtral: the top-k routing weights divided by their sum, (T, k)."""
    return top / top.sum(dim=-1, keepdim=True)


def as_picked(top: torch.Tensor) -> torch.Tensor:
    """A port that keeps the softmax values of the picked experts as they are."""
    return top


RENORMALIZE = Knob("moe_renorm", choice("keep", "drop"), "keep | drop", "keep",
                   "Mixtral renormalizes the top-k routing weights to sum to 1; a port that keeps the softmax "
                   "values forgets it", fixed("moe_renorm=drop"), expected=f"layers.0.{EXPERTS}", kind="semantic")


@dataclass(frozen=True)
class SparseMoE(Component):
    """A router and `num_local_experts` gated experts, each token through its top `num_experts_per_tok`."""

    knobs = (RENORMALIZE,)
    config_fields = (ConfigField("num_local_experts", REQUIRED), ConfigField("num_experts_per_tok", 2))

    @property
    def output(self) -> str:
        return MOE

    def points(self, source: str) -> tuple[Point, ...]:
        return (Point(ROUTER, "router", "rows", "router", "router logits, one per expert (T, E)", source,
                      "output:(T, X)"),
                Point(EXPERTS, "experts", "rows", "experts", "the picked experts' outputs times their routing "
                      "weights, summed", ROUTER, "output:(T, X)"),
                Point(MOE, "moe", "rows", "moe", "the mixture of experts' output", EXPERTS))

    def weights(self, spec) -> dict:
        c, i = spec.hidden_size, spec.intermediate_size
        shapes = {ROUTER_WEIGHT: (spec.num_local_experts, c)}
        for e in range(spec.num_local_experts):
            shapes |= {expert_weight(e, "w1"): (i, c), expert_weight(e, "w3"): (i, c), expert_weight(e, "w2"): (c, i)}
        return shapes

    def steps(self, knobs: dict, spec) -> dict:
        return {"routing": {"keep": renormalized, "drop": as_picked}[setting(knobs, "moe_renorm")]}

    def forward(self, x: torch.Tensor, run) -> torch.Tensor:
        """x (1, T, C) -> (1, T, C)."""
        spec, w = run.spec, run.weights
        batch, tokens, hidden = x.shape
        flat = x.view(-1, hidden)  # (T, C)
        logits = run.steps.linear(flat[None], w[ROUTER_WEIGHT])[0]  # (T, E)
        run.record(ROUTER, logits[None])
        probs = torch.softmax(logits.float(), dim=-1)  # (T, E)
        top, picked = torch.topk(probs, spec.num_experts_per_tok, dim=-1)  # (T, k) each
        top = run.steps.routing(top)
        out = torch.zeros_like(flat)  # (T, C)
        experts = spec.num_local_experts
        mask = F.one_hot(picked, num_classes=experts + 1).permute(2, 1, 0)  # (E + 1, k, T)
        for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = int(expert[0])
            slot, token = torch.where(mask[e])  # which of its k picks, which token
            gate_up = torch.cat([w[expert_weight(e, "w1")], w[expert_weight(e, "w3")]])  # (2I, C): gate first
            gate, up = run.steps.linear(flat[token][None], gate_up)[0].chunk(2, dim=-1)  # (n, I) each
            h = run.steps.linear((activation(spec.hidden_act)(gate) * up)[None], w[expert_weight(e, "w2")])[0]
            h = h * top[token, slot, None]  # (n, C)
            out.index_add_(0, token, h.to(out.dtype))
        run.record(EXPERTS, out[None])
        out = out.reshape(batch, tokens, hidden)  # (1, T, C)
        run.record(MOE, out)
        return out


TOY_MOE = LLAMA.derive(
    name="toy_moe", title="a test's toy Mixtral", model_types=("toy_moe",), architecture="MixtralForCausalLM",
    adds="a sparse mixture-of-experts MLP: a router and top-k gated experts",
    attention=Attention(window=True), mlp=SparseMoE(),
    config=FamilyConfig(lambda config: {**rope_fields(config), **every_layer_window(config, None)},
                        {**ROPE_KEYS, "sliding_window": None}, kv_heads=8, rms_norm_eps=1e-5, max_positions=131072))


def register_toy_config() -> None:
    """transformers reads a "toy_moe" config.json as Mixtral's config (its model class is Mixtral's), and its
    per-expert weights as Mixtral's (fused into gate_up_proj on load, as it loads a Mixtral's)."""
    from transformers import AutoConfig, MixtralConfig  # transformers: only the tests that load the toy
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    class ToyMoeConfig(MixtralConfig):
        model_type = TOY_MOE.name

    if get_checkpoint_conversion_mapping(TOY_MOE.name) is not None:  # registered by an earlier test of the session
        return
    AutoConfig.register(TOY_MOE.name, ToyMoeConfig)
    register_checkpoint_conversion_mapping(TOY_MOE.name, get_checkpoint_conversion_mapping("mixtral"))
