"""llama.cpp's float-weight matmuls (tracer.ggml.tinyblas): the compiled lane chains against
tinyBLAS written out in tensor code, AVX512-BF16's reordered chain, and the path each build and
shape takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracer.ggml import kernels, ops, tinyblas
from tracer.ggml.floats import F64, round_bf16, round_f16
from tracer.ggml.quants import Blocks

BUILD = frozenset({"AVX2", "AVX512", "LLAMAFILE"})  # an AVX-512 build without AVX512-BF16
BF16_BUILD = BUILD | {"AVX512_BF16"}
AVX2_BUILD = frozenset({"AVX2", "FMA", "F16C", "LLAMAFILE"})  # 8 lanes: tinyBLAS<8, __m256, ...>


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("build", [BUILD, AVX2_BUILD], ids=["avx512", "avx2"])
@pytest.mark.parametrize("tokens, inner, rows", [(7, 64, 97), (13, 576, 70), (2, 80, 12), (9, 1536, 130)])
def test_the_compiled_lane_chains_are_tinyblas_written_out(tokens, inner, rows, build):
    """Tails of every tile (tokens not a multiple of 8, rows of 64, steps of 4) included; 16 lanes
    (`_mm512_reduce_add_ps`) and AVX2's 8 (tinyBLAS' hsum)."""
    x, w = round_f16(_randn(tokens, inner, seed=1)), round_f16(_randn(rows, inner, seed=2))
    lanes = ops.f32_lanes(build)
    out = kernels.lane_chains(x.numpy().reshape(tokens, -1, lanes),
                              w.T.contiguous().numpy().reshape(-1, lanes, rows))
    assert np.array_equal(out, ops.tinyblas_dot(x[:, None], w[None], build).numpy())
    if tinyblas.takes_tinyblas("f16", (rows, inner), tokens, build):  # the matmul takes these chains
        assert torch.equal(tinyblas.matmul(x, Blocks("f16", (rows, inner), held=w), build), torch.from_numpy(out))
    exact = (x.to(F64) @ w.to(F64).T).float().numpy()
    assert not np.array_equal(out, exact)  # the order is observable: an exact sum rounds otherwise


def test_avx512_bf16s_dot_products_are_the_same_chain_over_a_reordered_inner_axis():
    x, w = round_bf16(_randn(5, 96, seed=3)), round_bf16(_randn(40, 96, seed=4))
    order = tinyblas.dpbf16_order(96)
    assert order[:34].tolist() == [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                   0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 33, 35]
    ours = tinyblas.matmul(x, Blocks("bf16", (40, 96), held=w), BF16_BUILD)
    assert torch.equal(ours, ops.tinyblas_dot_dpbf16(x[:, None], w[None]))
    avx512f = tinyblas.matmul(x, Blocks("bf16", (40, 96), held=w), BUILD)
    assert torch.equal(avx512f, ops.tinyblas_dot(x[:, None], w[None], BUILD)) and not torch.equal(ours, avx512f)
    avx2 = tinyblas.matmul(x, Blocks("bf16", (40, 96), held=w), AVX2_BUILD)
    assert torch.equal(avx2, ops.tinyblas_dot(x[:, None], w[None], AVX2_BUILD)) and not torch.equal(avx2, avx512f)


@pytest.mark.parametrize("kind, shape, tokens, build, takes", [
    ("f16", (64, 64), 2, BUILD, True),
    ("f16", (64, 64), 1, BUILD, False),  # llamafile_sgemm: prompt processing only
    ("f16", (97, 64), 5, BUILD, False),  # tinyBLAS::matmul: rows in 4s
    ("f32", (64, 72), 5, BUILD, False),  # the inner axis in whole vectors of 16
    ("bf16", (64, 80), 5, BUILD, True),
    ("bf16", (64, 80), 5, BF16_BUILD, False),  # __m512bh: whole 32s
    ("f16", (64, 64), 5, BUILD - {"LLAMAFILE"}, False),
])
def test_tinyblas_takes_what_llamafile_sgemm_takes(kind, shape, tokens, build, takes):
    assert tinyblas.takes_tinyblas(kind, shape, tokens, build) is takes


@pytest.mark.parametrize("build", [BUILD, AVX2_BUILD], ids=["avx512", "avx2"])
@pytest.mark.parametrize("kind", ["f16", "bf16", "f32"])
def test_one_row_or_a_refused_shape_is_ggml_vec_dot_per_output(kind, build):
    fmt = {"f16": round_f16, "bf16": round_bf16, "f32": lambda t: t}[kind]
    x, w = fmt(_randn(3, 128, seed=5)), fmt(_randn(97, 128, seed=6))  # 97 rows: tinyBLAS refuses
    dot = {"f16": lambda a, b: ops.vec_dot_f16(a, b, build), "bf16": lambda a, b: ops.vec_dot_bf16(a, b, False, build),
           "f32": lambda a, b: ops.vec_dot_f32(a, b, build)}[kind]
    weight = Blocks(kind, (97, 128), held=w)
    assert torch.equal(tinyblas.matmul(x, weight, build), dot(x[:, None], w[None]))
    assert torch.equal(tinyblas.matmul(x[:1], weight, build), dot(x[:1, None], w[None]))
    other = AVX2_BUILD if build is BUILD else BUILD
    assert not torch.equal(tinyblas.matmul(x, weight, other), dot(x[:, None], w[None]))  # the lanes are observable
