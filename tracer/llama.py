"""Llama and its descendants in plain torch, instrumented: the `reimpl` engine's model.

Mirrors transformers 5.24's `models/llama/modeling_llama.py` with eager attention, op by op and
dtype by dtype (RMSNorm in f32 then cast back, softmax in f32, the same matmul shapes with a batch
of 1), so that with no variant every point agrees with the `hf` engine at rounding level and a
difference is a real difference. The other families tracer traces (`tracer.families`: Qwen2/3,
Mistral, Gemma 2/3, Phi-3, OLMo-2; their `modeling_<family>.py` files) are the same forward with
other entries of the same tables: a family names its norm, embedding, projections, q/k norm, MLP
and norm positions, and the spec carries its windows, RoPE bases, soft-caps and scalars. It reads
`config.json` and safetensors itself; transformers is never imported on this path.

Every point of `tracer.points` is handed to one `record(name, tensor)` call; tensors keep their
batch dimension of 1 here and the recorder drops it. Variant knobs are resolved once, before the
forward: config-level knobs into a different `LlamaSpec` (`tracer.config.apply_overrides`),
semantic knobs and the family's structure into the small strategy functions of `Strategies`
(`resolve_strategies`), picked from one lookup table per step (`NORMS`, `EMBEDDINGS`, `ROPES`,
`KV_REPEATS`, `MASKS`, `ATTN_MATH`, `ATTENTION`, `PROJECTIONS`, `QK_NORMS`, `MLPS`, `LOGITS`, ...);
the number-format regime knobs (`weights`, `act_quant`, `kv_cache`, `ops`, ..., `preset=llamacpp`)
replace steps with `tracer.ggml.strategies`'s. The forward calls whatever was picked; it never tests a
knob or a family.

Notation: T tokens, C hidden size, H query heads, KV kv heads, D head dim, R rotary dims (D unless
partial), I intermediate size, V vocab size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tracer import families
from tracer.config import LlamaSpec, apply_overrides, load_config, read_config
from tracer.errors import TracerError
from tracer.points import FINAL_LOGITS, fused_away
from tracer.torch_types import TORCH_DTYPES, Recorder
from tracer.variants import KNOBS, expand_presets, is_regime, setting


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh (Gemma's GeGLU)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "gelu_pytorch_tanh": gelu_tanh}


def gated_activation(gate: torch.Tensor, up: torch.Tensor, hidden_act: str) -> torch.Tensor:
    """The MLP's act(gate) * up, (1, T, I) each."""
    return ACTIVATIONS[hidden_act](gate) * up


def _no_record(name: str, tensor: torch.Tensor) -> None:
    pass


# --- norm, rotary ----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)


def rms_norm_candle(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """candle_nn::ops::rms_norm on CPU: sum of squares in f32, the root cast to the load dtype, then
    x / root * weight in the load dtype (HF multiplies by rsqrt in f32 and casts before the weight)."""
    root = torch.sqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
    return x / root * weight


NORMS = {"hf": rms_norm, "candle": rms_norm_candle}


def rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma: normalized in f32, times (1 + weight) in f32, then cast (the stored weight is an offset)."""
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def rms_norm_gemma_no_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A Gemma port that forgets the 1: times the stored weight (near 0) instead of (1 + weight)."""
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).type_as(x)


def rms_norm_olmo(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """OLMo-2: the weight multiplies the f32 normalized values, and only then the cast."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(input_dtype)


# A family's norm flavour (tracer.families.Family.norm) -> (the knob that picks from it, its table).
NORM_FLAVOURS = {
    "rms": ("norm", NORMS),
    "gemma": ("norm_offset", {"keep": rms_norm_gemma, "drop": rms_norm_gemma_no_offset}),
    "olmo": (None, {None: rms_norm_olmo}),
}


# --- embedding -------------------------------------------------------------------------------


def embed_plain(ids: torch.Tensor, weight: torch.Tensor, spec: LlamaSpec) -> torch.Tensor:
    """(1, T) -> (1, T, C): rows of the table."""
    return F.embedding(ids, weight)


def embed_scaled(ids: torch.Tensor, weight: torch.Tensor, spec: LlamaSpec) -> torch.Tensor:
    """Gemma: rows times sqrt(hidden_size), the scale rounded to the model's dtype first (transformers
    builds its buffer in the load dtype: a bf16 Gemma 2 9B multiplies by 60.0, not 59.87)."""
    scale = torch.tensor(spec.hidden_size**0.5, dtype=weight.dtype, device=weight.device)  # 0-dim
    return F.embedding(ids, weight) * scale


def embed_scaled_f32(ids: torch.Tensor, weight: torch.Tensor, spec: LlamaSpec) -> torch.Tensor:
    """A Gemma port that scales in f32 and casts the product (the same numbers in f32, not in bf16)."""
    return (F.embedding(ids, weight).float() * spec.hidden_size**0.5).to(weight.dtype)


# A family's embedding (Family.embed) -> the `embed_scale` knob's value -> the function.
EMBEDDINGS = {
    "plain": {"model": embed_plain},
    "scaled": {"model": embed_scaled, "drop": embed_plain, "f32": embed_scaled_f32},
}


def rope_inv_freq(spec: LlamaSpec, layer_type: str = "full_attention", num_tokens: int = 1) -> torch.Tensor:
    """(R/2,) inverse frequencies, f32, with the config's rope scaling applied. Gemma 3's sliding
    layers use their own base (`rope_local_theta`) without scaling; longrope picks its factors by
    the sequence length, as transformers' `longrope_frequency_update` does."""
    dim, local = spec.rotary_dim, layer_type == "sliding_attention" and spec.rope_local_theta is not None
    base = spec.rope_local_theta if local else spec.rope_theta
    scaling = None if local else spec.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        return _longrope_inv_freq(base, dim, scaling, num_tokens)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise TracerError(f"rope_type {kind!r} is not supported by the reimpl engine "
                      "(supported: default, linear, llama3, longrope)")


