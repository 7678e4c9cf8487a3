"""The candle engine on the bundled SmolLM2 (the notes' model): candle-nn 0.4.2's kernels running
candle-transformers 0.11's llama.rs on the f32 directory and quantized_llama.rs on the Q4_1 GGUF,
against transformers, and candle's quantized arithmetic emulated (preset=candle-q) bit for bit.

Measured here (5 tokens, "The capital of France is"): llama.rs matches transformers at all 513
points (worst 4.9e-6 rel, logits 4.1e-5 at the last position); theta 10000 from candle's reader
diverges first at layer-0 q_rope (rel 8.1e-2); rope_i on HF rows there too (max|diff| 4.4);
quantized_llama.rs: input_layernorm 1.2e-7, layer-0 q_proj 2.7e-3 (the Q8_1 activations), logits
5.1e-2 rel; preset=candle-q,weights=gguf equals candle at every point exactly.
"""

from __future__ import annotations

import json

import pytest

import tracer
from tracer.engines import candle as candle_engine
from tracer.files.sources import ModelSource
from tracer.model.points import layer_point

from .test_ggml_smollm2 import PROMPT_IDS, _corrupt

CANDLE_Q = {"preset": "candle-q", "weights": "gguf"}


def candle(model, variant=None, gguf=None):
    """A candle trace from the engine built in this process (the registered child-process path is
    the regime test's, below): the child's start costs more than the forward."""
    return candle_engine.load(ModelSource(model), variant or {}, argument=gguf and str(gguf)).record(PROMPT_IDS)


@pytest.fixture(scope="module")
def reference(default_model):
    pytest.importorskip("candle")
    return tracer.record(default_model, PROMPT_IDS, engine="hf", progress=False)


@pytest.fixture(scope="module")
def gguf():
    from tracer.files.sources import bundled_gguf

    return bundled_gguf()


@pytest.fixture(scope="module")
def candle_q(default_model, reference):
    """tracer's model in candle's arithmetic on the file's own tensors: the regime reference."""
    return tracer.record(default_model, PROMPT_IDS, engine="reimpl", variant=CANDLE_Q, progress=False)


def test_llama_rs_matches_transformers_at_all_513_points(default_model, reference):
    result = tracer.compare(reference, candle(default_model))
    assert result.verdict == "match" and len([p for p in result.points if p.recorded]) == 513
    assert max(p.rel_l2 for p in result.points) < 2e-5  # measured 4.9e-6


def test_a_transformers_5_save_makes_candles_reader_take_theta_10000(default_model, reference, tmp_path):
    """The notes' bug in real candle: config.json as transformers 5 saves it (theta only under
    rope_parameters); the saved candle trace compares as the live run."""
    from transformers import AutoConfig

    saved = tmp_path / "tf5"
    AutoConfig.from_pretrained(default_model).save_pretrained(saved)
    assert "rope_theta" not in json.loads((saved / "config.json").read_text())
    for file in default_model.iterdir():
        if file.name != "config.json":
            (saved / file.name).symlink_to(file)
    live = candle(saved)
    assert tracer.compare(reference, live).first_divergence.point == layer_point(0, "self_attn.q_rope")
    assert any("took rope_theta = 10000" in note for note in live.meta.notes)
    file = tracer.compare_files(reference.save(tmp_path / "hf.safetensors"), live.save(tmp_path / "candle.safetensors"))
    assert file.first_divergence.point == layer_point(0, "self_attn.q_rope")
    fixed = candle(saved, {"config": "hf"})
    assert tracer.compare(reference, fixed).verdict == "match"


def test_rope_i_on_hf_rows_diverges_at_the_first_rope(default_model, reference):
    candidate = candle(default_model, {"rope": "interleaved"})
    first = tracer.compare(reference, candidate).first_divergence
    assert first.point == layer_point(0, "self_attn.q_rope") and first.max_abs > 1  # measured 4.4


def test_quantized_llama_rs_is_candles_regime_to_the_bit_and_f32_up_to_the_first_projection(
        default_model, reference, candle_q, gguf):
    candidate = candle(default_model, gguf=gguf)
    raw = tracer.compare(reference, candidate)
    by_point = {p.point: p.rel_l2 for p in raw.points}
    assert by_point[layer_point(0, "input_layernorm")] < 1e-6  # measured 1.2e-7
    assert raw.first_divergence.point in {layer_point(0, f"self_attn.{x}_proj") for x in "qkv"}
    exact = tracer.compare(candle_q, candidate)
    assert exact.verdict == "match" and {p.rel_l2 for p in exact.points if p.recorded} == {0.0}


def test_regime_auto_picks_candles_arithmetic_and_reads_candle_as_correct(default_model, gguf):
    result = tracer.run(default_model, tokens=PROMPT_IDS, candidate=f"candle:{gguf}", regime="auto", greedy=0,
                        noise_floor=False, progress=False)  # exactly 0 needs no noise floor
    assert result.regime.variant == CANDLE_Q and result.regime.caveats == ()
    assert result.verdict == "match" and all(p.rel_l2 == 0 for p in result.points if p.recorded)
    assert result.regime.raw.first_divergence.layer == 0


def test_a_corrupted_tensor_stands_alone_in_candles_regime(default_model, candle_q, tmp_path):
    corrupted = tmp_path / "corrupted.gguf"
    from tracer.files.sources import bundled_gguf

    _corrupt(bundled_gguf(), corrupted)
    candidate = candle(default_model, gguf=corrupted)
    first = tracer.compare(candle_q, candidate).first_divergence
    assert first.point == "model.layers.7.mlp.down_proj" and first.upstream_max_rel_l2 == 0.0
