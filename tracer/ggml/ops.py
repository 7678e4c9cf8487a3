"""RMSNorm, RoPE, SwiGLU and attention as llama.cpp's CPU backend computes them (ggml-cpu/ops.cpp,
vec.h, vec.cpp, simd-gemm.h), for x86 with AVX-512F/DQ or AVX2/FMA (a `GGML_NATIVE` build by GCC 12):
the two differ in `ggml_v_expf` and in the lanes of their vectors (`f32_lanes`: 16 or 8), which decide
the sums of the f16 and f32 dot products, of softmax and the vector part of SwiGLU.

What the build's code is, is read from its feature report and the CPU (`llamacpp_cpu_features`):
AVX512_BF16 (`_mm512_dpbf16_ps`), LLAMAFILE (tinyBLAS), AVX512_FP16 (f16 arithmetic in flash
attention's accumulator, from 128 columns) and ZNVER (GCC's tuning for AMD Zen: RoPE's pairs
vectorised 4 at a time, loop accumulators not fused). Measured against llama.cpp on an Intel Xeon,
an AMD EPYC with AVX-512 (Zen 4) and one without (Zen 3, AVX2), every path but AVX512-FP16's
(docs/regimes.md).

Shapes as in `tracer.reimpl.forward`: x (1, T, C); q (1, H, T, D), k/v (1, KV, T, D) in HF's half-split
order. ggml holds q/k rows in GGUF's interleaved order; where that order decides a summation
(the q·k dot products) the functions below permute to it first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import numpy as np
import torch

from tracer.core.errors import TracerError
from tracer.ggml.floats import (
    F32,
    F64,
    exp_constants,
    expf,
    fma,
    fma_f16,
    ggml_v_expf,
    ggml_v_silu,
    hsum8,
    libm,
    powf,
    rdiv,
    reduce_add16,
    round_bf16,
    round_f16,
    silu_scalar,
)
from tracer.model.points import PROBS, SCORES
from tracer.traces.layouts import to_interleaved

SIMD_F32 = 16  # f32 lanes of an AVX-512 register (GGML_F32_EPR)
F16_DOT_STEP = 64  # GGML_F16_STEP: 4 registers of 16 lanes per step of ggml_vec_dot_f16 (AVX2: 4 of 8)
FA_TILE = 64  # GGML_FA_TILE_Q = GGML_FA_TILE_KV
F16_NATIVE_STEP = 128  # GGML_F16_STEP with AVX512-FP16: 4 registers of 32 f16 lanes


# --- RMSNorm ----------------------------------------------------------------------------------


def sequential_sum_f64(values: torch.Tensor) -> torch.Tensor:
    """(..., C) f64 -> (...): a left-to-right f64 sum, as a C loop `sum += x[i]` computes it."""
    return (torch.from_numpy(np.cumsum(values.detach().to("cpu", F64).numpy(), axis=-1)[..., -1].copy())
            .to(values.device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml_compute_forward_rms_norm_f32 (+ the fused MUL): squares in f32, summed left to right in
    f64, mean = f32(sum / C), scale = 1.0f / sqrtf(mean + eps) in f32 (IEEE sqrt: taken in f64 and
    rounded, which is exact for a square root), y = (x * scale) * w."""
    x32 = x.to(F32)
    total = sequential_sum_f64((x32 * x32).to(F64))  # (1, T)
    mean = (total / x32.shape[-1]).to(F32)
    root = torch.sqrt((mean + np.float32(eps)).to(F64)).to(F32)
    scale = rdiv(1.0, root)[..., None]  # (1, T, 1)
    return (x32 * scale) * weight.to(F32)


