"""The run's stages, in two steps every command composes (`tracer.pipeline.commands`).

1. `prepared_reference(request)`: on the request's resolved target (`Request.resolved`: the model
   source, the device, the placement, checked once against every engine it names), the token ids,
   the reference engine and its trace, the noise floor, the reference's greedy continuation, and the
   notes about all of that. A context manager: long prompts spill traces to a temporary folder that
   lives as long as the block.
2. `compare_candidate(prepared, engine)`: the candidate's local (teacher-forced) errors where its
   engine can run them, its trace (a long prompt's judged point by point as it is recorded), the
   diff against the reference, both greedy continuations, and the notes: one `Result` with the
   run's context attached once.

`run` is one candidate; `sweep` many (one per variant, `sweep_row`); `diagnose` one observed trace
plus the catalogue; `compare_files` two traces with no model (`prepared_from_trace`). Because they
share these steps, a sweep row says what `tracer run --variant V` says for the same variant.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from tracer.comparison.diff import ErrorRecorder, compare, rejudged
from tracer.comparison.result import Greedy, Result, Tolerance
from tracer.core.allocator import map_streamed_weights
from tracer.core.errors import TracerError
from tracer.core.progress import stage
from tracer.engines.base import Engine, at_positions, environment
from tracer.engines.load import LoadTarget, load_engine
from tracer.engines.registry import EngineRef, check_engine
from tracer.engines.reimpl import from_parts
from tracer.files.sources import ModelSource
from tracer.files.tokenizer import chat_text, chat_tokens, detokenize, tokenize
from tracer.files.weights import WeightFiles, read_weights
from tracer.model.config import audit, unchanging_knobs
from tracer.model.knobs import expand_presets, is_regime, setting, variant_text
from tracer.pipeline import greedy, lockstep, reference_cache
from tracer.pipeline.lockstep import Lockstep
from tracer.pipeline.noise_floor import NoiseFloor, estimate_noise, floor_rows, prefix_noise
from tracer.pipeline.request import Request, Side
from tracer.reimpl.forced_runs import after_routing, routes
from tracer.traces.spill import SPILL_TOKENS, spill_folder
from tracer.traces.trace import ATTENTION_ROWS, Trace


@dataclass(frozen=True)
class Prepared:
    """The reference side of a run, prepared once and shared by every candidate compared with it.

    `request` is the run's (None for two saved traces): the stages after the reference read what they do
    from it. `target` is what every engine of the run loads and where (the model source, the device,
    streamed or not, accelerate's placement), resolved once; `prompt` the text as the user gave it and
    `chat` the templated text when it went through a chat template; `sink(side)` gives a recorder for a
    side (None: in memory; a `DiskRecorder` for long prompts).
    """

    request: Request | None
    target: LoadTarget | None
    ids: list[int]
    prompt: str | None
    chat: dict | None
    reference: str  # the engine name as given ("hf", "file:PATH")
    engine: Engine | None
    variant: dict
    trace: Trace
    noise: dict | None  # each point's floor, judged against (`floor.noise`; None: no floor)
    tolerance: Tolerance
    greedy_steps: int
    reference_greedy: list[int] | None
    detokenize: Callable
    sink: Callable
    position_offset: int = 0  # the first token's absolute position, on both sides
    notes: tuple[str, ...] = ()
    timings: dict = field(default_factory=dict)
    lockstep: Lockstep | None = None  # the candidate, already run beside the reference (streamed runs)
    floor: NoiseFloor | None = None  # how `noise` was measured, and its exact values measured on demand

    @property
    def source(self) -> ModelSource | None:
        """The model the run traces (None for two saved traces)."""
        return self.target.source if self.target is not None else None

    def cache_key(self, placement, **measured) -> dict | None:
        """The reference cache's key of what was `measured` on this reference over its tokens (a decode's
        step floors, a diagnosis's catalogue): the reference, its variant, `placement` and the position
        offset, with what `measured` names; None for a loaded model or a saved trace."""
        source = self.source
        if source is None or source.loaded:
            return None
        return reference_cache.entry_key(source.directory, self.ids, engine=self.reference, variant=self.variant,
                                         placement=repr(placement), position_offset=self.position_offset, **measured)


def token_ids(source: ModelSource, prompt: str | None = None, tokens=None, *, chat: bool = False,
              system: str | None = None) -> tuple[list[int], dict | None]:
    """(ids, chat) for the run: ids given directly, or the prompt tokenized with the model's
    tokenizer (through its chat template when `chat`; `chat` then says what was fed)."""
    if tokens is not None:
        if chat or system is not None:
            raise TracerError("chat templates apply to a prompt, not to token ids")
        ids = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
        if not ids:
            raise TracerError("empty token list")
        return ids, None
    if prompt is None:
        raise TracerError("give a prompt or token ids")
    if system is not None and not chat:
        raise TracerError("a system message needs the chat template: pass chat=True (--chat)")
    model_dir = source.directory
    if model_dir is None:
        raise TracerError("this loaded model has no tokenizer folder; pass token ids instead of a prompt")
    if not chat:
        return tokenize(model_dir, prompt), None
    text = chat_text(model_dir, prompt, system)
    ids = chat_tokens(model_dir, text)
    return ids, {"system": system, "text": text, "tokens": len(ids)}


def check_tokens(ids: list[int], engine: Engine, position_offset: int = 0) -> None:
    """Ids the model cannot embed, or more positions than it has, are the user's error, said plainly."""
    if engine.vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < engine.vocab_size]
        if bad:
            raise TracerError(f"token id {bad[0]} is outside the vocabulary (0..{engine.vocab_size - 1})")
    if engine.max_positions is not None and position_offset + len(ids) > engine.max_positions:
        at = f" from position {position_offset}" if position_offset else ""
        raise TracerError(f"the prompt has {len(ids)} tokens{at}; the model has {engine.max_positions} positions")


