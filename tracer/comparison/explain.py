"""Why a point diverges: breakdowns of its error and hints read from their signature.

Pure functions over the two tensors of one point (reference, candidate), in the point layouts
of `tracer.model.points`: most points are (T, X); q_rope/k_rope are (heads, T, D) and scores/probs
(H, T, T), whose query position is axis 1.
"""

from __future__ import annotations

import math

import torch

from tracer.engines.registry import ENGINES
from tracer.model.component import registered
from tracer.model.points import (
    CONTEXT,
    EXPERTS,
    MLP,
    Q_PROJ,
    ROUTER_LOGITS,
    causal_allowed,
    has_head_axis,
    is_causal,
    layer_point,
    op_kind,
    source_point,
    split_point,
)

TOP_CHANNELS = 5
# A position or head counts as untouched when its error is this small against the largest one.
QUIET = 1e-6


def _error(point: str, ref: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """|cand - ref| in f64, with never-attended (masked) entries zeroed."""
    diff = (cand.double() - ref.double()).abs()
    if is_causal(point):
        diff = diff * causal_allowed(*diff.shape[-2:])  # (rows, T)
    return diff


def by_position(point: str, ref: torch.Tensor, cand: torch.Tensor) -> list[float]:
    """max |diff| per token position (the query position for attention matrices)."""
    diff = _error(point, ref, cand)
    if has_head_axis(point):
        diff = diff.transpose(0, 1)  # (T, heads, ...)
    return diff.reshape(diff.shape[0], -1).amax(dim=1).tolist()


def by_head(point: str, ref: torch.Tensor, cand: torch.Tensor, num_heads: int | None = None) -> list[float] | None:
    """max |diff| per head, for points that have heads: (heads, T, ...) or (T, heads*D) when `num_heads` is known."""
    diff = _error(point, ref, cand)
    if has_head_axis(point):
        return diff.reshape(diff.shape[0], -1).amax(dim=1).tolist()
    if num_heads and split_point(point)[1] in (Q_PROJ, CONTEXT) and diff.shape[-1] % num_heads == 0:
        heads = diff.reshape(diff.shape[0], num_heads, -1)  # (T, H, D)
        return heads.transpose(0, 1).reshape(num_heads, -1).amax(dim=1).tolist()
    return None


def top_channels(point: str, ref: torch.Tensor, cand: torch.Tensor, k: int = TOP_CHANNELS) -> list[dict] | None:
    """The channels (last axis of a (T, X) point) with the largest max |diff|."""
    if has_head_axis(point) or ref.dim() != 2:
        return None
    per_channel = _error(point, ref, cand).amax(dim=0)  # (X,)
    values, indices = per_channel.topk(min(k, per_channel.numel()))
    return [{"channel": int(i), "max_abs": float(v)} for v, i in zip(values, indices)]


def uniform_scale(ref: torch.Tensor, cand: torch.Tensor) -> float | None:
    """c where the candidate is c × the reference throughout (the difference explained to 0.1% by that
    one factor), else None: a scale applied on one side only, such as RoPE's attention factor."""
    ref, cand = ref.double().flatten(), cand.double().flatten()
    reference_norm = float(ref @ ref)
    if reference_norm == 0 or not torch.isfinite(cand).all():
        return None
    factor = float(ref @ cand) / reference_norm
    error = float((cand - ref).norm())
    return factor if error > 0 and float((cand - factor * ref).norm()) <= 1e-3 * error else None


def breakdown(point: str, ref: torch.Tensor, cand: torch.Tensor, num_heads: int | None = None) -> dict:
    """Everything a reader wants to see about one diverged point."""
    return {
        "by_position": by_position(point, ref, cand),
        "by_head": by_head(point, ref, cand, num_heads),
        "top_channels": top_channels(point, ref, cand),
        "scale": uniform_scale(ref, cand) if op_kind(point) == "rope" else None,
    }


def _quiet(values: list[float]) -> list[bool]:
    """Which entries are untouched; a NaN or Inf is never untouched and sets no scale for the rest."""
    top = max((v for v in values if math.isfinite(v)), default=0.0)
    return [math.isfinite(v) and v <= QUIET * top for v in values]


def hints(point: str, details: dict, family: str | None = None, unseen: tuple[str, ...] = ()) -> list[str]:
    """Short sentences an expert would say on seeing this signature (on a model of `family`: its own
    features first, `tracer.model.families.Family.hints`). `unseen`: the points before it that were not
    recorded: the error may start at any of them, so nothing is said of this op's own kind."""
    said = family_hints(point, family)
    positions, heads = details.get("by_position") or [], details.get("by_head")
    quiet = _quiet(positions)
    window = _exact_prefix(quiet)
    if window >= 2 and op_kind(point) in ("softmax", "attention"):
        said.append(f"exact on the first {window} positions and not after: attention limited to a window of "
                    f"{window} keys (a sliding window, kept on one side and ignored on the other)")
    elif len(positions) > 1 and quiet[0] and not any(quiet[1:]):
        growing = positions[-1] >= positions[1]
        said.append(
            "exact at position 0 and " + ("growing with position" if growing else "non-zero after it")
            + ": positional encoding (rope_theta, rope scaling, or the rotary pairing: half-split vs interleaved)"
        )
    elif op_kind(point) == "rope" and details.get("scale") is not None:
        said.append(f"the candidate is the reference × {details['scale']:.6g} at every position and head: cos and "
                    "sin scaled by another factor (RoPE's attention factor on one side only: YaRN's mscale, "
                    "LongRoPE's attention factor)")
    elif op_kind(point) == "rope" and positions and not any(quiet):
        said.append("every position differs at RoPE, the first included: the rotation's angles at these positions "
                    "(rope_theta, or the rope scaling: Llama 3's frequency factors, LongRoPE's short/long factors "
                    "picked by the sequence length, YaRN's or dynamic NTK's frequencies) or the rotary pairing "
                    "(half-split vs interleaved); at far positions (--position-offset) no position of the prompt "
                    "has angle 0 to be exact at")
    elif len(positions) > 1 and quiet[-1] and not any(quiet[:-1]):
        said.append("exact at the last position only: the causal mask (the last query attends to every key anyway)")
    nonfinite = [i for i, v in enumerate(positions) if not math.isfinite(v)]
    if nonfinite and len(nonfinite) < len(positions):
        exact = [i for i, q in enumerate(quiet) if q]
        said.append(f"non-finite (NaN or Inf) at position{'s' if len(nonfinite) > 1 else ''} "
                    f"{', '.join(map(str, nonfinite))} only" + (f", exact at {', '.join(map(str, exact))}" if exact
                                                                 else "")
                    + ": a value overflowed or a NaN entered there, not a formula applied everywhere")
    if heads and any(_quiet(heads)) and not all(_quiet(heads)):
        exact = [i for i, q in enumerate(_quiet(heads)) if q]
        said.append(f"only some heads differ (heads {exact} are exact): the GQA head mapping (kv head repeat order)")
    if unseen:
        said.append(f"the {len(unseen)} point{'s' if len(unseen) > 1 else ''} before it "
                    f"({', '.join(short_names(unseen))}) {'are' if len(unseen) > 1 else 'is'} not recorded: "
                    "the error may start at any of them; record them to see where")
    else:
        said += OP_HINTS.get(op_kind(point), [])
    return said


def routed_hints(point: str, points) -> list[str]:
    """Where the first divergence is a MoE layer's router (`mlp.gate*`) or its experts (`mlp.experts`, `mlp`):
    "wrong router" when that layer's experts, rerun on the reference's inputs and its routing, match
    (`PointDiff.routed_local_rel_l2` within the point's threshold), "wrong expert" when they still diverge.
    `points`: the comparison's `PointDiff`s. Nothing where the routed run was not made (an engine that cannot
    be forced: the routing diff alone judges the router)."""
    layer, sub = split_point(point)
    if layer is None or not (sub == ROUTER_LOGITS or sub.startswith(ROUTER_LOGITS + ".") or sub in (EXPERTS, MLP)):
        return []
    experts = next((p for p in points if p.point == layer_point(layer, EXPERTS)), None)
    if experts is None or experts.routed_local_rel_l2 is None or experts.threshold is None:
        return []
    error, bound = experts.routed_local_rel_l2, experts.threshold
    measured = f"{EXPERTS} rel_l2 {error:.2g}, threshold {bound:.2g}"
    if error <= bound:
        return [f"wrong router: rerun on the reference's inputs and its routing (its picked experts and their "
                f"weights), layer {layer}'s experts match ({measured}); the router sends the tokens elsewhere or "
                "weighs them otherwise (the routing diff says which)"]
    both = sub not in (EXPERTS, MLP)
    return [f"wrong expert: rerun on the reference's inputs and its routing, layer {layer}'s experts still "
            f"diverge ({measured}): the experts compute wrongly (their weights, gate/up order, activation)"
            + ("; the router diverges before them too: both are wrong" if both else "")]


def short_names(points: tuple[str, ...], most: int = 6) -> list[str]:
    """Points without their layer prefix where they share one layer ("q_rope", not the whole path)."""
    layers = {split_point(p)[0] for p in points}
    names = [split_point(p)[1] for p in points] if len(layers) == 1 and None not in layers else list(points)
    return names[:most] + ([f"{len(names) - most} more"] if len(names) > most else [])


def runtime_hints(point: str, family: str | None, engines: tuple[str | None, ...]) -> list[str]:
    """Where a side's engine declares a runtime difference on this family at this point
    (`tracer.engines.registry.Difference`): the runtime's own behaviour, so that a port is not blamed."""
    said = []
    for engine in dict.fromkeys(engines):
        entry = ENGINES.get(engine) if engine else None
        for difference in entry.differences_on(family or "llama") if entry else ():
            if difference.at(point):
                when = f", shown by {difference.condition}" if difference.condition else ""
                said.append(f"the {engine} runtime's own behaviour on {family or 'llama'}, not a porting mistake: "
                            f"{difference.what}{when} (a runtime difference its engine declares; `tracer engines`)")
    return said


def family_hints(point: str, family: str | None) -> list[str]:
    """The family's own feature at this point, where it has one (Gemma's (1 + w) norms, Qwen3's q/k
    norms, soft-caps, sliding windows, ...)."""
    entry = registered().get(family or "llama")
    layer, sub = split_point(point)
    text = entry.hints.get(sub if layer is not None else point) if entry else None
    return [text] if text else []


def _exact_prefix(quiet: list[bool]) -> int:
    """How many leading positions are exact, when some later ones are not (0 otherwise)."""
    count = next((i for i, q in enumerate(quiet) if not q), len(quiet))
    return count if count < len(quiet) else 0


# What an expert suspects first when the first error is made by an op of this kind (tracer.model.points).
OP_HINTS = {
    "norm": ["first error right after a norm: rms_norm_eps, or the norm's precision (f32 upcast)"],
    "embedding": ["error already at the embedding: the load dtype or the weights themselves"],
    "projection": ["first error at a projection: its weights (layout, quantization, a dropped bias) "
                   "or matmul precision"],
}


# --- amplification: the op whose output error most exceeds its input's (a norm dividing by a
# small RMS, a softmax saturating) is where error grows fastest.


def amplification(rel_l2: dict[str, float], top: int = 5, family: str | None = None) -> list[dict]:
    """Ops ranked by how much they multiply the relative error of their input (what each point is
    computed from, as `family` computes it)."""
    gains = []
    for point, error in rel_l2.items():
        source = source_point(point, family)
        inherited = rel_l2.get(source) if source else None
        if inherited and inherited > 0 and error is not None:
            gains.append({"point": point, "gain": error / inherited, "input": source})
    return sorted(gains, key=lambda g: g["gain"], reverse=True)[:top]


# --- a decode step's cache and positions, read off the numbers (`tracer.comparison.steps`) ---------


def row_distances(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """(M, N) rel_l2 of each of the candidate's M rows against each of the reference's N rows (f64;
    rows are (N, X) and (M, X))."""
    ref, cand = reference.double(), candidate.double()
    scale = ref.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)  # (N,)
    return torch.cdist(cand, ref) / scale[None]  # (M, N)


def slots(cache: torch.Tensor) -> torch.Tensor:
    """A cache point (KV, S, D) as one row per slot, (S, KV*D)."""
    return cache.transpose(0, 1).reshape(cache.shape[1], -1)


def cache_hints(point: str, reference: torch.Tensor, candidate: torch.Tensor, threshold: float,
                start: int | None, before_rope: torch.Tensor | None = None) -> list[str]:
    """What the candidate's cache (KV, S, D) holds, slot by slot, against the reference's: the keys
    before RoPE (`before_rope`: the reference's keys before RoPE of the step's slots, the last T,
    (KV, T, D)), or another slot's keys or values. A slot "holds" a reference slot when its rel_l2 to it
    is within `threshold` (the point's own bound). `start`: the position of slot 0 (None: a cache
    whose slots are not positions in order, a ring)."""
    what = "keys" if point.endswith("cache_k") else "values"
    where = (lambda slot: f"slot {slot} (position {start + slot})") if start is not None else (lambda s: f"slot {s}")
    distance = row_distances(slots(reference), slots(candidate))  # (S, S)
    own = distance.diagonal()
    wrong = [int(j) for j in torch.nonzero(~(own <= threshold)).flatten()]
    if not wrong:
        return []
    if before_rope is not None:
        count = before_rope.shape[1]
        held = row_distances(slots(before_rope), slots(candidate[:, -count:])).diagonal()  # (T,)
        if bool((held <= threshold).all()):
            first, last = candidate.shape[1] - count, candidate.shape[1] - 1
            slots_text = where(first) if first == last else f"{where(first)} to {where(last)}"
            return [f"the cache holds the keys before RoPE: {slots_text} equal the reference's keys before "
                    f"RoPE (rel_l2 at most {float(held.max()):.1e}), not its cached keys after RoPE (rel_l2 "
                    f"{float(own[first:].max()):.1e}): the cache keeps the projection, and later steps attend to "
                    "keys never rotated"]
    nearest, at = distance[wrong].min(dim=1)  # per wrong slot: the reference slot it is nearest
    moved = [(j, int(i), float(d)) for j, i, d in zip(wrong, at, nearest) if d <= threshold and int(i) != j]
    said = []
    if moved:
        listed = "; ".join(f"{where(j)} holds {where(i).replace('slot', 'the reference slot', 1)}'s {what} "
                           f"(rel_l2 {d:.1e}, against its own {float(own[j]):.1e})" for j, i, d in moved[:3])
        more = f"; {len(moved) - 3} more slots too" if len(moved) > 3 else ""
        said.append(f"the cache holds {what} at other slots than the reference's: {listed}{more}")
    alien = [j for j in wrong if j not in {m[0] for m in moved}]
    if alien:
        j = alien[0]
        said.append(f"{len(alien)} slot{'s' if len(alien) > 1 else ''} of the cache hold{'' if len(alien) > 1 else 's'}"
                    f" none of the reference's {what} (the first, {where(j)}: nearest the reference's slot "
                    f"{int(at[wrong.index(j)])}, rel_l2 {float(nearest[wrong.index(j)]):.1e})")
    return said


def position_hint(number: int, point: str, position: int, candidate: torch.Tensor, reference: torch.Tensor,
                  scanned: list[int], threshold: float, prompt_end: int, offset: int) -> str:
    """Which position a decode step's token was given, read off its layer-0 RoPE output: `candidate`
    (heads, 1, D) against the reference's for the same token at each of the `scanned` positions
    (`reference` (heads, N, D), one row per position). `position`: the step's true one; `prompt_end`: the
    position after the prompt; `offset`: the prompt's first position."""
    rows = reference.transpose(0, 1).reshape(reference.shape[1], -1)  # (N, heads*D)
    distance = row_distances(rows, candidate.transpose(0, 1).reshape(1, -1))[0]  # (N,)
    best = int(distance.argmin())
    given, gap = scanned[best], float(distance[best])
    name = point.rsplit(".", 1)[-1]
    if not gap <= threshold:
        ranges = ", ".join(f"{a}..{b}" for a, b in _runs(scanned))
        return (f"decode step {number}'s layer-0 {name} is the reference's at none of positions {ranges} "
                f"(nearest: position {given}, rel_l2 {gap:.1e}): not a position mistake alone")
    against = f", against its own {float(distance[scanned.index(position)]):.1e}" if position in scanned else ""
    why = ("" if given == position
           else "positions restart at 0 after the prompt (the step's count, not its position)"
           if given == position - prompt_end
           else "the prompt's position offset is dropped" if offset and given == position - offset
           else "one past its position (off by one: the cache's length plus one)" if given == position + 1
           else "one before its position (off by one)" if given == position - 1 else "")
    return (f"decode step {number}'s token (position {position}) was given position {given}: its layer-0 "
            f"{name} is the reference's for the same token at position {given} (rel_l2 {gap:.1e}{against})"
            + (f"; {why}" if why else ""))


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """Sorted integers as (first, last) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], value)
        else:
            runs.append((value, value))
    return runs
