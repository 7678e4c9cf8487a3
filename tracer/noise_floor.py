"""The noise floor: how much a point's value moves from f32 rounding alone.

The reference model is run once more by the reimplementation in f64 (same math, same knobs);
the relative L2 distance between the reference trace and that run is, per point, the error
that a faithful f32 implementation makes anyway. On SmolLM2 it ranges from 2e-8 (layer-0 norm)
to 5e-6 (layer-10 MLP) and bounds the eager-vs-sdpa difference at every point.
"""

from __future__ import annotations

from tracer.diff import compare_points, Tolerance
from tracer.engines.load import load_engine
from tracer.trace import Trace

NOISE_TOKENS = 128  # longer prompts measure their noise floor on this many first tokens


def estimate_noise(source, reference: Trace, reference_variant: dict, recorder=None, device="cpu") -> dict[str, float]:
    """Per point, rel_l2 between `reference` and an f64 run of the same model and variant.

    `recorder` (default: in memory) receives the f64 run's points, e.g. a `DiskRecorder` for long prompts.
    The f64 weights are streamed block by block: a whole f64 copy would be the largest thing in
    memory (twice the f32 model), for one forward. A number-format regime (weights=, act_quant=,
    preset=llamacpp, ...) gets its own estimate instead: `tracer.ggml.summation_noise.regime_noise`.
    """
    from tracer.ggml.strategies import is_regime
    from tracer.variants import expand_presets

    if is_regime(expand_presets(reference_variant)):
        from tracer.ggml.summation_noise import regime_noise

        return regime_noise(source, reference, reference_variant, recorder, device)
    engine = load_engine("reimpl", source, {**reference_variant, "dtype": "f64"}, device=device, stream=True)
    exact = engine.record(reference.tokens, recorder)
    return {p.point: p.rel_l2 for p in compare_points(reference, exact, Tolerance()) if p.recorded}
