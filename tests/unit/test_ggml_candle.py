"""candle's CPU arithmetic (tracer.ggml.candle) against candle-nn's own kernels, bit for bit:
quantized matmuls through `QTensor.matmul_t`, the f32 reductions and products the candle engine
composes its forward from."""

import pytest
import torch

from tracer.files.gguffile import GGUFFile
from tracer.ggml import candle as emulated
from tracer.ggml.quants import from_gguf_bytes


@pytest.fixture(scope="module")
def candle():
    candle = pytest.importorskip("candle")
    from tracer.core.errors import TracerError
    from tracer.engines.candle import check_platform

    try:
        check_platform()
    except TracerError as exc:
        pytest.skip(str(exc))
    return candle


def values(tensor) -> torch.Tensor:
    return torch.tensor(tensor.values(), dtype=torch.float32)


def blocks_of(candle, qtensor, tmp_path):
    """The blocks candle quantized, read back through a GGUF file it writes itself."""
    path = tmp_path / "w.gguf"
    candle.utils.save_gguf(str(path), {"w": qtensor}, {})
    info = GGUFFile(path).tensors["w"]
    return from_gguf_bytes(info.kind, GGUFFile(path).raw("w"), info.shape)


@pytest.mark.parametrize("kind, act", [("q4_1", "q8_1"), ("q8_0", "q8_0"), ("q4_0", "q8_0")])
@pytest.mark.parametrize("inputs", ["normal", "positive"])
def test_a_quantized_matmul_is_candles_to_the_bit(candle, tmp_path, kind, act, inputs):
    """Positive rows put each Q8_1 block's sum past 2048, where f16(sum) rounds: candle's s term."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 256, generator=generator)
    x = torch.randn(7, 256, generator=generator) * 3
    x = x.abs() if inputs == "positive" else x
    qtensor = candle.Tensor(weight.numpy()).quantize(kind)
    expected = values(qtensor.matmul_t(candle.Tensor(x.numpy())))
    got = emulated.matmul(emulated.quantize(x, act), blocks_of(candle, qtensor, tmp_path))
    assert torch.equal(got, expected)


def test_ggmls_quantizer_is_not_candles(candle, tmp_path):
    """The three differences are real: ggml's x86 Q8_1 (127/amax, ties to even, f16(d·sum)) gives
    other products on the same Q4_1 weights."""
    from tracer.ggml.quants import quantize_q8_1

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(7, 256, generator=generator).abs() * 3
    qtensor = candle.Tensor(torch.randn(48, 256, generator=generator).numpy()).quantize("q4_1")
    expected = values(qtensor.matmul_t(candle.Tensor(x.numpy())))
    ggml = emulated.matmul(quantize_q8_1(x), blocks_of(candle, qtensor, tmp_path))
    assert (ggml != expected).float().mean() > 0.5


@pytest.mark.parametrize("width", [5, 32, 37, 576, 1536])
def test_vec_sum_is_candles_sum_keepdim(candle, width):
    x = torch.randn(6, width, generator=torch.Generator().manual_seed(width)) * 10
    assert torch.equal(emulated.vec_sum(x), values(candle.Tensor(x.numpy()).sum_keepdim(1))[:, 0])


@pytest.mark.parametrize("m, k, n", [(5, 64, 5), (7, 7, 64), (40, 64, 40), (9, 16, 9), (5, 512, 64), (5, 513, 64),
                                     (7, 576, 64), (5, 576, 200), (70, 600, 64), (5, 1100, 70)])
def test_products_are_gemms_blocked_fma_chains(candle, m, k, n):
    """One chain up to 512 values of depth; past it 512-value blocks for small products (<= 64 rows
    and columns), else gemm's cache model's equal blocks (576 -> 2 × 288, 1100 -> 3 × 367): probs·v
    of prompts over 512 tokens included."""
    generator = torch.Generator().manual_seed(m * k)
    a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    assert torch.equal(emulated.gemm(a, b), values(candle.Tensor(a.numpy()).matmul(candle.Tensor(b.numpy()))))


@pytest.mark.parametrize("k", [513, 576, 1100])
def test_past_512_one_chain_is_not_gemms_order(candle, k):
    """The depth blocks are real: one chain over the whole depth gives other sums."""
    from tracer.ggml import kernels

    generator = torch.Generator().manual_seed(9)
    a, b = torch.randn(70, k, generator=generator), torch.randn(k, 64, generator=generator)
    product = values(candle.Tensor(a.numpy()).matmul(candle.Tensor(b.numpy())))
    assert not torch.equal(torch.from_numpy(kernels.fma_chains(a.numpy(), b.numpy())), product)


def test_gemms_depth_blocks_split_only_past_512():
    """Small products take 512-value blocks and a remainder; larger ones k split evenly into blocks
    of at most an L1-sized depth of at least 512 (its size depends on this machine's L1: the
    products above check it against the wheel)."""
    assert emulated.gemm_depth_block(5, 64, 1100) == 512
    assert emulated.gemm_depth_block(512, 64, 512) == 512 and emulated.gemm_depth_block(5, 1536, 300) == 300
    block = emulated.gemm_depth_block(5, 1536, 1100)
    parts = -(-1100 // block)
    assert parts <= 3 and block == -(-1100 // parts)  # at most ceil(1100 / 512) equal blocks


@pytest.mark.parametrize("tokens, depth, rows", [(1, 576, 64), (1, 100, 7), (1, 1536, 70), (5, 576, 64), (5, 1536, 576),
                                                 (70, 576, 100)])
def test_f32_and_f16_weights_are_gemms_product(candle, tokens, depth, rows):
    """QMatMul dequantizes F32/F16 weights and multiplies by gemm; one token takes gemm's gemv."""
    generator = torch.Generator().manual_seed(tokens * depth)
    x, weight = torch.randn(tokens, depth, generator=generator), torch.randn(rows, depth, generator=generator)
    for kind in ("f32", "f16"):
        qtensor = candle.Tensor(weight.numpy()).quantize(kind)
        expected = values(qtensor.matmul_t(candle.Tensor(x.numpy())))
        assert torch.equal(emulated.matmul(x, torch.tensor(qtensor.dequantize().values())), expected)


