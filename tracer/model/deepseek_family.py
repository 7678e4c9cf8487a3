"""DeepSeek-V3: Llama's pre-norm block with multi-head latent attention
(`tracer.model.components.mla.LatentAttention`) and, from layer `first_k_dense_replace` on, a mixture of
experts behind a biased, group-limited sigmoid router with shared experts
(`tracer.model.components.deepseek_moe.DeepseekMoE`). Registered after the other mixtures of experts
(`tracer.model` imports this module last). No torch here.

Read off transformers 5.25's `models/deepseek_v3/modeling_deepseek_v3.py` and `configuration_deepseek_v3.py`.
"""

from __future__ import annotations

from tracer.model.component import register
from tracer.model.components.deepseek_moe import DeepseekMoE
from tracer.model.components.mla import LatentAttention
from tracer.model.config import FamilyConfig
from tracer.model.families import LLAMA
from tracer.model.points import (
    EXPERTS,
    K_NOPE,
    K_PE,
    K_ROPE,
    KV_LATENT,
    Q_ROPE,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    ROUTER_SELECTION,
    SHARED_EXPERT,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
)

_ROUTER = ("DeepSeek-V3: scores = sigmoid(logits) in f32; top-k picks from the scores plus e_score_correction_bias, "
           "only among the experts of the topk_group groups whose two best biased scores sum highest; the weights "
           "are the unbiased scores of the picked experts, divided by their sum where norm_topk_prob, times "
           "routed_scaling_factor. A port that weighs by the biased scores, drops the scaling factor or picks "
           "over every group differs here")
_MLA_ROPE = ("DeepSeek-V3's MLA: each query head is [qk_nope_head_dim non-RoPE | qk_rope_head_dim RoPE] values, "
             "RoPE rotating only the RoPE part, in interleaved pairs where rope_interleave (evens then odds out); "
             "each key is [kv_b_proj of the latent kv | the shared k_pe rotated]")

DEEPSEEK_V3 = LLAMA.derive(
    name="deepseek_v3", title="DeepSeek-V3", model_types=("deepseek_v3",), architecture="DeepseekV3ForCausalLM",
    gguf_arch="deepseek2",
    adds="multi-head latent attention (low-rank q and kv latents, RoPE on a decoupled part of each head), a "
         "sigmoid router with a selection bias and group-limited top-k, routed scaling, shared experts, dense "
         "first layers",
    attention=LatentAttention(),
    mlp=DeepseekMoE(),
    config=FamilyConfig(head_dim=64, max_positions=4096),
    hints={ROUTER_LOGITS: "DeepSeek-V3: the router's logits are linear(x, W) with both in f32, whatever the "
                          "model's dtype",
           ROUTER_SCORES: _ROUTER, ROUTER_SELECTION: _ROUTER, TOP_K_INDEX: _ROUTER, TOP_K_WEIGHTS: _ROUTER,
           EXPERTS: "DeepSeek-V3: each routed expert is down(act(gate·x)·(up·x)) times its weight (f32)",
           SHARED_EXPERT: "DeepSeek-V3: the shared experts (one MLP of moe_intermediate_size · n_shared_experts) "
                          "run on every token, ungated, added to the routed experts' sum",
           KV_LATENT: "DeepSeek-V3's MLA: the latent kv is the first kv_lora_rank values of kv_a_proj_with_mqa, "
                      "RMS-normed with eps 1e-6 (not rms_norm_eps); k's RoPE part is the last qk_rope_head_dim",
           K_PE: "DeepSeek-V3's MLA: k's RoPE part is the last qk_rope_head_dim values of kv_a_proj_with_mqa, "
                 "shared by every head",
           K_NOPE: "DeepSeek-V3's MLA: kv_b_proj of the latent kv gives each head [qk_nope_head_dim key | "
                   "v_head_dim value]",
           Q_ROPE: _MLA_ROPE, K_ROPE: _MLA_ROPE})

register(DEEPSEEK_V3)
