"""llama.cpp's k-quant × Q8_K matrix products on x86, compiled by numba: every path's integer sums
exact and its f32 steps in ggml's order (the paths and which tensor takes which:
`tracer.ggml.kmatmul`).

All paths share the integer part. A super-block's products (Q8_K quant × sub-block scale × quant)
are summed exactly, as ggml sums them in int32 (`_mm256_maddubs_epi16` + `_mm256_madd_epi16`, or
VNNI's `vpdpbusd`); they differ in how the integers are grouped before they meet floating point,
and in the f32 steps after:

- `VEC_DOT` (`ggml_vec_dot_q*_K_q8_K`, arch/x86/quants.c, AVX2; an AVX-512 build runs the same
  code): 8 int32 lanes per super-block, lane L holding values 4L..4L+3 of every 32-value chunk;
  each lane accumulated across super-blocks by one FMA, `acc[L] = fma(d_x*d_w, f32(lane), acc[L])`,
  then `hsum_float_8`. The mins: Q4_K in 4 f32 lanes of their own (`fma(-d_x*dmin, f32(m·bsums),
  acc_m)`, reduced and added last), Q5_K in one scalar (GCC contracts `summs += dmin*sum` to an
  FMA), Q2_K into the same 8 lanes, before the scales' FMA; Q6_K subtracts 32·scale·bsum from its
  lanes in integers (its quants are multiplied unsigned).
- `TILED` (tiled/tiled-kernel.cpp, from 8 activation rows; the AVX-512 VNNI microkernel and the
  AVX2 one round alike): per super-block `res = f32(s1)*d_w`, `res = fnmadd(dmin, f32(s2), res)`,
  `buf = fma(res, d_x, buf)` (GCC contracts the VNNI kernel's add of `res*d_x` to this FMA).
- `GEMV` / `GEMM` (weights repacked at load: Q4_K to q4_K_8x8, Q2_K to q2_K_8x8; arch/x86/repack.cpp):
  `acc = fma(f32(s), d_w*d_x, acc)` and `acc_min = fma(f32(m·bsums), dmin*d_x, acc_min)`, out
  `acc - acc_min`; the gemv once per super-block, the gemm once per 64 values (Q4_K) or 128 (Q2_K).

How the integers are summed here: in f32 by FMA chains, which are exact while every partial sum
stays below 2^24. Per lane (a 32nd of the values) and per group of at most 128 values the largest
is Q6_K's 16 · 127 · 63 · 128 < 2^24; each group's lane sums are then converted to int32 and
added there. The f32 steps use LLVM's `llvm.fma.f32`; numba neither contracts nor reassociates
without `fastmath` (`tracer.ggml.kernels`).

Notation: T tokens, R outputs, B super-blocks per row, S sub-blocks per super-block.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tracer.ggml.kernels import fma32, pad_rows, set_threads

VEC_DOT, TILED, GEMV, GEMM = 0, 1, 2, 3  # the paths (`mode`)
KIND_CODES = {"q2_k": 2, "q3_k": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6}
ROW_TILE = 64  # outputs per inner loop (vectorised)
TOKEN_TILE = 4  # tokens per pass over a tile of weights


@njit(cache=True)
def _min_terms(kind, b, j, bsums, mins, first, count):  # pragma: no cover - compiled
    """Σ mins[b, s, j] * (bsums of sub-block s) over sub-blocks first..first+count-1 (int):
    Q4_K/Q5_K's 32-value sub-blocks take two 16-value bsums each."""
    total = 0
    for s in range(first, first + count):
        block_sum = bsums[2 * s] + bsums[2 * s + 1] if kind in (4, 5) else bsums[s]
        total += mins[b, s, j] * block_sum
    return total