def test_one_query_scores_are_gemms_gemv(candle):
    generator = torch.Generator().manual_seed(11)
    q, k = torch.randn(9, 1, 64, generator=generator), torch.randn(9, 1, 64, generator=generator)
    expected = values(candle.Tensor(q.numpy()).matmul(candle.Tensor(k.numpy()).t()))
    assert torch.equal(emulated.gemm(q, k.transpose(-1, -2)), expected)


def test_the_composed_rms_norm_softmax_and_silu_are_candles(candle):
    from tracer.engines.candle import Forward, Shape
    from tracer.ggml.candle import candle_inv_freq

    generator = torch.Generator().manual_seed(5)
    x = torch.randn(1, 5, 576, generator=generator) * 0.05  # small: eps and sqrt's last bit matter
    weight = 1 + torch.randn(576, generator=generator) * 0.1
    shape = Shape(1, 9, 3, 64, 576, 10, 8, 1e-5, candle_inv_freq(1e5, 64), "interleaved", True, "interleave", "where")
    forward = Forward(shape, {}, None, candle)
    norm = forward.rms_norm(candle.Tensor(x.numpy()), candle.Tensor(weight.numpy()))
    assert torch.equal(emulated.rms_norm(x, weight, 1e-5), values(norm))
    scores = torch.randn(9, 5, 5, generator=generator) * 4
    assert torch.equal(emulated.softmax(scores), values(forward.softmax_last_dim(candle.Tensor(scores.numpy()))))
    gate, up = torch.randn(5, 96, generator=generator) * 4, torch.randn(5, 96, generator=generator)
    act = candle.functional.silu(candle.Tensor(gate.numpy())) * candle.Tensor(up.numpy())
    assert torch.equal(emulated.glu(gate, up, "silu"), values(act))


def test_rope_tables_are_candles_cos_and_sin(candle):
    from tracer.ggml.candle import candle_inv_freq, rope_angles
    from tracer.model.config import LlamaSpec

    spec = LlamaSpec(10, 64, 96, 1, 4, 2, 16, 1e5, 1e-5, 64)
    cos, sin = emulated.rotary(spec, torch.arange(1000, 1009), torch.float32)  # absolute positions 1000..1008
    angles = candle.Tensor(rope_angles(candle_inv_freq(1e5, 16), range(1000, 1009)))
    assert torch.equal(cos[0, :, :8], values(angles.cos()))
    assert torch.equal(sin[0, :, 8:], values(angles.sin()))


def test_implied_regime_names_what_it_cannot_reproduce_exactly():
    knobs, caveats = emulated.implied_regime({"a.weight": "q4_1", "b.weight": "q6_k", "c.weight": "q5_0",
                                              "d.weight": "q8_1"})
    assert knobs == {"preset": "candle-q", "weights": "gguf"}
    assert len(caveats) == 1 and caveats[0].startswith("Q8_1 weights (1 tensors, e.g. d.weight)")
