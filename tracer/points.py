"""The point vocabulary every engine records under (docs/design.md, "Points"), described once.

A point is named by the HF module path whose output it is (`model.layers.3.mlp.down_proj`), or
is a virtual point under its module for a value no module returns (`...self_attn.q_rope`).
Batch is 1 and dropped. `SUB_POINTS` describes each per-layer sub-point once: its label, its
layout, the op kind that computes it, what it is, the sub-point it is computed from and how the
hf engine observes it. Layouts, hints, figures, hooks and the notebook views all read this
table; adding a point is one entry here (and its place in the families' order, `layer_order`).

Families (`tracer.families`) share the table: a point means the same thing and has the same layout
in every family that has it. What differs per family is the order of the per-layer points
(`layer_order(family)`; in Gemma 2/3 and OLMo-2 `post_attention_layernorm` normalizes the attention
output *before* the residual add), and for a few points what they are computed from and how the hf
engine observes them (`family_overrides(family)`; read through `sub_points(family)`). Both are
derived from the family's `tracer.families.Family` row, never written per family. Traces carry their
family in their metadata (`meta["family"]`); functions that order or explain points take it.

Layouts (T tokens, H query heads, KV kv heads, D head dim):
- "rows": (T, X), one row per position (hidden states, norms, MLP points, logits);
- "merged": (T, heads·D), per-head values side by side (q/k/v projections, the context);
- "heads": (heads, T, D), per-head values head-first (q/k after RoPE);
- "attention": (H, T, T), query × key; entries above the diagonal are masked by causality and
  excluded from metrics.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from tracer import families

EMBED = "model.embed_tokens"
FINAL_NORM = "model.norm"
LOGITS = "lm_head"
BLOCK_INPUT = "<in>"  # the block's input: the previous block's output, or the embeddings


@dataclass(frozen=True)
class SubPoint:
    """One per-layer point, relative to `model.layers.{i}` ("" is the block output).

    Attributes:
        name: the path under the layer, e.g. "self_attn.q_rope".
        label: a short label for figures and tables.
        layout: "rows" | "merged" | "heads" | "attention" (see the module docstring).
        op: the kind of op that computes it ("norm", "projection", "rope", "scores", "softmax",
            "attention", "residual", "activation", "block"), which hints and notes read.
        what: one line saying what it is.
        source: the sub-point it is computed from (`BLOCK_INPUT` for the block's input).
        observed: how the hf engine sees it: "output" (the module's output), "output:(T, H, D)" or
            "output:(H, T, D)" (the module's output laid out per head, merged into the point's
            (T, H·D)), "input:MODULE" (the first input of that module under the layer), or
            "attention" (the recording attention function).
    """

    name: str
    label: str
    layout: str
    op: str
    what: str
    source: str
    observed: str = "output"


SUB_POINTS: dict[str, SubPoint] = {
    sub.name: sub
    for sub in (
        SubPoint("input_layernorm", "in_norm", "rows", "norm", "RMSNorm before attention", BLOCK_INPUT),
        SubPoint("self_attn.qkv_proj", "qkv_proj", "merged", "projection",
                 "fused q | k | v projection (Phi-3), (T, (H + 2·KV)·D)", "input_layernorm"),
        SubPoint("self_attn.q_proj", "q_proj", "merged", "projection", "query projection", "input_layernorm"),
        SubPoint("self_attn.q_norm", "q_norm", "merged", "norm", "RMSNorm of the queries before RoPE",
                 "self_attn.q_proj"),
        SubPoint("self_attn.k_proj", "k_proj", "merged", "projection", "key projection", "input_layernorm"),
        SubPoint("self_attn.k_norm", "k_norm", "merged", "norm", "RMSNorm of the keys before RoPE",
                 "self_attn.k_proj"),
        SubPoint("self_attn.v_proj", "v_proj", "merged", "projection", "value projection", "input_layernorm"),
        SubPoint("self_attn.q_rope", "q_rope", "heads", "rope", "queries after RoPE, HF half-split layout",
                 "self_attn.q_proj", "attention"),
        SubPoint("self_attn.k_rope", "k_rope", "heads", "rope", "keys after RoPE, HF half-split layout",
                 "self_attn.k_proj", "attention"),
        SubPoint("self_attn.scores", "scores", "attention", "scores", "q·kᵀ·scale before softmax",
                 "self_attn.q_rope", "attention"),
        SubPoint("self_attn.probs", "probs", "attention", "softmax", "softmax of the masked scores",
                 "self_attn.scores", "attention"),
        SubPoint("self_attn.context", "context", "merged", "attention", "probs·v, heads merged (input of o_proj)",
                 "self_attn.probs", "attention"),
        SubPoint("self_attn.o_proj", "o_proj", "rows", "projection", "attention output", "self_attn.context"),
        SubPoint("resid_mid", "resid_mid", "rows", "residual", "after the attention residual add",
                 "self_attn.o_proj", "input:post_attention_layernorm"),
        SubPoint("post_attention_layernorm", "post_norm", "rows", "norm", "RMSNorm before the MLP", "resid_mid"),
        SubPoint("pre_feedforward_layernorm", "pre_ff_norm", "rows", "norm", "RMSNorm before the MLP (Gemma)",
                 "resid_mid"),
        SubPoint("mlp.gate_up_proj", "gate_up", "rows", "projection", "fused gate | up projection (Phi-3), (T, 2·I)",
                 "post_attention_layernorm"),
        SubPoint("mlp.gate_proj", "gate", "rows", "projection", "MLP gate projection", "post_attention_layernorm"),
        SubPoint("mlp.up_proj", "up", "rows", "projection", "MLP up projection", "post_attention_layernorm"),
        SubPoint("mlp.act", "act", "rows", "activation", "act(gate)·up (input of down_proj)", "mlp.gate_proj",
                 "input:mlp.down_proj"),
        SubPoint("mlp.down_proj", "down", "rows", "projection", "MLP output", "mlp.act"),
        SubPoint("post_feedforward_layernorm", "post_ff_norm", "rows", "norm",
                 "RMSNorm of the MLP output, before the residual add", "mlp.down_proj"),
        SubPoint("", "block out", "rows", "block", "block output (after the MLP residual add)", "mlp.down_proj"),
    )
}

# What a fused attention kernel (sdpa, flash attention, MLX's fast sdpa) never forms as tensors.
FUSED_AWAY = ("self_attn.scores", "self_attn.probs")


def fused_away(reason: str) -> dict[str, str]:
    """The per-layer points a fused attention kernel never forms, each with why."""
    return dict.fromkeys(FUSED_AWAY, reason)


FINAL_LOGITS = "lm_head.softcap"  # Gemma's soft-capped logits: a virtual point under lm_head

# Points outside the blocks, in execution order: point -> (label, op, what).
MODEL_POINTS = {
    EMBED: ("embed", "embedding", "token embeddings (times sqrt(hidden) in Gemma)"),
    FINAL_NORM: ("norm", "norm", "final RMSNorm"),
    LOGITS: ("logits", "logits", "logits: the lm_head projection"),
    FINAL_LOGITS: ("capped logits", "softcap", "final logits soft-capped, cap·tanh(logits/cap) (Gemma)"),
}

_ATTENTION = ("self_attn.q_rope", "self_attn.k_rope", "self_attn.scores", "self_attn.probs", "self_attn.context",
              "self_attn.o_proj")


def layer_order(family: str | None = None) -> tuple[str, ...]:
    """A family's per-layer points in execution order (transformers' modeling_<family>.py, op by op),
    derived from its `Family` row (None: Llama)."""
    row = families.get(family)
    (attn_pre, attn_post), (mlp_pre, mlp_post) = row.norms
    order = [attn_pre] if attn_pre else []
    order += _projection_order(row)
    order += _ATTENTION
    # A post-norm (Gemma's sandwich, OLMo-2) normalizes the attention output before the residual add.
    order += [attn_post, "resid_mid"] if attn_post else ["resid_mid"]
    order += [mlp_pre] if mlp_pre else []
    order += ["mlp.gate_up_proj"] if row.mlp == "fused" else ["mlp.gate_proj", "mlp.up_proj"]
    order += ["mlp.act", "mlp.down_proj"]
    order += [mlp_post] if mlp_post else []
    return (*order, "")


def _projection_order(row: families.Family) -> list[str]:
    if row.projections == "fused":
        return ["self_attn.qkv_proj"]
    if row.qk_norm == "none":
        return ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    if row.qk_norm == "per_head_heads_first":  # normed after the head transpose, once all three exist
        return ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.q_norm", "self_attn.k_norm"]
    return ["self_attn.q_proj", "self_attn.q_norm", "self_attn.k_proj", "self_attn.k_norm", "self_attn.v_proj"]


# Family.qk_norm -> (what q_norm is, what k_norm is, how the hf engine observes them)
_PER_HEAD = ("per-head RMSNorm of the queries (over D)", "per-head RMSNorm of the keys (over D)")
_QK_NORM_WHAT = {
    "per_head": (*_PER_HEAD, "output:(T, H, D)"),
    "per_head_heads_first": (*_PER_HEAD, "output:(H, T, D)"),
    "whole": ("RMSNorm of the whole query projection (over H·D)", "RMSNorm of the whole key projection (over KV·D)",
              "output"),
}


def family_overrides(family: str | None = None) -> dict[str, dict]:
    """Where a family's points differ from the table (what a point is computed from, how hf observes
    it, what it is), derived from its `Family` row; {} for Llama."""
    row = families.get(family)
    (attn_pre, attn_post), (mlp_pre, mlp_post) = row.norms
    out: dict[str, dict] = {}

    def put(sub: str, **fields) -> None:
        out.setdefault(sub, {}).update(fields)

    if attn_pre is None:
        for sub in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            put(sub, source=BLOCK_INPUT)
    if row.qk_norm != "none":
        q_what, k_what, observed = _QK_NORM_WHAT[row.qk_norm]
        put("self_attn.q_norm", what=q_what, **({} if observed == "output" else {"observed": observed}))
        put("self_attn.k_norm", what=k_what, **({} if observed == "output" else {"observed": observed}))
        put("self_attn.q_rope", source="self_attn.q_norm")
        put("self_attn.k_rope", source="self_attn.k_norm")
    if row.projections == "fused":
        put("self_attn.q_rope", source="self_attn.qkv_proj")
        put("self_attn.k_rope", source="self_attn.qkv_proj")
    if attn_post:
        put(attn_post, source="self_attn.o_proj", what="RMSNorm of the attention output, before the residual add")
        put("resid_mid", source=attn_post, observed=f"input:{mlp_pre or 'mlp'}")
    if mlp_pre != "post_attention_layernorm":
        for sub in ("mlp.gate_proj", "mlp.up_proj"):
            put(sub, source=mlp_pre or "resid_mid")
    if row.mlp == "fused":
        put("mlp.act", source="mlp.gate_up_proj")
    if mlp_post:
        put("", source=mlp_post)
    return out


# How the hf engine observes the points outside the blocks: a module's output, or a field of the
# whole model's output (Gemma's capped logits are what the model returns).
MODEL_OBSERVED = {EMBED: "output", FINAL_NORM: "output", LOGITS: "output", FINAL_LOGITS: "model:logits"}


def model_points(final_softcap: bool = False) -> tuple[str, ...]:
    """The points outside the blocks, in execution order; the capped logits where the config soft-caps
    the logits (Gemma 2's final_logit_softcapping)."""
    return (EMBED, FINAL_NORM, LOGITS, FINAL_LOGITS) if final_softcap else (EMBED, FINAL_NORM, LOGITS)


def sub_points(family: str | None = None) -> dict[str, SubPoint]:
    """A family's per-layer sub-points in its execution order, its overrides applied (None: Llama)."""
    row = families.get(family)
    cached = _SUB_POINTS_BY_FAMILY.get(row.name)
    if cached is None or cached[0] is not row:  # a row replaced under the same name (tests) is read afresh
        overrides = family_overrides(row.name)
        table = {sub: dataclasses.replace(SUB_POINTS[sub], **overrides.get(sub, {})) for sub in layer_order(row.name)}
        cached = _SUB_POINTS_BY_FAMILY[row.name] = (row, table)
    return cached[1]


_SUB_POINTS_BY_FAMILY: dict[str, tuple[families.Family, dict[str, SubPoint]]] = {}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)(?:\.(.+))?$")


