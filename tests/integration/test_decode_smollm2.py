"""`--decode` on the bundled SmolLM2: hf and reimpl, each with its own KV cache, match at every point of
every decode step; positions restarting at 0 after the prompt are found at decode step 1, layer 0's RoPE, made by
the step (rerun on the reference's cache) and named by the position its token was given.
(4 steps keep it cheap; `tracer run --decode 16` is measured in docs/decode.md.)"""

import tracer
from tracer.model.points import Q_ROPE, layer_point


def test_cached_steps_match_and_a_restarted_position_is_found_at_step_one(default_model):
    result = tracer.run(default_model, decode=4, greedy=0, progress=False)
    assert result.verdict == "match" and len(result.steps) == 5
    assert all(step.verdict == "match" for step in result.steps)
    assert [step.position for step in result.steps[1:]] == list(range(5, 9))  # after the 5-token prompt
    restarted = tracer.run(default_model, decode=1, greedy=0, variant="decode_positions=restart", noise_floor=False,
                           progress=False)
    assert restarted.step == 1 and restarted.steps[0].verdict == "match"
    assert restarted.first_divergence.point == layer_point(0, Q_ROPE)
    first = restarted.first_divergence
    assert first.localized_by == "local" and restarted.steps[1].local is True  # made by the step, not inherited
    assert first.hints[0].startswith("decode step 1's token (position 5) was given position 0: its layer-0 q_rope is "
                                     "the reference's for the same token at position 0")
    assert first.hints[0].endswith("positions restart at 0 after the prompt (the step's count, not its position)")
