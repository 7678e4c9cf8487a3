"""The mixture-of-experts families: Llama's attention (with each family's own q/k norm and window) and a
sparse MoE MLP (`tracer.model.components.moe.SparseMoE`) in the MLP's place. Registered after the dense
families (`tracer.model.families` imports this module last). No torch here.

Read off transformers 5.25's `models/{mixtral,qwen2_moe,qwen3_moe,olmoe}/modeling_*.py` and
`configuration_*.py`: the config readers below are each family's `__post_init__` and attention module
(which window, which biases), composed of the dense families' readers.
"""

from __future__ import annotations

from tracer.core.errors import TracerError
from tracer.model import config
from tracer.model.component import ConfigField, register
from tracer.model.components.attention import Attention, PerHeadNorm, WholeNorm
from tracer.model.components.moe import MIXTRAL_NAMES, SparseMoE
from tracer.model.config import FamilyConfig
from tracer.model.families import LLAMA
from tracer.model.points import (
    EXPERTS,
    K_NORM,
    PROBS,
    Q_NORM,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    SHARED_EXPERT,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
)

_ROUTER = ("the router takes the softmax over every expert in f32, then the top {k} (ties to the lower index), "
           "{renorm}; a port that takes top-k first, scores by sigmoid, or runs the router in bf16 picks or "
           "weighs otherwise")
_RENORM_ALWAYS = "then divides the k weights by their sum (always, whatever norm_topk_prob says)"
_RENORM_CONFIG = "then divides the k weights by their sum only where norm_topk_prob is true (default false)"
_EXPERTS_HINT = ("each expert is down(act(gate·x)·(up·x)), gate first in transformers' fused gate_up_proj; "
                 "a port that swaps gate and up, or loads the experts in another order, differs here first")


def _routing_hints(title: str, renorm: str) -> dict[str, str]:
    router = f"{title}: " + _ROUTER.format(k="num_experts_per_tok", renorm=renorm)
    logits = (f"{title}: the router's logits are x·Wᵀ in the model's dtype (router_dtype=bf16: a port that runs "
              "its router in bf16 rounds them here)")
    return {ROUTER_LOGITS: logits, ROUTER_SCORES: router, TOP_K_INDEX: router, TOP_K_WEIGHTS: router,
            EXPERTS: f"{title}: " + _EXPERTS_HINT}


def _mixtral_extras(file: dict) -> dict:
    """Mixtral: RoPE with base 1e6 by default, a sliding window on every layer where sliding_window is set."""
    theta, scaling = config._hf_rope(file, default_theta=1e6, original_max=config.top_level_original_max(file))
    return {"rope_theta": theta, "rope_scaling": scaling, **config.every_layer_window(file, None)}


def _use_sliding_window(file: dict) -> bool:
    return config.FIELD_CHECKS["bool"]("use_sliding_window", file.get("use_sliding_window", False))


def _qwen2_moe_extras(file: dict) -> dict:
    """Qwen2-MoE (`Qwen2MoeConfig.__post_init__`): q/k/v biases where qkv_bias (default true); with
    use_sliding_window, a window on layer_types' sliding layers, by default the even layers below
    max_window_layers (not Qwen2's pattern: the layers from max_window_layers on)."""
    use = _use_sliding_window(file)
    below = config.FIELD_CHECKS["positive_int"]("max_window_layers", file.get("max_window_layers", 28))
    pattern = ["sliding_attention" if use and (i + 1) % 2 and i < below else "full_attention"
               for i in range(file["num_hidden_layers"])]
    types = config._layer_types(file, pattern)
    window = config._window(file, 4096) if use else None
    if "sliding_attention" in types and window is None:
        raise TracerError("config.json: layer_types has sliding layers but use_sliding_window is false "
                          "(transformers then masks them to a window of 0 keys)")
    return {**config.rope_fields(file), "qkv_bias": config.FIELD_CHECKS["bool"]("qkv_bias", file.get("qkv_bias", True)),
            "sliding_window": window, "layer_types": types if "sliding_attention" in types else None}


def _qwen3_moe_extras(file: dict) -> dict:
    """Qwen3-MoE (`Qwen3MoeConfig.__post_init__`): sliding_window only with use_sliding_window, then on
    every layer (one mask function for the model)."""
    window = config.every_layer_window(file if _use_sliding_window(file) else {**file, "sliding_window": None}, 4096)
    return {**config.llama_extras(file), **window, "mlp_bias": False}


def _olmoe_extras(file: dict) -> dict:
    """OLMoE: Llama's attention biases; `clip_qkv` (clamping q, k and v) is not in tracer's forward."""
    if file.get("clip_qkv") is not None:
        raise TracerError("config.json: clip_qkv is set; tracer's OLMoE forward does not clamp q, k and v yet")
    return {**config.llama_extras(file), "mlp_bias": False}


