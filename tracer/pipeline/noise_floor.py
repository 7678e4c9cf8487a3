"""The noise floor: how much a point's value moves from rounding alone, outside a regime and in one.

Outside a regime (`estimate_noise`): the reference model is run once more by the reimplementation
in f64 (same math, same knobs); the relative L2 distance between the reference trace and that run
is, per point, the error that a faithful f32 implementation makes anyway.

That f64 run of the whole prompt is the floor's definition, and the run's dearest part at real
sizes. The cheap floor (`NoiseFloor`, the default) runs f64 on the prompt's first quarter only
(`floor_rows`): a causal model's first rows depend on the first tokens alone, so it is the exact
floor of those rows (`prefix_noise`), and FLOOR_SCALE times it is never below the whole prompt's
floor on every model calibrated (docs/floor.md). No verdict rests on that scaled value: where one
would (the first divergence, or a point whose error could leave the exact floor though within the
scaled one), the exact floor of the stretch it depends on, from the first layer through that
point's, is measured then (`NoiseFloor.settled`).

In a number-format regime (`regime_noise`) that estimate is wrong twice over: an f64 run drops the
formats the regime is about (8-bit activations, an f16 KV cache), and the regime's errors are not
continuous (an activation that moves by 1e-7 can flip an 8-bit rounding, which moves the next
matmul by a whole quantization step), so a free-running spread measures chaos, not arithmetic.
The estimate keeps the formats and changes only what an equally valid implementation of the regime
may change, the order of its sums: the regime with `accumulate=f64` (every quantized matmul, RoPE,
SwiGLU and q·k sum exact and rounded once; ggml's online softmax and f16 flash-attention
accumulator kept) is run with every op fed the reference's values of its inputs
(`tracer.reimpl.forced_runs.op_forced_points`), and a point's noise is its rel_l2 to the reference there:
the error a different summation order makes in that op alone. Forcing per op, not per block, keeps
one op's flips from spreading to the next ops of its block. Points both variants compute alike
(embedding, norms, residual adds) get 0 and fall back to the criterion's absolute floor.

Measured figures (SmolLM2, preset=llamacpp): docs/regimes.md, "The noise floor in a regime".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from tracer.comparison.diff import ErrorRecorder
from tracer.comparison.result import FloorSummary, Result, Tolerance
from tracer.core.errors import TracerError
from tracer.engines.base import at_positions
from tracer.engines.load import LoadTarget, load_engine
from tracer.engines.registry import EngineRef
from tracer.files.sources import ModelSource
from tracer.model.knobs import expand_presets, is_regime
from tracer.model.points import layer_of, rank
from tracer.traces.trace import Trace, first_rows

FLOOR_ROWS = 16  # the fewest tokens the cheap floor's f64 run takes; a prompt of as many has its exact floor
# The cheap floor's calibration (bench/floor_calibration.py, docs/floor.md): over every point of every model
# measured, the exact floor is at most FLOOR_SCALE times the cheap one and at least FLOOR_LOW times it.
FLOOR_SCALE = 4.0
FLOOR_LOW = 0.4


def floor_rows(tokens: int, mode: str) -> int:
    """Tokens the floor's f64 run takes: every one for the exact floor or a prompt of FLOOR_ROWS or fewer;
    else a quarter to a half of them, a power of two times FLOOR_ROWS (the ratio the calibration measured;
    and prompts that share their first rows share a cheap floor, `tracer.pipeline.reference_cache`)."""
    if mode == "exact" or tokens <= FLOOR_ROWS:
        return tokens
    rows = FLOOR_ROWS
    while rows * 4 < tokens:
        rows *= 2
    return rows


@dataclass
class NoiseFloor:
    """The noise floor a run's points are judged against (`noise`), and how it was measured.

    `exact` holds the points whose exact floor is known (all of them for an exact floor); every other
    point is judged against FLOOR_SCALE times its floor on the first `rows` tokens (`prefix`).
    `measure_exact(point)`: the exact floor of every point from the first layer through `point`'s
    (None: none can be measured, e.g. a floor read from the cache with no model at hand)."""

    mode: str
    tokens: int
    rows: int
    prefix: dict[str, float] = field(default_factory=dict)
    exact: dict[str, float] = field(default_factory=dict)
    exact_through: str | None = None
    from_cache: bool = False
    measure_exact: Callable[[str], dict[str, float]] | None = None
    family: str | None = None  # the traced family, whose order the points run in
    noise: dict[str, float] = field(default_factory=dict)
    unsaved: bool = True  # measured by this run, not yet in the reference cache
    unconfirmed: str | None = None  # why a verdict resting on the scaled floor was not confirmed

    def __post_init__(self):
        self.noise.update({point: FLOOR_SCALE * value for point, value in self.prefix.items()})
        self.noise.update(self.exact)

    @property
    def scale(self) -> float:
        return FLOOR_SCALE if self.rows < self.tokens else 1.0

    def judged_against(self, noise: dict[str, float]) -> NoiseFloor:
        """This floor with `noise` in place of its own, per point: what the regime's per-op view judges
        against (`tracer.pipeline.regime_view.per_op_noise`, which this floor's values are part of). Described
        as this one was measured; nothing more is measured through it."""
        floor = replace(self, measure_exact=None, noise={})
        floor.noise = dict(noise)  # after: `__post_init__` fills `noise` from the prefix and exact floors
        return floor

    def lowest(self) -> dict[str, float]:
        """Per point, the lowest its exact floor can be: FLOOR_LOW times its cheap floor where only that is known."""
        return {**{point: FLOOR_LOW * value for point, value in self.prefix.items()}, **self.exact}

    def scaled(self, point: str) -> bool:
        """Whether `point` is judged against a scaled floor."""
        return point in self.prefix and point not in self.exact

    def settled(self, judge: Callable[[dict[str, float]], Result], tolerance: Tolerance) -> Result:
        """`judge(noise)`'s result once no verdict rests on a scaled floor: while one does
        (`unsettled`), the exact floor through that point is measured and the run judged again."""
        result = judge(self.noise)
        while (point := self.unsettled(result, tolerance)) is not None and self.measure_exact is not None:
            try:
                measured = self.measure_exact(point)
            except TracerError as exc:  # said in the header: the verdict then rests on the scaled floor
                self.unconfirmed = f"the exact floor through {point} could not be measured ({exc})"
                break
            new = {name: value for name, value in measured.items() if name not in self.exact}
            if not new:
                self.unconfirmed = f"the exact floor's run did not record {point}"
                break
            self.exact.update(new)
            self.noise.update(new)
            self.unsaved = True
            self.exact_through = max((self.exact_through, point) if self.exact_through else (point,),
                                     key=lambda name: rank(name, self.family))
            result = judge(self.noise)
        return result

    def unsettled(self, result: Result, tolerance: Tolerance) -> str | None:
        """The last point, up to the first divergence, whose verdict a scaled floor decides: the first
        divergence itself, or one whose error (or local error) is above FLOOR_LOW times its floor's
        bound, where the exact floor could be lower than the scaled one by enough to make it diverge."""
        if tolerance.elementwise or not any(map(self.scaled, self.prefix)):
            return None
        first = result.first_divergence.point if result.first_divergence is not None else None
        last = None
        for p in result.points:
            if p.recorded and self.scaled(p.point):
                low = tolerance.threshold(FLOOR_LOW * self.prefix[p.point])
                errors = [e for e in (p.rel_l2, p.local_rel_l2, p.routed_local_rel_l2) if e is not None]
                if p.point == first or any(not e <= low for e in errors):
                    last = p.point
            if p.point == first:
                break
        return last

    def summary(self, result: Result) -> FloorSummary:
        """How this floor was measured, and the point of `result` that came closest to its bound."""
        shares = [(p.point, p.rel_l2 / p.threshold) for p in result.points
                  if p.recorded and not p.diverged and p.threshold and p.rel_l2]
        closest = max(shares, key=lambda share: share[1], default=None)
        return FloorSummary(self.mode, self.tokens, self.rows, self.scale, self.exact_through, self.from_cache,
                            closest, self.unconfirmed)


def estimate_noise(source: ModelSource, reference: Trace, reference_variant: dict, device="cpu",
                   through: str | None = None) -> dict[str, float]:
    """Per point, rel_l2 between `reference` and an f64 run of the same model and variant; with
    `through`, of the points from the first layer through `through`'s layer only (the run stops there).

    The f64 run's points are compared as they come and never kept (`tracer.comparison.diff.ErrorRecorder`).
    The f64 weights are streamed block by block: a whole f64 copy would be the largest thing in
    memory (twice the f32 model), for one forward. A number-format regime (weights=, act_quant=,
    preset=llamacpp, ...) gets its own estimate instead: `regime_noise`.
    """
    if is_regime(expand_presets(reference_variant)):
        return regime_noise(source, reference, reference_variant, device)
    engine = load_engine(EngineRef.named("reimpl"), {**reference_variant, "dtype": "f64"},
                         LoadTarget(source, torch.device(device), stream=True))
    errors = ErrorRecorder(reference) if through is None else _Through(reference, through)
    try:
        engine.record(reference.tokens, errors,
                      **at_positions(reference.meta.position_offset or 0, len(reference.tokens)))
    except _PastStretch:
        pass
    return errors.rel_l2


class _PastStretch(Exception):
    """Raised by `_Through` to stop a run past the stretch it measures."""


class _Through(ErrorRecorder):
    """An `ErrorRecorder` that stops the run at the first point of a layer after `through`'s."""

    def __init__(self, reference: Trace, through: str):
        super().__init__(reference)
        family = reference.meta.family
        self.layer, self.order = layer_of(through), rank(through, family)
        self.rank = lambda name: rank(name, family)

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        layer = layer_of(name)
        if layer is not None and layer != self.layer and self.rank(name) > self.order:
            raise _PastStretch
        super().__call__(name, tensor)


def prefix_noise(source: ModelSource, reference: Trace, reference_variant: dict, rows: int,
                 record_prefix, device="cpu") -> dict[str, float]:
    """Per point, rel_l2 between `reference`'s rows of the prompt's first `rows` tokens and an f64 run of
    those tokens alone: the exact floor of those rows (a causal model's first rows depend on the first
    tokens only). Where `reference` did not keep every such row (a long prompt keeps its attention's last
    query rows), `record_prefix(rows)` records the reference engine's own run of them instead."""
    prefix = first_rows(reference, rows)
    if any(point not in prefix for point in reference):
        prefix = record_prefix(rows)
    return estimate_noise(source, prefix, reference_variant, device)


def regime_noise(source: ModelSource, reference: Trace, variant: dict, device="cpu") -> dict[str, float]:
    """Per point, rel_l2 between `reference` and the regime `variant` with `accumulate=f64`, every
    op of it fed `reference`'s values of its inputs.

    Args:
        source: the model the reference ran, resolved (`tracer.files.sources.resolve_source`).
        reference: the regime's trace (usually the reimpl engine's run of `variant`).
        variant: the regime's knobs, e.g. {"preset": "llamacpp", "weights": "gguf"}.

    Returns:
        point -> rel_l2, for every point both traces hold.

    Example:
        >>> from tracer.files.sources import ModelSource
        >>> model, regime = tracer.default_model_path(), {"preset": "llamacpp", "weights": "gguf"}
        >>> ref = tracer.record(model, [504, 3575, 282, 4649, 314], engine="reimpl", variant=regime, progress=False)
        >>> regime_noise(ModelSource(model), ref, regime)["model.layers.0.mlp.down_proj"] < 1e-5  # 1e-7..6e-7
        True
    """
    engine = load_engine(EngineRef.named("reimpl"), {**variant, "accumulate": "f64"},
                         LoadTarget(source, torch.device(device)))
    errors = ErrorRecorder(reference)
    engine.op_trace(reference, errors)
    return errors.rel_l2