@contextmanager
def prepared_reference(request: Request, *, lockstep_with: Side | None = None):
    """The reference side loaded (`reference_side`) and measured (`measured`): yield a `Prepared`, and keep
    what was measured in the reference cache once the block has run without an error.

    `request` is checked and resolved already (`tracer.pipeline.request.Request.resolved`: its `target`
    is what every engine loads and where). `lockstep_with`: the candidate, run beside the reference in
    one pass over the weights when the run streams and the engines allow (`tracer.pipeline.lockstep`;
    `Prepared.lockstep` holds its engine and results).
    """
    with reference_side(request, lockstep_with) as side:
        prepared, measurements = measured(side)
        yield prepared
    # kept only once the run has succeeded: a failed run writes nothing
    entries = [(side.key, measurements)] if measurements is not None else []
    if prepared.floor is not None and prepared.floor.unsaved and side.key is not None:
        entries += floor_entries(side, prepared.floor)
    reference_cache.store(*entries)


@dataclass(frozen=True)
class ReferenceSide:
    """The reference side of a run, loaded and not yet recorded (`reference_side`): its engine on the
    request's target, the token ids and the notes so far, how many greedy steps it decodes, its entry in
    the reference cache (`key`, None for a loaded model; `kept`: what an earlier run measured), `sink(side)`
    (a recorder for a side: None in memory, a spill folder's for long prompts and streamed runs) and the
    candidate that records beside it, if any (`lockstep_with`)."""

    request: Request
    engine: Engine
    ids: list[int]
    chat: dict | None
    notes: tuple[str, ...]
    greedy_steps: int
    key: str | None
    kept: dict | None
    sink: Callable
    lockstep_with: Side | None
    timings: dict


