"""The routing diff: per layer and token of a mixture-of-experts model, does the candidate send the token to
the experts the reference sends it to, in the same order, and with what weights (docs/moe.md).

Traces are data and the diff is a value, as everywhere in the comparison: `routing_diff` reads two traces'
routing points (`mlp.gate.top_k_index` and the scores and weights beside it) and returns a `RoutingDiff`,
whose `bool` says there is no structural flip.

A token-layer whose picked experts differ as a set is a *flip*, and every flip is classified by the
reference's margin against the error that reaches the router at that token:

- **near-tie**: the gap between the reference's selection scores that the candidate's picks overturn (the
  best expert it drops minus the worst it adds; for a swap at the boundary, the k-th minus the (k+1)-th
  score) is at most `NEAR_TIE_FACTOR` times that error. Noise: counted and shown, never a divergence. An
  exact tie (margin 0, as bf16 router scores often are) is always one.
- **structural**: the gap is larger: no error the router's input carries explains it, so the router (or a
  step after its input: scoring, a bias, the selection) is wrong. The first one is the finding.

The error that reaches the router is measured at the router's *input* (the point the router reads, both
sides recorded): at token t, `e_t = |δx_t| / |x_t|`, the relative error of the input row (never below
the house's noise floor, nor below the unit roundoff of the router logits' coarser dtype), carried through
the router's linear map as `e_t · max_e |l_t,e|` on the reference's logits. The candidate's own scores
cannot serve: a flip by itself moves the two swapped scores by at least half the margin, so the scores'
error always "explains" the flip, a wrong router's included. Where the input is not recorded on both
sides the error is taken at the router's logits, and without logits at the selection scores themselves:
there the measured error is the router's own output's and may hold its fault, so a layer's flips are judged
only where that point stays within its tolerance (`diverged`), and are unjudged where it diverges.
`RoutingDiff.error_source` and its note say which measure was used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tracer.comparison.result import NOISE_FACTOR, NOISE_FLOOR, Divergence, json_safe
from tracer.core.errors import TracerError
from tracer.core.renderers import render
from tracer.model.points import (
    POST_ATTENTION_NORM,
    PRE_FF_NORM,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    ROUTER_SELECTION,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    layer_point,
    rank,
    source_point,
    split_point,
)
from tracer.traces.trace import Trace

# A flip is a near-tie when the reference's overturned margin is within NEAR_TIE_FACTOR × the error reaching
# the router. 2: the swapped experts' scores each move by up to that error, so their gap moves by twice it.
# NOISE_FACTOR (10, the house's factor over measured f32 noise): the input's error, measured as a norm over
# the row, reaches one expert's logit with its own alignment to that expert's router row, and the router's
# own rounding rides on it. softmax and sigmoid move a score by at most 1/2 and 1/4 of its logit's move, so
# a bound in logits is a bound in scores with room to spare.
NEAR_TIE_FACTOR = 2 * NOISE_FACTOR

# The routing points, under `layers.N.` (what a long run's recorder keeps for this diff to read).
ROUTING = (ROUTER_LOGITS, ROUTER_SCORES, ROUTER_SELECTION, TOP_K_INDEX, TOP_K_WEIGHTS)

# What one token-layer's routing is, as the map and the JSON show it.
AGREE, ORDER, NEAR_TIE, STRUCTURAL, UNJUDGED = "agree", "order", "near_tie", "structural", "unjudged"

# How the error reaching the router was measured, strongest first (`RoutingDiff.error_source`).
SOURCES = {
    "input": "the router's input, carried through its logits",
    "logits": "the router's logits (its input is not recorded on both sides): its flips are judged only where "
              "the logits stay within their tolerance, and unjudged where they diverge",
    "scores": "the selection scores themselves (neither the router's input nor its logits recorded on both "
              "sides): its flips are judged only where the scores stay within their tolerance, and unjudged "
              "where they diverge",
}


@dataclass(frozen=True)
class Flip:
    """One token-layer whose picked experts differ as a set."""

    layer: int
    token: int
    kind: str  # NEAR_TIE | STRUCTURAL | UNJUDGED (no selection scores, or no error measured apart from the router's)
    reference: tuple[int, ...]  # the reference's experts, in its top-k order
    candidate: tuple[int, ...]
    margin: float | None  # the reference's selection gap the candidate's picks overturn
    error: float | None  # the error reaching the router's selection at this token

    def text(self) -> str:
        """"layer 1 token 3, experts {0,2} -> {0,3}, margin 0.3 >> error 3e-06" (phrased by the reports)."""
        return render("flip_text", self.to_dict())

    def to_dict(self) -> dict:
        return {"layer": self.layer, "token": self.token, "kind": self.kind, "reference": list(self.reference),
                "candidate": list(self.candidate), "margin": self.margin, "error": self.error}


@dataclass(frozen=True)
class LayerRouting:
    """One layer's routing compared, token by token (a row of the layer × token map)."""

    layer: int
    k: int  # experts per token (the reference's)
    status: tuple[str, ...]  # per token: AGREE | ORDER | NEAR_TIE | STRUCTURAL | UNJUDGED
    margin: tuple[float | None, ...]  # per token, the reference's k-th minus (k+1)-th selection score
    error: tuple[float | None, ...]  # per token, the error reaching the router's selection
    error_at: str | None  # the point the error reaching the router was measured at (None: nowhere)
    weight_max_abs: float | None  # max |w_c - w_r| over the experts both picked (None: weights not on both)
    weight_max_ref: float | None  # max |w_r| there

    @property
    def tokens(self) -> int:
        return len(self.status)

    def count(self, *kinds: str) -> int:
        return sum(status in kinds for status in self.status)

    @property
    def agreement(self) -> float:
        """The fraction of tokens routed to the same set of experts (order aside)."""
        return self.count(AGREE, ORDER) / self.tokens if self.tokens else 1.0

    def to_dict(self) -> dict:
        return {"layer": self.layer, "k": self.k, "tokens": self.tokens, "agreement": self.agreement,
                "flips": self.tokens - self.count(AGREE, ORDER), "near_ties": self.count(NEAR_TIE),
                "structural": self.count(STRUCTURAL), "order_only": self.count(ORDER),
                "error_at": self.error_at,
                "weight_max_abs": self.weight_max_abs, "weight_max_ref": self.weight_max_ref,
                "status": list(self.status), "margin": list(self.margin), "error": list(self.error)}


