"""Q4_0 and IQ4_NL as llama.cpp multiplies them (tracer.ggml.repack): the repacked gemv/gemm's one
FMA per block, IQ4_NL's codebook and its two-accumulator vec_dot, and which weights are repacked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.cpu_builds import BUILDS
from tracer.ggml import repack
from tracer.ggml.floats import F32, F64, fma, hsum8
from tracer.ggml.quants import IQ4_NL_VALUES, Blocks, from_gguf_bytes, quantize, quantize_q8_0
from tracer.ggml.vecdot import matmul_ggml

BUILD = frozenset({"AVX2", "AVX512", "LLAMAFILE", "REPACK"})


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _iq4_nl_bytes(rows: int, cols: int, seed: int) -> np.ndarray:
    """(R, bytes) random IQ4_NL blocks as a GGUF stores them: an f16 scale, 16 bytes of nibbles."""
    generator = np.random.default_rng(seed)
    raw = generator.integers(0, 256, size=(rows, cols // 32, 18), dtype=np.uint8)
    scales = generator.uniform(0.001, 0.01, size=(rows, cols // 32, 1)).astype(np.float16)
    raw[..., :2] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def _iq4_nl(rows: int, cols: int, seed: int) -> Blocks:
    return from_gguf_bytes("iq4_nl", _iq4_nl_bytes(rows, cols, seed), (rows, cols))


def _block_chains_written_out(act, weight) -> torch.Tensor:
    """Per output: acc = fma(sum of the block's 32 integer products, d_w * d_x, acc), blocks in order."""
    sums = torch.einsum("tbi,rbi->trb", act.q.to(F64), weight.q.to(F64)).to(F32)  # (T, R, B): integers, exact
    acc = torch.zeros(sums.shape[:2])
    for b in range(sums.shape[2]):
        acc = fma(sums[..., b], weight.d[None, :, b] * act.d[:, None, b], acc)
    return acc


@pytest.mark.parametrize("kind", ["q4_0", "iq4_nl"])
def test_a_repacked_weight_takes_one_fma_per_block_over_exact_integer_sums(kind):
    weight = quantize(_randn(104, 96, seed=1), "q4_0") if kind == "q4_0" else _iq4_nl(104, 96, seed=1)
    act = quantize_q8_0(_randn(11, 96, seed=2) * 3)  # 11 rows: gemm on 8 and gemv on 3 alike
    out = repack.matmul(act, weight, BUILD)
    assert torch.equal(out, _block_chains_written_out(act, weight))
    assert not torch.equal(out, matmul_ggml(act, weight))  # the 8-lane vec_dot order differs


def test_iq4_nl_unpacks_to_its_codebook_as_the_gguf_package_dequantizes():
    import gguf.quants

    raw = _iq4_nl_bytes(4, 64, seed=3)
    blocks = from_gguf_bytes("iq4_nl", raw, (4, 64))
    assert blocks.unpacked and set(blocks.q.unique().tolist()) <= set(IQ4_NL_VALUES.tolist())
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.IQ4_NL)
    assert np.array_equal(blocks.values().numpy(), expected)


@pytest.mark.parametrize("build", ["intel", "amd"])
def test_iq4_nl_on_one_row_is_two_accumulators_and_a_scalar_last_block(build):
    weight, act = _iq4_nl(60, 96, seed=4), quantize_q8_0(_randn(1, 96, seed=5) * 3)  # 3 blocks: one pair, one left
    lanes = (weight.q.to(F32).unflatten(-1, (8, 4)) * act.q[0].unflatten(-1, (8, 4))).sum(-1)  # (R, B, 8)
    scale = weight.d * act.d[0]  # (R, B)
    acc_even, acc_odd = scale[:, 0, None] * lanes[:, 0], scale[:, 1, None] * lanes[:, 1]  # fma(d, lane, 0)
    pairs, last = hsum8(acc_even + acc_odd), lanes[:, 2].sum(-1)
    # `sumf += d * (sumi1 + sumi2)`: fused on Intel; GCC's tuning for Zen keeps the loop's add apart
    expected = fma(scale[:, 2], last, pairs) if build == "intel" else pairs + scale[:, 2] * last
    out = repack.matmul(act, weight, BUILDS[build])  # 60 rows: not repacked (ne[1] % 8)
    assert torch.equal(out, expected[None])
    other = BUILDS["amd" if build == "intel" else "intel"]
    assert not torch.equal(out, repack.matmul(act, weight, other))
    two_rows = quantize_q8_0(_randn(2, 96, seed=5) * 3)  # from 2 rows tinyBLAS_Q0_AVX: vec_dot's 8 lanes
    assert torch.equal(repack.matmul(two_rows, weight, BUILDS[build]), matmul_ggml(two_rows, weight))


@pytest.mark.parametrize("kind, rows, build, repacked", [
    ("q4_0", 104, BUILD, True),
    ("iq4_nl", 104, BUILD, True),
    ("q4_0", 100, BUILD, False),  # ne[1] % 8
    ("q4_0", 104, BUILD - {"REPACK"}, False),  # a build without the CPU_REPACK buffer
    ("q8_0", 104, BUILD, False),  # repacked on ARM only
])
def test_llama_cpp_repacks_4_bit_weights_with_rows_in_8s(kind, rows, build, repacked):
    weight = Blocks(kind, (rows, 64), d=torch.ones(rows, 2), q=torch.zeros(rows, 2, 32, dtype=torch.int16))
    assert repack.repacks(weight, build) is repacked
