"""The model families tracer traces, as data: what each one is built of, and where it differs from Llama.

A family is a row of this table, not a branch in a forward. Its structural fields name entries of
the reimplementation's strategy tables (`tracer.llama`: `NORMS`, `EMBEDDINGS`, `PROJECTIONS`,
`QK_NORMS`, `MLPS`, `ROPE_PRECISIONS`). Its per-layer points and their order
(`tracer.points.layer_order`), its tensor shapes (`tracer.llama.expected_shapes`) and the knobs that
apply to it (`tracer.variants.Knob.applies`, a predicate on this row) are derived from the row; its
config semantics are
`tracer.config.FAMILY_CONFIGS[row.config_reader]`. `hints` is what an expert says when the first
divergence falls on one of the family's own features. Adding a family is one row here, plus a
strategy in `tracer.llama` where it computes something new. No torch here.

All of it was read off transformers 5.24's `models/<family>/modeling_<family>.py` and
`configuration_<family>.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracer.errors import TracerError

# Norm positions around a block's two sublayers: (before, after) the attention, (before, after) the MLP.
PRE_NORM = (("input_layernorm", None), ("post_attention_layernorm", None))
SANDWICH = (("input_layernorm", "post_attention_layernorm"),
            ("pre_feedforward_layernorm", "post_feedforward_layernorm"))
POST_NORM = ((None, "post_attention_layernorm"), (None, "post_feedforward_layernorm"))


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: tracer's name, also the `model_type` of its config.json (`gemma3` reads `gemma3_text`).
        title: how people write it ("Gemma 2").
        model_types: the `model_type` values that are this family.
        architecture: the transformers class the hf engine loads (`Gemma2ForCausalLM`).
        adds: one line, what it adds over Llama (`tracer variants`, docs/families.md).
        norm: RMSNorm flavour: "rms" (Llama: x·rsqrt in f32, cast, then × weight), "gemma" (× (1 + weight)
            in f32, then cast), "olmo" (× weight in f32, then cast).
        embed: "plain" or "scaled" (× √hidden_size, rounded to the model's dtype: Gemma).
        projections: "separate" (q_proj, k_proj, v_proj) or "fused" (one qkv_proj: Phi-3).
        qk_norm: "none"; "per_head" (RMSNorm over each head's D, tokens first: Qwen3); "per_head_heads_first"
            (the same after the head transpose: Gemma 3); "whole" (over the whole H·D projection: OLMo-2).
        mlp: "separate" (gate_proj, up_proj) or "fused" (one gate_up_proj, gate first: Phi-3).
        norms: module names of the norms (before, after) the attention and the MLP; None where there is none.
        rope_precision: "model" (cos/sin cast to the model dtype) or "f32" (rotate in f32, cast back: OLMo-2).
        sliding_window: its configs may restrict attention to a sliding window on some layers.
        softcap: its configs may soft-cap attention scores and final logits (Gemma).
        local_rope: its local (sliding) layers rotate with their own RoPE base (Gemma 3's rope_local_base_freq).
        config: the `tracer.config.FAMILY_CONFIGS` row that reads its config.json ("": its own name).
        hints: sub-point (or model point) -> what this family does there that a port gets wrong.
    """

    name: str
    title: str
    model_types: tuple[str, ...]
    architecture: str
    adds: str
    norm: str = "rms"
    embed: str = "plain"
    projections: str = "separate"
    qk_norm: str = "none"
    mlp: str = "separate"
    norms: tuple = PRE_NORM
    rope_precision: str = "model"
    sliding_window: bool = False
    softcap: bool = False
    local_rope: bool = False
    config: str = ""
    hints: dict[str, str] = field(default_factory=dict)

    @property
    def config_reader(self) -> str:
        return self.config or self.name

    @property
    def attention_norms(self) -> tuple[str | None, str | None]:
        return self.norms[0]

    @property
    def mlp_norms(self) -> tuple[str | None, str | None]:
        return self.norms[1]


def _on(points: tuple[str, ...], text: str) -> dict[str, str]:
    return {point: text for point in points}


_GEMMA_NORM = ("Gemma's RMSNorm scales by (1 + weight), computed in f32 before the cast back "
               "(norm_offset=drop multiplies by the stored weight alone, which is near 0)")
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm", "model.norm")
_GEMMA_EMBED = ("Gemma multiplies the embeddings by sqrt(hidden_size) rounded to the model's dtype "
                "(embed_scale=drop forgets the scale; embed_scale=f32 scales in f32, which differs in bf16/f16)")
_GEGLU = ("GeGLU with the tanh-approximated GELU: hidden_activation gelu_pytorch_tanh "
          "(act=gelu is the exact erf GELU; a port reading `hidden_act` instead of `hidden_activation` may pick it)")
_WINDOW = ("sliding-window attention: a query sees only the last sliding_window keys on the windowed layers "
           "(window=ignore attends to the whole prefix, visible once the prompt is longer than the window)")
