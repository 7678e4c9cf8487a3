"""Each command, composed of the pipeline's stages from one `Request` (`tracer.pipeline.request`).

The CLI builds the request from its flags, the API (`tracer.api`) from its arguments: checked when built,
before torch loads. Each composition checks what is its own to check (a quality's chunks, a diagnosis's
trace, ...), then resolves the request once (`Request.resolved`: the model source, the device, the
placement, checked against every engine it names) and hands its `target` to every engine it loads;
nothing resolves or checks it again.

- `run`: the reference prepared, one candidate compared, then its decode steps, its batch's rows and its
  regime view where the request asks for them, and the report folder; with several candidates, `triangulate`.
- `triangulate`: the reference prepared once, every candidate compared with it, then with each other at
  the points that tell who is the odd one (`tracer.comparison.triangulation`).
- `sweep`: the reference prepared once, every variant of the candidate compared with it (`sweep_row`).
- `diagnose`: an observed trace against the reference, and the variant catalogue ranked by resemblance.
- `record`: one engine's trace.
- `quality`: a text's chunks through both engines, llama-perplexity's figures (`tracer.pipeline.corpus`).
- `compare_files`: two saved traces, no model.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from pathlib import Path
from typing import Callable

from tracer.comparison.fingerprint import Signature, resemblance
from tracer.comparison.perplexity import Statistics, chunk_tokens, fitting_ctx, mean_and_uncertainty
from tracer.comparison.result import Diagnosis, Result, Sweep, SweepRow, Tolerance, Triangulation
from tracer.comparison.steps import compare_steps, with_steps
from tracer.comparison.triangulation import triangulation
from tracer.core.errors import TracerError
from tracer.core.progress import progress_stages, stage
from tracer.engines.base import Engine, at_positions, environment
from tracer.engines.file import FileEngine
from tracer.engines.load import load_engine
from tracer.engines.registry import EngineRef
from tracer.files.sources import ModelSource
from tracer.model.config import read_hf
from tracer.model.knobs import variant_text
from tracer.model.points import is_coarse
from tracer.names.aliases import alias_table
from tracer.pipeline import reference_cache
from tracer.pipeline.attribution import Attributor, emulation
from tracer.pipeline.batch import compare_batched
from tracer.pipeline.catalogue import default_variants, diagnosis_variants, parse_variants
from tracer.pipeline.corpus import (
    Quality,
    check_quality,
    load_side,
    quality_notes,
    score_chunks,
    side_summary,
    text_tokens,
)
from tracer.pipeline.decode import compare_decoded, decoded_tokens, reference_decode, with_decoded
from tracer.pipeline.regime_view import check_regime_decode, compare_in_regime
from tracer.pipeline.regime_view import resolve as resolve_regime
from tracer.pipeline.request import DEFAULT_CTX, Inputs, Outputs, Placement, Request, Side
from tracer.pipeline.run import (
    Prepared,
    candidate_compared,
    candidate_engine,
    candidate_loader,
    check_tokens,
    compare_candidate,
    config_audit,
    prepared_from_trace,
    prepared_reference,
    stream_notes,
    token_ids,
)
from tracer.traces.shards import load_shards
from tracer.traces.trace import Trace, import_foreign

RUN_STAGES = ("load", "reference", "noise floor", "candidate", "greedy", "decode", "batch", "regime", "report")
TRIANGULATE_STAGES = ("load", "reference", "noise floor", "candidate", "greedy", "agreement", "report")
SWEEP_STAGES = ("load", "reference", "noise floor", "decode", "candidate", "report")
DIAGNOSE_STAGES = ("load", "reference", "noise floor", "decode", "candidate")


def run(request: Request) -> Result | Triangulation:
    """`tracer run`: trace the request's reference and candidate on the same tokens and localize the first
    divergence (`tracer.api.run` says what each part of the request does). After the reference, each stage
    reads what it does from the run's request, which the prepared reference holds. A request with several
    candidates is a triangulation (`triangulate`)."""
    if request.candidates:
        return triangulate(request)
    candidate, inputs = request.candidate, request.inputs
    with progress_stages(RUN_STAGES, request.progress):
        request = request.resolved()  # in the bar's "load" stage: a GGUF converted on first use takes seconds
        with prepared_reference(request, lockstep_with=candidate if request.regime is None else None) as prepared:
            in_regime = None
            if request.regime is not None:
                in_regime = resolve_regime(request.regime, candidate.engine, candidate.variant, prepared.source)
                # before the candidate runs: a decode the regime cannot judge is refused now
                check_regime_decode(in_regime[0], in_regime[1], len(prepared.ids), inputs.decode)
            engine = candidate_engine(prepared)
            result = compare_candidate(prepared, engine, command=request.command,
                                       notes=tuple(stream_notes(prepared.target.stream, candidate.engine)),
                                       config_audit=config_audit(prepared.source, candidate.variant))
            if inputs.decode:
                result = compare_decoded(result, prepared, engine, inputs.decode)
            if inputs.batch > 1:
                result = compare_batched(result, prepared, engine)
            if in_regime is not None:
                stage("regime")
                result = compare_in_regime(result, prepared, engine, *in_regime)
        if request.outputs.report is not None:
            from tracer.reports import write_report  # matplotlib and pandas: only a report folder needs them

            stage("report")
            write_report(result, request.outputs.report)
        return result


def triangulate(request: Request) -> Triangulation:
    """`tracer run --candidate A --candidate B ...`: the reference prepared once, each of the request's
    `candidates` compared with it as `run` compares one (its own `Result`), then the candidates with each other
    at each one's first divergence and at the logits (`tracer.comparison.triangulation`): who agrees with whom,
    and which side, the reference included, is the odd one."""
    with progress_stages(TRIANGULATE_STAGES, request.progress):
        request = request.resolved()
        with prepared_reference(request) as prepared:
            compared, loads = [], {}
            for number, side in enumerate(request.candidates, 1):
                stage("load")
                started = time.perf_counter()
                engine = load_engine(side.engine, side.variant, prepared.target)
                loads[f"candidate_{number}_load_s"] = time.perf_counter() - started
                compared.append(candidate_compared(
                    prepared, engine, command=alone(request.command, side), kept_as=f"candidate-{number}",
                    notes=tuple(stream_notes(prepared.target.stream, side.engine)),
                    config_audit=config_audit(prepared.source, side.variant)))
            stage("agreement")
            started = time.perf_counter()
            result = triangulation(prepared.trace, compared, prepared.tolerance, prepared.noise)
            timings = {**prepared.timings, **loads}
            for number, (one, _) in enumerate(compared, 1):  # each candidate's own stages, after the shared ones
                timings |= {f"candidate_{number}_{key}": value for key, value in one.timings.items()
                            if key not in prepared.timings}
            timings["agreement_s"] = time.perf_counter() - started
        notes = tuple(dict.fromkeys(note for one, _ in compared for note in one.notes))  # each said once
        result = result.with_context(environment=environment(), command=request.command, timings=timings,
                                     notes=notes)
        if request.outputs.report is not None:
            from tracer.reports import write_report  # matplotlib and pandas: only a report folder needs them

            stage("report")
            write_report(result, request.outputs.report)
        return result


def alone(command: str | None, side: Side) -> str | None:
    """A triangulation's command line as the line that repeats one of its candidates' comparisons alone: every
    --candidate given replaced by that side's (its own report's "repeat this run", its trace's `record` line)."""
    if command is None:
        return None
    words, kept = shlex.split(command), []
    while words:
        word = words.pop(0)
        if word == "--candidate" and words:
            words.pop(0)
        elif not word.startswith("--candidate="):
            kept.append(word)
    return shlex.join([*kept, "--candidate", side.text])


