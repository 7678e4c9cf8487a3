"""Forced runs of the reimplementation: local vs inherited error, and each op on the reference's inputs.

The reimplementation reruns every block on the *reference's* input to that block (and the final
norm and lm_head on the reference's own inputs). A point's error in that run is what the
candidate's computation introduces there (`local_rel_l2`); the rest of its error in the plain
run is inherited from upstream. An injected fault in one block is then local to that block even
though every later block inherits it. A decode step's cache is an input like a block's: the step
rerun on the reference's cache (`cached_step_points`) tells the error the step makes from the one
it inherits from the cache written at earlier steps.

In a mixture of experts the local run still routes by the candidate's own router, so the experts'
local error mixes a wrong router (tokens sent to other experts, or weighted otherwise) with wrong
experts. `routed_points` reruns it with every MoE layer's experts on the reference's routing (its
picked experts and their weights): the experts' points then carry the experts' own error.
"""

from __future__ import annotations

import copy

import torch

from tracer.core.errors import TracerError
from tracer.model.kv_cache import KVCache
from tracer.model.points import CACHE_K, CACHE_V, TOP_K_INDEX, TOP_K_WEIGHTS, layer_point, split_point
from tracer.reimpl.forward import Model
from tracer.reimpl.unit_runs import TeacherForced
from tracer.traces.trace import Trace, TraceRecorder


def trace_positions(trace: Trace) -> torch.Tensor:
    """The absolute positions a trace's tokens ran at (its `position_offset`, 0 by default)."""
    start = trace.meta.position_offset or 0
    return torch.arange(start, start + len(trace.tokens))


@torch.inference_mode()
def teacher_forced_points(model: Model, reference: Trace, recorder=None, cache: KVCache | None = None):
    """The candidate's points (point -> tensor, recording order) with every block fed the
    reference's input to that block, and each point of the head (a chain: final norm, logits,
    capped logits) the reference's value of the point before it (`tracer.reimpl.unit_runs.TeacherForced`,
    all its units in a row).

    `cache`: a decode step's rerun (`cached_step_points`): every block also reads and appends to this
    cache, which holds what the reference's cache held before the step, and the model takes the step's
    positions from it (as in its own decode, where a wrong position is made)."""
    recorder = recorder if recorder is not None else TraceRecorder()
    run = TeacherForced(model, reference, recorder, trace_positions(reference), cache)
    run.embed()
    for i in range(model.spec.num_hidden_layers):
        run.block(i)
    run.head()
    return recorder.tensors


def cached_step_points(model: Model, step: Trace, before: Trace | None, prefilled: int, recorder=None):
    """A decode step of the candidate rerun on the reference's inputs, its cache among them: every block
    on the reference's input to it and on the reference's cache as it was before the step (`before`'s
    `cache_k`/`cache_v`, the reference's trace of the step before; None for the prompt's prefill, into
    an empty cache). A point's error in this run is the step's own; the rest of its error in the
    candidate's decode it inherits, from the block before or from the cache written at earlier steps.
    `prefilled`: the prompt's length (the slots the prefill wrote)."""
    layers = model.spec.num_hidden_layers
    if before is None:
        cache = KVCache(layers)
    else:
        held = [(before.tensors.get(layer_point(i, CACHE_K)), before.tensors.get(layer_point(i, CACHE_V)))
                for i in range(layers)]
        missing = next((i for i, (k, v) in enumerate(held) if k is None or v is None), None)
        if missing is not None:
            raise TracerError(f"the reference's step at position {step.meta.position_offset or 0} has no "
                              f"{layer_point(missing, CACHE_K)}/{CACHE_V}: a step is rerun on the cache it recorded")
        placed = [(k.to(dtype=model.steps.dtype, device=model.device),
                   v.to(dtype=model.steps.dtype, device=model.device)) for k, v in held]  # (KV, S, D) each
        start = trace_positions(step)[0].item() - placed[0][0].shape[1]  # the first slot's position
        cache = KVCache.holding([k for k, _ in placed], [v for _, v in placed], start, prefilled)
    return teacher_forced_points(model, step, recorder, cache)


