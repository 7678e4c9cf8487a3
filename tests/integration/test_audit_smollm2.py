"""The bundled SmolLM2 quantized by llama.cpp's own quantizer as a user does (Q4_K_M requantized
from its Q4_1 GGUF: Q5_0/Q8_0 fallbacks where a row of 576 is not a multiple of 256, Q4_K/Q6_K
for ffn_down), traced with `--regime auto` on the f32 directory converted from the Q4_1 file:
not the file's own source, so the regime takes the candidate file's tensors in their own types.

Measured here: the audit finds all 272 tensors identical to llama.cpp's requantization of the
directory's weights (2.6 s); with one block of blk.5.attn_k (Q5_0) changed, that tensor alone is
damaged (one block of 3456 at 9.5x the error Q5_0 gives there), and the regime's first divergence
is model.layers.5.self_attn.k_proj (rel_l2 4.0e-3, 1950x its floor), every earlier point exactly 0
(llama.cpp's Q4_K/Q6_K kernels are emulated: the regime runs free).
"""

from __future__ import annotations

import pytest

import tracer
from tests.audited_gguf import damage_block
from tests.cpu_builds import skip_unless_exact_here
from tests.quantized_gguf import quantize_gguf
from tracer.engines.registry import parse_engine
from tracer.files.sources import ModelSource, bundled_gguf
from tracer.files.weights import WeightFiles
from tracer.ggml.audit import audit_gguf
from tracer.pipeline.regime_view import resolve as resolve_regime


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    return quantize_gguf(bundled_gguf(), tmp_path_factory.mktemp("audit") / "smollm2-Q4_K_M.gguf", "Q4_K_M")


def test_a_q4_k_m_made_from_the_bundled_gguf_is_identical_to_its_requantization(default_model, q4_k_m):
    audit = audit_gguf(q4_k_m, WeightFiles(default_model))
    assert audit.verdict == "identical" and audit.count("identical") == 272
    kinds = {t.kind for t in audit.tensors}
    assert {"q5_0", "q8_0", "q4_k", "q6_k", "f32"} == kinds  # every type of the mix, none of them the directory's


def test_one_damaged_block_of_blk_5_attn_k_shows_at_layer_5_k_proj(default_model, q4_k_m, tmp_path):
    damaged = damage_block(q4_k_m, tmp_path / "damaged.gguf", "blk.5.attn_k.weight", 1234, quants=2)
    result = tracer.run(default_model, candidate=f"llamacpp:{damaged}", regime="auto", greedy=0, progress=False)
    regime = result.regime
    assert regime.audit.damaged == ("blk.5.attn_k.weight",)
    assert result.verdict == "diverged"
    first = result.first_divergence
    assert first.point == "model.layers.5.self_attn.k_proj"
    upstream = [p for p in result.points[:first.index] if p.recorded]
    assert upstream and all(p.rel_l2 <= p.threshold for p in upstream)
    # the raw view, against f32, has it at the first projection of layer 0: the file's formats
    assert regime.raw.first_divergence.point.startswith("model.layers.0.self_attn.")
    skip_unless_exact_here(regime.caveats)  # last: the rest holds on any CPU
    assert all(p.rel_l2 == 0 for p in upstream)


def test_regime_auto_on_an_f16_file_takes_its_f16_tensors(default_model, tmp_path):
    """What `--regime auto` once answered with "bad value 'f16' for knob 'weights'"."""
    pytest.importorskip("llama_cpp")
    f16 = quantize_gguf(bundled_gguf(), tmp_path / "smollm2-F16.gguf", "F16")
    knobs, caveats, audit = resolve_regime("auto", parse_engine(f"llamacpp:{f16}"), {}, ModelSource(default_model))
    assert knobs == {"preset": "llamacpp", "weights": "gguf", "gguf_file": str(f16.resolve())}
    assert audit.verdict == "identical"
