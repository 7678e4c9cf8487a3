"""RMSNorm and its flavours, each a subclass stating only how it differs (transformers'
`modeling_llama.py`, `modeling_gemma.py`, `modeling_olmo2.py`).

A family names one flavour (`Family.norm`); every norm of its model computes with it (the block's,
the q/k norms', the final one). Which norms a block has, and where, is the block's
(`tracer.model.components.block`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.core.lazy import torch
from tracer.model.component import Component
from tracer.model.knobs import Knob, choice, fixed, setting
from tracer.model.points import INPUT_NORM


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama: x · rsqrt(mean(x²) + eps) in f32, cast back, then × weight."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)


def rms_norm_candle(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """candle_nn::ops::rms_norm on CPU: sum of squares in f32, the root cast to the load dtype, then
    x / root * weight in the load dtype (HF multiplies by rsqrt in f32 and casts before the weight)."""
    root = torch.sqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
    return x / root * weight


def rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma: normalized in f32, times (1 + weight) in f32, then cast (the stored weight is an offset)."""
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def rms_norm_gemma_no_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A Gemma port that forgets the 1: times the stored weight (near 0) instead of (1 + weight)."""
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).type_as(x)


def rms_norm_olmo(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """OLMo-2: the weight multiplies the f32 normalized values, and only then the cast."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(input_dtype)


CANDLE_NORM = Knob("norm", choice("hf", "candle"), "hf | candle", "hf",
                   "candle's RMSNorm: x / root in the load dtype (HF: x * rsqrt in f32, cast, then weight)",
                   fixed("norm=candle"), kind="semantic", after="attn_math")
NORM_OFFSET = Knob("norm_offset", choice("keep", "drop"), "keep | drop", "keep",
                   "Gemma's RMSNorm scales by (1 + weight); a port that multiplies by the stored weight forgets the 1",
                   fixed("norm_offset=drop"), expected=f"layers.0.{INPUT_NORM}", kind="semantic", after="head_dim")


@dataclass(frozen=True)
class RMSNorm(Component):
    """Llama's RMSNorm (candle's variant of it: `norm=candle`)."""

    knobs = (CANDLE_NORM,)

    def steps(self, knobs: dict, spec) -> dict:
        return {"norm": {"hf": rms_norm, "candle": rms_norm_candle}[setting(knobs, "norm")]}


@dataclass(frozen=True)
class GemmaRMSNorm(RMSNorm):
    """Gemma's: × (1 + weight) in f32, then the cast."""

    knobs = (NORM_OFFSET,)

    def steps(self, knobs: dict, spec) -> dict:
        return {"norm": {"keep": rms_norm_gemma, "drop": rms_norm_gemma_no_offset}[setting(knobs, "norm_offset")]}


@dataclass(frozen=True)
class Olmo2RMSNorm(RMSNorm):
    """OLMo-2's: × weight in f32, then the cast."""

    knobs = ()

    def steps(self, knobs: dict, spec) -> dict:
        return {"norm": rms_norm_olmo}
