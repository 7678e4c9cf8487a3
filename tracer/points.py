"""The point vocabulary every engine records under (DESIGN.md, "Points").

Module outputs use the HF module path; values that are not module outputs are virtual points
under their module. Batch is 1 and dropped. The order below is execution order.
"""

from __future__ import annotations

import re

# Per-layer points in execution order, relative to `model.layers.{i}` ("" is the block output).
LAYER_POINTS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.q_rope",
    "self_attn.k_rope",
    "self_attn.scores",
    "self_attn.probs",
    "self_attn.context",
    "self_attn.o_proj",
    "resid_mid",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.act",
    "mlp.down_proj",
    "",
)

EMBED = "model.embed_tokens"
FINAL_NORM = "model.norm"
LOGITS = "lm_head"

# Points of shape (H, T, T) whose entries above the diagonal are masked out by causality:
# they are excluded from metrics.
CAUSAL_SUFFIXES = ("self_attn.scores", "self_attn.probs")

# Points laid out (heads, T, ...) rather than (T, ...).
HEAD_FIRST_SUFFIXES = ("self_attn.q_rope", "self_attn.k_rope", "self_attn.scores", "self_attn.probs")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)(?:\.|$)")


def layer_point(layer: int, sub: str) -> str:
    return f"model.layers.{layer}.{sub}" if sub else f"model.layers.{layer}"


def all_points(num_layers: int) -> list[str]:
    """Every point of a model with `num_layers` blocks, in execution order."""
    names = [EMBED]
    for i in range(num_layers):
        names += [layer_point(i, sub) for sub in LAYER_POINTS]
    return names + [FINAL_NORM, LOGITS]


def coarse_points(num_layers: int) -> list[str]:
    """The coarse curve: embeddings, every block output, final norm, logits."""
    return [EMBED, *(layer_point(i, "") for i in range(num_layers)), FINAL_NORM, LOGITS]


def layer_of(point: str) -> int | None:
    """The block index a point belongs to; None for embeddings, final norm and logits."""
    match = _LAYER_RE.match(point)
    return int(match.group(1)) if match else None


def is_causal(point: str) -> bool:
    return point.endswith(CAUSAL_SUFFIXES)


def causal_allowed(queries: int, keys: int):
    """(queries, keys) bool: what each query may attend to. Queries are the *last* `queries`
    positions, so a matrix reduced to its last rows keeps the right diagonal."""
    import torch

    return torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)


def has_head_axis(point: str) -> bool:
    return point.endswith(HEAD_FIRST_SUFFIXES)


def is_coarse(point: str) -> bool:
    return point in (EMBED, FINAL_NORM, LOGITS) or re.fullmatch(r"model\.layers\.\d+", point) is not None