@contextmanager
def reference_side(request: Request, lockstep_with: Side | None = None):
    """Load the reference engine, tokenize and check the tokens, choose the greedy steps (`request.greedy`
    None: 20, or none past 128 tokens, in a streamed run or for a batch), look the reference up in the
    cache, and open the run's spill folder; yield a `ReferenceSide` for as long as its traces are used."""
    inputs, reference, target = request.inputs, request.reference, request.target
    timings = {"load_s": request.resolve_s}
    notes = list(request.notes)
    with timed(timings, "load_s"):
        stage("load")
        if target.stream:
            map_streamed_weights()  # weights pass through memory on every forward: not kept in the heap
        engine = load_engine(reference.engine, reference.variant, target)
    source, stream = target.source, target.stream
    ids, chat_info = token_ids(source, inputs.text, inputs.tokens, chat=inputs.chat, system=inputs.system)
    if inputs.max_tokens is not None and len(ids) > inputs.max_tokens:
        notes.append(f"prompt truncated from {len(ids)} to its first {inputs.max_tokens} tokens")
        ids = ids[:inputs.max_tokens]
    offset = inputs.position_offset
    check_tokens(ids, engine, offset)
    notes += stream_notes(stream, reference.engine)
    greedy_steps = request.greedy
    if greedy_steps is None and inputs.batch > 1:
        greedy_steps = 0  # the rows are compared point by point; a greedy continuation would be the first row's only
    elif greedy_steps is None:
        greedy_steps = greedy.default_steps(len(ids)) if not stream else 0
        if not greedy_steps:
            why = "in a streamed run (each step reads every weight again)" if stream \
                else f"for a {len(ids)}-token prompt"
            notes.append(f"no greedy continuation {why} (pass greedy=N to force)")
    key = None if source.loaded else reference_cache.entry_key(
        source.directory, ids, engine=str(reference.engine), variant=reference.variant,
        placement=repr(request.placement), greedy_steps=greedy_steps, position_offset=offset)
    kept = reference_cache.load(key) if key is not None else None
    # a streamed run spills too: its points, 25 MB a layer per side at the 8B width and 64 tokens, would
    # otherwise be the one thing in its memory that grows with depth
    with spill_folder(len(ids) > SPILL_TOKENS or stream) as sink:
        yield ReferenceSide(request, engine, ids, chat_info, tuple(notes), greedy_steps, key, kept, sink,
                            lockstep_with, timings)


def measured(side: ReferenceSide) -> tuple[Prepared, dict | None]:
    """Record the reference (beside its lockstep candidate where one applies), measure its noise floor and
    decode its greedy continuation, or take either from the cache: the `Prepared` reference, and what the
    reference cache is to keep of its greedy continuation (None: read from there, or a loaded model's)."""
    request, engine, ids, kept = side.request, side.engine, side.ids, side.kept
    reference, target, tolerance, offset = request.reference, request.target, request.tolerance, \
        request.inputs.position_offset
    timings, notes = dict(side.timings), list(side.notes)
    mode = request.noise_floor
    rows = None if mode is None else len(ids) if is_regime(expand_presets(reference.variant)) \
        else floor_rows(len(ids), mode)
    floor = cached_floor(side, mode, rows)
    together = None
    if target.stream and side.lockstep_with is not None and lockstep.applies(engine, reference, side.lockstep_with):
        together = lockstep.run(engine, target.source, ids, side.sink, reference=reference,
                                candidate=side.lockstep_with, tolerance=tolerance,
                                floor_rows=rows if floor is None else None,
                                known=floor, offset=offset)
    if together is not None:
        trace = together.reference
        timings.update(together.timings)
    else:
        with timed(timings, "reference_s"):
            stage("reference")
            trace = engine.record(ids, side.sink("reference"), **at_positions(offset, len(ids)))
    noise_notes = []
    if floor is None and mode is not None:
        with timed(timings, "noise_s"):
            stage("noise floor")
            if together is not None and together.noise_measured:
                noise_notes = together.noise_notes
                floor = None if together.noise is None else floor_of(mode, len(ids), rows, together.noise)
            else:
                floor, noise_notes = reference_noise(target, reference, engine, trace, mode, rows)
    if floor is not None and reference.entry.noise_floor:
        source, variant, device = target.source, reference.variant, engine.device
        floor.family = trace.meta.family
        floor.measure_exact = lambda point: estimate_noise(source, trace, variant, device, through=point)
    if kept is not None:
        reference_greedy = kept["greedy"]
        notes.append("reference greedy continuation read from the cache (an earlier run of this model and these "
                     "tokens decoded it)")
    else:
        with timed(timings, "reference_greedy_s"):
            stage("reference greedy")
            reference_greedy = greedy.generated(engine, ids, side.greedy_steps, offset=offset) \
                if side.greedy_steps else None
    prepared = Prepared(
        request=request, target=target, ids=ids, prompt=request.inputs.text, chat=side.chat,
        reference=str(reference.engine), engine=engine, variant=reference.variant, trace=trace,
        noise=floor.noise if floor is not None else None,
        tolerance=tolerance, greedy_steps=side.greedy_steps, reference_greedy=reference_greedy,
        detokenize=detokenizer(target.source), sink=side.sink, position_offset=offset,
        notes=(*notes, *noise_notes, *memory_notes(len(ids))), timings=timings, lockstep=together, floor=floor,
    )
    keep = side.key is not None and kept is None and side.greedy_steps
    return prepared, {"greedy": reference_greedy} if keep else None


