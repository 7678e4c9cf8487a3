"""`--batch B`: both sides run the batch's rows left-padded with an attention mask, one forward each, and
every row is compared at its real positions (docs/batch.md).

The truth of a row is the reference's batch-1 run of its prompt; its floor comes from the reference too:
its batched row against that batch-1 run differ by the rounding of other matmul shapes only
(`tracer.comparison.batch.row_floors`), the larger of that and the prompt's f64 noise per point. Padded
positions are computed by both sides but compared nowhere: they are no prompt's.
"""

from __future__ import annotations

import dataclasses

from tracer.comparison.batch import batch_gaps, batch_line, compare_rows, row_floors, with_rows
from tracer.comparison.result import Result
from tracer.core.errors import TracerError
from tracer.core.progress import stage
from tracer.engines.base import Engine
from tracer.pipeline.noise_floor import floor_rows
from tracer.pipeline.request import Inputs, Side
from tracer.pipeline.run import check_tokens, reference_noise, timed, token_ids
from tracer.traces.spill import SPILL_TOKENS
from tracer.traces.trace import Trace


def batch_rows(prepared, inputs: Inputs) -> list[list[int]]:
    """The token ids of every row: the prepared prompt's for the rows that repeat it, the others tokenized
    (and truncated) as the prepared prompt was."""
    rows = []
    for given in inputs.rows:
        if given in (inputs.prompt, inputs.tokens):
            ids = list(prepared.ids)
        else:
            text, tokens = (given, None) if isinstance(given, str) else (None, given)
            ids, _ = token_ids(prepared.source, text, tokens, chat=inputs.chat, system=inputs.system)
            ids = ids[:inputs.max_tokens] if inputs.max_tokens else ids
        if len(ids) > SPILL_TOKENS:
            raise TracerError(f"--batch: a row of {len(ids)} tokens; a batch's rows are kept in memory, up to "
                              f"{SPILL_TOKENS} tokens each")
        rows.append(ids)
    return rows


def reference_alone(prepared, reference: Side, rows: list[list[int]]) -> tuple[list[Trace], list[dict | None]]:
    """The reference's batch-1 run of each row's prompt and its f64 noise (None without a noise floor), each
    distinct prompt run once (the prepared one is already)."""
    runs = {tuple(prepared.ids): (prepared.trace, prepared.noise)}
    for ids in rows:
        if tuple(ids) not in runs:
            trace = prepared.engine.record(ids)
            mode = prepared.request.noise_floor
            floor = None if prepared.noise is None else reference_noise(
                prepared.target, reference, prepared.engine, trace, mode, floor_rows(len(ids), mode))[0]
            noise = None if floor is None else floor.noise  # a cheap floor's scaled values: never below it
            runs[tuple(ids)] = (trace, noise)
    return [runs[tuple(ids)][0] for ids in rows], [runs[tuple(ids)][1] for ids in rows]


def compare_batched(result: Result, prepared, engine: Engine) -> Result:
    """`result` (the first row's prompt run alone) with every row of both sides' batched forwards compared
    and attached (`tracer.comparison.batch.with_rows`): the rows of the run's request (`prepared.request`)."""
    inputs, reference = prepared.request.inputs, prepared.request.reference
    stage("batch")
    timings = dict(result.timings)
    rows = batch_rows(prepared, inputs)
    for ids in rows:
        check_tokens(ids, prepared.engine)
        check_tokens(ids, engine)
    with timed(timings, "batch_alone_s"):  # the other prompts' batch-1 runs and f64 noise
        alone, noise = reference_alone(prepared, reference, rows)
    with timed(timings, "batch_reference_s"):
        gaps = batch_gaps(alone, prepared.engine.record_batch(rows))
    floors = row_floors(gaps, noise) if prepared.noise is not None else None
    with timed(timings, "batch_candidate_s"):
        candidate = engine.record_batch(rows)
    width = max(len(ids) for ids in rows)
    padding = tuple(width - len(ids) for ids in rows)
    with timed(timings, "batch_compare_s"):
        compared = compare_rows(alone, candidate, padding, prepared.tolerance, floors, gaps)
    worst = max(((gap, point, row) for row, by_point in enumerate(gaps) for point, gap in by_point.items()),
                default=None)
    floor = (f"each row's floor: the reference's batched row against its batch-1 run (at most {worst[0]:.2g} rel_l2, "
             f"{worst[1]}, row {worst[2]}), or the prompt's f64 noise where larger") if floors and worst \
        else "the rows judged by the fixed rel_l2 bound"
    note = (f"batch: {len(rows)} rows left-padded to {width} tokens (padding {', '.join(map(str, padding))}), one "
            "forward per side with an attention mask; each row compared at its real positions with the reference's "
            f"batch-1 run of its prompt (padded positions are not compared); {floor}")
    batched = with_rows(result.with_context(notes=(note,), timings=timings), compared)
    if batched.row is not None:  # the shown comparison is that row's: its prompt and tokens head the report
        ids, given = rows[batched.row], inputs.rows[batched.row]
        batched = dataclasses.replace(batched, prompt=given if isinstance(given, str) else None, tokens=list(ids),
                                      token_texts=[prepared.detokenize([t]) for t in ids] if result.token_texts
                                      else None)
    return batched.with_context(notes=(batch_line(batched),))
