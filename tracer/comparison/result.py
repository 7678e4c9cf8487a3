"""What comparisons produce, as values: `Tolerance`, `PointDiff`, `Result` with its parts (`Divergence`,
`LogitsSummary`, `Greedy`, `RegimeView` and its `WeightAudit`), `SweepRow`, `Sweep`, `Diagnosis`, and a
`Triangulation` (several candidates' `Result`s on one reference, with their `AgreementRow`s). The
functions that compute them live apart (`tracer.comparison.diff` compares two traces, `tracer.pipeline.run` runs
engines), as Polygraphy keeps `struct.py` apart from `compare.py`.

A value is built once and never assigned to afterwards (frozen dataclasses; sequences are tuples).
`bool(value)` says "within tolerance"; `to_dict()` is the JSON contract (docs/design.md, "JSON contract"),
with NaN and Inf written as the strings "nan" / "inf" (JSON has neither). A part's `to_dict()` is its
piece of the contract, made JSON-safe by the whole's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tracer.core import __version__
from tracer.core.renderers import render

if TYPE_CHECKING:  # a value held here; the audit module computes with numpy and torch
    from tracer.ggml.audit import WeightAudit

DEFAULT_REL_L2 = 1e-4
# On SmolLM2 the f32-vs-f64 noise bounds eager-vs-sdpa at every point (ratio at most 0.98).
NOISE_FACTOR = 10.0
# The version of summary.json's contract (docs/design.md): 2 added the decode steps (`step`, `steps`), 3 each
# step's local errors and status per layer (`layer_max_local_rel_l2`, `layer_status`, `local`, `inherited_from`),
# 4 the triangulation (`kind` "triangulation": several candidates on one reference run, `Triangulation.to_dict`),
# 5 the routing diff of a mixture of experts (`routing`, `tracer.comparison.routing.RoutingDiff.to_dict`),
# 6 how the noise floor was measured (`floor`, `FloorSummary.to_dict`).
CONTRACT_VERSION = 6
NOISE_FLOOR = 1e-6


@dataclass(frozen=True)
class Tolerance:
    """When a point counts as diverged.

    By default a point diverges when its relative L2 error leaves its noise floor: more than
    `noise_factor` times the error pure f32 rounding makes there (the reference against an f64
    run of the same model), and at least `noise_floor`. Where no noise estimate exists (two saved
    traces), the fixed bound `rel_l2` applies. `atol`/`rtol` replace both with elementwise bounds.
    """

    rel_l2: float = DEFAULT_REL_L2
    atol: float | None = None
    rtol: float | None = None
    noise_factor: float = NOISE_FACTOR
    noise_floor: float = NOISE_FLOOR

    def threshold(self, noise: float | None) -> float:
        """The relative-L2 bound for a point whose rounding noise is `noise` (None: unknown)."""
        if noise is None or not math.isfinite(noise):
            return self.rel_l2
        return max(self.noise_floor, self.noise_factor * noise)

    @property
    def elementwise(self) -> bool:
        return self.atol is not None or self.rtol is not None

    def exceeded(self, rel_l2: float, noise: float | None = None, any_outside: bool = False) -> bool:
        if self.elementwise:
            return any_outside or not math.isfinite(rel_l2)
        return not rel_l2 <= self.threshold(noise)  # NaN diverges

    def to_dict(self) -> dict:
        if self.elementwise:
            atol, rtol = self.atol or 0.0, self.rtol or 0.0
            return {"criterion": "allclose", "atol": atol, "rtol": rtol,
                    "text": f"|diff| > {atol:.0e} + {rtol:.0e}·|ref| anywhere"}
        return {"criterion": "rel_l2", "rel_l2": self.rel_l2, "noise_factor": self.noise_factor,
                "noise_floor": self.noise_floor,
                "text": f"rel_l2 > max({self.noise_floor:.0e}, {self.noise_factor:g} × noise), "
                        f"else > {self.rel_l2:.0e}"}


@dataclass(frozen=True)
class FloorSummary:
    """How the noise floor the points were judged against was measured (`tracer.pipeline.noise_floor`):
    "exact", an f64 run of all `tokens`; "cheap", of the first `rows`, each point's floor `scale` times
    that, and exact through `exact_through` (the last point whose verdict rested on it) where a
    confirmation measured it. `closest`: the point whose error came closest to its bound without leaving
    it, and the fraction of the bound it reached."""

    mode: str
    tokens: int
    rows: int
    scale: float = 1.0
    exact_through: str | None = None
    from_cache: bool = False
    closest: tuple[str, float] | None = None
    unconfirmed: str | None = None  # why a verdict resting on the scaled floor could not be confirmed

    def text(self) -> str:
        cached = ", from the cache" if self.from_cache else ""
        if self.rows >= self.tokens:
            return f"exact (an f64 run of all {self.tokens} tokens{cached})"
        confirmed = f"exact through {self.exact_through}" if self.exact_through else "no verdict rested on it"
        if self.unconfirmed:
            confirmed = f"not confirmed: {self.unconfirmed}"
        return f"cheap (an f64 run of the first {self.rows} of {self.tokens} tokens{cached}, × {self.scale:g}; " \
               f"{confirmed})"

    def to_dict(self) -> dict:
        closest = None if self.closest is None else {"point": self.closest[0], "share": self.closest[1]}
        return {"mode": self.mode, "tokens": self.tokens, "rows": self.rows, "scale": self.scale,
                "exact_through": self.exact_through, "from_cache": self.from_cache, "closest": closest,
                "unconfirmed": self.unconfirmed, "text": self.text()}


@dataclass(frozen=True)
class PointDiff:
    """One point's comparison. `bool(point_diff)` is True when it is within tolerance."""

    point: str
    layer: int | None
    shape: tuple[int, ...] | None
    # "reference", "candidate" or "both" when not recorded; "neither" when both recorded it in cache layouts
    # that cannot be reconciled (`tracer.model.kv_cache.SlotLayout`): not compared, `reason` says why
    missing_on: str | None = None
    max_abs: float | None = None
    max_ref: float | None = None
    rel_l2: float | None = None
    cosine: float | None = None
    diverged: bool = False
    reason: str | None = None  # why a side did not record it
    noise: float | None = None  # rel_l2 that f32 rounding alone makes here
    local_rel_l2: float | None = None  # rel_l2 introduced here, on the reference's inputs
    threshold: float | None = None  # the rel_l2 bound this point was judged against
    # a MoE layer's points after its routing: rel_l2 introduced here on the reference's inputs and routing
    routed_local_rel_l2: float | None = None

    @property
    def recorded(self) -> bool:
        return self.missing_on is None

    def __bool__(self) -> bool:
        return not self.diverged

    def to_dict(self) -> dict:
        return {
            "point": self.point, "layer": self.layer, "shape": list(self.shape) if self.shape else None,
            "recorded": self.recorded, "missing_on": self.missing_on, "max_abs": json_number(self.max_abs),
            "max_ref": json_number(self.max_ref), "rel_l2": json_number(self.rel_l2),
            "cosine": json_number(self.cosine),
            "diverged": self.diverged, "noise": json_number(self.noise), "threshold": json_number(self.threshold),
            "local_rel_l2": json_number(self.local_rel_l2),
            "routed_local_rel_l2": json_number(self.routed_local_rel_l2),
            **({"reason": self.reason} if self.reason else {}),
        }