_QK_NORM = ("per-head RMSNorm of q and k over each head's D values, before RoPE "
            "(qk_norm=drop forgets it; OLMo-2 norms the whole projection instead)")

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("llama", "Llama", ("llama",), "LlamaForCausalLM",
               "the reference design: pre-norm RMSNorm, RoPE, GQA, SwiGLU"),
        Family("qwen2", "Qwen2 / Qwen2.5", ("qwen2",), "Qwen2ForCausalLM",
               "q/k/v biases (no o_proj bias); optional sliding window on the layers from max_window_layers on",
               sliding_window=True,
               hints={**_on(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                            "Qwen2 always has q/k/v biases, whatever the config says (bias=ignore drops them, "
                            "as candle's linear_no_bias would)"),
                      "self_attn.probs": "Qwen2 " + _WINDOW}),
        Family("qwen3", "Qwen3", ("qwen3",), "Qwen3ForCausalLM",
               "per-head q/k RMSNorm before RoPE; head_dim from the config (default 128)",
               qk_norm="per_head", sliding_window=True,
               hints={**_on(("self_attn.q_norm", "self_attn.k_norm"), "Qwen3 applies a " + _QK_NORM),
                      "self_attn.probs": "Qwen3 " + _WINDOW}),
        Family("mistral", "Mistral", ("mistral",), "MistralForCausalLM",
               "sliding window on every layer (transformers defaults sliding_window to 4096 when the key is absent)",
               sliding_window=True,
               hints={"self_attn.probs": "Mistral " + _WINDOW
                                         + "; transformers reads an absent sliding_window as 4096"}),
        Family("gemma2", "Gemma 2", ("gemma2",), "Gemma2ForCausalLM",
               "(1 + w) RMSNorm, scaled embeddings, pre- and post-norms around both sublayers, attention and "
               "final-logit soft-capping, query_pre_attn_scalar, GeGLU (tanh), sliding window on alternate layers",
               norm="gemma", embed="scaled", norms=SANDWICH, sliding_window=True, softcap=True,
               hints={**_on(_GEMMA_NORMS, _GEMMA_NORM), "model.embed_tokens": _GEMMA_EMBED, "mlp.act": _GEGLU,
                      "self_attn.scores": "Gemma 2 soft-caps attention scores, cap·tanh(scores/cap) with "
                                          "attn_logit_softcapping, and scales by query_pre_attn_scalar^-0.5 "
                                          "(softcap=drop forgets the cap)",
                      "self_attn.probs": "Gemma 2 " + _WINDOW + " (layers 0, 2, 4, ...)",
                      "lm_head.softcap": "Gemma 2 soft-caps the final logits with final_logit_softcapping"}),
        Family("gemma3", "Gemma 3 (text)", ("gemma3_text",), "Gemma3ForCausalLM",
               "Gemma 2's norms and embeddings, per-head q/k norms, local layers with their own RoPE base "
               "(rope_local_base_freq), a global layer every sliding_window_pattern layers, no soft-capping",
               norm="gemma", embed="scaled", qk_norm="per_head_heads_first", norms=SANDWICH, sliding_window=True,
               softcap=True, local_rope=True,
               hints={**_on(_GEMMA_NORMS, _GEMMA_NORM), "model.embed_tokens": _GEMMA_EMBED, "mlp.act": _GEGLU,
                      **_on(("self_attn.q_norm", "self_attn.k_norm"),
                            "Gemma 3 applies a " + _QK_NORM + "; its q/k norms are (1 + w) norms too"),
                      **_on(("self_attn.q_rope", "self_attn.k_rope"),
                            "Gemma 3's local (sliding) layers rotate with rope_local_base_freq (10000), its global "
                            "layers with rope_theta (1e6) and rope scaling (rope_local=global gives local layers "
                            "the global base)"),
                      "self_attn.scores": "Gemma 3 scales scores by query_pre_attn_scalar^-0.5 and soft-caps "
                                          "them only if attn_logit_softcapping is set",
                      "self_attn.probs": "Gemma 3 " + _WINDOW + " (every layer but each sliding_window_pattern-th)",
                      "lm_head.softcap": "Gemma 3 soft-caps the final logits only if final_logit_softcapping is set"}),
        Family("phi3", "Phi-3", ("phi3",), "Phi3ForCausalLM",
               "fused qkv_proj and gate_up_proj, partial rotary (partial_rotary_factor), longrope scaling, "
               "optional sliding window on every layer",
               projections="fused", mlp="fused", sliding_window=True,
               hints={**_on(("self_attn.q_rope", "self_attn.k_rope"),
                            "Phi-3 splits its fused qkv_proj output as q | k | v with H·D, KV·D, KV·D columns "
                            "(qkv_split reorders it), and rotates only the first partial_rotary_factor·D dims"),
                      "mlp.act": "Phi-3's fused gate_up_proj holds the gate first, then up "
                                 "(gate_up=up_gate swaps them)",
                      "self_attn.probs": "Phi-3 " + _WINDOW}),
        Family("olmo2", "OLMo-2", ("olmo2",), "Olmo2ForCausalLM",
               "post-norms instead of pre-norms (norm of each sublayer's output, before the residual add), "
               "q/k RMSNorm over the whole projection, weight applied in f32",
               norm="olmo", qk_norm="whole", norms=POST_NORM, rope_precision="f32",
               hints={**_on(("self_attn.q_norm", "self_attn.k_norm"),
                            "OLMo-2 norms q and k over the whole projection (H·D values), not per head, "
                            "before RoPE (qk_norm=drop forgets it)"),
                      **_on(("post_attention_layernorm", "post_feedforward_layernorm"),
                            "OLMo-2 norms each sublayer's output before the residual add (post-norm), "
                            "and multiplies by the weight in f32 before the cast")}),
    )
}

def model_types() -> dict[str, Family]:
    """model_type -> its family, every row's (read each time: a test may add a row)."""
    return {model_type: family for family in FAMILIES.values() for model_type in family.model_types}


def family_of(model_type: str | None) -> Family:
    """The family of a config's `model_type` (absent: Llama, as tracer always read it).

    Raises:
        TracerError: a model type tracer does not trace, in one line naming the supported ones.
    """
    known = model_types()
    family = known.get("llama" if model_type is None else model_type)
    if family is None:
        raise TracerError(f"unsupported model_type {model_type!r}; tracer traces: {', '.join(known)}")
    return family


def get(name: str | None) -> Family:
    """A family by tracer's name (None: Llama)."""
    return FAMILIES[name or "llama"]