# --- RoPE -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _rope_angles(positions: tuple[int, ...], n_dims: int, base: float,
                 freq_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, D/2) cos, sin as ggml_rope_cache_init computes them: theta starts at the position (f32)
    and is multiplied by theta_scale = powf(base, -2.0f/n_dims) once per pair, in f32; then
    cosf/sinf of the C library (scaled by freq_scale, which is 1 without rope scaling)."""
    theta_scale = np.float32(powf(base, float(np.float32(-2.0) / np.float32(n_dims))))
    theta = np.array(positions, dtype=np.float32)  # (T,)
    angles = np.empty((len(positions), n_dims // 2), dtype=np.float32)
    for i in range(n_dims // 2):
        angles[:, i] = np.float32(freq_scale) * theta
        theta = (theta * theta_scale).astype(np.float32)
    table = torch.from_numpy(angles)
    return libm("cosf", table), libm("sinf", table)


def rope_cos_sin(spec, positions: torch.Tensor, dtype: torch.dtype | None, device="cpu",
                 layer_type: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:
    """(1, T, D/2) cos and sin for `rope` below at absolute `positions` (T,), from the spec's theta (and
    linear scaling); f32 whatever `dtype` (ggml computes RoPE in f32); a sliding layer of a model with a
    local base (Gemma 3) takes that base, as llama.cpp's get_rope_freq_base does.

    Raises:
        TracerError: a rope scaling ggml's normal-mode RoPE is not emulated for (llama3: freq factors).
    """
    scaling = spec.rope_scaling
    if scaling is not None and scaling.get("rope_type") != "linear":
        raise TracerError(f"rope_type {scaling.get('rope_type')!r} is not emulated by the ggml regime "
                          "(default, linear)")
    freq_scale = 1.0 / scaling["factor"] if scaling else 1.0
    local = layer_type == "sliding_attention" and spec.rope_local_theta is not None  # Gemma 3's rope.freq_base_swa
    theta = spec.rope_local_theta if local else spec.rope_theta
    cos, sin = _rope_angles(tuple(positions.tolist()), spec.rotary_dim, float(np.float32(theta)), freq_scale)
    return cos[None].to(device), sin[None].to(device)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         features: frozenset[str] | None = None) -> torch.Tensor:
    """ggml RoPE, normal mode (rotate_pairs, ops.cpp): pair (x0, x1) = GGUF rows (2i, 2i+1), which
    are HF's dims (i, i + D/2). GCC vectorises the loop over pairs: those in whole vectors of its
    epilogue (`rope_fused_pairs`) take vfmaddsub, y0 = fma(x0, c, -(x1*s)) and y1 = fma(x0, s, x1*c);
    the last few a 64-bit vaddsubps of products each rounded, y0 = x0*c - x1*s, y1 = x0*s + x1*c.
    x (1, heads, T, D), cos/sin (1, T, D/2); `features`: the build's (default: this one's)."""
    features = llamacpp_cpu_features() if features is None else features
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half].to(F32), x[..., half:].to(F32)  # (1, heads, T, D/2) each
    c, s = cos[:, None], sin[:, None]  # (1, 1, T, D/2)
    fused = torch.arange(half) < rope_fused_pairs(half, features)  # (D/2,)
    y0 = torch.where(fused, fma(x0, c, -(x1 * s)), x0 * c - x1 * s)
    y1 = torch.where(fused, fma(x0, s, x1 * c), x0 * s + x1 * c)
    return torch.cat((y0, y1), dim=-1)  # (1, heads, T, D)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              features: frozenset[str] | None = None) -> torch.Tensor:
    """ggml RoPE, NEOX mode (rotate_pairs with n_offset = n_dims/2: Qwen, Gemma, Phi-3, OLMo-2): pair
    (x0, x1) = dims (i, i + D/2), HF's own order. Every pair takes FMAs, y0 = fma(x0, c, -(x1*s)) and
    y1 = fma(x0, s, x1*c): contiguous loads, no vaddsubps tail (measured on Qwen3, head size 12, bit
    for bit). Phi-3's partial rotary: the first R = n_rot dims rotate, pairs (i, i + R/2), the rest pass
    (ggml copies them). x (1, heads, T, D), cos/sin (1, T, R/2); `features` unused (every build alike)."""
    half = cos.shape[-1]
    x0, x1 = x[..., :half].to(F32), x[..., half:2 * half].to(F32)  # (1, heads, T, R/2) each
    c, s = cos[:, None], sin[:, None]  # (1, 1, T, R/2)
    rest = x[..., 2 * half:].to(F32)  # (1, heads, T, D - R)
    return torch.cat((fma(x0, c, -(x1 * s)), fma(x0, s, x1 * c), rest), dim=-1)  # (1, heads, T, D)


def rope_fused_pairs(pairs: int, features: frozenset[str]) -> int:
    """How many of a head's `pairs` rotate_pairs computes with FMAs: those in whole vectors of the
    vectorised loop's last, narrowest part (4 pairs on a build that vectorises in 512 bits, whose
    epilogue is 256; else 2, a 256-bit loop's 128-bit epilogue); the rest are left to a 64-bit
    (one-pair) vaddsubps, which GCC 12 does not fuse. Measured on builds for Zen 4 (native), Sapphire
    Rapids, Skylake-AVX512, Haswell and Zen 1-3 at head sizes 2 to 128."""
    return pairs - pairs % (4 if vectorises_in_512_bits(features) else 2)


def rope_exact(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation with each output rounded once from f64 (the accumulate=f64 variant)."""
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half].to(F64), x[..., half:].to(F64)
    c, s = cos[:, None].to(F64), sin[:, None].to(F64)
    return torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).to(F32)


# --- SwiGLU -----------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor, features: frozenset[str] | None = None) -> torch.Tensor:
    """ggml_vec_swiglu_f32 per row: ggml_v_silu(gate) * up on whole vectors (16 lanes, AVX2 8), the
    scalar ggml_silu_f32 (libm expf) on a row's last values. gate/up (1, T, I); `features`: the
    build's (default: this one's)."""
    features = llamacpp_cpu_features() if features is None else features
    width = gate.shape[-1] - gate.shape[-1] % f32_lanes(features)
    vector = ggml_v_silu(gate[..., :width], avx512_exp(features)) * up[..., :width].to(F32)
    if width == gate.shape[-1]:
        return vector
    return torch.cat((vector, silu_scalar(gate[..., width:]) * up[..., width:].to(F32)), dim=-1)


def swiglu_exact(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in f64, rounded once."""
    g = gate.to(F64)
    return (g / (1 + torch.exp(-g)) * up.to(F64)).to(F32)


def swiglu_f32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch's f32 silu(gate) * up."""
    return torch.nn.functional.silu(gate.to(F32)) * up.to(F32)


SWIGLU = {"ggml": swiglu, "f32": swiglu_f32, "f64": swiglu_exact}


# --- GeGLU and soft-capping (Gemma 2) ------------------------------------------------------------

GELU_COEF_A, SQRT_2_OVER_PI = np.float32(0.044715), np.float32(0.79788456080286535587989211986876)


@functools.lru_cache(maxsize=1)
def gelu_table() -> torch.Tensor:
    """(65536,) ggml_table_gelu_f16 as f32: for every f16 bit pattern x, f16(ggml_gelu_f32(x)) with
    ggml_gelu_f32 = 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))), GCC contracting
    1.0f + (A*x)*x into one FMA (ggml-cpu.c fills it at init)."""
    x = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32))  # (65536,)
    inner = fma(GELU_COEF_A * x, x, torch.ones_like(x))
    t = libm("tanhf", torch.nan_to_num(SQRT_2_OVER_PI * x * inner))
    return round_f16((np.float32(0.5) * x) * (1.0 + t))


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """ggml_vec_geglu_f32 (GGML_GELU_FP16, vec.h): gelu(gate) from the table at f16(gate), 0 below -10,
    gate itself from 10 on, times up in f32."""
    x, g = gate.to(F32), up.to(F32)
    bits = round_f16(x).to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF  # the table's index
    gelu = torch.where(x <= -10.0, 0.0, torch.where(x >= 10.0, x, gelu_table()[bits]))
    return gelu * g


