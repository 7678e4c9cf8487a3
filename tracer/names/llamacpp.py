"""llama.cpp's names: the ggml graph node names its eval callback sees (`cb(cur, "Qcur", il)` gives
"Qcur-3"), which a dump of that callback keeps. ggml's ne order reversed from numpy's gives per-head
tensors as [T, H, D]. A name written more than once in one graph is told apart by the op that wrote it
(`ggml_write`): `Qcur-3` is the matmul (q_proj, `ADD` where there is a bias), a reshape that is a view of it
(no point) and the RoPE (q_rope, in GGUF's interleaved order: llama.cpp's converter permutes the q/k
weight rows).

Not every node a point is gets a name: most families' graphs leave the attention's output product
unnamed (only llama.cpp's llama graph calls it `attn_out-{i}`), Phi-3's graph its residual add, Gemma's
the raw logits before the soft-cap. Such a node is named by its op and its first source, recursively
(`unnamed`): the product with `blk.3.attn_output.weight` is "MUL_MAT(blk.3.attn_output.weight)". A name
written without its layer inside a layer (Gemma 2's and OLMo-2's `ffn_post_norm`) is `Name(...,
unindexed=True)`."""

from __future__ import annotations

from tracer.model.component import family_named
from tracer.model.component import registered as families
from tracer.model.points import (
    BLOCK_OUT,
    CONTEXT,
    DOWN_PROJ,
    EMBED,
    EXPERTS,
    FINAL_LOGITS,
    FINAL_NORM,
    GATE_PROJ,
    GATE_UP_PROJ,
    INPUT_NORM,
    K_NORM,
    K_PROJ,
    K_ROPE,
    LOGITS,
    MLP,
    MLP_ACT,
    O_PROJ,
    POST_ATTENTION_NORM,
    POST_FF_NORM,
    PRE_FF_NORM,
    PROBS,
    Q_NORM,
    Q_PROJ,
    Q_ROPE,
    QKV_PROJ,
    RESID_MID,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    ROUTER_SELECTION,
    SCORES,
    SHARED_EXPERT,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    UP_PROJ,
    V_PROJ,
)
from tracer.names.vocabulary import Name, Vocabulary, pattern_regex, per_family, register

PROJECTION = ("MUL_MAT", "ADD")  # the matmul, and the bias added to it


def unnamed(op: str, source: str) -> str:
    """The name an unnamed graph node goes by: its op and its first source's name (itself named so if
    unnamed), e.g. "MUL_MAT(blk.3.attn_output.weight)" for the product with that weight."""
    return f"{op}({source})"


# The attention's output product, which every graph but llama's leaves unnamed (the weight names its layer).
OUTPUT_PRODUCT = unnamed("MUL_MAT", "blk.{i}.attn_output.weight")
# Gemma's raw logits before the soft-cap: the product with the output matrix (a tied one is token_embd).
RAW_LOGITS = (Name("result_output", writes=("MUL_MAT",), dump=False), unnamed("MUL_MAT", "output.weight"),
              unnamed("MUL_MAT", "token_embd.weight"))
# Gemma's soft-capped logits: the last scale of scale(1/cap) -> tanh -> scale(cap).
CAPPED_LOGITS = (Name("result_output", writes=("SCALE",)),)
# Gemma's graphs: the embeddings scaled by sqrt(hidden) (ggml_scale), the attention output normed before the
# residual add, whose sum is `sa_out`, then the MLP's pre- and post-norms.
GEMMA = {EMBED: ("inp_scaled",), POST_ATTENTION_NORM: ("attn_post_norm-{i}",), RESID_MID: ("sa_out-{i}",),
         PRE_FF_NORM: ("ffn_norm-{i}",), LOGITS: RAW_LOGITS, FINAL_LOGITS: CAPPED_LOGITS}

