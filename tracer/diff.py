"""The diff engine: pure functions from two traces to a `Result`.

Metrics are computed in f64 on the candidate minus the reference. The default criterion is scale
aware: a point diverges when its relative L2 error exceeds `DEFAULT_REL_L2`. Absolute tolerances
mean nothing on SmolLM2's hidden states, which reach |x| ~ 22,500 from layer 12 on, while the
noise of reordered f32 sums stays below 1e-5 relative everywhere (eager vs sdpa: at most 2e-6).
`--atol/--rtol` replace it with `|c - r| <= atol + rtol * |r|` elementwise (torch.allclose).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tracer.errors import TracerError
from tracer.points import LOGITS, is_causal, layer_of
from tracer.trace import Trace

DEFAULT_REL_L2 = 1e-4


@dataclass(frozen=True)
class Tolerance:
    """When a point counts as diverged. Either a relative-L2 bound or elementwise atol/rtol."""

    rel_l2: float = DEFAULT_REL_L2
    atol: float | None = None
    rtol: float | None = None

    @property
    def elementwise(self) -> bool:
        return self.atol is not None or self.rtol is not None

    def exceeded(self, diff: torch.Tensor, ref: torch.Tensor, rel_l2: float) -> bool:
        if self.elementwise:
            bound = (self.atol or 0.0) + (self.rtol or 0.0) * ref.abs()
            return bool((diff.abs() > bound).any()) or not math.isfinite(rel_l2)
        return not rel_l2 <= self.rel_l2  # NaN diverges

    def to_dict(self) -> dict:
        if self.elementwise:
            atol, rtol = self.atol or 0.0, self.rtol or 0.0
            return {"criterion": "allclose", "atol": atol, "rtol": rtol,
                    "text": f"|diff| > {atol:.0e} + {rtol:.0e}·|ref| anywhere"}
        return {"criterion": "rel_l2", "rel_l2": self.rel_l2, "text": f"rel_l2 > {self.rel_l2:.0e}"}


@dataclass(frozen=True)
class PointDiff:
    """One point's comparison. `bool(point_diff)` is True when it is within tolerance."""

    point: str
    layer: int | None
    shape: tuple[int, ...] | None
    missing_on: str | None = None  # "reference", "candidate" or "both" when not recorded
    max_abs: float | None = None
    max_ref: float | None = None
    rel_l2: float | None = None
    cosine: float | None = None
    diverged: bool = False
    reason: str | None = None  # why a side did not record it

    @property
    def recorded(self) -> bool:
        return self.missing_on is None

    def __bool__(self) -> bool:
        return not self.diverged

    def to_dict(self) -> dict:
        return {
            "point": self.point, "layer": self.layer, "shape": list(self.shape) if self.shape else None,
            "recorded": self.recorded, "missing_on": self.missing_on, "max_abs": _num(self.max_abs),
            "max_ref": _num(self.max_ref), "rel_l2": _num(self.rel_l2), "cosine": _num(self.cosine),
            "diverged": self.diverged, **({"reason": self.reason} if self.reason else {}),
        }


