"""The point vocabulary every engine records under (docs/design.md, "Points"): one constant per
point name, the grammar of point names, and what is read off the registered families.

A point is named by the HF module path whose output it is (`model.layers.3.mlp.down_proj`), or
is a virtual point under its module for a value no module returns (`...self_attn.q_rope`).
Batch is 1 and dropped. What a point is (its label, layout, op, source, how hf observes it) is
declared once, by the component that computes it (`tracer.model.components`); a family is a
composition of components (`tracer.model.families`), and its point order, records and ranks are read
off it here (`layer_order`, `sub_points`, `all_points`, `rank`, `label`, `layout_of`, `source_point`).
Code outside the components names points by the constants below, never by literals
(tests/unit/test_point_names.py holds it).

Layouts (T tokens, H query heads, KV kv heads, D head dim):
- "rows": (T, X), one row per position (hidden states, norms, MLP points, logits);
- "merged": (T, heads·D), per-head values side by side (q/k/v projections, the context);
- "heads": (heads, T, D), per-head values head-first (q/k after RoPE);
- "attention": (H, T, T), query × key; entries above the diagonal are masked by causality and
  excluded from metrics.
"""

from __future__ import annotations

import functools
import re

from tracer.model.component import Point, family_named, registered, registry_version

# --- points outside the blocks ----------------------------------------------------------------
EMBED = "model.embed_tokens"
FINAL_NORM = "model.norm"
LOGITS = "lm_head"
FINAL_LOGITS = "lm_head.softcap"  # Gemma's soft-capped logits: a virtual point under lm_head

# --- per-layer points, relative to `model.layers.{i}` -----------------------------------------
BLOCK_OUT = ""  # the block output, `model.layers.{i}` itself
BLOCK_INPUT = "<in>"  # the block's input: the previous block's output, or the embeddings
ATTENTION = "self_attn"  # the attention module's path (its output is o_proj's)
MLP = "mlp"  # the MLP module's path (its output is the MLP's last point)
INPUT_NORM = "input_layernorm"
POST_ATTENTION_NORM = "post_attention_layernorm"
PRE_FF_NORM = "pre_feedforward_layernorm"
POST_FF_NORM = "post_feedforward_layernorm"
QKV_PROJ = "self_attn.qkv_proj"
Q_PROJ = "self_attn.q_proj"
K_PROJ = "self_attn.k_proj"
V_PROJ = "self_attn.v_proj"
Q_NORM = "self_attn.q_norm"
K_NORM = "self_attn.k_norm"
Q_ROPE = "self_attn.q_rope"
K_ROPE = "self_attn.k_rope"
SCORES = "self_attn.scores"
PROBS = "self_attn.probs"
CONTEXT = "self_attn.context"
O_PROJ = "self_attn.o_proj"
RESID_MID = "resid_mid"
GATE_UP_PROJ = "mlp.gate_up_proj"
GATE_PROJ = "mlp.gate_proj"
UP_PROJ = "mlp.up_proj"
MLP_ACT = "mlp.act"
DOWN_PROJ = "mlp.down_proj"
# Multi-head latent attention (DeepSeek-V3, `tracer.model.components.mla`): q and kv through low-rank latents.
Q_A_PROJ = "self_attn.q_a_proj"  # (T, q_lora_rank), the query's down-projection
Q_LATENT = "self_attn.q_a_layernorm"  # (T, q_lora_rank), the latent q: q_a_proj RMS-normed (q_b_proj's input)
Q_B_PROJ = "self_attn.q_b_proj"  # (T, H·(nope + rope)), the queries before RoPE, each head non-RoPE part first
KV_A_PROJ = "self_attn.kv_a_proj_with_mqa"  # (T, kv_lora_rank + rope), the latent kv and k's shared RoPE part
K_PE = "self_attn.k_pe"  # (T, rope), k's RoPE part before RoPE: one for every head, the tail of kv_a_proj
KV_LATENT = "self_attn.kv_a_layernorm"  # (T, kv_lora_rank), the latent kv: kv_a_proj's head RMS-normed
K_NOPE = "self_attn.k_nope"  # (H, T, nope), k's non-RoPE part per head: the latent kv through kv_b_proj
# A mixture of experts' MLP (`tracer.model.components.moe`): the router's steps, the experts, the shared expert.
ROUTER_LOGITS = "mlp.gate"  # (T, E), the router's logits
ROUTER_SCORES = "mlp.gate.scores"  # (T, E) f32, softmax or sigmoid of the logits
ROUTER_SELECTION = "mlp.gate.selection"  # (T, E), the scores top-k picks from where a selection bias is added
TOP_K_INDEX = "mlp.gate.top_k_index"  # (T, k) int64, the picked experts in top-k's order
TOP_K_WEIGHTS = "mlp.gate.top_k_weights"  # (T, k), the routing weights applied to them
SHARED_EXPERT = "mlp.shared_expert"  # (T, C), the shared expert's output after its gate
EXPERTS = "mlp.experts"  # (T, C), the routed experts' weighted sum
# Points holding integers: never judged by rel_l2; the routing diff compares them (`tracer.comparison.routing`).
INTEGER_POINTS = (TOP_K_INDEX,)

