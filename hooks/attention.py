"""Attention functions that record what no module returns: q/k after RoPE, scores, probs, context.

transformers calls the function registered under `config._attn_implementation` with q/k after
RoPE and k/v before `repeat_kv`. `recording_attention` registers a recording twin of the model's
implementation (and the matching mask function, without which a registered function receives no
mask) under a fresh name, switches the model to it, and undoes all three on exit.
"""

from __future__ import annotations

import itertools
import sys
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import repeat_kv

from tracer.core.torch_types import Recorder
from tracer.model.points import (
    CACHE_K,
    CACHE_V,
    CONTEXT,
    K_ROPE,
    PROBS,
    Q_ROPE,
    SCORES,
    fused_away,
    layer_point,
    split_point,
)

_session_ids = itertools.count()


def record_qk(record: Recorder, layer: int, query, key, value, cached: bool) -> None:
    """q and k after RoPE: this forward's own keys, the last of what a cache hands over (1, KV, T, D);
    with a cache (`cached`), all it holds as the points `cache_k`/`cache_v` (1, KV, S, D)."""
    record(layer_point(layer, Q_ROPE), query)  # (1, H, T, D)
    if not cached:  # the keys are this forward's own (an ONNX export reads the very node attention reads)
        record(layer_point(layer, K_ROPE), key)  # (1, KV, T, D)
        return
    record(layer_point(layer, K_ROPE), key[:, :, -query.shape[2]:].clone())  # (1, KV, T, D)
    record(layer_point(layer, CACHE_K), key)  # (1, KV, S, D)
    record(layer_point(layer, CACHE_V), value)  # (1, KV, S, D)


class _ScoresSeen(TorchFunctionMode):
    """Inside a model's own eager attention function: its scores, the first product with q·kᵀ (the first
    matmul's result), as it forms them."""

    def __init__(self):
        super().__init__()
        self.qk = self.scores = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if self.qk is None and name == "matmul":
            self.qk = out
        elif self.scores is None and self.qk is not None and name in ("mul", "__mul__"):
            if any(arg is self.qk for arg in args):
                self.scores = out
        return out


def sinks_recorded(record: Recorder, layer: int, module, query, key, value, attention_mask, **kwargs):
    """gpt-oss (`s_aux`, its sinks): its own modeling file's eager function runs, the sinks' column in its
    softmax; the scores seen as it forms them, the probs (the sinks' column dropped) and context as it returns
    them."""
    own = sys.modules[type(module).__module__].eager_attention_forward
    with _ScoresSeen() as seen:
        attn_output, attn_weights = own(module, query, key, value, attention_mask, **kwargs)  # (1, T, H, D), ...
    record(layer_point(layer, SCORES), seen.scores)  # (1, H, T, S)
    record(layer_point(layer, PROBS), attn_weights)  # (1, H, T, S)
    record(layer_point(layer, CONTEXT), attn_output.reshape(*attn_output.shape[:-2], -1))  # (1, T, H*D)
    return attn_output, attn_weights


def eager_recording(record: Recorder, names: dict[nn.Module, str], cached: bool = False) -> Callable:
    """transformers' `eager_attention_forward`, op for op, recording scores, probs and context.

    One function for every family tracer traces: theirs differ only in Gemma's soft-cap (the
    `softcap` argument, applied before the mask; `scores` is recorded after it) and in the scaling
    the attention module passes (Gemma's query_pre_attn_scalar); gpt-oss's sinks (`s_aux`) run its own
    function (`sinks_recorded`). Sliding windows arrive in the mask, which transformers builds with the
    mask function registered under the same name.
    """

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
        layer = split_point(names[module])[0]  # the attention module model.layers.{i}.self_attn
        record_qk(record, layer, query, key, value, cached)
        if kwargs.get("s_aux") is not None:  # gpt-oss's sinks: its own function, observed
            return sinks_recorded(record, layer, module, query, key, value, attention_mask, scaling=scaling,
                                  dropout=dropout, **kwargs)
        if scaling is None:  # Gemma's eager function defaults it so
            scaling = module.head_dim**-0.5
        key_states = repeat_kv(key, module.num_key_value_groups)  # (1, H, T, D)
        value_states = repeat_kv(value, module.num_key_value_groups)  # (1, H, T, D)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling  # (1, H, T, S)
        if softcap is not None:  # Gemma 2
            attn_weights = attn_weights / softcap
            attn_weights = torch.tanh(attn_weights)
            attn_weights = attn_weights * softcap
        record(layer_point(layer, SCORES), attn_weights)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
        record(layer_point(layer, PROBS), attn_weights)
        attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
        attn_output = torch.matmul(attn_weights, value_states)  # (1, H, T, D)
        attn_output = attn_output.transpose(1, 2).contiguous()  # (1, T, H, D)
        # (1, T, H*D), reshaped as the attention module then reshapes it: in an ONNX export the point is
        # then the very value o_proj reads (one node), not a copy beside it
        record(layer_point(layer, CONTEXT), attn_output.reshape(*attn_output.shape[:-2], -1))
        return attn_output, attn_weights

    return attention


def fused_recording(inner: Callable, record: Recorder, names: dict[nn.Module, str], cached: bool = False) -> Callable:
    """Wraps a fused implementation (sdpa, ...): only its inputs and output can be recorded."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer = split_point(names[module])[0]  # the attention module model.layers.{i}.self_attn
        record_qk(record, layer, query, key, value, cached)
        attn_output, attn_weights = inner(module, query, key, value, attention_mask, **kwargs)
        record(layer_point(layer, CONTEXT), attn_output.flatten(2))  # (1, T, H, D) -> (1, T, H*D)
        return attn_output, attn_weights

    return attention


def unobservable_points(implementation: str) -> dict[str, str]:
    """Per-layer points (relative to `self_attn`) this implementation never materializes."""
    if implementation == "eager":
        return {}
    reason = (
        f"attn_implementation={implementation!r} fuses scores and softmax; "
        "load the model with attn_implementation='eager' to record them"
    )
    return fused_away(reason)


@contextmanager
def recording_attention(model, record: Recorder, names: dict[nn.Module, str], cached: bool = False):
    """Route `model`'s attention through a recording function for the duration of the block;
    `cached`: the forward runs with a KV cache, whose contents are recorded too."""
    implementation = model.config._attn_implementation
    if implementation == "eager":
        function = eager_recording(record, names, cached)
    else:
        inner = ALL_ATTENTION_FUNCTIONS.get(implementation, sdpa_attention_forward)
        function = fused_recording(inner, record, names, cached)
    name = f"tracer_{implementation}_{next(_session_ids)}"
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    try:
        model.set_attn_implementation(name)
        yield
    finally:
        model.set_attn_implementation(implementation)
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
