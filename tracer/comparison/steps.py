"""Two decoded traces compared step by step (`--decode N`, docs/decode.md).

A decoded trace is the prompt's prefill with the engine's KV cache (step 0) and `Trace.steps`, one
trace per decode step (1..N), each one token at its position. Each step is compared like any trace
(`tracer.comparison.diff.compare`), against its own noise floor; the walk names the first step whose
comparison diverges, and that step's comparison becomes the one a result shows (`with_steps`).

Where each step's floor comes from (`step_floors`): the reference's cached step against the same
position of its own uncached forward over the whole sequence, which differ by f32 rounding only (other
matmul shapes); a point's floor is the larger of that, the prefill's f64 noise of the point, and the
f64 noise of the step's own rows (`StepNoise`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from tracer.comparison.diff import compare, introduces_error, paired, rel_l2_by_point, slot_layout, tokens_cached
from tracer.comparison.explain import cache_hints
from tracer.comparison.result import DEFAULT_REL_L2, Divergence, Result, StepResult, Tolerance
from tracer.core.errors import TracerError
from tracer.model.kv_cache import ring_slots
from tracer.model.points import (
    CACHE_K,
    CACHE_POINTS,
    CACHE_V,
    K_NORM,
    K_PROJ,
    K_ROPE,
    LOGITS,
    PROBS,
    Q_ROPE,
    QKV_PROJ,
    V_PROJ,
    layer_of,
    layer_point,
    layout_of,
    split_point,
)
from tracer.traces.trace import Trace, kept

PREFILL = 0  # the step number of the prompt's (cached) prefill

# The cache's points take the prefill floor of what they hold.
_HELD = {CACHE_K: K_ROPE, CACHE_V: V_PROJ}


def decoded_steps(trace: Trace) -> list[Trace]:
    """Step 0 (the cached prefill) then every decode step."""
    return [trace, *trace.steps]


def step_position(trace: Trace) -> int:
    return trace.meta.position_offset or 0


def compare_steps(reference: Trace, candidate: Trace, tolerance: Tolerance | None = None,
                  floors: list[dict[str, float]] | None = None, local: list[dict[str, float] | None] | None = None,
                  measured_hints: Callable[[int, Trace, Trace, Divergence], list[str]] | None = None,
                  ) -> list[tuple[StepResult, Result]]:
    """Every step of two decoded traces compared (0: the cached prefill); `floors[step]`: per point
    noise (`step_floors`); `local[step]`: per point, the error the candidate's step makes on the
    reference's inputs and cache (`tracer.reimpl.forced_runs.cached_step_points`; None: not measured
    at that step), which localizes
    each step's first divergence and tells a step's own error from what it inherits;
    `measured_hints(step, reference step, candidate step, first divergence)`: hints that need a run of
    their own (the position a step's token was given), asked at the first step that diverges. The two
    traces must hold the same number of steps, on the same tokens."""
    if len(reference.steps) != len(candidate.steps):
        raise TracerError(f"the traces hold different numbers of decode steps: {len(reference.steps)} vs "
                          f"{len(candidate.steps)}")
    compared: list[tuple[StepResult, Result]] = []
    cache_wrong: int | None = None  # the first step whose cache points diverged
    for number, (ref, cand) in enumerate(zip(decoded_steps(reference), decoded_steps(candidate))):
        if number and ref.tokens is not None and cand.tokens is not None and list(ref.tokens) != list(cand.tokens):
            raise TracerError(f"decode step {number} was fed different tokens: {ref.tokens} vs {cand.tokens} (each "
                              "side decoded its own greedy tokens; `tracer run --decode N` feeds the candidate the "
                              "reference's)")
        result = compare(ref, cand, tolerance, noise=floors[number] if floors else None,
                         local=local[number] if local else None)
        first = result.first_divergence
        if first is not None:
            written = tokens_cached(ref)
            # hints that need a run of their own: at the first step that diverges (the one a result shows)
            ran = measured_hints(number, ref, cand, first) if measured_hints and not any(
                summary.verdict != "match" for summary, _ in compared) else []
            measured = [*measured_cache_hints(reference, ref, cand, first), *ran]
            # the ring's own hint first (a measured slot hint alone does not say that the ring wrapped), then
            # what the numbers say, then what the point suggests where they name no cause
            ring = ring_hints(number, first, written)
            general = [hint for hint in step_hints(number, first, written) if hint not in ring]
            said = [*ring, *measured, *general]
            first = dataclasses.replace(first, hints=(*said, *first.hints))
            result = dataclasses.replace(result, first_divergence=first)
        inherited = cache_wrong if result.verdict != "match" and cache_wrong is not None else None
        compared.append((step_summary(number, ref, result, cand, inherited), result))
        if cache_wrong is None and any(p.diverged for p in result.points if split_point(p.point)[1] in CACHE_POINTS):
            cache_wrong = number
    return compared


def greedy_pick(trace: Trace) -> int | None:
    """The token a step's own logits pick next (their last row's argmax); None without logits."""
    return int(trace[LOGITS][-1].argmax()) if LOGITS in trace else None


def step_summary(number: int, reference: Trace, result: Result, candidate: Trace | None = None,
                 inherited_from: int | None = None) -> StepResult:
    """What the JSON and the step × layer map keep of one step's comparison: per layer its largest
    error, its largest local error (on the reference's inputs and cache) and its status: `match`, `local`
    (a point's local error leaves its floor: the step's own op makes the error), `inherited` (diverged,
    every local error within the floor: the step reads the error from its inputs or its cache), or
    `diverged` (no local errors measured)."""
    worst: dict[int | None, float] = {}
    worst_local: dict[int | None, float] = {}
    diverged: set[int | None] = set()
    made: set[int | None] = set()
    measured = any(p.local_rel_l2 is not None for p in result.points)
    for p in result.points:
        if not p.recorded:
            continue
        if p.rel_l2 is not None:
            worst[p.layer] = max(worst.get(p.layer, 0.0), p.rel_l2)
        if p.local_rel_l2 is not None:
            worst_local[p.layer] = max(worst_local.get(p.layer, 0.0), p.local_rel_l2)
        if p.diverged:
            diverged.add(p.layer)
            if p.local_rel_l2 is not None and introduces_error(p):
                made.add(p.layer)
    layers = max((layer for layer in worst if layer is not None), default=-1) + 1

    def status(layer: int) -> str:
        if layer not in diverged:
            return "match"
        return ("local" if layer in made else "inherited") if measured else "diverged"

    return StepResult(
        step=number, position=step_position(reference), tokens=tuple(reference.tokens or ()), verdict=result.verdict,
        first_divergence=result.first_divergence, points=sum(p.recorded for p in result.points),
        layer_max_rel_l2=tuple(worst.get(layer) for layer in range(layers)),
        reference_pick=greedy_pick(reference), candidate_pick=None if candidate is None else greedy_pick(candidate),
        layer_max_local_rel_l2=tuple(worst_local.get(layer) for layer in range(layers)) if measured else (),
        layer_status=tuple(status(layer) for layer in range(layers)),
        local=bool(made) if measured else None, inherited_from=inherited_from,
    )


def measured_cache_hints(decoded: Trace, reference: Trace, candidate: Trace, first: Divergence) -> list[str]:
    """Where a step first diverges at a cache point: what the candidate's cache holds, read slot by
    slot against the reference's in the layout they were compared in (`tracer.comparison.explain.cache_hints`):
    the keys before RoPE, or another slot's keys or values."""
    layer, sub = split_point(first.point)
    if sub not in CACHE_POINTS or first.point not in reference or first.point not in candidate:
        return []
    ref, cand = paired(first.point, reference, candidate, slot_layout(reference, candidate))  # (KV, S, D) each
    end = step_position(reference) + len(reference.tokens or ())  # one past the step's last position
    start = step_position(decoded)
    linear = ref.shape[1] == end - start  # every position since the prompt's first, in order (not a ring)
    before_rope = _keys_before_rope(reference, layer, ref.shape[0], ref.shape[2]) if sub == CACHE_K else None
    threshold = first.threshold if first.threshold is not None else DEFAULT_REL_L2
    return cache_hints(first.point, ref, cand, threshold, start if linear else None, before_rope)


def _keys_before_rope(trace: Trace, layer: int, heads: int, dim: int) -> torch.Tensor | None:
    """The reference's keys of the step before RoPE (KV, T, D), `heads` KV heads of `dim`: its k_norm
    where the family has one, else its k_proj, else the k part of its fused q | k | v projection
    (Phi-3); None where none is recorded. Each keeps the heads merged, (T, ...)."""
    for sub in (K_NORM, K_PROJ, QKV_PROJ):
        point = layer_point(layer, sub)
        if point in trace:
            keys = trace[point]  # (T, KV*D), or (T, (H + 2·KV)·D) for the fused projection
            if sub == QKV_PROJ:
                width = keys.shape[1]
                keys = keys[:, width - 2 * heads * dim:width - heads * dim]  # (T, KV*D)
            return keys.reshape(keys.shape[0], heads, dim).transpose(0, 1)  # (KV, T, D)
    return None


def ring_hints(number: int, first: Divergence, written: int | None) -> list[str]:
    """Where a step first diverges at the cache of a sliding layer whose ring has wrapped (`written`: the
    tokens the cache took up to this step; a cache point holding fewer slots is a ring)."""
    sub = split_point(first.point)[1]
    slots = first.shape[1] if sub in CACHE_POINTS and first.shape and len(first.shape) == 3 else None
    if slots is None or written is None or slots >= written or number == PREFILL:
        return []
    wraps = "wraps at this step" if slots == written - 1 else f"has wrapped ({written} tokens in {slots} slots)"
    return [f"decode step {number} agrees up to the cache of a sliding layer whose ring buffer {wraps}: a slot "
            "holds other keys or values than the reference's: the ring written at another slot than the "
            f"token's place in the sequence modulo the window ({slots}), e.g. at its fill, which stops at the "
            "window (mlx-lm #1437: the ring's offset and fill conflated)"]


def step_hints(number: int, first: Divergence, written: int | None = None) -> list[str]:
    """What a divergence that appears only at a decode step suggests, by the point it starts at (where
    no hint read off the numbers says more); `written`: the tokens the cache took up to this step."""
    sub = split_point(first.point)[1]
    ring = ring_hints(number, first, written)
    if sub in CACHE_POINTS and number == 1:
        return ["the prefill agrees and decode step 1 differs from its cache on: the step reads a cache that holds "
                "other keys or values than the prefill left (a cache left over from another prompt, not cleared "
                "between requests; or written at the wrong slot)", *ring]
    if ring:
        return ring
    if sub == PROBS:
        return [f"{'the cached prefill' if number == PREFILL else f'decode step {number}'} agrees up to the scores and "
                "the softmax differs: the mask over the cached keys differs (a sliding-window mask one key too wide "
                "or narrow: mlx-lm #390 let a window of 128 see 129 keys)"]
    if number == PREFILL:
        if sub in CACHE_POINTS:
            return ["the prompt's own attention agrees but what the cache keeps differs: the cache stores another "
                    "tensor than the reference's (keys before RoPE, another dtype or layout)"]
        return []
    if sub in (Q_ROPE, K_ROPE) and first.layer == 0:
        return [f"the prefill agrees and decode step {number} leaves it at RoPE of layer 0: the step's token was "
                "given another position (restarting at 0 after the prompt, off by one: check the position "
                "taken from the cache's length), or a rope scaling that depends on the sequence length read "
                "otherwise at this step (LongRoPE's long factors past original_max_position_embeddings, dynamic "
                "NTK's base)"]
    if sub in CACHE_POINTS:
        return [f"decode step {number} agrees up to the cache: a slot holds other keys or values than the "
                "reference's (written at the wrong slot, or kept from another prompt)"]
    if layer_of(first.point) == 0 and sub not in (Q_ROPE, K_ROPE):
        return [f"the prefill agrees and decode step {number} diverges at layer 0 after RoPE: what the step "
                "attends to differs (the cached keys or values, or the mask over them)"]
    return []


def with_steps(result: Result, compared: list[tuple[StepResult, Result]]) -> Result:
    """`result` (the uncached prefill's comparison, with its context) with the decode steps attached; when
    the prefill matches and a step diverges, that step's comparison is the one shown (points, first
    divergence, logits), so that reports and the verdict line name it."""
    steps = tuple(summary for summary, _ in compared)
    first = next(((summary, shown) for summary, shown in compared if shown.verdict != "match"), None)
    if result.verdict != "match" or first is None:
        return dataclasses.replace(result, steps=steps)
    summary, shown = first
    return result.showing(shown, steps=steps, step=summary.step)


# --- the floor of each step ------------------------------------------------------------------------


def step_floors(decoded: Trace, uncached: Trace, prefill_noise: dict[str, float] | None,
                step_noise: list[dict[str, float]] | None = None) -> list[dict[str, float]]:
    """Per step (0: the cached prefill), per point: the larger of the prefill's f64 noise of the point
    (for the cache, of what it holds), the rel_l2 between the reference's cached step and the same
    position of `uncached` (its forward over the prompt and every decoded token, without a cache), and
    `step_noise[step]` (`StepNoise`: the f64 noise of the step's own rows)."""
    start = step_position(decoded)
    floors = []
    for step in decoded_steps(decoded):
        first = step_position(step) - start  # the step's first row in the uncached forward
        rows = len(step.tokens or ())
        same = Trace({point: tensor for point in step.points
                      if (tensor := _rows(point, uncached, first, rows, step)) is not None}, step.meta)
        gaps = rel_l2_by_point(step, same) if len(same) else {}
        own = step_noise[len(floors)] if step_noise else {}
        floors.append({point: max(gaps.get(point, 0.0), own.get(point, 0.0)) for point in step.points})
    return raised_to(floors, prefill_noise)


def raised_to(floors: list[dict[str, float]], prefill_noise: dict[str, float] | None) -> list[dict[str, float]]:
    """Each step's floors, none below the prefill's f64 noise of the point (for a cache point, of what it
    holds): what a step's own measurements (kept in the reference cache) become in a run."""
    prefill_noise = prefill_noise or {}
    return [{point: max(value, prefill_noise.get(_held(point)) or 0.0) for point, value in step.items()}
            for step in floors]


class StepNoise:
    """A recorder for an f64 run over the prompt and every decoded token (the uncached sequence): each
    point, as it comes, compared at every step's rows with the same rows of `uncached` (the reference's
    f32 forward over the same tokens); nothing is kept. `noise[step][point]`: the f32 rounding of that
    point at that step's own rows. The prefill's noise is an average over the prompt's rows; a decoded
    token whose residual holds a massive activation that the next layer cancels rounds up to ten times
    more than that average there (docs/decode.md), and a correct runtime's step is judged against the
    rounding of that very row."""

    @property
    def tensors(self) -> dict:
        """Nothing kept (the engines return a Trace of their recorder's tensors)."""
        return {}

    def __init__(self, decoded: Trace, uncached: Trace):
        self.steps, self.start, self.uncached = decoded_steps(decoded), step_position(decoded), uncached
        self.noise: list[dict[str, float]] = [{} for _ in self.steps]

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        exact = Trace({name: kept(name, tensor)}, self.uncached.meta)
        layer, sub = split_point(name)
        points = [name, *(layer_point(layer, cache) for cache, held in _HELD.items() if held == sub)]
        for noise, step in zip(self.noise, self.steps):
            first, rows = step_position(step) - self.start, len(step.tokens or ())
            for point in points:
                if point not in step.tensors:
                    continue
                ours, truth = _rows(point, self.uncached, first, rows, step), _rows(point, exact, first, rows, step)
                if ours is not None and truth is not None:
                    noise[point] = rel_l2_by_point(Trace({point: truth}, step.meta),
                                                   Trace({point: ours}, step.meta)).get(point, 0.0)


def _held(point: str) -> str:
    layer, sub = split_point(point)
    return layer_point(layer, _HELD[sub]) if sub in _HELD else point


def _held_rows(sub: str, full: Trace, layer: int, shape: tuple[int, ...]) -> torch.Tensor | None:
    """What a cache point holds, (KV, T, D) in position order, from the uncached forward's keys or values."""
    if sub == CACHE_K:
        return full.tensors.get(layer_point(layer, K_ROPE))  # (KV, T, D)
    values = full.tensors.get(layer_point(layer, V_PROJ))  # (T, KV*D)
    if values is None:
        return None
    heads, _, dim = shape
    return values.reshape(values.shape[0], heads, dim).transpose(0, 1)  # (KV, T, D)


def _rows(point: str, full: Trace, first: int, rows: int, step: Trace) -> torch.Tensor | None:
    """The rows of the uncached forward that a step with `rows` tokens from `first` computed (its cache:
    every slot up to its last token); None where the uncached forward did not keep them."""
    last = first + rows  # one past the step's last row
    layer, sub = split_point(point)
    if sub in CACHE_POINTS:
        held = _held_rows(sub, full, layer, step[point].shape)
        slots = step[point].shape[1]  # fewer than `last`: a sliding layer's ring of that many slots
        return None if held is None else held[:, :last] if slots >= last else ring_slots(held[:, :last], last, slots)
    tensor = full.tensors.get(point)
    if tensor is None:
        return None
    layout = layout_of(point)
    if layout == "attention":  # (H, kept rows, T): the last rows only, past ATTENTION_ROWS tokens
        skipped = tensor.shape[-1] - tensor.shape[-2]
        keys = step[point].shape[-1]  # fewer than `last` on a sliding layer: the window's last keys
        return None if first < skipped else tensor[:, first - skipped:last - skipped, last - keys:last]
    if layout == "heads":
        return tensor[:, first:last]  # (H, rows, D)
    if tensor.shape[0] < last:  # a runtime that keeps only the last position's logits
        return None
    return tensor[first:last]  # (rows, X)
