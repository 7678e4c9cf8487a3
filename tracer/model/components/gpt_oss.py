"""gpt-oss's own parts: attention with sinks, its biased top-k router and its clamped-SwiGLU experts.

Mirrors transformers 5.25 op by op (`models/gpt_oss/modeling_gpt_oss.py`):

- attention sinks (`eager_attention_forward`): the scaled, masked scores get one more column per head, the
  head's learned sink logit; the max of each row is subtracted, the softmax taken in the scores' dtype, and the
  sink's column dropped: each row of probabilities then sums to less than 1, the rest going to no value;
- the router (`GptOssTopKRouter`): logits = x·Wᵀ + b, top-k of the logits, the softmax over the k picked
  logits only (in their dtype); the scores over every expert are never formed, and top-k picks from the
  biased logits themselves, which are recorded as the selection too (the routing diff reads its margins there);
- the experts (`GptOssExperts`, the eager loop): per expert hit, in expert order, its tokens through
  x @ gate_up[e] + b (stored (E, C, 2I), gate and up interleaved: gate the even columns, up the odd), the
  clamped SwiGLU (gate clamped above at `swiglu_limit`, up to ±limit, gate·sigmoid(alpha·gate)·(up + 1)),
  then @ down[e] + b, times the routing weight, `index_add_`.

No point for the sinks alone: transformers forms no tensor of them but the parameter expanded and the
softmax's input with the sink column, which it drops after the softmax; a sink shows in `self_attn.probs`
(rows summing to less than 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

from tracer.core.errors import TracerError
from tracer.core.lazy import F, torch
from tracer.model.component import ConfigField, Point
from tracer.model.components.attention import Attention, attention_eager, score_scale_dim
from tracer.model.components.moe import SparseMoE, aligned
from tracer.model.components.rope import Rope
from tracer.model.knobs import Knob, choice, fixed, setting
from tracer.model.points import (
    EXPERTS,
    MLP,
    PROBS,
    ROUTER_LOGITS,
    ROUTER_SELECTION,
    SCORES,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
)

_FIRST = "layers.0."
SINKS = "self_attn.sinks"  # (H,), a learned logit per head (a weight, not a point)
ROUTER = "mlp.router"  # transformers' router module: its weight and bias
GATE_UP, GATE_UP_BIAS = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"  # (E, C, 2I), (E, 2I)
DOWN, DOWN_BIAS = "mlp.experts.down_proj", "mlp.experts.down_proj_bias"  # (E, I, C), (E, C)

SINKS_KNOB = Knob("sinks", choice("keep", "drop"), "keep | drop", "keep",
                  "gpt-oss's attention sinks dropped: a plain softmax over the keys, every row summing to 1",
                  fixed("sinks=drop"), expected=_FIRST + PROBS, kind="semantic", after="window")
ROUTER_BIAS = Knob("router_bias", choice("keep", "drop"), "keep | drop", "keep",
                   "gpt-oss's router bias dropped: logits x·Wᵀ without + b (top-k then picks from other logits)",
                   fixed("router_bias=drop"), expected=_FIRST + ROUTER_LOGITS, kind="semantic", after="norm_topk")
SWIGLU_CLAMP = Knob("swiglu_clamp", choice("keep", "drop"), "keep | drop", "keep",
                    "gpt-oss's SwiGLU clamp dropped: gate and up not clamped at swiglu_limit",
                    fixed("swiglu_clamp=drop"), expected=_FIRST + EXPERTS, kind="semantic", after="router_bias")


# --- attention with sinks ------------------------------------------------------------------------


def attention_with_sinks(q, k, v, spec, steps, record, visible=None, *, sinks) -> torch.Tensor:
    """transformers' gpt-oss eager attention: q (B, H, T, D), k/v (B, KV, S, D), sinks (H,) -> (B, H, T, D)."""
    in_dtype = q.dtype
    work = steps.attention_dtype or in_dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    k, v = steps.repeat_kv(k, spec.num_kv_groups), steps.repeat_kv(v, spec.num_kv_groups)  # (B, H, S, D)
    scores = steps.scale_scores(torch.matmul(q, k.transpose(2, 3)), score_scale_dim(spec))  # (B, H, T, S)
    record(SCORES, scores)
    scores = steps.mask(scores, visible)
    column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)  # (B, H, T, 1)
    combined = torch.cat([scores, column], dim=-1)  # (B, H, T, S + 1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)  # (B, H, T, S): sink dropped
    record(PROBS, probs)
    return torch.matmul(probs, v).to(in_dtype)


