"""Error fingerprints: how closely one comparison's errors resemble another's.

A fingerprint is the per-point relative L2 error on a log scale, plus the per-position profile
at the first divergence. `tracer.diagnose` ranks the variant catalogue by the resemblance of
each variant's fingerprint to an observed trace's: "your port behaves like theta=10000".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Signature:
    """What `resemblance` reads of one comparison: its fingerprint, the point it first diverges at and that
    divergence's position profile. Small, and plain JSON (`to_dict`), so a diagnosis's catalogue keeps its
    rows' signatures, not their comparisons (in memory and in the reference cache)."""

    errors: dict[str, float]
    first: str | None
    profile: list[float] | None

    @classmethod
    def of(cls, result: Result) -> Signature:
        first = result.first_divergence
        return cls(fingerprint(result), first.point if first else None, position_profile(result))

    def to_dict(self) -> dict:
        return {"errors": self.errors, "first": self.first, "profile": self.profile}

    @classmethod
    def from_dict(cls, data: dict) -> Signature:
        return cls(dict(data["errors"]), data["first"], data["profile"])


def resemblance(observed: Result | Signature, variant: Result | Signature) -> float:
    """1 for the same fingerprint, towards 0 as the per-point errors part (in decades)."""
    seen, tried = (Signature.of(side) if isinstance(side, Result) else side for side in (observed, variant))
    common = [p for p in seen.errors if p in tried.errors]
    if not common:
        return 0.0
    distance = sum(abs(seen.errors[p] - tried.errors[p]) for p in common) / len(common)
    shape = 0.5
    if seen.first is not None and seen.first == tried.first:
        a, b = seen.profile, tried.profile
        shape = sum(x * y for x, y in zip(a, b)) if a and b and len(a) == len(b) else 0.5
    return (0.5 + 0.5 * shape) / (1.0 + distance)
