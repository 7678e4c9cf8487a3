"""`--decode N`: both sides decode N steps after the prompt, each with its own KV cache, and every step
is compared (docs/decode.md).

The reference decodes first, greedily; the candidate is teacher-forced on the reference's tokens, so
both see the same inputs at every step and a flipped argmax does not end the comparison. The truth
of a step is the reference's cached decode; its floor comes from the reference too: its uncached
forward over the prompt and every decoded token (one more forward) gives each step's rows computed
without a cache, and the two differ by f32 rounding only (`tracer.comparison.steps.step_floors`).
"""

from __future__ import annotations

import time

from tracer.comparison.result import Result
from tracer.comparison.steps import StepNoise, compare_steps, step_floors, with_steps
from tracer.comparison.trace import Trace
from tracer.core.errors import TracerError
from tracer.core.progress import stage
from tracer.engines.base import Engine, at_positions
from tracer.engines.load import load_engine
from tracer.engines.registry import EngineRef


def reference_decode(prepared, steps: int) -> tuple[Trace, list[dict[str, float]] | None]:
    """The reference's greedy decode of `steps` tokens with its cache, and each step's floor (None
    without a noise floor: the fixed bound applies, as to the prefill)."""
    end = prepared.position_offset + len(prepared.ids) + steps
    limit = prepared.engine.max_positions
    if limit is not None and end > limit:
        raise TracerError(f"--decode {steps} after {len(prepared.ids)} tokens from position {prepared.position_offset} "
                          f"runs to position {end - 1}; the model has {limit} positions")
    reference = prepared.engine.decode(prepared.ids, steps, offset=prepared.position_offset)
    if prepared.noise is None:
        return reference, None
    sequence = prepared.ids + decoded_tokens(reference)
    at = at_positions(prepared.position_offset, len(sequence))
    uncached = prepared.engine.record(sequence, **at)
    # each step's own rows in f64 (a streamed reimpl run, as the prefill's noise): their f32 rounding
    noise = StepNoise(reference, uncached)
    load_engine(EngineRef.named("reimpl"), prepared.source, {**prepared.variant, "dtype": "f64"},
                device=prepared.device, stream=True).record(sequence, noise, **at)
    return reference, step_floors(reference, uncached, prepared.noise, noise.noise)


def decoded_tokens(trace: Trace) -> list[int]:
    """The tokens a decoded trace's steps were fed, in order."""
    return [token for step in trace.steps for token in step.tokens or ()]


def compare_decoded(result: Result, prepared, engine: Engine, steps: int) -> Result:
    """`result` (the prefill's comparison) with every decode step of both sides compared and attached
    (`tracer.comparison.steps.with_steps`)."""
    stage("decode")
    started = time.perf_counter()
    reference, floors = reference_decode(prepared, steps)
    candidate = engine.decode(prepared.ids, steps, forced=decoded_tokens(reference), offset=prepared.position_offset)
    compared = compare_steps(reference, candidate, prepared.tolerance, floors)
    timings = {**result.timings, "decode_s": time.perf_counter() - started}
    floor = ("each step's floor: the reference's cached step against its uncached forward at the same positions, "
             "or the prefill's f64 noise where larger") if floors else "the steps judged by the fixed rel_l2 bound"
    note = (f"decode: {steps} steps after the prefill, each side with its own KV cache, the candidate fed the "
            f"reference's greedy tokens; {floor}")
    return with_steps(result.with_context(notes=(note,), timings=timings), compared)