def sweep(request: Request) -> Sweep:
    """`tracer sweep`: the reference once, then every variant of the request's candidate against it (the
    request's `variants`, or one representative per knob); a variant that fails to load, or that the
    candidate cannot honour, is that variant's row's error."""
    reference, candidate, decode = request.reference, request.candidate, request.inputs.decode
    with progress_stages(SWEEP_STAGES, request.progress):
        request = request.resolved()
        with prepared_reference(request) as prepared:
            load_candidate = candidate_loader(candidate.engine, prepared)
            variants = request.variants
            if variants is None:
                variants = parse_variants(default_variants(model_spec(prepared.source), candidate.entry.name,
                                                           decode=bool(decode)))
            decoded = None
            if decode:  # the reference decodes once; every variant is fed its tokens
                stage("decode")
                decoded = (decode, reference_decode(prepared, decode))
            stage("candidate")
            rows = tuple(sweep_row(prepared, load_candidate, knobs, decoded=decoded) for knobs in variants)
        result = Sweep(
            rows=rows, reference={"engine": str(reference.engine), "variant": prepared.variant,
                                  "label": prepared.trace.label},
            candidate={"engine": str(candidate.engine)}, tolerance=prepared.tolerance, model=prepared.trace.meta.model,
            prompt=prepared.prompt, tokens=prepared.ids, chat=prepared.chat, greedy_steps=prepared.greedy_steps,
            reference_greedy=prepared.reference_greedy, environment=environment(), command=request.command,
            timings={**prepared.timings, "variants_s": sum(row.seconds or 0.0 for row in rows)},
            notes=prepared.notes,
        )
        if request.outputs.report is not None:
            from tracer.reports import write_sweep_report  # matplotlib and pandas: only a report folder needs them

            stage("report")
            write_sweep_report(result, request.outputs.report)
        return result


