"""ggml's CPU ops as emulated in tracer.ggml.ops: RMSNorm, RoPE, SwiGLU, the f16 dot product and
both flash-attention paths, on small literal and random tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.cpu_builds import AMD, BUILDS, INTEL, ZEN3
from tracer.ggml import ops
from tracer.ggml.floats import F32, F64, fma, ggml_v_silu, libm, powf, round_f16, silu_scalar
from tracer.model.config import LlamaSpec
from tracer.traces.layouts import to_interleaved


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_sequential_sum_is_a_left_to_right_loop():
    values = torch.tensor([[1e16, 1.0, -1e16, 1.0]], dtype=F64)
    assert ops.sequential_sum_f64(values).item() == 1.0  # 1e16 + 1 loses the 1; a pairwise sum keeps both
    assert (values[:, 0] + values[:, 2] + values[:, 1] + values[:, 3]).item() == 2.0


def test_rms_norm_is_within_one_rounding_of_f64_and_multiplies_x_by_scale_first():
    x, w = _randn(1, 5, 576, seed=1, scale=30), 1 + _randn(576, seed=2, scale=0.1)
    out = ops.rms_norm(x, w, 1e-5)
    x64 = x.to(F64)
    exact = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + np.float32(1e-5)) * w.to(F64)
    assert float(((out - exact) / exact).abs().max()) < 4 * 2**-24
    scale = (out / x / w)[0, :, 0]  # (x*s)*w: the same s for a row
    assert float((out[0, 0] - (x[0, 0] * scale[0]) * w).abs().max()) == 0.0


def test_rope_angles_are_repeated_f32_products_of_powf_and_the_c_librarys_cos_sin():
    spec = LlamaSpec(vocab_size=10, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                     num_key_value_heads=1, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=64)
    cos, sin = ops.rope_cos_sin(spec, torch.arange(9), F32)  # (1, T, D/2)
    scale = np.float32(powf(100000.0, -2.0 / 64))
    theta = np.float32(8)
    for _ in range(31):
        theta = np.float32(theta * scale)
    assert cos[0, 8, 31].item() == libm("cosf", torch.tensor([float(theta)])).item()
    assert cos[0, 0].eq(1).all() and sin[0, 0].eq(0).all()
    # transformers' angles (position times an inverse frequency computed once) differ in the last bits
    cos64, _ = ops.rope_cos_sin(spec, torch.arange(64), F32)
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=F32) / 64))
    hf_cos = (torch.arange(64, dtype=F32)[:, None] * inv_freq).cos()
    assert 0 < int((cos64[0] != hf_cos).sum()) and float((cos64[0] - hf_cos).abs().max()) < 1e-4
    # absolute positions: the tables at 1000..1008 are the rows 1000..1008 of a table from 0, each
    # position's angles built from the position itself
    far_cos, far_sin = ops.rope_cos_sin(spec, torch.arange(1000, 1009), F32)
    long_cos, long_sin = ops.rope_cos_sin(spec, torch.arange(1009), F32)
    assert torch.equal(far_cos[0], long_cos[0, 1000:]) and torch.equal(far_sin[0], long_sin[0, 1000:])
    assert not torch.equal(far_cos[0], cos[0])


@pytest.mark.parametrize("build, head_dim, fused", [
    ("amd", 12, 4),  # a 512-bit loop, its 256-bit epilogue: 4 pairs at a time, 2 left
    ("intel", 12, 6),  # a 256-bit loop, its 128-bit epilogue: 2 pairs at a time
    ("intel", 10, 4),
    ("amd", 64, 32),  # SmolLM2's heads: whole vectors on both
])
def test_rope_fuses_the_pairs_in_whole_vectors_and_rounds_each_product_of_the_rest(build, head_dim, fused):
    half = head_dim // 2
    x = _randn(1, 4, 16, head_dim, seed=3)
    cos, sin = torch.rand(1, 16, half), torch.rand(1, 16, half)
    out = ops.rope(x, cos, sin, BUILDS[build])
    x0, x1 = x[..., :half], x[..., half:]
    c, s = cos[:, None], sin[:, None]
    # fma(x0, c, -(x1*s)) and fma(x0, s, x1*c): one rounding of x0*c (x0*s) with the f32 product added
    y0 = (x0.to(F64) * c.to(F64) - (x1 * s).to(F64)).to(F32)
    y1 = (x0.to(F64) * s.to(F64) + (x1 * c).to(F64)).to(F32)
    assert torch.equal(out[..., :fused], y0[..., :fused]) and torch.equal(out[..., half:half + fused], y1[..., :fused])
    assert torch.equal(out[..., fused:half], (x0 * c - x1 * s)[..., fused:])  # vaddsubps: both products rounded
    assert torch.equal(out[..., half + fused:], (x0 * s + x1 * c)[..., fused:])
    assert float((out - ops.rope_exact(x, cos, sin)).abs().max()) < 1e-6


def test_the_two_cpus_rope_differs_where_one_leaves_pairs_to_the_scalar_tail():
    x, cos, sin = _randn(1, 4, 16, 12, seed=4), torch.rand(1, 16, 6), torch.rand(1, 16, 6)
    amd, intel = ops.rope(x, cos, sin, AMD), ops.rope(x, cos, sin, INTEL)
    differs = (amd != intel).flatten(0, 2).any(0)  # (D,): which dims differ anywhere
    assert differs[[4, 5, 10, 11]].all() and not differs[[0, 1, 2, 3, 6, 7, 8, 9]].any()


def test_swiglu_takes_16_lane_vectors_and_a_scalar_tail():
    gate, up = _randn(1, 2, 20, seed=4, scale=3), _randn(1, 2, 20, seed=5)
    out = ops.swiglu(gate, up)
    assert out.shape == (1, 2, 20)
    assert float(((out - ops.swiglu_exact(gate, up)).abs()
                  / ops.swiglu_exact(gate, up).abs().clamp(min=1e-3)).max()) < 1e-6


def test_vec_dot_f16_adds_registers_0_and_2_then_1_and_3():
    x, y = torch.zeros(64), torch.zeros(64)
    x[0], y[0] = 4096.0, 4096.0  # register 0, lane 0: 2^24
    x[32], y[32] = -4096.0, 4096.0  # register 2, lane 0: -2^24
    x[16] = y[16] = x[48] = y[48] = 1.0  # registers 1 and 3, lane 0
    assert ops.vec_dot_f16(x, y).item() == 2.0  # (a0 + a2) + (a1 + a3)
    seq = np.float32(0)
    for i in range(64):
        seq = np.float32(seq + np.float32(x[i] * y[i]))
    assert float(seq) == 1.0  # in order, 2^24 + 1 would lose the first 1
    tail = torch.ones(70)  # 64 in registers, 6 added one by one in f64
    assert ops.vec_dot_f16(tail, tail).item() == 70.0


def test_an_avx2_builds_dot_products_take_8_lanes_reduced_by_two_hadds():
    x, y = torch.zeros(32), torch.zeros(32)  # one AVX2 step (4 registers of 8); an AVX-512 build's tail
    x[:4], y[:4] = torch.tensor([4096.0, 1.0, -4096.0, 1.0]), torch.tensor([4096.0, 1.0, 4096.0, 1.0])
    # lanes 0-3 of register 0: (v0 + v1) + (v2 + v3), `_mm_hadd_ps` twice: 2^24 + 1 loses its 1
    assert ops.vec_dot_f16(x, y, ZEN3).item() == 1.0 and ops.vec_dot_f32(x, y, ZEN3).item() == 1.0
    assert ops.vec_dot_f16(x, y, AMD).item() == 2.0  # AVX-512: 32 values are a tail, added in f64
    assert ops.f32_lanes(ZEN3) == 8 and not ops.avx512_exp(ZEN3) and ops.f32_lanes(AMD) == 16


def test_swiglus_vectors_are_the_builds_width():
    """24 values: three AVX2 vectors (its exp), or one AVX-512 vector and 8 values of libm's expf."""
    gate, up = _randn(1, 64, 24, seed=6, scale=3), _randn(1, 64, 24, seed=7)
    assert torch.equal(ops.swiglu(gate, up, ZEN3), ggml_v_silu(gate, False) * up)
    avx512 = ops.swiglu(gate, up, AMD)
    assert torch.equal(avx512[..., 16:], silu_scalar(gate[..., 16:]) * up[..., 16:])
    assert torch.equal(avx512[..., :16], ggml_v_silu(gate[..., :16], True) * up[..., :16])
    assert not torch.equal(avx512, ops.swiglu(gate, up, ZEN3))


