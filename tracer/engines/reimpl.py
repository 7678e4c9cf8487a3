"""The `reimpl` engine: tracer's own instrumented forward (`tracer.llama`, every family of
`tracer.families`), no transformers import."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tracer.engines.base import check_device, per_layer, trace_meta
from tracer.engines.registry import ENGINES
from tracer.llama import Llama
from tracer.sources import ModelSource
from tracer.trace import Trace, TraceMeta, TraceRecorder


class ReimplEngine:
    entry = ENGINES["reimpl"]
    name = entry.name

    def __init__(self, llama: Llama, model: str):
        self.llama, self.model, self.variant = llama, model, llama.variant

    @property
    def device(self) -> torch.device:
        return self.llama.device

    @property
    def vocab_size(self) -> int:
        return self.llama.spec.vocab_size

    @property
    def max_positions(self) -> int:
        return self.llama.spec.max_position_embeddings

    def record(self, tokens: list[int], recorder=None) -> Trace:
        """Every point of one forward; `recorder` (default in memory) may spill to disk instead."""
        recorder = recorder if recorder is not None else TraceRecorder()
        self.llama.forward(torch.tensor(tokens), recorder)
        return Trace(recorder.tensors, self._meta(tokens))

    def logits(self, tokens: list[int]) -> torch.Tensor:
        return self.llama.forward(torch.tensor(tokens))

    def local_trace(self, reference: Trace, recorder=None) -> Trace:
        """Every block rerun on the reference's input to that block (`tracer.forced_runs`)."""
        from tracer.forced_runs import teacher_forced_points

        return Trace(teacher_forced_points(self.llama, reference, recorder), self._meta(reference.tokens))

    def op_trace(self, reference: Trace, recorder=None) -> Trace:
        """Every op rerun on the reference's values of its inputs (`tracer.forced_runs.op_forced_points`)."""
        from tracer.forced_runs import op_forced_points

        return Trace(op_forced_points(self.llama, reference, recorder), self._meta(reference.tokens))

    def _meta(self, tokens: list[int]) -> TraceMeta:
        spec = self.llama.spec
        not_recorded = per_layer(spec.num_hidden_layers, self.llama.strategies.not_recorded())
        return trace_meta(self, self.model, tokens, self.llama.strategies.dtype, not_recorded,
                          num_layers=spec.num_hidden_layers, unused_config_keys=list(spec.unused_keys),
                          unused_tensors=self.llama.unused_tensors, family=spec.family)


def load(source: ModelSource, variant: dict, *, argument: str | None = None, device: str | torch.device = "cpu",
         stream: bool = False) -> ReimplEngine:
    """From a model directory, or an already loaded transformers model (its config and state dict
    read our own way). `stream`: each block's weights read from the files when it runs."""
    placement = {"device": check_device(device), "stream": stream}
    if source.loaded:
        llama = Llama.from_config(source.config(), dict(source.module.state_dict()), variant, **placement)
        return ReimplEngine(llama, source.name)
    return ReimplEngine(Llama.from_dir(source.directory, variant, **placement), source.name)


def from_parts(config: dict, weights: Mapping[str, torch.Tensor], variant: dict, label: str, *,
               device: str | torch.device = "cpu", stream: bool = False) -> ReimplEngine:
    """A reimpl engine from a config dict and weights already read (a sweep reads them once)."""
    return ReimplEngine(Llama.from_config(config, weights, variant, device=check_device(device), stream=stream), label)
