"""The model families tracer traces, as compositions of components.

A family is a short declaration that states only how it differs from its parent, as transformers'
modular files do (Gemma 2 = Llama with (1 + w) norms, scaled embeddings, sandwich norms and
soft-capping). Its point order and records (`tracer.model.points`), its tensor shapes
(`Family.weight_shapes`), the knobs that apply to it (its components', `tracer.model.knobs`) and how
hf observes it are read off the composition; other runtimes' names for its points are each runtime's own
(`tracer.names`).
`register` adds a family: a test's made-up family with a component of its own is one component
module and one declaration, and nothing here changes. No torch here.

Read off transformers 5.25's `models/<family>/modeling_<family>.py` and `configuration_<family>.py`.
"""

from __future__ import annotations

from collections.abc import Mapping

from tracer.model import config
from tracer.model.component import (
    Family,
    family_named,
    family_of,
    model_types,
    register,
    registered,
    unregister,
)
from tracer.model.components.attention import Attention, FusedQKV, PerHeadNorm, WholeNorm
from tracer.model.components.block import POST_NORM, PRE_NORM, SANDWICH, Block
from tracer.model.components.embedding import Embedding, ScaledEmbedding
from tracer.model.components.head import Head
from tracer.model.components.mlp import GatedMLP
from tracer.model.components.norm import GemmaRMSNorm, Olmo2RMSNorm, RMSNorm
from tracer.model.components.rope import Rope
from tracer.model.config import FamilyConfig
from tracer.model.points import (
    BLOCK_OUT,
    EMBED,
    FINAL_LOGITS,
    FINAL_NORM,
    INPUT_NORM,
    K_NORM,
    K_PROJ,
    K_ROPE,
    MLP_ACT,
    POST_ATTENTION_NORM,
    POST_FF_NORM,
    PRE_FF_NORM,
    PROBS,
    Q_NORM,
    Q_PROJ,
    Q_ROPE,
    SCORES,
    V_PROJ,
    layer_point,
)

__all__ = ["Family", "family_named", "family_of", "model_types", "register", "registered", "unregister",
           "expected_shapes", "FAMILIES", "LLAMA", "PRE_NORM", "SANDWICH", "POST_NORM"]


def _on(points: tuple[str, ...], text: str) -> dict[str, str]:
    return {point: text for point in points}


_GEMMA_NORM = ("Gemma's RMSNorm scales by (1 + weight), computed in f32 before the cast back "
               "(norm_offset=drop multiplies by the stored weight alone, which is near 0)")
_GEMMA_NORMS = (INPUT_NORM, POST_ATTENTION_NORM, PRE_FF_NORM, POST_FF_NORM, FINAL_NORM)
_GEMMA_EMBED = ("Gemma multiplies the embeddings by sqrt(hidden_size) rounded to the model's dtype "
                "(embed_scale=drop forgets the scale; embed_scale=f32 scales in f32, which differs in bf16/f16)")
_GEGLU = ("GeGLU with the tanh-approximated GELU: hidden_activation gelu_pytorch_tanh "
          "(act=gelu is the exact erf GELU; a port reading `hidden_act` instead of `hidden_activation` may pick it)")
_WINDOW = ("sliding-window attention: a query sees only the last sliding_window keys on the windowed layers "
           "(window=ignore attends to the whole prefix, visible once the prompt is longer than the window)")
_QK_NORM = ("per-head RMSNorm of q and k over each head's D values, before RoPE "
            "(qk_norm=drop forgets it; OLMo-2 norms the whole projection instead)")
_LLAMA_KEYS = {**config.ROPE_KEYS, "attention_bias": False, "mlp_bias": False}
_GEMMA_CONFIG = dict(kv_heads=4, head_dim=256, tied=True, activation=("hidden_activation", "gelu_pytorch_tanh"),
                     divisible_heads=True)

LLAMA = Family(
    "llama", "Llama", ("llama",), "LlamaForCausalLM", "the reference design: pre-norm RMSNorm, RoPE, GQA, SwiGLU",
    embedding=Embedding(), norm=RMSNorm(), attention=Attention(), mlp=GatedMLP(), block=Block(PRE_NORM), head=Head(),
    config=FamilyConfig(config.llama_extras, _LLAMA_KEYS, divisible_heads=True))

