"""The run pipeline: prepare a reference once, compare candidates against it.
(Being filled in: see `local_errors`.)"""

from __future__ import annotations

from tracer.diff import Tolerance, compare_points
from tracer.trace import Trace


def local_errors(engine, reference: Trace, recorder=None) -> dict[str, float] | None:
    """Per point, the rel_l2 the engine introduces there given the reference's inputs; None for
    engines that cannot rerun a block on foreign inputs (their registry entry says)."""
    if not engine.entry.local_errors:
        return None
    forced = engine.local_trace(reference, recorder)
    return {p.point: p.rel_l2 for p in compare_points(reference, forced, Tolerance()) if p.recorded}