def softcap_logits(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's final soft-capping in llama.cpp: ggml_scale by 1.0f/cap, ggml_tanh (tanhf), ggml_scale
    by cap, each in f32."""
    if cap is None:
        return x
    cap32 = np.float32(cap)
    return libm("tanhf", x.to(F32) * (np.float32(1.0) / cap32)) * cap32


# --- attention --------------------------------------------------------------------------------


def f32_lanes(features: frozenset[str]) -> int:
    """GGML_F32_EPR of a build with these features: 16 f32 lanes with AVX-512, else 8 (AVX2)."""
    return SIMD_F32 if "AVX512" in features else SIMD_F32 // 2


def avx512_exp(features: frozenset[str]) -> bool:
    """Whether the build's ggml_v_expf is the AVX-512F/DQ variant (else AVX2's; `floats.ggml_v_expf`)."""
    return "AVX512" in features


def reduce_lanes(v: torch.Tensor) -> torch.Tensor:
    """(..., 16) -> (...) `_mm512_reduce_add_ps`, or (..., 8) -> (...) GGML_F32x8_REDUCE's last steps:
    the halves added, then two `_mm_hadd_ps`: ((v0+v4) + (v1+v5)) + ((v2+v6) + (v3+v7))."""
    if v.shape[-1] == SIMD_F32:
        return reduce_add16(v)
    t = v[..., :4] + v[..., 4:]  # (..., 4)
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])


def vec_dot_f16(x: torch.Tensor, y: torch.Tensor, features: frozenset[str] | None = None) -> torch.Tensor:
    """ggml_vec_dot_f16 (vec.cpp, AVX-512F without FP16, or AVX2): x (..., D), y (..., D) f16 values
    held in f32, broadcast against each other -> (...). Four f32 accumulators of 16 lanes (AVX2: 8) take
    one FMA per 64 values (32); reduced (a0+a2) + (a1+a3), then across the lanes (`reduce_lanes`);
    values past the last whole step are added in f64 one by one."""
    lanes = f32_lanes(llamacpp_cpu_features() if features is None else features)
    step = 4 * lanes
    width = x.shape[-1] - x.shape[-1] % step
    acc = None
    for start in range(0, width, step):
        xs = x[..., start:start + step].unflatten(-1, (4, lanes))  # (..., 4, lanes)
        ys = y[..., start:start + step].unflatten(-1, (4, lanes))
        acc = xs * ys if acc is None else fma(xs, ys, acc)  # the first FMA adds to 0: the exact product
    if acc is None:
        total = torch.zeros(torch.broadcast_shapes(x.shape[:-1], y.shape[:-1]), dtype=F64)
    else:
        total = reduce_lanes((acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])).to(F64)
    for i in range(width, x.shape[-1]):
        total = total + (x[..., i] * y[..., i]).to(F64)
    return total.to(F32)


def vec_dot_f32(x: torch.Tensor, y: torch.Tensor, features: frozenset[str] | None = None) -> torch.Tensor:
    """ggml_vec_dot_f32 (vec.cpp, AVX-512 or AVX2): the register scheme of `vec_dot_f16` on f32 values
    (an FMA per step), but an f32 total: the values past the last whole step are added to it in f32 one
    by one, each product rounded first (GCC vectorizes that loop as an in-order reduction, so the
    multiply is not fused; measured against llama.cpp)."""
    lanes = f32_lanes(llamacpp_cpu_features() if features is None else features)
    step = 4 * lanes
    width = x.shape[-1] - x.shape[-1] % step
    shape = torch.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    acc = None
    for start in range(0, width, step):
        xs = x[..., start:start + step].unflatten(-1, (4, lanes))  # (..., 4, lanes)
        ys = y[..., start:start + step].unflatten(-1, (4, lanes))
        acc = xs * ys if acc is None else fma(xs, ys, acc)
    if acc is None:
        total = torch.zeros(shape, dtype=F32)
    else:
        total = reduce_lanes((acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :]))
    for i in range(width, x.shape[-1]):
        total = total + x[..., i] * y[..., i]
    return total


def attention_scale(head_dim: int) -> float:
    """llama's kq_scale: 1.0f/sqrtf(float(n_embd_head)), in f32."""
    return float(np.float32(1.0) / np.float32(math.sqrt(np.float32(head_dim))))