QWEN2 = LLAMA.derive(
    name="qwen2", title="Qwen2 / Qwen2.5", model_types=("qwen2",), architecture="Qwen2ForCausalLM", gguf_arch="qwen2",
    adds="q/k/v biases (no o_proj bias); optional sliding window on the layers from max_window_layers on",
    attention=Attention(window=True),
    config=FamilyConfig(config.qwen2_extras, {**config.ROPE_KEYS, **config.QWEN_WINDOW_KEYS}, kv_heads=32,
                        max_positions=32768),
    hints={**_on((Q_PROJ, K_PROJ, V_PROJ), "Qwen2 always has q/k/v biases, whatever the config says (bias=ignore "
                                           "drops them, as candle's linear_no_bias would)"),
           PROBS: "Qwen2 " + _WINDOW})

QWEN3 = LLAMA.derive(
    name="qwen3", title="Qwen3", model_types=("qwen3",), architecture="Qwen3ForCausalLM", gguf_arch="qwen3",
    adds="per-head q/k RMSNorm before RoPE; head_dim from the config (default 128)",
    attention=Attention(qk_norm=PerHeadNorm(), window=True),
    config=FamilyConfig(config.qwen3_extras, {**config.ROPE_KEYS, "attention_bias": False,
                                              **config.QWEN_WINDOW_KEYS}, kv_heads=32, head_dim=128,
                        max_positions=32768),
    hints={**_on((Q_NORM, K_NORM), "Qwen3 applies a " + _QK_NORM), PROBS: "Qwen3 " + _WINDOW})

MISTRAL = LLAMA.derive(
    name="mistral", title="Mistral", model_types=("mistral",), architecture="MistralForCausalLM",
    adds="sliding window on every layer (transformers defaults sliding_window to 4096 when the key is absent)",
    attention=Attention(window=True),
    config=FamilyConfig(config.mistral_extras, {**config.ROPE_KEYS, "sliding_window": 4096}, kv_heads=8,
                        max_positions=131072),
    hints={PROBS: "Mistral " + _WINDOW + "; transformers reads an absent sliding_window as 4096"})

GEMMA2 = LLAMA.derive(
    name="gemma2", title="Gemma 2", model_types=("gemma2",), architecture="Gemma2ForCausalLM", gguf_arch="gemma2",
    adds="(1 + w) RMSNorm, scaled embeddings, pre- and post-norms around both sublayers, attention and "
         "final-logit soft-capping, query_pre_attn_scalar, GeGLU (tanh), sliding window on alternate layers",
    embedding=ScaledEmbedding(), norm=GemmaRMSNorm(), block=Block(SANDWICH), head=Head(softcap=True),
    attention=Attention(window=True, softcap=True),
    config=FamilyConfig(config.gemma2_extras, {**config.ROPE_KEYS, **config.GEMMA_KEYS, "attn_logit_softcapping": 50.0,
                                               "final_logit_softcapping": 30.0, "use_bidirectional_attention": None},
                        max_positions=8192, **_GEMMA_CONFIG),
    hints={**_on(_GEMMA_NORMS, _GEMMA_NORM), EMBED: _GEMMA_EMBED, MLP_ACT: _GEGLU,
           SCORES: "Gemma 2 soft-caps attention scores, cap·tanh(scores/cap) with attn_logit_softcapping, and "
                   "scales by query_pre_attn_scalar^-0.5 (softcap=drop forgets the cap)",
           PROBS: "Gemma 2 " + _WINDOW + " (layers 0, 2, 4, ...)",
           FINAL_LOGITS: "Gemma 2 soft-caps the final logits with final_logit_softcapping"})

