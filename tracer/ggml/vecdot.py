"""Quantized matrix products: y = x · Wᵀ with W in a GGUF block type and x quantized to its vec-dot type.

Two accumulations of the same quantized operands:

- `ggml`: the order of `ggml_vec_dot_*` on x86 with AVX2 (AVX-512 machines take the same code;
  ggml-cpu/arch/x86/quants.c). Per 32-value block the int8 products are summed into 8 lanes of 4
  consecutive values (`_mm256_maddubs_epi16` + `_mm256_madd_epi16`, exact in int32), each lane is
  accumulated over the blocks with one f32 FMA, `acc = fma(d_w*d_x, lane, acc)` (Q5_1:
  `fma(lane, d_w*d_x, acc)`, the same value), the 8 lanes are summed by `hsum_float_8`, and for
  Q4_1/Q5_1 the min terms `m_w * s_x` are summed separately in f32 and added last (both are f16
  values, so the product is exact and GCC's contraction of `summs += m*s` changes nothing). llamafile's tinyBLAS (`tinyBLAS_Q0_AVX`, taken for Q8_0/Q4_0/Q5_0
  weights when several rows are multiplied at once) keeps one such 8-lane accumulator per output
  and the same hsum, so its results are the same numbers.
- `f64`: every product and sum exact in f64 (the operands' products fit), rounded to f32 once:
  what any summation order approaches; the regime's noise floor compares the two.
- `f32`: the same operands through torch's f32 BLAS: another valid f32 summation order, fast.

Pairs without an emulated kernel (k-quant weights, an activation type ggml does not pair with the
weight type) are accumulated in f64 from dequantized values.

Notation: T tokens (rows of x), R output features, C input features, B = C/32 blocks.
"""

from __future__ import annotations

import torch

from tracer.ggml.floats import F32, F64, fma_, hsum8
from tracer.ggml.quants import ActBlocks, Blocks

# (weight type, activation type) pairs whose x86 ggml_vec_dot kernel is emulated here.
KERNELS = {("q4_0", "q8_0"), ("q4_1", "q8_1"), ("q5_0", "q8_0"), ("q5_1", "q8_1"), ("q8_0", "q8_0")}
CHUNK_ELEMENTS = 1 << 20  # lane sums held at once (B*8 * tokens * rows): 4 MB, cache-sized


def lane_sums(wq: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """wq (R, B, 32), xq (T, B, 32) integer quants -> (B, 8, T, R): per block and lane l the exact
    sum of the 4 products of values 4l..4l+3 (what `_mm256_madd_epi16(ones, maddubs(...))` holds)."""
    rows, blocks, _ = wq.shape
    w = wq.to(F32).reshape(rows, blocks * 8, 4).permute(1, 2, 0)  # (B*8, 4, R)
    return torch.bmm(_act_lanes(xq), w).unflatten(0, (blocks, 8))  # (B, 8, T, R), exact: |sum| < 2^24


def _act_lanes(xq: torch.Tensor) -> torch.Tensor:
    """(T, B, 32) -> (B*8, T, 4) f32."""
    return xq.to(F32).reshape(xq.shape[0], -1, 4).permute(1, 0, 2).contiguous()


def matmul_ggml(act: ActBlocks, weight: Blocks, contract_min: bool = True) -> torch.Tensor:
    """(T, R): every `ggml_vec_dot_<weight>_<act>` of a matmul, in chunks of rows and tokens small
    enough for the lane sums to stay in cache."""
    w_lanes, w_scales = weight.lanes()  # (B*8, R, 4), (B, R)
    w_mins = None if weight.m is None else weight.m.T.contiguous()  # (B, R)
    x_lanes = _act_lanes(act.q)  # (B*8, T, 4)
    (groups, tokens, _), rows = x_lanes.shape, weight.shape[0]
    token_chunk = min(tokens, 64)
    row_chunk = max(16, CHUNK_ELEMENTS // (groups * token_chunk))
    out = torch.empty(tokens, rows, dtype=F32)
    for t0 in range(0, tokens, token_chunk):
        t1 = min(t0 + token_chunk, tokens)
        for r0 in range(0, rows, row_chunk):
            r1 = min(r0 + row_chunk, rows)
            w = w_lanes[:, r0:r1].transpose(1, 2)  # (B*8, 4, r)
            lanes = torch.bmm(x_lanes[:, t0:t1], w).unflatten(0, (-1, 8))  # (B, 8, t, r)
            mins = None if w_mins is None else (act.s[t0:t1], w_mins[:, r0:r1])
            out[t0:t1, r0:r1] = _accumulate(lanes, act.d[t0:t1], w_scales[:, r0:r1], mins, contract_min)
    return out


def _accumulate(lanes: torch.Tensor, x_scales: torch.Tensor, w_scales: torch.Tensor, mins, contract_min: bool):
    """The f32 chain over blocks: lanes (B, 8, t, r), x_scales (t, B), w_scales (B, r), mins
    (s (t, B), m (B, r)) or None -> (t, r)."""
    acc = torch.zeros(lanes.shape[1:], dtype=F32)  # (8, t, r)
    scales = x_scales.T[:, :, None] * w_scales[:, None, :]  # (B, t, r): f16*f16, exact in f32
    for b in range(lanes.shape[0]):
        fma_(acc, scales[b], lanes[b])
    summs = None
    if mins is not None:
        s, m = mins[0].T[:, :, None], mins[1][:, None, :]  # (B, t, 1), (B, 1, r)
        summs = torch.zeros(lanes.shape[2:], dtype=F32)  # (t, r)
        for b in range(lanes.shape[0]):
            summs = fma_(summs, s[b], m[b]) if contract_min else summs.add_(s[b] * m[b])
    out = hsum8(acc.permute(1, 2, 0))  # (t, r)
    return out if summs is None else out + summs


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