def split_point(point: str) -> tuple[int | None, str]:
    """`model.layers.3.self_attn.q_rope` -> (3, "self_attn.q_rope"); `model.layers.3` -> (3, "");
    a point outside the blocks -> (None, point)."""
    match = _LAYER_RE.match(point)
    if match is None:
        return None, point
    return int(match.group(1)), match.group(2) or ""


def layer_of(point: str) -> int | None:
    """The block index a point belongs to; None for embeddings, final norm and logits."""
    return split_point(point)[0]


def sub_point_of(point: str, family: str | None = None) -> SubPoint | None:
    """The table entry of a per-layer point, as `family` has it (None outside the blocks or for an
    unknown name)."""
    layer, sub = split_point(point)
    if layer is None:
        return None
    return sub_points(family).get(sub) or SUB_POINTS.get(sub)


def layer_point(layer: int, sub: str) -> str:
    return f"model.layers.{layer}.{sub}" if sub else f"model.layers.{layer}"


def folded(point: str) -> str:
    """The point with its layer index as `{i}`: `model.layers.{i}.self_attn.q_rope` (how views
    fold 30 layers into one row, and how alias patterns are written)."""
    layer, sub = split_point(point)
    return point if layer is None else layer_point("{i}", sub)


def rank(point: str, family: str | None = None) -> tuple:
    """A sort key in execution order for any point or folded point: embeddings, the blocks
    (layer by layer, sub-points in `family`'s order, Llama's by default), final norm, logits,
    capped logits; unknown names last. A sub-point the family lacks goes after its own, in the
    table's order."""
    if point in MODEL_POINTS:
        return (list(MODEL_POINTS).index(point) * 2, 0, 0)  # embed 0, norm 2, logits 4, capped logits 6
    match = re.match(r"^model\.layers\.(\d+|\{i\})(?:\.(.+))?$", point)
    if match is None:
        return (7, 0, point)
    layer = -1 if match.group(1) == "{i}" else int(match.group(1))
    order = tuple(sub_points(family))
    sub = match.group(2) or ""
    if sub in order:
        return (1, layer, order.index(sub))
    table = list(SUB_POINTS)
    return (1, layer, len(order) + (table.index(sub) if sub in table else len(table)))


