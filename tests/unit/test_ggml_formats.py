"""The llamacpp regime against llama.cpp itself on GGUF files its own quantizer made from a tiny
random Llama: Q4_0 and IQ4_NL (repacked at load where the rows come in 8s, not elsewhere), F16 and
BF16 (tinyBLAS, ggml_vec_dot_f16/bf16) and F32 (tinyBLAS' f32 kernel), at 1, 7 and 70 tokens."""

from __future__ import annotations

import pytest

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tests.cpu_builds import skip_unless_exact_here
from tests.ggml_gguf import sourced_copy
from tests.quantized_gguf import quantize_gguf
from tests.tiny_gguf import write_tiny_gguf
from tracer.files.sources import ModelSource
from tracer.ggml import ops
from tracer.ggml.strategies import GGUFWeights, implied_regime

# 96 wide: 3 blocks of 32 (IQ4_NL's one-row vec_dot ends on an odd block). k/v 12 rows (KV 1 x
# head_dim 12): not repacked (ne[1] % 8), taken by tinyBLAS (rows in 4s). A vocabulary of 98: the
# tied f16/bf16 output is refused by tinyBLAS (rows in 4s), ggml_vec_dot for every row. The rest
# (q, o, gate, up, down: 96 and 128 rows) repacked.
SHAPES = dict(vocab_size=98, hidden_size=96, intermediate_size=128, num_attention_heads=8, num_key_value_heads=1)
PROMPTS = (TOKENS[:1], TOKENS, (TOKENS * 10)[:70])  # vec_dot only; tinyBLAS and gemm + gemv; the tiled attention
BF16 = "BF16-dpbf16" if ops.takes_dpbf16() else "BF16-avx512f"


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    """(folder, the tiny HF directory, its F32 GGUF)."""
    folder = tmp_path_factory.mktemp("formats")
    model = write_tiny_llama(folder / "model", **SHAPES)
    return folder, model, write_tiny_gguf(model, folder / "F32.gguf")


@pytest.mark.parametrize("ftype", ["Q4_0", "IQ4_NL", "F16", pytest.param("BF16", id=BF16), "F32"])
def test_the_llamacpp_preset_is_llama_cpp_to_the_bit_on_a_file_its_quantizer_made(f32_model, ftype):
    pytest.importorskip("llama_cpp")
    from tracer.engines import llamacpp

    folder, model, f32 = f32_model
    gguf = f32 if ftype == "F32" else quantize_gguf(f32, folder / f"{ftype}.gguf", ftype)
    types = GGUFWeights(gguf).types()
    assert types["model.layers.0.mlp.up_proj.weight"] == ftype.lower()
    skip_unless_exact_here(implied_regime(types, {})[1])  # exact here: the free-running verdict
    converted = sourced_copy(model, gguf, folder / ftype)
    engine = llamacpp.load(ModelSource(converted), {"threads": 1}, argument=str(gguf))
    for tokens in PROMPTS:
        ours = tracer.record(converted, tokens, engine="reimpl", variant={"preset": "llamacpp", "weights": "gguf"},
                             progress=False)
        result = tracer.compare(ours, engine.record(tokens))
        compared = [p for p in result.points if p.recorded]
        assert result.verdict == "match" and len(compared) == 33
        assert all(p.rel_l2 == 0 for p in compared), (len(tokens), [(p.point, p.rel_l2) for p in compared if p.rel_l2])