def json_number(value: float | None):
    """JSON has no NaN or Infinity; say them as strings rather than lie with a number."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


def json_safe(value):
    """`json_number` through a whole JSON tree (logits figures, breakdowns): NaN and Inf as strings."""
    if isinstance(value, float):
        return json_number(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dict_or_none(value) -> dict | None:
    """A value's `to_dict()`, None for none (the optional parts of a result)."""
    return None if value is None else value.to_dict()


@dataclass(frozen=True)
class Divergence:
    """The first point that introduces error (`tracer.comparison.diff.first_divergence`): its figures, how well
    everything upstream agrees, and the breakdowns and hints `tracer.comparison.diff.explain_divergence` adds."""

    point: str
    layer: int | None
    shape: tuple[int, ...] | None
    max_abs: float | None
    max_ref: float | None
    rel_l2: float | None
    cosine: float | None
    noise: float | None
    threshold: float | None
    local_rel_l2: float | None
    index: int  # its place in `Result.points`
    localized_by: str  # "local" (by its error on the reference's inputs) or "total"
    last_agreeing: str | None  # the last recorded point before it
    upstream_points: int  # recorded points before it
    upstream_max_rel_l2: float | None
    by_position: tuple[float, ...] = ()  # max |diff| per token position (the query position for attention)
    by_head: tuple[float, ...] | None = None  # max |diff| per head, for points that have heads
    top_channels: tuple[dict, ...] | None = None  # {"channel", "max_abs"}, the worst channels first
    hints: tuple[str, ...] = ()  # what an expert would suspect on seeing these breakdowns
    # The points between the last agreeing one and it that were not recorded, where its own error is not
    # measured (no local rerun): the error may start at any of them, so what it inherits is unknown.
    unseen: tuple[str, ...] = ()

    def brief(self) -> dict:
        """Where and how large, for a view told beside the main one (the raw f32 view of a regime,
        the step where the greedy continuations part)."""
        return {"point": self.point, "layer": self.layer, "rel_l2": self.rel_l2, "max_abs": self.max_abs,
                "max_ref": self.max_ref}

    def to_dict(self) -> dict:
        return {
            "point": self.point, "layer": self.layer, "shape": list(self.shape) if self.shape else None,
            "max_abs": self.max_abs, "max_ref": self.max_ref, "rel_l2": self.rel_l2, "cosine": self.cosine,
            "noise": self.noise, "threshold": self.threshold, "local_rel_l2": self.local_rel_l2,
            "index": self.index, "localized_by": self.localized_by, "last_agreeing": self.last_agreeing,
            "upstream_points": self.upstream_points, "upstream_max_rel_l2": self.upstream_max_rel_l2,
            "by_position": list(self.by_position),
            "by_head": None if self.by_head is None else list(self.by_head),
            "top_channels": None if self.top_channels is None else list(self.top_channels),
            "hints": list(self.hints), "unseen": list(self.unseen),
        }


