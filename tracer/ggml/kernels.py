"""ggml's quantized dot kernels compiled by numba: the same order as `tracer.ggml.vecdot`'s tensor
code, at the speed of a loop that keeps each output's 8 lane accumulators in registers.

Why compiled: ggml accumulates every output's 8 lanes by one f32 FMA per 32-value block, a chain
that no BLAS call can reorder. In tensor ops that chain is B elementwise passes over (8, T, R), plus
the lane dot products of inner length 4, an order of magnitude slower than a plain forward.
numba compiles these loops with LLVM, which numba ships (no C compiler at run time); the compiled
code is cached on disk (`cache=True`) in a folder named after the kernels' source content
(`tracer.ggml.kernel_cache`), so only a machine's first run of this code pays the compilation, not
every clone or virtual environment again (docs/measured.md has both costs).

Exactness does not depend on how LLVM vectorises: the lane sums are integer, the FMA is LLVM's
`llvm.fma.f32` (one rounding, a hardware FMA or the C library's `fmaf`), and numba does not
contract or reassociate f32 arithmetic without `fastmath`.

The other chains ggml computes in an order of its own are here too: flash attention's and candle's
FMA chains, tinyBLAS' 16-lane chains on float weights (`tracer.ggml.tinyblas`), the repacked
Q4_0/IQ4_NL blocks (`tracer.ggml.repack`), ggml's vector exp, the C library's expf and the Q8 quantizer.
"""

from __future__ import annotations

import os
import sys


def _prefer_512_bit_vectors() -> None:
    """LLVM tunes most AVX-512 Intel CPUs to vectorise with 256-bit registers (`prefer-256-bit`);
    the loops here are bound by their FMAs and run 20-30% faster on 512-bit ones (measured on an
    AVX-512 Xeon; the numbers are the same, each lane's operations being the same). numba reads its
    CPU features once, from NUMBA_CPU_FEATURES, when it is first imported: set there, unless the
    user set it, numba is imported already, or the CPU has no AVX-512."""
    if "numba" in sys.modules or "NUMBA_CPU_FEATURES" in os.environ:
        return
    import llvmlite.binding as llvm  # numba's LLVM, to read the CPU's features before numba loads

    llvm.initialize_native_target()
    features = llvm.get_host_cpu_features()
    if features.get("avx512f"):
        os.environ["NUMBA_CPU_FEATURES"] = f"{features.flatten()},-prefer-256-bit"


_prefer_512_bit_vectors()

import numba  # noqa: E402  (after its CPU features are set)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from tracer.ggml import kernel_cache  # noqa: E402, F401  (before any kernel is defined: where they are compiled to)

ZERO = np.float32(0.0)  # a lane starts at +0, as the lane array did
ROW_TILE = 192  # outputs per inner loop (vectorised): long loops amortise each block's set-up
TOKEN_TILE = 8  # tokens per pass over a tile of weights, written out: each weight loaded once for 8 tokens
EXP_AVX512, EXP_AVX2 = 1.0, 0.0  # ggml_v_expf's variant: the last of its constants (`floats.exp_constants`)
EXP_VARIANT = 9  # its index: after the shift, log2(e), ln2's two parts and the 5 coefficients


@intrinsic
def fma32(typingctx, a, b, c):
    """f32 fused multiply-add a*b + c, rounded once (LLVM's llvm.fma.f32)."""
    if not all(t == numba.float32 for t in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        function = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32] * 3))
        return builder.call(function, args)

    return numba.float32(numba.float32, numba.float32, numba.float32), codegen


@njit(inline="always")
def quad(x, t, b, p):  # pragma: no cover - compiled
    """x[t, b, p:p + 4] as four scalars."""
    return x[t, b, p], x[t, b, p + 1], x[t, b, p + 2], x[t, b, p + 3]


@njit(inline="always")
def lane4(x, w0, w1, w2, w3):  # pragma: no cover - compiled
    """The exact integer sum of 4 products, as `_mm256_maddubs_epi16` + `_mm256_madd_epi16` give
    it: an FMA chain (integers below 2^24: every step exact). x: the four activation quants."""
    return fma32(x[3], w3, fma32(x[2], w2, fma32(x[1], w1, fma32(x[0], w0, ZERO))))


