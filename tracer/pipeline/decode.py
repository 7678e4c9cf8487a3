"""`--decode N`: both sides decode N steps after the prompt, each with its own KV cache, and every step
is compared (docs/decode.md).

The reference decodes first, greedily; the candidate is teacher-forced on the reference's tokens, so
both see the same inputs at every step and a flipped argmax does not end the comparison. The truth
of a step is the reference's cached decode; its floor comes from the reference too: its uncached
forward over the prompt and every decoded token (one more forward) gives each step's rows computed
without a cache, and the two differ by f32 rounding only (`tracer.comparison.steps.step_floors`), and
an f64 run over the same tokens gives each step's own rounding. What these measure is kept in the
reference cache (`step_floors_key`), so that a second run of the same decode pays for neither.
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from tracer.comparison.diff import ErrorRecorder
from tracer.comparison.explain import position_hint
from tracer.comparison.result import DEFAULT_REL_L2, Divergence, Result
from tracer.comparison.steps import (
    PREFILL,
    StepNoise,
    compare_steps,
    decoded_steps,
    raised_to,
    step_floors,
    step_position,
    with_steps,
)
from tracer.core.errors import TracerError
from tracer.core.progress import stage
from tracer.engines.base import Engine, at_positions, steps_kept_by
from tracer.engines.load import load_engine
from tracer.engines.registry import EngineRef
from tracer.model.knobs import expand_presets, is_regime
from tracer.model.points import CACHE_POINTS, K_ROPE, Q_ROPE, split_point
from tracer.pipeline import reference_cache
from tracer.traces.spill import SPILL_TOKENS, DiskRecorder
from tracer.traces.trace import Trace


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
    at = at_positions(prepared.position_offset, len(sequence))
    if is_regime(expand_presets(prepared.variant)):  # its prefill's floor is the regime's own (regime_noise)
        return reference, step_floors(reference, prepared.engine.record(sequence, **at), prepared.noise)
    key = step_floors_key(prepared, steps, forced)
    kept = reference_cache.load(key) if key is not None else None
    if kept is not None and kept.get("tokens") == sequence:
        return reference, raised_to(kept["floors"], prepared.noise)
    uncached = prepared.engine.record(sequence, **at)
    # each step's own rows in f64 (a streamed reimpl run, as the prefill's noise): their f32 rounding
    noise = StepNoise(reference, uncached)
    load_engine(EngineRef.named("reimpl"), {**prepared.variant, "dtype": "f64"},
                dataclasses.replace(prepared.target, stream=True)).record(sequence, noise, **at)
    floors = step_floors(reference, uncached, None, noise.noise)
    if key is not None:
        reference_cache.store((key, {"tokens": sequence, "floors": floors}))
    return reference, raised_to(floors, prepared.noise)


def step_floors_key(prepared, steps: int, forced: list[int] | None) -> dict | None:
    """The reference cache's key of a decode's step floors (what the steps measure apart from the
    prefill's floor, which each run adds: `raised_to`); None for a loaded model."""
    if prepared.request is None:
        return None
    return prepared.cache_key(prepared.request.placement, measure="step floors", steps=steps, forced=forced)


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
    with kept_steps(len(prepared.ids) + steps if reference is None else 0):
        reference, floors = reference or reference_decode(prepared, steps)
        candidate = engine.decode(prepared.ids, steps, forced=decoded_tokens(reference),
                                  offset=prepared.position_offset)
        return with_decoded(result, prepared, reference, floors, candidate, started,
                            fed="the candidate fed the reference's greedy tokens", engine=engine)


@contextmanager
def kept_steps(sequence: int):
    """Past `SPILL_TOKENS` positions (prompt and decoded tokens), each step both sides record is written to
    a temporary folder as soon as it is recorded and read back point by point when compared
    (`tracer.traces.spill`), so that memory stays flat in the number of steps: held in memory, each
    step's cache points hold every slot so far and a decode's memory grows with its square. The folder
    goes when the steps are compared. Engines in a child process (llama.cpp, candle) send their steps
    back in one file and are not spilled."""
    if sequence <= SPILL_TOKENS:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="tracer-steps-") as folder:
        written = itertools.count()

        def spill(trace: Trace) -> Trace:
            recorder = DiskRecorder(Path(folder) / f"{next(written):06d}")
            for point, tensor in trace.tensors.items():
                recorder(point, tensor[None])  # recorders take the batch dimension their traces drop
            return dataclasses.replace(trace, tensors=recorder.tensors)

        with steps_kept_by(spill):
            yield


