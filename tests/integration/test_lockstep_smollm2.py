"""SmolLM2 `--stream`: the lockstep pass (tracer/pipeline/lockstep.py) gives the Result the sides give
one after the other, all 513 points (two streamed runs of the bundled model)."""

from tests.unit.test_lockstep import results, same

PROMPT = "The capital of France is"


def test_smollm2_streamed_in_lockstep_is_the_same_result(default_model, monkeypatch):
    apart, together = results(default_model, monkeypatch, tokens=None, prompt=PROMPT, variant="theta=10000")
    same(apart, together)
    assert together.first_divergence.point == "model.layers.0.self_attn.q_rope"
    assert len(together.points) == len(apart.points) > 500