GGML = register(Vocabulary(
    "ggml", "llama.cpp's graph node names", "THD",
    names={
        EMBED: ("embd", "inp_embd"),  # older builds: inp_embd
        INPUT_NORM: ("attn_norm-{i}",),
        Q_PROJ: (Name("Qcur-{i}", writes=PROJECTION, dump=False),),
        K_PROJ: (Name("Kcur-{i}", writes=PROJECTION, dump=False),),
        V_PROJ: (Name("Vcur-{i}", writes=PROJECTION),),
        Q_NORM: ("Qcur_normed-{i}",),  # Qwen3's and Gemma 3's per head, OLMo-2's over the whole projection
        K_NORM: ("Kcur_normed-{i}",),
        Q_ROPE: (Name("Qcur-{i}", qk_order="interleaved", writes=("ROPE",)),),
        K_ROPE: (Name("Kcur-{i}", qk_order="interleaved", writes=("ROPE",)),),
        PROBS: ("kq_soft_max-{i}",),
        CONTEXT: ("kqv_out-{i}",),
        O_PROJ: ("attn_out-{i}", OUTPUT_PRODUCT),
        RESID_MID: ("ffn_inp-{i}",),
        POST_ATTENTION_NORM: ("ffn_norm-{i}",),
        POST_FF_NORM: ("ffn_post_norm-{i}",),
        GATE_PROJ: ("ffn_gate-{i}",),
        UP_PROJ: ("ffn_up-{i}",),
        # older builds wrote silu(gate)·up as ffn_gate_par; Gemma's GELU-gated MLP writes ffn_geglu
        MLP_ACT: ("ffn_swiglu-{i}", "ffn_gate_par-{i}", "ffn_geglu-{i}"),
        DOWN_PROJ: ("ffn_out-{i}",),
        BLOCK_OUT: ("l_out-{i}",),
        FINAL_NORM: ("result_norm",),
        LOGITS: ("result_output",),
        # a mixture of experts' routing (llama-graph.cpp build_moe_ffn), per token: the router's logits and
        # scores (E, T), the selection scores where a bias is added (DeepSeek-V3), the picked experts (int32, a
        # view of the descending argsort's first k) and their weights (1, k, T)
        ROUTER_LOGITS: ("ffn_moe_logits-{i}",),
        ROUTER_SCORES: ("ffn_moe_probs-{i}",),
        ROUTER_SELECTION: ("ffn_moe_probs_biased-{i}",),
        TOP_K_INDEX: ("ffn_moe_topk-{i}",),
        # the weights applied are the chain's last step: gathered, then renormalized where the graph passes
        # norm_w, then scaled where it has a w_scale; each is computed from the one before, so the last one
        # read before the experts' sum is the one they are multiplied by (the engine keeps that one)
        TOP_K_WEIGHTS: ("ffn_moe_weights-{i}", "ffn_moe_weights_norm-{i}", "ffn_moe_weights_scaled-{i}"),
        EXPERTS: ("ffn_moe_out-{i}",),  # the picked experts' weighted outputs summed (C, T)
    },
    families={
        "gemma2": {**GEMMA, SCORES: ("kq_scaled_2-{i}",),  # after the soft-cap's last scale
                   POST_FF_NORM: (Name("ffn_post_norm-{i}", unindexed=True),)},
        "gemma3": GEMMA,
        "olmo2": {POST_ATTENTION_NORM: ("attn_post_norm-{i}",),
                  POST_FF_NORM: (Name("ffn_post_norm-{i}", unindexed=True),)},
        # q, k, v are views of one fused product (wqkv); the MLP's up product is gate and up fused, halved
        # by the GLU; the residual add after the attention is unnamed (GET_ROWS first in the last layer)
        # the shared expert is build_ffn's (ffn_gate, ffn_up, ffn_swiglu: its own steps, not a dense MLP's: every
        # layer of llama.cpp's qwen2moe is sparse), times sigmoid of its gate; the MLP's output is both summed
        "qwen2_moe": {SHARED_EXPERT: ("ffn_shexp_out-{i}",), MLP: ("ffn_out-{i}",), GATE_PROJ: (), UP_PROJ: (),
                      MLP_ACT: (), DOWN_PROJ: ()},
        "phi3": {QKV_PROJ: ("wqkv-{i}",), GATE_UP_PROJ: ("ffn_up-{i}",),
                 RESID_MID: (unnamed("ADD", OUTPUT_PRODUCT), unnamed("ADD", unnamed("GET_ROWS", OUTPUT_PRODUCT)))},
    },
    skipped={
        "kq-{i}": "llama.cpp's q·kᵀ before the scale its softmax applies (tracer's scores are scaled)",
        "kq_scaled_1-{i}": "Gemma 2's scores divided by the soft-cap, before the tanh",
        "kq_tanh-{i}": "Gemma 2's tanh of the scores over the soft-cap",
        "norm-{i}": "llama.cpp's RMS-normalized input before the norm weight",
        "ffn_silu-{i}": "llama.cpp's silu(gate) before the product with up",
        "kqv-{i}": "llama.cpp's per-head attention output before the heads are merged (use kqv_out)",
        "ffn_moe_argsort-{i}": "llama.cpp's full argsort of the selection scores (ffn_moe_topk is its first k)",
        "ffn_moe_weights_sum-{i}": "the top-k weights' sum, before the renormalization divides by it",
        "ffn_moe_weights_sum_clamped-{i}": "the top-k weights' sum clamped to f16's smallest normal",
        "ffn_moe_gate-{i}": "each picked expert's gate projection (n_ff, k, T): per expert, not a point",
        "ffn_moe_up-{i}": "each picked expert's up projection (n_ff, k, T): per expert, not a point",
        "ffn_moe_swiglu-{i}": "each picked expert's silu(gate)·up (n_ff, k, T): per expert, not a point",
        "ffn_moe_down-{i}": "each picked expert's output (C, k, T): per expert, not a point",
        "ffn_moe_weighted-{i}": "each picked expert's output times its weight (C, k, T), before the sum",
        "ffn_shexp-{i}": "Qwen2-MoE's shared expert before its gate (ffn_shexp_out is after it)",
        "ffn_shexp_gate_inp-{i}": "Qwen2-MoE's shared expert's gate logit (T, 1), before the sigmoid",
        "ffn_shexp_gate-{i}": "Qwen2-MoE's shared expert's gate, sigmoid of its logit (T, 1)",
    },
))


