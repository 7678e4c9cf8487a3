"""Several candidates on one reference: who agrees with whom, and which side is the odd one.

A reference can be wrong too. Each candidate has been compared with the reference (its `Result`); here the
candidates are compared with each other, pair by pair, at the points that tell the story: each candidate's
first divergence from the reference, and the logits. Every pair at a point is judged by the bound the
candidates were held to there against the reference (`Tolerance.threshold` of the reference's f64 noise at
that point, or the fixed bound, or atol/rtol), and only where both sides of the pair recorded the point (a
runtime that records fewer points, or candle's last-position logits, is compared on what both hold).

The odd one, at a point that at least three sides recorded: the one side that disagrees with every other
side, while every other pair agrees. When that side is the reference, the reference may be the wrong one
(transformers #40609 lost a transpose in Llama 4's router scores); when it is a candidate, that candidate.
Anything else (two camps, everyone apart, a pair not compared) names no odd one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations

from tracer.comparison.diff import compare_at, output_logits, trace_family
from tracer.comparison.result import AgreementRow, PairAgreement, PointDiff, Result, Tolerance, Triangulation
from tracer.model.points import rank
from tracer.traces.trace import Trace


def triangulation(reference: Trace, candidates: Sequence[tuple[Result, Trace]], tolerance: Tolerance,
                  noise: dict[str, float] | None = None) -> Triangulation:
    """The candidates' results (each `compare`d with `reference`, with `noise`) and their traces, gathered into
    a `Triangulation`: the agreement table at each candidate's first divergence and at the logits, and the
    first row's odd one."""
    results = tuple(result for result, _ in candidates)
    names = side_names(results)
    traces = (reference, *(trace for _, trace in candidates))
    family = trace_family(*traces)
    firsts = {name: result.first_divergence.point for name, result in zip(names[1:], results)
              if result.first_divergence is not None}
    logits = output_logits(reference, reference)
    shown = sorted({*firsts.values(), *([logits] if logits in reference else [])},
                   key=lambda point: rank(point, family))
    between = {(i, j): compare_at(shown, traces[i], traces[j], tolerance, noise)
               for i, j in combinations(range(1, len(traces)), 2)}
    rows = []
    for point in shown:
        against = {(0, i): next(p for p in result.points if p.point == point) for i, result in enumerate(results, 1)}
        diffs = {**against, **{pair: diffs[point] for pair, diffs in between.items()}}
        rows.append(agreement_row(point, names, traces, diffs, tolerance, noise,
                                  tuple(name for name, first in firsts.items() if first == point)))
    odd = next(({"side": row.odd_one, "role": "reference" if row.odd_one == names[0] else "candidate",
                 "point": row.point} for row in rows if row.odd_one is not None), None)
    return Triangulation(results, names, tuple(rows), odd)


def side_names(results: Sequence[Result]) -> tuple[str, ...]:
    """How the table names each side: its label (`hf[theta=10000]`), a candidate whose label an earlier side
    has (two llama.cpp files, hf against hf) with its place among the candidates added."""
    names = [results[0].reference["label"]]
    for number, result in enumerate(results, 1):
        label = result.candidate["label"]
        names.append(label if label not in names else f"{label} (candidate {number})")
    return tuple(names)


def agreement_row(point: str, names: Sequence[str], traces: Sequence[Trace], diffs: dict[tuple[int, int], PointDiff],
                  tolerance: Tolerance, noise: dict[str, float] | None, first_of: tuple[str, ...]) -> AgreementRow:
    """One point's row: every pair of sides (`diffs`, by the sides' places in `names`) within the point's bound
    or not, and its odd one."""
    pairs = tuple(pair_agreement(names[i], names[j], diffs[i, j]) for i, j in sorted(diffs))
    recorded = tuple(name for name, trace in zip(names, traces) if point in trace)
    known = (noise or {}).get(point)
    floor = "allclose" if tolerance.elementwise else "noise" if known is not None and math.isfinite(known) \
        else "fixed"
    return AgreementRow(point, diffs[0, 1].layer, first_of, recorded,
                        None if tolerance.elementwise else tolerance.threshold(known), floor,
                        known if floor == "noise" else None, pairs, odd_one(recorded, pairs))


def pair_agreement(first: str, second: str, diff: PointDiff) -> PairAgreement:
    """A pair as its row holds it: not compared where a side did not record the point (which one: the row's
    `sides`), with the engine's reason."""
    if not diff.recorded:
        why = diff.reason or ("not compared" if diff.missing_on == "neither" else "not recorded")
        return PairAgreement((first, second), None, None, why)
    return PairAgreement((first, second), diff.rel_l2, not diff.diverged)


def odd_one(recorded: Sequence[str], pairs: Sequence[PairAgreement]) -> str | None:
    """The one side of `recorded` (three or more) that disagrees with every other while every other pair
    agrees; None otherwise (a pair not compared counts as neither)."""
    if len(recorded) < 3:
        return None
    agree = {frozenset(pair.sides): pair.agree for pair in pairs}
    for side in recorded:
        others = [other for other in recorded if other != side]
        if all(agree.get(frozenset((side, other))) is False for other in others) and \
                all(agree.get(frozenset(pair)) is True for pair in combinations(others, 2)):
            return side
    return None
