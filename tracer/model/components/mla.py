"""Multi-head latent attention (DeepSeek-V3's MLA): the queries through a low-rank latent (q_a_proj,
q_a_layernorm, q_b_proj; one q_proj where `q_lora_rank` is null), the keys and values through one shared
latent (kv_a_proj_with_mqa, whose last `qk_rope_head_dim` values are k's RoPE part, shared by every head;
kv_a_layernorm; kv_b_proj into each head's non-RoPE key and value), RoPE on the RoPE parts only.

Mirrors transformers 5.25's `DeepseekV3Attention` op by op (`models/deepseek_v3/modeling_deepseek_v3.py`):
each query head is split [qk_nope_head_dim | qk_rope_head_dim]; RoPE in DeepSeek's interleaved pairs
(`rope_interleave`, true by default: pairs (x0, x1), (x2, x3), ... rotated, the results laid out evens then
odds) or transformers' half split; q = [q_nope | q_rot], k = [k_nope | k_rot]; eager attention scaled by
qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)² where the RoPE scaling is YaRN's
(`yarn_apply_mscale`); v's heads of v_head_dim into o_proj. Its latent norms use transformers' default eps,
1e-6, whatever rms_norm_eps says.

Notation: T tokens, H heads, N qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim, Lq q_lora_rank,
Lkv kv_lora_rank, C hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracer.core.errors import TracerError
from tracer.core.lazy import torch
from tracer.model import kv_cache
from tracer.model.component import Component, ConfigField, Point
from tracer.model.components.attention import (
    Visible,
    attention_eager,
    mask_additive,
    repeat_kv,
    window_of_layer,
)
from tracer.model.components.rope import ROPE_SCALING, SCALING_KNOBS, Rope, rope_half, yarn_mscale
from tracer.model.config import check
from tracer.model.knobs import Knob, choice, fixed, setting
from tracer.model.points import (
    ATTENTION,
    CACHE_K,
    CACHE_V,
    CONTEXT,
    K_NOPE,
    K_PE,
    K_ROPE,
    KV_A_PROJ,
    KV_LATENT,
    O_PROJ,
    PROBS,
    Q_A_PROJ,
    Q_B_PROJ,
    Q_LATENT,
    Q_PROJ,
    Q_ROPE,
    SCORES,
    WEIGHT,
)

LATENT_EPS = 1e-6  # DeepseekV3RMSNorm(q_lora_rank) and (kv_lora_rank): transformers' default, not rms_norm_eps

MLA_SPLIT = Knob("mla_split", choice("nope_first", "rope_first"), "nope_first | rope_first", "nope_first",
                 "each query head split RoPE part first: the rotation applied to the first qk_rope_head_dim "
                 "values instead of the last (MLA's RoPE and non-RoPE parts swapped)", fixed("mla_split=rope_first"),
                 expected=f"layers.0.{Q_ROPE}", kind="semantic", after="qk_norm")


def rope_deepseek_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb_interleave`: pairs (x0, x1), (x2, x3), ... each rotated by one
    frequency, the rotated evens then the rotated odds. x (1, heads, T, R), cos/sin (1, T, R)."""
    cos, sin = cos[..., : cos.shape[-1] // 2][:, None], sin[..., : sin.shape[-1] // 2][:, None]  # (1, 1, T, R/2)
    even, odd = x[..., 0::2], x[..., 1::2]  # (1, heads, T, R/2) each
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)  # (1, heads, T, R)


def split_nope_first(q: torch.Tensor, nope: int, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, H, T, N + R) -> q_nope (1, H, T, N), q_rot (1, H, T, R)."""
    q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
    return q_pass, q_rot


def split_rope_first(q: torch.Tensor, nope: int, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A port that rotates each head's first R values and passes the rest."""
    q_rot, q_pass = torch.split(q, [rope, nope], dim=-1)
    return q_pass, q_rot


def mla_softmax_scale(spec) -> float:
    """transformers: qk_head_dim^-0.5, folded with YaRN's mscale(factor, mscale_all_dim)² (`yarn_apply_mscale`)."""
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** (-0.5)
    scaling = spec.rope_scaling
    if scaling is not None and scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


