"""A sparse mixture-of-experts MLP: a router, routed experts, an optional shared expert behind a sigmoid
gate, and (Qwen's MoE families) dense layers where the config says so.

Mirrors transformers 5.25 op by op (`models/{mixtral,qwen2_moe,qwen3_moe,olmoe}/modeling_*.py`):

- the router (`MixtralTopKRouter`, `Qwen2MoeTopKRouter`, ...): logits = x·Wᵀ, softmax in f32 over every
  expert, top-k (descending), the k weights divided by their sum (Mixtral always; the others where
  `norm_topk_prob`), then cast back to the logits' dtype (the Qwen families and OLMoE; Mixtral keeps f32);
- the routed experts' eager loop (`MixtralExperts`, 5.25's `experts_implementation="eager"`): for each
  expert hit, in expert order, its tokens through the fused gate | up projection (gate first),
  act(gate)·up, down, times the routing weight, added back with `index_add_`;
- the shared expert (`Qwen2MoeSparseMoeBlock`): a gated MLP of its own on every token, computed before
  the router, times sigmoid(shared_expert_gate(x)), added to the routed experts' sum.

Its points are the routing points (`tracer.model.points`: logits, scores, top-k index and weights, the
shared expert after its gate, the experts' sum, the block's output); a dense layer records the gated MLP's
points and the MLP's output. Its knobs are the classic porting mistakes of a router and its experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.core.lazy import F, torch
from tracer.model.component import Component, ConfigField, Point
from tracer.model.components.mlp import GatedMLP, activation
from tracer.model.knobs import Knob, choice, fixed, setting, when
from tracer.model.points import (
    EXPERTS,
    MLP,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    SHARED_EXPERT,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    WEIGHT,
)

_FIRST = "layers.0."  # the knobs' first divergence: layer 0 is a sparse layer in every tiny model of the tests


def renormalizes(spec) -> bool:
    """Whether the family renormalizes the top-k weights on this model (Mixtral always; else norm_topk_prob)."""
    return spec is None or bool(spec.extra.get("norm_topk_prob", True))


SCORING = Knob("moe_scoring", choice("softmax", "sigmoid"), "softmax | sigmoid", "softmax",
               "the router's scores as a sigmoid of each logit instead of the softmax over the experts (sigmoid "
               "gating taken as softmax, or the reverse)", fixed("moe_scoring=sigmoid"),
               expected=_FIRST + ROUTER_SCORES, kind="semantic")
SOFTMAX_ORDER = Knob("moe_softmax", choice("before_topk", "after_topk"), "before_topk | after_topk", "before_topk",
                     "the softmax taken over the k picked logits instead of over every expert before top-k: the "
                     "weights then sum to 1, as if norm_topk_prob were set (the same model where it is: Mixtral)",
                     when(lambda spec: not renormalizes(spec), "moe_softmax=after_topk"),
                     expected=f"{_FIRST}{TOP_K_WEIGHTS} (the scores over every expert are never formed)",
                     kind="semantic", after="moe_scoring")
NORM_TOPK = Knob("norm_topk", choice("config", "ignore", "force"), "config | ignore | force", "config",
                 "norm_topk_prob ignored (the top-k weights never renormalized to sum to 1) or forced (always "
                 "renormalized); Mixtral always renormalizes",
                 lambda spec: "norm_topk=ignore" if renormalizes(spec) else "norm_topk=force",
                 expected=f"{_FIRST}{TOP_K_WEIGHTS} (the picked experts identical)", kind="semantic",
                 after="moe_softmax")
ROUTER_DTYPE = Knob("router_dtype", choice("f32", "bf16"), "f32 | bf16", "f32",
                    "the router's logits and softmax computed in bf16 (transformers takes the softmax in f32)",
                    fixed("router_dtype=bf16"),
                    expected=f"{_FIRST}{ROUTER_LOGITS} (in a bf16 run, whose logits are bf16 anyway: the scores)",
                    kind="semantic", after="norm_topk")
EXPERT_GATE_UP = Knob("expert_gate_up", choice("gate_up", "up_gate"), "gate_up | up_gate", "gate_up",
                      "each expert's gate and up projections swapped: act(up)·gate", fixed("expert_gate_up=up_gate"),
                      expected=_FIRST + EXPERTS, kind="semantic", after="router_dtype")
EXPERT_ORDER = Knob("expert_order", choice("keep", "reversed"), "keep | reversed", "keep",
                    "the experts' weights loaded in reverse order: the router picks expert e, the port runs expert "
                    "E-1-e", fixed("expert_order=reversed"), expected=_FIRST + EXPERTS, kind="semantic",
                    after="expert_gate_up")
SHARED_GATE = Knob("shared_gate", choice("keep", "drop"), "keep | drop", "keep",
                   "the shared expert's sigmoid gate dropped: its output added ungated (a quantized path did this)",
                   fixed("shared_gate=drop"), expected=_FIRST + SHARED_EXPERT, kind="semantic",
                   after="expert_order")


@dataclass(frozen=True)
class ExpertNames:
    """How `save_pretrained` names a family's router and experts, relative to the layer: Mixtral's
    `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1|w3|w2`; the others' `mlp.gate`,
    `mlp.experts.{e}.gate_proj|up_proj|down_proj`."""

    prefix: str = MLP
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    @property
    def router(self) -> str:
        return f"{self.prefix}.gate{WEIGHT}"

    def expert(self, expert: int, which: str) -> str:
        """`which`: "gate", "up" or "down", in the family's own names."""
        return f"{self.prefix}.experts.{expert}.{getattr(self, which)}{WEIGHT}"


MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


def shared_weight(which: str) -> str:
    """The shared expert's own gate_proj, up_proj or down_proj (`which`: "gate", "up", "down")."""
    return f"{SHARED_EXPERT}.{getattr(ExpertNames(), which)}{WEIGHT}"


SHARED_GATE_WEIGHT = f"{SHARED_EXPERT}_gate{WEIGHT}"  # (1, C)
_DENSE = GatedMLP()  # a dense layer's MLP (Qwen2-MoE's and Qwen3-MoE's mlp_only_layers)
_DENSE_POINTS = frozenset(point.name for point in _DENSE.points(""))
_ROUTED_POINTS = frozenset({ROUTER_LOGITS, ROUTER_SCORES, TOP_K_INDEX, TOP_K_WEIGHTS, EXPERTS, SHARED_EXPERT})


# --- the router's steps ------------------------------------------------------------------------


def router_logits_f32(flat: torch.Tensor, weight: torch.Tensor, linear) -> torch.Tensor:
    """(T, C) -> (T, E) in the model's dtype."""
    return linear(flat[None], weight)[0]  # (T, E)


def router_logits_bf16(flat: torch.Tensor, weight: torch.Tensor, linear) -> torch.Tensor:
    """A port that runs its router in bf16: inputs and weights rounded to bf16, logits in bf16."""
    return linear(flat[None].bfloat16(), weight.bfloat16())[0]  # (T, E)


def softmax_scores(logits: torch.Tensor, in_f32: bool = True) -> torch.Tensor:
    """transformers: softmax(logits, dtype=float32) over the experts, (T, E)."""
    return torch.softmax(logits.float(), dim=-1) if in_f32 else torch.softmax(logits, dim=-1)


def sigmoid_scores(logits: torch.Tensor, in_f32: bool = True) -> torch.Tensor:
    """A port that takes a sigmoid of each logit instead, (T, E)."""
    return torch.sigmoid(logits.float() if in_f32 else logits)


def renormalized(top: torch.Tensor) -> torch.Tensor:
    """The top-k weights divided by their sum, (T, k)."""
    return top / top.sum(dim=-1, keepdim=True)


def as_picked(top: torch.Tensor) -> torch.Tensor:
    return top


