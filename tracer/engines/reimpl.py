"""The `reimpl` engine: tracer's own instrumented forward (`tracer.reimpl.forward`, every family of
`tracer.model.families`), no transformers import; it takes explicit positions."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tracer.comparison.trace import Trace, TraceMeta, TraceRecorder
from tracer.engines.base import EngineBase, check_device, decode_steps, per_layer, refuse_windowed_decode
from tracer.engines.registry import ENGINES
from tracer.files.sources import ModelSource
from tracer.reimpl.forward import Model


class ReimplEngine(EngineBase):
    entry = ENGINES["reimpl"]

    def __init__(self, model: Model, label: str):
        self.model, self.label, self.variant, self.device = model, label, model.variant, model.device
        self.vocab_size, self.max_positions = model.spec.vocab_size, model.spec.max_position_embeddings

    def record(self, tokens: list[int], recorder=None, *, positions: torch.Tensor | None = None) -> Trace:
        """Every point of one forward at `positions` (default 0..T-1); `recorder` (default in memory)
        may spill to disk instead."""
        offset = self.first_position(tokens, positions)
        recorder = recorder if recorder is not None else TraceRecorder()
        self.model.forward(torch.tensor(tokens), recorder, positions=positions)
        return Trace(recorder.tensors, self._meta(tokens, offset))

    def decode(self, tokens: list[int], count: int, *, forced: list[int] | None = None, offset: int = 0) -> Trace:
        """The prefill and `count` decode steps with its own KV cache (`tracer.reimpl.kv_cache`); the
        model picks each step's position from the cache (where the decode knobs get it wrong)."""
        from tracer.reimpl.kv_cache import KVCache

        spec = self.model.spec
        windowed = next((i for i in range(spec.num_hidden_layers) if self.model.steps.window(spec, i)), None)
        refuse_windowed_decode(self.name, None if windowed is None else spec.window(windowed), windowed,
                               offset + len(tokens) + count)
        cache = KVCache(self.model.spec.num_hidden_layers)

        def forward(ids: list[int], start: int) -> tuple[Trace, torch.Tensor]:
            recorder = TraceRecorder()
            at = torch.arange(start, start + len(ids)) if cache.length == 0 else None  # the prompt's, as given
            logits = self.model.forward(torch.tensor(ids), recorder, positions=at, cache=cache)  # (T, V)
            return Trace(recorder.tensors, self._meta(ids, start or None)), logits

        return decode_steps(forward, tokens, count, forced, offset)

    def logits(self, tokens: list[int], *, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.forward(torch.tensor(tokens), positions=positions)

    def local_trace(self, reference: Trace, recorder=None) -> Trace:
        """Every block rerun on the reference's input to that block (`tracer.reimpl.forced_runs`)."""
        from tracer.reimpl.forced_runs import teacher_forced_points

        return Trace(teacher_forced_points(self.model, reference, recorder),
                     self._meta(reference.tokens, reference.meta.position_offset))

    def op_trace(self, reference: Trace, recorder=None) -> Trace:
        """Every op rerun on the reference's values of its inputs (`tracer.reimpl.forced_runs.op_forced_points`)."""
        from tracer.reimpl.forced_runs import op_forced_points

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
    `load_engine`'s, already checked."""
    placement = {"device": torch.device(device), "stream": stream}
    if source.loaded:
        model = Model.from_config(source.config(), dict(source.module.state_dict()), variant, **placement)
        return ReimplEngine(model, source.name)
    return ReimplEngine(Model.from_dir(source.directory, variant, **placement), source.name)


def from_parts(config: dict, weights: Mapping[str, torch.Tensor], variant: dict, label: str, *,
               device: str | torch.device = "cpu", stream: bool = False) -> ReimplEngine:
    """A reimpl engine from a config dict and weights already read (a sweep reads them once)."""
    return ReimplEngine(Model.from_config(config, weights, variant, device=check_device(device), stream=stream), label)