def _num(value: float | None):
    """JSON has no NaN or Infinity; say them as strings rather than lie with a number."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


def _json_safe(value):
    """`_num` through a whole JSON tree (logits figures, breakdowns): NaN and Inf as strings."""
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def compared_entries(point: str, tensor: torch.Tensor) -> torch.Tensor:
    """The entries metrics look at: causal points keep only what a query may attend to (masked
    scores are -inf or dtype-min by design, not a finding)."""
    if not is_causal(point):
        return tensor
    allowed = torch.ones(tensor.shape[-2:], dtype=torch.bool).tril()  # (T, T) entries a query may attend to
    return tensor[..., allowed]


def first_nonfinite(points: list[str], reference: Trace, candidate: Trace) -> dict | None:
    """The first point (in `points` order) where either side holds NaN or Inf, and which side.

    An f16 overflow is a finding about the candidate, not a crash: the metrics there are NaN or
    Inf (said as strings in JSON) and the point counts as diverged.
    """
    for point in points:
        counts = {}
        for name, trace in (("reference", reference), ("candidate", candidate)):
            if point in trace and trace[point].is_floating_point():
                values = compared_entries(point, trace[point])
                counts[name] = (int(values.isnan().sum()), int(values.isinf().sum()))
        bad = [name for name, (nan, inf) in counts.items() if nan + inf]
        if bad:
            return {
                "point": point, "layer": layer_of(point), "side": bad[0] if len(bad) == 1 else "both",
                "count": sum(sum(counts[name]) for name in bad),
                "nan": sum(counts[name][0] for name in bad), "inf": sum(counts[name][1] for name in bad),
            }
    return None


def compare_point(point: str, ref: torch.Tensor, cand: torch.Tensor, tolerance: Tolerance) -> PointDiff:
    if tuple(ref.shape) != tuple(cand.shape):
        raise TracerError(f"shape mismatch at {point}: reference {tuple(ref.shape)}, candidate {tuple(cand.shape)}")
    r, c = compared_entries(point, ref.double()), compared_entries(point, cand.double())
    diff = c - r
    ref_norm, diff_norm = float(r.norm()), float(diff.norm())
    if math.isnan(ref_norm) or math.isnan(diff_norm):
        rel_l2 = math.nan  # a NaN on either side: never within any tolerance, not even rel_l2 <= inf
    else:
        rel_l2 = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    cand_norm = float(c.norm())
    cosine = float((c * r).sum()) / (cand_norm * ref_norm) if cand_norm * ref_norm > 0 else float(diff_norm == 0)
    return PointDiff(
        point, layer_of(point), tuple(ref.shape),
        max_abs=float(diff.abs().max()) if diff.numel() else 0.0,
        max_ref=float(r.abs().max()) if r.numel() else 0.0,
        rel_l2=rel_l2, cosine=cosine, diverged=tolerance.exceeded(diff, r, rel_l2),
    )


def compare_points(reference: Trace, candidate: Trace, tolerance: Tolerance) -> list[PointDiff]:
    """Every point either side recorded or declared unobservable, in execution order."""
    order = list(reference.points)
    for extra in [*candidate.points, *reference.not_recorded, *candidate.not_recorded]:
        if extra not in order:
            order.append(extra)
    order = _execution_order(order, reference, candidate)
    results = []
    for point in order:
        in_ref, in_cand = point in reference, point in candidate
        if in_ref and in_cand:
            results.append(compare_point(point, reference[point], candidate[point], tolerance))
            continue
        missing_on = "both" if not (in_ref or in_cand) else ("candidate" if in_ref else "reference")
        reason = candidate.not_recorded.get(point) or reference.not_recorded.get(point)
        shape = tuple(reference[point].shape) if in_ref else tuple(candidate[point].shape) if in_cand else None
        results.append(PointDiff(point, layer_of(point), shape, missing_on=missing_on, reason=reason))
    return results


def _execution_order(names: list[str], reference: Trace, candidate: Trace) -> list[str]:
    """Unrecorded points take their place in the vocabulary's order, not the end of the list."""
    from tracer.points import all_points

    num_layers = reference.meta.get("num_layers") or candidate.meta.get("num_layers")
    if not num_layers:
        return names
    rank = {p: i for i, p in enumerate(all_points(num_layers))}
    return sorted(names, key=lambda p: rank.get(p, len(rank)))


def logits_summary(reference: Trace, candidate: Trace) -> dict | None:
    """Logits at the last position (what candle returns and the notes quote) and over all positions."""
    if LOGITS not in reference or LOGITS not in candidate:
        return None
    ref, cand = reference[LOGITS].double(), candidate[LOGITS].double()
    if ref.shape != cand.shape:
        return None  # already reported as a shape mismatch by compare_points
    last_diff = cand[-1] - ref[-1]
    return {
        "max_abs": float(last_diff.abs().max()),
        "max_ref": float(ref[-1].abs().max()),
        "rel_l2": float(last_diff.norm() / ref[-1].norm()),
        "max_abs_all": float((cand - ref).abs().max()),
        "argmax_agree": float((cand.argmax(-1) == ref.argmax(-1)).double().mean()),
        "positions": int(ref.shape[0]),
    }