@njit(cache=True, parallel=True)
def _kquant_dot(xq, xd, xbs, w, wd, wdmin, wsc, wmin, out, kind, mode, group, row_tile, token_tile):
    # pragma: no cover - compiled
    """Every output of a k-quant × Q8_K matmul by path `mode`. xq (T, B, 256) f32 activation quants,
    xd (T, B) f32 scales, xbs (T, B, 16) int32 sums of 16 quants; w (B, 256, R) f32 scale*quant,
    wd / wdmin (B, R) f32 super-block scales, wsc / wmin (B, S, R) int32 sub-block scales and
    mins (wdmin / wmin (0, 0[, 0]) without mins) -> out (T, R). `group`: values per f32 partial
    sum (GEMM: per FMA step). T a multiple of token_tile, R of row_tile (callers pad)."""
    tokens, blocks = xd.shape
    rows = wd.shape[1]
    has_min = wmin.shape[0] > 0
    min_blocks = 8 if kind in (4, 5) else 16  # sub-blocks a super-block's mins run over
    for tile in prange(rows // row_tile):
        r0 = tile * row_tile
        lanes = np.empty((token_tile, 8, row_tile), np.float32)  # a group's lane sums (integers)
        ilanes = np.empty((token_tile, 8, row_tile), np.int32)  # a super-block's lane sums
        acc = np.empty((token_tile, 8, row_tile), np.float32)  # VEC_DOT: the 8 lanes; else [0] acc, [1] acc_min
        acc_m = np.empty((token_tile, 4, row_tile), np.float32)  # Q4_K's min lanes; Q5_K's summs in [0]
        for t0 in range(0, tokens, token_tile):
            acc[:] = 0
            acc_m[:] = 0
            for b in range(blocks):
                ilanes[:] = 0
                for g0 in range(0, 256, group):
                    lanes[:] = 0
                    for c in range(g0 // 32, (g0 + group) // 32):
                        for lane in range(8):
                            p = 32 * c + 4 * lane
                            w0, w1 = w[b, p, r0:r0 + row_tile], w[b, p + 1, r0:r0 + row_tile]
                            w2, w3 = w[b, p + 2, r0:r0 + row_tile], w[b, p + 3, r0:r0 + row_tile]
                            for u in range(token_tile):
                                x0, x1 = xq[t0 + u, b, p], xq[t0 + u, b, p + 1]
                                x2, x3 = xq[t0 + u, b, p + 2], xq[t0 + u, b, p + 3]
                                part = lanes[u, lane]
                                for j in range(row_tile):
                                    part[j] += fma32(x3, w3[j], fma32(x2, w2[j], fma32(x1, w1[j], x0 * w0[j])))
                    if mode == GEMM:  # one FMA per group: the group's integer, then its mins'
                        for u in range(token_tile):
                            t = t0 + u
                            dx = xd[t, b]
                            for j in range(row_tile):
                                s = 0
                                for lane in range(8):
                                    s += np.int32(lanes[u, lane, j])
                                m = _min_terms(kind, b, r0 + j, xbs[t, b], wmin, g0 * min_blocks // 256,
                                               group * min_blocks // 256)
                                acc[u, 0, j] = fma32(np.float32(s), wd[b, r0 + j] * dx, acc[u, 0, j])
                                acc[u, 1, j] = fma32(np.float32(m), wdmin[b, r0 + j] * dx, acc[u, 1, j])
                    else:
                        for u in range(token_tile):
                            for lane in range(8):
                                for j in range(row_tile):
                                    ilanes[u, lane, j] += np.int32(lanes[u, lane, j])
                if mode == GEMM:
                    continue
                for u in range(token_tile):
                    t = t0 + u
                    dx = xd[t, b]
                    bsums = xbs[t, b]
                    for j in range(row_tile):
                        r = r0 + j
                        if mode == VEC_DOT:
                            d = dx * wd[b, r]
                            if kind == 2:  # Q2_K: the mins into the same lanes, first
                                dmin = -dx * wdmin[b, r]
                                for lane in range(8):
                                    m = _min_terms(kind, b, r, bsums, wmin, 2 * lane, 2)
                                    acc[u, lane, j] = fma32(dmin, np.float32(m), acc[u, lane, j])
                            elif kind == 4:  # Q4_K: 4 lanes of mins, pairs of 32-value sub-blocks
                                dmin = -dx * wdmin[b, r]
                                for k in range(4):
                                    m = (wmin[b, 2 * k, r] * (bsums[4 * k] + bsums[4 * k + 1])
                                         + wmin[b, 2 * k + 1, r] * (bsums[4 * k + 2] + bsums[4 * k + 3]))
                                    acc_m[u, k, j] = fma32(dmin, np.float32(m), acc_m[u, k, j])
                            elif kind == 5:  # Q5_K: summs += dmin * sum, contracted
                                dmin = -dx * wdmin[b, r]
                                m = _min_terms(kind, b, r, bsums, wmin, 0, 8)
                                acc_m[u, 0, j] = fma32(dmin, np.float32(m), acc_m[u, 0, j])
                            for lane in range(8):
                                s = ilanes[u, lane, j]
                                if kind == 6:  # unsigned quants: minus 32 * scale * bsum, lane L's two 16-blocks
                                    s -= 32 * (wsc[b, 2 * lane, r] * bsums[2 * lane]
                                               + wsc[b, 2 * lane + 1, r] * bsums[2 * lane + 1])
                                acc[u, lane, j] = fma32(d, np.float32(s), acc[u, lane, j])
                        else:
                            s = 0
                            for lane in range(8):
                                s += ilanes[u, lane, j]
                            if kind == 6:
                                s -= 32 * _min_terms(kind, b, r, bsums, wsc, 0, 16)
                            m = _min_terms(kind, b, r, bsums, wmin, 0, min_blocks) if has_min else 0
                            if mode == TILED:
                                res = np.float32(s) * wd[b, r]
                                if has_min:
                                    res = fma32(-wdmin[b, r], np.float32(m), res)
                                acc[u, 0, j] = fma32(res, dx, acc[u, 0, j])
                            else:  # GEMV
                                acc[u, 0, j] = fma32(np.float32(s), wd[b, r] * dx, acc[u, 0, j])
                                acc[u, 1, j] = fma32(np.float32(m), wdmin[b, r] * dx, acc[u, 1, j])
            for u in range(token_tile):
                for j in range(row_tile):
                    if mode == VEC_DOT:  # hsum_float_8, then Q4_K's min lanes or Q5_K's summs
                        a = acc[u, :, j]
                        total = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
                        if kind == 4:
                            total = total + ((acc_m[u, 0, j] + acc_m[u, 2, j]) + (acc_m[u, 1, j] + acc_m[u, 3, j]))
                        elif kind == 5:
                            total = total + acc_m[u, 0, j]
                        out[t0 + u, r0 + j] = total
                    elif mode == TILED:
                        out[t0 + u, r0 + j] = acc[u, 0, j]
                    else:
                        out[t0 + u, r0 + j] = acc[u, 0, j] - acc[u, 1, j]


def kquant_dot(xq: np.ndarray, xd: np.ndarray, xbs: np.ndarray, layout, kind: str, mode: int, group: int = 128,
               threads: int | None = None) -> np.ndarray:
    """(T, R) f32: `_kquant_dot` on numpy arrays (any T and R), `layout` a
    `tracer.ggml.kquants.KernelLayout`, on `threads` of numba's threads."""
    tokens, rows = xd.shape[0], layout.d.shape[1]
    xq, xd, xbs = (pad_rows(np.ascontiguousarray(a), TOKEN_TILE, 0) for a in (xq, xd, xbs))
    w, wd = pad_rows(layout.weights, ROW_TILE, 2), pad_rows(layout.d, ROW_TILE, 1)
    wsc = pad_rows(layout.scales, ROW_TILE, 2)
    no_min = layout.mins is None
    wdmin = np.zeros((0, 0), np.float32) if no_min else pad_rows(layout.dmin, ROW_TILE, 1)
    wmin = np.zeros((0, 0, 0), np.int32) if no_min else pad_rows(layout.mins, ROW_TILE, 2)
    out = np.empty((xd.shape[0], wd.shape[1]), np.float32)
    set_threads(threads)
    _kquant_dot(xq, xd, xbs, w, wd, wdmin, wsc, wmin, out, KIND_CODES[kind], mode, group, ROW_TILE, TOKEN_TILE)
    return out[:tokens, :rows]