def sweep_row(prepared: Prepared, load_candidate: Callable[[dict], Engine], knobs: dict, *,
              local: bool = True, decoded: tuple[int, tuple] | None = None) -> SweepRow:
    """One variant against the prepared reference; a variant that fails to load is a row with its error.
    `local`: with local errors (the first divergence localized by them), as `tracer.run` does. `decoded`:
    (N, the reference's decode and floors) for `--decode N`: the variant decodes too and its steps are
    compared (`tracer.pipeline.decode.compare_decoded`), as `tracer run --decode N` does."""
    started = time.perf_counter()
    label = variant_text(knobs)
    try:
        engine = load_candidate(knobs)
        result = compare_candidate(prepared, engine, config_audit=None, local=local)
        if decoded is not None:
            result = compare_decoded(result, prepared, engine, *decoded)
    except TracerError as exc:
        return SweepRow(label, knobs, "error", error=str(exc), seconds=time.perf_counter() - started)
    curve = tuple({key: p.to_dict().get(key) for key in ("point", "layer", "rel_l2", "threshold", "diverged")}
                  for p in result.points if p.recorded and is_coarse(p.point))
    return SweepRow(label, knobs, result.verdict, result.first_divergence, result.logits, result.greedy,
                    curve=curve, notes=result.notes, seconds=time.perf_counter() - started, result=result,
                    step=result.step)


def model_spec(source: ModelSource):
    """What the hf reader makes of the model's config (for the variants worth trying on it)."""
    return read_hf(source.config())


# The catalogue's rows for the last model, tokens and placement diagnosed (`catalogue_rows`).
_CATALOGUE_ROWS: dict[str, list] = {}


def observed_trace_of(trace, steps: int = 0) -> Trace:
    """A diagnosis's observed candidate (a `Trace` or a file), read and checked before its model resolves: it
    carries the token ids to rerun and at least the `steps` decode steps to compare."""
    observed = load_trace(trace)
    if not observed.tokens:
        raise TracerError("the trace carries no token ids; diagnose needs them to rerun the same input")
    if steps and len(observed.steps) < steps:
        raise TracerError(f"--decode {steps}: the trace holds {len(observed.steps)} decode steps (record it "
                          f"with --decode {steps} or more)")
    return observed


