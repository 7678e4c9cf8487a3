"""A batched run's rows compared (`--batch B`, docs/batch.md).

Each row is a trace of the row's real positions (`tracer.engines.batch.RowRecorders`: the padding cut
off), compared with the reference's batch-1 run of the same prompt: the truth. The floor of a row comes
from the reference too: its batched row against its batch-1 run differ by the rounding of other matmul
shapes only (`row_floors`); a point's floor is the larger of that and the prompt's f64 noise. The walk
names the first row whose comparison diverges, and that row's comparison becomes the one a result
shows (`with_rows`), with hints that read the padding.
"""

from __future__ import annotations

import dataclasses

from tracer.comparison.diff import compare, rel_l2_by_point
from tracer.comparison.result import BatchRow, Divergence, Result, Tolerance
from tracer.model.points import CONTEXT, K_ROPE, PROBS, Q_ROPE, SCORES, layer_of, split_point
from tracer.traces.trace import Trace


def batch_gaps(alone: list[Trace], batched: list[Trace]) -> list[dict[str, float]]:
    """Per row, per point: the rel_l2 between the reference's batched row and its batch-1 run of the prompt
    (`alone`): what the batch shape alone changes in the reference's rounding."""
    return [rel_l2_by_point(one, row) for one, row in zip(alone, batched)]


def row_floors(gaps: list[dict[str, float]], noise: list[dict[str, float] | None]) -> list[dict[str, float]]:
    """Per row, per point: the larger of the reference's batched-vs-batch-1 rel_l2 (`batch_gaps`) and the
    prompt's f64 noise of the point (`noise[row]`, None: none measured)."""
    return [{point: max(gap, (measured or {}).get(point) or 0.0) for point, gap in row.items()}
            for row, measured in zip(gaps, noise)]


def compare_rows(alone: list[Trace], candidate: list[Trace], padding: tuple[int, ...], tolerance: Tolerance,
                 floors: list[dict[str, float]] | None = None,
                 gaps: list[dict[str, float]] | None = None) -> list[tuple[BatchRow, Result]]:
    """Every row of the candidate's batch against the reference's batch-1 run of its prompt, against its
    floor (`row_floors`; None: the fixed bound); `gaps`: the reference's own batched-vs-batch-1 rel_l2
    per row and point (`batch_gaps`), summarized as each row's `batch_floor`."""
    compared = []
    for row, (one, cand) in enumerate(zip(alone, candidate)):
        result = compare(one, cand, tolerance, noise=floors[row] if floors else None)
        first = result.first_divergence
        if first is not None:
            hints = row_hints(row, padding, first, result.first_nonfinite)
            first = dataclasses.replace(first, hints=(*hints, *first.hints))
            result = dataclasses.replace(result, first_divergence=first)
        gap = max(gaps[row].values(), default=0.0) if gaps else None
        compared.append((row_summary(row, one, padding[row], result, gap), result))
    return compared


def row_summary(row: int, reference: Trace, padding: int, result: Result, batch_floor: float | None) -> BatchRow:
    """What the JSON keeps of one row's comparison."""
    worst: dict[int | None, float] = {}
    for p in result.points:
        if p.recorded and p.rel_l2 is not None:
            worst[p.layer] = max(worst.get(p.layer, 0.0), p.rel_l2)
    layers = max((layer for layer in worst if layer is not None), default=-1) + 1
    return BatchRow(row=row, tokens=tuple(reference.tokens or ()), padding=padding, verdict=result.verdict,
                    first_divergence=result.first_divergence, points=sum(p.recorded for p in result.points),
                    batch_floor=batch_floor, layer_max_rel_l2=tuple(worst.get(layer) for layer in range(layers)))


def row_hints(row: int, padding: tuple[int, ...], first: Divergence, nonfinite: dict | None = None) -> list[str]:
    """What a divergence that appears only in a batch suggests, by the row's padding, the point it starts at
    and where NaN first shows (`nonfinite`: the result's `first_nonfinite`)."""
    sub, pad = split_point(first.point)[1], padding[row]
    if pad and nonfinite and nonfinite["side"] == "candidate" and nonfinite["point"] == first.point \
            and split_point(first.point)[1] == CONTEXT:
        return [f"row {row} ({pad} padded positions) turns NaN at {first.point} from its padding: a padded query "
                "masked from every key with -inf (a where/masked_fill mask) gets NaN probabilities, its output "
                "carries NaN into the next layer's keys and values, and probs 0 × NaN reach the real tokens; "
                "mask with the dtype's minimum, as transformers does, or keep padded queries finite"]
    if not pad:
        return [f"row {row} has no padding and still leaves the floor: its output depends on the batch shape "
                "itself (another kernel or reduction order for a batch of rows), beyond the reference's own "
                "batched-vs-batch-1 rounding"]
    if layer_of(first.point) != 0:
        return []
    if sub in (Q_ROPE, K_ROPE):
        return [f"row {row} ({pad} padded positions) diverges at RoPE of layer 0: its positions do not start at 0 at "
                "its first real token (position_ids counted from the padded sequence's start instead of from the "
                "attention mask, as transformers' generate does: attention_mask.cumsum(-1) - 1)"]
    if sub in (SCORES, PROBS, CONTEXT):
        return [f"row {row} ({pad} padded positions) diverges at layer 0's attention: its real tokens attend to "
                "its padding (the attention mask dropped, or built without the padding: causal only)"]
    return []


def with_rows(result: Result, compared: list[tuple[BatchRow, Result]]) -> Result:
    """`result` (the first row's prompt run alone, with its context) with the batch's rows attached; when it
    matches and a row diverges, that row's comparison is the one shown (points, first divergence, logits)."""
    rows = tuple(summary for summary, _ in compared)
    first = next(((summary, shown) for summary, shown in compared if shown.verdict != "match"), None)
    if result.verdict != "match" or first is None:
        return dataclasses.replace(result, batch=rows)
    summary, shown = first
    return result.showing(shown, batch=rows, row=summary.row)


def batch_line(result: Result) -> str | None:
    """One line on the rows, for the notes: "batch of 4: rows 0, 2 match; row 1 (3 padded positions) diverged
    first at model.layers.0.self_attn.probs" (that row's prompt and tokens then head the result)."""
    if not result.batch:
        return None
    matched = [str(row.row) for row in result.batch if row.verdict == "match"]
    line = f"batch of {len(result.batch)}: " + (
        "no row matches" if not matched else f"row {matched[0]} matches" if len(matched) == 1
        else f"rows {', '.join(matched)} match")
    if result.row is not None:
        shown = result.batch[result.row]
        where = shown.first_divergence.point if shown.first_divergence else "the logits"
        line += f"; row {shown.row} ({shown.padding} padded positions) {shown.verdict} first at {where}"
    return line
