"""The point vocabulary every engine records under (DESIGN.md, "Points"), described once.

A point is named by the HF module path whose output it is (`model.layers.3.mlp.down_proj`), or
is a virtual point under its module for a value no module returns (`...self_attn.q_rope`).
Batch is 1 and dropped. `SUB_POINTS` describes each per-layer sub-point once: its label, its
layout, the op kind that computes it, what it is, the sub-point it is computed from and how the
hf engine observes it. Layouts, hints, figures, hooks and the notebook views all read this
table; adding a point is one entry here (and its place in a family's order, `LAYER_ORDER`).

Layouts (T tokens, H query heads, KV kv heads, D head dim):
- "rows": (T, X), one row per position (hidden states, norms, MLP points, logits);
- "merged": (T, heads·D), per-head values side by side (q/k/v projections, the context);
- "heads": (heads, T, D), per-head values head-first (q/k after RoPE);
- "attention": (H, T, T), query × key; entries above the diagonal are masked by causality and
  excluded from metrics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
        observed: how the hf engine sees it: "output" (the module's output), "input:MODULE" (the
            first input of that module under the layer), or "attention" (the recording
            attention function).
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
        SubPoint("self_attn.q_proj", "q_proj", "merged", "projection", "query projection", "input_layernorm"),
        SubPoint("self_attn.k_proj", "k_proj", "merged", "projection", "key projection", "input_layernorm"),
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
        SubPoint("mlp.gate_proj", "gate", "rows", "projection", "MLP gate projection", "post_attention_layernorm"),
        SubPoint("mlp.up_proj", "up", "rows", "projection", "MLP up projection", "post_attention_layernorm"),
        SubPoint("mlp.act", "act", "rows", "activation", "act(gate)·up (input of down_proj)", "mlp.gate_proj",
                 "input:mlp.down_proj"),
        SubPoint("mlp.down_proj", "down", "rows", "projection", "MLP output", "mlp.act"),
        SubPoint("", "block out", "rows", "block", "block output (after the MLP residual add)", "mlp.down_proj"),
    )
}

# Points outside the blocks: point -> (label, op, what).
MODEL_POINTS = {
    EMBED: ("embed", "embedding", "token embeddings"),
    FINAL_NORM: ("norm", "norm", "final RMSNorm"),
    LOGITS: ("logits", "logits", "logits: the lm_head projection"),
}

# A family's per-layer points in execution order.
LAYER_ORDER = {"llama": tuple(SUB_POINTS)}
# Kept for the many readers that only need Llama's order.
LAYER_POINTS = LAYER_ORDER["llama"]

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


def sub_point_of(point: str) -> SubPoint | None:
    """The table entry of a per-layer point (None outside the blocks or for an unknown name)."""
    layer, sub = split_point(point)
    return SUB_POINTS.get(sub) if layer is not None else None


def layer_point(layer: int, sub: str) -> str:
    return f"model.layers.{layer}.{sub}" if sub else f"model.layers.{layer}"


def folded(point: str) -> str:
    """The point with its layer index as `{i}`: `model.layers.{i}.self_attn.q_rope` (how views
    fold 30 layers into one row, and how alias patterns are written)."""
    layer, sub = split_point(point)
    return point if layer is None else layer_point("{i}", sub)


def rank(point: str) -> tuple:
    """A sort key in execution order for any point or folded point: embeddings, the blocks
    (layer by layer, sub-points in the table's order), final norm, logits; unknown names last."""
    if point in MODEL_POINTS:
        return (list(MODEL_POINTS).index(point) * 2, 0, 0)  # embed 0, norm 2, logits 4
    match = re.match(r"^model\.layers\.(\d+|\{i\})(?:\.(.+))?$", point)
    if match is None:
        return (5, 0, point)
    layer = -1 if match.group(1) == "{i}" else int(match.group(1))
    order = list(SUB_POINTS)
    sub = match.group(2) or ""
    return (1, layer, order.index(sub) if sub in order else len(order))


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


def all_points(num_layers: int, family: str = "llama") -> list[str]:
    """Every point of a model with `num_layers` blocks, in execution order."""
    names = [EMBED]
    for i in range(num_layers):
        names += [layer_point(i, sub) for sub in LAYER_ORDER[family]]
    return names + [FINAL_NORM, LOGITS]


def coarse_points(num_layers: int) -> list[str]:
    """The coarse curve: embeddings, every block output, final norm, logits."""
    return [EMBED, *(layer_point(i, "") for i in range(num_layers)), FINAL_NORM, LOGITS]


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


def source_point(point: str) -> str | None:
    """The point `point` is computed from (None for the embeddings and outside the table)."""
    if point == FINAL_NORM or point == LOGITS:
        return None
    layer, _ = split_point(point)
    entry = sub_point_of(point)
    if entry is None:
        return None
    if entry.source == BLOCK_INPUT:
        return EMBED if layer == 0 else layer_point(layer - 1, "")
    return layer_point(layer, entry.source)