@dataclass(frozen=True)
class RoutingDiff:
    """Two traces' routing compared (`routing_diff`). `bool(diff)`: no structural flip (near-ties are noise;
    unjudged flips are counted and said, never called either).

    Example (one layer, two tokens, the same router input on both sides; the candidate's router sends token 1
    to expert 2 instead of 3, a margin of 0.35 in the reference's scores: a wrong router, structural):
        >>> def side(logits):
        ...     points = {"post_attention_layernorm": torch.ones(2, 4), "mlp.gate": logits,
        ...               "mlp.gate.scores": logits.softmax(-1), "mlp.gate.top_k_index": logits.topk(2).indices}
        ...     return tracer.Trace({f"model.layers.0.{name}": x for name, x in points.items()},
        ...                         tracer.TraceMeta(engine="example", variant={}, tokens=[1, 2]))
        >>> logits = torch.tensor([[0.5, 0.1, 0.3, 0.1], [0.05, 0.5, 0.05, 0.4]]).log()
        >>> wrong = logits.clone(); wrong[1, 2] = 0.6
        >>> diff = routing_diff(side(logits), side(wrong))
        >>> bool(diff), diff.first_structural.token, diff.first_structural.reference, diff.first_structural.candidate
        (False, 1, (1, 3), (2, 1))
    """

    layers: tuple[LayerRouting, ...]
    flips: tuple[Flip, ...]  # every set flip, layer by layer, token by token
    error_source: str  # a key of SOURCES: where the error reaching the router was measured
    # The first divergent point upstream of the first structural flip's router, which the flip inherits.
    inherits: str | None = None

    def __bool__(self) -> bool:
        return self.first_structural is None

    @property
    def first_structural(self) -> Flip | None:
        return next((flip for flip in self.flips if flip.kind == STRUCTURAL), None)

    def counts(self) -> dict[str, int]:
        def total(*kinds):
            return sum(layer.count(*kinds) for layer in self.layers)
        return {"tokens": sum(layer.tokens for layer in self.layers), "agree": total(AGREE, ORDER),
                "order_only": total(ORDER), "flips": len(self.flips), "near_ties": total(NEAR_TIE),
                "structural": total(STRUCTURAL), "unjudged": total(UNJUDGED)}

    @property
    def agreement(self) -> float:
        counts = self.counts()
        return counts["agree"] / counts["tokens"] if counts["tokens"] else 1.0

    @property
    def weight_max_abs(self) -> float | None:
        errors = [layer.weight_max_abs for layer in self.layers if layer.weight_max_abs is not None]
        return max(errors) if errors else None

    def text(self) -> str:
        """The summary line: "routing: 100% of 14 token-layers agree", with the flips and the first
        structural one (phrased by the reports, from `to_dict`)."""
        return render("routing_line", {"routing": self.to_dict()})

    def note(self) -> str | None:
        """What the error measure could not tell, where it is weaker than the router's input."""
        return None if self.error_source == "input" else f"routing: the error reaching the router is measured " \
                                                         f"at {SOURCES[self.error_source]}"

    def to_dict(self) -> dict:
        first = self.first_structural
        return json_safe({
            **self.counts(), "agreement": self.agreement, "near_tie_factor": NEAR_TIE_FACTOR,
            "error_source": self.error_source, "weight_max_abs": self.weight_max_abs,
            "first_structural": None if first is None else {**first.to_dict(), "inherits": self.inherits},
            "layers": [layer.to_dict() for layer in self.layers], "flipped": [flip.to_dict() for flip in self.flips],
        })


