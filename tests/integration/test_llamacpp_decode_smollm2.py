"""llama.cpp's cached decode on the bundled SmolLM2 GGUF (Q4_1) in its bit-exact regime: tracer's model in
the regime `--regime auto` resolves, decoding with a cache stored as llama.cpp stores it (f16), and
llama.cpp decoding with its own KV cache (in its child process) agree exactly at every point of every
step, the 60 cache points included. (The two engines directly, 3 steps: the pipeline around them is
tested on a tiny model in tests/unit/test_llamacpp_decode.py; `tracer run --candidate llamacpp --regime
auto --decode 16` is measured in docs/decode.md.)"""

import pytest
import torch

from tests.cpu_builds import skip_unless_exact_here
from tracer.engines.load import resolve_and_load
from tracer.engines.registry import EngineRef
from tracer.files.sources import ModelSource
from tracer.pipeline.regime_view import resolve

PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
STEPS = 3


def test_llamacpps_cached_decode_is_exactly_its_regimes(default_model):
    pytest.importorskip("llama_cpp")
    source, llamacpp = ModelSource(default_model), EngineRef.named("llamacpp")
    knobs, caveats, _ = resolve("auto", llamacpp, {}, source)
    skip_unless_exact_here(caveats)  # this CPU's paths are emulated: the free-running comparison is a verdict
    regime = resolve_and_load(EngineRef.named("reimpl"), source, knobs).decode(PROMPT, STEPS)
    decoded = resolve_and_load(llamacpp, source, {}).decode(PROMPT, STEPS, forced=[s.tokens[0] for s in regime.steps])
    assert [step.meta.position_offset for step in decoded.steps] == [5, 6, 7]
    for ours, theirs in zip([regime, *regime.steps], [decoded, *decoded.steps]):
        assert len(theirs.tensors) == 453 + 60  # every point recorded, 30 layers' cache_k and cache_v among them
        for point, value in theirs.tensors.items():
            assert torch.equal(ours[point].double(), value.double()), point