def with_decoded(result: Result, prepared, reference: Trace, floors: list[dict[str, float]] | None,
                 candidate: Trace, started: float, fed: str, engine: Engine | None = None) -> Result:
    """`result` with the steps of two decoded traces compared and attached, the decode's time and a note
    saying how the steps were fed (`fed`) and judged; with the candidate's `engine`, each step's local
    errors where it can rerun a step (`step_local_errors`)."""
    local = step_local_errors(engine, reference) if engine is not None else None
    compared = compare_steps(reference, candidate, prepared.tolerance, floors, local,
                             measured_hints=lambda *step: given_position_hints(prepared, *step))
    timings = {**result.timings, "decode_s": time.perf_counter() - started}
    floor = ("each step's floor: the reference's cached step against its uncached forward at the same positions, "
             "or the prefill's f64 noise where larger") if floors else "the steps judged by the fixed rel_l2 bound"
    rerun = ("; each step of the candidate also rerun on the reference's inputs and cache (local errors: what the "
             "step makes, not what it inherits)") if local else ""
    skipped = [number for number, errors in enumerate(local or []) if errors is None]
    if skipped:
        rerun += (f", except at {len(skipped)} step{'s' if len(skipped) > 1 else ''} from step {skipped[0]} on, whose "
                  "reference cache holds fewer slots than positions (a sliding window's ring: not rerun)")
    note = (f"decode: {len(reference.steps)} steps after the prefill, each side with its own KV cache, {fed}; "
            f"{floor}{rerun}")
    return with_steps(result.with_context(notes=(note,), timings=timings), compared)


def step_local_errors(engine: Engine, reference: Trace) -> list[dict[str, float] | None] | None:
    """Per step (0: the prefill), per point: the error the candidate's step makes on the reference's
    inputs and on the reference's cache as it was before the step (`Engine.local_step_trace`); None
    where the engine cannot rerun a block on foreign inputs, and for a step whose reference cache, before
    or after it, does not hold every position in order (a sliding window's ring: its slots are not
    positions the rerun could place). The reruns are compared as they come."""
    if not (engine.entry.local_errors and engine.entry.decode):
        return None
    steps, errors = decoded_steps(reference), []
    for number, step in enumerate(steps):
        before = steps[number - 1] if number else None
        held = step_position(step) - step_position(reference)  # the positions before the step
        if not holds_every_position(step, held + len(step.tokens)) or (
                before is not None and not holds_every_position(before, held)):
            errors.append(None)
            continue
        recorder = ErrorRecorder(step)
        engine.local_step_trace(step, before, len(reference.tokens), recorder)
        errors.append(recorder.rel_l2)
    return errors


def holds_every_position(step: Trace, count: int) -> bool:
    """Whether every layer's cache after `step` holds `count` slots, one per position since the prompt's first."""
    return all(step[point].shape[1] == count for point in step.points if split_point(point)[1] in CACHE_POINTS)


SCANNED_POSITIONS = 64  # positions tried at each end for a step's token: 0.. and ..its own + 1


def given_position_hints(prepared, number: int, reference: Trace, candidate: Trace, first: Divergence) -> list[str]:
    """Where a decode step first diverges at layer 0's RoPE: which position its token was given, read
    off the numbers. The reference runs the step's token at every position from 0 (and up to one past
    the step's own) in one uncached forward; layer 0's RoPE output of a token depends on the token and
    its position alone, so the row the candidate's equals names the position it was given
    (`tracer.comparison.explain.position_hint`)."""
    layer, sub = split_point(first.point)
    if number == PREFILL or layer != 0 or sub not in (Q_ROPE, K_ROPE) or first.point not in candidate:
        return []
    position, engine = step_position(reference), prepared.engine
    last = min(position + 2, engine.max_positions or position + 2)  # one past the last position tried
    ranges = [(0, min(last, SCANNED_POSITIONS))]
    if last > SCANNED_POSITIONS:
        ranges.append((max(ranges[0][1], last - SCANNED_POSITIONS), last))
    if any(start for start, _ in ranges) and not engine.entry.positions:
        ranges = ranges[:1]
    token = reference.tokens[-1]
    scanned, rows = [], []
    for start, end in ranges:
        run = engine.record([token] * (end - start), **at_positions(start, end - start))
        scanned += range(start, end)
        rows.append(run[first.point])  # (heads, N, D)
    threshold = first.threshold if first.threshold is not None else DEFAULT_REL_L2
    return [position_hint(number, first.point, position, candidate[first.point][:, -1:], torch.cat(rows, dim=1),
                          scanned, threshold, prepared.position_offset + len(prepared.ids), prepared.position_offset)]
