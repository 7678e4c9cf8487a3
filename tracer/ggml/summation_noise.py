"""The noise floor of an emulated number-format regime.

Outside a regime, a point's noise is what f32 rounding alone makes there: the reference against
an f64 run of the same model (`tracer.noise_floor`). Inside a regime that estimate is wrong twice
over: an f64 run drops the formats the regime is about (8-bit activations, an f16 KV cache), and
the regime's own errors are not continuous: an activation that moves by 1e-7 can flip an 8-bit
rounding, which moves the next matmul by a whole quantization step (~1e-3 relative), and a free
run of two equally valid implementations (x86 and ARM order, say) parts by ~1e-2 within one or
two layers. So free-running spread measures chaos, not the arithmetic.

The estimate here keeps the formats and changes only what an equally valid implementation of the
same regime may change, the order of its sums: the regime with `accumulate=f64` (every quantized
matmul, RoPE, SwiGLU and q·k sum exact and rounded once; ggml's online softmax and f16
flash-attention accumulator kept, as every implementation of its kernel keeps them) is run with
every op fed the reference's values of its inputs (`tracer.localize.op_forced_points`), and a
point's noise is its rel_l2 to the reference there: the error a different summation order makes
in that op alone. Forcing per block instead would let a 1e-7 difference in one op flip 8-bit
roundings in the next ones of the same block (measured: up to 9e-3 at MLP points, which would
hide a corrupted tensor); forcing per op leaves only the op's own flips. Points both variants
compute alike (embedding, norms, residual adds) get 0 and fall back to the criterion's absolute
floor (1e-6).

On the bundled SmolLM2 with preset=llamacpp,weights=gguf (5 tokens) this puts the noise of the
quantized projections at 1e-7..1e-6, RoPE at 4e-8 and the attention context at up to 3e-5 (the
f16 accumulator's roundings).
"""

from __future__ import annotations

from tracer.trace import Trace


def regime_noise(source, reference: Trace, variant: dict, recorder=None, device="cpu") -> dict[str, float]:
    """Per point, rel_l2 between `reference` and the regime `variant` with `accumulate=f64`, every
    op of it fed `reference`'s values of its inputs.

    Args:
        source: the model (directory or loaded model) the reference ran.
        reference: the regime's trace (usually the reimpl engine's run of `variant`).
        variant: the regime's knobs, e.g. {"preset": "llamacpp", "weights": "gguf"}.
        recorder: where the forced run's points go (default: in memory).

    Returns:
        point -> rel_l2, for every point both traces hold.

    Example:
        >>> model, regime = tracer.default_model_path(), {"preset": "llamacpp", "weights": "gguf"}
        >>> ref = tracer.record(model, [504, 3575, 282, 4649, 314], engine="reimpl", variant=regime, progress=False)
        >>> regime_noise(model, ref, regime)["model.layers.0.mlp.down_proj"] < 1e-5  # measured 1e-7..6e-7
        True
    """
    from tracer.diff import Tolerance, compare_points
    from tracer.engines.load import load_engine

    engine = load_engine("reimpl", source, {**variant, "accumulate": "f64"}, device=device)
    forced = engine.op_trace(reference, recorder)
    return {p.point: p.rel_l2 for p in compare_points(reference, forced, Tolerance()) if p.recorded}
