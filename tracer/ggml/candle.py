"""candle's CPU arithmetic, emulated: the `preset=candle-q` regime (quantized_llama.rs on x86 AVX2).

candle's quantized CPU path (candle-core `quantized/k_quants.rs`, `quantized/avx.rs`; the same code
in the 0.4.2 wheel the candle engine runs and in 0.11) differs from ggml's x86 path in three places:

- activation quantization (`BlockQ8_0/BlockQ8_1::from_float`, knob `act_round=candle`):
  `d = amax/127`, `id = 1/d`, `q = f32::round(x·id)` (ties away from zero); ggml's x86 quantizer
  multiplies by `127/amax` and rounds ties to even. Q8_1's block sum is `s = f16(sum) * f16(d)`, an
  f16 product (half's `Mul`: the f32 product rounded to f16), where ggml stores `f16(d·sum)`;
- the Q4_1×Q8_1 dot product (`BlockQ4_1::vec_dot`, knob `accumulate=candle`) is candle's scalar
  loop: per block `sumf += sumi·d_w·d_x + m_w·s_x` in f32, left to right, no FMA (Rust does not
  contract); Q8_0×Q8_0 and Q4_0×Q8_0 run candle's AVX2 kernels, whose lane order and FMA chain are
  ggml's (`tracer.ggml.vecdot.matmul_ggml`). Other pairs are summed in f64 (a caveat);
- the ops around the matmuls (knob `ops=candle`) are candle's f32 kernels as the candle engine
  composes them: RMSNorm with Σx² by candle's `vec_sum` (4×8 AVX lanes over 32-value chunks, then
  its `vec_reduce`), RoPE tables from libm's powf/cosf/sinf, the attention products by the gemm
  crate (a sequential FMA chain over the inner dimension up to its 512-value k block: q·kᵀ over D
  in GGUF's dim order, probs·v over the keys), scores scaled by candle's affine,
  softmax as exp (glibc expf), `vec_sum`, divide; SiLU as `x / (1 + expf(−x))`.

Measured against the wheel (tests/unit/test_ggml_candle.py): every piece bit-exact; not emulated:
gemm's blocked order past its k block (probs·v of prompts over 512 tokens) and its one-column
path (q·kᵀ of a one-token prompt, whose softmax is 1 whatever the score).
"""

from __future__ import annotations

import numpy as np
import torch

from tracer.errors import TracerError
from tracer.ggml.floats import (
    F32,
    F64,
    expf,
    libm,
    powf,
    round_f16,
    round_half_away,
    silu_scalar,
)
from tracer.ggml.quants import ActBlocks, Blocks
from tracer.ggml.vecdot import matmul_blas, matmul_ggml
from tracer.layouts import to_interleaved
from tracer.model.points import PROBS, SCORES

# (weight, activation) pairs whose candle kernel is emulated in its own order.
SCALAR_KERNELS = {("q4_1", "q8_1")}  # candle's generic loop (no AVX2 kernel in k_quants.rs)
AVX2_KERNELS = {("q4_0", "q8_0"), ("q8_0", "q8_0")}  # avx.rs: ggml's lane order and FMA chain
EXACT_WEIGHT_TYPES = {"f32", "q4_0", "q4_1", "q8_0"}
# gemm's order is a plain FMA chain up to this inner dimension, its k block (measured on the wheel:
# 512 values summed as the chain, 513 not); probs·v of prompts longer than that is not bit-exact.
GEMM_CHAIN_LIMIT = 512


# --- activations -------------------------------------------------------------------------------


