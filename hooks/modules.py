"""Forward hooks on the module outputs (and inputs) that are points.

Module outputs are recorded under their HF module path. Points that are module *inputs* (the
residual stream after attention, `resid_mid`, is the input of `post_attention_layernorm` in Llama,
of `pre_feedforward_layernorm` in Gemma and of the MLP in OLMo-2; the MLP's `act(gate) * up`,
`mlp.act`, the input of `down_proj`) are taken by forward pre-hooks. Which is which is read from
the point table as the model's family has it (`tracer.model.points.sub_points(family)`, its `observed`
field), and so is the layout of a module that returns per-head values (Qwen3's q_norm returns
(1, T, H, D), Gemma 3's (1, H, T, D); the point is (T, H·D); a module that flattens the batch away,
a mixture of experts' router, returns (T, X); "output[2]:(T, X)" is the third of the values it returns, of
the module the point is a virtual point under, or of the one "MODULE>output[2]:(T, X)" names).
Gemma's capped logits are the whole model's output. What a module computes but returns to no one (a
router's softmax over every expert, Qwen2-MoE's shared expert after its sigmoid gate) is observed inside
transformers' own forward of that module ("within:MODULE:WHAT", `hooks.within`): never recomputed here.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from tracer.core.torch_types import Recorder
from tracer.hooks.within import within
from tracer.model.points import model_point_records, sub_points

# How a module's output becomes the point's layout (batch kept): "output:(T, H, D)" -> (1, T, H*D), ...
TO_POINT_LAYOUT = {
    "output": lambda t: t,
    "output:(T, H, D)": lambda t: t.flatten(2),  # (1, T, H, D) -> (1, T, H*D)
    "output:(H, T, D)": lambda t: t.transpose(1, 2).flatten(2),  # (1, H, T, D) -> (1, T, H*D)
    "output:(T, X)": lambda t: t[None],  # (T, X) -> (1, T, X)
}


def _nth_tensor(value, index: int = 0) -> torch.Tensor:
    return value[index] if isinstance(value, (tuple, list)) else value


def _output_hook(record: Recorder, point: str, to_layout=TO_POINT_LAYOUT["output"], index: int = 0):
    return lambda module, args, output: record(point, to_layout(_nth_tensor(output, index)))


def _output_index(observed: str) -> tuple[str, int]:
    """"output[2]:(T, X)" -> ("output:(T, X)", 2): the third value a module returns."""
    head, _, layout = observed.partition(":")
    if not head.startswith("output[") or not head.endswith("]"):
        return observed, 0
    return "output" + (f":{layout}" if layout else ""), int(head[len("output["):-1])


def _input_hook(record: Recorder, point: str):
    return lambda module, args: record(point, args[0])


def _model_output_hook(record: Recorder, point: str, field: str):
    return lambda module, args, output: record(point, output[field])


def _join(prefix: str, sub: str) -> str:
    return f"{prefix}.{sub}" if prefix and sub else prefix or sub


def _hook(modules: dict, prefix: str, sub: str, observed: str, point: str, record: Recorder):
    """The handle of one point's hook, as the table says it is observed; None where the model has no
    such module, or where the attention function records the point."""
    if observed.startswith("input:"):
        module = modules.get(_join(prefix, observed.removeprefix("input:")))
        return None if module is None else module.register_forward_pre_hook(_input_hook(record, point))
    if observed.startswith("model:"):  # a field of the whole model's output
        return modules[""].register_forward_hook(_model_output_hook(record, point, observed.removeprefix("model:")))
    if observed.startswith("module:"):  # another module's output (DeepSeek-V3's mlp.shared_experts)
        module = modules.get(_join(prefix, observed.removeprefix("module:")))
        return None if module is None else module.register_forward_hook(_output_hook(record, point))
    if observed.startswith("within:"):
        _, inside, what = observed.split(":")
        module = modules.get(_join(prefix, inside))
        return None if module is None else within(module, what, lambda tensor: record(point, tensor))
    inside, named, returned = observed.rpartition(">")  # "MODULE>output[i]:...": a module named otherwise
    observed, index = _output_index(returned)
    # the i-th value a module returns is a virtual point under it (`mlp.gate.top_k_index` of `mlp.gate`), or
    # of the module named before ">" (gpt-oss's router is `mlp.router`)
    module = modules.get(_join(prefix, inside if named else sub.rsplit(".", 1)[0] if index else sub))
    if observed not in TO_POINT_LAYOUT or module is None:
        return None
    return module.register_forward_hook(_output_hook(record, point, TO_POINT_LAYOUT[observed], index))


@contextmanager
def recording_modules(model: nn.Module, record: Recorder, layer_prefixes: list[str], family: str = "llama",
                      model_points: tuple[str, ...] | None = None):
    """Attach every hook of `family`'s points (and of `model_points`, the points outside the blocks:
    embeddings, final norm, logits by default); remove every handle on exit, even when the forward raises."""
    outside = model_point_records(family)
    modules = dict(model.named_modules())
    handles = []
    try:
        for point in model_points or model_point_records(family, False):
            handles.append(_hook(modules, "", point, outside[point].observed, point, record))
        for prefix in layer_prefixes:
            for sub, entry in sub_points(family).items():
                handles.append(_hook(modules, prefix, sub, entry.observed, _join(prefix, sub), record))
        yield
    finally:
        for handle in handles:
            if handle is not None:
                handle.remove()