@dataclass(frozen=True)
class SinkAttention(Attention):
    """Attention with a learned sink logit per head in each softmax's denominator (gpt-oss); no sdpa path,
    as transformers' gpt-oss has none."""

    @property
    def knobs(self) -> tuple:
        return (*super().knobs, SINKS_KNOB)

    def weights(self, spec) -> dict:
        return {**super().weights(spec), SINKS: (spec.num_attention_heads,)}

    def steps(self, knobs: dict, spec) -> dict:
        if setting(knobs, "attn") == "sdpa":
            raise TracerError("attn=sdpa cannot take gpt-oss's attention sinks, nor can transformers' sdpa")
        for knob in ("ops", "kv_cache"):  # the regimes' attentions (llama.cpp's, emulated) have no sinks yet
            if knobs.get(knob) is not None and setting(knobs, "sinks") == "keep":
                raise TracerError(f"{knob}={knobs[knob]}: tracer's emulation of that attention has no sinks yet")
        return {**super().steps(knobs, spec), "sinks": setting(knobs, "sinks") == "keep"}

    def forward(self, x: torch.Tensor, run) -> torch.Tensor:
        """x (1, T, C) -> (1, T, C): the eager core with this layer's sinks, unless a variant drops them."""
        if run.steps.sinks:
            if run.steps.attention is not attention_eager:
                raise TracerError("gpt-oss's attention sinks are in tracer's eager attention only")
            kernel = partial(attention_with_sinks, sinks=run.weights[SINKS])
            run = dataclasses.replace(run, steps=run.steps.replace(attention=kernel))
        return super().forward(x, run)


# transformers' `GptOssConfig.__post_init__`: the scaling a config without rope_parameters gets (theta 150000)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class GptOssRope(Rope):
    """gpt-oss's RoPE: base 150000, and YaRN (factor 32 over 4096 positions) where the config writes none."""

    theta: float = 150000.0

    def read_config(self, config: dict) -> dict:
        if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
            config = {**config, "rope_parameters": {"rope_theta": config.get("rope_theta", self.theta), **DEFAULT_ROPE}}
        return super().read_config(config)


# --- the router and the experts --------------------------------------------------------------------


def router_logits_biased(flat: torch.Tensor, run) -> torch.Tensor:
    """F.linear(x, W, b): (T, C) -> (T, E)."""
    return run.steps.linear(flat[None], run.weights[ROUTER + ".weight"], run.weights[ROUTER + ".bias"])[0]


def router_logits_unbiased(flat: torch.Tensor, run) -> torch.Tensor:
    return run.steps.linear(flat[None], run.weights[ROUTER + ".weight"])[0]  # (T, E)