def floor_of(mode: str, tokens: int, rows: int, measured: dict[str, float]) -> NoiseFloor:
    """A floor measured on the first `rows` of `tokens` tokens: exact where that is all of them."""
    if rows >= tokens:
        return NoiseFloor(mode, tokens, tokens, exact=dict(measured))
    return NoiseFloor(mode, tokens, rows, prefix=dict(measured))


def floor_keys(side: ReferenceSide, rows: int) -> tuple[dict, dict]:
    """The reference cache's keys of a floor: its exact values (the whole prompt's tokens), and its cheap
    ones (the first `rows` tokens only: a prompt that extends a measured one shares them)."""
    request, ids = side.request, side.ids
    context = dict(engine=str(request.reference.engine), variant=request.reference.variant,
                   placement=repr(request.placement), position_offset=request.inputs.position_offset)
    directory = request.target.source.directory
    return (reference_cache.entry_key(directory, ids, measure="exact floor", **context),
            reference_cache.entry_key(directory, ids[:rows], measure="cheap floor", rows=rows, **context))


def cached_floor(side: ReferenceSide, mode: str | None, rows: int | None) -> NoiseFloor | None:
    """The floor an earlier run measured (None: none kept): the whole prompt's exact floor where a run
    measured it, else a cheap floor of its first `rows` tokens or more (more rows: closer to the exact
    floor, within the calibration still) with the exact values measured so far."""
    if mode is None or side.key is None:
        return None
    tokens = len(side.ids)
    exact_key, _ = floor_keys(side, rows)
    exact = reference_cache.load(exact_key) or {}
    if exact.get("complete"):
        return NoiseFloor(mode, tokens, tokens, exact=exact["noise"], from_cache=True, unsaved=False)
    while rows < tokens:
        cheap = reference_cache.load(floor_keys(side, rows)[1])
        if cheap is not None:
            return NoiseFloor(mode, tokens, rows, prefix=cheap["noise"], exact=exact.get("noise") or {},
                              exact_through=exact.get("through"), from_cache=True, unsaved=False)
        rows *= 2
    return None


def floor_entries(side: ReferenceSide, floor: NoiseFloor) -> list[tuple[dict, dict]]:
    """What the reference cache keeps of `floor`: its cheap values under the first rows' key, its exact ones
    under the whole prompt's (complete, or through the last point a confirmation measured)."""
    exact_key, cheap_key = floor_keys(side, floor.rows)
    entries = [(cheap_key, {"noise": floor.prefix})] if floor.prefix else []
    if floor.exact:
        complete = floor.rows >= floor.tokens
        entries.append((exact_key, {"noise": floor.exact, "complete": complete, "through": floor.exact_through}))
    return entries


def stream_notes(stream: bool, engine: EngineRef) -> list[str]:
    """In a streamed run, a side whose engine cannot stream loads its whole model: said."""
    if stream and not engine.entry.stream:
        return [f"stream: the {engine} engine loads its whole model (only engines that stream read weights "
                "block by block)"]
    return []