# What a layer's KV cache holds after a forward with a cache (`--decode`): every slot's keys (after RoPE)
# and values, (KV, S, D). Recorded only by a cached run, ranked right after the keys they hold.
CACHE_K = "self_attn.cache_k"
CACHE_V = "self_attn.cache_v"
CACHE_POINTS = (CACHE_K, CACHE_V)

# What a fused attention kernel (sdpa, flash attention, MLX's fast sdpa) never forms as tensors.
FUSED_AWAY = (SCORES, PROBS)

WEIGHT = ".weight"
BIAS = ".bias"


def fused_away(reason: str) -> dict[str, str]:
    """The per-layer points a fused attention kernel never forms, each with why."""
    return dict.fromkeys(FUSED_AWAY, reason)


# --- the grammar of point names ----------------------------------------------------------------

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)(?:\.(.+))?$")
_FOLDED_RE = re.compile(r"^model\.layers\.(\d+|\{i\})(?:\.(.+))?$")


@functools.lru_cache(maxsize=1 << 16)  # names repeat: a comparison splits each of ~500 points thousands of times
def split_point(point: str) -> tuple[int | None, str]:
    """`model.layers.3.self_attn.q_rope` -> (3, "self_attn.q_rope"); `model.layers.3` -> (3, "");
    a point outside the blocks -> (None, point)."""
    match = _LAYER_RE.match(point)
    if match is None:
        return None, point
    return int(match.group(1)), match.group(2) or ""


def is_integer_point(point: str) -> bool:
    """A point whose values are integers (the experts a router picks): judged by the routing diff."""
    return split_point(point)[1] in INTEGER_POINTS


def layer_of(point: str) -> int | None:
    """The block index a point belongs to; None for embeddings, final norm and logits."""
    return split_point(point)[0]


def layer_point(layer, sub: str) -> str:
    """`model.layers.{layer}.{sub}` (the block output for sub ""); `layer` may be "{i}" for a pattern."""
    return f"model.layers.{layer}.{sub}" if sub else f"model.layers.{layer}"


def folded(point: str) -> str:
    """The point with its layer index as `{i}`: `model.layers.{i}.self_attn.q_rope` (how views
    fold 30 layers into one row, and how alias patterns are written)."""
    layer, sub = split_point(point)
    return point if layer is None else layer_point("{i}", sub)


def causal_allowed(queries: int, keys: int):
    """(queries, keys) bool: what each query may attend to. Queries are the *last* `queries`
    positions, so a matrix reduced to its last rows keeps the right diagonal."""
    import torch  # torch: reading the model's declarations never loads it

    return torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)


# --- read off the families ---------------------------------------------------------------------


def layer_order(family: str | None = None) -> tuple[str, ...]:
    """A family's per-layer points in execution order (None: Llama), read off its composition."""
    return tuple(sub_points(family))


def sub_points(family: str | None = None) -> dict[str, Point]:
    """A family's per-layer points in its execution order (None: Llama)."""
    return family_named(family).sub_points()


_KNOWN: dict[str, tuple[int, dict[str, Point]]] = {}


def _known(kind: str) -> dict[str, Point]:
    """Every point any registered family has, per-layer ("sub") or outside the blocks ("model"), the
    first family's record of a name winning; cached until a family is registered."""
    version, table = _KNOWN.get(kind, (-1, {}))
    if version != registry_version():
        table = {}
        for each in registered().values():
            for name, point in (each.sub_points() if kind == "sub" else each.model_points()).items():
                table.setdefault(name, point)
        _KNOWN[kind] = (registry_version(), table)
    return table


def known_sub_points() -> dict[str, Point]:
    """Every per-layer point any registered family has."""
    return _known("sub")


def known_model_points() -> dict[str, Point]:
    """Every point outside the blocks any registered family has, in execution order."""
    return _known("model")