def quantize(x: torch.Tensor, kind: str, rounding: str = "candle") -> ActBlocks:
    """(T, C) f32 -> candle's Q8_0 / Q8_1 blocks (`from_float`): d = amax/127, id = 1/d, round
    ties away; Q8_1 adds s = f16(f16(Σq)·f16(d)). `rounding` is "candle" (the signature of
    `tracer.ggml.quants.quantize_activations`, whose place it takes with act_round=candle).

    Raises:
        TracerError: another activation type (candle's Q8_K differs between 0.4.2 and 0.11).
    """
    if kind not in ("q8_0", "q8_1"):
        raise TracerError(f"act_round=candle emulates candle's Q8_0/Q8_1 quantizers; {kind} is not one "
                          "(candle 0.11 changed Q8_K's scale to -127/max)")
    if x.shape[-1] % 32:
        raise TracerError(f"act_quant={kind}: a row of {x.shape[-1]} values is not a whole number of 32-value blocks")
    blocks = x.to(F32).unflatten(-1, (x.shape[-1] // 32, 32))  # (T, B, 32)
    d = blocks.abs().amax(-1) / torch.tensor(127.0, dtype=F32)  # (T, B), an f32 division
    inverse = torch.where(d != 0, torch.tensor(1.0, dtype=F32) / d, torch.zeros_like(d))
    q = round_half_away(blocks * inverse[..., None])
    d16 = round_f16(d)
    s = round_f16(round_f16(q.sum(-1)) * d16) if kind == "q8_1" else None  # half's Mul: f32 product to f16
    return ActBlocks(kind, d16, q, s=s)


# --- matmuls -----------------------------------------------------------------------------------


def matmul(act: ActBlocks, weight: Blocks) -> torch.Tensor:
    """(T, R): candle's vec_dot for every (token, row): the scalar Q4_1 loop, the AVX2 Q8_0/Q4_0
    kernels (ggml's order), else the same operands summed in f64."""
    pair = (weight.kind, act.kind)
    if weight.unpacked and pair in SCALAR_KERNELS:
        return matmul_q4_1_scalar(act, weight)
    if weight.unpacked and pair in AVX2_KERNELS:
        return matmul_ggml(act, weight)
    return matmul_blas(act, weight, F64)


def matmul_q4_1_scalar(act: ActBlocks, weight: Blocks) -> torch.Tensor:
    """`BlockQ4_1::vec_dot`: sumf = Σ_b ((sumi_b·d_w)·d_x + m_w·s_x), each step rounded to f32.
    act (T, B, 32) Q8_1, weight (R, B, 32) Q4_1 -> (T, R), by the compiled loop of
    `tracer.ggml.kernels` (on as many threads as torch uses)."""
    from tracer.ggml import kernels

    quants, scales, mins = weight.kernel_layout()  # (B, 32, R), (B, R), (B, R)
    out = kernels.vec_dot_blocks(act.q.to(F32).contiguous().numpy(), act.d.to(F32).contiguous().numpy(),
                                 quants, scales, act.s.to(F32).contiguous().numpy(), mins,
                                 threads=torch.get_num_threads(), order="candle")
    return torch.from_numpy(out)


# --- candle's f32 kernels ------------------------------------------------------------------------


def vec_sum(x: torch.Tensor) -> torch.Tensor:
    """candle's `vec_sum` (cpu/mod.rs, AVX): (..., n) -> (...). 4 registers of 8 lanes summed over
    each 32-value chunk, reduced as `vec_reduce` does (registers pairwise, halves, two hadds),
    then the leftovers one by one."""
    n = x.shape[-1]
    whole = n & ~31
    acc = torch.zeros(*x.shape[:-1], 32, dtype=F32)
    for start in range(0, whole, 32):
        acc = acc + x[..., start:start + 32]
    regs = acc.unflatten(-1, (4, 8))  # (..., 4 registers, 8 lanes)
    x0 = (regs[..., 0, :] + regs[..., 1, :]) + (regs[..., 2, :] + regs[..., 3, :])  # (..., 8)
    t0 = x0[..., :4] + x0[..., 4:]  # low 128 bits + high 128 bits
    out = (t0[..., 0] + t0[..., 1]) + (t0[..., 2] + t0[..., 3])  # two _mm_hadd_ps
    for i in range(whole, n):
        out = out + x[..., i]
    return out


def gemm_chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (..., M, K) @ b (..., K, N) as the gemm crate sums a small product: one FMA per k from
    zero, k in order -> (..., M, N) (`tracer.ggml.kernels.fma_chains`)."""
    from tracer.ggml import kernels

    return torch.from_numpy(kernels.fma_chains(a.detach().to(F32).numpy(), b.detach().to(F32).numpy(),
                                               threads=torch.get_num_threads()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The candle engine's RMSNorm: m = sqrt(vec_sum(x²) / n + eps), x / m · w (f32 throughout)."""
    x = x.to(F32)
    n = torch.tensor(float(x.shape[-1]), dtype=F32)
    mean = vec_sum(x * x) / n + torch.tensor(eps, dtype=F32)
    # f64's sqrt rounded to f32 is f32's correctly rounded sqrt; torch's f32 sqrt (SLEEF) is 1 ulp off at times
    m = torch.sqrt(mean.to(F64)).to(F32)[..., None]  # (1, T, 1)
    return x / m * weight.to(F32)


def candle_inv_freq(theta: float, head_dim: int) -> np.ndarray:
    """(D/2,) f32: `(0..D).step_by(2).map(|i| 1f32 / theta.powf(i as f32 / D as f32))`, libm's powf
    as Rust's f32::powf calls it."""
    base = np.float32(theta)
    return np.array([np.float32(1.0) / np.float32(powf(float(base), float(np.float32(i) / np.float32(head_dim))))
                     for i in range(0, head_dim, 2)], dtype=np.float32)


def rope_angles(inv_freq: np.ndarray, positions) -> np.ndarray:
    """(T, D/2) f32: position × frequency for absolute `positions` (T,), exact in f32 (candle's
    (P, 1) @ (1, D/2) matmul has one product per entry)."""
    return np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]


def rotary(spec, positions: torch.Tensor, dtype, device="cpu", layer_type: str = "full_attention"):
    """cos, sin (1, T, D) in half-split layout from candle's tables at absolute `positions` (T,):
    `1f32 / theta.powf(i/D)` per pair, position × frequency, then libm's cosf/sinf (Rust's f32::cos/sin)."""
    angles = torch.from_numpy(rope_angles(candle_inv_freq(spec.rope_theta, spec.head_dim),
                                          positions.cpu().numpy()))  # (T, D/2)
    cos, sin = libm("cosf", angles), libm("sinf", angles)
    return torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]  # (1, T, D)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax_last_dim: exp(x − max) by glibc's expf, summed by vec_sum, each divided by the sum."""
    top = x.amax(-1, keepdim=True)
    e = expf(x - top)
    return e / vec_sum(e)[..., None]