def first_divergence(points: list[PointDiff]) -> dict | None:
    """The first diverged point, with how well everything upstream of it agrees."""
    for index, p in enumerate(points):
        if p.diverged:
            upstream = [q for q in points[:index] if q.recorded]
            return {
                **{k: v for k, v in p.to_dict().items() if k not in ("recorded", "missing_on", "diverged")},
                "index": index,
                "last_agreeing": upstream[-1].point if upstream else None,
                "upstream_points": len(upstream),
                "upstream_max_rel_l2": max((q.rel_l2 for q in upstream), default=None),
            }
    return None


@dataclass
class Result:
    """The comparison of a candidate trace with a reference. `bool(result)`: no divergence.

    Example:
        >>> result = tracer.run(variant="theta=10000")
        >>> result.verdict, result.first_divergence["point"]
        ('diverged', 'model.layers.0.self_attn.q_rope')
        >>> result.table()  # per-point pandas DataFrame
    """

    verdict: str
    points: list[PointDiff]
    first_divergence: dict | None
    logits: dict | None
    tolerance: Tolerance
    reference: dict  # {"engine", "variant", "label"}
    candidate: dict
    model: str | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    token_texts: list[str] | None = None
    greedy: dict | None = None
    environment: dict = field(default_factory=dict)
    command: str | None = None
    timings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    first_nonfinite: dict | None = None  # {"point", "layer", "side", "count", "nan", "inf"}

    def __bool__(self) -> bool:
        return self.verdict == "match"

    @property
    def not_recorded(self) -> list[PointDiff]:
        return [p for p in self.points if not p.recorded]

    def to_dict(self) -> dict:
        from tracer import __version__

        return _json_safe({
            "tracer_version": __version__,
            "verdict": self.verdict, "model": self.model, "prompt": self.prompt, "tokens": self.tokens,
            "token_texts": self.token_texts, "reference": self.reference, "candidate": self.candidate,
            "tolerance": self.tolerance.to_dict(), "first_divergence": self.first_divergence,
            "points": [p.to_dict() for p in self.points], "logits": self.logits, "greedy": self.greedy,
            "environment": self.environment, "command": self.command, "timings": self.timings,
            "notes": self.notes, "error": self.error, "first_nonfinite": self.first_nonfinite,
        })

    def to_json(self, indent: int | None = 2) -> str:
        import json

        return json.dumps(self.to_dict(), indent=indent)

    def table(self):
        """The per-point comparison as a pandas DataFrame, one row per point in execution order."""
        import pandas as pd

        return pd.DataFrame([p.to_dict() for p in self.points]).set_index("point")

    def plot(self, kind: str = "curve"):
        """A matplotlib Figure: "curve" (per-layer error), "heatmap" (layer × sub-point) or
        "breakdown" (the first divergence per position and head). Shown inline in Jupyter."""
        from tracer.reports import plot

        return plot(self, kind)

    def _repr_html_(self) -> str:
        """Jupyter's view: verdict, first divergence, curve, the diverging block (scoped CSS)."""
        from tracer.reports import result_html

        return result_html(self)


def side(trace: Trace) -> dict:
    return {"engine": trace.meta.get("engine", "file"), "variant": trace.meta.get("variant", {}), "label": trace.label}


def compare(reference: Trace, candidate: Trace, tolerance: Tolerance | None = None) -> Result:
    """Diff two traces point by point; name the first divergence."""
    tolerance = tolerance or Tolerance()
    ref_tokens, cand_tokens = reference.tokens, candidate.tokens
    if ref_tokens is not None and cand_tokens is not None and list(ref_tokens) != list(cand_tokens):
        raise TracerError(f"the traces were recorded on different token ids: {ref_tokens} vs {cand_tokens}")
    points = compare_points(reference, candidate, tolerance)
    first = first_divergence(points)
    return Result(
        verdict="diverged" if first else "match",
        points=points,
        first_divergence=first,
        logits=logits_summary(reference, candidate),
        tolerance=tolerance,
        reference=side(reference),
        candidate=side(candidate),
        model=reference.meta.get("model"),
        tokens=ref_tokens or cand_tokens,
        first_nonfinite=first_nonfinite([p.point for p in points], reference, candidate),
    )