def prepared_from_trace(trace: Trace, tolerance: Tolerance | None = None, tokens: list[int] | None = None) -> Prepared:
    """A saved reference trace standing alone (no model, no noise floor, no greedy decoding);
    `tokens` when the trace does not carry its own."""
    return Prepared(
        request=None, target=None, ids=list(trace.tokens or tokens or []), prompt=trace.meta.prompt, chat=None,
        reference="file", engine=None, variant=trace.variant, trace=trace, noise=None,
        tolerance=tolerance or Tolerance(), greedy_steps=0, reference_greedy=None,
        detokenize=lambda ids: None, sink=lambda side: None,
    )


def compare_candidate(prepared: Prepared, engine: Engine, *, command: str | None = None, notes: tuple[str, ...] = (),
                      config_audit: dict | None = None, trace: Trace | None = None, local: bool = True) -> Result:
    """Record `engine` on the prepared tokens (or take its `trace` of them, already recorded) and
    compare it with the reference: the `Result`, with local errors (unless `local` is False),
    greedy continuations and the run's context attached."""
    return candidate_compared(prepared, engine, command=command, notes=notes, config_audit=config_audit, trace=trace,
                              local=local)[0]


def candidate_compared(prepared: Prepared, engine: Engine, *, command: str | None = None,
                       notes: tuple[str, ...] = (), config_audit: dict | None = None, trace: Trace | None = None,
                       local: bool = True, kept_as: str | None = None) -> tuple[Result, Trace]:
    """`compare_candidate`, and the candidate's trace. `kept_as`: the candidate is one of several compared with
    each other afterwards (a triangulation): its whole trace is kept, under that name where the run spills,
    rather than judged as it comes and kept in part."""
    check_tokens(prepared.ids, engine, prepared.position_offset)
    timings, floor = dict(prepared.timings), prepared.floor
    together = prepared.lockstep if prepared.lockstep is not None and prepared.lockstep.engine is engine else None
    with timed(timings, "local_s"):
        errors = (together.local if together is not None else local_errors(engine, prepared.trace)) if local else None
        # (a streamed run's local errors come from its lockstep pass, which does not force the routing)
        routed = routed_errors(engine, prepared.trace) if local and together is None else None
    compared = None
    with timed(timings, "candidate_s"):
        stage("candidate")
        if together is not None:  # run in the reference's pass
            trace, compared = together.candidate, together.compared
        elif trace is None:
            recorder = prepared.sink(kept_as or "candidate")
            # A long run's candidate is judged as it comes; an isolated engine's child writes its points
            # straight into the spill folder instead, which that would not save.
            if recorder is not None and not engine.entry.isolated and kept_as is None:
                recorder = compared = ErrorRecorder(prepared.trace, prepared.tolerance, prepared.noise, errors,
                                                    store=recorder, lowest_noise=floor and floor.lowest())
            trace = engine.record(prepared.ids, recorder,
                                  **at_positions(prepared.position_offset, len(prepared.ids)))

    def judged(noise: dict[str, float] | None) -> Result:
        diffs = None if compared is None else rejudged(compared.diffs, prepared.tolerance, noise or {})
        return compare(prepared.trace, trace, prepared.tolerance, noise=noise, local=errors, routed=routed,
                       compared=diffs)

    with timed(timings, "compare_s"):
        stage("compare")
        result = judged(prepared.noise) if floor is None else floor.settled(judged, prepared.tolerance)
    with timed(timings, "greedy_s"):
        stage("greedy")
        continuations = greedy_comparison(prepared, engine, prepared.tolerance)
    detokenize = prepared.detokenize
    return result.with_context(
        notes=(*notes, *prepared.notes, *unchanging_notes(prepared, engine), *trace_notes(prepared.trace, trace)),
        prompt=prepared.prompt, chat=prepared.chat, greedy=continuations,
        token_texts=[detokenize([t]) for t in prepared.ids] if prepared.ids and detokenize(prepared.ids[:1]) else None,
        environment=environment(), command=command, timings=timings, config_audit=config_audit,
        floor=floor.summary(result) if floor is not None else None,
    ), trace


