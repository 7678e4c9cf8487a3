"""Single-precision arithmetic as ggml's compiled CPU code performs it.

llama.cpp is built with GCC in GNU C/C++ mode (`-ffp-contract=fast`), so `a*b + c` becomes one
fused multiply-add wherever the target has FMA; its SIMD reductions add lanes in fixed trees; it
calls the C library's `expf`, `cosf`, `sinf` and `powf`, and its own polynomial exp in vector
code. Emulating that bit for bit needs each of those here, as functions of torch tensors.

Depends on: IEEE-754 f32/f64 in torch (every CPU), a fused `torch.addcmul` for f32 (probed once;
when the probe fails an exact f64 route with round-to-odd is taken instead), and glibc's libm
(`ctypes`; `expf` from compiled code), whose float functions are the ones llama.cpp calls on Linux.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import numpy as np
import torch

F32, F64 = torch.float32, torch.float64


# --- fused multiply-add ---------------------------------------------------------------------


def _sum_to_odd(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """p + c (f64) rounded to odd: TwoSum's error decides the last bit, and an f64 rounded to odd
    rounds correctly to any format of 51 bits or fewer (f32, f16)."""
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # s + err == p + c exactly
    bits = s.view(torch.int64)
    inexact_even = (err != 0) & torch.isfinite(err) & ((bits & 1) == 0)
    away = (err > 0) == (s > 0)  # the exact value lies further from zero than s
    step = torch.where(away, 1, -1)
    return torch.where(inexact_even, bits + step, bits).view(F64)


def _fma_via_f64(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """round_f32(a*b + c) exactly: the f32 product is exact in f64, the sum rounded to odd."""
    return _sum_to_odd(a.to(F64) * b.to(F64), c.to(F64)).to(F32)


@functools.cache
def addcmul_is_fused() -> bool:
    """Whether `torch.addcmul` on f32 rounds once (a hardware FMA), checked on values where a
    separate multiply and add round differently."""
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen)
    c = -(a * b) + torch.randn(4099, generator=gen) * 1e-6  # heavy cancellation: unfused differs
    return bool(torch.equal(torch.addcmul(c, a, b), _fma_via_f64(a, b, c)))


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """f32 fused multiply-add `a*b + c`, rounded once (broadcasting like torch)."""
    a, b, c = (t.to(F32) if torch.is_tensor(t) else torch.tensor(t, dtype=F32) for t in (a, b, c))
    if addcmul_is_fused():
        return torch.addcmul(c, a, b)
    return _fma_via_f64(*torch.broadcast_tensors(a, b, c))


def rdiv(numerator: float, x: torch.Tensor) -> torch.Tensor:
    """numerator / x as one IEEE division (torch's `float / tensor` multiplies by a rounded reciprocal)."""
    return torch.full_like(x, numerator) / x


def fma_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc <- fma(a, b, acc) in place (f32 `acc`); returns acc."""
    if addcmul_is_fused():
        return torch.addcmul(acc, a, b, out=acc)
    return acc.copy_(_fma_via_f64(*torch.broadcast_tensors(a.to(F32), b.to(F32), acc)))


# --- formats ----------------------------------------------------------------------------------


def round_f16(x: torch.Tensor) -> torch.Tensor:
    """f32 -> f16 -> f32, round to nearest even (F16C `_cvtss_sh(x, 0)`, `_mm512_cvtps_ph(x, 0)`)."""
    return x.to(torch.float16).to(F32)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """f32 -> bf16 -> f32, round to nearest even (ggml_compute_fp32_to_bf16)."""
    return x.to(torch.bfloat16).to(F32)


def fma_f16(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The binary16 fused multiply-add of AVX512-FP16 (`_mm512_fmadd_ph`): a*b + c of f16 values
    held in f32 (broadcasting like torch), rounded once to f16 (to nearest even; FP16 arithmetic
    keeps subnormals). The product is exact in f64, the sum rounded to odd there, and numpy
    rounds an f64 to f16 in one step."""
    a, b, c = torch.broadcast_tensors(a.to(F64), b.to(F64), c.to(F64))
    return torch.from_numpy(_sum_to_odd(a * b, c).numpy().astype(np.float16).astype(np.float32))


ROUND = {"f32": lambda x: x.to(F32), "f16": round_f16, "bf16": round_bf16}


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """`_mm256_round_ps(x, _MM_ROUND_NEAREST)` and ggml's `nearest_int`: ties to even."""
    return torch.round(x)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C `roundf`: ties away from zero (ggml's portable `quantize_row_q8_*_ref`); exact in f64."""
    x64 = x.to(F64)
    return (torch.sign(x64) * torch.floor(x64.abs() + 0.5)).to(x.dtype)


ROUNDINGS = {"even": round_half_even, "away": round_half_away}


# --- horizontal sums ------------------------------------------------------------------------


def hsum8(v: torch.Tensor) -> torch.Tensor:
    """(..., 8) -> (...): `hsum_float_8` (arch/x86/quants.c) and tinyBLAS' `hsum(__m256)`:
    ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7)), each add rounded to f32."""
    q = v[..., 4:] + v[..., :4]  # (..., 4)
    h = q[..., 2:] + q[..., :2]  # (..., 2)
    return h[..., 0] + h[..., 1]


def reduce_add16(v: torch.Tensor) -> torch.Tensor:
    """(..., 16) -> (...): GCC's `_mm512_reduce_add_ps`: halves added 8, 4, then (t0+t2) + (t1+t3)."""
    t = v[..., 8:] + v[..., :8]  # (..., 8)
    t = t[..., 4:] + t[..., :4]  # (..., 4)
    t = t[..., :2] + t[..., 2:]  # (..., 2)
    return t[..., 0] + t[..., 1]


# --- the C library ----------------------------------------------------------------------------


@functools.cache
def _libm_function(name: str):
    path = ctypes.util.find_library("m")
    function = getattr(ctypes.CDLL(path), name)
    function.restype = ctypes.c_float
    function.argtypes = [ctypes.c_float] * (2 if name == "powf" else 1)
    return function


def libm(name: str, x: torch.Tensor) -> torch.Tensor:
    """The C library's float function `name` ("expf", "cosf", "sinf") at every element of `x`."""
    function = _libm_function(name)
    flat = x.detach().to(F32).flatten().tolist()
    return torch.tensor([function(v) for v in flat], dtype=F32).reshape(x.shape)


def powf(base: float, exponent: float) -> float:
    """The C library's `powf` (ggml's RoPE: `theta_scale = powf(freq_base, -2.0f/n_dims)`)."""
    return _libm_function("powf")(base, exponent)


def expf(x: torch.Tensor) -> torch.Tensor:
    """The C library's `expf` at every element of f32 `x`, called by compiled code
    (`tracer.ggml.kernels.libm_expf`) rather than once per element through ctypes."""
    from tracer.ggml import kernels  # numba compiles these kernels: loaded by the ops that run them

    return torch.from_numpy(kernels.libm_expf(x.detach().to("cpu", F32).numpy(), torch.get_num_threads()))


# --- ggml's vectorised exp --------------------------------------------------------------------

# ggml_v_expf (ggml-cpu/vec.h), adapted from ARM's optimized routines: an AVX-512F/DQ build's variant and an
# AVX2/FMA build's, the same polynomial put together differently (`exp_constants`).
EXP_SHIFT = float.fromhex("0x1.8p23")
LOG2E = float.fromhex("0x1.715476p+0")
LN2_HI, LN2_LO = float.fromhex("0x1.62e4p-1"), float.fromhex("0x1.7f7d1cp-20")
EXP_POLY = [float.fromhex(h) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2",
                                       "0x1.ffffecp-1")]


def exp_constants(avx512: bool) -> np.ndarray:
    """The compiled loops' constants of ggml_v_expf (`tracer.ggml.kernels.v_expf1`): shift, log2(e), ln2's
    two parts, the 5 coefficients and the variant, AVX-512's (`avx512`) or AVX2's."""
    from tracer.ggml.kernels import EXP_AVX2, EXP_AVX512  # numba compiles the kernels: loaded by the ops that run them

    return np.array([EXP_SHIFT, LOG2E, LN2_HI, LN2_LO, *EXP_POLY, EXP_AVX512 if avx512 else EXP_AVX2], dtype=np.float32)


def ggml_v_expf(x: torch.Tensor, avx512: bool) -> torch.Tensor:
    """ggml_v_expf (vec.h): exp(x) = 2^n * poly(b), b = x - n*ln2 in two fused steps; max error 1.45 + 0.5
    ulp. AVX-512F/DQ (`avx512`): poly(b) = fma(..., fma(c4, b, 1)), times 2^n by `_mm512_scalef_ps`; |n| >
    192 gives 0 (n <= 0) or inf. AVX2/FMA: j = fma(..., c4 * b), then fma(j, 2^n, 2^n), 2^n from the
    exponent bits; 126 < |n| <= 192 through two powers of two, past 192 0 or inf.
    Computed per element by `tracer.ggml.kernels._v_expf` (the same steps, compiled)."""
    from tracer.ggml import kernels  # numba compiles these kernels: loaded by the ops that run them

    return torch.from_numpy(kernels.v_expf(x.detach().to("cpu", F32).numpy(), exp_constants(avx512),
                                           torch.get_num_threads()))


def ggml_v_silu(x: torch.Tensor, avx512: bool) -> torch.Tensor:
    """ggml_v_silu (vec.h): x / (1 + ggml_v_expf(0 - x)), each step rounded to f32."""
    x = x.to(F32)
    return x / (1.0 + ggml_v_expf(0.0 - x, avx512))  # tensor / tensor: IEEE


def silu_scalar(x: torch.Tensor) -> torch.Tensor:
    """ggml_silu_f32 (vec.h), the scalar tail of vector loops: x / (1.0f + expf(-x)) with libm's expf."""
    x = x.to(F32)
    return x / (1.0 + expf(-x))
