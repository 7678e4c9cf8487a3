"""The llamacpp regime on SmolLM2 files llama.cpp's own quantizer makes (`quantize_gguf`, from the
bundled Q4_1 GGUF): Q4_0, whose projections llama.cpp repacks at load (q4_0_8x8), and F16 (tinyBLAS
on f16 weights, the tied f16 output included), against llama.cpp itself. One file per test.

Measured here: every one of llama.cpp's 453 recorded points exactly equal, at 5 and at 512 tokens
(docs/regimes.md); the regime they imply has no caveat, so `--regime auto` judges free-running.
"""

from __future__ import annotations

import pytest

import tracer
from tests.cpu_builds import skip_unless_exact_here
from tests.ggml_gguf import sourced_copy
from tests.quantized_gguf import quantize_gguf
from tracer.files.sources import ModelSource, bundled_gguf
from tracer.ggml.strategies import GGUFWeights, implied_regime

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"
LLAMACPP = {"preset": "llamacpp", "weights": "gguf"}


@pytest.mark.parametrize("ftype, projection", [("Q4_0", "q4_0"), ("F16", "f16")])
def test_a_file_llama_cpps_quantizer_made_is_llama_cpp_to_the_bit(default_model, tmp_path, ftype, projection):
    pytest.importorskip("llama_cpp")
    from tracer.engines import llamacpp

    gguf = quantize_gguf(bundled_gguf(), tmp_path / f"smollm2-{ftype}.gguf", ftype)
    types = GGUFWeights(gguf).types()
    assert types["model.layers.0.self_attn.q_proj.weight"] == projection
    variant, caveats = implied_regime(types, {})
    assert variant == LLAMACPP
    skip_unless_exact_here(caveats)
    converted = sourced_copy(default_model, gguf, tmp_path / "converted", link=True)
    ours = tracer.record(converted, PROMPT_IDS, engine="reimpl", variant=LLAMACPP, progress=False)
    theirs = llamacpp.load(ModelSource(converted), {}, argument=str(gguf)).record(PROMPT_IDS)
    result = tracer.compare(ours, theirs)
    compared = [p for p in result.points if p.recorded]
    assert result.verdict == "match" and len(compared) == 453
    assert [p.point for p in compared if p.rel_l2 != 0] == []