def label(point: str) -> str:
    """A short label: the sub-point's for a per-layer point, the model point's otherwise."""
    entry = sub_point_of(point)
    if entry is not None:
        return entry.label
    return MODEL_POINTS[point][0] if point in MODEL_POINTS else split_point(point)[1]


def op_kind(point: str) -> str | None:
    entry = sub_point_of(point)
    if entry is not None:
        return entry.op
    return MODEL_POINTS[point][1] if point in MODEL_POINTS else None


def layout_of(point: str) -> str:
    entry = sub_point_of(point)
    return entry.layout if entry is not None else "rows"


def all_points(num_layers: int, family: str = "llama", *, final_softcap: bool = False) -> list[str]:
    """Every point of a model with `num_layers` blocks, in execution order; `final_softcap`: its
    config soft-caps the logits (Gemma 2), which adds the capped logits."""
    first, *last = model_points(final_softcap)
    names = [first]
    for i in range(num_layers):
        names += [layer_point(i, sub) for sub in sub_points(family)]
    return names + last


def is_coarse(point: str) -> bool:
    """On the coarse curve: embeddings, a block output, final norm or logits."""
    layer, sub = split_point(point)
    return point in MODEL_POINTS or (layer is not None and sub == "")


def is_causal(point: str) -> bool:
    return layout_of(point) == "attention"


def has_head_axis(point: str) -> bool:
    """Laid out (heads, T, ...) rather than (T, ...)."""
    return layout_of(point) in ("heads", "attention")


def causal_allowed(queries: int, keys: int):
    """(queries, keys) bool: what each query may attend to. Queries are the *last* `queries`
    positions, so a matrix reduced to its last rows keeps the right diagonal."""
    import torch

    return torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)


def source_point(point: str, family: str | None = None) -> str | None:
    """The point `point` is computed from in `family` (None for the embeddings and outside the table)."""
    if point == FINAL_LOGITS:
        return LOGITS
    if point == FINAL_NORM or point == LOGITS:
        return None
    layer, _ = split_point(point)
    entry = sub_point_of(point, family)
    if entry is None:
        return None
    if entry.source == BLOCK_INPUT:
        return EMBED if layer == 0 else layer_point(layer - 1, "")
    return layer_point(layer, entry.source)