def routed_layers(reference: Trace, candidate: Trace) -> list[int]:
    """The layers both traces recorded picked experts for."""
    layers = {split_point(point)[0] for point in reference.points if split_point(point)[1] == TOP_K_INDEX}
    return sorted(layer for layer in layers if layer_point(layer, TOP_K_INDEX) in candidate)


def routing_diff(reference: Trace, candidate: Trace, family: str | None = None,
                 first: Divergence | None = None, diverged: frozenset[str] = frozenset()) -> RoutingDiff | None:
    """Compare the routing of two traces that carry routing points; None where they do not both.

    Args:
        family: the traced family (orders the points: where the router's input is, what is upstream of it).
        first: the comparison's first divergence; a structural flip downstream of it inherits it.
        diverged: the points the comparison found diverged. Where the router's input is not recorded on both
            sides and the point the error is measured at instead (the logits, the scores) diverged, that
            error may be the router's own fault: the layer's flips are unjudged, not called noise.
    """
    layers = routed_layers(reference, candidate)
    if not layers:
        return None
    compared = [_layer(layer, reference, candidate, family, diverged) for layer in layers]
    # the weakest measure any layer had is the one said
    source = max((source for _, _, source in compared if source is not None), key=list(SOURCES).index,
                 default="scores")
    flips = tuple(flip for _, layer_flips, _ in compared for flip in layer_flips)
    diff = RoutingDiff(tuple(layer for layer, _, _ in compared), flips, source)
    structural = diff.first_structural
    if structural is not None and first is not None and _upstream(first.point, structural.layer, family):
        diff = RoutingDiff(diff.layers, diff.flips, source, inherits=first.point)
    return diff


def _upstream(point: str, layer: int, family: str | None) -> bool:
    """Is `point` computed before layer `layer`'s router?"""
    at = split_point(point)[0]
    if at is None:
        return rank(point, family) < rank(layer_point(layer, ROUTER_LOGITS), family)
    return at < layer or (at == layer and rank(point, family) < rank(layer_point(layer, ROUTER_LOGITS), family))


def _layer(layer: int, reference: Trace, candidate: Trace, family: str | None, diverged: frozenset[str]):
    """(LayerRouting, its flips, the error source) of one layer."""
    ref_index, cand_index = reference[layer_point(layer, TOP_K_INDEX)], candidate[layer_point(layer, TOP_K_INDEX)]
    if ref_index.shape[0] != cand_index.shape[0]:
        raise TracerError(f"the routing of layer {layer} covers other tokens: reference {tuple(ref_index.shape)}, "
                          f"candidate {tuple(cand_index.shape)}")
    selection = _first_of(reference, layer, (ROUTER_SELECTION, ROUTER_SCORES))  # (T, E) or None
    experts = max(int(ref_index.max()), int(cand_index.max())) + 1
    experts = max(experts, selection.shape[-1]) if selection is not None else experts
    ref_set, cand_set = _picked(ref_index, experts), _picked(cand_index, experts)  # (T, E) bool each
    same_set = (ref_set == cand_set).all(-1)  # (T,)
    same_order = same_set & (ref_index == cand_index).all(-1) if ref_index.shape == cand_index.shape else same_set
    k = ref_index.shape[-1]
    margin = _boundary_margin(selection, k) if selection is not None else None  # (T,)
    error, source, at = _router_error(layer, reference, candidate, family)  # (T,) or None
    judged = source == "input" or at not in diverged  # a weaker measure that diverged may hold the fault
    overturned = _overturned(selection, ref_set, cand_set) if selection is not None else None  # (T,)
    status, flips = [], []
    for token in range(ref_index.shape[0]):
        if same_order[token]:
            status.append(AGREE)
            continue
        if same_set[token]:
            status.append(ORDER)
            continue
        gap = None if overturned is None else float(overturned[token])
        err = None if error is None else float(error[token])
        gap = None if gap is None or math.isnan(gap) else gap
        kind = UNJUDGED if gap is None or err is None or not judged else \
            NEAR_TIE if gap <= NEAR_TIE_FACTOR * err else STRUCTURAL
        status.append(kind)
        flips.append(Flip(layer, token, kind, tuple(map(int, ref_index[token])), tuple(map(int, cand_index[token])),
                          gap, err))
    weights = _weight_error(layer, reference, candidate, ref_set & cand_set, experts)
    return (LayerRouting(layer, k, tuple(status), _floats(margin, len(status)), _floats(error, len(status)),
                         at, *weights), flips, source if selection is not None else None)


