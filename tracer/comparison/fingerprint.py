"""Error fingerprints: how closely one comparison's errors resemble another's.

A fingerprint is the per-point relative L2 error on a log scale, plus the per-position profile
at the first divergence. `tracer.diagnose` ranks the variant catalogue by the resemblance of
each variant's fingerprint to an observed trace's: "your port behaves like theta=10000".
"""

from __future__ import annotations

import math

from tracer.comparison.result import Result

FLOOR = 1e-12  # rel_l2 below this counts as exact on the log scale


def fingerprint(result: Result) -> dict[str, float]:
    """point -> log10(rel_l2), for every point both sides recorded."""
    return {p.point: math.log10(max(p.rel_l2, FLOOR)) for p in result.points
            if p.recorded and p.rel_l2 is not None and math.isfinite(p.rel_l2)}


def position_profile(result: Result) -> list[float] | None:
    """The first divergence's per-position error, log-scaled and normalized (None without one)."""
    first = result.first_divergence
    if not first or not first.by_position:
        return None
    values = [math.log10(max(v, FLOOR)) - math.log10(FLOOR) for v in first.by_position]
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values] if norm else None


def resemblance(observed: Result, variant: Result) -> float:
    """1 for the same fingerprint, towards 0 as the per-point errors part (in decades)."""
    seen, tried = fingerprint(observed), fingerprint(variant)
    common = [p for p in seen if p in tried]
    if not common:
        return 0.0
    distance = sum(abs(seen[p] - tried[p]) for p in common) / len(common)
    seen_first, tried_first = observed.first_divergence, variant.first_divergence
    same_start = (seen_first and seen_first.point) == (tried_first and tried_first.point)
    shape = 0.5
    if same_start and seen_first:
        a, b = position_profile(observed), position_profile(variant)
        shape = sum(x * y for x, y in zip(a, b)) if a and b and len(a) == len(b) else 0.5
    return (0.5 + 0.5 * shape) / (1.0 + distance)
