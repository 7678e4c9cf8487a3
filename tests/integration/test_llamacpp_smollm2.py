"""llama.cpp on the bundled SmolLM2 GGUF (Q4_1) against transformers on its f32 conversion.

llama.cpp quantizes activations to 8 bits inside Q4_1 matmuls, by design: the first difference is
at the layer-0 projections (q_proj rel_l2 2.7e-3, v_proj 1.3e-2 measured here), the norm before
them agrees at rounding level (6.6e-8), and the last position's argmax survives (logits max|diff|
0.75 of 19.8).
"""

from __future__ import annotations

import pytest

import tracer

PROJECTIONS = {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"}


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


def test_llamacpp_against_transformers(default_model, llama_cpp, tmp_path):
    result = tracer.run(default_model, candidate="llamacpp", out=tmp_path / "report", progress=False)
    points = {p.point: p for p in result.points}
    assert points["model.layers.0.input_layernorm"].rel_l2 < 1e-6
    assert result.first_divergence.point in PROJECTIONS
    assert 1e-3 < points["model.layers.0.self_attn.v_proj"].rel_l2 < 5e-2  # 8-bit activations, not a bug
    assert result.logits.argmax_agree == 1.0 and result.logits.max_abs < 2  # measured: 1.0 and 0.75
    summary = result.to_dict()
    assert summary["candidate"]["runtime"]["name"] == "llama.cpp"
    assert "llama-cpp-python" in summary["candidate"]["runtime"]["package"]
    greedy = summary["greedy"]
    assert len(greedy["candidate"]) == len(greedy["reference"]) == 20
    assert greedy["candidate"][0] == greedy["reference"][0]  # " Paris" on both sides (argmax at the last position)
    assert (tmp_path / "report" / "summary.json").is_file()


def test_theta_on_llamacpp_localizes_at_layer_0_rope_with_everything_upstream_bitwise_equal(default_model, llama_cpp):
    result = tracer.run(default_model, reference="llamacpp", candidate="llamacpp", variant="theta=10000",
                        greedy=0, progress=False)
    first = result.first_divergence.point
    assert first in ("model.layers.0.self_attn.q_rope", "model.layers.0.self_attn.k_rope")
    upstream = [p for p in result.points if p.recorded][:[p.point for p in result.points if p.recorded].index(first)]
    assert {p.point for p in upstream} == {"model.embed_tokens", "model.layers.0.input_layernorm", *PROJECTIONS}
    assert all(p.rel_l2 == 0 and p.max_abs == 0 for p in upstream)
