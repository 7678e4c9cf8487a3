"""reimpl == hf at every point on tiny random Llamas, and the knobs move exactly what they should."""

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tracer.model.points import all_points

SHAPES = {
    "gqa-tied": dict(),
    "mha-untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "bias-v5-config": dict(attention_bias=True, mlp_bias=True, rope_format="v5"),
    "head-dim-32": dict(head_dim=32, num_attention_heads=4, num_key_value_heads=1),
    "llama3-scaling": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 4},
                           rope_format="v5"),
}


@pytest.mark.parametrize("name", SHAPES)
def test_reimpl_matches_hf_at_every_point(tiny_llama, name):
    model = tiny_llama(name, **SHAPES[name])
    reference = tracer.record(model, TOKENS, engine="hf")
    candidate = tracer.record(model, TOKENS, engine="reimpl")
    result = tracer.compare(reference, candidate)

    assert result.verdict == "match", result.first_divergence
    assert reference.points == candidate.points == all_points(2)
    assert all(p.recorded for p in result.points)
    worst = max(p.rel_l2 for p in result.points)
    assert worst <= 1e-6, f"reimpl differs from hf by rel_l2 {worst:.2e}"
    assert result.logits.max_abs_all <= 1e-5


def test_recorded_shapes_follow_the_vocabulary(tiny_llama):
    trace = tracer.record(tiny_llama(), TOKENS, engine="reimpl")
    t, hidden, heads, kv, d = len(TOKENS), 64, 4, 2, 16
    assert trace["model.embed_tokens"].shape == (t, hidden)
    assert trace["model.layers.0.self_attn.q_proj"].shape == (t, heads * d)
    assert trace["model.layers.0.self_attn.k_proj"].shape == (t, kv * d)
    assert trace["model.layers.0.self_attn.q_rope"].shape == (heads, t, d)
    assert trace["model.layers.0.self_attn.k_rope"].shape == (kv, t, d)
    assert trace["model.layers.1.self_attn.scores"].shape == (heads, t, t)
    assert trace["model.layers.1.self_attn.context"].shape == (t, heads * d)
    assert trace["model.layers.1.mlp.act"].shape == (t, 96)
    assert trace["lm_head"].shape == (t, 97)
    probs = trace["model.layers.0.self_attn.probs"]
    torch.testing.assert_close(probs.sum(-1), torch.ones(heads, t))
    assert probs.triu(1).abs().max() == 0  # causal


@pytest.mark.parametrize("engine", ["hf", "reimpl"])
def test_theta_diverges_first_at_rope(tiny_llama, engine):
    model = tiny_llama()
    reference = tracer.record(model, TOKENS, engine="hf")
    candidate = tracer.record(model, TOKENS, engine=engine, variant="theta=500")
    result = tracer.compare(reference, candidate)

    assert result.verdict == "diverged"
    assert result.first_divergence.point == "model.layers.0.self_attn.q_rope"
    assert result.first_divergence.last_agreeing == "model.layers.0.self_attn.v_proj"
    assert result.first_divergence.upstream_max_rel_l2 <= 1e-6
    q_rope_diff = (candidate["model.layers.0.self_attn.q_rope"] - reference["model.layers.0.self_attn.q_rope"]).abs()
    assert q_rope_diff[:, 0].max() == 0  # position 0 is not rotated, whatever theta is
    assert q_rope_diff[:, 1:].max() > 1e-3


def test_sdpa_records_what_it_can_and_says_what_it_cannot(tiny_llama):
    model = tiny_llama()
    reference = tracer.record(model, TOKENS, engine="hf")
    candidate = tracer.record(model, TOKENS, engine="hf", variant="attn=sdpa")
    result = tracer.compare(reference, candidate)

    assert result.verdict == "match"
    missing = [p.point for p in result.points if not p.recorded]
    assert missing == [f"model.layers.{i}.self_attn.{s}" for i in range(2) for s in ("scores", "probs")]
    assert all(p.missing_on == "candidate" and "sdpa" in p.reason for p in result.not_recorded)
    assert result.points[-1].point == "lm_head" and result.points[-1].rel_l2 < 1e-5


def test_reimpl_sdpa_agrees_with_hf_sdpa(tiny_llama):
    model = tiny_llama()
    reference = tracer.record(model, TOKENS, engine="hf", variant="attn=sdpa")
    candidate = tracer.record(model, TOKENS, engine="reimpl", variant="attn=sdpa")
    assert tracer.compare(reference, candidate).verdict == "match"


def test_record_accepts_a_loaded_transformers_model(tiny_llama):
    from transformers import LlamaForCausalLM

    model_dir = tiny_llama()
    loaded = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    from_object = tracer.record(loaded, TOKENS, engine="hf")
    from_path = tracer.record(model_dir, TOKENS, engine="hf")
    reimpl_from_object = tracer.record(loaded, TOKENS, engine="reimpl")
    assert tracer.compare(from_path, from_object).points[-1].max_abs == 0
    assert tracer.compare(from_path, reimpl_from_object).verdict == "match"