def _longrope_inv_freq(base: float, dim: int, scaling: dict, num_tokens: int) -> torch.Tensor:
    """Phi-3's longrope: per-frequency factors, the long ones past the pretraining length."""
    long = num_tokens > scaling["original_max_position_embeddings"]
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)  # (R/2,)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * base**shape)


def rope_attention_scaling(spec: LlamaSpec, layer_type: str = "full_attention") -> float:
    """The factor cos and sin are multiplied by: 1 but for longrope (sqrt(1 + ln(s)/ln(original)))."""
    scaling = spec.rope_scaling
    local = layer_type == "sliding_attention" and spec.rope_local_theta is not None
    if local or scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or spec.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_cos_sin(spec: LlamaSpec, num_tokens: int, dtype: torch.dtype | None,
                   device: torch.device | str = "cpu",
                   layer_type: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (1, T, R), in the half-split layout (frequencies repeated, not interleaved);
    cast to `dtype` (None: kept in f32, as OLMo-2 keeps them)."""
    positions = torch.arange(num_tokens, device=device)[None]  # (1, T)
    # On the run's device, as transformers computes them: a GPU's cos/sin differ from the CPU's in the last bit.
    freqs = positions[..., None].float() * rope_inv_freq(spec, layer_type, num_tokens).to(device)  # (1, T, R/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (1, T, R)
    scale = rope_attention_scaling(spec, layer_type)
    cos, sin = (emb.cos(), emb.sin()) if scale == 1.0 else (emb.cos() * scale, emb.sin() * scale)
    return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's RoPE: x (1, heads, T, D), cos/sin (1, T, D)."""
    cos, sin = cos[:, None], sin[:, None]  # (1, 1, T, D)
    return (x * cos) + (rotate_half(x) * sin)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """candle's `rope_i` (the GGUF convention): rotates adjacent pairs (x0, x1), (x2, x3), ... by
    frequency i of pair i. On HF-layout weights, which pair dim i with dim i + D/2, it is wrong."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :, :half], sin[:, None, :, :half]  # (1, 1, T, D/2): one angle per pair
    pairs = x.unflatten(-1, (half, 2))  # (1, heads, T, D/2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]  # (1, heads, T, D/2) each
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # (1, heads, T, D/2, 2)
    return rotated.flatten(-2)  # (1, heads, T, D)


ROPES = {"half": rope_half, "interleaved": rope_interleaved}


def partial_rotary(rope: Callable) -> Callable:
    """Phi-3's partial rotary: `rope` on the first R dims of each head, the rest passed through."""

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotary_dim = cos.shape[-1]
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]  # (1, heads, T, R), (1, heads, T, D - R)
        return torch.cat([rope(x_rot, cos, sin), x_pass], dim=-1)  # (1, heads, T, D)

    return rotate


def rotated_in_f32(rope: Callable) -> Callable:
    """OLMo-2: cos/sin stay f32, so the rotation runs in f32 and the result is cast back to x's dtype."""
    return lambda x, cos, sin: rope(x, cos, sin).to(x.dtype)


# A family's RoPE precision (Family.rope_precision) -> (cos/sin dtype: None keeps f32, wrapper of the rope).
ROPE_PRECISIONS = {"model": (True, lambda rope: rope), "f32": (False, rotated_in_f32)}


@dataclass(frozen=True)
class Positions:
    """What one layer knows about positions: its RoPE tables and the keys a query may see."""

    cos: torch.Tensor  # (1, T, R)
    sin: torch.Tensor  # (1, T, R)
    window: int | None = None  # keys a query sees, itself included; None: the whole prefix


