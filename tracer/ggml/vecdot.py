"""Quantized matrix products: y = x · Wᵀ with W in a GGUF block type and x quantized to its vec-dot type.

Two accumulations of the same quantized operands:

- `ggml`: the order of `ggml_vec_dot_*` on x86 with AVX2 (AVX-512 machines take the same code;
  ggml-cpu/arch/x86/quants.c). Per 32-value block the int8 products are summed into 8 lanes of 4
  consecutive values (`_mm256_maddubs_epi16` + `_mm256_madd_epi16`, exact in int32), each lane is
  accumulated over the blocks with one f32 FMA, `acc = fma(d_w*d_x, lane, acc)` (Q5_1:
  `fma(lane, d_w*d_x, acc)`, the same value), the 8 lanes are summed by `hsum_float_8`, and for
  Q4_1/Q5_1 the min terms `m_w * s_x` are summed separately in f32 (an FMA chain: GCC contracts
  `summs += m*s`) and added last. llamafile's tinyBLAS (`tinyBLAS_Q0_AVX`, taken for Q8_0/Q4_0/Q5_0
  weights when several rows are multiplied at once) keeps one such 8-lane accumulator per output
  and the same hsum, so its results are the same numbers.
- `f64`: every product and sum exact in f64 (the operands' products fit), rounded to f32 once:
  what any summation order approaches; the regime's noise floor compares the two.

Pairs without an emulated kernel (k-quant weights, an activation type ggml does not pair with the
weight type) are accumulated in f64 from dequantized values.

Notation: T tokens (rows of x), R output features, C input features, B = C/32 blocks.
"""

from __future__ import annotations

import torch

from tracer.ggml.floats import F32, F64, fma, hsum8
from tracer.ggml.quants import ActBlocks, Blocks

# (weight type, activation type) pairs whose x86 ggml_vec_dot kernel is emulated here.
KERNELS = {("q4_0", "q8_0"), ("q4_1", "q8_1"), ("q5_0", "q8_0"), ("q5_1", "q8_1"), ("q8_0", "q8_0")}
CHUNK_ELEMENTS = 1 << 23  # lane sums held at once: B*8 * T_chunk * R_chunk


def lane_sums(wq: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """wq (R, B, 32), xq (T, B, 32) integer quants -> (B, 8, T, R): per block and lane l the exact
    sum of the 4 products of values 4l..4l+3 (what `_mm256_madd_epi16(ones, maddubs(...))` holds)."""
    rows, blocks, _ = wq.shape
    w = wq.to(F32).reshape(rows, blocks * 8, 4).permute(1, 2, 0)  # (B*8, 4, R)
    x = xq.to(F32).reshape(xq.shape[0], blocks * 8, 4).permute(1, 0, 2)  # (B*8, T, 4)
    return torch.bmm(x, w).unflatten(0, (blocks, 8))  # (B, 8, T, R), exact: |sum| < 2^24


def _chunk_ggml(weight: Blocks, act: ActBlocks, contract_min: bool) -> torch.Tensor:
    """(T, R) for one chunk of tokens and rows, in ggml_vec_dot's order."""
    lanes = lane_sums(weight.q, act.q)  # (B, 8, T, R)
    acc = torch.zeros(lanes.shape[1:], dtype=F32)  # (8, T, R)
    summs = torch.zeros(lanes.shape[2:], dtype=F32)  # (T, R)
    for b in range(lanes.shape[0]):
        scale = act.d[:, b, None] * weight.d[None, :, b]  # (T, R): f16*f16, exact in f32
        acc = fma(scale, lanes[b], acc)
        if weight.m is not None:
            term = act.s[:, b, None] * weight.m[None, :, b]  # (T, R) broadcast
            summs = fma(act.s[:, b, None], weight.m[None, :, b], summs) if contract_min else summs + term
    out = hsum8(acc.permute(1, 2, 0))  # (T, R)
    return out + summs if weight.m is not None else out


def matmul_ggml(act: ActBlocks, weight: Blocks, contract_min: bool = True) -> torch.Tensor:
    """(T, R): every `ggml_vec_dot_<weight>_<act>` of a matmul, chunked to bound memory."""
    tokens, rows, blocks = act.q.shape[0], weight.shape[0], weight.q.shape[1]
    row_chunk = max(1, min(rows, CHUNK_ELEMENTS // max(1, blocks * 8 * tokens)))
    token_chunk = max(1, min(tokens, CHUNK_ELEMENTS // (blocks * 8 * row_chunk)))
    out = torch.empty(tokens, rows, dtype=F32)
    for r0 in range(0, rows, row_chunk):
        w = Blocks(weight.kind, weight.shape, weight.d[r0:r0 + row_chunk], weight.q[r0:r0 + row_chunk],
                   None if weight.m is None else weight.m[r0:r0 + row_chunk])
        for t0 in range(0, tokens, token_chunk):
            a = ActBlocks(act.kind, act.d[t0:t0 + token_chunk], act.q[t0:t0 + token_chunk],
                          None if act.s is None else act.s[t0:t0 + token_chunk])
            out[t0:t0 + token_chunk, r0:r0 + row_chunk] = _chunk_ggml(w, a, contract_min)
    return out


def matmul_f64(act: ActBlocks | torch.Tensor, weight: Blocks | torch.Tensor) -> torch.Tensor:
    """(T, R): the same quantized operands, products and sums exact in f64, rounded to f32 once.

    Q4_1/Q5_1 weights with Q8_1 activations keep ggml's split: (d_w q_w)·(d_x q_x) + m_w·s_x, with
    s_x the block's f16 sum; otherwise the dequantized values are multiplied."""
    x = act.values() if isinstance(act, ActBlocks) else act
    if isinstance(weight, Blocks) and weight.unpacked and weight.m is not None and isinstance(act, ActBlocks) \
            and act.s is not None:
        scaled = (weight.q.to(F64) * weight.d[..., None].to(F64)).flatten(-2)  # (R, C): d*q, no min
        out = x.to(F64) @ scaled.T + act.s.to(F64) @ weight.m.to(F64).T
        return out.to(F32)
    w = weight.values() if isinstance(weight, Blocks) else weight
    return (x.to(F64) @ w.to(F64).T).to(F32)


def has_kernel(weight: Blocks, act: ActBlocks) -> bool:
    return weight.unpacked and (weight.kind, act.kind) in KERNELS
