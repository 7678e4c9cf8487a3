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
from tracer.comparison.steps import compare_steps, step_floors, with_steps
from tracer.comparison.trace import Trace
from tracer.core.errors import TracerError
from tracer.core.progress import stage
from tracer.engines.base import Engine, at_positions


def reference_decode(prepared, steps: int, forced: list[int] | None = None
                     ) -> tuple[Trace, list[dict[str, float]] | None]:
    """The reference's greedy decode of `steps` tokens with its cache (teacher-forced on `forced` where
    given: an observed trace's tokens), and each step's floor (None without a noise floor: the fixed
    bound applies, as to the prefill)."""
    end = prepared.position_offset + len(prepared.ids) + steps
    limit = prepared.engine.max_positions
    if limit is not None and end > limit:
        raise TracerError(f"--decode {steps} after {len(prepared.ids)} tokens from position {prepared.position_offset} "
                          f"runs to position {end - 1}; the model has {limit} positions")
    reference = prepared.engine.decode(prepared.ids, steps, forced=forced, offset=prepared.position_offset)
    if prepared.noise is None:
        return reference, None
    sequence = prepared.ids + decoded_tokens(reference)
    uncached = prepared.engine.record(sequence, **at_positions(prepared.position_offset, len(sequence)))
    return reference, step_floors(reference, uncached, prepared.noise)


def decoded_tokens(trace: Trace) -> list[int]:
    """The tokens a decoded trace's steps were fed, in order."""
    return [token for step in trace.steps for token in step.tokens or ()]


def compare_decoded(result: Result, prepared, engine: Engine, steps: int,
                    reference: tuple[Trace, list[dict[str, float]] | None] | None = None) -> Result:
    """`result` (the prefill's comparison) with every decode step of both sides compared and attached
    (`tracer.comparison.steps.with_steps`). `reference`: the reference's decode and floors
    (`reference_decode`), where several candidates share them (a sweep's variants)."""
    stage("decode")
    started = time.perf_counter()
    reference, floors = reference or reference_decode(prepared, steps)
    candidate = engine.decode(prepared.ids, steps, forced=decoded_tokens(reference), offset=prepared.position_offset)
    return with_decoded(result, prepared, reference, floors, candidate, started,
                        fed="the candidate fed the reference's greedy tokens")


def with_decoded(result: Result, prepared, reference: Trace, floors: list[dict[str, float]] | None,
                 candidate: Trace, started: float, fed: str) -> Result:
    """`result` with the steps of two decoded traces compared and attached, the decode's time and a note
    saying how the steps were fed (`fed`) and judged."""
    compared = compare_steps(reference, candidate, prepared.tolerance, floors)
    timings = {**result.timings, "decode_s": time.perf_counter() - started}
    floor = ("each step's floor: the reference's cached step against its uncached forward at the same positions, "
             "or the prefill's f64 noise where larger") if floors else "the steps judged by the fixed rel_l2 bound"
    note = (f"decode: {len(reference.steps)} steps after the prefill, each side with its own KV cache, {fed}; "
            f"{floor}")
    return with_steps(result.with_context(notes=(note,), timings=timings), compared)