@dataclass(frozen=True)
class MLARope(Rope):
    """RoPE as MLA applies it: on the RoPE parts (qk_rope_head_dim, the config's head_dim), in DeepSeek's
    interleaved pairs where `rope_interleave` (true by default), else transformers' half split. candle's
    `rope=interleaved` is not a knob here: the layout is the config's."""

    @property
    def knobs(self) -> tuple:
        return (ROPE_SCALING, *SCALING_KNOBS)

    def steps(self, knobs: dict, spec) -> dict:
        steps = super().steps(knobs, spec)
        interleaved = spec is None or spec.rope_interleave
        return {**steps, "rope": rope_deepseek_interleaved if interleaved else rope_half}


@dataclass(frozen=True)
class LatentAttention(Component):
    """DeepSeek-V3's multi-head latent attention (its config's q_lora_rank, kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim, rope_interleave); `rope`: its RoPE (theta, scaling) as `Rope` reads it."""

    rope: Rope = field(default_factory=MLARope)
    window = None  # MLA has no sliding window (transformers' DeepseekV3Model builds one causal mask)

    knobs = (MLA_SPLIT,)
    config_fields = (ConfigField("q_lora_rank", 1536, "optional_positive_int"), ConfigField("kv_lora_rank", 512),
                     ConfigField("qk_nope_head_dim", 128), ConfigField("qk_rope_head_dim", 64),
                     ConfigField("v_head_dim", 128), ConfigField("rope_interleave", True, "bool"),
                     ConfigField("attention_bias", False, "bool"))

    @property
    def output(self) -> str:
        return O_PROJ

    def parts(self) -> tuple[Component, ...]:
        return (self.rope,)

    def read_config(self, config: dict) -> dict:
        read = {f.key: check(f.kind, f.key, config.get(f.key, f.default)) for f in self.config_fields}
        if read["attention_bias"]:
            raise TracerError("config.json: attention_bias is set; tracer's MLA forward has no projection biases yet")
        heads = config["num_attention_heads"]
        if config.get("num_key_value_heads", heads) not in (None, heads):  # transformers' MLA repeats no kv head
            raise TracerError(f"config.json: num_key_value_heads {config['num_key_value_heads']} is not "
                              f"num_attention_heads {heads}: MLA gives every head its own key and value")
        if config.get("head_dim", read["qk_rope_head_dim"]) != read["qk_rope_head_dim"]:
            raise TracerError(f"config.json: head_dim {config['head_dim']} is not qk_rope_head_dim "
                              f"{read['qk_rope_head_dim']} (transformers sets it so: RoPE's width)")
        return read

    def records_on(self, spec, layer: int, point: str) -> bool:
        """One q_proj where q_lora_rank is null, else the low-rank query's three points."""
        if point == Q_PROJ:
            return spec.q_lora_rank is None
        return point not in (Q_A_PROJ, Q_LATENT, Q_B_PROJ) or spec.q_lora_rank is not None

    def points(self, source: str) -> tuple[Point, ...]:
        return (Point(Q_PROJ, "q_proj", "merged", "projection", "the queries (q_lora_rank null), each head's "
                      "non-RoPE part first", source),
                Point(Q_A_PROJ, "q_a_proj", "rows", "projection", "the query's down-projection (T, q_lora_rank)",
                      source),
                Point(Q_LATENT, "q_latent", "rows", "norm", "the latent q: q_a_proj RMS-normed (eps 1e-6)",
                      Q_A_PROJ),
                Point(Q_B_PROJ, "q_b_proj", "merged", "projection", "the queries from the latent q, each head "
                      "[non-RoPE | RoPE]", Q_LATENT),
                Point(KV_A_PROJ, "kv_a_proj", "rows", "projection", "the latent kv and k's shared RoPE part "
                      "(T, kv_lora_rank + qk_rope_head_dim)", source),
                Point(K_PE, "k_pe", "rows", "projection", "k's RoPE part before RoPE, shared by every head (the "
                      "last qk_rope_head_dim values of kv_a_proj_with_mqa)", KV_A_PROJ, f"within:{ATTENTION}:split2.1"),
                Point(KV_LATENT, "kv_latent", "rows", "norm", "the latent kv: the first kv_lora_rank values of "
                      "kv_a_proj_with_mqa RMS-normed (eps 1e-6)", KV_A_PROJ),
                Point(K_NOPE, "k_nope", "heads", "projection", "k's non-RoPE part per head, kv_b_proj of the latent "
                      "kv (H, T, qk_nope_head_dim)", KV_LATENT, f"within:{ATTENTION}:split3.0"),
                Point(Q_ROPE, "q_rope", "heads", "rope", "queries [non-RoPE | RoPE part rotated] (H, T, N + R)",
                      Q_B_PROJ, "attention"),
                Point(K_ROPE, "k_rope", "heads", "rope", "keys [non-RoPE | shared RoPE part rotated] (H, T, N + R)",
                      K_NOPE, "attention"),
                Point(SCORES, "scores", "attention", "scores", "q·kᵀ·scale before softmax (scale qk_head_dim^-0.5, "
                      "YaRN's mscale² where it scales)", Q_ROPE, "attention"),
                Point(PROBS, "probs", "attention", "softmax", "softmax of the masked scores", SCORES, "attention"),
                Point(CONTEXT, "context", "merged", "attention", "probs·v, heads merged (H·v_head_dim)", PROBS,
                      "attention"),
                Point(O_PROJ, "o_proj", "rows", "projection", "attention output", CONTEXT))

    def weights(self, spec) -> dict:
        c, h = spec.hidden_size, spec.num_attention_heads
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank is None:
            shapes = {Q_PROJ + WEIGHT: (h * qk, c)}
        else:
            shapes = {Q_A_PROJ + WEIGHT: (spec.q_lora_rank, c), Q_LATENT + WEIGHT: (spec.q_lora_rank,),
                      Q_B_PROJ + WEIGHT: (h * qk, spec.q_lora_rank)}
        kv_b = "self_attn.kv_b_proj"
        return {**shapes, KV_A_PROJ + WEIGHT: (spec.kv_lora_rank + spec.qk_rope_head_dim, c),
                KV_LATENT + WEIGHT: (spec.kv_lora_rank,),
                kv_b + WEIGHT: (h * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
                O_PROJ + WEIGHT: (c, h * spec.v_head_dim)}

    def steps(self, knobs: dict, spec) -> dict:
        if spec is not None and spec.head_dim != spec.qk_rope_head_dim:  # a head_dim knob: nothing MLA reads
            raise TracerError(f"head_dim={spec.head_dim}: MLA's heads are qk_nope_head_dim + qk_rope_head_dim "
                              "(keys), v_head_dim (values)")
        scale = None if spec is None else mla_softmax_scale(spec)
        return {**kv_cache.steps(knobs, spec),  # the cache as every attention keeps it (the latent kv and k_pe here)
                "window": window_of_layer,  # no layer slides: how a cache is laid out
                "attention": attention_eager,  # transformers' eager attention, on MLA's keys and scale
                "mla_split": split_rope_first if setting(knobs, "mla_split") == "rope_first" else split_nope_first,
                # transformers' eager attention multiplies by the module's scaling
                "mla_scale": lambda scores, dim: scores * scale}

    def forward(self, x: torch.Tensor, run) -> torch.Tensor:
        """x (1, T, C) -> (1, T, C), recording the latents, k's parts, RoPE, scores, probs, context, output."""
        spec, steps, w = run.spec, run.steps, run.weights
        if run.positions.real is not None:
            raise TracerError("tracer's MLA forward runs one unpadded prompt at a time (no batch of padded prompts)")
        batch, tokens, _ = x.shape
        nope, rope, heads = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.num_attention_heads
        if spec.q_lora_rank is None:
            q = steps.linear(x, w[Q_PROJ + WEIGHT])  # (1, T, H·(N + R))
            run.record(Q_PROJ, q)
        else:
            q = steps.linear(x, w[Q_A_PROJ + WEIGHT])  # (1, T, Lq)
            run.record(Q_A_PROJ, q)
            q = steps.norm(q, w[Q_LATENT + WEIGHT], LATENT_EPS)  # (1, T, Lq)
            run.record(Q_LATENT, q)
            q = steps.linear(q, w[Q_B_PROJ + WEIGHT])  # (1, T, H·(N + R))
            run.record(Q_B_PROJ, q)
        q = q.view(batch, tokens, -1, nope + rope).transpose(1, 2)  # (1, H, T, N + R)
        q_pass, q_rot = steps.mla_split(q, nope, rope)  # (1, H, T, N), (1, H, T, R)
        compressed = steps.linear(x, w[KV_A_PROJ + WEIGHT])  # (1, T, Lkv + R)
        run.record(KV_A_PROJ, compressed)
        latent, k_rot = torch.split(compressed, [spec.kv_lora_rank, rope], dim=-1)  # (1, T, Lkv), (1, T, R)
        run.record(K_PE, k_rot)
        latent = steps.norm(latent, w[KV_LATENT + WEIGHT], LATENT_EPS)  # (1, T, Lkv)
        run.record(KV_LATENT, latent)
        latent = latent.view(batch, 1, tokens, spec.kv_lora_rank)  # (1, 1, T, Lkv)
        k_rot = k_rot.view(batch, 1, tokens, rope)  # (1, 1, T, R)
        cos, sin = run.positions.tables("full_attention")  # (1, T, R) each
        q_rot, k_rot = steps.rope(q_rot, cos, sin), steps.rope(k_rot, cos, sin)
        queries = keys = run.positions.positions  # (T,)
        if run.cache is not None:  # transformers caches the latent kv and k's rotated RoPE part, S tokens so far
            if steps.cache_store is not None:  # a regime's cache format (kv_cache=f16), on what MLA caches
                latent, k_rot = steps.cache_store(latent), steps.cache_store(k_rot)
            latent, k_rot, keys = run.cache.update(run.index, latent, k_rot, queries)  # (1, 1, S, Lkv), (1, 1, S, R)
        q = torch.cat((q_pass, q_rot), dim=-1)  # (1, H, T, N + R)
        held = latent.shape[2]  # S: T without a cache
        kv = steps.linear(latent, w["self_attn.kv_b_proj" + WEIGHT])  # (1, 1, S, H·(N + V))
        kv = kv.view(batch, held, -1, nope + spec.v_head_dim).transpose(1, 2)  # (1, H, S, N + V)
        k_nope, v = torch.split(kv, [nope, spec.v_head_dim], dim=-1)  # (1, H, S, N), (1, H, S, V)
        run.record(K_NOPE, k_nope)
        k = kv.new_empty(*kv.shape[:-1], nope + rope)  # (1, H, S, N + R), filled as transformers fills it
        k[..., :nope].copy_(k_nope)
        k[..., nope:].copy_(k_rot.expand(-1, heads, -1, -1))
        run.record(Q_ROPE, q)
        run.record(K_ROPE, k[:, :, -tokens:])  # this forward's own keys, as hf's attention function records them
        if run.cache is not None:  # what attention reads of the cache: every key and value so far
            run.record(CACHE_K, k)
            run.record(CACHE_V, v)
        context = steps.attention(q, k, v, spec, _EagerSteps(steps), run.record, Visible(queries, keys))  # (1, H, T, V)
        context = context.transpose(1, 2).contiguous().reshape(batch, tokens, -1)  # (1, T, H·V)
        run.record(CONTEXT, context)
        out = steps.linear(context, w[O_PROJ + WEIGHT])  # (1, T, C)
        run.record(O_PROJ, out)
        return out


class _EagerSteps:
    """What `attention_eager` reads of the steps, as transformers' eager attention does it for MLA: every head
    its own key (no repeat), the module's scaling, the additive causal mask, no soft-cap, the model's dtype."""

    attention_dtype = None

    def __init__(self, steps):
        self.scale_scores = steps.mla_scale

    @staticmethod
    def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
        return repeat_kv(x, 1)

    @staticmethod
    def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
        return x

    @staticmethod
    def mask(scores: torch.Tensor, visible: Visible | None = None) -> torch.Tensor:
        return mask_additive(scores, visible)