def kv_for_heads(k: torch.Tensor, heads: int) -> torch.Tensor:
    """(KV, T, D) -> (H, T, D): query head h reads kv head h // (H/KV) (ggml's ik2 = iq2 / rk2)."""
    return k.repeat_interleave(heads // k.shape[0], dim=0)


def dot_exact(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The dot product over the last axis in f64 (f16 values: exact products), rounded to f32 once."""
    return (x.to(F64) * y.to(F64)).sum(-1).to(F32)


def causal(queries: int, keys: int) -> torch.Tensor:
    """(T, S) bool, True where a query may attend: the T queries are the last of the S keys' positions
    (a prefill: T = S; a cached decode step: the new token after the S - 1 cached ones)."""
    return torch.arange(keys - queries, keys)[:, None] >= torch.arange(keys)[None, :]


def online_softmax_factors(scores: torch.Tensor, allowed: torch.Tensor):
    """The one-chunk loop's online softmax for every key at once: scores (H, T, S), allowed (T, S) ->
    visible, new_max (bool), ms, vs (f32), each (H, T, S). The running maximum before a key is the
    cumulative maximum of the visible scores before it; a visible key above it is a new maximum
    (ms = expf(M_old - s), vs = 1), any other visible key weighs vs = expf(s - M) (ms = 1). The same
    expf calls on the same operands as the loop over keys, in two calls instead of two per key."""
    visible = allowed[None].expand(scores.shape)  # (H, T, S)
    through = torch.cummax(torch.where(visible, scores, float("-inf")), dim=-1).values  # (H, T, S)
    best = torch.cat([torch.full_like(through[..., :1], float("-inf")), through[..., :-1]], dim=-1)  # M before each
    new_max = visible & (scores > best)
    kept = visible & ~new_max
    ms = torch.where(new_max, expf(torch.where(new_max, best - scores, 0.0)), 1.0)
    vs = torch.where(kept, expf(torch.where(kept, scores - best, 0.0)), 1.0)
    return visible, new_max, ms, vs


def native_f16_columns(columns: int, features: frozenset[str]) -> int:
    """How many of a row's leading `columns` ggml_vec_mad_f16 and ggml_vec_scale_f16 (vec.h)
    compute in f16 arithmetic: on a build with AVX512-FP16 (GGML_F16_VEC is `__m512h`) the whole
    steps of 128 (GGML_F16_STEP), the scalar first rounded to f16; none elsewhere (AVX-512F, AVX2:
    f32 arithmetic on widened values, each result rounded to f16, as the scalar leftovers)."""
    return columns - columns % F16_NATIVE_STEP if "AVX512_FP16" in features else 0


def vec_mad_f16(y: torch.Tensor, x: torch.Tensor, v: torch.Tensor, native: int) -> torch.Tensor:
    """ggml_vec_mad_f16: y + x*v for f16 values y, x (..., D) held in f32 and v (...) f32: the first
    `native` columns `_mm512_fmadd_ph(x, f16(v), y)`, the others f16(fma(x, v, y)) in f32."""
    out = round_f16(fma(x, v[..., None], y))
    if not native:
        return out
    return torch.cat((fma_f16(x[..., :native], round_f16(v)[..., None], y[..., :native]), out[..., native:]), dim=-1)


def vec_scale_f16(y: torch.Tensor, v: torch.Tensor, native: int) -> torch.Tensor:
    """ggml_vec_scale_f16: y * v, y (..., D) f16 values held in f32, v (...) f32: the first `native`
    columns `_mm512_mul_ph(y, f16(v))` (two f16 values: their f32 product is exact, one rounding
    to f16), the others f16(y * v) in f32."""
    out = round_f16(y * v[..., None])
    if not native:
        return out
    return torch.cat((round_f16(y[..., :native] * round_f16(v)[..., None]), out[..., native:]), dim=-1)


def flash_attn_one_chunk(q, k, v, scale: float, contract_sum: bool = True, dot=vec_dot_f16,
                         allowed: torch.Tensor | None = None, features: frozenset[str] | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk with an f16 K/V cache (fewer than 64 query
    rows). q (H, T, D) f32 and k (H, S, D) in GGUF order, v (H, S, D); returns (H, T, D) f32.
    `allowed` (T, S): which keys each query sees (default `causal`: the queries are the last keys);
    `features`: the build's (default: this one's), which decide `native_f16_columns`.

    Q is rounded to f16 and dotted with each key by ggml_vec_dot_f16 (or `dot`); keys are visited in order,
    masked (future) ones skipped; on a new maximum the f16 accumulator is rescaled by expf(M_old - M)
    (`vec_scale_f16`), else the key's weight is expf(s - M); V is accumulated by `vec_mad_f16`,
    S = fma(S, ms, vs); the output is f32(acc) * (1/S). `softcap` (Gemma 2): the scale divided by it
    first (f32), each score then cap·tanhf(score).
    """
    heads, tokens, _ = q.shape
    allowed = causal(tokens, k.shape[1]) if allowed is None else allowed  # (T, S)
    native = native_f16_columns(v.shape[-1], llamacpp_cpu_features() if features is None else features)
    k16, v16 = round_f16(k), round_f16(v)
    if softcap:
        scale = np.float32(scale) / np.float32(softcap)
    scores = dot(round_f16(q)[:, :, None, :], k16[:, None, :, :]) * np.float32(scale)  # (H, T, S)
    if softcap:
        scores = np.float32(softcap) * libm("tanhf", scores)
    acc = torch.zeros(heads, tokens, v.shape[-1], dtype=F32)  # the f16 accumulator, held in f32
    total = torch.zeros(heads, tokens, dtype=F32)
    seen, raised, scales, weights = online_softmax_factors(scores, allowed)  # (H, T, S) each
    for key in range(k.shape[1]):
        visible, new_max = seen[..., key], raised[..., key]  # (H, T): masked keys skipped
        ms, vs = scales[..., key], weights[..., key]
        acc = torch.where(new_max[..., None], vec_scale_f16(acc, ms, native), acc)
        updated = vec_mad_f16(acc, v16[:, key, None, :], vs, native)  # (H, T, D)
        acc = torch.where(visible[..., None], updated, acc)
        s_next = fma(total, ms, vs) if contract_sum else total * ms + vs
        total = torch.where(visible, s_next, total)
    inverse = torch.where(total == 0, 0.0, rdiv(1.0, total))
    return acc * inverse[..., None]


def flash_attn_tiled(q, k, v, scale: float) -> torch.Tensor:
    """ggml_compute_forward_flash_attn_ext_tiled (64 or more query rows, f16/f32 K/V): Q stays f32,
    K and V are widened from the f16 cache; per tile of 64 keys the scores are FMA chains over D,
    scaled, masked (-inf); a row with nothing visible in the tile skips it; on a new maximum the
    f32 accumulator and S are scaled by expf(M_old - M); weights are ggml_v_expf(s - M), their sum
    (f64, per 16 lanes, AVX2 8) is added to S; V is accumulated by FMA chains over the tile's keys. Output:
    acc * (1/S). q/k (H, T, D) GGUF order, v (H, T, D) -> (H, T, D) f32.

    Three compiled passes (`tracer.ggml.kernels`): the q·k FMA chains, the online softmax per
    query row (`tile_softmax`), the FMA chains over V."""
    from tracer.ggml import kernels  # numba compiles these kernels: loaded by the ops that run them

    threads = torch.get_num_threads()
    k32, v32 = round_f16(k), round_f16(v)
    raw = kernels.fma_chains(q.to(F32).numpy(), k32.numpy().transpose(0, 2, 1), causal=True,
                             threads=threads)  # (H, T, T)
    constants = exp_constants(avx512_exp(llamacpp_cpu_features()))
    p, ms, grows, total = kernels.tile_softmax(raw, scale, constants, FA_TILE, threads)
    acc = torch.from_numpy(kernels.context_chains(p, v32.numpy(), ms, grows, FA_TILE, threads))
    total = torch.from_numpy(total)  # (H, T)
    inverse = torch.where(total == 0, 0.0, rdiv(1.0, total))
    return acc * inverse[..., None]


def flash_attn_exact(q, k, v, scale: float, round_q: bool, dtype: torch.dtype = F64) -> torch.Tensor:
    """The same operands (K, V in f16; Q in f16 below 64 rows, else f32), softmax and weighted sum
    in `dtype` (f64: exact but for the last bits; f32: torch's own order), rounded to f32. Shapes
    as `flash_attn_tiled`."""
    qd = (round_f16(q) if round_q else q).to(dtype)
    scores = qd @ round_f16(k).to(dtype).transpose(-1, -2) * scale  # (H, T, S)
    probs = torch.softmax(scores.masked_fill(~causal(*scores.shape[-2:]), float("-inf")), dim=-1)
    return (probs @ round_f16(v).to(dtype)).to(F32)


def dot_f32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """q·k products in torch's f32 order: (..., 1, D) x (..., N, D) broadcast as matmul."""
    return torch.matmul(x, y.transpose(-1, -2))[..., 0, :] if x.shape[-2] == 1 else (x * y).sum(-1)


def flash_attention(q, k, v, head_dim: int, accumulate: str = "ggml", allowed: torch.Tensor | None = None,
                    order=to_interleaved, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """llama.cpp's CPU flash attention with an f16 KV cache, picking its path as ggml does (tiled
    from 64 query rows). q (1, H, T, D), k/v (1, KV, S, D) HF order -> (1, H, T, D) f32; `allowed`
    (T, S): the mask below 64 rows (default: causal, the queries the last keys).

    `accumulate` other than "ggml": the same algorithm with other sums. Below 64 rows the f16
    accumulator and online softmax stay (every implementation of ggml's kernel keeps them) and only
    the q·k dot products change (f64: exact; f32: plain f32 sums); from 64 rows (f32 accumulators)
    softmax attention is computed in f64 or f32 and rounded once. `order`: (…, D) HF order -> the
    order llama.cpp holds each head's dims in (`tracer.ggml.strategies.gguf_dims`). `scale`: the
    kernel's kq_scale (default 1/sqrt(head_dim)); `softcap` (Gemma 2) below 64 rows only."""
    heads = q.shape[1]
    q_g = order(q[0].to(F32), head_dim)  # (H, T, D) llama.cpp's order: the dot products' order
    k_g = kv_for_heads(order(k[0].to(F32), head_dim), heads)  # (H, S, D)
    v_h = kv_for_heads(v[0].to(F32), heads)  # (H, S, D): V rows are not permuted
    scale = attention_scale(head_dim) if scale is None else scale
    tiled = q.shape[2] >= FA_TILE
    if softcap and tiled:
        raise TracerError("the ggml regime soft-caps attention scores in llama.cpp's one-chunk flash attention "
                          "only (fewer than 64 query rows)")
    if tiled and q.shape[2] != k.shape[2]:
        raise TracerError("the ggml regime's tiled flash attention (64 or more query rows) runs a prefill only, "
                          "not rows after a KV cache")
    if accumulate == "ggml":
        run = flash_attn_tiled if tiled else flash_attn_one_chunk
    elif tiled:
        run = functools.partial(flash_attn_exact, round_q=False, dtype=F64 if accumulate == "f64" else F32)
    else:
        run = functools.partial(flash_attn_one_chunk, dot=dot_exact if accumulate == "f64" else dot_f32)
    if not tiled:
        run = functools.partial(run, allowed=allowed)
    if softcap:
        run = functools.partial(run, softcap=softcap)
    return run(q_g, k_g, v_h, scale)[None]


# --- quantized and bf16 KV caches -----------------------------------------------------------


def fwht(x: torch.Tensor, size: int) -> torch.Tensor:
    """ggml_compute_forward_fwht (llama.cpp's `llama_mul_mat_hadamard`): each run of `size` values of
    the last axis scaled by 1.0f/sqrtf(size), then the Walsh-Hadamard butterflies (u + v, u - v)
    in f32, pairs at distance 1, 2, 4, ...; the transform is its own inverse."""
    scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(size)))
    y = x.to(F32).unflatten(-1, (-1, size)) * scale  # (..., blocks, size)
    length = 1
    while length < size:
        pairs = y.unflatten(-1, (size // (2 * length), 2, length))  # (..., blocks, groups, 2, length)
        u, v = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((u + v, u - v), dim=-2).flatten(-3)
        length *= 2
    return y.flatten(-2)


def rotation_size(head_dim: int, keys: bool) -> int | None:
    """The Hadamard size llama.cpp rotates a quantized K or V cache with (llama-kv-cache.cpp:
    head sizes that are multiples of 64; K: the largest power of two dividing it, V: 64)."""
    if head_dim % 64:
        return None
    size = 64
    while keys and head_dim % (size * 2) == 0:
        size *= 2
    return size


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """This machine's first processor as Linux's /proc/cpuinfo describes it (empty elsewhere)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    return set(_cpuinfo().get("flags", "").split())


# Not one of llama.cpp's names: a native build made on an AMD CPU (GGML_NATIVE: `-march=native`) is
# tuned by GCC for AMD Zen (znver1..4), and that tuning, not an instruction set, decides two things
# the emulation follows (`contracts_fma_chains`, `vectorises_in_512_bits`).
ZNVER = "ZNVER"
AMD_VENDORS = ("AuthenticAMD", "HygonGenuine")  # /proc/cpuinfo vendor_id; GCC tunes Hygon's as znver1


def report_features(report: str, cpu: Mapping[str, str]) -> frozenset[str]:
    """The features a llama.cpp build reports as on (`llama_print_system_info`: "CPU : SSE3 = 1 |
    AVX2 = 1 | ... | REPACK = 1 |"), plus two it does not report that a native build on `cpu` (its
    /proc/cpuinfo fields) takes: ZNVER where the vendor is AMD's, AVX512_FP16 where the CPU has it
    (ggml's f16 vectors are then FP16 arithmetic: `native_f16_columns`)."""
    names = {name.rpartition(":")[2].strip() for name, _, on in (part.partition("=") for part in report.split("|"))
             if on.strip() == "1"}
    if cpu.get("vendor_id") in AMD_VENDORS:
        names.add(ZNVER)
    if "avx512_fp16" in cpu.get("flags", "").split():
        names.add("AVX512_FP16")
    return frozenset(names)


@functools.cache
def llamacpp_cpu_features() -> frozenset[str]:
    """The CPU features the llama.cpp build takes here, as it reports them (`llama_print_system_info`:
    "AVX512_BF16 = 1 | ... | LLAMAFILE = 1 | REPACK = 1") with ZNVER and AVX512_FP16 read off this CPU
    (`report_features`); without llama-cpp-python, what a native build would take: this CPU's
    /proc/cpuinfo flags under llama.cpp's names (AVX512_BF16, AVX512_VNNI, AVX512, ...) and its
    default matmul paths (LLAMAFILE: tinyBLAS; REPACK: the CPU_REPACK buffer)."""
    try:
        import llama_cpp  # llama-cpp-python, an optional runtime: loaded where llama.cpp runs

        report = llama_cpp.llama_print_system_info().decode(errors="replace")
    except (ImportError, OSError, AttributeError):
        names = {flag.upper() if flag.startswith("avx512_") else flag.upper().replace("AVX512F", "AVX512")
                 for flag in cpu_flags()} | {"LLAMAFILE", "REPACK"}
        report = " | ".join(f"{name} = 1" for name in sorted(names))
    return report_features(report, _cpuinfo())


def contracts_fma_chains(features: frozenset[str]) -> bool:
    """Whether GCC fuses `acc += a * b` into one FMA where `acc` is a loop's f32 accumulator: not on a
    build tuned for AMD Zen (ZNVER), whose tuning avoids FMA chains up to 256 bits (GCC 12:
    `--param avoid-fma-max-bits=256`) and leaves a multiply and an add, each rounded."""
    return ZNVER not in features


def vectorises_in_512_bits(features: frozenset[str]) -> bool:
    """Whether GCC's auto-vectorised loops take 512-bit vectors, their epilogue 256: on an AVX-512
    build tuned for AMD Zen; GCC's tunings for Intel's AVX-512 cores prefer 256 bits (then a 128-bit
    epilogue), as does every AVX2 build."""
    return {"AVX512", ZNVER} <= features


def takes_dpbf16() -> bool:
    """Whether llama.cpp's bf16 dot products take AVX512-BF16's `_mm512_dpbf16_ps` on this CPU."""
    return "AVX512_BF16" in llamacpp_cpu_features()


def dpbf16(acc: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`_mm512_dpbf16_ps(acc, x, y)` (VDPBF16PS): x, y (..., 32) bf16 values in f32, acc (..., 16):
    lane j adds the product of elements 2j+1, then of 2j, each add rounded to f32 (the products of
    bf16 values are exact in f32)."""
    xp, yp = x.unflatten(-1, (SIMD_F32, 2)), y.unflatten(-1, (SIMD_F32, 2))  # (..., 16, 2)
    return (acc + xp[..., 1] * yp[..., 1]) + xp[..., 0] * yp[..., 0]


def vec_dot_bf16(x: torch.Tensor, y: torch.Tensor, use_dpbf16: bool | None = None,
                 features: frozenset[str] | None = None) -> torch.Tensor:
    """ggml_vec_dot_bf16 (vec.cpp) on bf16 values held in f32, x/y (..., K) broadcast -> (...).

    AVX512-BF16 (`use_dpbf16`, default: what llama.cpp takes here): two 16-lane accumulators over
    steps of 64, `_mm512_dpbf16_ps` on each half. AVX-512F without it: two accumulators over steps
    of 32, an f32 add of each product. Then each is reduced by `_mm512_reduce_add_ps` and added in
    f64, and the values past the last whole step one by one in f64. AVX2 (`features` without AVX512;
    default: this build's): four 8-lane accumulators over steps of 32 (`vec_dot_bf16_avx2`)."""
    use_dpbf16 = takes_dpbf16() if use_dpbf16 is None else use_dpbf16
    if not use_dpbf16 and f32_lanes(llamacpp_cpu_features() if features is None else features) != SIMD_F32:
        return vec_dot_bf16_avx2(x, y)
    step = 64 if use_dpbf16 else 32
    width = x.shape[-1] - x.shape[-1] % step
    shape = torch.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    c1 = c2 = torch.zeros(*shape, SIMD_F32, dtype=F32)
    for start in range(0, width, step):
        half = start + step // 2
        if use_dpbf16:
            c1, c2 = dpbf16(c1, x[..., start:half], y[..., start:half]), dpbf16(c2, x[..., half:start + step],
                                                                                y[..., half:start + step])
        else:
            c1, c2 = (c1 + x[..., start:half] * y[..., start:half],
                      c2 + x[..., half:start + step] * y[..., half:start + step])
    total = reduce_add16(c1).to(F64) + reduce_add16(c2).to(F64)
    for i in range(width, x.shape[-1]):
        total = total + (x[..., i] * y[..., i]).to(F64)
    return total.to(F32)


def vec_dot_bf16_avx2(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ggml_vec_dot_bf16's AVX2 path: per 32 values four 8-lane accumulators, each adding its 8 products
    (a multiply and an add, each rounded); (c1+c3) + (c2+c4), `hsum8`, in f64; the values past the last
    whole 32 one by one in f64. x/y (..., K) broadcast -> (...)."""
    width = x.shape[-1] - x.shape[-1] % 32
    shape = torch.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    acc = torch.zeros(*shape, 4, 8, dtype=F32)  # c1..c4
    for start in range(0, width, 32):
        acc = x[..., start:start + 32].unflatten(-1, (4, 8)) * y[..., start:start + 32].unflatten(-1, (4, 8)) + acc
    total = hsum8((acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])).to(F64)
    for i in range(width, x.shape[-1]):
        total = total + (x[..., i] * y[..., i]).to(F64)
    return total.to(F32)


def flash_attn_one_chunk_f32(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The one-chunk flash attention loop for K/V types other than f16: the same online softmax
    (libm expf, S = fma(S, ms, vs)), an f32 accumulator (ggml_vec_scale_f32 on a new maximum,
    ggml_vec_mad_f32: fma(v, weight, acc)), output acc * (1/S). scores (H, T, T) already scaled,
    v (H, T, D) as ggml's v_to_float gives it."""
    heads, tokens, keys = scores.shape
    allowed = causal(tokens, keys)  # (T, S)
    acc = torch.zeros(heads, tokens, v.shape[-1], dtype=F32)
    total = torch.zeros(heads, tokens, dtype=F32)
    seen, raised, scales, weights = online_softmax_factors(scores, allowed)  # (H, T, S) each
    for key in range(keys):
        visible, new_max = seen[..., key], raised[..., key]
        ms, vs = scales[..., key], weights[..., key]
        acc = torch.where(new_max[..., None], acc * ms[..., None], acc)
        acc = torch.where(visible[..., None], fma(v[:, key, None, :], vs[..., None], acc), acc)
        total = torch.where(visible, fma(total, ms, vs), total)
    return acc * torch.where(total == 0, 0.0, rdiv(1.0, total))[..., None]


# --- unfused attention (flash_attn=off) -------------------------------------------------------


def tinyblas_dot(x: torch.Tensor, y: torch.Tensor, features: frozenset[str] | None = None) -> torch.Tensor:
    """llamafile's tinyBLAS (sgemm.cpp `gemm_bloc`, AVX-512) for one output: a 16-lane f32
    accumulator takes one FMA per 16 values of the inner axis, in order, then
    `_mm512_reduce_add_ps`; AVX2 8 lanes, then tinyBLAS' `hsum(__m256)` (`hsum8`). x, y (..., K)
    broadcast, K a multiple of the lanes -> (...); `features`: the build's (default: this one's)."""
    lanes = f32_lanes(llamacpp_cpu_features() if features is None else features)
    acc = None
    for start in range(0, x.shape[-1], lanes):
        a, b = x[..., start:start + lanes], y[..., start:start + lanes]
        acc = a * b if acc is None else fma(a, b, acc)
    return reduce_add16(acc) if lanes == SIMD_F32 else hsum8(acc)


def tinyblas_dot_dpbf16(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """tinyBLAS on bf16 with AVX512-BF16 (`tinyBLAS<32, __m512, __m512bh, ...>`): per 32 values of
    the inner axis one `_mm512_dpbf16_ps` into a 16-lane accumulator from 0, then
    `_mm512_reduce_add_ps`. x, y (..., K) broadcast, K a multiple of 32 -> (...)."""
    acc = torch.zeros(*torch.broadcast_shapes(x.shape[:-1], y.shape[:-1]), SIMD_F32, dtype=F32)
    for start in range(0, x.shape[-1], 2 * SIMD_F32):
        acc = dpbf16(acc, x[..., start:start + 2 * SIMD_F32], y[..., start:start + 2 * SIMD_F32])
    return reduce_add16(acc)


def takes_tinyblas(rows: int) -> bool:
    """Whether ggml_mul_mat hands `rows` rows of its second operand to llamafile's tinyBLAS: from 2,
    on a build with it (LLAMAFILE)."""
    return rows > 1 and "LLAMAFILE" in llamacpp_cpu_features()


def bf16_mul_mat_dot(x: torch.Tensor, y: torch.Tensor, rows: int) -> torch.Tensor:
    """The dot products of ggml_mul_mat on a bf16 cache as llama.cpp's build takes them here: from
    2 rows tinyBLAS (AVX512-BF16's when the CPU has it, and the inner axis is whole steps of 32;
    else its 16-lane f32 one), for one row, a refused tinyBLAS call or a build without LLAMAFILE
    ggml_vec_dot_bf16."""
    use_dpbf16 = takes_dpbf16()
    if not takes_tinyblas(rows) or (use_dpbf16 and x.shape[-1] % (2 * SIMD_F32)):
        return vec_dot_bf16(x, y, use_dpbf16)
    return tinyblas_dot_dpbf16(x, y) if use_dpbf16 else tinyblas_dot(x, y)


def _pad16(x: torch.Tensor, multiple: int = SIMD_F32) -> torch.Tensor:
    """The key axis (last) padded with zeros to a multiple of 16 (or `multiple`, a divisor of 256):
    llama.cpp's KV cache holds 256 cells, the unused ones masked (weight 0)."""
    return torch.nn.functional.pad(x, (0, -x.shape[-1] % multiple))


def soft_max(scores: torch.Tensor, features: frozenset[str] | None = None) -> torch.Tensor:
    """ggml_compute_forward_soft_max_f32 on scaled scores with the causal mask (-inf): the row
    maximum, ggml_v_expf(s - max) per vector with its lanes' sum added in f64 (16 lanes,
    `_mm512_reduce_add_ps`; AVX2 8, `hsum8`), then p * f32(1.0/sum) (the reciprocal taken in f64).
    scores (H, T, N) -> (H, T, N); `features`: the build's (default: this one's)."""
    features = llamacpp_cpu_features() if features is None else features
    lanes = f32_lanes(features)
    tokens = scores.shape[-1]
    masked = scores + torch.where(causal(*scores.shape[-2:]), 0.0, float("-inf"))  # (H, T, S)
    best = masked.amax(-1, keepdim=True)
    p = _pad16(ggml_v_expf(masked - best, avx512_exp(features)), lanes)  # (H, T, N padded)
    total = torch.zeros(p.shape[:-1], dtype=F64)
    for start in range(0, p.shape[-1], lanes):
        vector = p[..., start:start + lanes]  # (H, T, lanes)
        total = total + (reduce_add16(vector) if lanes == SIMD_F32 else hsum8(vector)).to(F64)
    return (p * (1.0 / total).to(F32)[..., None])[..., :tokens]


def attention_unfused(q, k, v, head_dim: int, kv_cache: str, record=None, order=to_interleaved):
    """llama.cpp's attention without flash attention (llama-graph.cpp build_attn_mha): kq =
    mul_mat(K cache, Q), soft_max_ext(kq, mask, scale), kqv = mul_mat(Vᵀ cache, probabilities).

    f16/bf16 cache: Q and the probabilities converted to the cache type (mul_mat's vec-dot type),
    both products by tinyBLAS from 2 query rows (one 16-lane FMA chain per output), by
    ggml_vec_dot_f16/bf16 for one row or on a build without LLAMAFILE. f32 cache: q·k by
    ggml_vec_dot_f32 (the first tinyBLAS call needs a contiguous Q), the probabilities by tinyBLAS.
    Scores and probabilities are recorded (`record`: names relative to the layer).
    q (1, H, T, D), k/v (1, KV, T, D) HF order -> (1, H, T, D); `order` as `flash_attention`'s."""
    heads, tokens = q.shape[1], q.shape[2]
    store = {"f16": round_f16, "bf16": round_bf16, "f32": lambda x: x.to(F32)}[kv_cache]
    q_g = store(order(q[0].to(F32), head_dim))[:, :, None, :]  # (H, T, 1, D)
    k_g = store(kv_for_heads(order(k[0].to(F32), head_dim), heads))[:, None]  # (H, 1, T, D)
    dots = {"f16": vec_dot_f16, "bf16": vec_dot_bf16, "f32": vec_dot_f32}[kv_cache]
    if kv_cache == "bf16":
        raw = bf16_mul_mat_dot(k_g, q_g, tokens)  # (H, T, T)
    elif kv_cache == "f32" or not takes_tinyblas(tokens):
        raw = dots(q_g, k_g)
    else:
        raw = tinyblas_dot(k_g, q_g)
    scores = raw * np.float32(attention_scale(head_dim))
    probs = soft_max(scores)
    if record is not None:
        record(SCORES, scores[None])
        record(PROBS, probs[None])
    # the cache's cells padded to whole steps of every dot product here (tinyBLAS: 16 or 32; ggml_vec_dot_*: 64),
    # so that sums split where llama.cpp's over the 256 cells do
    p = _pad16(store(probs), F16_DOT_STEP)[:, :, None, :]  # (H, T, 1, N): converted to V's vec-dot type
    values = _pad16(store(kv_for_heads(v[0].to(F32), heads)).transpose(-1, -2), F16_DOT_STEP)[:, None]  # (H, 1, D, N)
    if kv_cache == "bf16":
        out = bf16_mul_mat_dot(values, p, tokens)  # (H, T, D)
    else:
        out = tinyblas_dot(values, p) if takes_tinyblas(tokens) else dots(values, p)
    return out[None]
