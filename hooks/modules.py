"""Forward hooks on the module outputs (and inputs) that are points.

Module outputs are recorded under their HF module path. Two points are module *inputs*: the
residual stream after attention (`resid_mid`, input of `post_attention_layernorm`) and the MLP's
`act(gate) * up` (`mlp.act`, input of `down_proj`); forward pre-hooks take them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

Recorder = Callable[[str, torch.Tensor], None]

# Per-layer submodules whose output is the point of the same name.
LAYER_OUTPUTS = (
    "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "",
)
# Per-layer point -> submodule whose first input it is.
LAYER_INPUTS = {"resid_mid": "post_attention_layernorm", "mlp.act": "mlp.down_proj"}
MODEL_OUTPUTS = ("model.embed_tokens", "model.norm", "lm_head")


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
                handles.append(modules[point].register_forward_hook(_output_hook(record, point)))
            for sub, module_name in LAYER_INPUTS.items():
                module = modules[_join(prefix, module_name)]
                handles.append(module.register_forward_pre_hook(_input_hook(record, _join(prefix, sub))))
        yield
    finally:
        for handle in handles:
            handle.remove()
