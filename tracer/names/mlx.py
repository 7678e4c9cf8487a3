"""mlx-lm's names: its module paths are HF's (`model.layers.3.self_attn.q_proj`), so a point's own name is
its module's output; these are the points mlx-lm gives otherwise. A name is a call: of a module (`call`: which
of its calls, `side`: its input or output), of a module's method (`model.embed_tokens.as_linear`), of
mlx.core's function inside a module's call (`self_attn.mx.softmax`), or of the model itself (""). A
sub-point's name is relative to its layer; a point with two names takes the first the model has.

- q/k after RoPE: mlx-lm's RoPE module, called twice per layer (queries, then keys); the context: the input
  of o_proj; the logits: the head's own call (an untied `lm_head`, else the embedding's `as_linear`), and
  the soft-capped logits the model's output.
- Gemma 2 and 3 scale the embedding after mlx-lm's embedding call (`h = h * hidden_size**0.5`), so the
  embedding point is what the first block takes (the input of its first norm); Gemma 2's attention is
  unfused (soft-capped scores, then `mx.softmax`), so its scores and probabilities are the softmax's input
  and output.
- A mixture of experts (`mlx_lm/models/{mixtral,qwen2_moe,qwen3_moe,olmoe}.py`): the router's logits are its
  `gate` module's output, the scores the block's `mx.softmax` over every expert, the picked experts the second
  argument of its `switch_mlp` (SwitchGLU: `switch_mlp(x, inds)`), and what mlx-lm then does with
  `switch_mlp`'s output gives the rest: the routing weights are what it is multiplied by (`y * scores[...,
  None]`), the experts' sum that product's `.sum(axis=-2)`, and Qwen2-MoE's shared expert (after its sigmoid
  gate) what is added to that sum. Mixtral's block is `block_sparse_moe`, and it takes the softmax over the k
  picked logits only: its scores over every expert are never formed (`UNSEEN`).

The mlx engine reads them (`tracer.engines.mlx.planned_calls`); a dump of mlx-lm's modules uses HF's paths,
so they map no dump's tensors."""

from __future__ import annotations

from tracer.model.points import (
    CONTEXT,
    EMBED,
    EXPERTS,
    FINAL_LOGITS,
    K_ROPE,
    LOGITS,
    MLP,
    O_PROJ,
    PROBS,
    Q_ROPE,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    SCORES,
    SHARED_EXPERT,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
)
from tracer.names.vocabulary import Name, Vocabulary, register

ROPE_MODULE = "self_attn.rope"  # mlx-lm's `Attention.rope` (transformers has no such module)
SOFTMAX = "self_attn.mx.softmax"  # mlx.core's softmax as an unfused attention calls it
MODEL = ""  # the model's own call
# Gemma: the embedding after mlx-lm's sqrt(hidden) scale, the first block's input, which its first norm takes
SCALED_EMBEDDING = Name("model.layers.0.input_layernorm", side="input")


def moe_names(block: str) -> dict[str, tuple[Name, ...]]:
    """A sparse block's routing points, `block` its path under the layer (`mlp`; Mixtral's `block_sparse_moe`)."""
    switch = f"{block}.switch_mlp"  # SwitchGLU: switch_mlp(x, inds), every picked expert's output (.., k, C)
    return {ROUTER_LOGITS: (Name(f"{block}.gate"),), ROUTER_SCORES: (Name(f"{block}.mx.softmax"),),
            TOP_K_INDEX: (Name(switch, side="input[1]"),), TOP_K_WEIGHTS: (Name(switch, side="output*"),),
            EXPERTS: (Name(switch, side="output*.sum"),), SHARED_EXPERT: (Name(switch, side="output*.sum+"),)}


MIXTRAL_BLOCK = "block_sparse_moe"  # mlx-lm's Mixtral keeps the checkpoint's name for its sparse block
# family -> point -> why mlx-lm never forms it as an array (the mlx engine says so in the trace's not_recorded)
UNSEEN = {"mixtral": {ROUTER_SCORES: "mlx-lm's mixtral.py takes the softmax over the k picked logits only "
                                     "(softmax(take_along_axis(gates, inds))): scores over every expert never exist"}}

MLX = register(Vocabulary(
    "mlx", "mlx-lm's calls where they are not HF's module outputs", "HTD",
    names={Q_ROPE: (Name(ROPE_MODULE, call=0),), K_ROPE: (Name(ROPE_MODULE, call=1),),
           CONTEXT: (Name(O_PROJ, side="input"),),
           LOGITS: (Name("lm_head"), Name("model.embed_tokens.as_linear")), FINAL_LOGITS: (Name(MODEL),),
           **moe_names(MLP)},
    families={"gemma2": {EMBED: (SCALED_EMBEDDING,), SCORES: (Name(SOFTMAX, side="input"),),
                         PROBS: (Name(SOFTMAX),)},
              "gemma3": {EMBED: (SCALED_EMBEDDING,)},
              "mixtral": {**moe_names(MIXTRAL_BLOCK), ROUTER_SCORES: (), MLP: (Name(MIXTRAL_BLOCK),)}},
    aliases=False,
))