_WINDOWLESS_PROBS = "sliding-window attention where the config sets one (window=ignore attends to the whole prefix)"
_QWEN_MOE = dict(top_k=ConfigField("num_experts_per_tok", 4), expert_size=ConfigField("moe_intermediate_size", 1408),
                 norm_topk=ConfigField("norm_topk_prob", False, "bool"), dense_layers=True)

MIXTRAL = LLAMA.derive(
    name="mixtral", title="Mixtral", model_types=("mixtral",), architecture="MixtralForCausalLM",
    adds="a sparse mixture-of-experts MLP (softmax router, top-k weights always renormalized, "
         "block_sparse_moe.* weights); a sliding window on every layer where the config sets one",
    attention=Attention(window=True),
    mlp=SparseMoE(names=MIXTRAL_NAMES, experts=ConfigField("num_local_experts", 8, aliases=("num_experts",)),
                  cast_weights=False),
    config=FamilyConfig(_mixtral_extras, {**config.ROPE_KEYS, "sliding_window": None}, kv_heads=8, rms_norm_eps=1e-5,
                        max_positions=131072),
    hints={**_routing_hints("Mixtral", _RENORM_ALWAYS), PROBS: "Mixtral: " + _WINDOWLESS_PROBS})

QWEN2_MOE = LLAMA.derive(
    name="qwen2_moe", title="Qwen2-MoE", model_types=("qwen2_moe",), architecture="Qwen2MoeForCausalLM",
    gguf_arch="qwen2moe",
    adds="Qwen2's q/k/v biases, a sparse MoE MLP with a shared expert behind a sigmoid gate, dense layers "
         "where mlp_only_layers or decoder_sparse_step say",
    attention=Attention(window=True),
    mlp=SparseMoE(experts=ConfigField("num_experts", 60), shared=ConfigField("shared_expert_intermediate_size", 5632),
                  **_QWEN_MOE),
    config=FamilyConfig(_qwen2_moe_extras, {**config.ROPE_KEYS, "qkv_bias": True, **config.QWEN_WINDOW_KEYS},
                        kv_heads=16, max_positions=32768),
    hints={**_routing_hints("Qwen2-MoE", _RENORM_CONFIG),
           SHARED_EXPERT: "Qwen2-MoE multiplies its shared expert's output by sigmoid(shared_expert_gate(x)) before "
                          "adding it (shared_gate=drop adds it ungated)",
           PROBS: "Qwen2-MoE: " + _WINDOWLESS_PROBS})

QWEN3_MOE = LLAMA.derive(
    name="qwen3_moe", title="Qwen3-MoE", model_types=("qwen3_moe",), architecture="Qwen3MoeForCausalLM",
    gguf_arch="qwen3moe",
    adds="Qwen3's per-head q/k RMSNorm, a sparse MoE MLP (no shared expert), dense layers where "
         "mlp_only_layers or decoder_sparse_step say",
    attention=Attention(qk_norm=PerHeadNorm(), window=True),
    mlp=SparseMoE(experts=ConfigField("num_experts", 128, aliases=("num_local_experts",)),
                  **{**_QWEN_MOE, "top_k": ConfigField("num_experts_per_tok", 8),
                     "expert_size": ConfigField("moe_intermediate_size", 768)}),
    config=FamilyConfig(_qwen3_moe_extras, {**config.ROPE_KEYS, "attention_bias": False, "use_sliding_window": False,
                                            "sliding_window": 4096}, kv_heads=4, max_positions=32768),
    hints={**_routing_hints("Qwen3-MoE", _RENORM_CONFIG),
           Q_NORM: "Qwen3-MoE norms q and k per head (over D values) before RoPE",
           K_NORM: "Qwen3-MoE norms q and k per head (over D values) before RoPE",
           PROBS: "Qwen3-MoE: " + _WINDOWLESS_PROBS})

OLMOE = LLAMA.derive(
    name="olmoe", title="OLMoE", model_types=("olmoe",), architecture="OlmoeForCausalLM", gguf_arch="olmoe",
    adds="OLMo's q/k RMSNorm over the whole projection (pre-norm blocks, Llama's RMSNorm), a sparse MoE MLP",
    attention=Attention(qk_norm=WholeNorm()),
    mlp=SparseMoE(experts=ConfigField("num_experts", 64, aliases=("num_local_experts",)),
                  top_k=ConfigField("num_experts_per_tok", 8), norm_topk=ConfigField("norm_topk_prob", False, "bool")),
    config=FamilyConfig(_olmoe_extras, {**config.ROPE_KEYS, "attention_bias": False, "clip_qkv": None},
                        rms_norm_eps=1e-5, max_positions=4096),
    hints={**_routing_hints("OLMoE", _RENORM_CONFIG),
           Q_NORM: "OLMoE norms q and k over the whole projection (H·D values), before RoPE",
           K_NORM: "OLMoE norms q and k over the whole projection (KV·D values), before RoPE"})

MOE_FAMILIES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE)
for _family in MOE_FAMILIES:
    register(_family)
