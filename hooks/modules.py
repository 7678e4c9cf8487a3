"""Forward hooks on the module outputs (and inputs) that are points.

Module outputs are recorded under their HF module path. Points that are module *inputs* (the
residual stream after attention, `resid_mid`, is the input of `post_attention_layernorm`; the MLP's
`act(gate) * up`, `mlp.act`, the input of `down_proj`) are taken by forward pre-hooks. Which is
which is read from the point table (`tracer.points.SUB_POINTS`, its `observed` field); a module
this model does not have (another family's point) is not hooked.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from tracer.points import MODEL_POINTS, SUB_POINTS

Recorder = Callable[[str, torch.Tensor], None]

# What the table says each point is: a module's output, or the first input of a module.
LAYER_OUTPUTS = tuple(sub.name for sub in SUB_POINTS.values() if sub.observed == "output")
LAYER_INPUTS = {sub.name: sub.observed.removeprefix("input:") for sub in SUB_POINTS.values()
                if sub.observed.startswith("input:")}
MODEL_OUTPUTS = tuple(MODEL_POINTS)


def _first_tensor(value) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def _output_hook(record: Recorder, point: str):
    return lambda module, args, output: record(point, _first_tensor(output))


def _input_hook(record: Recorder, point: str):
    return lambda module, args: record(point, args[0])


def _join(prefix: str, sub: str) -> str:
    return f"{prefix}.{sub}" if sub else prefix


@contextmanager
def recording_modules(model: nn.Module, record: Recorder, layer_prefixes: list[str]):
    """Attach every hook; remove every handle on exit, even when the forward raises."""
    modules = dict(model.named_modules())
    handles = []
    try:
        for point in MODEL_OUTPUTS:
            handles.append(modules[point].register_forward_hook(_output_hook(record, point)))
        for prefix in layer_prefixes:
            for sub in LAYER_OUTPUTS:
                point = _join(prefix, sub)
                if point in modules:
                    handles.append(modules[point].register_forward_hook(_output_hook(record, point)))
            for sub, module_name in LAYER_INPUTS.items():
                module = modules.get(_join(prefix, module_name))
                if module is not None:
                    handles.append(module.register_forward_pre_hook(_input_hook(record, _join(prefix, sub))))
        yield
    finally:
        for handle in handles:
            handle.remove()