@dataclass(frozen=True)
class LogitsSummary:
    """The model's output compared (`tracer.comparison.diff.logits_summary`): at the last position, over all
    positions, and as next-token predictions."""

    max_abs: float  # at the last position
    max_ref: float
    rel_l2: float
    max_abs_all: float  # over all positions
    argmax_agree: float  # the fraction of positions whose argmax agrees
    positions: int
    next_token_accuracy: dict[str, float] | None  # side -> how often its argmax is the text's next token

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)  # the fields are the JSON keys, in order


@dataclass(frozen=True)
class Greedy:
    """Both sides' greedy continuations and how long they agree (`tracer.pipeline.greedy.summary`)."""

    reference: list[int]
    candidate: list[int]
    steps: int
    same_prefix: int  # tokens before the first flip
    first_flip: int | None  # 1-based step of the first differing token
    same_positions: int
    reference_text: str
    candidate_text: str
    # Where the sides part on the tokens of the first flip's step (`tracer.pipeline.run.greedy_comparison`).
    first_flip_divergence: Divergence | None = None

    def to_dict(self) -> dict:
        flip = self.first_flip_divergence
        return {
            "reference": self.reference, "candidate": self.candidate, "steps": self.steps,
            "same_prefix": self.same_prefix, "first_flip": self.first_flip, "same_positions": self.same_positions,
            "reference_text": self.reference_text, "candidate_text": self.candidate_text,
            # a continuation that flips says where, in brief (None: no point diverges at that step)
            **({"first_flip_divergence": flip and flip.brief()} if self.first_flip else {}),
        }


@dataclass(frozen=True)
class RawView:
    """Beside a regime view, the same candidate against the f32 reference: the verdict without the regime."""

    verdict: str
    reference: dict
    first_divergence: Divergence | None
    logits: LogitsSummary | None

    def to_dict(self) -> dict:
        first = self.first_divergence
        return {"verdict": self.verdict, "reference": self.reference, "first_divergence": first and first.brief(),
                "logits": dict_or_none(self.logits)}


