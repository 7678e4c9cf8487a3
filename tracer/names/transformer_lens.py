"""TransformerLens' names: the hook names of a run's `ActivationCache`, TransformerLens 3's
(`blocks.{i}.attn.hook_rot_q`) and TransformerLens 4's bridge's (`blocks.{i}.attn.q.hook_out`). A dump of
them is not an engine's: tracer reads it as a file (`tracer compare`, `Trace.load`). Hooks are
[batch, pos, head, d_head]: per-head tensors are [T, H, D]."""

from __future__ import annotations

from tracer.model.points import (
    BLOCK_OUT,
    CONTEXT,
    DOWN_PROJ,
    EMBED,
    FINAL_NORM,
    GATE_PROJ,
    INPUT_NORM,
    K_PROJ,
    K_ROPE,
    LOGITS,
    MLP_ACT,
    O_PROJ,
    POST_ATTENTION_NORM,
    PROBS,
    Q_PROJ,
    Q_ROPE,
    RESID_MID,
    SCORES,
    UP_PROJ,
    V_PROJ,
)
from tracer.names.vocabulary import Vocabulary, register


def _normalized(point: str, hook_out: str) -> str:
    # fold_ln (HookedTransformer's default, the bridge's compatibility mode) folds the norm weight into
    # the next matmul, so in TransformerLens 3 nothing before that matmul holds the norm's output.
    return (f"TransformerLens' x / rms before the norm weight, not {point} (which is TransformerLens 4's "
            f"{hook_out}; TransformerLens 3 has none)")


# TransformerLens 4 module -> the point its hook_in repeats (a Llama block, TransformerLens 4.3's names)
_TL_MLP = "mlp"  # TransformerLens' MLP module (its gate is a projection, not a mixture of experts' router)
_INPUTS = {"ln1": "blocks.{i}.hook_in", "attn": "ln1.hook_out", "attn.q": "ln1.hook_out",
           "attn.k": "ln1.hook_out", "attn.v": "ln1.hook_out", _TL_MLP: "ln2.hook_out",
           f"{_TL_MLP}.gate": "ln2.hook_out", f"{_TL_MLP}.in": "ln2.hook_out"}

TRANSFORMER_LENS = register(Vocabulary(
    "transformer_lens", "TransformerLens 3 and 4 hook names", "THD",
    names={
        EMBED: ("hook_embed", "embed.hook_out"),
        INPUT_NORM: ("blocks.{i}.ln1.hook_out",),
        Q_PROJ: ("blocks.{i}.attn.hook_q", "blocks.{i}.attn.q.hook_out"),
        K_PROJ: ("blocks.{i}.attn.hook_k", "blocks.{i}.attn.k.hook_out"),
        V_PROJ: ("blocks.{i}.attn.hook_v", "blocks.{i}.attn.v.hook_out"),
        Q_ROPE: ("blocks.{i}.attn.hook_rot_q",),
        K_ROPE: ("blocks.{i}.attn.hook_rot_k",),
        SCORES: ("blocks.{i}.attn.hook_attn_scores",),
        PROBS: ("blocks.{i}.attn.hook_pattern",),
        CONTEXT: ("blocks.{i}.attn.hook_z", "blocks.{i}.attn.o.hook_in"),
        O_PROJ: ("blocks.{i}.hook_attn_out", "blocks.{i}.attn.o.hook_out", "blocks.{i}.attn.hook_out"),
        RESID_MID: ("blocks.{i}.hook_resid_mid", "blocks.{i}.ln2.hook_in"),
        POST_ATTENTION_NORM: ("blocks.{i}.ln2.hook_out",),
        GATE_PROJ: ("blocks.{i}.mlp.hook_pre", "blocks.{i}.mlp.gate.hook_out"),
        UP_PROJ: ("blocks.{i}.mlp.hook_pre_linear", "blocks.{i}.mlp.in.hook_out"),
        MLP_ACT: ("blocks.{i}.mlp.hook_post", "blocks.{i}.mlp.out.hook_in"),
        DOWN_PROJ: ("blocks.{i}.hook_mlp_out", "blocks.{i}.mlp.out.hook_out", "blocks.{i}.mlp.hook_out"),
        BLOCK_OUT: ("blocks.{i}.hook_resid_post", "blocks.{i}.hook_out"),
        FINAL_NORM: ("ln_final.hook_out",),
        LOGITS: ("unembed.hook_out", "hook_unembed"),
    },
    skipped={
        # TransformerLens 3 and 4
        "blocks.{i}.ln1.hook_normalized": _normalized(INPUT_NORM, "blocks.{i}.ln1.hook_out"),
        "blocks.{i}.ln2.hook_normalized": _normalized(POST_ATTENTION_NORM, "blocks.{i}.ln2.hook_out"),
        "ln_final.hook_normalized": _normalized(FINAL_NORM, "ln_final.hook_out"),
        "blocks.{i}.ln1.hook_scale": "TransformerLens' RMS scale, one number per position",
        "blocks.{i}.ln2.hook_scale": "TransformerLens' RMS scale, one number per position",
        "ln_final.hook_scale": "TransformerLens' RMS scale, one number per position",
        "blocks.{i}.hook_resid_pre": "TransformerLens' block input: the previous block's hook_resid_post (or "
                                     "hook_embed)",
        # TransformerLens 4 (TransformerBridge): module inputs that repeat the point before them, and the
        # rotary tables
        **{f"blocks.{{i}}.{module}.hook_in": f"TransformerLens 4's input of {module}: the same tensor as {before}"
           for module, before in _INPUTS.items()},
        "blocks.{i}.hook_in": "TransformerLens 4's block input (hook_resid_pre): the previous block's output",
        "ln_final.hook_in": "TransformerLens 4's input of ln_final: the last block's output",
        "unembed.hook_in": "TransformerLens 4's input of unembed: the same tensor as ln_final.hook_out",
        "blocks.{i}.attn.hook_cos": "TransformerLens 4's rotary cos table per position, not an activation",
        "blocks.{i}.attn.hook_sin": "TransformerLens 4's rotary sin table per position, not an activation",
        "rotary_emb.hook_cos": "TransformerLens 4's rotary cos table per position, not an activation",
        "rotary_emb.hook_sin": "TransformerLens 4's rotary sin table per position, not an activation",
        "rotary_emb.hook_in": "TransformerLens 4's input of the rotary embedding (read for its dtype and device "
                              "only)",
    },
    tokens=("embed.hook_in",),  # TransformerLens 4 caches the token ids as the embedding's input
))
