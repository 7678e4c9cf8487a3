"""candle's integer arithmetic, compiled: its activation quantizers (Q8_0, Q8_1, Q8_K) and the
AVX2 vec_dot kernels for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K weights (candle-core 0.4.2, the wheel the
candle engine runs: `quantized/k_quants.rs` `from_float`, `quantized/avx.rs` `vec_dot_q*k_q8k`; the
wheel is built for AVX2/FMA, so `vec_dot` takes avx.rs' kernels, never the generic loops).

Q8_0 / Q8_1 (`BlockQ8_0/BlockQ8_1::from_float`): per 32 values `d = amax/127`, `id = 1/d`,
`q = f32::round(x·id)` (ties away from zero); Q8_1's `s = f16(f16(Σq)·f16(d))`.
Q8_K in 0.4.2 (`BlockQ8K::from_float`): per 256 values `max` is the first value of largest
magnitude, `iscale = -128/max` (0.11 and ggml take -127/max), `q = min(127, f32::round(iscale·x))`
(q = -128 where x = max), `d = 1/iscale` kept in f32, and `bsums` the sums of 16 consecutive
quants. An all-zero block has d = 0 and quants 0.

The kernels take the block's integers exactly as ggml's AVX2 kernels of the same era do: per
super-block, 8 int32 lanes, lane l summing scale·quant·q8 over the values p with (p mod 32) div 4
== l (`maddubs` pairs, `madd` pairs: 4 consecutive values of each 32-value run), then one f32 FMA
per lane `acc_l = fma(d, f32(lane_l), acc_l)` with `d = y.d·x.d` (an f32 product), and
`hsum_float_8` at the end. The mins (terms `dmin·Σ min·bsum`) differ per type:

- Q4_K: 4 more lanes, `acc_m_k = fma(-y.d·x.dmin, f32(m_2k·S_2k + m_2k+1·S_2k+1), acc_m_k)` with
  S the 32-value sums, reduced `(m0 + m2) + (m1 + m3)` and added after `hsum_float_8`;
- Q5_K: one f32 `summs += (-y.d·x.dmin) · f32(Σ m_s·S_s)` (two roundings: Rust does not
  contract), added after `hsum_float_8`;
- Q2_K: into the same 8 lanes, before the block's quants: `acc_l = fma(-y.d·x.dmin,
  f32(m_2l·b_2l + m_2l+1·b_2l+1), acc_l)` with b the 16-value sums;
- Q3_K, Q6_K: none (Q6_K's quants enter as q − 32, Q3_K's as −4..3).

Every lane sum is an integer of at most 2^24 in magnitude, so f32 holds it exactly in any order.
Verified against the wheel's `Tensor.quantize` and `QTensor.matmul_t`, on files llama.cpp's
quantizer wrote too (tests/unit/test_ggml_candle_kernels.py).

Notation: T tokens, R output features, B blocks of 32 or 256 values per row, S sub-blocks.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange
from torch.utils.weak import WeakIdKeyDictionary

from tracer.core.errors import TracerError
from tracer.ggml.floats import F32, round_f16
from tracer.ggml.kernels import ROW_TILE, TOKEN_TILE, fma32, pad_rows, set_threads
from tracer.ggml.kquants import QK_K, QUANT_ZERO, KBlocks
from tracer.ggml.quants import ACT_BLOCK, ActBlocks

# How each type's mins enter (see the module docstring); types without mins have none.
MINS_NONE, MINS_LANES4, MINS_SCALAR, MINS_LANES8 = 0, 1, 2, 3
MINS_MODE = {"q2_k": MINS_LANES8, "q3_k": MINS_NONE, "q4_k": MINS_LANES4, "q5_k": MINS_SCALAR, "q6_k": MINS_NONE}
KQUANT_KINDS = tuple(MINS_MODE)


# --- activations -------------------------------------------------------------------------------


@njit(cache=True)
def _round_away(v):  # pragma: no cover - compiled
    """f32::round: to nearest, ties away from zero (v − trunc(v) is exact in f32)."""
    whole = np.trunc(v)
    fraction = v - whole
    if fraction >= 0.5:
        return whole + np.float32(1.0)
    if fraction <= -0.5:
        return whole - np.float32(1.0)
    return whole


@njit(cache=True, parallel=True)
def _quantize(x, k_quant, q, d, sums):  # pragma: no cover - compiled
    """x (T, B, size) f32 -> q (T, B, size) quants, d (T, B) f32 scales, sums (T, B) Σq. k_quant:
    Q8_K's `iscale = -128/max` (max the first value of largest magnitude), `q = min(127,
    round(iscale·x))`, `d = 1/iscale`; else Q8_0/Q8_1's `d = amax/127`, `q = round(x·(1/d))`."""
    tokens, blocks, size = x.shape
    one, zero = np.float32(1.0), np.float32(0.0)
    for row in prange(tokens):
        for b in range(blocks):
            values = x[row, b]
            amax, peak = zero, zero
            for i in range(size):
                if amax < abs(values[i]):  # strict: the first of equal magnitudes stays
                    amax, peak = abs(values[i]), values[i]
            total = zero
            if k_quant:
                if amax == 0:
                    d[row, b] = zero
                    q[row, b] = zero
                    sums[row, b] = zero
                    continue
                iscale = np.float32(-128.0) / peak
                for i in range(size):
                    q[row, b, i] = min(_round_away(iscale * values[i]), np.float32(127.0))
                    total += q[row, b, i]
                d[row, b] = one / iscale
            else:
                scale = amax / np.float32(127.0)
                inverse = one / scale if scale != 0 else zero
                for i in range(size):
                    q[row, b, i] = _round_away(values[i] * inverse)
                    total += q[row, b, i]  # integers below 2^24: exact in any order
                d[row, b] = scale
            sums[row, b] = total


def quantize(x: torch.Tensor, kind: str) -> ActBlocks:
    """(T, C) f32 -> candle's `kind` blocks ("q8_0", "q8_1", "q8_k"), compiled: d (T, B) (Q8_0/Q8_1:
    the f16 value; Q8_K: f32), q (T, B, size), Q8_1's s.

    Raises:
        TracerError: a row that is not a whole number of blocks.
    """
    size = ACT_BLOCK[kind]
    if x.shape[-1] % size:
        raise TracerError(f"act_quant={kind}: a row of {x.shape[-1]} values is not a whole number of "
                          f"{size}-value blocks")
    blocks = np.ascontiguousarray(x.detach().to("cpu", F32).numpy().reshape(x.shape[0], -1, size))  # (T, B, size)
    q, d, sums = np.empty_like(blocks), np.empty(blocks.shape[:2], np.float32), np.empty(blocks.shape[:2], np.float32)
    set_threads(torch.get_num_threads())
    _quantize(blocks, kind == "q8_k", q, d, sums)
    q, d, sums = torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(sums)
    if kind == "q8_k":
        return ActBlocks(kind, d, q)
    d16 = round_f16(d)
    s = round_f16(round_f16(sums) * d16) if kind == "q8_1" else None  # half's Mul: the f32 product to f16
    return ActBlocks(kind, d16, q, s=s)


# --- weights, laid out for the kernel ------------------------------------------------------------

_LAYOUTS = WeakIdKeyDictionary()  # KBlocks -> its candle layout (goes with the weights)


def _layout(weight: KBlocks) -> tuple[np.ndarray, ...]:
    """weight's super-blocks as `_vec_dot_kquants` walks them (outputs last), cached:
    scaled (B, 256, R) f32 scale·(quant − zero) per value, d (B, R), dmin (B, R), mins (B, S, R)
    f32 (the last two empty without mins)."""
    if weight not in _LAYOUTS:
        sub = weight.sub_block
        signed = weight.q.to(torch.int32) - QUANT_ZERO.get(weight.kind, 0)  # (R, B, 256)
        scaled = signed * weight.scales.to(torch.int32).repeat_interleave(sub, -1)  # (R, B, 256)
        empty = np.zeros((0, 0), np.float32)
        _LAYOUTS[weight] = (
            scaled.to(F32).permute(1, 2, 0).contiguous().numpy(),  # (B, 256, R)
            weight.d.T.contiguous().numpy(),  # (B, R)
            empty if weight.dmin is None else weight.dmin.T.contiguous().numpy(),  # (B, R)
            np.zeros((0, 0, 0), np.float32) if weight.mins is None
            else weight.mins.to(F32).permute(1, 2, 0).contiguous().numpy())  # (B, S, R)
    return _LAYOUTS[weight]


# --- the kernels ---------------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def _vec_dot_kquants(xq, xd, xsums, wq, wd, wdmin, wmins, mode, out,
                     row_tile, token_tile):  # pragma: no cover - compiled
    """Every `vec_dot_q*k_q8k` (avx.rs) of a matmul. xq (T, B, 256) f32 activation quants, xd (T, B)
    scales, xsums (T, B, S) the activations' sums over each weight sub-block; wq (B, 256, R) f32
    scale·quant, wd / wdmin (B, R), wmins (B, S, R); mode: MINS_*. -> out (T, R). T a multiple
    of token_tile, R of row_tile (the caller pads)."""
    tokens, blocks = xd.shape
    rows = wd.shape[1]
    subs = wmins.shape[1]
    for tile in prange(rows // row_tile):
        r0 = tile * row_tile
        acc = np.empty((token_tile, 8, row_tile), np.float32)  # the 8 f32 lanes of `acc`
        acc_m = np.empty((token_tile, 4, row_tile), np.float32)  # Q4_K's 4 lanes of mins
        summs = np.empty((token_tile, row_tile), np.float32)  # Q5_K's scalar sum of mins
        lane = np.empty((token_tile, row_tile), np.float32)  # one int32 lane of a block
        mins = np.empty((token_tile, row_tile), np.float32)  # Σ min·sum of a block
        for t0 in range(0, tokens, token_tile):
            acc[:] = 0
            acc_m[:] = 0
            summs[:] = 0
            for b in range(blocks):
                w_scales = wd[b, r0:r0 + row_tile]
                if mode == MINS_LANES8:  # Q2_K: lane k += dmin·(m[2k]·b[2k] + m[2k+1]·b[2k+1]), first
                    w_dmin = wdmin[b, r0:r0 + row_tile]
                    for k in range(8):
                        m0, m1 = wmins[b, 2 * k, r0:r0 + row_tile], wmins[b, 2 * k + 1, r0:r0 + row_tile]
                        for u in range(token_tile):
                            s0, s1, dx = xsums[t0 + u, b, 2 * k], xsums[t0 + u, b, 2 * k + 1], xd[t0 + u, b]
                            acc_uk = acc[u, k]
                            for j in range(row_tile):
                                acc_uk[j] = fma32(-dx * w_dmin[j], m0[j] * s0 + m1[j] * s1, acc_uk[j])
                for k in range(8):  # lane k: values 4k..4k+3 of each 32-value run, integers (exact)
                    lane[:] = 0
                    for c in range(8):
                        p = 32 * c + 4 * k
                        w0, w1 = wq[b, p, r0:r0 + row_tile], wq[b, p + 1, r0:r0 + row_tile]
                        w2, w3 = wq[b, p + 2, r0:r0 + row_tile], wq[b, p + 3, r0:r0 + row_tile]
                        for u in range(token_tile):
                            x0, x1 = xq[t0 + u, b, p], xq[t0 + u, b, p + 1]
                            x2, x3 = xq[t0 + u, b, p + 2], xq[t0 + u, b, p + 3]
                            lane_u = lane[u]
                            for j in range(row_tile):
                                lane_u[j] += (x0 * w0[j] + x1 * w1[j]) + (x2 * w2[j] + x3 * w3[j])
                    for u in range(token_tile):  # acc = fma(d, f32(lane), acc), d = y.d·x.d
                        dx, acc_uk, lane_u = xd[t0 + u, b], acc[u, k], lane[u]
                        for j in range(row_tile):
                            acc_uk[j] = fma32(dx * w_scales[j], lane_u[j], acc_uk[j])
                if mode == MINS_LANES4 or mode == MINS_SCALAR:  # Q4_K, Q5_K: m·S over pairs of sub-blocks
                    w_dmin = wdmin[b, r0:r0 + row_tile]
                    for u in range(token_tile):
                        dx, mins_u = xd[t0 + u, b], mins[u]
                        mins_u[:] = 0
                        for k in range(subs // 2):
                            m0, m1 = wmins[b, 2 * k, r0:r0 + row_tile], wmins[b, 2 * k + 1, r0:r0 + row_tile]
                            s0, s1 = xsums[t0 + u, b, 2 * k], xsums[t0 + u, b, 2 * k + 1]
                            if mode == MINS_LANES4:
                                acc_mk = acc_m[u, k]
                                for j in range(row_tile):
                                    acc_mk[j] = fma32(-dx * w_dmin[j], m0[j] * s0 + m1[j] * s1, acc_mk[j])
                            else:
                                for j in range(row_tile):
                                    mins_u[j] += m0[j] * s0 + m1[j] * s1
                        if mode == MINS_SCALAR:  # summs += dmin·f32(Σ): two roundings
                            summs_u = summs[u]
                            for j in range(row_tile):
                                summs_u[j] = summs_u[j] + (-dx * w_dmin[j]) * mins_u[j]
            for u in range(token_tile):  # hsum_float_8, then the mins
                a, m = acc[u], acc_m[u]
                for j in range(row_tile):
                    total = ((a[0, j] + a[4, j]) + (a[2, j] + a[6, j])) + ((a[1, j] + a[5, j]) + (a[3, j] + a[7, j]))
                    if mode == MINS_LANES4:
                        total = total + ((m[0, j] + m[2, j]) + (m[1, j] + m[3, j]))
                    elif mode == MINS_SCALAR:
                        total = total + summs[u, j]
                    out[t0 + u, r0 + j] = total


def matmul(act: ActBlocks, weight: KBlocks) -> torch.Tensor:
    """(T, R): candle's `vec_dot_<weight>_q8k` for every (token, row), compiled (on as many threads
    as torch uses). act: Q8_K blocks of `quantize_q8_k`."""
    wq, wd, wdmin, wmins = _layout(weight)
    sub = weight.sub_block
    q = act.q.to(F32)  # (T, B, 256)
    sums = q.unflatten(-1, (QK_K // sub, sub)).sum(-1)  # (T, B, S): integers, exact
    tokens, rows = q.shape[0], weight.shape[0]
    xq = pad_rows(q.contiguous().numpy(), TOKEN_TILE, 0)
    xd = pad_rows(act.d.to(F32).contiguous().numpy(), TOKEN_TILE, 0)
    xsums = pad_rows(sums.contiguous().numpy(), TOKEN_TILE, 0)
    wq, wd = pad_rows(wq, ROW_TILE, 2), pad_rows(wd, ROW_TILE, 1)
    if wmins.size:
        wdmin, wmins = pad_rows(wdmin, ROW_TILE, 1), pad_rows(wmins, ROW_TILE, 2)
    out = np.empty((xd.shape[0], wd.shape[1]), np.float32)
    set_threads(torch.get_num_threads())
    _vec_dot_kquants(xq, xd, xsums, wq, wd, wdmin, wmins, MINS_MODE[weight.kind], out, ROW_TILE, TOKEN_TILE)
    return torch.from_numpy(out[:tokens, :rows])