# Points that are the same graph node as another where a family's graph has nothing between them: without a
# shared expert, the experts' sum (`ffn_moe_out`) is what the MLP block returns (src/models/llama.cpp,
# qwen3moe.cpp, olmoe.cpp add it to the residual as it is).
SAME_NODE = {family: {EXPERTS: (MLP,)} for family in ("mixtral", "qwen3_moe", "olmoe")}


def ggml_writes(family: str | None = None) -> dict[str, dict[str, str]]:
    """ggml names written more than once in one llama.cpp graph: which write is which point, by the op
    that wrote it (Qcur-{i}: MUL_MAT and ADD (a bias) are q_proj, ROPE is q_rope), in `family`'s graph
    (None: every registered family's, the first one's where they differ). Writes of other ops (RESHAPE: a
    view of the projection, same values) are not points."""
    writes: dict[str, dict[str, str]] = {}
    for row in [family_named(family)] if family else families().values():
        for point, names in GGML.patterns(row).items():
            for name in names:
                for op in name.writes:
                    writes.setdefault(name.pattern, {}).setdefault(op, point)
    return writes


_WRITES: dict = {}  # family -> [(regex, op -> point)]: compiled once per state of the registries


def ggml_write(name: str, op: str, family: str | None = None) -> tuple[bool, str | None]:
    """For a name llama.cpp writes more than once per graph (`ggml_writes`): (True, the point that
    the write of `op` is, or None for a write that is no point). Any other name: (False, None).

    Example:
        >>> ggml_write("Qcur-3", "ROPE"), ggml_write("Qcur-3", "RESHAPE"), ggml_write("l_out-3", "ADD")
        ((True, 'model.layers.3.self_attn.q_rope'), (True, None), (False, None))
    """
    compiled = per_family(_WRITES, family, lambda: [(pattern_regex(pattern), ops)
                                                    for pattern, ops in ggml_writes(family).items()])
    for regex, ops in compiled:
        match = regex.match(name)
        if match:
            point = ops.get(op)
            return True, point.replace("{i}", match.group(1)) if point and match.groups() else point
    return False, None