def diagnose(request: Request, trace) -> Diagnosis:
    """`tracer diagnose`: the observed candidate (`trace`, read and checked first: `observed_trace_of`) against
    the request's reference on the trace's tokens, then every variant of the catalogue (the request's
    `variants`, or `tracer.pipeline.catalogue.diagnosis_variants`) on the reimplementation, ranked by
    resemblance. `request.inputs` names the model and the decode steps to compare."""
    steps = request.inputs.decode
    observed_trace = observed_trace_of(trace, steps)
    with progress_stages(DIAGNOSE_STAGES, request.progress):
        request = request.resolved()
        # the trace's tokens replayed on the target just resolved
        replay = Request(Inputs(request.target.source, tokens=observed_trace.tokens), request.placement,
                         request.reference, greedy=0, progress=request.progress, target=request.target,
                         notes=request.notes, resolve_s=request.resolve_s)
        with prepared_reference(replay) as prepared:
            observed = compare_candidate(prepared, FileEngine(observed_trace))
            decoded = None
            forced = None
            if steps:  # the reference and every variant fed the observed trace's tokens
                stage("decode")
                started = time.perf_counter()
                observed_steps = dataclasses.replace(observed_trace, steps=observed_trace.steps[:steps])
                forced = decoded_tokens(observed_steps)
                decoded = (steps, reference_decode(prepared, steps, forced=forced))
                observed = with_decoded(observed, prepared, *decoded[1], observed_steps, started,
                                        fed="the reference fed the trace's tokens")
            tried = request.variants
            if tried is None:
                tried = parse_variants(diagnosis_variants(model_spec(prepared.source), decode=bool(steps)))
            stage("candidate")
            rows = catalogue_rows(prepared, request.placement, tried, decoded, forced)
    ranking = sorted((
        {"variant": row["variant"],
         "score": 0.0 if row["signature"] is None else resemblance(observed, Signature.from_dict(row["signature"])),
         "verdict": row["verdict"], "first_divergence": row["first_divergence"], "error": row["error"]}
        for row in rows), key=lambda entry: entry["score"], reverse=True)
    return Diagnosis(observed, tuple(ranking))


def catalogue_rows(prepared: Prepared, placement: Placement, tried, decoded, forced) -> list[dict]:
    """Each variant tried against the prepared reference, as the ranking reads it: its verdict, first
    divergence, error and `Signature`. Run once per model (its files as they are on disk), tokens,
    reference, placement, catalogue and decode steps, then read from this process's memory or from the
    reference cache (`tracer.pipeline.reference_cache`): diagnosing several dumps of one prompt (a
    notebook, a porting CI job, a port after each fix) runs the catalogue once. A loaded model's
    catalogue runs every time."""
    key = prepared.cache_key(placement, measure="catalogue", tolerance=repr(prepared.tolerance),
                             noise_floor=prepared.floor.mode if prepared.floor else None,
                             variants=[variant_text(knobs) for knobs in tried], forced=forced)
    memo = json.dumps(key, sort_keys=True, default=str)
    rows = None
    if key is not None:
        rows = _CATALOGUE_ROWS.get(memo) or (reference_cache.load(key) or {}).get("rows")
    if rows is None:
        load_candidate = candidate_loader(EngineRef.named("reimpl"), prepared)
        # Without local errors: the observed trace has none (a file cannot rerun a block), so
        # both sides' first divergences are where the total error leaves the floor.
        rows = []
        for knobs in tried:
            row = sweep_row(prepared, load_candidate, knobs, local=False, decoded=decoded)
            rows.append({"variant": row.variant, "verdict": row.verdict, "error": row.error,
                         "first_divergence": row.first_divergence.point if row.first_divergence else None,
                         "signature": None if row.result is None else Signature.of(row.result).to_dict()})
        if key is not None:
            reference_cache.store((key, {"rows": rows}))
    if key is not None:
        _CATALOGUE_ROWS.clear()  # the last catalogue only
        _CATALOGUE_ROWS[memo] = rows
    return rows


