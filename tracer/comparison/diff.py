"""The diff engine: pure functions from two traces to a `Result` (the values: `tracer.comparison.result`).

Metrics are computed on the candidate minus the reference, in f32 (f64 where either side is f64),
each sum over a chunk reduced by torch's cascade summation and the chunks added in f64: measured
relative error of a sum of squares 4e-8 on heavy-tailed values (a BLAS f32 dot: 8e-5). Where that
could change a verdict (rel_l2 within `BORDERLINE` of its threshold, and the elementwise atol/rtol
test) the point is redone in f64. Chunks stay under torch's parallel grain, so the metrics never
wait on a thread pool: on this shared 2-core machine a (64, 8192) point took 0.5 s instead of 1 ms
whenever the second core was busy.

The default criterion is scale aware: a point diverges when its relative L2 error leaves its noise
floor (`Tolerance`). Absolute tolerances mean nothing on SmolLM2's hidden states, which reach
|x| ~ 22,500 from layer 12 on, while the noise of reordered f32 sums stays below 1e-5 relative
everywhere (eager vs sdpa: at most 2e-6).
`--atol/--rtol` replace it with `|c - r| <= atol + rtol * |r|` elementwise (torch.allclose).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tracer.comparison.explain import amplification, breakdown, hints, routed_hints, runtime_hints
from tracer.comparison.result import Divergence, LogitsSummary, PointDiff, Result, Tolerance
from tracer.comparison.routing import NEAR_TIE, ROUTING, RoutingDiff, routing_diff, routing_notes
from tracer.core.errors import TracerError, ids_text
from tracer.model.kv_cache import SlotLayout
from tracer.model.points import (
    CACHE_POINTS,
    FINAL_LOGITS,
    LOGITS,
    Q_ROPE,
    TOP_K_INDEX,
    causal_allowed,
    is_causal,
    layer_of,
    layer_point,
    rank,
    split_point,
)
from tracer.traces.layouts import align
from tracer.traces.spill import SpilledTensors
from tracer.traces.trace import Trace, kept, rows_before

CHUNK = 1 << 14  # values per chunk: 64 kB of f32, in cache, and below torch's parallel grain (32768)
BLOCK_CHUNKS = 64  # chunks summed per call (4 MB of f32): each chunk's sum is still one row's, on one thread
BORDERLINE = 1e-4  # rel_l2 this close (relative) to its threshold is recomputed in f64
# An integer point (the experts a router picked) is compared by the routing diff, never by rel_l2.
INTEGER_POINT = "integer ids: the routing diff compares them"


def outside(tolerance: Tolerance, diff: torch.Tensor, ref: torch.Tensor) -> bool:
    """Elementwise mode: does any entry of this chunk exceed atol + rtol·|ref|?"""
    bound = (tolerance.atol or 0.0) + (tolerance.rtol or 0.0) * ref.abs()
    return bool((diff.abs() > bound).any())


def compared_entries(point: str, tensor: torch.Tensor) -> torch.Tensor:
    """The entries metrics look at: causal points keep only what a query may attend to (masked
    scores are -inf or dtype-min by design, not a finding)."""
    if not is_causal(point):
        return tensor
    allowed = causal_allowed(*tensor.shape[-2:])  # (rows, T) entries a query may attend to
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


def _max_magnitude(values: torch.Tensor) -> float:
    """max |x| in one pass without an |x| copy (NaN if any value is NaN)."""
    low, high = values.aminmax()
    return _nan_max(-float(low), float(high))


def _nan_max(a: float, b: float) -> float:
    """max() that keeps a NaN (Python's max drops it depending on argument order)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def compare_point(point: str, ref: torch.Tensor, cand: torch.Tensor, tolerance: Tolerance,
                  noise: float | None = None) -> PointDiff:
    if tuple(ref.shape) != tuple(cand.shape):
        raise TracerError(f"shape mismatch at {point}: reference {tuple(ref.shape)}, candidate {tuple(cand.shape)}")
    if not (ref.is_floating_point() and cand.is_floating_point()):  # ids, not values: no rel_l2 measures them
        return PointDiff(point, layer_of(point), tuple(ref.shape), missing_on="neither", reason=INTEGER_POINT)
    r_all = compared_entries(point, ref).reshape(-1)
    c_all = compared_entries(point, cand).reshape(-1)
    sums = _sums(r_all, c_all, _metric_dtype(r_all, c_all), tolerance)
    rel_l2 = _rel_l2(*sums[:2])
    threshold = None if tolerance.elementwise else tolerance.threshold(noise)
    if threshold is not None and sums[-1] is not torch.float64 and abs(rel_l2 - threshold) <= BORDERLINE * threshold:
        sums = _sums(r_all, c_all, torch.float64, tolerance)  # a verdict this close is decided in f64
        rel_l2 = _rel_l2(*sums[:2])
    sq_ref, sq_diff, sq_cand, ref_dot_diff, max_abs, max_ref, any_outside, _ = sums
    if sq_ref > 0 and sq_cand > 0:
        cosine = _cosine(ref_dot_diff / sq_ref, sq_diff / sq_ref)
    else:
        cosine = float(sq_diff == 0)
    return PointDiff(
        point, layer_of(point), tuple(ref.shape), max_abs=max_abs, max_ref=max_ref,
        rel_l2=rel_l2, cosine=cosine, diverged=tolerance.exceeded(rel_l2, noise, any_outside),
        noise=noise, threshold=threshold,
    )