def _floats(values: torch.Tensor | None, n: int) -> tuple[float | None, ...]:
    return (None,) * n if values is None else tuple(float(v) for v in values)


def _first_of(trace: Trace, layer: int, subs: tuple[str, ...]) -> torch.Tensor | None:
    """The first of `subs` the trace recorded at `layer`, as f64 (T, E)."""
    tensor = next((t for t in (_tensor(trace, layer_point(layer, sub)) for sub in subs) if t is not None), None)
    return None if tensor is None else _rows(tensor)  # (T, E)


def _picked(index: torch.Tensor, experts: int) -> torch.Tensor:
    """(T, k) expert ids -> (T, E) bool, True where picked."""
    return torch.zeros(index.shape[0], experts, dtype=torch.bool).scatter(1, index.long(), True)


def _boundary_margin(selection: torch.Tensor, k: int) -> torch.Tensor:
    """Per token, the reference's k-th minus its (k+1)-th selection score (0 where every expert is picked)."""
    if selection.shape[-1] <= k:
        return torch.zeros(selection.shape[0], dtype=torch.float64)
    top = selection.topk(k + 1, dim=-1).values  # (T, k + 1), descending
    return top[:, k - 1] - top[:, k]


def _overturned(selection: torch.Tensor, ref_set: torch.Tensor, cand_set: torch.Tensor) -> torch.Tensor:
    """Per token, the largest gap in the reference's selection the candidate's picks overturn: the best expert
    it drops minus the worst it adds (0 where none; a candidate picking more or fewer experts overturns the
    reference's worst pick or best unpicked one)."""
    inf = torch.tensor(math.inf, dtype=torch.float64)
    dropped, added = ref_set & ~cand_set, cand_set & ~ref_set  # (T, E) each
    best_dropped = torch.where(dropped, selection, -inf).amax(-1)  # (T,)
    worst_kept = torch.where(ref_set, selection, inf).amin(-1)
    best_dropped = torch.where(dropped.any(-1), best_dropped, worst_kept)
    worst_added = torch.where(added, selection, inf).amin(-1)
    best_unpicked = torch.where(ref_set, -inf, selection).amax(-1)
    worst_added = torch.where(added.any(-1), worst_added, best_unpicked)
    gap = best_dropped - worst_added  # (T,)
    # below 0: the candidate added an expert the reference scored above one it picked, so the reference's picks
    # are not the top-k of these scores (DeepSeek-V3's group limit masked it): no margin to read (nan, unjudged)
    return torch.where(gap < 0, torch.nan, gap)