def route_scores_first(flat: torch.Tensor, run, moe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' routers: scores over every expert, top-k of them, the weights renormalized where the
    model does. Returns the weights (T, k), the picked experts (T, k) and the logits (T, E)."""
    steps = run.steps
    logits = steps.router_logits(flat, run.weights[moe.names.router], steps.linear)  # (T, E)
    run.record(ROUTER_LOGITS, logits[None])
    scores = steps.scoring(logits, steps.router_f32)  # (T, E)
    run.record(ROUTER_SCORES, scores[None])
    top, picked = torch.topk(scores, moe.top_k_of(run.spec), dim=-1)  # (T, k) each
    return steps.renormalize(top).to(logits.dtype) if moe.cast_weights else steps.renormalize(top), picked, logits


def route_topk_first(flat: torch.Tensor, run, moe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A port that picks the top-k logits and takes the softmax over those k only (no scores over every
    expert are formed, so none are recorded)."""
    steps = run.steps
    logits = steps.router_logits(flat, run.weights[moe.names.router], steps.linear)  # (T, E)
    run.record(ROUTER_LOGITS, logits[None])
    top_logits, picked = torch.topk(logits, moe.top_k_of(run.spec), dim=-1)  # (T, k) each
    top = steps.scoring(top_logits, steps.router_f32)  # (T, k), summing to 1 with a softmax
    return top.to(logits.dtype) if moe.cast_weights else top, picked, logits


def own_routing(top: torch.Tensor, picked: torch.Tensor, run) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts run on the router's own weights and picks (a forced run gives others:
    `tracer.reimpl.forced_runs.GivenRouting`)."""
    return top, picked


# --- the experts' steps ------------------------------------------------------------------------


def gate_up_stacked(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """transformers fuses an expert's gate and up on load: (2I, C), the gate first."""
    return torch.cat([gate, up])


