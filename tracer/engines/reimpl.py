"""The `reimpl` engine: tracer's own instrumented forward (`tracer.reimpl.forward`, every family of
`tracer.model.families`), no transformers import; it takes explicit positions."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tracer.engines.base import EngineBase, decode_steps, per_layer
from tracer.engines.batch import RowRecorders, left_padded
from tracer.engines.registry import ENGINES
from tracer.files.sources import ModelSource
from tracer.model.components.rope import rope_type
from tracer.model.kv_cache import KVCache, decode_is_forward, ring_slot
from tracer.reimpl.forced_runs import cached_step_points, op_forced_points, routed_points, teacher_forced_points
from tracer.reimpl.forward import Model
from tracer.traces.trace import Trace, TraceMeta, TraceRecorder


class ReimplEngine(EngineBase):
    entry = ENGINES["reimpl"]

    def __init__(self, model: Model, label: str):
        self.model, self.label, self.variant, self.device = model, label, model.variant, model.device
        self.vocab_size, self.max_positions = model.spec.vocab_size, model.spec.max_position_embeddings
        if rope_type(model.spec) == "dynamic":  # dynamic NTK grows its base past max_position_embeddings
            self.max_positions = None

    def record(self, tokens: list[int], recorder=None, *, positions: torch.Tensor | None = None) -> Trace:
        """Every point of one forward at `positions` (default 0..T-1); `recorder` (default in memory)
        may spill to disk instead."""
        offset = self.first_position(tokens, positions)
        recorder = recorder if recorder is not None else TraceRecorder()
        self.model.forward(torch.tensor(tokens), recorder, positions=positions)
        return Trace(recorder.tensors, self._meta(tokens, offset))

    def decode(self, tokens: list[int], count: int, *, forced: list[int] | None = None, offset: int = 0,
               recorded=None) -> Trace:
        """The prefill and `count` decode steps with its own KV cache (`tracer.model.kv_cache`: a ring
        buffer on sliding layers); the model picks each step's position from the cache (where the decode
        knobs get it wrong). With `cache_reset=kept` the steps run on the cache another prompt left.
        `recorded`: the steps whose points are recorded (`decode_steps`)."""
        cache = self.new_cache()
        steps_cache = cache
        if self.model.steps.cache_left_over:  # the previous request: the prompt, every token id one higher
            steps_cache = self.new_cache()
            previous = torch.tensor([(token + 1) % self.model.spec.vocab_size for token in tokens])
            self.model.forward(previous, positions=torch.arange(offset, offset + len(tokens)), cache=steps_cache)

        def forward(ids: list[int], start: int, record: bool = True) -> tuple[Trace, torch.Tensor]:
            recorder = TraceRecorder()
            held = cache if cache.length == 0 else steps_cache
            at = torch.arange(start, start + len(ids)) if cache.length == 0 else None  # the prompt's, as given
            logits = self.model.forward(torch.tensor(ids), recorder if record else None, positions=at,
                                        cache=held)  # (T, V)
            return Trace(recorder.tensors, self._meta(ids, start or None)), logits

        return decode_steps(forward, tokens, count, forced, offset, recorded)

    @property
    def decode_is_forward(self) -> bool:
        """Its cached decode computes what its forward computes, rounding apart (no cache knob in the variant)."""
        return decode_is_forward(self.model.steps)

    def record_batch(self, rows: list[list[int]]) -> list[Trace]:
        """The rows left-padded into one batched forward with an attention mask (`Model.forward_batch`); one
        trace per row, at its real positions (`tracer.engines.batch`)."""
        padded = left_padded(rows)
        recorders = RowRecorders(padded)
        self.model.forward_batch(padded.ids, padded.mask, recorders)
        return [Trace(recorder.tensors, self._meta(row)) for recorder, row in zip(recorders.rows, rows)]

    def new_cache(self):
        """An empty KV cache for this model: a ring of the window's slots on each sliding layer."""
        spec, steps = self.model.spec, self.model.steps
        windows = [steps.window(spec, i) for i in range(spec.num_hidden_layers)]
        return KVCache(spec.num_hidden_layers, windows, steps.ring_slot or ring_slot,
                       [steps.cached_window(window) for window in windows])

    def logits(self, tokens: list[int], *, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.forward(torch.tensor(tokens), positions=positions)

    def local_trace(self, reference: Trace, recorder=None) -> Trace:
        """Every block rerun on the reference's input to that block (`tracer.reimpl.forced_runs`)."""
        return Trace(teacher_forced_points(self.model, reference, recorder),
                     self._meta(reference.tokens, reference.meta.position_offset))

    def routed_trace(self, reference: Trace, recorder=None) -> tuple[Trace, list[int]]:
        """The local run with each MoE layer's experts on the reference's routing, and the layers so forced
        (`tracer.reimpl.forced_runs.routed_points`)."""
        tensors, layers = routed_points(self.model, reference, recorder)
        return Trace(tensors, self._meta(reference.tokens, reference.meta.position_offset)), layers

    def local_step_trace(self, step: Trace, before: Trace | None, prefilled: int, recorder=None) -> Trace:
        """A decode step rerun on the reference's inputs and on its cache before the step (`before`'s;
        None: the prefill, into an empty cache): `tracer.reimpl.forced_runs.cached_step_points`."""
        return Trace(cached_step_points(self.model, step, before, prefilled, recorder),
                     self._meta(step.tokens, step.meta.position_offset))

    def op_trace(self, reference: Trace, recorder=None) -> Trace:
        """Every op rerun on the reference's values of its inputs (`tracer.reimpl.forced_runs.op_forced_points`)."""
        return Trace(op_forced_points(self.model, reference, recorder),
                     self._meta(reference.tokens, reference.meta.position_offset))

    def trace(self, tensors, tokens: list[int], offset: int | None = None) -> Trace:
        """The trace of a forward over `tokens` whose points a driver recorded unit by unit
        (`tracer.reimpl.unit_runs.FreeRun`): what `record` returns for the same points."""
        return Trace(tensors, self._meta(tokens, offset or None))

    def _meta(self, tokens: list[int], offset: int | None = None) -> TraceMeta:
        spec = self.model.spec
        not_recorded = per_layer(spec.num_hidden_layers, self.model.not_recorded())
        return self.meta(tokens, self.model.steps.dtype, not_recorded, num_layers=spec.num_hidden_layers,
                         unused_config_keys=list(spec.unused_keys), unused_tensors=self.model.unused_tensors,
                         family=spec.family, position_offset=offset)


def load(source: ModelSource, variant: dict, *, argument: str | None = None, device: str | torch.device = "cpu",
         stream: bool = False) -> ReimplEngine:
    """From a model directory, or an already loaded transformers model (its config and state dict
    read our own way). `stream`: each block's weights read from the files when it runs. `device` is
    the run's, checked once (`tracer.engines.load.resolve_target`)."""
    placement = {"device": torch.device(device), "stream": stream}
    if source.loaded:
        model = Model.from_config(source.config(), dict(source.module.state_dict()), variant, **placement)
        return ReimplEngine(model, source.name)
    return ReimplEngine(Model.from_dir(source.directory, variant, **placement), source.name)


def from_parts(config: dict, weights: Mapping[str, torch.Tensor], variant: dict, label: str, *,
               device: torch.device = torch.device("cpu"), stream: bool = False) -> ReimplEngine:
    """A reimpl engine from a config dict and weights already read (a sweep reads them once), on a device
    resolved already (`tracer.engines.load.resolve_target`)."""
    return ReimplEngine(Model.from_config(config, weights, variant, device=device, stream=stream), label)
