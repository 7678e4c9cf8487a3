"""candle's arithmetic on the GGUF types people download (tracer.ggml.candle_kernels,
tracer.ggml.candle) against candle-nn 0.4.2's own kernels, bit for bit: its Q8_K quantizer,
`QTensor.matmul_t` on Q2_K..Q6_K, Q5_0, Q5_1 and F16 weights, and quantized_llama.rs end to end
on a tiny Llama that llama.cpp's quantizer made Q3_K_M (Q3_K, Q4_K, Q5_K and Q6_K tensors).

The kernel tests are quick; those on whole files start llama.cpp's quantizer in a child process or
run both forwards (`slow`: the whole suite runs them, the quick tier does not)."""

import numpy as np
import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.ggml_gguf import sourced_copy
from tests.quantized_gguf import quantize_gguf, write_kquant_llama
from tracer import TracerError
from tracer.engines import candle as candle_engine
from tracer.files.gguffile import GGUFFile
from tracer.files.sources import ModelSource
from tracer.ggml import candle as emulated
from tracer.ggml.kquants import from_gguf_bytes
from tracer.ggml.quants import VEC_DOT_TYPE

CANDLE_Q = {"preset": "candle-q", "weights": "gguf"}
# tracer's type names -> the names candle's `Tensor.quantize` takes
CANDLE_NAMES = {"q2_k": "q2k", "q3_k": "q3k", "q4_k": "q4k", "q5_k": "q5k", "q6_k": "q6k", "q5_0": "q5_0",
                "q5_1": "q5_1"}


@pytest.fixture(scope="module")
def candle():
    candle = pytest.importorskip("candle")
    try:
        candle_engine.check_platform()
    except TracerError as exc:
        pytest.skip(str(exc))
    return candle


def values(tensor) -> torch.Tensor:
    return torch.tensor(tensor.values(), dtype=torch.float32)


def activations(tokens: int, width: int, seed: int) -> torch.Tensor:
    """Rows with an all-zero 256-value block (Q8_K's d = 0) and an outlier (a block whose other
    quants are small)."""
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :256] = 0
    x[1, 7] = 300.0
    return x


def saved_blocks(candle, qtensor, tmp_path):
    """The blocks of a QTensor, read back through a GGUF file candle writes itself."""
    path = tmp_path / "w.gguf"
    candle.utils.save_gguf(str(path), {"w": qtensor}, {})
    file = GGUFFile(path)
    return from_gguf_bytes(file.tensors["w"].kind, file.raw("w"), file.tensors["w"].shape)


def test_q8_k_is_candle_0_4_2s_with_minus_128_over_max(candle, tmp_path):
    """d = 1/iscale, iscale = -128/max (the first value of largest magnitude), q = min(127, round
    half away): -128 where x = max, ties away from zero; d = 0 and no quants for a zero block."""
    import gguf

    x = activations(3, 512, 1)
    x[2, 256:] = torch.linspace(-2, 2, 256)
    x[2, 300], x[2, 301], x[2, 302] = -128.0, 2.5, -3.5  # max -128: iscale 1, so 2.5 and -3.5 are ties
    path = tmp_path / "q8k.gguf"
    candle.utils.save_gguf(str(path), {"x": candle.Tensor(x.numpy()).quantize("q8k")}, {})
    raw = gguf.GGUFReader(path).tensors[0].data.reshape(3, 2, 292)  # (T, B, bytes): d f32, 256 qs, 16 bsums
    d = torch.from_numpy(np.ascontiguousarray(raw[..., :4]).view(np.float32)[..., 0])
    q = torch.from_numpy(np.ascontiguousarray(raw[..., 4:260]).view(np.int8).astype(np.float32))
    ours = emulated.quantize(x, "q8_k")
    assert torch.equal(ours.d, d) and torch.equal(ours.q, q)
    assert ours.q[2, 1, 300 - 256] == -128 and ours.q[2, 1, 45:47].tolist() == [3, -4]
    assert ours.d[0, 0] == 0 and not ours.q[0, 0].any()


@pytest.mark.parametrize("kind", list(CANDLE_NAMES))
def test_each_types_vec_dot_is_candles_to_the_bit(candle, tmp_path, kind):
    generator = torch.Generator().manual_seed(len(kind))
    weight = torch.randn(100, 512, generator=generator)
    x = activations(9, 512, 2)
    qtensor = candle.Tensor(weight.numpy()).quantize(CANDLE_NAMES[kind])
    expected = values(qtensor.matmul_t(candle.Tensor(x.numpy())))
    got = emulated.matmul(emulated.quantize(x, VEC_DOT_TYPE[kind]), saved_blocks(candle, qtensor, tmp_path))
    assert torch.equal(got, expected)


