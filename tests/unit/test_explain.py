"""Breakdowns and hints of a divergence, on literal tensors and tiny models."""

import torch

import tracer
from tests.conftest import TOKENS
from tracer.comparison.explain import by_head, by_position, hints, top_channels
from tracer.files.sources import ModelSource


def test_by_position_reads_the_query_axis_of_each_layout():
    ref = torch.zeros(3, 4)  # (T, X)
    cand = ref.clone()
    cand[2, 1] = 0.5
    assert by_position("model.layers.0.mlp.act", ref, cand) == [0.0, 0.0, 0.5]
    heads = torch.zeros(2, 3, 4)  # (H, T, D)
    moved = heads.clone()
    moved[1, 1, 3] = 2.0
    assert by_position("model.layers.0.self_attn.q_rope", heads, moved) == [0.0, 2.0, 0.0]
    assert by_head("model.layers.0.self_attn.q_rope", heads, moved) == [0.0, 2.0]


def test_masked_scores_do_not_count_in_breakdowns():
    ref = torch.zeros(1, 3, 3)
    cand = ref.clone()
    cand[0, 0, 2] = 100.0  # query 0 never sees key 2
    assert by_position("model.layers.0.self_attn.scores", ref, cand) == [0.0, 0.0, 0.0]


def test_by_head_splits_merged_heads_when_their_count_is_known():
    ref = torch.zeros(2, 6)  # (T, H*D) with H=3, D=2
    cand = ref.clone()
    cand[0, 4] = 1.0  # head 2
    assert by_head("model.layers.0.self_attn.context", ref, cand, num_heads=3) == [0.0, 0.0, 1.0]
    assert by_head("model.layers.0.mlp.act", ref, cand, num_heads=3) is None


def test_top_channels_names_the_worst_channels_first():
    ref = torch.zeros(2, 8)
    cand = ref.clone()
    cand[1, 5], cand[0, 2] = 3.0, 1.0
    assert top_channels("model.layers.3", ref, cand, k=2) == [{"channel": 5, "max_abs": 3.0},
                                                              {"channel": 2, "max_abs": 1.0}]


def test_hints_read_signatures():
    rope_like = {"by_position": [0.0, 0.1, 0.4, 0.9], "by_head": [0.2, 0.3]}
    assert "positional encoding" in hints("model.layers.0.self_attn.q_rope", rope_like)[0]
    gqa_like = {"by_position": [0.3, 0.2, 0.5], "by_head": [0.0, 0.0, 0.4, 0.6]}
    assert any("heads [0, 1] are exact" in h and "GQA" in h for h in hints("model.layers.0.self_attn.scores", gqa_like))
    mask_like = {"by_position": [0.5, 0.3, 0.0], "by_head": None}
    assert "causal mask" in hints("model.layers.0.self_attn.probs", mask_like)[0]
    assert any("rms_norm_eps" in h for h in hints("model.layers.0.input_layernorm", {"by_position": [1, 1, 1]}))
    assert any("dtype" in h for h in hints("model.embed_tokens", {"by_position": [1, 1]}))


def test_theta_on_a_tiny_model_explains_itself(tiny_llama):
    model = tiny_llama()
    result = tracer.compare(tracer.record(model, TOKENS, engine="hf"),
                            tracer.record(model, TOKENS, engine="reimpl", variant="theta=500"))
    first = result.first_divergence
    assert first.by_position[0] == 0 and min(first.by_position[1:]) > 0
    assert len(first.by_head) == 4 and first.top_channels is None
    assert any("positional encoding" in h for h in first.hints)


def test_noise_floor_judges_points_on_their_own_rounding(tiny_llama):
    from tracer.pipeline.noise_floor import estimate_noise

    model = tiny_llama()
    reference = tracer.record(model, TOKENS, engine="hf")
    noise = estimate_noise(ModelSource(model), reference, {})
    assert noise["model.embed_tokens"] == 0.0  # an f32 lookup is exact in f64
    assert all(0 <= v < 1e-5 for v in noise.values()) and max(noise.values()) > 0
    sdpa = tracer.record(model, TOKENS, engine="hf", variant="attn=sdpa")
    judged = tracer.compare(reference, sdpa, noise=noise)
    assert judged.verdict == "match"
    point = judged.points[-1]
    assert point.noise == noise["lm_head"] and point.threshold == max(1e-6, 10 * noise["lm_head"])
    theta = tracer.compare(reference, tracer.record(model, TOKENS, engine="reimpl", variant="theta=9000"), noise=noise)
    assert theta.first_divergence.point == "model.layers.0.self_attn.q_rope"


def test_next_token_accuracy_counts_argmax_hits_on_the_text():
    from tracer import Trace, TraceMeta

    logits = torch.full((3, 5), -1.0)
    logits[0, 7 % 5] = logits[1, 4] = 1.0  # predicts token 2 after position 0, token 4 after position 1
    meta = TraceMeta(engine="x", variant={}, tokens=[0, 2, 3])
    summary = tracer.compare(Trace({"lm_head": logits}, meta), Trace({"lm_head": logits}, meta)).logits
    assert summary.next_token_accuracy == {"reference": 0.5, "candidate": 0.5}


def test_a_dump_without_the_rope_points_says_it_cannot_tell_where_the_error_starts(llama_dir):
    """A wrong RoPE base in a dump that lacks q_rope through context (a forward-hook dump has none of
    them): the first recorded divergence is o_proj, but nothing shows the error was made there."""
    from reports.summary import divergence_facts

    reference = tracer.record(llama_dir, TOKENS, engine="hf", progress=False)
    candidate = tracer.record(llama_dir, TOKENS, engine="reimpl", variant="theta=500", progress=False)
    gap = ("q_rope", "k_rope", "scores", "probs", "context")
    dump = {name: t for name, t in candidate.tensors.items() if not name.endswith(gap)} | \
        {"tokens": torch.tensor(TOKENS)}
    first = tracer.compare_files(reference, dump).first_divergence
    assert first.point == "model.layers.0.self_attn.o_proj" and first.upstream_max_rel_l2 == 0
    assert first.unseen == tuple(f"model.layers.0.self_attn.{name}" for name in gap)
    assert not any("weights" in hint for hint in first.hints), first.hints
    named = ", ".join(f"self_attn.{name}" for name in gap)
    assert any(hint.startswith(f"the 5 points before it ({named}) are not recorded") for hint in first.hints)
    inherits = dict(divergence_facts({"first_divergence": first.to_dict()}))["error it inherits"]
    assert inherits.startswith("unknown") and "model.layers.0.self_attn.q_rope" in inherits

    whole = tracer.compare_files(reference, candidate).first_divergence  # with them: made at q_rope
    assert whole.point == "model.layers.0.self_attn.q_rope" and whole.unseen == ()