def model_point_records(family: str | None = None, final_softcap: bool = True) -> dict[str, Point]:
    """A family's points outside the blocks, in execution order (the capped logits where `final_softcap`)."""
    records = family_named(family).model_points()
    return {name: p for name, p in records.items() if final_softcap or name != FINAL_LOGITS}


def model_points(final_softcap: bool = False, family: str | None = None) -> tuple[str, ...]:
    """The points outside the blocks, in execution order; the capped logits where the config soft-caps
    the logits (Gemma 2's final_logit_softcapping)."""
    return tuple(model_point_records(family, final_softcap))


def all_points(num_layers: int, family: str | None = "llama", *, final_softcap: bool = False,
               spec=None) -> list[str]:
    """Every point of a model with `num_layers` blocks, in execution order; `final_softcap`: its
    config soft-caps the logits (Gemma 2), which adds the capped logits; `spec`: only the points each
    layer records (a mixture of experts' dense layers record no routing points; None: every point)."""
    first, *last = model_points(final_softcap, family)
    names = [first]
    attention, mlp = family_named(family).attention, family_named(family).mlp
    for i in range(num_layers):
        names += [layer_point(i, sub) for sub in sub_points(family)
                  if spec is None or (attention.records_on(spec, i, sub) and mlp.records_on(spec, i, sub))]
    return names + last


def sub_point_of(point: str, family: str | None = None) -> Point | None:
    """The record of a per-layer point, as `family` has it (None outside the blocks or for an
    unknown name); a name the family lacks is read from the family that has it."""
    layer, sub = split_point(point)
    if layer is None:
        return None
    return sub_points(family).get(sub) or known_sub_points().get(sub)


def point_record(point: str, family: str | None = None) -> Point | None:
    """The record of any point (per-layer or outside the blocks)."""
    if split_point(point)[0] is not None:
        return sub_point_of(point, family)
    return model_point_records(family).get(point) or known_model_points().get(point)


def rank(point: str, family: str | None = None) -> tuple:
    """A sort key in execution order for any point or folded point: embeddings, the blocks
    (layer by layer, sub-points in `family`'s order, Llama's by default), final norm, logits,
    capped logits; unknown names last. A sub-point the family lacks goes after its own, in the
    order of the family that has it."""
    outside = list({**model_point_records(family), **known_model_points()})
    if point in outside:
        return (0, 0, 0) if outside.index(point) == 0 else (2, 0, outside.index(point))
    match = _FOLDED_RE.match(point)
    if match is None:
        return (3, 0, point)
    layer = -1 if match.group(1) == "{i}" else int(match.group(1))
    order = layer_order(family)
    sub = match.group(2) or ""
    if sub in CACHE_POINTS and K_ROPE in order:  # after the keys they hold, before the scores that read them
        return (1, layer, order.index(K_ROPE) + (1 + CACHE_POINTS.index(sub)) / 4)
    if sub in order:
        return (1, layer, order.index(sub))
    known = list(known_sub_points())
    return (1, layer, len(order) + (known.index(sub) if sub in known else len(known)))


def label(point: str) -> str:
    """A short label: the point's record's, or the name under its layer."""
    record = point_record(point)
    return record.label if record is not None else split_point(point)[1]


def op_kind(point: str) -> str | None:
    record = point_record(point)
    return record.op if record is not None else None


def layout_of(point: str) -> str:
    if split_point(point)[1] in CACHE_POINTS:
        return "heads"  # (KV, S, D): slots along the second axis
    record = point_record(point)
    return record.layout if record is not None else "rows"


def is_coarse(point: str) -> bool:
    """On the coarse curve: embeddings, a block output, final norm or logits."""
    layer, sub = split_point(point)
    return (layer is None and point_record(point) is not None) or (layer is not None and sub == BLOCK_OUT)


def is_causal(point: str) -> bool:
    return layout_of(point) == "attention"


def has_head_axis(point: str) -> bool:
    """Laid out (heads, T, ...) rather than (T, ...)."""
    return layout_of(point) in ("heads", "attention")


def gguf_permuted(point: str) -> bool:
    """Whether the point's last axis holds q/k RoPE pairs, which GGUF's converter permutes."""
    record = point_record(point)
    return record is not None and record.gguf_permuted


def source_point(point: str, family: str | None = None) -> str | None:
    """The point `point` is computed from in `family` (None for the embeddings and outside the table)."""
    layer, _ = split_point(point)
    record = point_record(point, family)
    if record is None or not record.source:
        return None
    if layer is None:
        return record.source
    if record.source == BLOCK_INPUT:
        return EMBED if layer == 0 else layer_point(layer - 1, BLOCK_OUT)
    return layer_point(layer, record.source)
