"""DeepSeek-V3's mixture of experts: a sigmoid router whose selection adds a bias, group-limited top-k, the
weights from the unbiased scores, renormalized and scaled; routed experts as `moe.SparseMoE`'s; shared
experts on every token; dense MLPs on the first `first_k_dense_replace` layers.

Mirrors transformers 5.25's `DeepseekV3TopkRouter` and `DeepseekV3MoE` op by op
(`models/deepseek_v3/modeling_deepseek_v3.py`):

- logits = linear(x in f32, W in f32), (T, E), f32 whatever the model's dtype;
- scores = sigmoid(logits); selection = scores + e_score_correction_bias (for choosing only);
- per group of E / n_group experts, the sum of its top-2 selection scores; the top `topk_group` groups
  (`sorted=False`) kept, the other groups' experts masked to -inf;
- the top `num_experts_per_tok` of the masked selection (`sorted=False`: top-k's own order);
- weights = the unbiased scores of the picked experts, divided by (their sum + 1e-20) where
  `norm_topk_prob`, times `routed_scaling_factor`; left in f32 (the experts' product promotes);
- the experts' eager loop (`moe.routed_experts`), then `shared_experts`, a gated MLP of
  moe_intermediate_size · n_shared_experts on every token, added to the experts' sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.core.errors import TracerError
from tracer.core.lazy import torch
from tracer.model.component import ConfigField, Point
from tracer.model.components.mlp import GatedMLP, activation
from tracer.model.components.moe import (
    EXPERT_GATE_UP,
    EXPERT_ORDER,
    NORM_TOPK,
    ROUTER_DTYPE,
    SparseMoE,
    routed_experts,
)
from tracer.model.config import check, given, refuse
from tracer.model.knobs import Knob, choice, fixed, setting
from tracer.model.points import (
    EXPERTS,
    MLP,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    ROUTER_SELECTION,
    SHARED_EXPERT,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    WEIGHT,
)

_FIRST = "layers.K."  # the knobs' first divergence: the first sparse layer, K = first_k_dense_replace
SELECTION_BIAS = f"{MLP}.gate.e_score_correction_bias"  # (E,), f32
SHARED_EXPERTS = f"{MLP}.shared_experts"  # transformers' module (plural): the point is `mlp.shared_expert`
DENSE = GatedMLP()  # the first first_k_dense_replace layers' MLP (intermediate_size)
GROUP_TOP = 2  # a group's score: the sum of its 2 best selection scores

BIAS_IN_WEIGHTS = Knob("selection_bias", choice("selection", "weights"), "selection | weights", "selection",
                       "e_score_correction_bias used in the routing weights too (the weights gathered from the "
                       "biased selection scores instead of the sigmoid scores)", fixed("selection_bias=weights"),
                       expected=f"{_FIRST}{TOP_K_WEIGHTS} (the picked experts identical)", kind="semantic",
                       after="expert_order")
ROUTED_SCALING = Knob("routed_scaling", choice("keep", "drop"), "keep | drop", "keep",
                      "routed_scaling_factor dropped: the routing weights not multiplied by it",
                      fixed("routed_scaling=drop"), expected=f"{_FIRST}{TOP_K_WEIGHTS} (the picked experts identical)",
                      kind="semantic", after="selection_bias")
GROUP_LIMIT = Knob("group_limit", choice("keep", "ignore"), "keep | ignore", "keep",
                   "group-limited routing ignored: the top-k taken over every expert, not only those of the "
                   "topk_group best groups", fixed("group_limit=ignore"),
                   expected=f"{_FIRST}{TOP_K_WEIGHTS} where a token's best experts lie outside its best groups",
                   kind="semantic", after="routed_scaling")


def group_limited(selection: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """transformers: the experts outside the `keep` best groups masked to -inf. (T, E) -> (T, E)."""
    tokens, experts = selection.shape
    group_scores = selection.view(-1, groups, experts // groups).topk(GROUP_TOP, dim=-1)[0].sum(dim=-1)  # (T, G)
    group_idx = torch.topk(group_scores, k=keep, dim=-1, sorted=False)[1]  # (T, keep)
    group_mask = torch.zeros_like(group_scores)  # (T, G)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)  # (T, E)
    return selection.masked_fill(~score_mask.bool(), float("-inf"))


def every_group(selection: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    return selection


def renormalized_eps(top: torch.Tensor) -> torch.Tensor:
    """transformers: divided by (sum + 1e-20), (T, k)."""
    return top / (top.sum(dim=-1, keepdim=True) + 1e-20)


def as_picked(top: torch.Tensor) -> torch.Tensor:
    return top


def route_biased(flat: torch.Tensor, run, moe) -> tuple[torch.Tensor, torch.Tensor]:
    """`DeepseekV3TopkRouter.forward`: (T, C) -> weights (T, k) f32, picked experts (T, k)."""
    steps, spec, w = run.steps, run.spec, run.weights
    logits = steps.router_logits(flat.float(), w[moe.names.router].float(), steps.linear)  # (T, E)
    run.record(ROUTER_LOGITS, logits[None])
    scores = torch.sigmoid(logits)  # (T, E)
    run.record(ROUTER_SCORES, scores[None])
    selection = scores + w[SELECTION_BIAS]  # (T, E)
    run.record(ROUTER_SELECTION, selection[None])
    masked = steps.group_limit(selection, spec.n_group, spec.topk_group)  # (T, E)
    picked = torch.topk(masked, k=moe.top_k_of(spec), dim=-1, sorted=False)[1]  # (T, k)
    top = steps.weights_from(scores, selection).gather(1, picked)  # (T, k)
    return steps.renormalize(top) * steps.routed_scale(spec), picked


def shared_experts(flat: torch.Tensor, run) -> torch.Tensor:
    """DeepseekV3MLP of the shared experts on every token: (1, T, C) -> (1, T, C)."""
    w, linear = run.weights, run.steps.linear
    gate = linear(flat, w[f"{SHARED_EXPERTS}.gate_proj{WEIGHT}"])  # (1, T, S)
    up = linear(flat, w[f"{SHARED_EXPERTS}.up_proj{WEIGHT}"])  # (1, T, S)
    return linear(activation(run.spec.hidden_act)(gate) * up, w[f"{SHARED_EXPERTS}.down_proj{WEIGHT}"])  # (1, T, C)


@dataclass(frozen=True)
class DeepseekMoE(SparseMoE):
    """DeepSeek-V3's MoE MLP: `SparseMoE`'s experts behind a biased, group-limited sigmoid router, shared
    experts, dense first layers."""

    experts: ConfigField = ConfigField("n_routed_experts", 256, aliases=("num_local_experts",))
    top_k: ConfigField = ConfigField("num_experts_per_tok", 8)
    expert_size: ConfigField | None = ConfigField("moe_intermediate_size", 2048)
    norm_topk: ConfigField | None = ConfigField("norm_topk_prob", True, "bool")
    dense_layers: bool = True
    f32_weights = (f"{MLP}.gate{WEIGHT}", SELECTION_BIAS)  # transformers' _keep_in_fp32_modules_strict

    @property
    def knobs(self) -> tuple:
        return (NORM_TOPK, ROUTER_DTYPE, EXPERT_GATE_UP, EXPERT_ORDER, BIAS_IN_WEIGHTS, ROUTED_SCALING, GROUP_LIMIT)

    @property
    def config_fields(self) -> tuple[ConfigField, ...]:
        return (self.experts, self.top_k, self.expert_size, self.norm_topk,
                ConfigField("n_shared_experts", 1), ConfigField("routed_scaling_factor", 2.5, "positive_number"),
                ConfigField("n_group", 8), ConfigField("topk_group", 4), ConfigField("first_k_dense_replace", 3, ""))

    def read_config(self, config: dict) -> dict:
        """Each field checked by its kind; first_k_dense_replace may be 0 (every layer sparse)."""
        read = {f.key: check(f.kind, f.key, given(config, f.key, f.default)) for f in self.config_fields if f.kind}
        read[self.experts.key] = check("positive_int", self.experts.key,
                                       config.get(self.experts.key, config.get("num_local_experts", 256)))
        dense = config.get("first_k_dense_replace", 3)
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
            raise refuse("first_k_dense_replace", dense, "a layer count (0 or more)")
        if read[self.experts.key] % read["n_group"] or read["topk_group"] > read["n_group"]:
            raise TracerError(f"config.json: {read[self.experts.key]} experts, n_group {read['n_group']}, topk_group "
                              f"{read['topk_group']}: the groups must divide the experts and hold the kept ones")
        return {**read, "first_k_dense_replace": dense}

    def is_sparse(self, spec, layer: int) -> bool:
        """`DeepseekV3DecoderLayer`: a dense MLP below first_k_dense_replace, the MoE from it on."""
        return layer >= spec.first_k_dense_replace

    def points(self, source: str) -> tuple[Point, ...]:
        base = {point.name: point for point in super().points(source)}
        selection = Point(ROUTER_SELECTION, "selection", "rows", "routing", "the scores top-k picks from: sigmoid "
                          "scores plus e_score_correction_bias, f32", ROUTER_SCORES,
                          f"within:{ROUTER_LOGITS}:selection")
        shared = Point(SHARED_EXPERT, "shared", "rows", "experts", "the shared experts' output (no gate)", source,
                       f"module:{SHARED_EXPERTS}")
        dense = [point for name, point in base.items() if name not in (*self._routed(), MLP)]
        return (*dense, base[ROUTER_LOGITS], base[ROUTER_SCORES], selection,
                base[TOP_K_INDEX].replace(source=ROUTER_SELECTION), base[TOP_K_WEIGHTS], base[EXPERTS], shared,
                base[MLP])

    @staticmethod
    def _routed() -> tuple[str, ...]:
        return (ROUTER_LOGITS, ROUTER_SCORES, TOP_K_INDEX, TOP_K_WEIGHTS, EXPERTS, SHARED_EXPERT)

    def records_on(self, spec, layer: int, point: str) -> bool:
        if point == ROUTER_SELECTION:
            return self.is_sparse(spec, layer)
        return super().records_on(spec, layer, point)

    def layer_weights(self, spec, layer: int) -> dict:
        if not self.is_sparse(spec, layer):
            return DENSE.weights(spec)
        c, experts, i = spec.hidden_size, self.experts_of(spec), spec.moe_intermediate_size
        shapes = {self.names.router: (experts, c), SELECTION_BIAS: (experts,)}
        for e in range(experts):
            shapes |= {self.names.expert(e, "gate"): (i, c), self.names.expert(e, "up"): (i, c),
                       self.names.expert(e, "down"): (c, i)}
        s = i * spec.n_shared_experts
        return shapes | {f"{SHARED_EXPERTS}.gate_proj{WEIGHT}": (s, c), f"{SHARED_EXPERTS}.up_proj{WEIGHT}": (s, c),
                         f"{SHARED_EXPERTS}.down_proj{WEIGHT}": (c, s)}

    def steps(self, knobs: dict, spec) -> dict:
        base = super().steps(knobs, spec)
        renorm = base["renormalize"].__name__ == "renormalized"  # norm_topk as the config or the knob says
        return {**base, "renormalize": renormalized_eps if renorm else as_picked,
                "group_limit": every_group if setting(knobs, "group_limit") == "ignore" else group_limited,
                "weights_from": (lambda scores, selection: selection) if setting(knobs, "selection_bias") == "weights"
                else (lambda scores, selection: scores),
                "routed_scale": (lambda spec: 1.0) if setting(knobs, "routed_scaling") == "drop"
                else (lambda spec: spec.routed_scaling_factor)}

    def forward(self, x: torch.Tensor, run) -> torch.Tensor:
        """x (1, T, C) -> (1, T, C)."""
        if (out := self.dense_forward(x, run, DENSE)) is not None:
            return out
        batch, tokens, hidden = x.shape
        flat = x.view(-1, hidden)  # (T, C)
        top, picked = route_biased(flat, run, self)  # (T, k) each
        run.record(TOP_K_INDEX, picked[None])
        run.record(TOP_K_WEIGHTS, top[None])
        routed = routed_experts(flat, top, picked, run, self).view(batch, tokens, hidden)  # (1, T, C)
        run.record(EXPERTS, routed)
        shared = shared_experts(x, run)  # (1, T, C)
        run.record(SHARED_EXPERT, shared)
        out = routed + shared  # (1, T, C)
        run.record(MLP, out)
        return out