def record(request: Request) -> Trace | list[Trace]:
    """`tracer record`: the request's one engine (its reference side) recorded on its inputs, with its decode
    steps, or as a batch of rows (one trace per row, each at its real positions)."""
    inputs, side = request.inputs, request.reference
    if request.placement.stream and not side.entry.stream:
        raise TracerError(f"--stream: only hf and reimpl read weights block by block, not {side.engine}")
    with progress_stages(("load", "record"), request.progress):
        request = request.resolved()
        target, inputs = request.target, request.inputs  # resolved: a model without a tokenizer gets default ids
        runner = load_engine(side.engine, side.variant, target)
        ids, chat_info = token_ids(target.source, inputs.text, inputs.tokens, chat=inputs.chat, system=inputs.system)
        check_tokens(ids, runner, inputs.position_offset)
        stage("record")
        if inputs.batch > 1:
            rows = [list(token_ids(target.source, *((row, None) if isinstance(row, str) else (None, row)),
                                   chat=inputs.chat, system=inputs.system)[0]) for row in inputs.rows]
            for row in rows:
                check_tokens(row, runner)
            traces = runner.record_batch(rows)
            return [dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, prompt=text, chat=None))
                    if isinstance(text, str) else trace for trace, text in zip(traces, inputs.rows)]
        if inputs.decode:
            trace = runner.decode(ids, inputs.decode, offset=inputs.position_offset)
        else:
            trace = runner.record(ids, **at_positions(inputs.position_offset, len(ids)))
        if inputs.text is not None:
            trace.meta = dataclasses.replace(trace.meta, prompt=inputs.text)
        if chat_info:
            trace.meta = dataclasses.replace(trace.meta, chat=chat_info)
        return trace


def quality(request: Request, *, ctx: int | None, chunks: int | None = None, by_layer: bool = False,
            text_name: str | None = None) -> Quality:
    """`tracer quality`: the request's text (`inputs.prompt`, or its token ids) cut into llama-perplexity's
    chunks of `ctx` tokens (None: `DEFAULT_CTX`, or less where the text is short: said in the notes; at most
    `chunks`), each through both engines, scored as llama-perplexity scores
    it; `by_layer`: also where the loss is made (`tracer.pipeline.attribution`). What quality cannot do is
    refused before the model resolves (`tracer.pipeline.corpus.check_quality`)."""
    check_quality(request, ctx, chunks)
    with progress_stages(("load", "chunks"), request.progress):
        request = request.resolved()
        reference, candidate, inputs, target = request.reference, request.candidate, request.inputs, request.target
        started = time.perf_counter() - request.resolve_s  # the load time counts resolving the model too

        ids, bos = text_tokens(target.source, inputs)
        given, ctx = ctx, fitting_ctx(len(ids), DEFAULT_CTX) if ctx is None else ctx
        windows = chunk_tokens(ids, ctx, bos, chunks)
        engines = {role: load_side(side, role, target, windows, ctx)
                   for role, side in (("reference", reference), ("candidate", candidate))}
        attributor = None
        if by_layer:
            source = target.source
            attributor = Attributor(source, emulation(reference.engine, reference.variant, source, role="reference"),
                                    emulation(candidate.engine, candidate.variant, source, role="candidate"),
                                    target.device)
        layers_s = attributor.seconds if attributor else 0.0
        timings = {"load_s": time.perf_counter() - started - layers_s}
        stage("chunks")
        started = time.perf_counter()
        figures, exact, lines = score_chunks(engines, ids, windows, ctx, attributor)
        statistics = Statistics.of(figures)
        exact_mean = mean_and_uncertainty(exact.sum(), (exact * exact).sum(), len(exact))
        layers = None
        if attributor is not None:
            layers = attributor.result(exact_mean.value)
            timings["layers_s"] = attributor.seconds
        timings["chunks_s"] = time.perf_counter() - started - (attributor.seconds - layers_s if attributor else 0.0)
        return Quality(
            reference=side_summary(reference), candidate=side_summary(candidate),
            model=target.source.name, text=text_name, tokens=len(ids), bos=bos, ctx=ctx, chunks=len(windows),
            statistics=statistics, exact_kld=exact_mean, lines=tuple(lines), layers=layers, timings=timings,
            notes=(*([f"-c {ctx}: the text's {len(ids)} tokens fill no two chunks of {DEFAULT_CTX}, the default "
                        "(pass -c to choose)"] if given is None and ctx != DEFAULT_CTX else []),
                   *quality_notes(len(ids), ctx, len(windows), statistics.count, bos, inputs)),
            command=request.command, environment=environment())


