"""`--batch 4` on the bundled SmolLM2: rows of different lengths left-padded with an attention mask, hf and
reimpl each one batched forward, every row matches the reference's batch-1 run of its prompt within the
floor; the dropped padding mask is found on the padded row at layer 0's probabilities, with its hint.
(Two prompts, each twice, keep the f64 noise runs to two; four distinct prompts are measured in docs/batch.md.)"""

import tracer
from tracer.model.points import PROBS, layer_point

PROMPTS = ["The capital of France is", "Hello"]  # 5 and 1 tokens: the second row padded by 4


def test_a_padded_batch_matches_and_a_dropped_padding_mask_is_found(default_model):
    result = tracer.run(default_model, PROMPTS * 2, batch=4, progress=False)
    assert result.verdict == "match" and result.row is None
    assert [(row.padding, row.verdict) for row in result.batch] == [(0, "match"), (4, "match")] * 2
    assert all(row.points > 500 for row in result.batch)
    assert 0.0 < result.batch[1].batch_floor < 1e-4  # the batch shape moves f32 rounding, a little
    dropped = tracer.run(default_model, PROMPTS, batch=2, variant="padding_mask=drop", noise_floor=False,
                         progress=False)
    assert dropped.row == 1 and [row.verdict for row in dropped.batch] == ["match", "diverged"]
    assert dropped.first_divergence.point == layer_point(0, PROBS)
    assert "attend to its padding" in dropped.first_divergence.hints[0]
