"""Q4_0 and IQ4_NL weights as llama.cpp's x86 CPU backend multiplies them: repacked at load, or
not (ggml-cpu/repack.cpp, arch/x86/repack.cpp, llamafile/sgemm.cpp, arch/x86/quants.c).

On a build with the CPU_REPACK buffer (REPACK) and AVX2, a Q4_0 or IQ4_NL weight with a multiple
of 8 rows is repacked when it is loaded (`ggml_repack_get_optimal_repack_type`: q4_0_8x8_q8_0,
iq4_nl_8x8_q8_0): every weight a MUL_MAT reads, the projections and `output` (a tied output is
loaded a second time for it), but not `token_embd`, which GET_ROWS reads. Its matmul
(`tensor_traits::forward_mul_mat`) quantizes the activations to Q8_0 (four rows at a time by
`ggml_quantize_mat_q8_0_4x8`: the same numbers as `quantize_row_q8_0`) and runs
`ggml_gemm_*_8x8_q8_0` on whole groups of 4 rows, `ggml_gemv_*` on the rest. Both keep one f32
accumulator per output: per block the 32 integer products summed exactly (int32), then
`acc = fma(f32(sum), d_w * d_x, acc)` over the blocks in order (`d_w * d_x`: two f16 values, exact).
How rows are split between gemm and gemv, tiles and threads changes nothing in that.

Otherwise the weight stays as stored: Q4_0 takes `ggml_vec_dot_q4_0_q8_0` or, from 2 rows,
tinyBLAS_Q0_AVX, both the 8-lane order `tracer.ggml.vecdot` emulates. IQ4_NL takes tinyBLAS_Q0_AVX
from 2 rows (the same 8-lane order), and for one row (or without LLAMAFILE)
`ggml_vec_dot_iq4_nl_q8_0`: two 8-lane accumulators, even blocks in the first and odd ones in the
second, `hsum_float_8(acc1 + acc2)`, then a last odd block added by the scalar loop's
`sumf += d * (sumi1 + sumi2)`: `fma(d_w * d_x, f32(sum), total)`, or on a build tuned for AMD Zen
(`ops.contracts_fma_chains`) the product rounded before the add.

Notation: T tokens, R outputs (weight rows), B blocks of 32 along the inner axis.
"""

from __future__ import annotations

import torch

from tracer.ggml import kernels, ops
from tracer.ggml.floats import F32, fma, hsum8
from tracer.ggml.quants import ActBlocks, Blocks
from tracer.ggml.vecdot import matmul_ggml

REPACKED = ("q4_0", "iq4_nl")  # the 4-bit, one-scale types repack.cpp interleaves 8 rows of on AVX2


def repacks(weight: Blocks, features: frozenset[str]) -> bool:
    """Whether llama.cpp's build with `features` repacks this weight at load (a MUL_MAT operand)."""
    return weight.kind in REPACKED and weight.shape[0] % 8 == 0 and {"REPACK", "AVX2"} <= features


def emulates(weight, act: ActBlocks) -> bool:
    """Whether `matmul` computes this pair: a Q4_0/IQ4_NL weight (unpacked) with Q8_0 activations."""
    return isinstance(weight, Blocks) and weight.kind in REPACKED and weight.unpacked and act.kind == "q8_0"


def matmul(act: ActBlocks, weight: Blocks, features: frozenset[str] | None = None) -> torch.Tensor:
    """act (T, B, 32) Q8_0, weight (R, C) Q4_0/IQ4_NL -> (T, R) f32, summed as llama.cpp's build
    with `features` (default: this one's) sums them."""
    features = ops.llamacpp_cpu_features() if features is None else features
    tokens = act.q.shape[0]
    if repacks(weight, features):
        quants, scales, _ = weight.kernel_layout()  # (B, 32, R), (B, R)
        x_q, x_d = act.q.to(F32).contiguous().numpy(), act.d.to(F32).contiguous().numpy()  # (T, B, 32), (T, B)
        out = kernels.block_chains(x_q, x_d, quants, scales, torch.get_num_threads())
        return torch.from_numpy(out)
    if weight.kind == "q4_0" or (tokens >= 2 and "LLAMAFILE" in features):  # vec_dot / tinyBLAS_Q0_AVX
        return matmul_ggml(act, weight)
    return vec_dot_iq4_nl(act, weight, features)


def vec_dot_iq4_nl(act: ActBlocks, weight: Blocks, features: frozenset[str]) -> torch.Tensor:
    """(T, R): `ggml_vec_dot_iq4_nl_q8_0` (AVX2) for every output, a token at a time, as the build
    with `features` compiles its scalar loop (arch/x86/quants.c)."""
    rows, blocks = weight.q.shape[:2]
    pairs = blocks - blocks % 2
    w_lanes = weight.q.to(F32).unflatten(-1, (8, 4))  # (R, B, 8, 4)
    out = []
    for x_q, x_d in zip(act.q.to(F32), act.d):  # (B, 32), (B,)
        lanes = (w_lanes * x_q.unflatten(-1, (8, 4))).sum(-1)  # (R, B, 8): 4 products each, exact
        scale = weight.d * x_d  # (R, B): f16 * f16, exact
        acc = torch.zeros(2, rows, 8, dtype=F32)  # even blocks, odd blocks
        for b in range(pairs):
            acc[b % 2] = fma(scale[:, b, None], lanes[:, b], acc[b % 2])
        total = hsum8(acc[0] + acc[1])  # (R,)
        if pairs < blocks:  # the last block of an odd count, in the scalar loop
            last = lanes[:, -1].sum(-1)  # (R,): sumi1 + sumi2, exact
            fused = ops.contracts_fma_chains(features)
            total = fma(scale[:, -1], last, total) if fused else total + scale[:, -1] * last
        out.append(total)
    return torch.stack(out)