def compare_files(reference, candidate, *, tolerance: Tolerance = Tolerance(), aliases=None,
                  outputs: Outputs = Outputs(), command: str | None = None, shard_layout=None) -> Result:
    """`tracer compare`: two saved traces (`tracer.api.compare_files` says what each may be), compared with
    no model; decoded traces step by step too."""
    table = alias_table(aliases)  # a bad mapping file is an error even when both traces are tracer's own
    ref_trace, cand_trace = (load_trace(side, table, shard_layout if is_sharded(side) else None)
                             for side in (reference, candidate))
    if shard_layout is not None and not (is_sharded(reference) or is_sharded(candidate)):
        raise TracerError("a shard layout was given, but neither side is a set of tensor-parallel shards")
    prepared = prepared_from_trace(ref_trace, tolerance, cand_trace.tokens)
    result = compare_candidate(prepared, FileEngine(cand_trace), command=command)
    if ref_trace.steps or cand_trace.steps:  # decoded traces (`record --decode N`): every step, by the fixed bound
        result = with_steps(result, compare_steps(ref_trace, cand_trace, prepared.tolerance))
    if result.prompt is None and cand_trace.meta.prompt:
        result = result.with_context(prompt=cand_trace.meta.prompt)
    if outputs.report is not None:
        from tracer.reports import write_report  # matplotlib and pandas: only a report folder needs them

        write_report(result, outputs.report)
    return result


def is_sharded(trace_or_path) -> bool:
    """Several files, one per rank, or a directory (SGLang's dumper): a tensor-parallel run's shards."""
    if isinstance(trace_or_path, (list, tuple)):
        return len(trace_or_path) > 1 or (len(trace_or_path) == 1 and Path(trace_or_path[0]).is_dir())
    return isinstance(trace_or_path, (str, Path)) and Path(trace_or_path).is_dir()


def load_trace(trace_or_path, aliases=None, shard_layout=None) -> Trace:
    """A Trace as it is; a file read with `Trace.load`, or a dict name -> tensor, with foreign
    names mapped through the aliases; a list of files (one per rank) or an SGLang dumper directory
    merged by `shard_layout` and the dumps' declarations (`tracer.traces.shards`)."""
    if isinstance(trace_or_path, Trace):
        return trace_or_path
    if isinstance(trace_or_path, dict):
        return import_foreign(trace_or_path, {}, Path("<dict>"), aliases)
    paths = list(trace_or_path) if isinstance(trace_or_path, (list, tuple)) else [trace_or_path]
    if not paths:
        raise TracerError("no trace file given")
    if len(paths) > 1 or Path(paths[0]).is_dir():
        return load_shards(paths, aliases, shard_layout)
    if shard_layout is not None:
        raise TracerError(f"a shard layout was given, but {paths[0]} is one trace, not shards of one")
    return Trace.load(paths[0], aliases)
