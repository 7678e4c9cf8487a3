"""candle's CPU arithmetic, emulated: the `preset=candle-q` regime (quantized_llama.rs on x86 AVX2).

candle's CPU path (candle-core 0.4.2, the wheel the candle engine runs: `quantized/k_quants.rs`,
`quantized/avx.rs`, `quantized/mod.rs`; the wheel is built for AVX2/FMA, so avx.rs' kernels run
where they exist) differs from ggml's x86 path in three places:

- activation quantization (`from_float`, knob `act_round=candle`): Q8_0/Q8_1 `d = amax/127`,
  `id = 1/d`, `q = f32::round(x·id)` (ties away from zero); ggml's x86 quantizer multiplies by
  `127/amax` and rounds ties to even. Q8_1's block sum is `s = f16(sum) * f16(d)`, an f16 product
  (half's `Mul`: the f32 product rounded to f16), where ggml stores `f16(d·sum)`. Q8_K (k-quant
  weights) is 0.4.2's: `iscale = -128/max` (0.11 and ggml: -127/max), `tracer.ggml.candle_kernels`;
- the dot products (`vec_dot`, knob `accumulate=candle`): Q4_1, Q5_1 and Q5_0 have no AVX2
  kernel, so candle's scalar loops run: per block `sumf += sumi·d_w·d_x (+ m_w·s_x)` in f32, left
  to right, no FMA (Rust does not contract); Q8_0×Q8_0 and Q4_0×Q8_0 run AVX2 kernels whose lane
  order and FMA chain are ggml's (`tracer.ggml.vecdot.matmul_ggml`); Q2_K..Q6_K×Q8_K run avx.rs'
  k-quant kernels (`tracer.ggml.candle_kernels`). `QMatMul` dequantizes F32/F16 weights and
  multiplies them by gemm (below). Other pairs are summed in f64 (a caveat);
- the ops around the matmuls (knob `ops=candle`) are candle's f32 kernels as the candle engine
  composes them: RMSNorm with Σx² by candle's `vec_sum` (4×8 AVX lanes over 32-value chunks, then
  its `vec_reduce`), RoPE tables from libm's powf/cosf/sinf, the attention products by the gemm
  crate (q·kᵀ over D in GGUF's dim order, probs·v over the keys), scores scaled by candle's
  affine, softmax as exp (glibc expf), `vec_sum`, divide; SiLU as `x / (1 + expf(−x))`.

gemm (0.17) sums each output as an f32 FMA chain over a depth block of the inner dimension, the
blocks' sums added in order; the block is min(k, 512) for products of at most 64 rows and
columns, else its cache model's (at least 512, then k split evenly: 576 -> 2 × 288); a single row
or column goes through its gemv (8 × 8 lanes).

Measured against the wheel (tests/unit/test_ggml_candle.py, test_ggml_candle_kernels.py): every
piece bit-exact, including gemm past 512 values of depth and the one-row gemv.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch

from tracer.core.errors import TracerError
from tracer.ggml import candle_kernels
from tracer.ggml.candle_kernels import KQUANT_KINDS
from tracer.ggml.floats import (
    F32,
    F64,
    expf,
    fma,
    libm,
    powf,
    silu_scalar,
)
from tracer.ggml.quants import ACT_BLOCK, ActBlocks, Blocks
from tracer.ggml.vecdot import matmul_blas, matmul_ggml
from tracer.model.points import PROBS, SCORES
from tracer.traces.layouts import to_interleaved

# (weight, activation) pairs whose candle kernel is emulated in its own order.
SCALAR_KERNELS = {("q4_1", "q8_1"), ("q5_1", "q8_1"), ("q5_0", "q8_0")}  # k_quants.rs' generic loops (no AVX2 kernel)
AVX2_KERNELS = {("q4_0", "q8_0"), ("q8_0", "q8_0")}  # avx.rs: ggml's lane order and FMA chain
KQUANT_KERNELS = {(kind, "q8_k") for kind in KQUANT_KINDS}  # avx.rs' vec_dot_q*k_q8k (tracer.ggml.candle_kernels)
# Verified bit-exact against the wheel (tests/unit/test_ggml_candle*.py, SmolLM2 Q4_K_M end to end).
EXACT_WEIGHT_TYPES = {"f32", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", *KQUANT_KINDS}
# The gemm crate (0.17, candle's f32 matmul; built without its `nightly` feature, so its FMA
# kernel runs on every x86-64 with FMA, AVX-512 or not): microkernel rows and columns (3 x 8
# lanes, 4), the sizes under which it skips its cache model, and the smallest depth block it takes.
GEMM_MR, GEMM_NR, GEMM_SMALL, GEMM_MIN_DEPTH = 24, 4, 64, 512


# --- activations -------------------------------------------------------------------------------


def quantize(x: torch.Tensor, kind: str, rounding: str = "candle") -> ActBlocks:
    """(T, C) f32 -> candle's Q8_0 / Q8_1 / Q8_K blocks (`from_float`, compiled:
    `tracer.ggml.candle_kernels.quantize`). `rounding` is "candle" (the signature of
    `tracer.ggml.quants.quantize_activations`, whose place it takes with act_round=candle).

    Raises:
        TracerError: another activation type, or a row that is not a whole number of blocks.
    """
    if kind not in ACT_BLOCK:
        raise TracerError(f"act_round=candle emulates candle's Q8_0/Q8_1/Q8_K quantizers; {kind} is not one")
    return candle_kernels.quantize(x, kind)


# --- matmuls -----------------------------------------------------------------------------------


def matmul(act: ActBlocks | torch.Tensor, weight: Blocks | torch.Tensor) -> torch.Tensor:
    """(T, R): `QMatMul`. On quantized activations candle's vec_dot for every (token, row): the
    scalar Q4_1/Q5_1/Q5_0 loops, the AVX2 Q8_0/Q4_0 and k-quant kernels; on f32 rows (T, C) and
    an F32/F16 weight, gemm; anything else the same operands summed in f64."""
    if not isinstance(act, ActBlocks):
        if isinstance(weight, Blocks) and weight.kind in ("f32", "f16"):  # a GGUF's float matrix, typed
            return matmul_f32(act, weight.values())
        return matmul_f32(act, weight) if not isinstance(weight, Blocks) else matmul_blas(act, weight, F64)
    pair = (weight.kind, act.kind)
    if weight.unpacked and pair in SCALAR_KERNELS:
        return matmul_scalar(act, weight)
    if weight.unpacked and pair in AVX2_KERNELS:
        return matmul_ggml(act, weight)
    if weight.unpacked and pair in KQUANT_KERNELS:
        return candle_kernels.matmul(act, weight)
    return matmul_blas(act, weight, F64)


def matmul_scalar(act: ActBlocks, weight: Blocks) -> torch.Tensor:
    """`BlockQ4_1::vec_dot` and `BlockQ5_1::vec_dot`: sumf = Σ_b ((sumi_b·d_w)·d_x + m_w·s_x), each
    step rounded to f32; `BlockQ5_0::vec_dot`: sumf = Σ_b (sumi_b·d_w)·d_x, the same loop with
    the min term 0 (adding +0 changes no sum: sumf starts at +0). act (T, B, 32) Q8_1 / Q8_0,
    weight (R, B, 32) -> (T, R), by the compiled loop of `tracer.ggml.kernels` (on as many threads
    as torch uses)."""
    from tracer.ggml import kernels  # numba compiles these kernels: loaded by the ops that run them

    quants, scales, mins = weight.kernel_layout()  # (B, 32, R), (B, R), (B, R) or None
    x_sums = act.s if act.s is not None else torch.zeros_like(act.d)  # (T, B)
    mins = mins if mins is not None else np.zeros_like(scales)
    out = kernels.vec_dot_blocks(act.q.to(F32).contiguous().numpy(), act.d.to(F32).contiguous().numpy(),
                                 quants, scales, x_sums.to(F32).contiguous().numpy(), mins,
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


@functools.cache
def l1_data_cache() -> tuple[int, int, int]:
    """(bytes per core, ways, line bytes) of this CPU's L1 data cache as gemm reads them (Linux
    sysfs: the size divided among the CPUs sharing it), else gemm's x86 default (32 KiB, 8, 64)."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in sorted(root.glob("index*")):
            def read(name: str) -> str:
                return (index / name).read_text().strip()

            if read("level") == "1" and read("type") in ("Data", "Unified"):
                sharing = sum(int(b) - int(a) + 1 if "-" in part else 1
                              for part in read("shared_cpu_list").split(",")
                              for a, _, b in [part.partition("-")])
                size = read("size")
                scale = {"K": 1024, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
                number = int(size.rstrip("KMG")) * scale
                return number // max(sharing, 1), int(read("ways_of_associativity")), int(read("coherency_line_size"))
    except (OSError, ValueError):
        pass
    return 32 * 1024, 8, 64


def gemm_depth_block(m: int, n: int, k: int) -> int:
    """The depth block (kc) gemm 0.17 sums an f32 (m, k) @ (k, n) in: min(k, 512) for small
    products (m, n <= 64), else `kernel_params`: an L1-sized block of at least 512, then k split
    into equal blocks (576 -> 288 + 288)."""
    if m <= GEMM_SMALL and n <= GEMM_SMALL:
        return min(k, GEMM_MIN_DEPTH)
    size, ways, line = l1_data_cache()
    size, ways, line = max(size, 32 * 1024), max(ways, 2), max(line, 64)
    set_bytes = line * (size // (line * ways))  # one way of L1: line × number of sets
    divisor = math.gcd(GEMM_MR * 4, set_bytes)
    kc_0 = set_bytes // divisor
    ways_per_panel = GEMM_MR * 4 // divisor + GEMM_NR * kc_0 * 4 // set_bytes
    multiplier = max(ways // ways_per_panel, 1)
    block = min(max(kc_0 * (1 << (multiplier - 1).bit_length()), GEMM_MIN_DEPTH), k)
    return -(-k // -(-k // block))  # k in ceil(k / block) equal blocks


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (..., M, K) @ b (..., K, N) as the gemm crate sums it: per depth block one f32 FMA chain
    per output, k in order from zero (its microkernel), the blocks' sums added into the output in
    order -> (..., M, N) (`tracer.ggml.kernels.fma_chains`). One row or column (M or N = 1, K > 2)
    goes through its gemv (`gemv_dot`): the path it takes where b is a transposed matrix, as in
    candle's x·wᵀ and q·kᵀ."""
    from tracer.ggml import kernels  # numba compiles these kernels: loaded by the ops that run them

    a, b = a.detach().to(F32), b.detach().to(F32)
    depth = a.shape[-1]
    if depth > 2 and a.shape[-2] == 1:
        return gemv_dot(a, b.transpose(-1, -2)).unsqueeze(-2)  # (..., 1, K) with (..., N, K) -> (..., 1, N)
    if depth > 2 and b.shape[-1] == 1:
        return gemv_dot(a, b.transpose(-1, -2)).unsqueeze(-1)  # (..., M, K) with (..., 1, K) -> (..., M, 1)
    block = gemm_depth_block(a.shape[-2], b.shape[-1], depth)
    out = None
    for start in range(0, depth, block):
        part = torch.from_numpy(kernels.fma_chains(a[..., start:start + block].numpy(),
                                                   b[..., start:start + block, :].numpy(),
                                                   threads=torch.get_num_threads()))
        out = part if out is None else out + part
    return out


def gemv_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (..., K) · b (..., K) -> (...) (broadcast) as gemm's `mixed_gemv_rowmajor` (FMA kernel)
    sums a row: 8 accumulators of 8 lanes, one FMA per value over 64-value chunks; the
    accumulators added in a tree, the leftover 8-value chunks FMA'd into the first; its 8 lanes
    added in order, then the leftover values FMA'd one by one."""
    a, b = torch.broadcast_tensors(a, b)
    lead, depth = a.shape[:-1], a.shape[-1]
    whole, lanes = depth // 64 * 64, depth // 8 * 8
    acc = torch.zeros(*lead, 8, 8, dtype=F32)  # (..., accumulator, lane)
    for start in range(0, whole, 64):
        chunk = (*lead, 8, 8)
        acc = fma(a[..., start:start + 64].reshape(chunk), b[..., start:start + 64].reshape(chunk), acc)
    pairs = acc[..., 0::2, :] + acc[..., 1::2, :]  # (..., 4, 8): acc0+acc1, acc2+acc3, ...
    quads = pairs[..., 0::2, :] + pairs[..., 1::2, :]  # (..., 2, 8)
    lane_acc = quads[..., 0, :] + quads[..., 1, :]  # (..., 8)
    for start in range(whole, lanes, 8):
        lane_acc = fma(a[..., start:start + 8], b[..., start:start + 8], lane_acc)
    out = lane_acc[..., 0]
    for lane in range(1, 8):
        out = out + lane_acc[..., lane]
    for i in range(lanes, depth):
        out = fma(a[..., i], b[..., i], out)
    return out


def matmul_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(T, R): `QMatMul` on an F32/F16 tensor: dequantized (F16 -> f32 is exact), then x @ wᵀ by
    gemm."""
    return gemm(x, weight.to(F32).T)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The candle engine's RMSNorm: m = sqrt(vec_sum(x²) / n + eps), x / m · w (f32 throughout)."""
    x = x.to(F32)
    n = torch.tensor(float(x.shape[-1]), dtype=F32)
    mean = vec_sum(x * x) / n + torch.tensor(eps, dtype=F32)
    # f64's sqrt rounded to f32 is f32's correctly rounded sqrt; torch's f32 sqrt (SLEEF) is 1 ulp off at times
    m = torch.sqrt(mean.to(F64)).to(F32)[..., None]  # (1, T, 1)
    return x / m * weight.to(F32)


def candle_inv_freq(theta: float, head_dim: int, *, f64: bool = False, factors=None) -> np.ndarray:
    """(D/2,) f32: `(0..D).step_by(2).map(|i| 1f32 / theta.powf(i as f32 / D as f32))`, libm's powf
    as Rust's f32::powf calls it (llama.rs, mistral.rs, quantized_llama.rs). `f64`: the other model files'
    `1f32 / theta.powf(i as f64 / D as f64) as f32` (qwen2.rs, gemma2.rs, phi3.rs, ...), libm's pow in f64
    (Python's float power calls it) rounded to f32. `factors` (f32, one per pair): phi3.rs' longrope
    table, `f / theta.powf(..) as f32`, as long as the shorter of the two (Rust's `zip`)."""
    pairs = range(0, head_dim, 2)
    if f64:
        powers = [np.float32(float(theta) ** (i / head_dim)) for i in pairs]
    else:
        base = np.float32(theta)
        powers = [np.float32(powf(float(base), float(np.float32(i) / np.float32(head_dim)))) for i in pairs]
    numerators = [np.float32(1.0)] * len(powers) if factors is None else [np.float32(f) for f in factors]
    return np.array([n / p for n, p in zip(numerators, powers)], dtype=np.float32)


def rope_angles(inv_freq: np.ndarray, positions) -> np.ndarray:
    """(T, D/2) f32: position × frequency for absolute `positions` (T,), exact in f32 (candle's
    (P, 1) @ (1, D/2) matmul has one product per entry)."""
    return np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]


def rotary(spec, positions: torch.Tensor, dtype, device="cpu", layer_type: str = "full_attention"):
    """cos, sin (1, T, D) in half-split layout from candle's tables at absolute `positions` (T,):
    `1f32 / theta.powf(i/D)` per pair, position × frequency, then libm's cosf/sinf (Rust's f32::cos/sin).
    quantized_llama.rs reads no rope scaling: a scaled model is refused, not rotated as if unscaled."""
    if spec.rope_scaling is not None:
        raise TracerError(f"rope_type {spec.rope_scaling['rope_type']!r} is not emulated by the candle regime "
                          "(quantized_llama.rs reads rope_freq_base only)")
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
    scores = gemm(q_g, k_g.transpose(-1, -2)) * scale + 0.0  # (1, H, T, T)
    record(SCORES, scores)
    probs = softmax(steps.mask(scores, visible))
    record(PROBS, probs)
    return gemm(probs, v.to(F32))  # (1, H, T, D)


def glu(gate: torch.Tensor, up: torch.Tensor, hidden_act: str) -> torch.Tensor:
    """candle_nn::ops::silu(gate) * up: v / (1 + exp(−v)) with glibc's expf, then the product."""
    if hidden_act != "silu":
        raise TracerError(f"ops=candle emulates quantized_llama.rs' SwiGLU only (hidden_act {hidden_act!r})")
    return silu_scalar(gate.to(F32)) * up.to(F32)


def apply_ops(steps):
    """`steps` with candle's f32 kernels (ops=candle) put in."""
    return steps.replace(norm=rms_norm, rotary=rotary, attention=attention, glu=glu)


# --- the regime a candle run implies -------------------------------------------------------------


def implied_regime(weight_types: dict[str, str], architecture: str = "llama") -> tuple[dict, list[str]]:
    """The reimpl variant reproducing candle's quantized_llama.rs on these GGUF tensor types, and
    what of it is not bit-exact. A GGUF of another architecture (`general.architecture`: quantized_qwen2.rs,
    its q/k rows unpermuted and biased) is not emulated: refused in one line.

    Example:
        >>> implied_regime({"model.layers.0.self_attn.q_proj.weight": "q4_1"})
        ({'preset': 'candle-q', 'weights': 'gguf'}, [])
    """
    if architecture != "llama":
        raise TracerError(f"candle's regime emulates quantized_llama.rs only: run this {architecture} GGUF without "
                          "--regime")
    caveats = []
    for kind in sorted(set(weight_types.values()) - EXACT_WEIGHT_TYPES):
        names = [name for name, t in weight_types.items() if t == kind]
        caveats.append(f"{kind.upper()} weights ({len(names)} tensors, e.g. {names[0]}): candle's kernel for it "
                       "is not emulated; accumulated in f64")
    return {"preset": "candle-q", "weights": "gguf"}, caveats