def _metric_dtype(ref: torch.Tensor, cand: torch.Tensor) -> torch.dtype:
    """f32, or f64 where either side is f64 (the noise floor's run): never below f32."""
    return torch.promote_types(torch.promote_types(ref.dtype, cand.dtype), torch.float32)


def _sums(r_all: torch.Tensor, c_all: torch.Tensor, dtype: torch.dtype, tolerance: Tolerance) -> tuple:
    """(Σr², Σd², Σc², Σr·d, max|d|, max|r|, any entry outside atol/rtol, dtype) over d = c − r in
    `dtype`, chunk by chunk: each chunk's sums by torch's cascade summation, the chunks' in f64, in
    order (a 2048-token lm_head is 100M values: no whole-tensor copy in any dtype). Up to
    BLOCK_CHUNKS chunks go through torch at once as the rows of one block: the same sums as one
    call per chunk (tests/unit/test_diff.py), for a fiftieth of the calls."""
    totals = [0.0, 0.0, 0.0, 0.0]  # Σr², Σd², Σc², Σr·d
    max_abs = max_ref = 0.0
    any_outside = False
    for start, stop in _blocks(r_all.numel()):
        r, c = _block(r_all, start, stop).to(dtype), _block(c_all, start, stop).to(dtype)
        diff = c - r
        for k, (a, b) in enumerate(((r, r), (diff, diff), (c, c), (r, diff))):
            for chunk_sum in _row_sums(a * b):
                totals[k] += chunk_sum
        max_abs, max_ref = _nan_max(max_abs, _max_magnitude(diff)), _nan_max(max_ref, _max_magnitude(r))
        if tolerance.elementwise and not any_outside:  # a bound crossed by one rounding: decided in f64
            any_outside = outside(tolerance, c.double() - r.double(), r.double())
    return *totals, max_abs, max_ref, any_outside, dtype


def _blocks(n: int):
    """(start, stop) over a flat tensor of `n` values: blocks of whole chunks, then the last, shorter chunk."""
    whole = n - n % CHUNK
    for start in range(0, whole, BLOCK_CHUNKS * CHUNK):
        yield start, min(start + BLOCK_CHUNKS * CHUNK, whole)
    if whole < n:
        yield whole, n