def unchanging_notes(prepared: Prepared, engine: Engine) -> list[str]:
    """A knob of either side that changes nothing on this model, said: a match then tells nothing of
    the mistake the knob plants."""
    source = prepared.source
    if source is None:
        return []
    config = source.config()
    notes = []
    for role, variant in (("reference", prepared.variant), ("candidate", engine.variant)):
        same = unchanging_knobs(config, variant or {})
        if same:
            notes.append(f"{role}: {variant_text(same)} changes nothing on this model (its own value already)")
    return notes


def local_errors(engine: Engine, reference: Trace) -> dict[str, float] | None:
    """Per point, the rel_l2 the engine introduces there given the reference's inputs; None for
    engines that cannot rerun a block on foreign inputs (their registry entry says). The forced
    run's points are compared as they come, never kept."""
    if not engine.entry.local_errors:
        return None
    errors = ErrorRecorder(reference)
    engine.local_trace(reference, errors)
    return errors.rel_l2


def routed_errors(engine: Engine, reference: Trace) -> dict[str, float] | None:
    """Per point of a MoE layer recorded after its routing (`mlp.experts`, `mlp`, the block's output), the
    rel_l2 the engine introduces there given the reference's inputs and the reference's routing
    (`tracer.reimpl.forced_runs.routed_points`): the experts' own error. None for engines that cannot
    rerun a block on foreign inputs, and where the reference carries no routing."""
    if not engine.entry.local_errors or not routes(reference):
        return None
    errors = ErrorRecorder(reference)
    _, layers = engine.routed_trace(reference, errors)
    return {name: errors.rel_l2[name] for name in after_routing(errors.names, layers) if name in errors.rel_l2}


def greedy_comparison(prepared: Prepared, engine: Engine, tolerance: Tolerance) -> Greedy | None:
    """Both sides' greedy continuations and, if they part, the first divergent point at that step."""
    if prepared.reference_greedy is None:
        return None
    candidate = greedy.generated(engine, prepared.ids, prepared.greedy_steps, guess=prepared.reference_greedy,
                               offset=prepared.position_offset)
    summary = greedy.summary(prepared.reference_greedy, candidate, prepared.detokenize)
    if summary and summary.first_flip:
        at_flip = flip_divergence(prepared, engine, summary.first_flip, tolerance)
        summary = dataclasses.replace(summary, first_flip_divergence=at_flip)
    return summary


def flip_divergence(prepared: Prepared, engine: Engine, flip: int, tolerance: Tolerance):
    """Where the two sides part at the step whose argmax flips, both fed the same tokens: that step of each
    side's own cached decode where both decode (`greedy.flip_step`), else both uncached forwards over the
    prompt and the reference's continuation up to it."""
    sides = [greedy.flip_step(side, prepared.ids, prepared.reference_greedy, flip, prepared.position_offset)
             for side in (prepared.engine, engine)]
    if None in sides:
        flip_ids = prepared.ids + prepared.reference_greedy[:flip - 1]
        at = at_positions(prepared.position_offset, len(flip_ids))
        sides = [prepared.engine.record(flip_ids, **at), engine.record(flip_ids, **at)]
    return compare(*sides, tolerance).first_divergence


def candidate_engine(prepared: Prepared) -> Engine:
    """The run's candidate on the prepared target: the one the lockstep pass ran beside the reference
    (a streamed run), else loaded now."""
    if prepared.lockstep is not None:
        return prepared.lockstep.engine
    candidate = prepared.request.candidate
    return load_engine(candidate.engine, candidate.variant, prepared.target)


