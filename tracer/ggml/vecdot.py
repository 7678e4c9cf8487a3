"""Quantized matrix products: y = x · Wᵀ with W in a GGUF block type and x quantized to its vec-dot type.

Two accumulations of the same quantized operands:

- `ggml`: the order of `ggml_vec_dot_*` on x86 with AVX2 (AVX-512 machines take the same code;
  ggml-cpu/arch/x86/quants.c). Per 32-value block the int8 products are summed into 8 lanes of 4
  consecutive values (`_mm256_maddubs_epi16` + `_mm256_madd_epi16`, exact in int32), each lane is
  accumulated over the blocks with one f32 FMA, `acc = fma(d_w*d_x, lane, acc)` (Q5_1:
  `fma(lane, d_w*d_x, acc)`, the same value), the 8 lanes are summed by `hsum_float_8`, and for
  Q4_1/Q5_1 the min terms `m_w * s_x` are summed separately in f32 and added last (both are f16
  values, so the product is exact and GCC's contraction of `summs += m*s` changes nothing). llamafile's
  tinyBLAS (`tinyBLAS_Q0_AVX`, taken for Q8_0/Q4_0/Q5_0 weights when several rows are multiplied at
  once) keeps one such 8-lane accumulator per output and the same hsum, so its results are the same numbers.
- `f64`: every product and sum exact in f64 (the operands' products fit), rounded to f32 once:
  what any summation order approaches; the regime's noise floor compares the two.
- `f32`: the same operands through torch's f32 BLAS: another valid f32 summation order, fast.

Pairs without an emulated kernel (k-quant weights, an activation type ggml does not pair with the
weight type) are accumulated in f64 from dequantized values.

Notation: T tokens (rows of x), R output features, C input features, B = C/32 blocks.
"""

from __future__ import annotations

import torch

from tracer.ggml.floats import F32, F64
from tracer.ggml.kquants import KQUANT_TYPES, KBlocks
from tracer.ggml.quants import ActBlocks, Blocks

# (weight type, activation type) pairs whose x86 kernels are emulated here (k-quants: each of
# llama.cpp's paths for them, `tracer.ggml.kmatmul`).
KERNELS = {("q4_0", "q8_0"), ("q4_1", "q8_1"), ("q5_0", "q8_0"), ("q5_1", "q8_1"), ("q8_0", "q8_0")} | \
    {(kind, "q8_k") for kind in KQUANT_TYPES}


def matmul_ggml(act: ActBlocks, weight: Blocks) -> torch.Tensor:
    """(T, R): every `ggml_vec_dot_<weight>_<act>` of a matmul, in ggml's order, by the compiled
    loop of `tracer.ggml.kernels` (on as many threads as torch uses); k-quants by the path
    llama.cpp takes for this weight and this many rows (`tracer.ggml.kmatmul`)."""
    if isinstance(weight, KBlocks):
        from tracer.ggml.kmatmul import matmul_kquant  # numba compiles these kernels: loaded by the ops that run them

        return matmul_kquant(act, weight)
    from tracer.ggml import kernels  # numba compiles these kernels: loaded by the ops that run them

    quants, scales, mins = weight.kernel_layout()  # (B, 32, R), (B, R), (B, R) or None
    x_sums = None if mins is None else act.s.to(F32).contiguous().numpy()
    out = kernels.vec_dot_blocks(act.q.to(F32).contiguous().numpy(), act.d.to(F32).contiguous().numpy(),
                                 quants, scales, x_sums, mins, threads=torch.get_num_threads())
    return torch.from_numpy(out)


def matmul_blas(act: ActBlocks | torch.Tensor, weight: Blocks | torch.Tensor, dtype: torch.dtype = F64) -> torch.Tensor:
    """(T, R): the same quantized operands multiplied by torch's BLAS in `dtype`, rounded to f32.
    In f64 every product is exact and the sums all but exact (`accumulate=f64`); in f32 the sums
    take BLAS's own order, another valid f32 order (`accumulate=f32`, the fast one).

    Q4_1/Q5_1 weights with Q8_1 activations keep ggml's split: (d_w q_w)·(d_x q_x) + m_w·s_x, with
    s_x the block's f16 sum; otherwise the dequantized values are multiplied."""
    x = (act.values() if isinstance(act, ActBlocks) else act).to(dtype)
    if isinstance(weight, Blocks) and weight.unpacked and weight.m is not None and isinstance(act, ActBlocks) \
            and act.s is not None:
        return (x @ weight.scaled(dtype).T + act.s.to(dtype) @ weight.m.to(dtype).T).to(F32)
    w = weight.values() if isinstance(weight, Blocks) else weight
    return (x @ w.to(dtype).T).to(F32)


def matmul_f64(act: ActBlocks | torch.Tensor, weight: Blocks | torch.Tensor) -> torch.Tensor:
    """`matmul_blas` in f64: products exact, sums all but exact, rounded to f32 once."""
    return matmul_blas(act, weight, F64)


def has_kernel(weight: Blocks, act: ActBlocks) -> bool:
    return weight.unpacked and (weight.kind, act.kind) in KERNELS