class ForcingRecorder:
    """A recorder that, after keeping each point (a copy), overwrites the forward's tensor in place
    with the reference's value of that point: every later op then reads the reference's input.

    Points the reference lacks, or holds in another shape (fewer rows, another layout), run on as
    computed and are listed in `unforced`.
    """

    def __init__(self, reference: Trace, recorder=None):
        self.reference, self.recorder = reference, recorder if recorder is not None else TraceRecorder()
        self.unforced: list[str] = []

    @property
    def tensors(self):
        return self.recorder.tensors

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        self.recorder(name, tensor.clone())
        given = self.reference[name] if name in self.reference else None
        if given is None or tuple(given.shape) != tuple(tensor.shape[1:]):
            self.unforced.append(name)
            return
        tensor.copy_(given[None].to(dtype=tensor.dtype, device=tensor.device))


@torch.inference_mode()
def op_forced_points(model: Model, reference: Trace, recorder=None):
    """The candidate's points with every op fed the reference's values of its inputs (a finer
    teacher forcing than `teacher_forced_points`: inside a block too). A point's error is then its
    op's alone: where the ops round to 8 bits (a quantized regime), a tiny difference upstream in
    the same block can no longer flip a rounding and pass for the op's own error."""
    forcing = ForcingRecorder(reference, recorder)
    model.forward(torch.tensor(reference.tokens), forcing, positions=trace_positions(reference))
    return forcing.tensors


def routes(reference: Trace) -> bool:
    """Whether the reference carries a MoE layer's routing as its experts read it (picks and weights)."""
    subs = {split_point(name)[1] for name in reference.points}
    return TOP_K_INDEX in subs and TOP_K_WEIGHTS in subs


class GivenRouting:
    """The MoE component's `routing` step that hands each layer's experts the reference's routing: its
    `mlp.gate.top_k_weights` (in the reference's own dtype, as its experts multiplied by them) and
    `mlp.gate.top_k_index`. A layer whose routing the reference lacks, or holds in another shape, keeps the
    candidate's own; `forced` lists the layers given the reference's."""

    def __init__(self, reference: Trace):
        self.reference = reference
        self.forced: list[int] = []

    def __call__(self, top: torch.Tensor, picked: torch.Tensor, run) -> tuple[torch.Tensor, torch.Tensor]:
        index, weights = (self.reference[name] if name in self.reference else None
                          for name in (layer_point(run.index, TOP_K_INDEX), layer_point(run.index, TOP_K_WEIGHTS)))
        if index is None or weights is None or index.shape != picked.shape or weights.shape != top.shape:
            return top, picked
        self.forced.append(run.index)
        return weights.to(top.device), index.to(picked.device)  # (T, k) each


@torch.inference_mode()
def routed_points(model: Model, reference: Trace, recorder=None) -> tuple[dict, list[int]]:
    """`teacher_forced_points` with each MoE layer's experts on the reference's routing (the router still
    runs and records its own). A layer whose experts still diverge here computes them wrongly; one whose
    experts match here and not in the local run routes wrongly. Returns the points and the layers forced."""
    if "routing" not in model.steps:  # a family whose experts take no given routing (gpt-oss's own MoE)
        return {}, []
    given = GivenRouting(reference)
    forced = copy.copy(model)  # the same weights and spec; only the routing step differs
    forced.steps = model.steps.replace(routing=given)
    return teacher_forced_points(forced, reference, recorder), given.forced


def after_routing(names: list[str], layers: list[int]) -> list[str]:
    """Of points in recording order, those of `layers` recorded after the layer's `mlp.gate.top_k_weights`
    (the experts' sum, the shared expert, the MLP's and the block's outputs): the points its routing reaches."""
    routed, layer = [], None
    for name in names:
        at, sub = split_point(name)
        if sub == TOP_K_WEIGHTS:
            layer = at if at in layers else None
        elif at is not None and at == layer:
            routed.append(name)
    return routed