@dataclass(frozen=True)
class RegimeView:
    """`Result.regime` (`tracer.pipeline.regime_view`): the regime the reference ran in, the raw f32 view, the
    regime's own cost per point and the per-op errors on the candidate's own inputs."""

    variant: dict  # the regime's knobs
    label: str
    caveats: tuple[str, ...]
    raw: RawView
    cost: dict[str, float]  # per point, the rel_l2 of the regime reference against the f32 one
    per_op: dict[str, float] | None  # per point, its op's error on the candidate's own inputs
    per_op_worst: dict | None  # {"point", "rel_l2"} of the largest per-op error
    per_op_bound: float | None  # the per-op error a correct op stays under (None: no bound)
    per_op_over: tuple[str, ...]  # the points whose per-op error exceeds it
    verdict_view: str  # "free" or "per_op": how the verdict was judged (`tracer.pipeline.regime_view.verdict_view`)
    # the GGUF file whose tensors the regime takes (weights=gguf), audited against the reference's weights
    audit: WeightAudit | None = None
    # every point judged against at least per_op_bound: a caveat names this CPU's or build's own code paths,
    # so the ops emulated in the runtime's order are not its arithmetic here either
    floor_at_bound: bool = False

    def to_dict(self) -> dict:
        return {
            "variant": self.variant, "label": self.label, "caveats": list(self.caveats), "raw": self.raw.to_dict(),
            "cost": self.cost, "per_op": self.per_op, "per_op_worst": self.per_op_worst,
            "per_op_bound": self.per_op_bound, "per_op_over": list(self.per_op_over),
            "verdict_view": self.verdict_view, "audit": dict_or_none(self.audit), "floor_at_bound": self.floor_at_bound,
        }


@dataclass(frozen=True)
class StepResult:
    """One step of a decoded run compared (`tracer.comparison.steps`): 0 is the prompt's prefill with
    the engines' KV caches, 1..N the decode steps, each one token at its position."""

    step: int
    position: int  # the absolute position of its first token
    tokens: tuple[int, ...]  # what it was fed (the reference's greedy token, on both sides)
    verdict: str
    first_divergence: Divergence | None
    points: int  # points compared
    layer_max_rel_l2: tuple[float | None, ...] = ()  # per layer, the largest rel_l2 (the step × layer map)
    # Each side's greedy pick after this step, from its own cached logits (None: no logits recorded): the
    # candidate's cached greedy continuation follows the reference's until the first step where they differ.
    reference_pick: int | None = None
    candidate_pick: int | None = None
    # Local against inherited (a reimpl candidate: the step rerun on the reference's inputs and cache): per layer
    # the largest local rel_l2 (empty: not measured) and its status, "match" | "local" (the step's own op leaves
    # the floor) | "inherited" (diverged, every local error within the floor) | "diverged" (not measured).
    layer_max_local_rel_l2: tuple[float | None, ...] = ()
    layer_status: tuple[str, ...] = ()
    local: bool | None = None  # the step itself makes error (None: not measured)
    inherited_from: int | None = None  # a diverged step: the first step whose cache points diverged, if earlier

    def to_dict(self) -> dict:
        return {"step": self.step, "position": self.position, "tokens": list(self.tokens), "verdict": self.verdict,
                "first_divergence": dict_or_none(self.first_divergence), "points": self.points,
                "layer_max_rel_l2": list(self.layer_max_rel_l2), "reference_pick": self.reference_pick,
                "candidate_pick": self.candidate_pick, "layer_max_local_rel_l2": list(self.layer_max_local_rel_l2),
                "layer_status": list(self.layer_status), "local": self.local, "inherited_from": self.inherited_from}


@dataclass(frozen=True)
class BatchRow:
    """One row of a batched run compared (`tracer.comparison.batch`): the candidate's row of its left-padded
    batch against the reference's batch-1 run of the same prompt, at the row's real positions."""

    row: int
    tokens: tuple[int, ...]  # the row's real tokens
    padding: int  # padded positions before them (not compared)
    verdict: str
    first_divergence: Divergence | None
    points: int  # points compared
    batch_floor: float | None = None  # the reference's batched row against its batch-1 run: the largest rel_l2
    layer_max_rel_l2: tuple[float | None, ...] = ()  # per layer, the largest rel_l2

    def to_dict(self) -> dict:
        return {"row": self.row, "tokens": list(self.tokens), "padding": self.padding, "verdict": self.verdict,
                "first_divergence": dict_or_none(self.first_divergence), "points": self.points,
                "batch_floor": self.batch_floor, "layer_max_rel_l2": list(self.layer_max_rel_l2)}