def _router_error(layer: int, reference: Trace, candidate: Trace, family: str | None):
    """(per token the error reaching the router's selection (T,), its source, the point it was measured at),
    measured as strongly as the traces allow (the module's docstring)."""
    logits = layer_point(layer, ROUTER_LOGITS)
    ref_logits, cand_logits = _tensor(reference, logits), _tensor(candidate, logits)
    floor = _floor(ref_logits, cand_logits)
    inp = _router_input(layer, reference, candidate, family)
    if inp is not None and ref_logits is not None:
        x_ref, x_cand = (_rows(trace[inp]) for trace in (reference, candidate))  # (T, C) each
        relative = (x_cand - x_ref).norm(dim=-1) / x_ref.norm(dim=-1).clamp(min=torch.finfo(torch.float64).tiny)
        scale = _rows(ref_logits).abs().amax(-1)  # (T,)
        return relative.clamp(min=floor) * scale, "input", inp
    if ref_logits is not None and cand_logits is not None and ref_logits.shape == cand_logits.shape:
        ref, cand = _rows(ref_logits), _rows(cand_logits)  # (T, E) each
        return torch.maximum((cand - ref).abs().amax(-1), floor * ref.abs().amax(-1)), "logits", logits
    for point in (layer_point(layer, ROUTER_SELECTION), layer_point(layer, ROUTER_SCORES)):
        ref, cand = _tensor(reference, point), _tensor(candidate, point)
        if ref is not None and cand is not None and ref.shape == cand.shape:
            return (_rows(cand) - _rows(ref)).abs().amax(-1), "scores", point
    return None, "scores", None


def _router_input(layer: int, reference: Trace, candidate: Trace, family: str | None) -> str | None:
    """The point the router reads, recorded on both sides: as the family declares it, else the MLP's input in
    the families tracer knows (the pre-feed-forward norm where there is one, else the post-attention norm)."""
    said = source_point(layer_point(layer, ROUTER_LOGITS), family)
    for point in (said, layer_point(layer, PRE_FF_NORM), layer_point(layer, POST_ATTENTION_NORM)):
        pair = [None if point is None else _tensor(trace, point) for trace in (reference, candidate)]
        if None not in pair and pair[0].shape == pair[1].shape:
            return point
    return None


def _tensor(trace: Trace, point: str) -> torch.Tensor | None:
    """A point's tensor, or None where the trace did not record it or did not keep it (a long run's candidate
    keeps the routing points, not the router's input: the diff then measures at the logits and says so)."""
    try:
        return trace[point] if point in trace else None
    except KeyError:
        return None


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """A rows point ((1, T, X) or (T, X)) as f64 (T, X)."""
    return tensor.reshape(-1, tensor.shape[-1]).double()  # (T, X)


def _floor(*logits: torch.Tensor | None) -> float:
    """The smallest relative error taken to reach the router: the house's noise floor, or the unit roundoff of
    the coarser dtype the router's logits were recorded in (bf16: 2e-3), whichever is larger."""
    dtypes = [tensor.dtype for tensor in logits if tensor is not None and tensor.is_floating_point()]
    roundoff = max((torch.finfo(dtype).eps / 2 for dtype in dtypes), default=0.0)
    return max(NOISE_FLOOR, roundoff)


def _weight_error(layer: int, reference: Trace, candidate: Trace, shared: torch.Tensor, experts: int):
    """(max |w_c - w_r|, max |w_r|) over the experts both sides picked, matched by expert, not by slot; (None,
    None) where the weights are not recorded on both sides."""
    point = layer_point(layer, TOP_K_WEIGHTS)
    recorded = [_tensor(trace, point) for trace in (reference, candidate)]
    if None in recorded or not shared.any():
        return None, None
    dense = []
    for trace, weights in zip((reference, candidate), recorded):
        index = trace[layer_point(layer, TOP_K_INDEX)].long()  # (T, k)
        weights = weights.reshape(index.shape).double()  # (T, k)
        dense.append(torch.zeros(index.shape[0], experts, dtype=torch.float64).scatter(1, index, weights))  # (T, E)
    ref, cand = dense
    return float((cand - ref).abs()[shared].max()), float(ref.abs()[shared].max())


def routing_notes(diff: RoutingDiff | None, first: Divergence | None, family: str | None = None) -> list[str]:
    """What the comparison's notes say of the routing beside the first divergence: a weaker error measure, a
    first divergence downstream of near-tie flips only (the tokens went elsewhere on noise-level margins, so
    the error there may be the flips', not an op's), a structural flip where no point leaves its tolerance."""
    if diff is None:
        return []
    notes = [diff.note()] if diff.note() else []
    near = next((flip for flip in diff.flips if flip.kind == NEAR_TIE), None)
    if diff and first is not None and near is not None and not _upstream(first.point, near.layer, family):
        notes.append(f"the first divergence {first.point} follows {diff.counts()['near_ties']} near-tie routing "
                     f"flip(s), the first at {near.text()}: tokens went to other experts on noise-level margins")
    if not diff and first is None:
        notes.append(f"routing: a structural flip where no point leaves its tolerance: "
                     f"{diff.first_structural.text()}")
    return notes