@njit(cache=True, parallel=True)
def _vec_dot_blocks(xq, xd, wq, wd, xs, wm, out, row_tile, token_group):  # pragma: no cover - compiled
    """Every `ggml_vec_dot_<w>_<x>` of a matmul. xq (T, B, 32) f32 activation quants, xd (T, B)
    scales, wq (B, 32, R) f32 weight quants (outputs last: the inner loops run over outputs), wd
    (B, R) scales, xs (T, B) / wm (B, R) the Q8_1 block sums and the weight mins (empty when the
    type has none) -> out (T, R). T a multiple of TOKEN_TILE (callers pad); outputs in tiles of
    row_tile, the last one shorter, tokens in groups of token_group (a multiple of TOKEN_TILE): the
    threads take (tile, group) pairs. Eight tokens at a time, written out, so that each weight loaded
    serves eight outputs; the tile size is an argument, not a constant, so that LLVM vectorises the loops
    over outputs rather than unrolling them into scalar code."""
    tokens, blocks = xd.shape
    rows = wd.shape[1]
    has_min = wm.shape[0] > 0
    token_groups = (tokens + token_group - 1) // token_group
    # threads share tiles of outputs and groups of tokens; one tile's groups in turn, its weights in cache
    for item in prange(((rows + row_tile - 1) // row_tile) * token_groups):
        r0, first = (item // token_groups) * row_tile, (item % token_groups) * token_group
        width = min(row_tile, rows - r0)
        acc = np.empty((TOKEN_TILE, 8, width), np.float32)
        summs = np.empty((TOKEN_TILE, width), np.float32)
        scales = np.empty((TOKEN_TILE, width), np.float32)  # d_x * d_w per token, for the block's 8 lanes
        for t0 in range(first, min(tokens, first + token_group), TOKEN_TILE):
            acc[:] = 0
            summs[:] = 0
            for b in range(blocks):
                w_scales = wd[b, r0:r0 + width]
                for u in range(TOKEN_TILE):
                    dx, scales_u = xd[t0 + u, b], scales[u]
                    for j in range(width):
                        scales_u[j] = dx * w_scales[j]  # f16*f16: exact in f32
                s0, s1, s2, s3 = scales[0], scales[1], scales[2], scales[3]
                s4, s5, s6, s7 = scales[4], scales[5], scales[6], scales[7]
                for g in range(8):
                    p = 4 * g
                    w0, w1 = wq[b, p, r0:r0 + width], wq[b, p + 1, r0:r0 + width]
                    w2, w3 = wq[b, p + 2, r0:r0 + width], wq[b, p + 3, r0:r0 + width]
                    x0, x1 = quad(xq, t0, b, p), quad(xq, t0 + 1, b, p)
                    x2, x3 = quad(xq, t0 + 2, b, p), quad(xq, t0 + 3, b, p)
                    x4, x5 = quad(xq, t0 + 4, b, p), quad(xq, t0 + 5, b, p)
                    x6, x7 = quad(xq, t0 + 6, b, p), quad(xq, t0 + 7, b, p)
                    a0, a1, a2, a3 = acc[0, g], acc[1, g], acc[2, g], acc[3, g]
                    a4, a5, a6, a7 = acc[4, g], acc[5, g], acc[6, g], acc[7, g]
                    for j in range(width):
                        # maddubs + madd: 4 consecutive products, exact, then acc = fma(d_x*d_w, lane,
                        # acc); the lane stays in a register, the weights serve 8 tokens
                        v0, v1, v2, v3 = w0[j], w1[j], w2[j], w3[j]
                        a0[j] = fma32(s0[j], lane4(x0, v0, v1, v2, v3), a0[j])
                        a1[j] = fma32(s1[j], lane4(x1, v0, v1, v2, v3), a1[j])
                        a2[j] = fma32(s2[j], lane4(x2, v0, v1, v2, v3), a2[j])
                        a3[j] = fma32(s3[j], lane4(x3, v0, v1, v2, v3), a3[j])
                        a4[j] = fma32(s4[j], lane4(x4, v0, v1, v2, v3), a4[j])
                        a5[j] = fma32(s5[j], lane4(x5, v0, v1, v2, v3), a5[j])
                        a6[j] = fma32(s6[j], lane4(x6, v0, v1, v2, v3), a6[j])
                        a7[j] = fma32(s7[j], lane4(x7, v0, v1, v2, v3), a7[j])
                if has_min:
                    mins = wm[b, r0:r0 + width]
                    for u in range(TOKEN_TILE):  # summs += m*s, contracted by GCC
                        s, summs_u = xs[t0 + u, b], summs[u]
                        for j in range(width):
                            summs_u[j] = fma32(mins[j], s, summs_u[j])
            for u in range(TOKEN_TILE):  # hsum_float_8, then the min terms
                a = acc[u]
                for j in range(width):
                    total = ((a[0, j] + a[4, j]) + (a[2, j] + a[6, j])) + ((a[1, j] + a[5, j]) + (a[3, j] + a[7, j]))
                    out[t0 + u, r0 + j] = total + summs[u, j] if has_min else total


def token_group(tokens: int, rows: int, row_tile: int, threads: int | None) -> int:
    """Tokens per parallel work item: all of them (each tile's weights read once from memory)
    unless the tiles of outputs are too few to keep twice the threads busy, then fewer, a multiple
    of TOKEN_TILE."""
    threads = min(threads or numba.config.NUMBA_NUM_THREADS, numba.config.NUMBA_NUM_THREADS)
    tiles = -(-rows // row_tile)
    groups = min(-(-tokens // TOKEN_TILE), max(1, -(-2 * threads // tiles)))
    return TOKEN_TILE * -(-tokens // (TOKEN_TILE * groups))


def pad_rows(x: np.ndarray, multiple: int, axis: int) -> np.ndarray:
    """`x` with zeros appended along `axis` up to a multiple of `multiple` (the kernels' tiles)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return np.pad(x, widths)


@njit(cache=True, parallel=True)
def _q4_1_scalar_blocks(xq, xd, wq, wd, xs, wm, out, row_tile, token_tile):  # pragma: no cover - compiled
    """candle's `BlockQ4_1::vec_dot` for every output, the operands laid out as `_vec_dot_blocks`'
    (xs and wm required): per block sumi (an integer: exact in f32 in any order), then
    `sumf += (sumi*d_w)*d_x + m_w*s_x`, each step rounded to f32 (Rust does not contract)."""
    tokens, blocks = xd.shape
    rows = wd.shape[1]
    for tile in prange(rows // row_tile):
        r0 = tile * row_tile
        acc = np.empty((token_tile, row_tile), np.float32)
        sumi = np.empty((token_tile, row_tile), np.float32)
        for t0 in range(0, tokens, token_tile):
            acc[:] = 0
            for b in range(blocks):
                sumi[:] = 0
                for g in range(8):
                    w0, w1 = wq[b, 4 * g, r0:r0 + row_tile], wq[b, 4 * g + 1, r0:r0 + row_tile]
                    w2, w3 = wq[b, 4 * g + 2, r0:r0 + row_tile], wq[b, 4 * g + 3, r0:r0 + row_tile]
                    for u in range(token_tile):
                        x0, x1 = xq[t0 + u, b, 4 * g], xq[t0 + u, b, 4 * g + 1]
                        x2, x3 = xq[t0 + u, b, 4 * g + 2], xq[t0 + u, b, 4 * g + 3]
                        sumi_u = sumi[u]
                        for j in range(row_tile):
                            sumi_u[j] += ((x0 * w0[j] + x1 * w1[j]) + (x2 * w2[j] + x3 * w3[j]))
                w_scales, mins = wd[b, r0:r0 + row_tile], wm[b, r0:r0 + row_tile]
                for u in range(token_tile):
                    dx, sx, acc_u, sumi_u = xd[t0 + u, b], xs[t0 + u, b], acc[u], sumi[u]
                    for j in range(row_tile):
                        acc_u[j] = acc_u[j] + ((sumi_u[j] * w_scales[j]) * dx + mins[j] * sx)
            for u in range(token_tile):
                out[t0 + u, r0:r0 + row_tile] = acc[u]


def vec_dot_blocks(xq: np.ndarray, xd: np.ndarray, wq: np.ndarray, wd: np.ndarray,
                   xs: np.ndarray | None = None, wm: np.ndarray | None = None,
                   threads: int | None = None, order: str = "ggml") -> np.ndarray:
    """(T, R) f32: `_vec_dot_blocks` (order "ggml") or `_q4_1_scalar_blocks` ("candle") on numpy
    arrays (shapes there, any T and R), on `threads` of numba's threads (default: all)."""
    tokens, rows = xd.shape[0], wd.shape[1]
    empty = np.zeros((0, 0), np.float32)
    xq, xd = pad_rows(xq, TOKEN_TILE, 0), pad_rows(xd, TOKEN_TILE, 0)
    xs = empty if xs is None else pad_rows(xs, TOKEN_TILE, 0)
    wm = empty if wm is None else wm
    set_threads(threads)
    if order == "ggml":
        out = np.empty((xd.shape[0], rows), np.float32)
        _vec_dot_blocks(xq, xd, wq, wd, xs, wm, out, ROW_TILE, token_group(tokens, rows, ROW_TILE, threads))
        return out[:tokens]
    wq, wd = pad_rows(wq, ROW_TILE, 2), pad_rows(wd, ROW_TILE, 1)
    wm = wm if wm is empty else pad_rows(wm, ROW_TILE, 1)
    out = np.empty((xd.shape[0], wd.shape[1]), np.float32)
    _q4_1_scalar_blocks(xq, xd, wq, wd, xs, wm, out, ROW_TILE, TOKEN_TILE)
    return out[:tokens, :rows]


# --- FMA chains: flash attention's (ggml's simd_gemm), the gemm crate's small products (candle) --


@njit(cache=True, parallel=True)
def _fma_chains(a, b, out, causal, skip_zero):  # pragma: no cover - compiled
    """a (G, M, K), b (G, K, N) -> out (G, M, N): per entry one f32 FMA chain over k in order, from
    +0. `causal`: only n <= m (the rest left 0: masked keys). `skip_zero`: a zero a[g, m, k] is
    skipped, exact when b is finite (fma(±0, finite, acc) is acc, and acc, starting at +0, is
    never -0)."""
    groups, rows, inner = a.shape
    columns = b.shape[2]
    for row in prange(groups * rows):
        g, m = row // rows, row % rows
        acc = out[g, m]
        acc[:] = 0
        width = m + 1 if causal else columns
        for k in range(inner):
            x, b_k = a[g, m, k], b[g, k]
            if skip_zero and x == 0:
                continue
            for n in range(width):
                acc[n] = fma32(b_k[n], x, acc[n])


def fma_chains(a: np.ndarray, b: np.ndarray, causal: bool = False, threads: int | None = None) -> np.ndarray:
    """a (..., M, K) @ b (..., K, N) -> (..., M, N) f32: `_fma_chains` over the leading dims."""
    lead = a.shape[:-2]
    a3 = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, *a.shape[-2:])  # (G, M, K)
    b3 = np.ascontiguousarray(b, dtype=np.float32).reshape(-1, *b.shape[-2:])  # (G, K, N)
    out = np.empty((a3.shape[0], a3.shape[1], b3.shape[2]), np.float32)
    set_threads(threads)
    _fma_chains(a3, b3, out, causal, bool(np.isfinite(b3).all()))
    return out.reshape(*lead, a3.shape[1], b3.shape[2])


@njit(cache=True, parallel=True)
def _context_chains(p, v, ms, grows, tile, out):  # pragma: no cover - compiled
    """p (H, T, T) softmax weights (0 past the query), v (H, T, D), ms / grows (H, T, tiles) ->
    out (H, T, D): per query the f32 accumulator over D, scaled by ms where a tile raised the
    maximum, then one FMA per key in order (masked keys add nothing: skipped)."""
    heads, tokens, dims = v.shape
    for row in prange(heads * tokens):
        h, t = row // tokens, row % tokens
        acc = out[h, t]
        acc[:] = 0
        for i in range(t // tile + 1):
            if grows[h, t, i]:
                scale = ms[h, t, i]
                for d in range(dims):
                    acc[d] = acc[d] * scale
            for key in range(i * tile, min((i + 1) * tile, t + 1)):
                weight, values = p[h, t, key], v[h, key]
                for d in range(dims):
                    acc[d] = fma32(values[d], weight, acc[d])


def context_chains(p: np.ndarray, v: np.ndarray, ms: np.ndarray, grows: np.ndarray, tile: int,
                   threads: int | None = None) -> np.ndarray:
    """(H, T, D) f32: `_context_chains`."""
    out = np.empty(v.shape, np.float32)
    set_threads(threads)
    _context_chains(np.ascontiguousarray(p), np.ascontiguousarray(v), np.ascontiguousarray(ms),
                    np.ascontiguousarray(grows), tile, out)
    return out


@njit(inline="always")
def reduce_add16(v, start):  # pragma: no cover - compiled
    """GCC's `_mm512_reduce_add_ps` over v[start:start + 16]: halves added 8, 4, then (t0+t2) +
    (t1+t3) (`tracer.ggml.floats.reduce_add16`)."""
    t0, t1, t2, t3 = v[start + 8] + v[start], v[start + 9] + v[start + 1], v[start + 10] + v[start + 2], \
        v[start + 11] + v[start + 3]
    t4, t5, t6, t7 = v[start + 12] + v[start + 4], v[start + 13] + v[start + 5], v[start + 14] + v[start + 6], \
        v[start + 15] + v[start + 7]
    u0, u1, u2, u3 = t4 + t0, t5 + t1, t6 + t2, t7 + t3
    return (u0 + u2) + (u1 + u3)


@njit(inline="always")
def hsum8(v, start):  # pragma: no cover - compiled
    """ggml_vec_soft_max_f32's AVX2 sum of v[start:start + 8]: ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7))
    (`tracer.ggml.floats.hsum8`)."""
    q0, q1, q2, q3 = v[start + 4] + v[start], v[start + 5] + v[start + 1], v[start + 6] + v[start + 2], \
        v[start + 7] + v[start + 3]
    return (q2 + q0) + (q3 + q1)


@njit(cache=True, parallel=True)
def _tile_softmax(raw, scale, constants, tile, p, ms, grows, total):  # pragma: no cover - compiled
    """The online softmax of ggml's tiled flash attention per query row, its tiles of `tile` keys
    (a multiple of 16) in turn: raw (H, T, T) q·k sums (keys past the query: ignored), scaled by
    `scale` -> p (H, T, T) the weights ggml_v_expf(s - M) (0 past the query), ms / grows (H, T,
    tiles) the factor expf(M_old - M) (1 where the maximum stayed) and whether the tile raised the
    maximum M, total (H, T) the sum S: on a new maximum S = S * ms, then S += the tile's sum (per 16
    weights `_mm512_reduce_add_ps`, on an AVX2 build (its exp's constants say so) per 8 `hsum8`, added in f64, added
    to S in f64)."""
    heads, tokens = raw.shape[0], raw.shape[1]
    tiles = ms.shape[2]
    neg_inf = np.float32(-np.inf)
    for row in prange(heads * tokens):
        h, t = row // tokens, row % tokens
        weights = np.empty(tile, np.float32)
        best, s_total = neg_inf, np.float32(0.0)
        for i in range(tiles):
            k0 = i * tile
            if k0 > t:  # no visible key: the tile is skipped
                grows[h, t, i], ms[h, t, i] = False, 1.0
                for key in range(k0, min(k0 + tile, tokens)):
                    p[h, t, key] = 0.0
                continue
            tile_max = neg_inf
            for k in range(tile):
                key = k0 + k
                weights[k] = raw[h, t, key] * scale if key <= t else neg_inf  # masked and padded: -inf
                tile_max = max(tile_max, weights[k])
            before, best = best, max(best, tile_max)
            grew = best > before
            factor = c_expf(before - best) if grew else np.float32(1.0)  # expf(-inf) = 0 on the first tile
            grows[h, t, i], ms[h, t, i] = grew, factor
            for k in range(tile):
                weights[k] = v_expf1(weights[k] - best, constants)
            sums = np.float64(0.0)
            if constants[EXP_VARIANT] == EXP_AVX2:  # an AVX2 build: 8 lanes a vector
                for c in range(0, tile, 8):
                    sums = sums + np.float64(hsum8(weights, c))
            else:
                for c in range(0, tile, 16):
                    sums = sums + np.float64(reduce_add16(weights, c))
            if grew:
                s_total = s_total * factor
            s_total = np.float32(np.float64(s_total) + sums)
            for k in range(min(tile, tokens - k0)):
                p[h, t, k0 + k] = weights[k]
        total[h, t] = s_total


def tile_softmax(raw: np.ndarray, scale: float, constants: np.ndarray, tile: int,
                 threads: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """raw (H, T, T) f32 -> (p (H, T, T), ms (H, T, tiles), grows (H, T, tiles), total (H, T)):
    `_tile_softmax` on tiles of `tile` keys."""
    heads, tokens = raw.shape[0], raw.shape[1]
    tiles = -(-tokens // tile)
    p, total = np.empty_like(raw), np.empty((heads, tokens), np.float32)
    ms, grows = np.empty((heads, tokens, tiles), np.float32), np.empty((heads, tokens, tiles), np.bool_)
    set_threads(threads)
    _tile_softmax(np.ascontiguousarray(raw, dtype=np.float32), np.float32(scale), constants, tile, p, ms, grows, total)
    return p, ms, grows, total


def set_threads(threads: int | None) -> None:
    """numba's threads for the next call: `threads` (torch's count, by the callers), at most numba's own.

    The first call starts numba's OpenMP pool, which sets OpenMP's process-wide thread count to
    numba's own (every core), and torch takes its count from there: a process that had asked torch
    for fewer threads (OMP_NUM_THREADS, torch.set_num_threads) would run torch on every core from
    then on. torch's count is put back."""
    torch_threads = torch.get_num_threads()
    numba.set_num_threads(min(threads or numba.config.NUMBA_NUM_THREADS, numba.config.NUMBA_NUM_THREADS))
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)


# --- ggml_v_expf (vec.h, AVX-512F/DQ and AVX2/FMA) ----------------------------------------------------------


@intrinsic
def pow2_f64(typingctx, n):
    """2.0**n as an f64 for |n| < 1023, from its exponent bits: exact, and no call (vectorisable)."""
    if n != numba.int64:
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        bits = builder.shl(builder.add(args[0], ir.Constant(i64, 1023)), ir.Constant(i64, 52))
        return builder.bitcast(bits, ir.DoubleType())

    return numba.float64(numba.int64), codegen


@njit(inline="always")
def v_expf1(v, constants):  # pragma: no cover - compiled
    """`tracer.ggml.floats.ggml_v_expf` of one f32; constants: shift, log2(e), ln2 high and low
    parts, the 5 polynomial coefficients and the variant, AVX-512's or AVX2's (f32, `floats.exp_constants`)."""
    shift, log2e, ln2_hi, ln2_lo = constants[0], constants[1], constants[2], constants[3]
    p0, p1, p2, p3, p4 = constants[4], constants[5], constants[6], constants[7], constants[8]
    one, zero = np.float32(1.0), np.float32(0.0)
    z = fma32(v, log2e, shift)
    n = z - shift
    b = fma32(-n, ln2_lo, fma32(-n, ln2_hi, v))
    u = b * b
    if constants[EXP_VARIANT] == EXP_AVX2:
        return _v_expf1_avx2(n, fma32(fma32(fma32(p0, b, p1), u, fma32(p2, b, p3)), u, p4 * b))
    j = fma32(fma32(fma32(p0, b, p1), u, fma32(p2, b, p3)), u, fma32(p4, b, one))
    in_range = abs(n) <= 192  # _mm512_scalef_ps' range check in ggml: else 0 or inf (NaN: not in range)
    # scalef: j * 2^n rounded once (exact in f64, then one rounding to f32); selects, not
    # branches, so that loops vectorise
    scaled = np.float32(np.float64(j) * pow2_f64(np.int64(n if in_range else zero)))
    out_of_range = n if np.isnan(n) else (zero if n <= 0 else np.float32(np.inf))
    return scaled if in_range else out_of_range


@njit(inline="always")
def _v_expf1_avx2(n, j):  # pragma: no cover - compiled
    """The AVX2 variant's last steps on n (the rounded x·log2 e) and j (its polynomial less 1): k = 2^n
    from the exponent bits, fma(j, k, k) where |n| <= 126; past it s2 = 2^(n-127) (n > 0) or 2^(n+125),
    fma(s2, j, s2) times s1 = 2^127 or 2^-125, one rounding each (a power of two: exact in f64, then one
    rounding to f32, subnormals included); past 192, s1·s1: inf or 0. NaN stays NaN."""
    zero = np.float32(0.0)
    low, near, reach = n <= 0, abs(n) <= 126, abs(n) <= 192  # NaN: none of them
    # selects, not branches, so that loops vectorise; an exponent not used is 0 (no conversion of NaN)
    k = np.float32(pow2_f64(np.int64(n if near else zero)))
    s2 = np.float32(pow2_f64(np.int64((n + 125 if low else n - 127) if reach and not near else zero)))
    far = np.float32(np.float64(fma32(s2, j, s2)) * pow2_f64(np.int64(-125 if low else 127)))
    out = fma32(j, k, k) if near else (far if reach else (zero if low else np.float32(np.inf)))
    return n if np.isnan(n) else out


@njit(cache=True, parallel=True)
def _v_expf(x, constants, out):  # pragma: no cover - compiled
    """`v_expf1` per element of the flat f32 array x."""
    for i in prange(x.shape[0]):
        out[i] = v_expf1(x[i], constants)


def _elementwise(kernel, x: np.ndarray, *arguments, threads: int | None) -> np.ndarray:
    """`kernel(flat x, *arguments, out)` on an f32 array of any shape, out shaped as x."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(flat)
    set_threads(threads)
    kernel(flat, *arguments, out)
    return out.reshape(x.shape)


def v_expf(x: np.ndarray, constants: np.ndarray, threads: int | None = None) -> np.ndarray:
    """ggml_v_expf on an f32 array of any shape."""
    return _elementwise(_v_expf, x, constants, threads=threads)


# --- the C library's expf -----------------------------------------------------------------------


@intrinsic
def c_expf(typingctx, x):
    """The C library's `expf(x)`, called as a function: `nobuiltin` keeps LLVM from replacing the
    call by its own exp or a vector library's (the C library's rounding is the point)."""
    if x != numba.float32:
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32]), "expf")
        function.attributes.add("nobuiltin")
        return builder.call(function, args)

    return numba.float32(numba.float32), codegen


@njit(cache=True, parallel=True)
def _libm_expf(x, out):  # pragma: no cover - compiled
    for i in prange(x.shape[0]):
        out[i] = c_expf(x[i])


def libm_expf(x: np.ndarray, threads: int | None = None) -> np.ndarray:
    """The C library's expf on an f32 array of any shape."""
    return _elementwise(_libm_expf, x, threads=threads)


# --- quantize_row_q8_0 / q8_1 (arch/x86/quants.c) ----------------------------------------------


@njit(cache=True, parallel=True)
def _quantize_q8(x, away, q, d, sums):  # pragma: no cover - compiled
    """x (T, B, 32) f32 -> q (T, B, 32) rounded quants, d (T, B) amax/127 in f32 (the caller rounds
    it to f16), sums (T, B) d * sum(q) in f32 (Q8_1's s before its f16 rounding). x86: q =
    round(x * (127/amax)) ties to even (`away`: ties away from zero, the portable reference)."""
    tokens, blocks, size = x.shape
    scale = np.float32(127.0)
    for row in prange(tokens):
        for b in range(blocks):
            amax = np.float32(0.0)
            nan = False
            for i in range(size):
                a = abs(x[row, b, i])
                nan = nan or np.isnan(a)
                amax = max(amax, a)
            if nan:
                amax = np.float32(np.nan)
            inverse = scale / amax if amax != 0 else np.float32(0.0)
            total = np.float32(0.0)
            for i in range(size):
                v = x[row, b, i] * inverse
                if away:
                    r = np.float32(np.sign(np.float64(v)) * np.floor(abs(np.float64(v)) + 0.5))
                else:
                    r = np.rint(v)
                q[row, b, i] = r
                total += r  # integers below 2^24: exact in any order
            d[row, b] = amax / scale
            sums[row, b] = d[row, b] * total


def quantize_q8(x: np.ndarray, away: bool, threads: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(T, B, 32) f32 -> (q (T, B, 32), d (T, B), d * sum(q) (T, B)), f32: `_quantize_q8`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    q, d, sums = np.empty_like(x), np.empty(x.shape[:2], np.float32), np.empty(x.shape[:2], np.float32)
    set_threads(threads)
    _quantize_q8(x, away, q, d, sums)
    return q, d, sums


# --- quantize_row_q8_K (ggml-quants.c quantize_row_q8_K_ref, which the x86 build calls) ----------


@njit(cache=True, parallel=True)
def _quantize_q8_k(x, q, d):  # pragma: no cover - compiled
    """x (T, B, 256) f32 -> q (T, B, 256) quants, d (T, B): per block iscale = -127/max with max the
    first value of largest magnitude (`fabsf(x) > amax`), q = min(127, nearest_int(iscale * x)),
    ties to even, d = 1/iscale; an all-zero block: d = 0, q = 0."""
    tokens, blocks, size = x.shape
    for row in prange(tokens):
        for b in range(blocks):
            amax, peak = np.float32(0.0), np.float32(0.0)
            for i in range(size):
                a = abs(x[row, b, i])
                if a > amax:
                    amax, peak = a, x[row, b, i]
            if amax == 0:
                d[row, b] = 0
                q[row, b] = 0
                continue
            iscale = np.float32(-127.0) / peak
            for i in range(size):
                q[row, b, i] = min(np.float32(127.0), np.rint(iscale * x[row, b, i]))
            d[row, b] = np.float32(1.0) / iscale


def quantize_q8_k(x: np.ndarray, threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(T, B, 256) f32 -> (q (T, B, 256), d (T, B)), f32: `_quantize_q8_k`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    q, d = np.empty_like(x), np.empty(x.shape[:2], np.float32)
    set_threads(threads)
    _quantize_q8_k(x, q, d)
    return q, d


# --- tinyBLAS' lane chains and the repacked Q4_0/IQ4_NL blocks (tracer.ggml.tinyblas, .repack) --

LANE_ROW_TILE = 64  # outputs per inner loop of `_lane_chains`: 16 lane accumulators of 8 tokens, 32 KB
LANE_UNROLL = 4  # steps of a lane chain per accumulator load: the chain runs in a register


@njit(cache=True, parallel=True)
def _lane_chains(x, w, out, row_tile, token_tile, unroll):  # pragma: no cover - compiled
    """x (T, S, L) f32, w (S, L, R) f32 -> out (T, R): per output L lane accumulators from +0 (16, or 8
    on AVX2), lane l taking acc = fma(w[s, l], x[s, l], acc) for s in order (tinyBLAS' madd), then
    `_mm512_reduce_add_ps` (AVX2: tinyBLAS' hsum). T a multiple of token_tile, R of row_tile (callers pad); `unroll`
    steps per pass, so that each chain runs that far in a register."""
    tokens, steps, lanes = x.shape
    rows = w.shape[2]
    whole = steps - steps % unroll
    for tile in prange(rows // row_tile):
        r0 = tile * row_tile
        acc = np.empty((token_tile, lanes, row_tile), np.float32)
        for t0 in range(0, tokens, token_tile):
            acc[:] = 0
            for s in range(0, whole, unroll):
                for lane in range(lanes):
                    w0, w1 = w[s, lane, r0:r0 + row_tile], w[s + 1, lane, r0:r0 + row_tile]
                    w2, w3 = w[s + 2, lane, r0:r0 + row_tile], w[s + 3, lane, r0:r0 + row_tile]
                    for u in range(token_tile):
                        x0, x1 = x[t0 + u, s, lane], x[t0 + u, s + 1, lane]
                        x2, x3 = x[t0 + u, s + 2, lane], x[t0 + u, s + 3, lane]
                        a = acc[u, lane]
                        for j in range(row_tile):
                            a[j] = fma32(w3[j], x3, fma32(w2[j], x2, fma32(w1[j], x1, fma32(w0[j], x0, a[j]))))
            for s in range(whole, steps):
                for lane in range(lanes):
                    w0 = w[s, lane, r0:r0 + row_tile]
                    for u in range(token_tile):
                        x0, a = x[t0 + u, s, lane], acc[u, lane]
                        for j in range(row_tile):
                            a[j] = fma32(w0[j], x0, a[j])
            for u in range(token_tile):
                a = acc[u]
                if lanes == 8:  # AVX2, tinyBLAS' hsum(__m256): halves 4, then (q0 + q2) + (q1 + q3)
                    for j in range(row_tile):
                        q0, q1 = a[0, j] + a[4, j], a[1, j] + a[5, j]
                        q2, q3 = a[2, j] + a[6, j], a[3, j] + a[7, j]
                        out[t0 + u, r0 + j] = (q0 + q2) + (q1 + q3)
                    continue
                for j in range(row_tile):  # _mm512_reduce_add_ps: halves 8, 4, then (t0 + t2) + (t1 + t3)
                    h0 = (a[0, j] + a[8, j]) + (a[4, j] + a[12, j])
                    h1 = (a[1, j] + a[9, j]) + (a[5, j] + a[13, j])
                    h2 = (a[2, j] + a[10, j]) + (a[6, j] + a[14, j])
                    h3 = (a[3, j] + a[11, j]) + (a[7, j] + a[15, j])
                    out[t0 + u, r0 + j] = (h0 + h2) + (h1 + h3)


def lane_chains(x: np.ndarray, w: np.ndarray, threads: int | None = None) -> np.ndarray:
    """(T, R) f32: `_lane_chains` on x (T, S, L) and w (S, L, R), any T and R, on `threads`."""
    tokens, rows = x.shape[0], w.shape[2]
    x = pad_rows(np.ascontiguousarray(x, dtype=np.float32), TOKEN_TILE, 0)
    w = pad_rows(w, LANE_ROW_TILE, 2)
    out = np.empty((x.shape[0], w.shape[2]), np.float32)
    set_threads(threads)
    _lane_chains(x, w, out, LANE_ROW_TILE, TOKEN_TILE, LANE_UNROLL)
    return out[:tokens, :rows]


@njit(cache=True, parallel=True)
def _block_chains(xq, xd, wq, wd, out, row_tile, token_tile):  # pragma: no cover - compiled
    """xq (T, B, 32) f32 activation quants, xd (T, B) scales, wq (B, 32, R) f32 weight quants, wd
    (B, R) scales -> out (T, R): per output acc = fma(sum, d_w * d_x, acc) over the blocks in
    order, `sum` the block's 32 integer products (exact in f32: below 2^24). T a multiple of
    token_tile, R of row_tile (callers pad)."""
    tokens, blocks = xd.shape
    rows = wd.shape[1]
    for tile in prange(rows // row_tile):
        r0 = tile * row_tile
        acc = np.empty((token_tile, row_tile), np.float32)
        sums = np.empty((token_tile, row_tile), np.float32)
        for t0 in range(0, tokens, token_tile):
            acc[:] = 0
            for b in range(blocks):
                sums[:] = 0
                for g in range(8):
                    w0, w1 = wq[b, 4 * g, r0:r0 + row_tile], wq[b, 4 * g + 1, r0:r0 + row_tile]
                    w2, w3 = wq[b, 4 * g + 2, r0:r0 + row_tile], wq[b, 4 * g + 3, r0:r0 + row_tile]
                    for u in range(token_tile):
                        x0, x1 = xq[t0 + u, b, 4 * g], xq[t0 + u, b, 4 * g + 1]
                        x2, x3 = xq[t0 + u, b, 4 * g + 2], xq[t0 + u, b, 4 * g + 3]
                        s = sums[u]
                        for j in range(row_tile):
                            s[j] = fma32(x3, w3[j], fma32(x2, w2[j], fma32(x1, w1[j], fma32(x0, w0[j], s[j]))))
                w_scales = wd[b, r0:r0 + row_tile]
                for u in range(token_tile):
                    dx, s, a = xd[t0 + u, b], sums[u], acc[u]
                    for j in range(row_tile):
                        a[j] = fma32(s[j], w_scales[j] * dx, a[j])
            out[t0:t0 + token_tile, r0:r0 + row_tile] = acc


def block_chains(xq: np.ndarray, xd: np.ndarray, wq: np.ndarray, wd: np.ndarray,
                 threads: int | None = None) -> np.ndarray:
    """(T, R) f32: `_block_chains` (shapes there, any T and R) on `threads` of numba's threads."""
    tokens, rows = xd.shape[0], wd.shape[1]
    xq, xd = pad_rows(xq, TOKEN_TILE, 0), pad_rows(xd, TOKEN_TILE, 0)
    wq, wd = pad_rows(wq, ROW_TILE, 2), pad_rows(wd, ROW_TILE, 1)
    out = np.empty((xd.shape[0], wd.shape[1]), np.float32)
    set_threads(threads)
    _block_chains(xq, xd, wq, wd, out, ROW_TILE, TOKEN_TILE)
    return out[:tokens, :rows]
