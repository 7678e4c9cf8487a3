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
stays below 2^24, then converted to int32. Per lane (an 8th of the values) over a super-block the
largest is Q6_K's centred quants, 32 · 127 · 32 · 128 < 2^24; the vec_dot multiplies them unsigned,
which needs half a super-block (16 · 127 · 63 · 128 < 2^24); the gemm's groups (64 or 128 values)
are summed in one f32 each (Q4_K's 64 · 127 · 15 · 63 < 2^24). The f32 steps use LLVM's
`llvm.fma.f32`; numba neither contracts nor reassociates without `fastmath` (`tracer.ggml.kernels`).

Notation: T tokens, R outputs, B super-blocks per row, S sub-blocks per super-block.
"""

from __future__ import annotations

import numpy as np

# numba through tracer.ggml.kernels, which sets its CPU features before importing it
from tracer.ggml.kernels import TOKEN_TILE, fma32, lane4, njit, pad_rows, prange, quad, set_threads, token_group

VEC_DOT, TILED, GEMV, GEMM = 0, 1, 2, 3  # the paths (`mode`)
PATHS = {"vec_dot": VEC_DOT, "tiled": TILED, "gemv": GEMV, "gemm": GEMM}
KIND_CODES = {"q2_k": 2, "q3_k": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6}
# values per f32 partial sum outside the gemm (whose groups are its FMA steps): exact below 2^24,
# Q6_K's unsigned quants (the vec_dot's) only over half a super-block
GROUPS = {"q2_k": 256, "q3_k": 256, "q4_k": 256, "q5_k": 256, "q6_k": 256}
UNSIGNED_GROUP = 128
ROW_TILE = 192  # outputs per inner loop (vectorised)


@njit(inline="always")
def _block_products(out, coefficients, b, r0, width, bsums, first, count, pair):  # pragma: no cover - compiled
    """out[j] = Σ coefficients[b, s, r0 + j] * (bsums of sub-block s) over sub-blocks
    first..first+count-1, integers; `pair`: a sub-block of 32 values, two 16-value bsums."""
    out[:] = 0
    for s in range(first, first + count):
        block_sum = bsums[2 * s] + bsums[2 * s + 1] if pair else bsums[s]
        column = coefficients[b, s, r0:r0 + width]
        for j in range(width):
            out[j] += column[j] * block_sum


@njit(cache=True, parallel=True)
def _kquant_dot(xq, xd, xbs, w, wd, wdmin, wsc, wmin, out, kind, mode, group, centred, row_tile, token_group):
    # pragma: no cover - compiled
    """Every output of a k-quant × Q8_K matmul by path `mode`. xq (T, B, 256) f32 activation quants,
    xd (T, B) f32 scales, xbs (T, B, 16) int32 sums of 16 quants; w (B, 256, R) f32 scale*quant,
    wd / wdmin (B, R) f32 super-block scales, wsc / wmin (B, S, R) int32 sub-block scales and
    mins (wdmin / wmin (0, 0[, 0]) without mins) -> out (T, R). `group`: values per f32 partial
    sum (GEMM: per FMA step); `centred`: Q6_K's weights less their zero (else unsigned, corrected
    by 32 * scale * bsum). T a multiple of TOKEN_TILE (callers pad); outputs in tiles of row_tile,
    the last one shorter, tokens in groups of token_group: the threads take (tile, group) pairs.
    Every loop over outputs is innermost (vectorised)."""
    tokens, blocks = xd.shape
    rows = wd.shape[1]
    has_min = wmin.shape[0] > 0
    pair = kind in (4, 5)  # 32-value sub-blocks
    sub_blocks = 8 if pair else 16
    token_groups = (tokens + token_group - 1) // token_group
    # threads share tiles of outputs and groups of tokens; one tile's groups in turn, its weights in cache
    for item in prange(((rows + row_tile - 1) // row_tile) * token_groups):
        r0, first = (item // token_groups) * row_tile, (item % token_groups) * token_group
        width = min(row_tile, rows - r0)
        lanes = np.empty((TOKEN_TILE, 8, width), np.float32)  # a group's lane sums (integers)
        ilanes = np.empty((TOKEN_TILE, 8, width), np.int32)  # a super-block's lane sums
        acc = np.empty((TOKEN_TILE, 8, width), np.float32)  # VEC_DOT: the 8 lanes; else [0] acc, [1] acc_min
        acc_m = np.empty((TOKEN_TILE, 4, width), np.float32)  # Q4_K's min lanes; Q5_K's summs in [0]
        total, mins = np.empty(width, np.int32), np.empty(width, np.int32)  # one token's integers
        scale, scale_min = np.empty(width, np.float32), np.empty(width, np.float32)
        for t0 in range(first, min(tokens, first + token_group), TOKEN_TILE):
            acc[:] = 0
            acc_m[:] = 0
            for b in range(blocks):
                ilanes[:] = 0
                d_w, dmin_w = wd[b, r0:r0 + width], wdmin[b, r0:r0 + width] if has_min else wd[b, r0:r0 + width]
                for g0 in range(0, 256, group):
                    if mode == GEMM:
                        lanes[:, 0] = 0
                    else:
                        lanes[:] = 0
                    for c in range(g0 // 32, (g0 + group) // 32):
                        for lane in range(8):
                            p = 32 * c + 4 * lane
                            w0, w1 = w[b, p, r0:r0 + width], w[b, p + 1, r0:r0 + width]
                            w2, w3 = w[b, p + 2, r0:r0 + width], w[b, p + 3, r0:r0 + width]
                            x0, x1 = quad(xq, t0, b, p), quad(xq, t0 + 1, b, p)
                            x2, x3 = quad(xq, t0 + 2, b, p), quad(xq, t0 + 3, b, p)
                            x4, x5 = quad(xq, t0 + 4, b, p), quad(xq, t0 + 5, b, p)
                            x6, x7 = quad(xq, t0 + 6, b, p), quad(xq, t0 + 7, b, p)
                            slot = lane if mode != GEMM else 0  # GEMM: a group's sum in one (exact) f32
                            l0, l1, l2, l3 = lanes[0, slot], lanes[1, slot], lanes[2, slot], lanes[3, slot]
                            l4, l5, l6, l7 = lanes[4, slot], lanes[5, slot], lanes[6, slot], lanes[7, slot]
                            for j in range(width):  # eight tokens written out: each weight loaded serves eight
                                v0, v1, v2, v3 = w0[j], w1[j], w2[j], w3[j]
                                l0[j] += lane4(x0, v0, v1, v2, v3)
                                l1[j] += lane4(x1, v0, v1, v2, v3)
                                l2[j] += lane4(x2, v0, v1, v2, v3)
                                l3[j] += lane4(x3, v0, v1, v2, v3)
                                l4[j] += lane4(x4, v0, v1, v2, v3)
                                l5[j] += lane4(x5, v0, v1, v2, v3)
                                l6[j] += lane4(x6, v0, v1, v2, v3)
                                l7[j] += lane4(x7, v0, v1, v2, v3)
                    for u in range(TOKEN_TILE):
                        if mode != GEMM:  # the super-block's lanes, in integers
                            for lane in range(8):
                                il, lf = ilanes[u, lane], lanes[u, lane]
                                for j in range(width):
                                    il[j] += np.int32(lf[j])
                            continue
                        # GEMM: one FMA per group, the group's integer, then its mins'
                        t = t0 + u
                        dx = xd[t, b]
                        lf = lanes[u, 0]
                        for j in range(width):
                            total[j] = np.int32(lf[j])
                        per_group = group * sub_blocks // 256
                        _block_products(mins, wmin, b, r0, width, xbs[t, b], g0 * sub_blocks // 256, per_group, pair)
                        a, a_min = acc[u, 0], acc[u, 1]
                        for j in range(width):
                            a[j] = fma32(np.float32(total[j]), d_w[j] * dx, a[j])
                            a_min[j] = fma32(np.float32(mins[j]), dmin_w[j] * dx, a_min[j])
                if mode == GEMM:
                    continue
                for u in range(TOKEN_TILE):
                    t = t0 + u
                    dx = xd[t, b]
                    bsums = xbs[t, b]
                    if mode == VEC_DOT:
                        for j in range(width):
                            scale[j] = dx * d_w[j]
                            scale_min[j] = -dx * dmin_w[j]
                        if kind == 2:  # Q2_K: the mins into the same lanes, first
                            for lane in range(8):
                                _block_products(mins, wmin, b, r0, width, bsums, 2 * lane, 2, False)
                                a = acc[u, lane]
                                for j in range(width):
                                    a[j] = fma32(scale_min[j], np.float32(mins[j]), a[j])
                        elif kind == 4:  # Q4_K: 4 lanes of mins, pairs of 32-value sub-blocks
                            for k in range(4):
                                _block_products(mins, wmin, b, r0, width, bsums, 2 * k, 2, True)
                                a = acc_m[u, k]
                                for j in range(width):
                                    a[j] = fma32(scale_min[j], np.float32(mins[j]), a[j])
                        elif kind == 5:  # Q5_K: summs += dmin * sum, contracted
                            _block_products(mins, wmin, b, r0, width, bsums, 0, 8, True)
                            a = acc_m[u, 0]
                            for j in range(width):
                                a[j] = fma32(scale_min[j], np.float32(mins[j]), a[j])
                        for lane in range(8):
                            il = ilanes[u, lane]
                            if kind == 6:  # unsigned quants: less 32 * scale * bsum, lane L's two 16-blocks
                                _block_products(mins, wsc, b, r0, width, bsums, 2 * lane, 2, False)
                                for j in range(width):
                                    il[j] -= 32 * mins[j]
                            a = acc[u, lane]
                            for j in range(width):
                                a[j] = fma32(scale[j], np.float32(il[j]), a[j])
                        continue
                    total[:] = 0
                    for lane in range(8):
                        il = ilanes[u, lane]
                        for j in range(width):
                            total[j] += il[j]
                    if kind == 6 and not centred:
                        _block_products(mins, wsc, b, r0, width, bsums, 0, 16, False)
                        for j in range(width):
                            total[j] -= 32 * mins[j]
                    if has_min:
                        _block_products(mins, wmin, b, r0, width, bsums, 0, sub_blocks, pair)
                    a, a_min = acc[u, 0], acc[u, 1]
                    if mode == TILED:
                        for j in range(width):
                            res = np.float32(total[j]) * d_w[j]
                            if has_min:
                                res = fma32(-dmin_w[j], np.float32(mins[j]), res)
                            a[j] = fma32(res, dx, a[j])
                    else:  # GEMV
                        for j in range(width):
                            a[j] = fma32(np.float32(total[j]), d_w[j] * dx, a[j])
                            a_min[j] = fma32(np.float32(mins[j]), dmin_w[j] * dx, a_min[j])
            for u in range(TOKEN_TILE):
                for j in range(width):
                    if mode == VEC_DOT:  # hsum_float_8, then Q4_K's min lanes or Q5_K's summs
                        a = acc[u, :, j]
                        result = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
                        if kind == 4:
                            result = result + ((acc_m[u, 0, j] + acc_m[u, 2, j]) + (acc_m[u, 1, j] + acc_m[u, 3, j]))
                        elif kind == 5:
                            result = result + acc_m[u, 0, j]
                        out[t0 + u, r0 + j] = result
                    elif mode == TILED:
                        out[t0 + u, r0 + j] = acc[u, 0, j]
                    else:
                        out[t0 + u, r0 + j] = acc[u, 0, j] - acc[u, 1, j]


def kquant_dot(xq: np.ndarray, xd: np.ndarray, xbs: np.ndarray, weight, path: str, gemm_group: int = 64,
               threads: int | None = None) -> np.ndarray:
    """(T, R) f32: `_kquant_dot` by `path` ("vec_dot", "tiled", "gemv", "gemm": one FMA step per
    `gemm_group` values) on numpy arrays (any T), `weight` a `tracer.ggml.kquants.KBlocks`, on
    `threads` of numba's threads. Only the vec_dot multiplies Q6_K's quants unsigned."""
    layout = weight.kernel_layout(centred=path != "vec_dot")
    group = gemm_group if path == "gemm" else GROUPS[weight.kind]
    if weight.kind == "q6_k" and not layout.centred:
        group = UNSIGNED_GROUP
    tokens = xd.shape[0]
    xq, xd, xbs = (pad_rows(np.ascontiguousarray(a), TOKEN_TILE, 0) for a in (xq, xd, xbs))
    no_min = layout.mins is None
    wdmin = np.zeros((0, 0), np.float32) if no_min else layout.dmin
    wmin = np.zeros((0, 0, 0), np.int32) if no_min else layout.mins
    out = np.empty((xd.shape[0], layout.d.shape[1]), np.float32)
    set_threads(threads)
    tokens_per_item = token_group(tokens, layout.d.shape[1], ROW_TILE, threads)
    _kquant_dot(xq, xd, xbs, layout.weights, layout.d, wdmin, layout.scales, wmin, out, KIND_CODES[weight.kind],
                PATHS[path], group, layout.centred, ROW_TILE, tokens_per_item)
    return out[:tokens]
