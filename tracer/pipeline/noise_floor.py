"""The noise floor: how much a point's value moves from rounding alone, outside a regime and in one.

Outside a regime (`estimate_noise`): the reference model is run once more by the reimplementation
in f64 (same math, same knobs); the relative L2 distance between the reference trace and that run
is, per point, the error that a faithful f32 implementation makes anyway.

In a number-format regime (`regime_noise`) that estimate is wrong twice over: an f64 run drops the
formats the regime is about (8-bit activations, an f16 KV cache), and the regime's errors are not
continuous (an activation that moves by 1e-7 can flip an 8-bit rounding, which moves the next
matmul by a whole quantization step), so a free-running spread measures chaos, not arithmetic.
The estimate keeps the formats and changes only what an equally valid implementation of the regime
may change, the order of its sums: the regime with `accumulate=f64` (every quantized matmul, RoPE,
SwiGLU and q·k sum exact and rounded once; ggml's online softmax and f16 flash-attention
accumulator kept) is run with every op fed the reference's values of its inputs
(`tracer.reimpl.forced_runs.op_forced_points`), and a point's noise is its rel_l2 to the reference there:
the error a different summation order makes in that op alone. Forcing per op, not per block, keeps
one op's flips from spreading to the next ops of its block. Points both variants compute alike
(embedding, norms, residual adds) get 0 and fall back to the criterion's absolute floor.

Measured figures (SmolLM2, preset=llamacpp): docs/regimes.md, "The noise floor in a regime".
"""

from __future__ import annotations

import torch

from tracer.comparison.diff import ErrorRecorder
from tracer.engines.base import at_positions
from tracer.engines.load import LoadTarget, load_engine
from tracer.engines.registry import EngineRef
from tracer.files.sources import ModelSource
from tracer.model.knobs import expand_presets, is_regime
from tracer.traces.trace import Trace

NOISE_TOKENS = 128  # longer prompts measure their noise floor on this many first tokens


def estimate_noise(source: ModelSource, reference: Trace, reference_variant: dict, device="cpu") -> dict[str, float]:
    """Per point, rel_l2 between `reference` and an f64 run of the same model and variant.

    The f64 run's points are compared as they come and never kept (`tracer.comparison.diff.ErrorRecorder`).
    The f64 weights are streamed block by block: a whole f64 copy would be the largest thing in
    memory (twice the f32 model), for one forward. A number-format regime (weights=, act_quant=,
    preset=llamacpp, ...) gets its own estimate instead: `regime_noise`.
    """
    if is_regime(expand_presets(reference_variant)):
        return regime_noise(source, reference, reference_variant, device)
    engine = load_engine(EngineRef.named("reimpl"), {**reference_variant, "dtype": "f64"},
                         LoadTarget(source, torch.device(device), stream=True))
    errors = ErrorRecorder(reference)
    engine.record(reference.tokens, errors, **at_positions(reference.meta.position_offset or 0, len(reference.tokens)))
    return errors.rel_l2


def regime_noise(source: ModelSource, reference: Trace, variant: dict, device="cpu") -> dict[str, float]:
    """Per point, rel_l2 between `reference` and the regime `variant` with `accumulate=f64`, every
    op of it fed `reference`'s values of its inputs.

    Args:
        source: the model the reference ran, resolved (`tracer.files.sources.resolve_source`).
        reference: the regime's trace (usually the reimpl engine's run of `variant`).
        variant: the regime's knobs, e.g. {"preset": "llamacpp", "weights": "gguf"}.

    Returns:
        point -> rel_l2, for every point both traces hold.

    Example:
        >>> from tracer.files.sources import ModelSource
        >>> model, regime = tracer.default_model_path(), {"preset": "llamacpp", "weights": "gguf"}
        >>> ref = tracer.record(model, [504, 3575, 282, 4649, 314], engine="reimpl", variant=regime, progress=False)
        >>> regime_noise(ModelSource(model), ref, regime)["model.layers.0.mlp.down_proj"] < 1e-5  # 1e-7..6e-7
        True
    """
    engine = load_engine(EngineRef.named("reimpl"), {**variant, "accumulate": "f64"},
                         LoadTarget(source, torch.device(device)))
    errors = ErrorRecorder(reference)
    engine.op_trace(reference, errors)
    return errors.rel_l2
