"""ggml's f32 arithmetic as emulated in tracer.ggml.floats: fused multiply-add, IEEE division,
tie rounding, the SIMD horizontal-sum trees, glibc's float functions and ggml's vector exp."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tracer.ggml import floats
from tracer.ggml.floats import F32, F64


def test_fma_rounds_once_where_a_multiply_then_add_rounds_twice():
    a = torch.tensor([1 + 2**-12], dtype=F32)
    c = torch.tensor([-(1 + 2**-11)], dtype=F32)
    assert floats.fma(a, a, c).item() == 2**-24  # (1 + 2^-12)^2 - (1 + 2^-11) = 2^-24 exactly
    assert (a * a + c).item() == 0.0  # the product alone rounds the 2^-24 away
    assert floats._fma_via_f64(a, a, c).item() == 2**-24


def test_fma_via_f64_is_correctly_rounded_where_double_rounding_would_not_be():
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is an f32 midpoint; + 2^-80 puts the exact sum just above
    # it. Rounded to f64 the 2^-80 is lost, and the tie then goes to the even neighbour (wrong);
    # rounding to odd first keeps the direction (right, as the hardware FMA).
    a, c = torch.tensor([1 + 2**-12], dtype=F32), torch.tensor([2.0**-80], dtype=F32)
    right = 1 + 2**-11 + 2**-23
    assert floats._fma_via_f64(a, a, c).item() == right
    assert torch.addcmul(c, a, a).item() == right
    assert (a.to(F64) * a.to(F64) + c.to(F64)).to(F32).item() == 1 + 2**-11
    gen = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(100_000, generator=gen) for _ in range(3))
    assert torch.equal(floats._fma_via_f64(x, y, z), torch.addcmul(z, x, y))


def _sequential_f32(values) -> float:
    total = np.float32(0)
    for v in values:
        total = np.float32(total + np.float32(v))
    return float(total)


def test_fma_f16_rounds_once_to_f16_where_rounding_through_f32_would_tie():
    a, b, c = torch.tensor([1 + 2**-10]), torch.tensor([4 - 2**-8]), torch.tensor([8200.0])  # f16 values
    # a*b + c = 8204 - 2^-18: just below the tie between 8200 and 8208 (f16 steps of 8 there)
    assert floats.fma_f16(a, b, c).item() == 8200.0
    assert floats.round_f16(floats.fma(a, b, c)).item() == 8208.0  # f32 holds 8204: the tie goes to even
    generator = torch.Generator().manual_seed(9)
    x, y, z = (floats.round_f16(torch.randn(4096, generator=generator)) for _ in range(3))
    literal = [float(np.float16(float(i) * float(j) + float(k))) for i, j, k in zip(x, y, z)]  # exact in f64 here
    assert floats.fma_f16(x, y, z).tolist() == literal


def test_rdiv_is_one_ieee_division_where_torch_multiplies_by_a_reciprocal():
    # The block that made llama.cpp's Q8_1 quantization and ours part (layer 9 of SmolLM2):
    # 127/amax times x is -41.5 exactly, a tie, only with a correctly rounded division.
    amax, x = torch.tensor([0.42014244198799133]), torch.tensor([-0.13729064166545868])
    assert (floats.rdiv(127.0, amax) * x).item() == -41.5
    assert (127.0 / amax * x).item() == -41.499996185302734
    assert floats.rdiv(127.0, amax).item() == float(np.float32(127) / np.float32(amax.item()))


def test_ties_round_to_even_on_x86_and_away_from_zero_in_the_portable_code():
    x = torch.tensor([-41.5, 2.5, 3.5, -0.5, 0.5, 1.4999999])
    assert floats.round_half_even(x).tolist() == [-42.0, 2.0, 4.0, -0.0, 0.0, 1.0]
    assert floats.round_half_away(x).tolist() == [-42.0, 3.0, 4.0, -1.0, 1.0, 1.0]


def test_hsum8_adds_the_halves_then_the_pairs():
    # In order, 2^24 + 1 rounds back to 2^24 three times; the tree cancels the 2^24s first.
    v = torch.tensor([2.0**24, 1, 1, 1, -(2.0**24), 1, 1, 1])
    assert floats.hsum8(v).item() == 6.0
    assert _sequential_f32(v.tolist()) == 3.0


def test_reduce_add16_follows_gccs_tree():
    v = torch.zeros(16)
    v[0], v[4], v[8], v[12] = 2.0**24, -(2.0**24), 1.0, 1.0  # halves first: 2^24 + 1 loses the 1
    assert floats.reduce_add16(v).item() == 1.0 and _sequential_f32(v.tolist()) == 2.0
    v = torch.zeros(16)
    v[0], v[1], v[2], v[3] = 2.0**24, 1.0, -(2.0**24), 1.0  # (t0 + t2) + (t1 + t3) last
    assert floats.reduce_add16(v).item() == 2.0 and _sequential_f32(v.tolist()) == 1.0


def test_expf_is_the_c_librarys_bit_for_bit_including_subnormal_and_special_results():
    x = torch.cat([torch.linspace(-20, 20, 50_001), torch.linspace(-104, -87, 5_001),
                   torch.tensor([float("-inf"), float("inf"), 0.0, -0.0, 88.72, 89.0, -150.0])])
    ours, libc = floats.expf(x), floats.libm("expf", x)
    assert torch.equal(ours.view(torch.int32), libc.view(torch.int32))
    naive = torch.exp(x.to(F64)).to(F32)
    assert int((naive != libc).sum()) > 0  # glibc is not correctly rounded everywhere (0.502 ulp)
    grid = x[:50_000].reshape(100, 500)
    assert torch.equal(floats.expf(grid.t()), libc[:50_000].reshape(100, 500).t())  # any layout
    assert torch.isnan(floats.expf(torch.tensor([float("nan")]))).all()


def test_cosf_sinf_powf_come_from_the_c_library():
    assert floats.powf(100000.0, -2.0 / 64) == float(np.float32(0.6978305578231812))
    x = torch.tensor([0.0, 1.0, 1e4])
    assert floats.libm("cosf", x)[0].item() == 1.0
    assert floats.libm("sinf", x)[1].item() == pytest.approx(math.sin(1.0), rel=1e-7)


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
def test_ggml_v_expf_is_within_its_documented_error_and_saturates(avx512):
    x = torch.linspace(-87, 88, 20_001)
    ratio = floats.ggml_v_expf(x, avx512).to(F64) / torch.exp(x.to(F64))
    assert float((ratio - 1).abs().max()) < 2.0 * 2**-23  # "max error 1.45358 plus 0.5 ulps"
    edge = floats.ggml_v_expf(torch.tensor([0.0, float("-inf"), -200.0, 200.0, float("nan")]), avx512)
    assert edge[:4].tolist() == [1.0, 0.0, 0.0, float("inf")] and edge[4].isnan()
    # past |n| = 126 (AVX2: two powers of two) and into the subnormals: exp within its error, not flushed
    far = torch.tensor([-100.0, -95.0, -88.0, 88.0])
    got, exact = floats.ggml_v_expf(far, avx512), torch.exp(far.to(F64)).to(F32)  # the first two subnormal
    assert (got.view(torch.int32) - exact.view(torch.int32)).abs().max().item() <= 1  # one unit of f32 at most
    assert floats.ggml_v_expf(torch.tensor([88.8]), avx512).item() == float("inf")


def test_the_avx2_and_avx512_exps_are_one_polynomial_rounded_differently():
    """AVX-512 adds the 1 inside the polynomial's last FMA and scales by scalef; AVX2 leaves it out and
    takes fma(j, 2^n, 2^n): equal at most inputs, one unit apart at some."""
    x = torch.linspace(-20, 20, 100_001)
    wide, narrow = floats.ggml_v_expf(x, True), floats.ggml_v_expf(x, False)
    apart = (wide != narrow).double().mean().item()
    assert 0 < apart < 0.5
    ulps = (wide.view(torch.int32).long() - narrow.view(torch.int32).long()).abs()
    assert int(ulps.max()) == 1


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
def test_silu_vector_and_scalar_forms_agree_with_f64(avx512):
    x = torch.linspace(-10, 10, 1001)
    exact = x.to(F64) / (1 + torch.exp(-x.to(F64)))
    assert float(((floats.ggml_v_silu(x, avx512) - exact) / exact.abs().clamp(min=1e-3)).abs().max()) < 1e-6
    assert float(((floats.silu_scalar(x) - exact) / exact.abs().clamp(min=1e-3)).abs().max()) < 1e-6
