"""`diagnose`: which known mistake does an observed trace look like?

A candidate trace recorded elsewhere (a port, another runtime) is compared with the reference;
then the variant catalogue runs on the reimplementation against the same reference, and each
variant's error fingerprint is matched with the observed one. The fingerprint is the per-point
relative L2 error on a log scale, plus the per-position profile at the first divergence. The
answer reads "your port behaves like rope_theta=10000".
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tracer.diff import Result
from tracer.errors import TracerError

# Values of the numeric knobs tried beyond the sweep's representative one (the model's own is skipped).
EXTRA_VALUES = {"theta": (10_000.0, 500_000.0, 1_000_000.0), "eps": (1e-6, 1e-5, 1e-4, 1e-3)}
FLOOR = 1e-12  # rel_l2 below this counts as exact on the log scale


@dataclass
class Diagnosis:
    """The observed comparison and the catalogue ranked by resemblance, best first."""

    observed: Result
    ranking: list[dict] = field(default_factory=list)  # {"variant", "score", "verdict", "first_divergence"}

    @property
    def best(self) -> dict | None:
        return self.ranking[0] if self.ranking else None

    def to_dict(self) -> dict:
        return {"observed": self.observed.to_dict(), "ranking": self.ranking}


def fingerprint(result: Result) -> dict[str, float]:
    """point -> log10(rel_l2), for every point both sides recorded."""
    return {p.point: math.log10(max(p.rel_l2, FLOOR)) for p in result.points
            if p.recorded and p.rel_l2 is not None and math.isfinite(p.rel_l2)}


def _profile(result: Result) -> list[float] | None:
    first = result.first_divergence
    if not first or not first.get("by_position"):
        return None
    values = [math.log10(max(v, FLOOR)) - math.log10(FLOOR) for v in first["by_position"]]
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values] if norm else None


def resemblance(observed: Result, variant: Result) -> float:
    """1 for the same fingerprint, towards 0 as the per-point errors part (in decades)."""
    seen, tried = fingerprint(observed), fingerprint(variant)
    common = [p for p in seen if p in tried]
    if not common:
        return 0.0
    distance = sum(abs(seen[p] - tried[p]) for p in common) / len(common)
    same_start = (observed.first_divergence or {}).get("point") == (variant.first_divergence or {}).get("point")
    shape = 0.5
    if same_start and observed.first_divergence:
        a, b = _profile(observed), _profile(variant)
        shape = sum(x * y for x, y in zip(a, b)) if a and b and len(a) == len(b) else 0.5
    return (0.5 + 0.5 * shape) / (1.0 + distance)


def catalogue(spec) -> list[str]:
    """The sweep's representative variants plus more values of theta and eps, and the number-format
    regimes (`tracer.ggml.regime.regime_catalogue`: block-quantized weights with and without their
    activation quantization, KV caches, 16-bit dtypes)."""
    from tracer.ggml.regime import regime_catalogue
    from tracer.sweep import default_variants
    from tracer.variants import parse_variant

    own = {"theta": spec.rope_theta, "eps": spec.rms_norm_eps}
    variants = default_variants(spec)
    seen = [parse_variant(v) for v in variants]
    for knob, values in EXTRA_VALUES.items():
        for value in values:
            if not math.isclose(value, own[knob]) and {knob: value} not in seen:
                variants.append(f"{knob}={value:g}")
                seen.append({knob: value})
    return variants + [v for v in regime_catalogue() if parse_variant(v) not in seen]


def diagnose(trace, model=None, *, variants=None, device: str = "cpu", stream: bool = False,
             progress: bool = True) -> Diagnosis:
    """Rank the variant catalogue by how well each reproduces an observed trace's error.

    Args:
        trace: the observed candidate: a `Trace` or a trace file (any runtime's, see
            docs/trace-format.md); it must carry its token ids.
        model: the model it ran (None: the bundled SmolLM2).
        variants: the variants to try (default: `catalogue(spec)`).

    Returns:
        A `Diagnosis`: `observed` (the comparison with the reference) and `ranking`, best first.

    Example:
        >>> tracer.diagnose("port.safetensors").best["variant"]
        'theta=10000'
    """
    from tracer.api import load_trace, resolve_source, run
    from tracer.config import load_config, read_hf
    from tracer.sweep import sweep

    observed_trace = load_trace(trace)
    if not observed_trace.tokens:
        raise TracerError("the trace carries no token ids; diagnose needs them to rerun the same input")
    source = resolve_source(model, progress)
    with tempfile.TemporaryDirectory(prefix="tracer-diagnose-") as folder:
        path = observed_trace.save(Path(folder) / "observed.safetensors") if not isinstance(trace, (str, Path)) else trace
        observed = run(source, tokens=observed_trace.tokens, candidate=f"file:{path}", greedy=0, progress=progress,
                       device=device, stream=stream)
    tried = sweep(source, tokens=observed_trace.tokens, greedy=0, progress=progress, device=device, stream=stream,
                  variants=variants if variants is not None else catalogue(read_hf(load_config(source))))
    ranking = [
        {"variant": row.variant, "score": resemblance(observed, row.result) if row.result is not None else 0.0,
         "verdict": row.verdict, "first_divergence": (row.first_divergence or {}).get("point"), "error": row.error}
        for row in tried.rows
    ]
    ranking.sort(key=lambda entry: entry["score"], reverse=True)
    return Diagnosis(observed, ranking)