@dataclass(frozen=True)
class Result:
    """The comparison of a candidate trace with a reference. `bool(result)`: no divergence.

    `tracer.comparison.diff.compare` builds the comparison; `tracer.pipeline.run` adds the run's context (prompt,
    greedy continuations, environment, command, timings, notes, config audit) in one
    `with_context` call. Neither changes it afterwards.

    Example:
        >>> result = tracer.run(variant="theta=10000", progress=False)
        >>> result.verdict, result.first_divergence.point
        ('diverged', 'model.layers.0.self_attn.q_rope')
        >>> bool(result.table().loc["model.layers.0.self_attn.q_rope", "diverged"])
        True
    """

    verdict: str  # "match" | "diverged" | "error"
    points: tuple[PointDiff, ...]
    first_divergence: Divergence | None
    logits: LogitsSummary | None
    tolerance: Tolerance
    reference: dict  # {"engine", "variant", "label", "device", "runtime"}
    candidate: dict
    model: str | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    token_texts: list[str] | None = None
    chat: dict | None = None  # {"system", "text", "tokens"} when the prompt went through a chat template
    greedy: Greedy | None = None
    environment: dict = field(default_factory=dict)
    command: str | None = None
    timings: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    error: str | None = None
    first_nonfinite: dict | None = None  # {"point", "layer", "side", "count", "nan", "inf"}
    amplification: tuple[dict, ...] = ()  # ops ranked by error gain over their input
    config_audit: dict | None = None  # what each config reader makes of the model's config.json
    # The regime view (`tracer.pipeline.regime_view`): the reference ran in the candidate's number formats; the raw
    # f32 view, the regime's own cost per point and the per-op errors ride along.
    regime: RegimeView | None = None
    # A decoded run (`--decode N`, `tracer.comparison.steps`): every step compared, 0 the cached prefill; `step`:
    # which of them `points` and `first_divergence` show (None: the uncached prefill, where everything matched
    # or the prefill itself diverged).
    steps: tuple[StepResult, ...] = ()
    step: int | None = None
    # A batched run (`--batch B`, `tracer.comparison.batch`): every row compared; `row`: which of them `points` and
    # `first_divergence` show (None: the first row's prompt run alone, where everything matched or it diverged).
    batch: tuple[BatchRow, ...] = ()
    row: int | None = None
    # Traces carrying a mixture of experts' routing points: which experts each token went to on each side, every
    # flip a near-tie or structural: a `tracer.comparison.routing.RoutingDiff` (its module, which imports this
    # one, holds the value beside the diff, as `tracer.ggml.audit` holds `WeightAudit`); None where they carry none.
    routing: object | None = None
    floor: FloorSummary | None = None  # how the noise floor was measured (None: none, the fixed bound)

    def __bool__(self) -> bool:
        return self.verdict == "match"

    def with_context(self, *, notes=(), **context) -> Result:
        """This comparison with the run's context attached; `notes` go before the comparison's own."""
        return dataclasses.replace(self, notes=(*notes, *self.notes), **context)

    def showing(self, shown: Result, **attached) -> Result:
        """This result (its context) showing `shown`'s comparison instead (verdict, points, first
        divergence, logits): a decode step's or a batch row's, the first that diverged, with `attached`."""
        return dataclasses.replace(self, verdict=shown.verdict, points=shown.points,
                                   first_divergence=shown.first_divergence, logits=shown.logits,
                                   first_nonfinite=shown.first_nonfinite, amplification=shown.amplification,
                                   routing=shown.routing, **attached)

    @property
    def not_recorded(self) -> list[PointDiff]:
        return [p for p in self.points if not p.recorded]

    def to_dict(self) -> dict:
        return json_safe({
            "tracer_version": __version__, "contract": CONTRACT_VERSION,
            "verdict": self.verdict, "model": self.model, "prompt": self.prompt, "tokens": self.tokens,
            "token_texts": self.token_texts, "chat": self.chat, "reference": self.reference,
            "candidate": self.candidate, "tolerance": self.tolerance.to_dict(),
            "first_divergence": dict_or_none(self.first_divergence), "points": [p.to_dict() for p in self.points],
            "logits": dict_or_none(self.logits), "greedy": dict_or_none(self.greedy), "environment": self.environment,
            "command": self.command, "timings": self.timings, "notes": list(self.notes), "error": self.error,
            "first_nonfinite": self.first_nonfinite, "amplification": list(self.amplification),
            "config_audit": self.config_audit,
            "view": "raw" if self.regime is None else "regime", "regime": dict_or_none(self.regime),
            "step": self.step, "steps": [step.to_dict() for step in self.steps],
            "row": self.row, "batch": [row.to_dict() for row in self.batch], "routing": dict_or_none(self.routing),
            "floor": dict_or_none(self.floor),
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self):
        """The per-point comparison as a pandas DataFrame, one row per point in execution order."""
        import pandas as pd  # pandas: 0.3 s, for a table only

        return pd.DataFrame([p.to_dict() for p in self.points]).set_index("point")

    def plot(self, kind: str = "curve"):
        """A matplotlib Figure: "curve" (per-layer error), "heatmap" (layer × sub-point), "breakdown" (the
        first divergence per position and head) or "routing" (a mixture of experts' layer × token routing
        map). Shown inline in Jupyter."""
        return render("plot", self, kind)

    def _repr_html_(self) -> str:
        """Jupyter's view: verdict, first divergence, curve, the diverging block (scoped CSS)."""
        return render("result_html", self)


@dataclass(frozen=True)
class PairAgreement:
    """Two sides of a triangulation at one point (`AgreementRow`): the rel_l2 of the second against the first,
    and whether it is within the row's bound; `agree` None where the pair was not compared (`reason` says why:
    a side did not record the point)."""

    sides: tuple[str, str]
    rel_l2: float | None
    agree: bool | None
    reason: str | None = None

    def to_dict(self) -> dict:
        return {"sides": list(self.sides), "rel_l2": self.rel_l2, "agree": self.agree, "reason": self.reason}


@dataclass(frozen=True)
class AgreementRow:
    """Who agrees with whom at one point of a triangulation (`tracer.comparison.triangulation`): a candidate's
    first divergence from the reference, or the logits. Every pair of sides that recorded the point is judged
    by one bound, `threshold`, the one each candidate was held to against the reference there: `floor` says
    which ("noise": `noise_factor` × the reference's f64 rounding noise at the point, `noise`; "fixed": the
    fixed rel_l2 bound, no noise measured there; "allclose": the elementwise atol/rtol, no rel_l2 bound).
    `odd_one`: the one side that disagrees with every other while all the others agree with each other."""

    point: str
    layer: int | None
    first_of: tuple[str, ...]  # the candidates whose first divergence from the reference this point is
    sides: tuple[str, ...]  # the sides that recorded it, the reference first
    threshold: float | None
    floor: str  # "noise" | "fixed" | "allclose"
    noise: float | None
    pairs: tuple[PairAgreement, ...]
    odd_one: str | None = None

    def to_dict(self) -> dict:
        return {"point": self.point, "layer": self.layer, "first_of": list(self.first_of), "sides": list(self.sides),
                "threshold": self.threshold, "floor": self.floor, "noise": self.noise,
                "pairs": [pair.to_dict() for pair in self.pairs], "odd_one": self.odd_one}


@dataclass(frozen=True)
class Triangulation:
    """Several candidates traced in one run on one reference run (`tracer.run(candidate=[A, B, ...])`): each
    candidate's `Result` against the reference, and at each one's first divergence and at the logits who agrees
    with whom (`agreement`). `odd_one` is the first row's odd one, if any: {"side", "role" ("reference" or
    "candidate"), "point"}; the reference there may be the wrong side (docs/explain.md, "Triangulation").

    `bool(triangulation)`: every candidate matches the reference (what `--fail-on-divergence` exits 1 on
    when it does not, the reference odd one out included: something disagrees either way).

    Example:
        >>> tri = tracer.run(reference="reimpl", reference_variant="theta=10000", candidate=["hf", "reimpl"],
        ...                  greedy=0, progress=False)
        >>> tri.odd_one["role"], tri.odd_one["point"]
        ('reference', 'model.layers.0.self_attn.q_rope')
    """

    results: tuple[Result, ...]  # one per candidate, in the order given
    sides: tuple[str, ...]  # how the agreement table names each side: the reference, then each candidate
    agreement: tuple[AgreementRow, ...]
    odd_one: dict | None = None
    environment: dict = field(default_factory=dict)
    command: str | None = None
    timings: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def verdict(self) -> str:
        return "match" if all(self.results) else "diverged"

    def __bool__(self) -> bool:
        return self.verdict == "match"

    def __getitem__(self, side: str) -> Result:
        """A candidate's `Result` by the name the table gives it (`sides`)."""
        if side not in self.sides[1:]:
            raise KeyError(side)
        return self.results[self.sides.index(side) - 1]

    def with_context(self, **context) -> Triangulation:
        return dataclasses.replace(self, **context)

    def to_dict(self) -> dict:
        first = self.results[0]
        return json_safe({
            "tracer_version": __version__, "contract": CONTRACT_VERSION, "kind": "triangulation",
            "verdict": self.verdict, "model": first.model, "prompt": first.prompt, "tokens": first.tokens,
            "token_texts": first.token_texts, "chat": first.chat, "reference": first.reference,
            "sides": list(self.sides), "tolerance": first.tolerance.to_dict(),
            "candidates": [result.to_dict() for result in self.results],
            "agreement": [row.to_dict() for row in self.agreement], "odd_one": self.odd_one,
            "environment": self.environment, "command": self.command, "timings": self.timings,
            "notes": list(self.notes),
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _repr_html_(self) -> str:
        return render("triangulation_html", self)


@dataclass(frozen=True)
class SweepRow:
    """One variant against the reference. `result` is the full comparison (None on error)."""

    variant: str
    knobs: dict
    verdict: str  # "match" | "diverged" | "error"
    first_divergence: Divergence | None = None
    logits: LogitsSummary | None = None
    greedy: Greedy | None = None
    error: str | None = None
    curve: tuple[dict, ...] = ()  # coarse points: point, layer, rel_l2, threshold, diverged
    notes: tuple[str, ...] = ()
    seconds: float | None = None
    result: Result | None = field(default=None, repr=False, compare=False)
    step: int | None = None  # with --decode: the decode step the first divergence is at (None: the prefill)

    def __bool__(self) -> bool:
        return self.verdict == "match"

    def to_dict(self) -> dict:
        return json_safe({
            "variant": self.variant, "knobs": self.knobs, "verdict": self.verdict,
            "first_divergence": dict_or_none(self.first_divergence), "logits": dict_or_none(self.logits),
            "greedy": dict_or_none(self.greedy), "error": self.error, "curve": list(self.curve),
            "notes": list(self.notes), "seconds": self.seconds, "step": self.step,
        })


@dataclass(frozen=True)
class Sweep:
    """Every variant's row, plus what they were compared against.

    Example:
        >>> sweep = tracer.sweep(variants=["theta=10000", "kv_repeat=tile"], progress=False)
        >>> [(row.variant, row.first_divergence.point) for row in sweep.rows]
        [('theta=10000', 'model.layers.0.self_attn.q_rope'), ('kv_repeat=tile', 'model.layers.0.self_attn.scores')]
        >>> list(sweep.table().index)  # one row per variant, a pandas DataFrame
        ['theta=10000', 'kv_repeat=tile']
    """

    rows: tuple[SweepRow, ...]
    reference: dict
    candidate: dict  # {"engine"}
    tolerance: Tolerance
    model: str | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    chat: dict | None = None
    greedy_steps: int = 0
    reference_greedy: list[int] | None = None
    environment: dict = field(default_factory=dict)
    command: str | None = None
    timings: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __getitem__(self, variant: str) -> SweepRow:
        for row in self.rows:
            if row.variant == variant:
                return row
        raise KeyError(variant)

    def to_dict(self) -> dict:
        return json_safe({
            "tracer_version": __version__, "kind": "sweep", "model": self.model, "prompt": self.prompt,
            "tokens": self.tokens, "chat": self.chat, "reference": self.reference, "candidate": self.candidate,
            "tolerance": self.tolerance.to_dict(), "greedy_steps": self.greedy_steps,
            "reference_greedy": self.reference_greedy, "variants": [row.to_dict() for row in self.rows],
            "environment": self.environment, "command": self.command, "timings": self.timings,
            "notes": list(self.notes),
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self):
        """One row per variant: verdict, first divergence, logits max|diff|, greedy agreement."""
        return render("sweep_frame", self.to_dict())

    def plot(self):
        """Every variant's per-layer error curve overlaid, as a matplotlib figure."""
        return render("sweep_figure", self)

    def _repr_html_(self) -> str:
        return render("sweep_html", self)


@dataclass(frozen=True)
class Diagnosis:
    """The observed comparison and the catalogue ranked by resemblance, best first.

    `tracer.diagnose` builds it (its docstring has an example).
    """

    observed: Result
    ranking: tuple[dict, ...] = ()  # {"variant", "score", "verdict", "first_divergence", "error"}

    @property
    def best(self) -> dict | None:
        """The closest variant, or None where it changes nothing on this model (its own verdict
        is match) while the observed trace diverged: then no planted mistake reproduces it."""
        if not self.ranking or (self.ranking[0]["verdict"] == "match" and self.observed.verdict == "diverged"):
            return None
        return self.ranking[0]

    def to_dict(self) -> dict:
        return json_safe({"observed": self.observed.to_dict(), "ranking": list(self.ranking)})
