"""gpt-oss: Llama's block with attention sinks, q/k/v/o biases, alternating sliding and full layers, YaRN
RoPE, and a mixture of experts with a biased router and clamped-SwiGLU experts
(`tracer.model.components.gpt_oss`). No torch here.

Read off transformers 5.25's `models/gpt_oss/modeling_gpt_oss.py` and `configuration_gpt_oss.py`: a window on
layer_types' sliding layers (by default the even ones), attention_bias true by default, the norms' weight
multiplied in f32 before the cast (OLMo-2's RMSNorm).
"""

from __future__ import annotations

from tracer.model.component import ConfigField, register
from tracer.model.components.attention import PatternWindow
from tracer.model.components.gpt_oss import GptOssMoE, GptOssRope, SinkAttention
from tracer.model.components.norm import Olmo2RMSNorm
from tracer.model.config import FamilyConfig
from tracer.model.families import LLAMA
from tracer.model.points import EXPERTS, PROBS, ROUTER_LOGITS, ROUTER_SELECTION, TOP_K_INDEX, TOP_K_WEIGHTS

_ROUTER = ("gpt-oss: the router's logits are x·Wᵀ + b (router_bias=drop forgets b); top-k picks the k largest "
           "logits and the weights are the softmax over those k only, in the logits' dtype")

GPT_OSS = LLAMA.derive(
    name="gpt_oss", title="gpt-oss", model_types=("gpt_oss",), architecture="GptOssForCausalLM",
    gguf_arch="gpt-oss",
    adds="attention sinks, q/k/v/o biases, alternating sliding and full layers, YaRN RoPE; a mixture of experts "
         "with a biased router (softmax over the top-k logits) and clamped-SwiGLU experts with biases",
    norm=Olmo2RMSNorm(),
    attention=SinkAttention(rope=GptOssRope(), window=PatternWindow(default=128, pattern=2),
                            fields=(ConfigField("attention_bias", True, "bool"),)),
    mlp=GptOssMoE(),
    config=FamilyConfig(kv_heads=8, head_dim=64, rms_norm_eps=1e-5, max_positions=131072),
    hints={PROBS: "gpt-oss adds a learned sink logit per head to each softmax's denominator and drops its column "
                  "after: each row sums to less than 1 (sinks=drop gives a plain softmax); its even layers slide "
                  "(window=ignore attends to the whole prefix)",
           ROUTER_LOGITS: _ROUTER, ROUTER_SELECTION: _ROUTER, TOP_K_INDEX: _ROUTER, TOP_K_WEIGHTS: _ROUTER,
           EXPERTS: "gpt-oss's experts: gate and up interleaved in gate_up_proj (gate the even columns), gate "
                    "clamped above at swiglu_limit and up to ±swiglu_limit (swiglu_clamp=drop forgets it), "
                    "(up + 1)·gate·sigmoid(swiglu_alpha·gate), biases on both projections"})

register(GPT_OSS)