def _block(flat: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Whole chunks as rows (chunks, CHUNK); the last, shorter chunk as it is (n,)."""
    values = flat[start:stop]
    return values.reshape(-1, CHUNK) if (stop - start) % CHUNK == 0 else values


def _row_sums(values: torch.Tensor) -> list[float]:
    """The sum of each row of a block (one value for the last chunk)."""
    return values.sum(dim=-1).tolist() if values.dim() > 1 else [float(values.sum())]


def _cosine(u: float, v: float) -> float:
    """cos(c, r) from u = r·d/|r|² and v = |d|²/|r|² (c = r + d): 1 − (v − u²)/(s(s + 1 + u)) with
    s = |c|/|r| = √(1 + 2u + v). The ratios carry the sums' relative error only, so 1 − cos keeps
    its digits however close to 1 (c·r/(|c||r|) from f32 sums would be off by 1e-7)."""
    s = math.sqrt(max(0.0, 1 + 2 * u + v))
    if s == 0 or math.isnan(s):
        return math.nan if math.isnan(s) else 0.0
    if 1 + u <= 0:  # an angle past 90°: no cancellation to avoid (and c = −r/2 would divide 0 by 0)
        return max(-1.0, (1 + u) / s)
    return 1 - max(0.0, v - u * u) / (s * (s + 1 + u))


def _rel_l2(sq_ref: float, sq_diff: float) -> float:
    ref_norm, diff_norm = math.sqrt(sq_ref), math.sqrt(sq_diff)
    if math.isnan(ref_norm) or math.isnan(diff_norm):
        return math.nan  # a NaN on either side: never within any tolerance, not even rel_l2 <= inf
    return diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)


def compare_points(reference: Trace, candidate: Trace, tolerance: Tolerance,
                   noise: dict[str, float] | None = None, compared: dict[str, PointDiff] | None = None,
                   layout: SlotLayout | None = None) -> list[PointDiff]:
    """Every point either side recorded or declared unobservable, in execution order, each pair read in
    one layout (`paired`; `layout`: the one to use, default `slot_layout`'s); `compared`: points already
    judged as they were recorded (`ErrorRecorder` with a store)."""
    layout = layout if layout is not None else slot_layout(reference, candidate)
    order = list(reference.points)
    for extra in [*candidate.points, *reference.not_recorded, *candidate.not_recorded]:
        if extra not in order:
            order.append(extra)
    order = _execution_order(order, reference, candidate)
    return [compared[point] if compared and point in compared
            else point_diff(point, reference, candidate, tolerance, noise, layout) for point in order]


def point_diff(point: str, reference: Trace, candidate: Trace, tolerance: Tolerance,
               noise: dict[str, float] | None, layout: SlotLayout) -> PointDiff:
    """One point of two traces compared (read in `layout`), or why it is not: a side did not record it, or
    the two sides' cache layouts cannot be reconciled."""
    in_ref, in_cand = point in reference, point in candidate
    if in_ref and in_cand:
        pair = paired(point, reference, candidate, layout)
        if isinstance(pair, str):  # two cache layouts that cannot be reconciled: said, not compared
            return PointDiff(point, layer_of(point), None, missing_on="neither", reason=pair)
        return compare_point(point, *pair, tolerance, (noise or {}).get(point))
    missing_on = "both" if not (in_ref or in_cand) else ("candidate" if in_ref else "reference")
    reason = candidate.not_recorded.get(point) or reference.not_recorded.get(point)
    shape = tuple(reference[point].shape) if in_ref else tuple(candidate[point].shape) if in_cand else None
    return PointDiff(point, layer_of(point), shape, missing_on=missing_on, reason=reason)


def compare_at(points, reference: Trace, candidate: Trace, tolerance: Tolerance,
               noise: dict[str, float] | None = None) -> dict[str, PointDiff]:
    """Only `points` of two traces, each compared as `compare` compares it (layouts aligned, caches read in
    one slot layout, judged against `noise` at that point): two of a triangulation's candidates at the
    points its agreement table shows."""
    reference, candidate, _ = align(reference, candidate)
    layout = slot_layout(reference, candidate)
    return {point: point_diff(point, reference, candidate, tolerance, noise, layout) for point in points}


def tokens_cached(trace: Trace) -> int | None:
    """The tokens a decoded trace's KV cache took up to and including its own (from `cache_start`, the
    decode's first position, to its last token); None for a trace without token ids."""
    if trace.tokens is None:
        return None
    return (trace.meta.position_offset or 0) + len(trace.tokens) - (trace.meta.cache_start or 0)


def slot_layout(reference: Trace, candidate: Trace) -> SlotLayout:
    """How the two traces' caches and attention over them are read in one layout
    (`tracer.model.kv_cache.SlotLayout`), from what the traces say of their cache; traces without a cache
    point are a forward from an empty cache (it took their tokens only: each side attends to its own)."""
    said = reference if reference.tokens is not None else candidate
    rows = None if said.tokens is None else len(said.tokens)
    if not any(split_point(point)[1] in CACHE_POINTS for trace in (reference, candidate) for point in trace.points):
        return SlotLayout(rows or 0, rows or 0)
    return SlotLayout(tokens_cached(said), rows)


def paired(point: str, reference: Trace, candidate: Trace, layout: SlotLayout) -> tuple | str:
    """Both sides' tensors of `point` as they are compared: the last rows where one side kept only the
    last (candle's logits), a cache and the attention over it in one slot layout (`layout`); or why two
    cache layouts cannot be compared (one line)."""
    ref, cand = last_rows_if_one_side_kept_one(point, reference[point], candidate[point])
    return layout.pair(point, ref, cand)


def rejudged(diffs: dict[str, PointDiff], tolerance: Tolerance, noise: dict[str, float]) -> dict[str, PointDiff]:
    """Points an `ErrorRecorder` judged as they came, judged again against `noise` (a floor measured
    exactly since): their rel_l2 is all a relative-L2 verdict reads."""
    if tolerance.elementwise:
        return diffs
    return {name: dataclasses.replace(d, noise=noise.get(name), threshold=tolerance.threshold(noise.get(name)),
                                      diverged=tolerance.exceeded(d.rel_l2, noise.get(name)))
            if d.recorded and d.rel_l2 is not None else d for name, d in diffs.items()}


def rel_l2_by_point(reference: Trace, other: Trace) -> dict[str, float]:
    """Per point both traces hold, the rel_l2 of `other` against `reference` (noise floors, local
    errors, a regime's cost, per-op errors)."""
    return {p.point: p.rel_l2 for p in compare_points(reference, other, Tolerance()) if p.recorded}


class ErrorRecorder:
    """A recorder that compares each point with `reference` as the forward produces it.

    Without `store` it keeps no tensor: for the runs whose points are wanted only as errors (the
    f64 noise run, the teacher-forced local run, a forced run in f64; `rel_l2`), nothing is held
    in memory or written to disk, however long the prompt.

    With `store` (a `tracer.traces.spill.DiskRecorder`) it records a long run's candidate: each point is
    judged with `tolerance` and `noise` as `compare` judges it (`diffs`, which `compare` then takes
    as they are), and only the tensors `compare` reads again are written: the logits, points
    holding NaN or Inf, the earliest point that can be the first divergence (`local` errors are
    known before the candidate runs) and points it cannot pair with the reference. A long run
    then writes one trace to disk, not two.
    """

    def __init__(self, reference: Trace, tolerance: Tolerance | None = None, noise: dict[str, float] | None = None,
                 local: dict[str, float] | None = None, store=None, lowest_noise: dict[str, float] | None = None):
        self.reference, self.tolerance, self.local = reference, tolerance or Tolerance(), local
        self.noise = noise if noise is not None else {}  # (a live mapping may be empty when given)
        # the lowest the exact floor can be where `noise` is a cheap floor's scaled one: a point over it may
        # be the first divergence once the exact floor is measured (`tracer.pipeline.noise_floor`), kept as such
        self.lowest_noise = lowest_noise
        self.store = store
        self.diffs: dict[str, PointDiff] = {}
        self.names: list[str] = []  # every point recorded, in order
        self._earliest: dict[str, tuple] = {}  # "diverged" / "introduces" -> rank of the earliest kept

    @property
    def rel_l2(self) -> dict[str, float]:
        return {name: diff.rel_l2 for name, diff in self.diffs.items()}

    @property
    def tensors(self):
        """Empty without a store (the engines return a Trace of it); else the points, the kept ones readable."""
        if self.store is None:
            return {}
        return SpilledTensors(self.store.files, self.names)

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        if name not in self.reference:
            self._keep(name, tensor)
            return
        ref, cand = last_rows_if_one_side_kept_one(name, self.reference[name], kept(name, tensor))
        if self.store is not None and ref.shape != cand.shape:
            self._keep(name, tensor)  # `compare` says the mismatch
            return
        diff = compare_point(name, ref, cand, self.tolerance, self.noise.get(name))
        self.diffs[name] = diff
        if self.store is not None and self._read_again(diff):
            self._keep(name, tensor)

    def _keep(self, name: str, tensor: torch.Tensor) -> None:
        if self.store is not None:
            self.store(name, tensor)

    def _read_again(self, diff: PointDiff) -> bool:
        """Will `compare` read this point's tensor (logits, NaN/Inf scan, the first divergence's breakdown)?"""
        if diff.point in (LOGITS, FINAL_LOGITS) or not _finite_metrics(diff) or split_point(diff.point)[1] in ROUTING:
            return True  # (the routing points, (T, E) at most, are what the routing diff reads)
        if self.lowest_noise is not None and diff.point in self.lowest_noise:
            lowest = self.lowest_noise[diff.point]
            diff = dataclasses.replace(diff, diverged=self.tolerance.exceeded(diff.rel_l2, lowest),
                                       threshold=self.tolerance.threshold(lowest))
        if not diff.diverged:
            return False
        judged = dataclasses.replace(diff, local_rel_l2=self.local.get(diff.point)) if self.local else diff
        # the two ways `first_divergence` picks a point; the earliest by the order it sorts in
        ways = ["diverged", *(["introduces"] if introduces_error(judged) else [])]
        order = rank(diff.point, self.reference.meta.family)
        earlier = [way for way in ways if way not in self._earliest or order < self._earliest[way]]
        self._earliest.update(dict.fromkeys(earlier, order))
        return bool(earlier)


def _execution_order(names: list[str], reference: Trace, candidate: Trace) -> list[str]:
    """Unrecorded points take their place in the vocabulary's order (the traced family's), not the
    end of the list."""
    family = trace_family(reference, candidate)
    return sorted(names, key=lambda name: rank(name, family))


def trace_family(*traces: Trace) -> str | None:
    """The model family the traces were recorded on (`meta.family`; None for a trace without it)."""
    return next((t.meta.family for t in traces if t.meta.family), None)


def last_rows_if_one_side_kept_one(point: str, ref: torch.Tensor, cand: torch.Tensor):
    """candle's forward keeps only the last position's logits ([1, V]); transformers has [T, V].
    Then both are compared on the last position alone (`compare` says so in its notes)."""
    if point in (LOGITS, FINAL_LOGITS) and ref.dim() == cand.dim() == 2 and 1 in (ref.shape[0], cand.shape[0]):
        return ref[-1:], cand[-1:]
    return ref, cand


def logits_note(reference: Trace, candidate: Trace) -> list[str]:
    if LOGITS not in reference or LOGITS not in candidate:
        return []
    rows = {"reference": reference[LOGITS].shape[0], "candidate": candidate[LOGITS].shape[0]}
    if len(set(rows.values())) == 1 or 1 not in rows.values():
        return []
    short = next(side for side, n in rows.items() if n == 1)
    return [f"the {short} recorded lm_head at the last position only; logits are compared there alone"]


def output_logits(reference: Trace, candidate: Trace) -> str:
    """The point holding what the model returns: Gemma's capped logits where both sides have them."""
    return FINAL_LOGITS if FINAL_LOGITS in reference and FINAL_LOGITS in candidate else LOGITS


def logits_summary(reference: Trace, candidate: Trace) -> LogitsSummary | None:
    """Logits at the last position (what candle returns and the notes quote) and over all positions:
    the model's output (soft-capped in Gemma 2)."""
    point = output_logits(reference, candidate)
    if point not in reference or point not in candidate:
        return None
    ref, cand = last_rows_if_one_side_kept_one(point, reference[point], candidate[point])
    if ref.shape != cand.shape:
        return None  # already reported as a shape mismatch by compare_points
    last_ref, last_diff = ref[-1].double(), cand[-1].double() - ref[-1].double()
    rows = max(1, CHUNK // max(1, ref.shape[-1]))  # f64 copies of a long text's logits do not fit twice
    chunks = [float((cand[i:i + rows].double() - ref[i:i + rows].double()).abs().max())
              for i in range(0, ref.shape[0], rows)]
    max_abs_all = math.nan if any(math.isnan(v) for v in chunks) else max(chunks)  # max() would drop a NaN
    return LogitsSummary(
        max_abs=float(last_diff.abs().max()),
        max_ref=float(last_ref.abs().max()),
        rel_l2=float(last_diff.norm() / last_ref.norm()),
        max_abs_all=max_abs_all,
        argmax_agree=float((cand.argmax(-1) == ref.argmax(-1)).double().mean()),
        positions=int(ref.shape[0]),
        next_token_accuracy=_next_token_accuracy(ref, cand, reference.tokens),
    )


def _next_token_accuracy(ref: torch.Tensor, cand: torch.Tensor, tokens: list[int] | None) -> dict | None:
    """How often each side's argmax at position t is the text's token t+1 (positions aligned to the end)."""
    if not tokens or ref.shape[0] < 2 or ref.shape[0] > len(tokens):
        return None
    targets = torch.tensor(tokens[len(tokens) - ref.shape[0] + 1:])  # (rows - 1,)
    return {side: float((logits[:-1].argmax(-1) == targets).double().mean())
            for side, logits in (("reference", ref), ("candidate", cand))}


def introduces_error(p: PointDiff) -> bool:
    """Its local error (on the reference's inputs) leaves the floor; without one, its total error does."""
    if p.local_rel_l2 is None or p.threshold is None:
        return p.diverged
    return not p.local_rel_l2 <= p.threshold


def first_divergence(points: list[PointDiff]) -> Divergence | None:
    """The first point that introduces error, with how well everything upstream of it agrees.

    With local errors known, that is the first point whose *local* error leaves the floor; if
    error only accumulates past tolerance without any op introducing it, the first point whose
    total error does.
    """
    index = next((i for i, p in enumerate(points) if p.diverged and introduces_error(p)), None)
    localized_by = "local" if any(p.local_rel_l2 is not None for p in points) else "total"
    if index is None:
        index, localized_by = next((i for i, p in enumerate(points) if p.diverged), None), "total"
    if index is None:
        return None
    p = points[index]
    upstream = [q for q in points[:index] if q.recorded]
    after = next((i + 1 for i in range(index - 1, -1, -1) if points[i].recorded), 0)  # past the last agreeing
    unseen = () if p.local_rel_l2 is not None else tuple(q.point for q in points[after:index])
    return Divergence(
        p.point, p.layer, p.shape, max_abs=p.max_abs, max_ref=p.max_ref, rel_l2=p.rel_l2, cosine=p.cosine,
        noise=p.noise, threshold=p.threshold, local_rel_l2=p.local_rel_l2, index=index, localized_by=localized_by,
        last_agreeing=upstream[-1].point if upstream else None, upstream_points=len(upstream),
        upstream_max_rel_l2=max((q.rel_l2 for q in upstream), default=None), unseen=unseen,
    )


def num_heads(trace: Trace, layer: int | None) -> int | None:
    """Query heads, read off the recorded q after RoPE (heads, T, D) of that layer."""
    q_rope = layer_point(layer, Q_ROPE)
    return int(trace[q_rope].shape[0]) if layer is not None and q_rope in trace else None


def explain_divergence(first: Divergence, reference: Trace, candidate: Trace, layout: SlotLayout) -> Divergence:
    """The first divergence with its breakdowns (per position, head, channel) and the hints they suggest;
    both sides read in the layout they were compared in."""
    point = first.point
    ref, cand = paired(point, reference, candidate, layout)
    details = breakdown(point, ref, cand, num_heads(reference, first.layer))
    family, engines = trace_family(reference, candidate), (reference.meta.engine, candidate.meta.engine)
    return dataclasses.replace(
        first, by_position=tuple(details["by_position"]), by_head=_tuple_or_none(details["by_head"]),
        top_channels=_tuple_or_none(details["top_channels"]),
        hints=tuple(runtime_hints(point, family, engines) + hints(point, details, family, unseen=first.unseen)),
    )


def _tuple_or_none(values: list | None) -> tuple | None:
    return None if values is None else tuple(values)


def side(trace: Trace) -> dict:
    """How a result names one side: engine, knobs, label, device, and a non-PyTorch runtime's
    name and version."""
    engine, runtime = trace.meta.engine, trace.meta.runtime
    return {"engine": "file" if engine is None else engine, "variant": trace.variant, "label": trace.label,
            "device": trace.meta.device, **({"runtime": runtime} if runtime else {})}


def compare(reference: Trace, candidate: Trace, tolerance: Tolerance | None = None,
            noise: dict[str, float] | None = None, local: dict[str, float] | None = None,
            compared: dict[str, PointDiff] | None = None, routed: dict[str, float] | None = None) -> Result:
    """Diff two traces point by point; name the first divergence and explain it.

    Args:
        noise: per point, the rel_l2 pure f32 rounding makes (`tracer.pipeline.noise_floor.estimate_noise`);
            points are judged against it. Without it the fixed `tolerance.rel_l2` applies.
        local: per point, the rel_l2 the candidate introduces on the reference's inputs
            (`tracer.pipeline.run.local_errors`); localization then names the first point whose
            local error leaves the floor, and `amplification` ranks ops by error gain.
        compared: per point, the `PointDiff` a long run's candidate recorder judged as it came
            (`ErrorRecorder` with a store, given the same tolerance and noise); not judged again.
        routed: per point of a MoE layer after its routing, the rel_l2 the candidate introduces on the
            reference's inputs and routing (`tracer.pipeline.run.routed_errors`); the first divergence at a
            router or its experts then says whether the router or the experts are wrong.
    """
    tolerance = tolerance or Tolerance()
    ref_tokens, cand_tokens = reference.tokens, candidate.tokens
    if ref_tokens is not None and cand_tokens is not None and list(ref_tokens) != list(cand_tokens):
        raise TracerError(f"the traces ran other token ids: {ids_text(ref_tokens)} vs {ids_text(cand_tokens)}")
    starts = [trace.meta.position_offset or 0 for trace in (reference, candidate) if trace.meta.engine != "file"]
    if len(set(starts)) > 1:  # a dump from another runtime says no position: taken as it is
        raise TracerError(f"the traces were recorded at different positions: from {starts[0]} vs from {starts[1]}")
    reference, candidate, layout_notes = align(reference, candidate)
    layout = slot_layout(reference, candidate)  # the caches' layouts, reconciled point by point
    points = compare_points(reference, candidate, tolerance, noise, compared, layout)
    if not any(p.recorded for p in points):
        unknown = [*(reference.meta.unknown_names or []), *(candidate.meta.unknown_names or [])]
        said = f"; names that match no alias: {', '.join(unknown[:3])}" if unknown else ""
        raise TracerError(f"the traces share no point to compare (reference: {len(reference)} points, "
                          f"candidate: {len(candidate)}{said}); see docs/trace-format.md for the names tracer reads")
    if local:
        points = [dataclasses.replace(p, local_rel_l2=local.get(p.point)) if p.recorded else p for p in points]
    if routed:
        points = [dataclasses.replace(p, routed_local_rel_l2=routed.get(p.point)) if p.recorded else p
                  for p in points]
    family = trace_family(reference, candidate)
    first = first_divergence(points)
    routing = routing_diff(reference, candidate, family, first, frozenset(p.point for p in points if p.diverged))
    near_tie_notes = []
    if routing is not None and first is not None:
        points = judged_before_near_ties(points, routing, reference, candidate, tolerance, noise, layout)
        first = first_divergence(points)
        near_tie_notes = near_tie_note(points)
    if first:
        first = explain_divergence(first, reference, candidate, layout)
        first = dataclasses.replace(first, hints=(*routed_hints(first.point, points), *first.hints))
    return Result(
        verdict="diverged" if first else "match",
        points=tuple(points),
        first_divergence=first,
        logits=logits_summary(reference, candidate),
        tolerance=tolerance,
        reference=side(reference),
        candidate=side(candidate),
        model=reference.meta.model,
        tokens=ref_tokens or cand_tokens,
        notes=(*layout_notes, *layout.notes(), *logits_note(reference, candidate),
               *routing_notes(routing, first, family), *near_tie_notes),
        # A point whose metrics are all finite holds no NaN or Inf on either side: only the rest is scanned.
        first_nonfinite=first_nonfinite([p.point for p in points if not _finite_metrics(p)], reference, candidate),
        amplification=tuple(_amplification(points, family)),
        routing=routing,
    )


def judged_before_near_ties(points: list[PointDiff], routing: RoutingDiff, reference: Trace, candidate: Trace,
                            tolerance: Tolerance, noise: dict[str, float] | None,
                            layout: SlotLayout) -> list[PointDiff]:
    """The points past a near-tie routing flip judged on the tokens before it only.

    A near-tie flip at layer L, token t sends t to other experts on a margin within the noise (docs/moe.md):
    from there on, every row from t is the flip's consequence, not an op's error (attention carries it to the
    later tokens; a causal model keeps the earlier ones out of it). Such points are judged on their rows
    before t (`PointDiff.reason` says so), and not at all where no row comes before t: never called a
    divergence, never called a match on rows that went elsewhere.
    """
    where = {p.point: n for n, p in enumerate(points)}  # execution order, as compared
    cuts = [(where[layer_point(flip.layer, TOP_K_INDEX)], flip.token) for flip in routing.flips
            if flip.kind == NEAR_TIE and layer_point(flip.layer, TOP_K_INDEX) in where]
    if not cuts:
        return points
    judged = []
    for at, p in enumerate(points):
        tokens = [token for after, token in cuts if after < at]
        if not tokens or not p.recorded:
            judged.append(p)
            continue
        cut = min(tokens)
        flip = next(f for f in routing.flips if f.kind == NEAR_TIE and f.token == cut)
        why = f"a near-tie flip at layer {flip.layer} token {cut} sent it to other experts"
        pair = paired(p.point, reference, candidate, layout) if p.point in reference and p.point in candidate \
            else "not held"
        rows = None if isinstance(pair, str) else before_token(p.point, *pair, cut, len(reference.tokens or ()))
        if rows is None:
            judged.append(PointDiff(p.point, p.layer, p.shape, missing_on="neither",
                                    reason=f"not judged: {why}"))
            continue
        within = compare_point(p.point, *rows, tolerance, (noise or {}).get(p.point))
        judged.append(dataclasses.replace(within, shape=p.shape, local_rel_l2=p.local_rel_l2,
                                          routed_local_rel_l2=p.routed_local_rel_l2,
                                          reason=f"judged on tokens 0-{cut - 1}: {why}"))
    return judged


def near_tie_note(points: list[PointDiff]) -> list[str]:
    """What `judged_before_near_ties` left out, in one note (none when it left nothing out)."""
    partly = [p for p in points if p.recorded and (p.reason or "").startswith("judged on tokens")]
    unjudged = [p for p in points if not p.recorded and (p.reason or "").startswith("not judged: a near-tie")]
    if not partly and not unjudged:
        return []
    first = (partly or unjudged)[0]
    flip = first.reason.split(": ", 1)[1].removesuffix(" sent it to other experts")
    return [f"routing: {flip} sent that token to other experts on a noise-level margin; from {first.point} on, "
            f"{len(partly)} points are judged on the tokens before it and {len(unjudged)} not at all"]


def before_token(point: str, ref: torch.Tensor, cand: torch.Tensor, cut: int, tokens: int):
    """Both sides' rows of the tokens before `cut` (`tracer.traces.trace.rows_before`), or None."""
    rows = [rows_before(point, x, cut, tokens) for x in (ref, cand)]
    return None if any(x is None for x in rows) else tuple(rows)


def _finite_metrics(p: PointDiff) -> bool:
    return p.recorded and all(math.isfinite(v) for v in (p.max_abs, p.max_ref, p.rel_l2))


def _amplification(points: list[PointDiff], family: str | None = None) -> list[dict]:
    return amplification({p.point: p.rel_l2 for p in points if p.recorded and p.rel_l2 is not None}, family=family)
