"""A streamed run's sides advancing together, one unit at a time: each block's weights read once.

A streamed run (`tracer.pipeline.streamed`) would otherwise read and convert every block's
weights once per forward: the hf reference, the noise floor's f64 run, the teacher-forced local
run and the reimpl candidate, four passes over the checkpoint. Here transformers' own forward of
the reference is the driver: it runs unchanged (its masks, rotary tables, recording hooks), and a
forward pre-hook on each decoder layer, before that layer's weights come in, steps the other runs
(`tracer.reimpl.unit_runs`) through the unit the reference has just finished: the noise floor's
f64 block on its own previous output, the local run's block on the reference's input to it (just
recorded), the candidate's block on its own. The unit's weights are mapped from the files once
and converted to f32 once, shared by the reference and both f32 runs; the f64 run converts from the
same pages (`WeightFiles.holding`); then they are released. The embedding's rows and lm_head's
chunks of rows are read by each run as they are in a plain streamed forward.

Why hooks in the reference's own forward rather than calling transformers' decoder layers from
outside: the layer's arguments (masks, position embeddings, cache and whatever a family adds) are
built inside each family's forward, and a driver that rebuilt them would be a second
implementation of transformers to keep in step with it; a thread paused at each layer would give
the same order with a second stack to keep alive and to fail in. In the hook, every reference
point of the units before it has been recorded and nothing after it has run.

Every run records exactly the points, in the order, that it records alone: the pass changes who
calls each unit, not what it computes (tests/unit/test_lockstep.py compares both, point for point).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tracer.comparison.diff import ErrorRecorder
from tracer.core.errors import TracerError
from tracer.core.progress import stage
from tracer.engines.base import Engine, at_positions
from tracer.engines.reimpl import from_parts
from tracer.model.knobs import expand_presets, is_regime
from tracer.pipeline.noise_floor import FLOOR_LOW, FLOOR_SCALE, NoiseFloor
from tracer.pipeline.request import Side
from tracer.reimpl.unit_runs import FreeRun, TeacherForced
from tracer.traces.spill import read_point
from tracer.traces.trace import ATTENTION_ROWS, FirstRows, Trace, TraceMeta, TraceRecorder, kept


@dataclass
class Lockstep:
    """What one lockstep pass measured: the reference's trace, and, where they ran in it, the
    noise floor, the local errors and the candidate (its engine, its trace, and for a long prompt
    its points judged as they came)."""

    reference: Trace
    engine: Engine  # the candidate's
    candidate: Trace
    compared: ErrorRecorder | None
    local: dict[str, float] | None
    noise: dict[str, float] | None = None
    noise_notes: list[str] = field(default_factory=list)
    noise_measured: bool = False  # False: none asked for (none wanted, or the cache's)
    shared_blocks: int = 0  # blocks the local run took from the candidate's (the same input, bit for bit)
    timings: dict[str, float] = field(default_factory=dict)


def applies(reference_engine: Engine, reference: Side, candidate: Side | None) -> bool:
    """A streamed hf reference and a streamed reimpl candidate, each outside a number-format regime
    (whose steps read whole tensors, and whose noise floor is a run of its own), advance together;
    anything else runs one side after the other."""
    return (candidate is not None and candidate.engine.name == "reimpl" and reference.engine.name == "hf"
            and getattr(reference_engine.model, "tracer_weight_files", None) is not None
            and not any(is_regime(expand_presets(side.variant)) for side in (reference, candidate)))


def run(engine: Engine, source, ids: list[int], sink, *, reference: Side, candidate: Side, tolerance,
        floor_rows: int | None, known: NoiseFloor | None = None, local: bool = True,
        offset: int = 0) -> Lockstep:
    """The reference `engine` recorded on `ids` with the candidate (`candidate`'s knobs on tracer's
    forward), its local run and, when `floor_rows`, the noise floor's f64 run of the first `floor_rows`
    tokens stepped beside it, compared with the reference's rows of them (all of `ids`: the exact floor;
    fewer: the cheap floor, `tracer.pipeline.noise_floor`). Where the reference keeps only some of those
    rows (attention past ATTENTION_ROWS tokens) the floor runs in a pass of its own before, on the first
    tokens alone (the candidate's judged points need it). `sink(side)`: the run's recorder for a side (a
    long prompt's spill folder). `known`: a floor already measured (the reference cache's), for
    those judged points."""
    files = engine.model.tracer_weight_files
    config, device = source.config(), engine.device
    timings: dict[str, float] = {}
    candidate_engine = from_parts(config, files, candidate.variant, source.name, device=device, stream=True)
    noise, noise_notes, noise_model = known.noise if known is not None else None, [], None
    scale = FLOOR_SCALE if floor_rows is not None and floor_rows < len(ids) else 1.0
    if floor_rows is not None:
        try:
            noise_model = from_parts(config, files, {**reference.variant, "dtype": "f64"}, source.name,
                                     device=device, stream=True).model
        except TracerError as exc:  # as `estimate_noise` says it
            noise_notes = [f"no noise floor ({exc}): points judged by the fixed rel_l2 bound"]
    if noise_model is not None and floor_rows < len(ids) and len(ids) > ATTENTION_ROWS:
        stage("noise floor")
        first = ids[:floor_rows]
        recorder = TraceRecorder()
        errors = ErrorRecorder(_live(recorder, engine, first))
        followers = [("noise_s", FreeRun(noise_model, first, errors, _positions(offset, len(first))))]
        _stepped(engine, first, recorder, offset, followers, timings, "noise_s")
        noise, noise_model = errors.rel_l2, None
        known = NoiseFloor("cheap", len(ids), floor_rows, prefix=noise)  # what its judged points are held to
    stage("reference")
    recorder = sink("reference")
    recorder = _UnitPoints(recorder) if recorder is not None else TraceRecorder()
    live = _live(recorder, engine, ids)
    positions = _positions(offset, len(ids))
    followers = []
    noise_errors = None
    if noise_model is not None:  # the reference's rows of the floor's tokens, as they come
        noise_errors = ErrorRecorder(live if floor_rows == len(ids) else
                                     Trace(FirstRows(live.tensors, floor_rows, len(ids)), live.meta))
        followers.append(("noise_s", FreeRun(noise_model, ids[:floor_rows], noise_errors,
                                             _positions(offset, floor_rows))))
    local_errors = ErrorRecorder(live) if local and candidate_engine.entry.local_errors else None
    store = sink("candidate")
    compared = None
    if store is not None:  # a spilled candidate is judged as it comes (`compare_candidate` says why)
        local_so_far = _RelL2(local_errors) if local_errors is not None else None
        # a floor measured in this pass: each unit's, by the f64 run stepped before the candidate through it
        if noise_errors is not None:
            floor, lowest = _RelL2(noise_errors, scale), _RelL2(noise_errors, FLOOR_LOW if scale != 1 else 1.0)
        else:
            floor, lowest = (known.noise, known.lowest()) if known is not None else (None, None)
        compared = ErrorRecorder(live, tolerance, floor, local_so_far, store=store, lowest_noise=lowest)
    candidate_recorder = compared if compared is not None else TraceRecorder()
    free = FreeRun(candidate_engine.model, ids, candidate_recorder, positions)
    forced = None
    if local_errors is not None:  # stepped right before the candidate, whose blocks it shares while their inputs agree
        forced = TeacherForced(candidate_engine.model, live, local_errors, positions, beside=free)
        followers.append(("local_s", forced))
    followers.append(("candidate_s", free))
    trace = _stepped(engine, ids, recorder, offset, followers, timings, "reference_s")
    if noise_errors is not None:
        noise = noise_errors.rel_l2
    return Lockstep(reference=trace, engine=candidate_engine,
                    candidate=candidate_engine.trace(candidate_recorder.tensors, ids, offset),
                    compared=compared, local=local_errors.rel_l2 if local_errors is not None else None,
                    noise=noise, noise_notes=noise_notes, noise_measured=floor_rows is not None, timings=timings,
                    shared_blocks=forced.shared if forced is not None else 0)


def _stepped(engine: Engine, ids: list[int], recorder, offset: int, followers, timings: dict,
             reference_key: str) -> Trace:
    """`engine.record(ids, recorder)` with each follower stepped through a unit when the reference
    has finished it; timings: each follower's units under its key, the rest under `reference_key`."""
    model = engine.model
    files = model.tracer_weight_files
    layers = [model.get_submodule(prefix) for prefix in engine.layer_prefixes]
    deepest = max([len(layers)] + [follower.layers for _, follower in followers])  # a variant may add blocks
    spent = dict.fromkeys([key for key, _ in followers], 0.0)
    done = 0  # units the followers have run: the embedding, then each block

    def step(unit: str, *index: int) -> None:
        for key, follower in followers:
            started = time.perf_counter()
            getattr(follower, unit)(*index)
            spent[key] += time.perf_counter() - started

    def catch_up(units: int) -> None:
        """The followers through `units` units, on the weights still held, which are then let go."""
        nonlocal done
        while done < units:
            step("embed") if done == 0 else step("block", done - 1)
            done += 1
        held.release()
        if isinstance(recorder, _UnitPoints):
            recorder.next_unit()

    def before(units: int):
        # the reference has run (and recorded) every unit before this module
        return lambda module, args: catch_up(units)

    started = time.perf_counter()
    with files.holding(model.dtype) as held:
        boundaries = [(layer, i + 1) for i, layer in enumerate(layers)]
        output = model.get_output_embeddings()
        if output is not None:  # the last block let go before lm_head, whose rows come by chunks
            boundaries.append((output, deepest + 1))
        handles = [module.register_forward_pre_hook(before(units), prepend=True) for module, units in boundaries]
        try:
            trace = engine.record(ids, recorder, **at_positions(offset, len(ids)))
        finally:
            for handle in handles:
                handle.remove()
        catch_up(deepest + 1)
        step("head")
    total = time.perf_counter() - started
    for key, seconds in spent.items():
        timings[key] = timings.get(key, 0.0) + seconds
    timings[reference_key] = timings.get(reference_key, 0.0) + total - sum(spent.values())
    return trace


def _positions(offset: int, count: int) -> torch.Tensor:
    return torch.arange(offset, offset + count)  # what `Model.forward` builds from no positions, or from these


def _live(recorder, engine: Engine, ids: list[int]) -> Trace:
    """The reference's trace as it is being recorded (the points so far), for the followers to read."""
    return Trace(_Recorded(recorder), TraceMeta(tokens=list(ids), family=engine.family))


class _Recorded(Mapping):
    """point -> tensor of a recorder that is still recording (in memory, or its spill folder's files)."""

    def __init__(self, recorder):
        self.recorder = recorder

    def _points(self):
        return self.recorder.files if hasattr(self.recorder, "files") else self.recorder.tensors

    def __getitem__(self, point: str) -> torch.Tensor:
        if point in getattr(self.recorder, "recent", ()):
            return self.recorder.recent[point]
        if hasattr(self.recorder, "files"):
            return read_point(self.recorder.files[point])
        return self.recorder.tensors[point]

    def __contains__(self, point) -> bool:
        return point in self._points()

    def __iter__(self):
        return iter(self._points())

    def __len__(self) -> int:
        return len(self._points())


class _UnitPoints:
    """A spilling recorder (`DiskRecorder`) whose points of the unit the followers are yet to run are
    also kept in memory until they have run it (`next_unit`), with the last point (the next block's
    input): the noise floor's, the local run's and the candidate's comparisons each read every one
    of them, from here rather than three times from the disk (the spill's reads bypass the page
    cache). Memory: one unit's points, whatever the depth."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.recent: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        self.recorder(name, tensor)
        self.recent[name] = kept(name, tensor)

    def next_unit(self) -> None:
        last = next(reversed(self.recent), None)
        self.recent = {last: self.recent[last]} if last is not None else {}

    @property
    def files(self):
        return self.recorder.files

    @property
    def tensors(self):
        return self.recorder.tensors


class _RelL2(Mapping):
    """point -> `scale` × rel_l2 of an `ErrorRecorder` still recording (the local run or the noise floor's,
    one unit ahead of the candidate; a cheap floor scaled as `tracer.pipeline.noise_floor.NoiseFloor` does)."""

    def __init__(self, errors: ErrorRecorder, scale: float = 1.0):
        self.errors, self.scale = errors, scale

    def __getitem__(self, point: str) -> float:
        return self.scale * self.errors.diffs[point].rel_l2

    def __iter__(self):
        return iter(self.errors.diffs)

    def __len__(self) -> int:
        return len(self.errors.diffs)