def layer_positions(spec: LlamaSpec, strategies: Strategies, num_tokens: int, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> list[Positions]:
    """Each layer's Positions: RoPE tables per layer type (Gemma 3's local layers have their own base)
    and its window (a sliding layer's, unless the variant ignores windows)."""
    tables = {kind: strategies.rotary(spec, num_tokens, dtype if strategies.rope_cast else None, device, kind)
              for kind in {spec.layer_type(i) for i in range(spec.num_hidden_layers)}}  # (1, T, R) each
    return [Positions(*tables[spec.layer_type(i)], window=strategies.window(spec, i))
            for i in range(spec.num_hidden_layers)]


def window_of_layer(spec: LlamaSpec, layer: int) -> int | None:
    return spec.window(layer)


def window_ignored(spec: LlamaSpec, layer: int) -> int | None:
    """A port without sliding windows: every layer attends to the whole prefix."""
    return None


WINDOWS = {"keep": window_of_layer, "ignore": window_ignored}


# --- attention -------------------------------------------------------------------------------


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(1, KV, T, D) -> (1, KV*groups, T, D), each kv head repeated for its consecutive query heads."""
    batch, kv_heads, tokens, dim = x.shape
    if groups == 1:
        return x
    x = x[:, :, None].expand(batch, kv_heads, groups, tokens, dim)  # (1, KV, groups, T, D)
    return x.reshape(batch, kv_heads * groups, tokens, dim)


def repeat_kv_tile(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(1, KV, T, D) -> (1, KV*groups, T, D) in tile order (torch.cat / .repeat): query head h reads
    kv head h % KV instead of h // groups."""
    return x.repeat(1, groups, 1, 1)  # (1, KV*groups, T, D)


KV_REPEATS = {"interleave": repeat_kv, "tile": repeat_kv_tile}


def blocked_keys(num_tokens: int, window: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """(T, T) bool, True where a query may not attend: the future, and with a sliding window the keys
    `window` or more positions back (transformers' `sliding_window_overlay`: kv > q - window)."""
    blocked = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).triu(1)
    if window is not None:
        blocked |= torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril(-window)
    return blocked


def causal_mask(num_tokens: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                window: int | None = None) -> torch.Tensor:
    """(1, 1, T, T): 0 where attention is allowed, the dtype's most negative value where it is not."""
    blocked = blocked_keys(num_tokens, window, device)
    # Built in the target dtype: f64's most negative value does not fit the default f32.
    return (torch.zeros(blocked.shape, dtype=dtype, device=device)
            .masked_fill(blocked, torch.finfo(dtype).min)[None, None])


def mask_additive(scores: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """HF eager: add the min-float causal (or sliding-window) mask to the scores (1, H, T, T)."""
    return scores + causal_mask(scores.shape[-1], scores.dtype, scores.device, window)


def mask_where(scores: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """candle's masked_fill: blocked positions replaced by -inf (a where, not an add)."""
    return scores.masked_fill(blocked_keys(scores.shape[-1], window, scores.device), float("-inf"))  # (T, T) mask


def mask_none(scores: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """No causal mask: every position attends to the future too (and past any window)."""
    return scores


MASKS = {"additive": mask_additive, "where": mask_where, "none": mask_none}


def scale_multiply(scores: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF: scores * head_dim**-0.5."""
    return scores * head_dim**-0.5


def scale_divide(scores: torch.Tensor, head_dim: int) -> torch.Tensor:
    """candle: scores / sqrt(head_dim) (the same number only when sqrt(head_dim) is a power of 2)."""
    return scores / math.sqrt(head_dim)


# How scores are scaled, and the dtype attention runs in (None: the load dtype; candle: f32 throughout).
ATTN_MATH = {"hf": (scale_multiply, None), "candle": (scale_divide, torch.float32)}


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2: cap·tanh(x/cap), in three ops as transformers writes it; None: no cap."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def softcap_dropped(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """A port that forgets the soft-cap."""
    return x


SOFTCAPS = {"keep": softcap, "drop": softcap_dropped}


def attention_eager(q, k, v, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder,
                    window: int | None = None) -> torch.Tensor:
    """matmul, scale (soft-cap), mask, softmax in f32, matmul: q (1, H, T, D), k/v (1, KV, T, D) -> (1, H, T, D).
    `scores` is what the mask and softmax receive: after Gemma 2's soft-cap."""
    in_dtype = q.dtype
    work = strategies.attention_dtype or in_dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    k, v = strategies.repeat_kv(k, spec.num_kv_groups), strategies.repeat_kv(v, spec.num_kv_groups)  # (1, H, T, D)
    scores = strategies.scale_scores(torch.matmul(q, k.transpose(2, 3)), spec.score_scale_dim)  # (1, H, T, T)
    scores = strategies.softcap(scores, spec.attn_logit_softcapping)
    record(f"{prefix}.scores", scores)
    probs = F.softmax(strategies.mask(scores, window), dim=-1, dtype=torch.float32).to(work)
    record(f"{prefix}.probs", probs)
    return torch.matmul(probs, v).to(in_dtype)


def attention_sdpa(q, k, v, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder,
                   window: int | None = None) -> torch.Tensor:
    """torch's fused kernel with its own causal mask (an explicit one for a window); scores and
    probs never exist as tensors."""
    k, v = strategies.repeat_kv(k, spec.num_kv_groups), strategies.repeat_kv(v, spec.num_kv_groups)  # (1, H, T, D)
    scale = spec.score_scale_dim ** -0.5
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale)
    allowed = ~blocked_keys(q.shape[2], window, q.device)  # (T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


attention_sdpa.fused = "attn=sdpa fuses scores and softmax into one kernel"  # why scores/probs are not recorded


ATTENTION = {"eager": attention_eager, "sdpa": attention_sdpa}


def logits_all(h: torch.Tensor, weight: torch.Tensor, linear: Callable = F.linear) -> torch.Tensor:
    """(1, T, C) -> (1, T, V): every position, as transformers returns them."""
    return linear(h, weight)


def logits_last(h: torch.Tensor, weight: torch.Tensor, linear: Callable = F.linear) -> torch.Tensor:
    """(1, T, C) -> (1, 1, V): candle's forward keeps the last position before lm_head."""
    return linear(h[:, -1:], weight)


LOGITS = {"all": logits_all, "last": logits_last}


# --- projections, q/k norms, MLPs: the families' shapes of the same steps ------------------------


def project_separate(x, w: dict, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder):
    """x (1, T, C) -> q (1, T, H*D), k, v (1, T, KV*D): three projections (Qwen2's carry biases)."""
    q = strategies.linear(x, w["q_proj.weight"], w.get("q_proj.bias"))  # (1, T, H*D)
    k = strategies.linear(x, w["k_proj.weight"], w.get("k_proj.bias"))  # (1, T, KV*D)
    v = strategies.linear(x, w["v_proj.weight"], w.get("v_proj.bias"))  # (1, T, KV*D)
    record(f"{prefix}.q_proj", q)
    record(f"{prefix}.k_proj", k)
    record(f"{prefix}.v_proj", v)
    return q, k, v


def project_fused(x, w: dict, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder):
    """Phi-3: one qkv_proj (1, T, (H + 2·KV)·D), cut into q | k | v in the variant's order."""
    qkv = strategies.linear(x, w["qkv_proj.weight"])  # (1, T, (H + 2·KV)·D)
    record(f"{prefix}.qkv_proj", qkv)
    sizes = {"q": spec.num_attention_heads * spec.head_dim, "k": spec.num_key_value_heads * spec.head_dim}
    sizes["v"] = sizes["k"]
    parts, start = {}, 0
    for name in strategies.qkv_order:  # "qkv": q = [:H*D], k = [H*D : H*D + KV*D], v = the rest
        parts[name], start = qkv[..., start:start + sizes[name]], start + sizes[name]
    return parts["q"], parts["k"], parts["v"]


PROJECTIONS = {"separate": project_separate, "fused": project_fused}


def heads_first(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(1, T, heads*D) -> (1, heads, T, D)."""
    batch, tokens, _ = x.shape
    return x.view(batch, tokens, -1, head_dim).transpose(1, 2)  # (1, heads, T, D)


def qk_plain(q, k, w: dict, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder):
    """No q/k norm: (1, T, heads*D) -> (1, heads, T, D) each."""
    return heads_first(q, spec.head_dim), heads_first(k, spec.head_dim)


def qk_norm_per_head(q, k, w: dict, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder):
    """Qwen3: RMSNorm over each head's D values on (1, T, heads, D), then the transpose."""
    out = []
    for name, x in (("q_norm", q), ("k_norm", k)):
        x = strategies.qk_norm(x.unflatten(-1, (-1, spec.head_dim)), w[f"{name}.weight"],
                               spec.rms_norm_eps)  # (1, T, heads, D)
        record(f"{prefix}.{name}", x.flatten(2))  # (1, T, heads*D)
        out.append(x.transpose(1, 2))  # (1, heads, T, D)
    return tuple(out)


def qk_norm_per_head_heads_first(q, k, w: dict, spec: LlamaSpec, strategies: Strategies, prefix: str,
                                 record: Recorder):
    """Gemma 3: the transpose first, then RMSNorm over each head's D values on (1, heads, T, D)."""
    out = []
    for name, x in (("q_norm", q), ("k_norm", k)):
        x = strategies.qk_norm(heads_first(x, spec.head_dim), w[f"{name}.weight"],
                               spec.rms_norm_eps)  # (1, heads, T, D)
        record(f"{prefix}.{name}", x.transpose(1, 2).flatten(2))  # (1, T, heads*D)
        out.append(x)
    return tuple(out)


def qk_norm_whole(q, k, w: dict, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder):
    """OLMo-2: RMSNorm over the whole projection (1, T, heads*D), then the split into heads."""
    out = []
    for name, x in (("q_norm", q), ("k_norm", k)):
        x = strategies.qk_norm(x, w[f"{name}.weight"], spec.rms_norm_eps)  # (1, T, heads*D)
        record(f"{prefix}.{name}", x)
        out.append(heads_first(x, spec.head_dim))  # (1, heads, T, D)
    return tuple(out)


def qk_norm_skipped(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """qk_norm=drop: a port without the q/k norm passes the projection through (recorded as such)."""
    return x


QK_NORMS = {"none": qk_plain, "per_head": qk_norm_per_head, "per_head_heads_first": qk_norm_per_head_heads_first,
            "whole": qk_norm_whole}


def gate_up_separate(x, w: dict, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder):
    """x (1, T, C) -> gate, up (1, T, I) each: two projections."""
    gate = strategies.linear(x, w["gate_proj.weight"], w.get("gate_proj.bias"))  # (1, T, I)
    record(f"{prefix}.gate_proj", gate)
    up = strategies.linear(x, w["up_proj.weight"], w.get("up_proj.bias"))  # (1, T, I)
    record(f"{prefix}.up_proj", up)
    return gate, up


def gate_up_fused(x, w: dict, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder):
    """Phi-3: one gate_up_proj (1, T, 2·I), chunked gate first (swapped by gate_up=up_gate)."""
    fused = strategies.linear(x, w["gate_up_proj.weight"])  # (1, T, 2·I)
    record(f"{prefix}.gate_up_proj", fused)
    first, second = fused.chunk(2, dim=-1)  # (1, T, I) each
    return (first, second) if strategies.gate_first else (second, first)


MLPS = {"separate": gate_up_separate, "fused": gate_up_fused}


@dataclass(frozen=True)
class Strategies:
    """The forward's replaceable steps, chosen once from the variant and the model's family."""

    attention: Callable = attention_eager
    dtype: torch.dtype = torch.float32
    norm: Callable = rms_norm
    rope: Callable = rope_half
    repeat_kv: Callable = repeat_kv
    mask: Callable = mask_additive
    scale_scores: Callable = scale_multiply
    attention_dtype: torch.dtype | None = None
    logits: Callable = logits_all
    # The family's structure (tracer.families) and the knobs that undo one of its features.
    embed: Callable = embed_plain
    project: Callable = project_separate
    qkv_order: str = "qkv"
    qk_heads: Callable = qk_plain
    qk_norm: Callable = rms_norm
    gate_up: Callable = gate_up_separate
    gate_first: bool = True
    norms: tuple = families.PRE_NORM  # ((before, after) the attention, (before, after) the MLP)
    rope_cast: bool = True  # cos/sin cast to the model dtype (OLMo-2 keeps them f32)
    softcap: Callable = softcap
    window: Callable = window_of_layer
    # Number formats (tracer.ggml.strategies): weights as run, every projection, RoPE tables, the GLU.
    weights: Callable = lambda weights, source: weights
    linear: Callable = F.linear
    rotary: Callable = rotary_cos_sin
    glu: Callable = gated_activation

    def not_recorded(self) -> dict[str, str]:
        reason = getattr(self.attention, "fused", None)  # a fused attention never forms scores/probs
        return fused_away(reason) if reason else {}


# Knobs the fused sdpa kernel cannot take: it masks and scales inside.
EAGER_ONLY = ("mask", "attn_math")


def resolve_strategies(knobs: dict, spec: LlamaSpec | None = None) -> Strategies:
    """The strategy functions a variant's knobs (presets expanded) pick from the tables above, for
    the model `spec` describes (its family's structure; None: a Llama)."""
    family = families.get(spec.family if spec else None)
    attn = setting(knobs, "attn")
    clashing = [k for k in EAGER_ONLY if attn == "sdpa" and setting(knobs, k) != KNOBS[k].default_value]
    if clashing:
        raise TracerError(f"{clashing[0]}={knobs[clashing[0]]} needs attn=eager: "
                          "sdpa masks and scales inside its fused kernel")
    if spec is not None:
        _check_feature(knobs, spec)
    scale_scores, attention_dtype = ATTN_MATH[setting(knobs, "attn_math")]
    norm_knob, norm_table = NORM_FLAVOURS[family.norm]
    norm = norm_table[knobs.get(norm_knob, next(iter(norm_table))) if norm_knob else None]
    cast, precision = ROPE_PRECISIONS[family.rope_precision]
    rope = precision(ROPES[setting(knobs, "rope")])
    plain = Strategies(
        attention=ATTENTION[attn],
        dtype=TORCH_DTYPES[setting(knobs, "dtype")],
        norm=norm,
        rope=partial_rotary(rope) if spec is not None and spec.rotary_dim < spec.head_dim else rope,
        repeat_kv=KV_REPEATS[setting(knobs, "kv_repeat")],
        mask=MASKS[setting(knobs, "mask")],
        scale_scores=scale_scores,
        attention_dtype=attention_dtype,
        logits=LOGITS[setting(knobs, "logits")],
        embed=EMBEDDINGS[family.embed][setting(knobs, "embed_scale")],
        project=PROJECTIONS[family.projections],
        qkv_order=setting(knobs, "qkv_split"),
        qk_heads=QK_NORMS[family.qk_norm],
        qk_norm=qk_norm_skipped if knobs.get("qk_norm") == "drop" else norm,
        gate_up=MLPS[family.mlp],
        gate_first=setting(knobs, "gate_up") == "gate_up",
        norms=family.norms,
        rope_cast=cast,
        softcap=SOFTCAPS[setting(knobs, "softcap")],
        window=WINDOWS[setting(knobs, "window")],
    )
    if not is_regime(knobs):
        return plain  # numba's kernels stay unimported (about 60 MB and 250 ms) outside a regime
    from tracer.ggml.strategies import apply_regime

    return apply_regime(knobs, plain, spec)


# A knob that undoes a feature this model's config does not use would change nothing: said, not ignored.
# (Checked on the variant's knobs; the fused sdpa kernel cannot soft-cap, as transformers' Gemma 2 cannot.)
_FEATURES = {
    ("attn", "sdpa"): (lambda spec: spec.attn_logit_softcapping is not None,
                       "attn=sdpa cannot soft-cap attention scores (attn_logit_softcapping; transformers has no "
                       "sdpa path for it either)"),
    ("softcap", "drop"): (lambda spec: spec.attn_logit_softcapping is None and spec.final_logit_softcapping is None,
                          "this model's config soft-caps nothing (attn_logit_softcapping and "
                          "final_logit_softcapping are null)"),
    ("window", "ignore"): (lambda spec: spec.sliding_window is None, "this model's config has no sliding window"),
}


def _check_feature(knobs: dict, spec: LlamaSpec) -> None:
    for (knob, value), (refused, reason) in _FEATURES.items():
        if knobs.get(knob) == value and refused(spec):
            raise TracerError(reason if knob == "attn" else f"{knob}={value} changes nothing here: {reason}")


# --- blocks ----------------------------------------------------------------------------------


def self_attention(x, w: dict, spec: LlamaSpec, positions: Positions, strategies: Strategies, prefix: str,
                   record: Recorder):
    """x (1, T, C) -> (1, T, C), recording projections, q/k norms, RoPE, scores, probs, context, output."""
    batch, tokens, _ = x.shape
    q, k, v = strategies.project(x, w, spec, strategies, prefix, record)  # (1, T, H*D), (1, T, KV*D) x2
    q, k = strategies.qk_heads(q, k, w, spec, strategies, prefix, record)  # (1, H, T, D), (1, KV, T, D)
    v = heads_first(v, spec.head_dim)  # (1, KV, T, D)
    q, k = strategies.rope(q, positions.cos, positions.sin), strategies.rope(k, positions.cos, positions.sin)
    record(f"{prefix}.q_rope", q)
    record(f"{prefix}.k_rope", k)
    context = strategies.attention(q, k, v, spec, strategies, prefix, record, positions.window)
    context = context.transpose(1, 2).contiguous().reshape(batch, tokens, -1)  # (1, T, H*D)
    record(f"{prefix}.context", context)
    out = strategies.linear(context, w["o_proj.weight"], w.get("o_proj.bias"))  # (1, T, C)
    record(f"{prefix}.o_proj", out)
    return out


def mlp(x, w: dict, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder):
    """x (1, T, C) -> (1, T, C): down(act(gate(x)) * up(x))."""
    gate, up = strategies.gate_up(x, w, spec, strategies, prefix, record)  # (1, T, I) each
    act = strategies.glu(gate, up, spec.hidden_act)
    record(f"{prefix}.act", act)
    down = strategies.linear(act, w["down_proj.weight"], w.get("down_proj.bias"))  # (1, T, C)
    record(f"{prefix}.down_proj", down)
    return down


def sublayer(x, w: dict, spec: LlamaSpec, strategies: Strategies, norms: tuple, run: Callable, prefix: str,
             record: Recorder):
    """One residual branch (1, T, C) -> (1, T, C): the family's norm before it (Llama), after it (OLMo-2)
    or both (Gemma), around `run`."""
    before, after = norms
    x = _norm_point(x, w, spec, strategies, before, prefix, record)
    return _norm_point(run(x), w, spec, strategies, after, prefix, record)


def _norm_point(x, w: dict, spec: LlamaSpec, strategies: Strategies, name: str | None, prefix: str,
                record: Recorder):
    """The block's norm `name` applied and recorded; no norm there (None): x itself."""
    if name is None:
        return x
    x = strategies.norm(x, w[f"{name}.weight"], spec.rms_norm_eps)
    record(f"{prefix}.{name}", x)
    return x


def decoder_layer(x, w: dict, spec: LlamaSpec, positions: Positions, strategies: Strategies, prefix: str,
                  record: Recorder):
    attention_norms, mlp_norms = strategies.norms

    def attend(h):
        return self_attention(h, Prefixed(w, "self_attn."), spec, positions, strategies, f"{prefix}.self_attn", record)

    def feed_forward(h):
        return mlp(h, Prefixed(w, "mlp."), spec, strategies, f"{prefix}.mlp", record)

    h = x + sublayer(x, w, spec, strategies, attention_norms, attend, prefix, record)
    record(f"{prefix}.resid_mid", h)
    out = h + sublayer(h, w, spec, strategies, mlp_norms, feed_forward, prefix, record)
    record(prefix, out)
    return out


class Prefixed:
    """The weights under one module path, e.g. a layer's `self_attn.q_proj.weight` (a view: with
    streamed weights nothing is read until a tensor is asked for)."""

    def __init__(self, weights, prefix: str):
        self.weights, self.prefix = weights, prefix

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights[self.prefix + name]

    def get(self, name: str, default=None):
        return self.weights.get(self.prefix + name, default)


# --- model -----------------------------------------------------------------------------------


class Llama:
    """A loaded model: spec, weights (checked against the spec), and the variant's strategies.

    `spec` is the file as the variant's config reader sees it (`Llama.from_config` picks the
    reader); the config-level knobs (theta, eps, layers, ...) are applied to it here. The
    weights are converted to the variant's dtype on `device` once, or, with `stream=True`, read
    and converted block by block during every forward, so that memory holds one block's
    weights instead of the model's (for checkpoints larger than memory, and for the f64 copy
    that measures the noise floor).

    Example:
        >>> model = Llama.from_dir(tracer.default_model_path(), {"theta": 10000.0})
        >>> logits = model.forward(torch.tensor([504, 3575, 282, 4649, 314]))  # (T, V)
    """

    def __init__(self, spec: LlamaSpec, weights: Mapping[str, torch.Tensor], variant: dict | None = None, *,
                 device: torch.device | str = "cpu", stream: bool = False, source: dict | None = None):
        self.variant = dict(variant or {})
        knobs = expand_presets(self.variant)
        self.spec = apply_overrides(spec, knobs)
        self.strategies = resolve_strategies(knobs, self.spec)
        self.device = torch.device(device)
        weights = self.strategies.weights(weights, source)  # source: config.json's tracer_source (the GGUF)
        self.weights = prepare_weights(self.spec, weights, self.strategies.dtype, self.device, stream)
        self.unused_tensors = unused_tensors(self.spec, weights)
        self.layers = [Prefixed(self.weights, f"model.layers.{i}.") for i in range(self.spec.num_hidden_layers)]

    @classmethod
    def from_config(cls, config: dict, weights: Mapping[str, torch.Tensor], variant: dict | None = None,
                    **placement) -> Llama:
        """From a config.json dict, read by the variant's reader (`config`, `resave` knobs)."""
        return cls(read_config(config, expand_presets(variant or {})), weights, variant,
                   source=config.get("tracer_source"), **placement)

    @classmethod
    def from_dir(cls, model_dir: str | Path, variant: dict | None = None, **placement) -> Llama:
        """`placement`: `device`, and `stream=True` to read each block's weights from the files when it runs."""
        from tracer.weights import WeightFiles, read_weights

        weights = WeightFiles(model_dir) if placement.get("stream") else read_weights(model_dir)
        return cls.from_config(load_config(model_dir), weights, variant, **placement)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, record: Recorder | None = None) -> torch.Tensor:
        """tokens (T,) int64 -> logits (T, V) ((1, V) with logits=last); every point goes to `record`."""
        record = record or _no_record
        spec, w, strategies = self.spec, self.weights, self.strategies
        ids = tokens.to(self.device)[None]  # (1, T)
        h = strategies.embed(ids, w["model.embed_tokens.weight"], spec)  # (1, T, C)
        record("model.embed_tokens", h)
        for i, (layer, positions) in enumerate(zip(self.layers, layer_positions(spec, strategies, ids.shape[1],
                                                                                h.dtype, self.device))):
            h = decoder_layer(h, layer, spec, positions, strategies, f"model.layers.{i}", record)
        h = strategies.norm(h, w["model.norm.weight"], spec.rms_norm_eps)
        record("model.norm", h)
        logits = strategies.logits(h, w["lm_head.weight"])  # (1, T, V), or (1, 1, V) for logits=last
        record("lm_head", logits)
        if spec.final_logit_softcapping is not None:  # Gemma 2: the capped logits, a virtual point under lm_head
            logits = strategies.softcap(logits, spec.final_logit_softcapping)
            record(FINAL_LOGITS, logits)
        return logits[0]


# --- weights ---------------------------------------------------------------------------------


def expected_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the spec needs, with its shape (HF names, as in the safetensors files)."""
    family = families.get(spec.family)
    c, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * d, spec.num_key_value_heads * d
    norms = [name for pair in family.norms for name in pair if name]
    qk_norms = {"none": {}, "per_head": {"q_norm": (d,), "k_norm": (d,)},
                "per_head_heads_first": {"q_norm": (d,), "k_norm": (d,)},
                "whole": {"q_norm": (q_out,), "k_norm": (kv_out,)}}[family.qk_norm]
    projections = ({"qkv_proj": (q_out + 2 * kv_out, c)} if family.projections == "fused"
                   else {"q_proj": (q_out, c), "k_proj": (kv_out, c), "v_proj": (kv_out, c)})
    gate_up = {"gate_up_proj": (2 * i, c)} if family.mlp == "fused" else {"gate_proj": (i, c), "up_proj": (i, c)}
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, c)}
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {p + f"{name}.weight": (c,) for name in norms}
        shapes |= {p + f"self_attn.{name}.weight": shape for name, shape in projections.items()}
        shapes |= {p + f"self_attn.{name}.weight": shape for name, shape in qk_norms.items()}
        shapes[p + "self_attn.o_proj.weight"] = (c, q_out)
        shapes |= {p + f"mlp.{name}.weight": shape for name, shape in gate_up.items()}
        shapes[p + "mlp.down_proj.weight"] = (c, i)
        if spec.attention_bias or spec.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                       p + "self_attn.v_proj.bias": (kv_out,)}
        if spec.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c,)
        if spec.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (c,)}
    shapes["model.norm.weight"] = (c,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, c)
    return shapes


def check_weights(spec: LlamaSpec, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor the spec needs is there with its shape (read from the headers for weight
    files); a missing or misshapen tensor, or an activation we lack, is a TracerError."""
    if spec.hidden_act not in ACTIVATIONS:
        raise TracerError(f"hidden_act {spec.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    shapes = tensors.shapes() if hasattr(tensors, "shapes") else {name: tuple(t.shape) for name, t in tensors.items()}
    for name, shape in expected_shapes(spec).items():
        if name not in shapes:
            raise TracerError(f"missing tensor {name} (expected shape {shape})")
        if shapes[name] != shape:
            raise TracerError(f"shape mismatch for {name}: expected {shape}, file has {shapes[name]}")


def prepare_weights(spec: LlamaSpec, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                    device: torch.device, stream: bool) -> Mapping[str, torch.Tensor]:
    """The spec's tensors in `dtype` on `device`, `lm_head.weight` tied to the embedding where the
    config says so: converted now, or (`stream`) on every access."""
    check_weights(spec, tensors)
    names = {name: name for name in expected_shapes(spec)}
    if spec.tie_word_embeddings:
        names["lm_head.weight"] = "model.embed_tokens.weight"
    if stream:
        return StreamedWeights(tensors, names, dtype, device)
    converted = {name: tensors[name].to(dtype=dtype, device=device) for name in expected_shapes(spec)}
    return {name: converted[source] for name, source in names.items()}


class StreamedWeights:
    """name -> tensor, read from the (memory-mapped) files and converted on every access: a forward
    holds the weights of the op it runs, at the price of reading them once per forward."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: dict[str, str], dtype: torch.dtype,
                 device: torch.device):
        self.tensors, self.names, self.dtype, self.device = tensors, names, dtype, device

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.names[name]].to(dtype=self.dtype, device=self.device)

    def get(self, name: str, default=None):
        return self[name] if name in self.names else default


def unused_tensors(spec: LlamaSpec, tensors: dict) -> list[str]:
    """Tensors in the files that this spec does not use (e.g. biases a config says are absent)."""
    needed = set(expected_shapes(spec)) | {"lm_head.weight"}
    return sorted(name for name in tensors if name not in needed and not name.endswith("rotary_emb.inv_freq"))