GEMMA3 = GEMMA2.derive(
    name="gemma3", title="Gemma 3 (text)", model_types=("gemma3_text",), architecture="Gemma3ForCausalLM",
    gguf_arch="gemma3",
    adds="Gemma 2's norms and embeddings, per-head q/k norms, local layers with their own RoPE base "
         "(rope_local_base_freq), a global layer every sliding_window_pattern layers, no soft-capping",
    attention=Attention(qk_norm=PerHeadNorm(heads_first=True), rope=Rope(local=True), window=True, softcap=True),
    config=FamilyConfig(config.gemma3_extras, {"rope_parameters": None, "rope_theta": 1e6,
                                               "rope_local_base_freq": 10_000.0, "rope_scaling": None,
                                               **config.GEMMA_KEYS, "sliding_window_pattern": 6,
                                               "attn_logit_softcapping": None, "final_logit_softcapping": None,
                                               "use_bidirectional_attention": False},
                        max_positions=131072, **_GEMMA_CONFIG),
    hints={**_on(_GEMMA_NORMS, _GEMMA_NORM), EMBED: _GEMMA_EMBED, MLP_ACT: _GEGLU,
           **_on((Q_NORM, K_NORM), "Gemma 3 applies a " + _QK_NORM + "; its q/k norms are (1 + w) norms too"),
           **_on((Q_ROPE, K_ROPE), "Gemma 3's local (sliding) layers rotate with rope_local_base_freq (10000), its "
                                   "global layers with rope_theta (1e6) and rope scaling (rope_local=global gives "
                                   "local layers the global base)"),
           SCORES: "Gemma 3 scales scores by query_pre_attn_scalar^-0.5 and soft-caps them only if "
                   "attn_logit_softcapping is set",
           PROBS: "Gemma 3 " + _WINDOW + " (every layer but each sliding_window_pattern-th)",
           FINAL_LOGITS: "Gemma 3 soft-caps the final logits only if final_logit_softcapping is set"})

PHI3 = LLAMA.derive(
    name="phi3", title="Phi-3", model_types=("phi3",), architecture="Phi3ForCausalLM", gguf_arch="phi3",
    adds="fused qkv_proj and gate_up_proj, partial rotary (partial_rotary_factor), longrope scaling, "
         "optional sliding window on every layer",
    attention=Attention(projections=FusedQKV(), window=True), mlp=GatedMLP(fused=True),
    config=FamilyConfig(config.phi3_extras, {**config.ROPE_KEYS, "partial_rotary_factor": 1.0,
                                             "original_max_position_embeddings": 4096, "sliding_window": None},
                        rms_norm_eps=1e-5, max_positions=4096),
    hints={**_on((Q_ROPE, K_ROPE), "Phi-3 splits its fused qkv_proj output as q | k | v with H·D, KV·D, KV·D "
                                   "columns (qkv_split reorders it), and rotates only the first "
                                   "partial_rotary_factor·D dims"),
           MLP_ACT: "Phi-3's fused gate_up_proj holds the gate first, then up (gate_up=up_gate swaps them)",
           PROBS: "Phi-3 " + _WINDOW})

OLMO2 = LLAMA.derive(
    name="olmo2", title="OLMo-2", model_types=("olmo2",), architecture="Olmo2ForCausalLM", gguf_arch="olmo2",
    adds="post-norms instead of pre-norms (norm of each sublayer's output, before the residual add), "
         "q/k RMSNorm over the whole projection, weight applied in f32",
    norm=Olmo2RMSNorm(), block=Block(POST_NORM), attention=Attention(qk_norm=WholeNorm(), rope=Rope(precision="f32")),
    config=FamilyConfig(config.olmo2_extras, {**config.ROPE_KEYS, "attention_bias": False}, rms_norm_eps=1e-5),
    hints={**_on((Q_NORM, K_NORM), "OLMo-2 norms q and k over the whole projection (H·D values), not per head, "
                                   "before RoPE (qk_norm=drop forgets it)"),
           **_on((POST_ATTENTION_NORM, POST_FF_NORM), "OLMo-2 norms each sublayer's output before the residual add "
                                                      "(post-norm), and multiplies by the weight in f32 before the "
                                                      "cast")})

for _family in (LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA2, GEMMA3, PHI3, OLMO2):
    register(_family)


class _Registered(Mapping):
    """name -> family, every registered one (read live: `FAMILIES` stays current after `register`)."""

    def __getitem__(self, name: str) -> Family:
        return registered()[name]

    def __iter__(self):
        return iter(registered())

    def __len__(self) -> int:
        return len(registered())


FAMILIES = _Registered()


def expected_shapes(spec) -> dict[str, tuple[int, ...]]:
    """Every tensor a spec needs, with its shape (HF names, as in the safetensors files), as the
    components of its family declare them."""
    family = family_named(spec.family)
    shapes = dict(family.embedding.weights(spec))
    for i in range(spec.num_hidden_layers):
        layer = family.layer_weights(spec, i)  # a mixture of experts' dense layers differ from its sparse ones
        shapes |= {f"{layer_point(i, BLOCK_OUT)}.{name}": shape for name, shape in layer.items()}
    return shapes | dict(family.head.weights(spec))