def test_ggmls_q8_k_is_not_candles(candle, tmp_path):
    """The quantizer's difference is real: ggml's Q8_K (-127/max, ties to even) gives other products
    on the same Q4_K weights."""
    from tracer.ggml.quants import quantize_q8_k as ggml_q8_k

    x = activations(9, 512, 3)
    qtensor = candle.Tensor(torch.randn(100, 512, generator=torch.Generator().manual_seed(4)).numpy()).quantize("q4k")
    expected = values(qtensor.matmul_t(candle.Tensor(x.numpy())))
    ggml = emulated.matmul(ggml_q8_k(x), saved_blocks(candle, qtensor, tmp_path))
    assert (ggml != expected).float().mean() > 0.5


@pytest.fixture(scope="module")
def kquant_model(candle, tmp_path_factory):
    """(a tiny random Llama with k-quant-sized widths, its F32 GGUF, their folder)."""
    folder = tmp_path_factory.mktemp("candle-kquants")
    return *write_kquant_llama(folder), folder


@pytest.fixture(scope="module")
def q3_k_m(kquant_model):
    """(the Q3_K_M file llama.cpp's quantizer makes of the tiny Llama, the directory converted
    from it): Q3_K, Q4_K, Q5_K and Q6_K tensors."""
    model, f32_file, folder = kquant_model
    gguf_file = quantize_gguf(f32_file, folder / "tiny-q3_k_m.gguf", "Q3_K_M")
    return gguf_file, sourced_copy(model, gguf_file, folder / "converted")


@pytest.mark.slow
def test_every_projection_of_a_llama_cpp_file_is_candles_matmul(candle, q3_k_m):
    gguf_file, _ = q3_k_m
    tensors, _ = candle.utils.load_gguf(str(gguf_file))
    file = GGUFFile(gguf_file)
    x = activations(7, 512, 5)
    kinds = set()
    for name, info in file.tensors.items():
        if len(info.shape) == 2:
            rows = x[:, :info.shape[1]]
            expected = values(tensors[name].matmul_t(candle.Tensor(rows.contiguous().numpy())))
            weight = from_gguf_bytes(info.kind, file.raw(name), info.shape)
            act = emulated.quantize(rows, VEC_DOT_TYPE[info.kind])
            assert torch.equal(emulated.matmul(act, weight), expected), name
            kinds.add(info.kind)
    assert kinds == {"q3_k", "q4_k", "q5_k", "q6_k"}


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [TOKENS, TOKENS[:1]])
def test_quantized_llama_rs_on_k_quants_is_candles_regime_at_every_point(q3_k_m, tokens):
    """One token too: gemm's gemv for q·kᵀ."""
    gguf_file, converted = q3_k_m
    candidate = candle_engine.load(ModelSource(converted), {}, argument=str(gguf_file)).record(tokens)
    emulation = tracer.record(converted, tokens, engine="reimpl", variant=CANDLE_Q)
    assert list(candidate.tensors) == list(emulation.tensors)
    for point, value in candidate.tensors.items():
        assert torch.equal(value, emulation.tensors[point]), point


@pytest.mark.slow
def test_regime_auto_on_k_quants_has_no_caveat(q3_k_m):
    from tracer.engines.registry import parse_engine
    from tracer.pipeline.regime_view import resolve

    gguf_file, converted = q3_k_m
    knobs, caveats, audit = resolve("auto", parse_engine(f"candle:{gguf_file}"), {}, ModelSource(converted))
    assert (knobs, caveats, audit.verdict) == (CANDLE_Q, [], "identical")


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [TOKENS, TOKENS[:1]])
def test_f16_weights_are_dequantized_and_multiplied_by_gemm(candle, tmp_path, tokens):
    """QMatMul turns F16 weights into f32 tensors: gemm's products, its gemv for one token."""
    model, gguf_file = write_kquant_llama(tmp_path, dtype="f16")
    assert "f16" in {info.kind for info in GGUFFile(gguf_file).tensors.values()}
    converted = sourced_copy(model, gguf_file, tmp_path / "converted")
    candidate = candle_engine.load(ModelSource(converted), {}, argument=str(gguf_file)).record(tokens)
    emulation = tracer.record(converted, tokens, engine="reimpl", variant=CANDLE_Q)
    for point, value in candidate.tensors.items():
        assert torch.equal(value, emulation.tensors[point]), point


@pytest.mark.slow
def test_a_bf16_file_is_one_line_naming_the_type_candle_cannot_read(kquant_model, tmp_path):
    model, f32_file, _ = kquant_model
    gguf_file = quantize_gguf(f32_file, tmp_path / "tiny-bf16.gguf", "BF16")
    with pytest.raises(TracerError, match=r"^candle-nn 0.4.2 cannot read BF16 tensors .*tiny-bf16.gguf"):
        candle_engine.load(ModelSource(model), {}, argument=str(gguf_file))