def route_topk_softmax(flat: torch.Tensor, run, moe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top-k of the logits, softmax over the k in their dtype: the weights (T, k), picks (T, k), logits (T, E)."""
    logits = run.steps.gpt_oss_logits(flat, run)  # (T, E)
    run.record(ROUTER_LOGITS, logits[None])
    run.record(ROUTER_SELECTION, logits[None])  # what top-k picks from
    top, picked = torch.topk(logits, moe.top_k_of(run.spec), dim=-1)  # (T, k) each
    return F.softmax(top, dim=1, dtype=top.dtype), picked, logits


def clamped_swiglu(gate_up: torch.Tensor, spec) -> torch.Tensor:
    """(n, 2I) interleaved -> (n, I): transformers' `GptOssExperts._apply_gate`."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # (n, I) each
    gate = gate.clamp(min=None, max=spec.swiglu_limit)
    up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
    glu = gate * torch.sigmoid(gate * spec.swiglu_alpha)
    return (up + 1) * glu


def unclamped_swiglu(gate_up: torch.Tensor, spec) -> torch.Tensor:
    """A port without the clamp."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # (n, I) each
    return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))


def gpt_oss_experts(flat: torch.Tensor, top: torch.Tensor, picked: torch.Tensor, run, moe) -> torch.Tensor:
    """transformers' eager loop over the fused, biased experts: (T, C), (T, k), (T, k) -> (T, C)."""
    w, spec = run.weights, run.spec
    gate_up, down = aligned(w[GATE_UP]), aligned(w[DOWN])  # (E, C, 2I), (E, I, C): slices as transformers'
    out = torch.zeros_like(flat)  # (T, C)
    mask = F.one_hot(picked, num_classes=moe.experts_of(spec)).permute(2, 1, 0)  # (E, k, T)
    for hit in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = int(hit[0])
        slot, token = torch.where(mask[e])  # which of its k picks, which token
        h = flat[token] @ gate_up[e] + w[GATE_UP_BIAS][e]  # (n, 2I)
        h = run.steps.swiglu(h, spec)  # (n, I)
        h = h @ down[e] + w[DOWN_BIAS][e]  # (n, C)
        h = h * top[token, slot, None]  # (n, C)
        out.index_add_(0, token, h.to(out.dtype))
    return out


@dataclass(frozen=True)
class GptOssMoE(SparseMoE):
    """gpt-oss's MLP: the biased router picking the top-k logits, softmax over the k, and the clamped-SwiGLU
    experts with biases, stored fused (transformers' `GptOssMLP`)."""

    experts: ConfigField = ConfigField("num_local_experts", 128, aliases=("num_experts",))
    top_k: ConfigField = ConfigField("num_experts_per_tok", 4)

    @property
    def knobs(self) -> tuple:
        return (ROUTER_BIAS, SWIGLU_CLAMP)

    @property
    def config_fields(self) -> tuple[ConfigField, ...]:
        return (self.experts, self.top_k, ConfigField("swiglu_limit", 7.0, "positive_number"),
                ConfigField("swiglu_alpha", 1.702, "positive_number"))

    def points(self, source: str) -> tuple[Point, ...]:
        return (Point(ROUTER_LOGITS, "router", "rows", "router", "router logits x·Wᵀ + b, one per expert (T, E)",
                      source, f"within:{ROUTER}:linear"),
                Point(ROUTER_SELECTION, "selection", "rows", "routing", "what top-k picks from: the biased logits",
                      ROUTER_LOGITS, f"within:{ROUTER}:linear"),
                Point(TOP_K_INDEX, "top-k", "rows", "routing", "the picked experts, int64 (T, k), in top-k's order",
                      ROUTER_SELECTION, f"{ROUTER}>output[2]:(T, X)"),
                Point(TOP_K_WEIGHTS, "weights", "rows", "routing", "softmax over the k picked logits (T, k)",
                      ROUTER_SELECTION, f"{ROUTER}>output[1]:(T, X)"),
                Point(EXPERTS, "experts", "rows", "experts", "the picked experts' outputs times their routing "
                      "weights, summed", TOP_K_WEIGHTS, "output:(T, X)"),
                Point(MLP, "moe", "rows", "moe", "the MLP's output (the experts' sum)", EXPERTS))

    def layer_weights(self, spec, layer: int) -> dict:
        c, i, experts = spec.hidden_size, spec.intermediate_size, self.experts_of(spec)
        return {ROUTER + ".weight": (experts, c), ROUTER + ".bias": (experts,),
                GATE_UP: (experts, c, 2 * i), GATE_UP_BIAS: (experts, 2 * i),
                DOWN: (experts, i, c), DOWN_BIAS: (experts, c)}

    def steps(self, knobs: dict, spec) -> dict:
        return {"route": route_topk_softmax, "routed_experts": gpt_oss_experts,
                "gpt_oss_logits": router_logits_unbiased if setting(knobs, "router_bias") == "drop"
                else router_logits_biased,
                "swiglu": unclamped_swiglu if setting(knobs, "swiglu_clamp") == "drop" else clamped_swiglu}

    def forward(self, x: torch.Tensor, run) -> torch.Tensor:
        """x (1, T, C) -> (1, T, C)."""
        batch, tokens, hidden = x.shape
        flat = x.reshape(-1, hidden)  # (B·T, C), as transformers flattens the batch
        top, picked, _ = run.steps.route(flat, run, self)  # (T, k) each
        run.record(TOP_K_INDEX, picked[None])
        run.record(TOP_K_WEIGHTS, top[None])
        out = run.steps.routed_experts(flat, top, picked, run, self)  # (T, C)
        run.record(EXPERTS, out[None])
        out = out.reshape(batch, tokens, hidden)  # (B, T, C)
        run.record(MLP, out)
        return out