def candidate_loader(candidate: EngineRef, prepared: Prepared) -> Callable[[dict], Engine]:
    """knobs -> a candidate engine on the prepared model, the knobs checked against it first; a reimpl
    candidate on a model directory reuses the config and weights read once (a sweep builds one per
    variant)."""
    if candidate.entry.argument_required:
        raise TracerError(f"{candidate} is a saved trace; variants need an engine that runs the model")
    target = prepared.target
    source = target.source
    if candidate.name == "reimpl" and not source.loaded:
        config = source.config()
        weights = WeightFiles(source.directory) if target.stream else read_weights(source.directory)

        def load(knobs: dict):
            return from_parts(config, weights, knobs, source.name, device=target.device, stream=target.stream)
    else:
        def load(knobs: dict):
            return load_engine(candidate, knobs, target)

    def load_candidate(knobs: dict) -> Engine:
        check_engine(knobs, candidate.entry)
        return load(knobs)

    return load_candidate


def reference_noise(target: LoadTarget, reference: Side, engine: Engine, trace: Trace, mode: str,
                    rows: int) -> tuple[NoiseFloor | None, list[str]]:
    """(the floor, notes): what f32 rounding alone makes at each point of the reference, measured by an
    f64 run of the first `rows` tokens (`tracer.pipeline.noise_floor`: all of them, the exact floor)."""
    entry, variant = reference.entry, reference.variant
    if entry.argument_required:
        return None, ["no noise floor for a saved reference trace: points judged by the fixed rel_l2 bound"]
    if not entry.noise_floor:
        return None, [f"no noise floor for a {entry.name} reference (an f64 run of tracer's model does not measure "
                      "its rounding): points judged by the fixed rel_l2 bound"]
    tokens, offset = len(trace.tokens), trace.meta.position_offset or 0
    try:
        if rows >= tokens:
            return floor_of(mode, tokens, rows, estimate_noise(target.source, trace, variant, engine.device)), []
        prefix = prefix_noise(target.source, trace, variant, rows,
                              lambda count: engine.record(trace.tokens[:count], **at_positions(offset, count)),
                              engine.device)
        return floor_of(mode, tokens, rows, prefix), []
    except TracerError as exc:
        return None, [f"no noise floor ({exc}): points judged by the fixed rel_l2 bound"]


def memory_notes(num_tokens: int) -> list[str]:
    """What a long prompt changes (a streamed run's traces spill as well, as its docs say: no note on each run)."""
    notes = []
    if num_tokens > ATTENTION_ROWS:
        notes.append(f"attention scores and probs are kept and compared on their last {ATTENTION_ROWS} query rows "
                     f"(of {num_tokens}) to bound memory")
    if num_tokens > SPILL_TOKENS:
        notes.append(f"{num_tokens} tokens: the reference's trace was written to a temporary folder point by point "
                     "and the candidate compared with it from there (in-process engines as each point came), then "
                     "deleted")
    return notes


def trace_notes(*traces: Trace) -> list[str]:
    """What a side skipped or could not use, said rather than ignored."""
    notes = []
    for trace in traces:
        meta = trace.meta
        notes += [f"{trace.label}: {note}" for note in meta.notes or ()]  # what the engine itself says
        if meta.unused_config_keys:
            notes.append(f"{trace.label}: config keys not read: {', '.join(meta.unused_config_keys)}")
        if meta.unused_tensors:
            notes.append(f"{trace.label}: {len(meta.unused_tensors)} tensors in the files are not used, "
                         f"e.g. {meta.unused_tensors[0]}")
        if meta.placement:
            notes.append(f"{trace.label}: {meta.placement}")
        if trace.not_recorded:
            reasons = sorted(set(trace.not_recorded.values()))
            notes.append(f"{trace.label}: {len(trace.not_recorded)} points not recorded ({'; '.join(reasons)})")
    return notes


def config_audit(source: ModelSource, variant: dict) -> dict | None:
    """The audit of the model's config.json (with the candidate's re-save applied), for the report;
    None for a loaded model, whose config is not a file."""
    if source.loaded:
        return None
    return audit(source.config(), setting(variant, "resave"))


def detokenizer(source: ModelSource) -> Callable:
    if source.loaded:
        return lambda ids: None
    return lambda ids: detokenize(source.directory, ids)


@contextmanager
def timed(timings: dict, key: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - started
