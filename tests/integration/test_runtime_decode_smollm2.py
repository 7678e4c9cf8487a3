"""`--decode` on the bundled SmolLM2 with the live runtimes' own caches: mlx (mlx-lm's KVCache) and candle
(candle-transformers' Cache, in its child process) match transformers' cached decode within each step's
floor at every point of every step, the cache points included. (4 steps keep it cheap; `tracer run
--decode 16` is measured in docs/decode.md.)"""

import pytest

import tracer
from tracer.engines.registry import ENGINES


@pytest.mark.parametrize("engine", ["mlx", "candle"])
def test_a_runtime_decodes_with_its_cache_within_the_floor(default_model, engine):
    if ENGINES[engine].missing_runtime():
        pytest.skip(f"{engine}'s runtime is not installed")
    result = tracer.run(default_model, candidate=engine, decode=4, greedy=0, progress=False)
    assert result.verdict == "match" and result.step is None and len(result.steps) == 5
    assert [step.position for step in result.steps[1:]] == list(range(5, 9))  # after the 5-token prompt
    # every point the engine records and, at every step, the 30 layers' cache_k and cache_v
    recorded = {"mlx": 453, "candle": 513}[engine] + 60
    assert all(step.verdict == "match" and step.points == recorded for step in result.steps)
    assert all(step.candidate_pick == step.reference_pick for step in result.steps)