def up_gate_stacked(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([up, gate])


def same_expert(expert: int, experts: int) -> int:
    return expert


def reversed_expert(expert: int, experts: int) -> int:
    return experts - 1 - expert


ALIGNMENT = 64  # bytes: where torch's allocator starts a tensor, and transformers' fused experts' slices


def aligned(weight: torch.Tensor) -> torch.Tensor:
    """The weight at an address BLAS treats as transformers' (a slice of its fused (E, C, I) experts tensor):
    one token's matrix-vector product sums in another order from a weight mapped from a safetensors file
    at an 8-byte offset (measured: 1 f32 ulp on a tiny Mixtral's expert hit by one token)."""
    return weight if weight.data_ptr() % ALIGNMENT == 0 else weight.clone()


def routed_experts(flat: torch.Tensor, top: torch.Tensor, picked: torch.Tensor, run, moe) -> torch.Tensor:
    """transformers' eager experts loop: (T, C) tokens, (T, k) weights and picks -> (T, C)."""
    steps, spec, w = run.steps, run.spec, run.weights
    experts = moe.experts_of(spec)
    out = torch.zeros_like(flat)  # (T, C)
    mask = F.one_hot(picked, num_classes=experts + 1).permute(2, 1, 0)  # (E + 1, k, T)
    for hit in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = int(hit[0])
        slot, token = torch.where(mask[e])  # which of its k picks, which token
        stored = steps.expert_index(e, experts)
        gate_up = steps.stack_gate_up(w[moe.names.expert(stored, "gate")], w[moe.names.expert(stored, "up")])
        gate, up = steps.linear(flat[token][None], gate_up)[0].chunk(2, dim=-1)  # (n, I) each
        h = activation(spec.hidden_act)(gate) * up  # (n, I)
        h = steps.linear(h[None], aligned(w[moe.names.expert(stored, "down")]))[0]  # (n, C)
        h = h * top[token, slot, None]  # (n, C)
        out.index_add_(0, token, h.to(out.dtype))
    return out


# --- the shared expert's steps -----------------------------------------------------------------


def shared_mlp(flat: torch.Tensor, run) -> torch.Tensor:
    """Qwen2MoeMLP on every token: down(act(gate(x))·up(x)), (T, C) -> (T, C)."""
    w, linear = run.weights, run.steps.linear
    gate = linear(flat[None], w[shared_weight("gate")])  # (1, T, I)
    up = linear(flat[None], w[shared_weight("up")])  # (1, T, I)
    return linear(activation(run.spec.hidden_act)(gate) * up, w[shared_weight("down")])[0]  # (T, C)


def sigmoid_gated(flat: torch.Tensor, shared: torch.Tensor, run) -> torch.Tensor:
    """sigmoid(shared_expert_gate(x)) · shared, (T, C)."""
    return torch.sigmoid(run.steps.linear(flat[None], run.weights[SHARED_GATE_WEIGHT])[0]) * shared  # (T, 1)·(T, C)


def ungated(flat: torch.Tensor, shared: torch.Tensor, run) -> torch.Tensor:
    return shared


@dataclass(frozen=True)
class SparseMoE(Component):
    """A router over the experts, each token through its top `num_experts_per_tok`.

    Attributes:
        names: the router's and experts' weight names (`ExpertNames`).
        experts: the config field counting the experts (Mixtral's num_local_experts, the others'
            num_experts; each reads the other's name too, as transformers' attribute_map does).
        top_k: num_experts_per_tok with the family's default.
        expert_size: the experts' intermediate size field (Qwen's moe_intermediate_size); None:
            intermediate_size (Mixtral, OLMoE).
        norm_topk: norm_topk_prob with its default; None: always renormalized (Mixtral).
        cast_weights: the weights cast back to the logits' dtype after top-k (not Mixtral's).
        shared: shared_expert_intermediate_size, where a shared expert stands behind a sigmoid gate.
        dense_layers: the layers are dense where `mlp_only_layers` lists them or `decoder_sparse_step`
            skips them (Qwen2-MoE, Qwen3-MoE).
    """

    names: ExpertNames = ExpertNames()
    experts: ConfigField = ConfigField("num_experts", 8)
    top_k: ConfigField = ConfigField("num_experts_per_tok", 2)
    expert_size: ConfigField | None = None
    norm_topk: ConfigField | None = None
    cast_weights: bool = True
    shared: ConfigField | None = None
    dense_layers: bool = False

    @property
    def knobs(self) -> tuple:
        return (SCORING, SOFTMAX_ORDER, NORM_TOPK, ROUTER_DTYPE, EXPERT_GATE_UP, EXPERT_ORDER,
                *((SHARED_GATE,) if self.shared else ()))

    @property
    def config_fields(self) -> tuple[ConfigField, ...]:
        dense = (ConfigField("decoder_sparse_step", 1), ConfigField("mlp_only_layers", None, "layers"))
        return (self.experts, self.top_k, *(f for f in (self.expert_size, self.norm_topk, self.shared) if f),
                *(dense if self.dense_layers else ()))

    @property
    def output(self) -> str:
        return MLP

    def experts_of(self, spec) -> int:
        return getattr(spec, self.experts.key)

    def top_k_of(self, spec) -> int:
        return getattr(spec, self.top_k.key)

    def is_sparse(self, spec, layer: int) -> bool:
        """transformers' `Qwen2MoeDecoderLayer`: sparse unless in mlp_only_layers or off decoder_sparse_step."""
        if not self.dense_layers:
            return True
        return layer not in spec.mlp_only_layers and (layer + 1) % spec.decoder_sparse_step == 0

    def points(self, source: str) -> tuple[Point, ...]:
        dense = _DENSE.points(source) if self.dense_layers else ()
        shared = (Point(SHARED_EXPERT, "shared", "rows", "experts", "the shared expert's output times its sigmoid "
                        "gate", source, f"within:{MLP}:gated"),) if self.shared else ()
        return (*dense,
                Point(ROUTER_LOGITS, "router", "rows", "router", "router logits, one per expert (T, E)", source,
                      f"within:{ROUTER_LOGITS}:linear"),
                Point(ROUTER_SCORES, "scores", "rows", "routing", "the router's scores over every expert, f32",
                      ROUTER_LOGITS, f"within:{ROUTER_LOGITS}:scores"),
                Point(TOP_K_INDEX, "top-k", "rows", "routing", "the picked experts, int64 (T, k), in top-k's order",
                      ROUTER_SCORES, "output[2]:(T, X)"),
                Point(TOP_K_WEIGHTS, "weights", "rows", "routing", "the picked experts' routing weights (T, k)",
                      ROUTER_SCORES, "output[1]:(T, X)"),
                Point(EXPERTS, "experts", "rows", "experts", "the picked experts' outputs times their routing "
                      "weights, summed", TOP_K_WEIGHTS, "output:(T, X)"),
                *shared,
                Point(MLP, "moe", "rows", "moe", "the MLP's output (the experts' sum, plus the shared expert's)",
                      EXPERTS))

    def records_on(self, spec, layer: int, point: str) -> bool:
        """A dense layer records the gated MLP's points, a sparse one the routing points; both the MLP's output."""
        if not self.dense_layers or point not in _DENSE_POINTS | _ROUTED_POINTS:
            return True
        return (point in _ROUTED_POINTS) == self.is_sparse(spec, layer)

    def weights(self, spec) -> dict:
        return self.layer_weights(spec, 0)

    def layer_weights(self, spec, layer: int) -> dict:
        if not self.is_sparse(spec, layer):
            return _DENSE.weights(spec)
        c, experts = spec.hidden_size, self.experts_of(spec)
        i = spec.intermediate_size if self.expert_size is None else getattr(spec, self.expert_size.key)
        shapes = {self.names.router: (experts, c)}
        for e in range(experts):
            shapes |= {self.names.expert(e, "gate"): (i, c), self.names.expert(e, "up"): (i, c),
                       self.names.expert(e, "down"): (c, i)}
        if self.shared:
            s = getattr(spec, self.shared.key)
            shapes |= {shared_weight("gate"): (s, c), shared_weight("up"): (s, c), shared_weight("down"): (c, s)}
            shapes[SHARED_GATE_WEIGHT] = (1, c)
        return shapes

    def steps(self, knobs: dict, spec) -> dict:
        norm = setting(knobs, "norm_topk")
        renorm = renormalizes(spec) if norm == "config" else norm == "force"
        after = setting(knobs, "moe_softmax") == "after_topk"
        return {**(_DENSE.steps(knobs, spec) if self.dense_layers else {}),
                "route": route_topk_first if after else route_scores_first,
                "routing": own_routing,
                "router_logits": router_logits_bf16 if setting(knobs, "router_dtype") == "bf16" else router_logits_f32,
                "router_f32": setting(knobs, "router_dtype") == "f32",
                "scoring": sigmoid_scores if setting(knobs, "moe_scoring") == "sigmoid" else softmax_scores,
                "renormalize": renormalized if renorm else as_picked,
                "stack_gate_up": up_gate_stacked if setting(knobs, "expert_gate_up") == "up_gate" else gate_up_stacked,
                "expert_index": reversed_expert if setting(knobs, "expert_order") == "reversed" else same_expert,
                **({"shared_gate": ungated if setting(knobs, "shared_gate") == "drop" else sigmoid_gated}
                   if self.shared else {})}

    def dense_forward(self, x: torch.Tensor, run, dense: Component = _DENSE) -> torch.Tensor | None:
        """A dense layer's MLP output (1, T, C), recorded as the MLP's; None on a sparse layer."""
        if self.is_sparse(run.spec, run.index):
            return None
        out = dense.forward(x, run)  # (1, T, C)
        run.record(MLP, out)
        return out

    def forward(self, x: torch.Tensor, run) -> torch.Tensor:
        """x (1, T, C) -> (1, T, C)."""
        if (out := self.dense_forward(x, run)) is not None:
            return out
        batch, tokens, hidden = x.shape
        flat = x.view(-1, hidden)  # (T, C)
        shared = shared_mlp(flat, run) if self.shared else None  # before the router, as transformers runs it
        top, picked, _ = run.steps.route(flat, run, self)  # (T, k) each
        run.record(TOP_K_INDEX, picked[None])
        run.record(TOP_K_WEIGHTS, top[None])
        top, picked = run.steps.routing(top, picked, run)  # (T, k) each: the router's, or a forced run's
        out = routed_experts(flat, top, picked, run, self)  # (T, C)
        run.record(EXPERTS, out[None])
        if shared is not None:
            gated = run.steps.shared_gate(flat, shared, run)  # (T, C)
            run.record(SHARED_EXPERT, gated[None])
            out = out + gated
        out = out.reshape(batch, tokens, hidden)  # (1, T, C)
        run.record(MLP, out)
        return out