def _attention_inputs(heads: int, kv: int, tokens: int, dim: int, seed: int = 0):
    q, k, v = (_randn(1, h, tokens, dim, seed=seed + i, scale=2) for i, h in enumerate((heads, kv, kv)))
    return q, k, v


def test_flash_attention_below_64_rows_keeps_an_f16_accumulator():
    q, k, v = _attention_inputs(4, 2, 9, 64)
    out = ops.flash_attention(q, k, v, 64)  # (1, H, T, D)
    # the first query sees one key: its output is that value rounded to f16, times 1/1
    assert torch.equal(out[0, :, 0], round_f16(v[0].repeat_interleave(2, 0)[:, 0]))
    exact = ops.flash_attention(q, k, v, 64, accumulate="f64")
    plain = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8).masked_fill(
        torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf")), -1) @ v.repeat_interleave(2, 1)
    near = float((out - exact).norm() / exact.norm())  # same f16 accumulator, only the q·k sums differ
    far = float((out - plain).norm() / plain.norm())  # the f16 cache and accumulator themselves
    assert 0 < near < 1e-6 and 1e-4 < far < 3e-3
    assert float((exact - ops.flash_attention(q, k, v, 64, accumulate="f32")).norm() / exact.norm()) < 1e-5


def test_flash_attention_from_64_rows_is_tiled_with_f32_accumulators():
    q, k, v = _attention_inputs(2, 1, 70, 16, seed=7)
    tiled = ops.flash_attention(q, k, v, 16)
    exact = ops.flash_attention(q, k, v, 16, accumulate="f64")
    assert not torch.equal(tiled, exact)
    assert float((tiled - exact).norm() / exact.norm()) < 1e-6  # f32 accumulators: rounding level
    scores = (to_interleaved(q[0], 16) @ round_f16(to_interleaved(k[0], 16)).repeat(2, 1, 1).transpose(-1, -2))
    assert math.isfinite(float(scores.sum()))


def test_an_avx512_fp16_build_scales_and_accumulates_f16_values_in_f16_from_128_columns():
    assert [ops.native_f16_columns(n, INTEL) for n in (64, 128, 200, 256)] == [0, 128, 128, 256]
    assert ops.native_f16_columns(256, AMD) == 0  # AVX-512F: f32 arithmetic, each result rounded to f16
    y, x = round_f16(_randn(6, 200, seed=21)), round_f16(_randn(6, 200, seed=22))
    v = torch.rand(6, generator=torch.Generator().manual_seed(23))  # weights in (0, 1), not f16 values
    v16 = round_f16(v)
    mad = ops.vec_mad_f16(y, x, v, 128)
    literal = [[float(np.float16(float(x[r, i]) * float(v16[r]) + float(y[r, i]))) for i in range(128)]
               for r in range(6)]  # _mm512_fmadd_ph(x, f16(v), y): one rounding of the exact value
    assert mad[:, :128].tolist() == literal
    assert torch.equal(mad[:, 128:], round_f16(fma(x, v[:, None], y))[:, 128:])  # the scalar leftovers
    assert not torch.equal(mad, ops.vec_mad_f16(y, x, v, 0))
    scaled = ops.vec_scale_f16(y, v, 128)
    assert torch.equal(scaled[:, :128], round_f16(y * v16[:, None])[:, :128])  # f16 * f16: exact, then f16
    assert torch.equal(scaled[:, 128:], round_f16(y * v[:, None])[:, 128:])
    # flash attention over 128-wide heads: the two CPUs' builds part in the last bits
    q, k, v = (_randn(2, 9, 128, seed=24 + i, scale=2) for i in range(3))
    amd, intel = (ops.flash_attn_one_chunk(q, k, v, 128**-0.5, features=build) for build in (AMD, INTEL))
    assert not torch.equal(amd, intel) and float((amd - intel).norm() / amd.norm()) < 1e-3


def _bf16_values(*shape: int, seed: int) -> torch.Tensor:
    return _randn(*shape, seed=seed, scale=3).to(torch.bfloat16).to(F32)


def _literal_dpbf16_dot(x: torch.Tensor, y: torch.Tensor) -> float:
    """ggml_vec_dot_bf16 with AVX512-BF16 written out in numpy f32 scalars: two 16-lane
    accumulators, per lane the odd element's product added before the even one's, then each
    register reduced (halves 8, 4, then (t0+t2) + (t1+t3)) and added in f64, the tail in f64."""
    xs, ys, f32 = x.tolist(), y.tolist(), np.float32
    registers = [[f32(0)] * 16, [f32(0)] * 16]
    width = len(xs) - len(xs) % 64
    for start in range(0, width, 64):
        for r in range(2):
            for j in range(16):
                i = start + 32 * r + 2 * j
                acc = f32(registers[r][j] + f32(xs[i + 1]) * f32(ys[i + 1]))
                registers[r][j] = f32(acc + f32(xs[i]) * f32(ys[i]))

    def reduce(v):
        v = [f32(v[i + 8] + v[i]) for i in range(8)]
        v = [f32(v[i + 4] + v[i]) for i in range(4)]
        return float(f32(f32(v[0] + v[2]) + f32(v[1] + v[3])))

    total = reduce(registers[0]) + reduce(registers[1])
    for i in range(width, len(xs)):
        total += float(f32(xs[i]) * f32(ys[i]))
    return float(f32(total))


def test_vec_dot_bf16_with_avx512_bf16_is_dpbf16_written_out_and_differs_from_the_avx512f_path():
    x, y = _bf16_values(6, 136, seed=11), _bf16_values(6, 136, seed=12)  # two steps of 64, a tail of 8
    out = ops.vec_dot_bf16(x, y, use_dpbf16=True)
    assert out.tolist() == [_literal_dpbf16_dot(x[i], y[i]) for i in range(6)]
    many_x, many_y = _bf16_values(256, 128, seed=13), _bf16_values(256, 128, seed=14)
    assert not torch.equal(ops.vec_dot_bf16(many_x, many_y, use_dpbf16=True),
                           ops.vec_dot_bf16(many_x, many_y, use_dpbf16=False))  # the CPU's path matters


def test_dpbf16_adds_the_odd_product_first():
    acc, x, y = torch.full((16,), 2.0**24), torch.zeros(32), torch.zeros(32)
    x[0], y[0], x[1], y[1] = 1.0, 1.0, 1.0, 1.0  # lane 0: 2^24 + 1 + 1, each add rounded
    assert ops.dpbf16(acc, x, y)[0].item() == 2.0**24  # ties to even twice: both ones lost
    x[1] = 2.0  # the odd product (2) first: 2^24 + 2 is exact, then + 1 ties to even
    assert ops.dpbf16(acc, x, y)[0].item() == 2.0**24 + 4


def test_the_build_features_are_its_report_and_what_the_cpu_adds():
    assert {"AVX2", "AVX512", "AVX512_BF16", "LLAMAFILE", "REPACK"} <= AMD & INTEL
    assert "SSE3" in AMD  # the report's first name, after its "CPU :"
    assert AMD - INTEL == {"ZNVER"} and INTEL - AMD == {"AVX_VNNI", "AVX512_FP16"}
    assert not ops.contracts_fma_chains(AMD) and ops.contracts_fma_chains(INTEL)
    assert ops.vectorises_in_512_bits(AMD) and not ops.vectorises_in_512_bits(INTEL)
    assert not ops.vectorises_in_512_bits(AMD - {"AVX512"})  # an AVX2 Zen: 256-bit vectors
    # a Hygon CPU is built as a Zen; the report never names AVX512-FP16, the CPU's flags do
    assert "ZNVER" in ops.report_features("AVX2 = 1 |", {"vendor_id": "HygonGenuine"})
    assert ops.report_features("AVX2 = 1 | AVX512 = 0 |", {"flags": "avx2 avx512_fp16"}) == {"AVX2", "AVX512_FP16"}
    assert ops.takes_dpbf16() == ("AVX512_BF16" in ops.llamacpp_cpu_features())