def attention(q, k, v, spec, steps, record, visible=None):
    """quantized_llama.rs' attention: q (1, H, T, D), k/v (1, KV, T, D) in HF order -> (1, H, T, D).
    The products run in GGUF's dim order, as candle multiplies the GGUF's permuted rows."""
    dim = spec.head_dim
    k, v = steps.repeat_kv(k, spec.num_kv_groups), steps.repeat_kv(v, spec.num_kv_groups)  # (1, H, T, D)
    q_g, k_g = to_interleaved(q.to(F32), dim), to_interleaved(k.to(F32), dim)  # GGUF order
    scale = torch.tensor(float(np.float32(1.0 / np.sqrt(dim))), dtype=F32)  # affine(1/sqrt(D), 0) in f32
    scores = gemm_chain(q_g, k_g.transpose(-1, -2)) * scale + 0.0  # (1, H, T, T)
    record(SCORES, scores)
    probs = softmax(steps.mask(scores, visible))
    record(PROBS, probs)
    return gemm_chain(probs, v.to(F32))  # (1, H, T, D)


def glu(gate: torch.Tensor, up: torch.Tensor, hidden_act: str) -> torch.Tensor:
    """candle_nn::ops::silu(gate) * up: v / (1 + exp(−v)) with glibc's expf, then the product."""
    if hidden_act != "silu":
        raise TracerError(f"ops=candle emulates quantized_llama.rs' SwiGLU only (hidden_act {hidden_act!r})")
    return silu_scalar(gate.to(F32)) * up.to(F32)


def apply_ops(steps):
    """`steps` with candle's f32 kernels (ops=candle) put in."""
    return steps.replace(norm=rms_norm, rotary=rotary, attention=attention, glu=glu)


# --- the regime a candle run implies -------------------------------------------------------------


def implied_regime(weight_types: dict[str, str]) -> tuple[dict, list[str]]:
    """The reimpl variant reproducing candle's quantized_llama.rs on these GGUF tensor types, and
    what of it is not bit-exact.

    Example:
        >>> implied_regime({"model.layers.0.self_attn.q_proj.weight": "q4_1"})
        ({'preset': 'candle-q', 'weights': 'gguf'}, [])
    """
    caveats = []
    for kind in sorted(set(weight_types.values()) - EXACT_WEIGHT_TYPES):
        names = [name for name, t in weight_types.items() if t == kind]
        why = ("K-quant: candle 0.11 changed Q8_K's scale to -127/max, and its k-quant kernels are not emulated"
               if kind.endswith("_k") else "candle's kernel for it is not emulated")
        caveats.append(f"{kind.upper()} weights ({len(names)} tensors, e.g. {names[0]}): {why}; accumulated in f64")
    return {"preset": "candle-q", "weights": "gguf"}, caveats
