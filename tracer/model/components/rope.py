"""Rotary position embeddings: the tables for absolute positions, the rotations, and the `Rope`
part of attention (its precision, a local base for sliding layers, partial rotary).

Positions are an input: a forward is given the absolute position of each token (int64 (T,)), and
the RoPE tables are computed from them (`Positions`), as transformers' `position_ids` and mlx-lm's
`offset` do; a decode step at position P is a call like any other. Every rope type tracer reads
(default, linear, llama3, longrope) takes positions; the regimes' emulations of ggml's and candle's
tables take them too (`tracer.ggml.ops.rope_cos_sin`, `tracer.ggml.candle.rotary`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from tracer.core.errors import TracerError
from tracer.core.lazy import torch
from tracer.model.component import Component
from tracer.model.knobs import Knob, choice, fixed, setting
from tracer.model.points import Q_ROPE

SLIDING = "sliding_attention"


def rope_inv_freq(spec, layer_type: str = "full_attention", num_tokens: int = 1) -> torch.Tensor:
    """(R/2,) inverse frequencies, f32, with the config's rope scaling applied. Gemma 3's sliding
    layers use their own base (`rope_local_theta`) without scaling; longrope picks its factors by
    the sequence length (the last position + 1), as transformers' `longrope_frequency_update` does."""
    dim, local = spec.rotary_dim, layer_type == SLIDING and spec.rope_local_theta is not None
    base = spec.rope_local_theta if local else spec.rope_theta
    scaling = None if local else spec.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        return _longrope_inv_freq(base, dim, scaling, num_tokens)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise TracerError(f"rope_type {kind!r} is not supported by the reimpl engine "
                      "(supported: default, linear, llama3, longrope)")


def _longrope_inv_freq(base: float, dim: int, scaling: dict, num_tokens: int) -> torch.Tensor:
    """Phi-3's longrope: per-frequency factors, the long ones past the pretraining length."""
    long = num_tokens > scaling["original_max_position_embeddings"]
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)  # (R/2,)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * base**shape)


def rope_attention_scaling(spec, layer_type: str = "full_attention") -> float:
    """The factor cos and sin are multiplied by: 1 but for longrope (sqrt(1 + ln(s)/ln(original)))."""
    scaling = spec.rope_scaling
    local = layer_type == SLIDING and spec.rope_local_theta is not None
    if local or scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or spec.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_cos_sin(spec, positions: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str = "cpu",
                   layer_type: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (1, T, R) for absolute `positions` (T,) ((B, T, R) for a batch's (B, T)), in the
    half-split layout (frequencies repeated, not interleaved); cast to `dtype` (None: kept in f32, as OLMo-2
    keeps them)."""
    positions = positions.to(device)
    positions = positions[None] if positions.dim() == 1 else positions  # (1, T) or (B, T)
    # On the run's device, as transformers computes them: a GPU's cos/sin differ from the CPU's in the last bit.
    inv_freq = rope_inv_freq(spec, layer_type, int(positions.max()) + 1).to(device)  # (R/2,)
    freqs = positions[..., None].float() * inv_freq  # (1, T, R/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (1, T, R)
    scale = rope_attention_scaling(spec, layer_type)
    cos, sin = (emb.cos(), emb.sin()) if scale == 1.0 else (emb.cos() * scale, emb.sin() * scale)
    return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's RoPE: x (1, heads, T, D), cos/sin (1, T, D)."""
    cos, sin = cos[:, None], sin[:, None]  # (1, 1, T, D)
    return (x * cos) + (rotate_half(x) * sin)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """candle's `rope_i` (the GGUF convention): rotates adjacent pairs (x0, x1), (x2, x3), ... by
    frequency i of pair i. On HF-layout weights, which pair dim i with dim i + D/2, it is wrong."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :, :half], sin[:, None, :, :half]  # (1, 1, T, D/2): one angle per pair
    pairs = x.unflatten(-1, (half, 2))  # (1, heads, T, D/2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]  # (1, heads, T, D/2) each
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # (1, heads, T, D/2, 2)
    return rotated.flatten(-2)  # (1, heads, T, D)


ROPES = {"half": rope_half, "interleaved": rope_interleaved}


def partial_rotary(rope: Callable) -> Callable:
    """Phi-3's partial rotary: `rope` on the first R dims of each head, the rest passed through."""

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotary_dim = cos.shape[-1]
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]  # (1, heads, T, R), (1, heads, T, D - R)
        return torch.cat([rope(x_rot, cos, sin), x_pass], dim=-1)  # (1, heads, T, D)

    return rotate


def rotated_in_f32(rope: Callable) -> Callable:
    """OLMo-2: cos/sin stay f32, so the rotation runs in f32 and the result is cast back to x's dtype."""
    return lambda x, cos, sin: rope(x, cos, sin).to(x.dtype)


class Positions:
    """The absolute positions of one forward's tokens (int64 (T,)) and their RoPE tables, computed
    once per layer type by the forward's `rotary` step (so a forward builds each table once, and a
    streamed run driving one block at a time reuses them).

    A left-padded batch (`Model.forward_batch`) has positions (B, T) and `real` (B, T) bool, True at
    each row's real tokens (what attention's padding mask is built from)."""

    def __init__(self, positions: torch.Tensor, spec, steps, dtype: torch.dtype, device,
                 real: torch.Tensor | None = None):
        self.positions, self.spec, self.steps, self.dtype, self.device = positions, spec, steps, dtype, device
        self.real = real
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return int(self.positions.shape[-1])

    def tables(self, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), (1, T, R) each, for one layer type (Gemma 3's local layers have their own base)."""
        if layer_type not in self._tables:
            dtype = self.dtype if self.steps.rope_cast else None
            self._tables[layer_type] = self.steps.rotary(self.spec, self.positions, dtype, self.device, layer_type)
        return self._tables[layer_type]


ROPE_LOCAL = Knob("rope_local", choice("local", "global"), "local | global", "local",
                  "Gemma 3's local (sliding) layers given the global RoPE base instead of rope_local_base_freq",
                  fixed("rope_local=global"),
                  expected=f"{Q_ROPE} of the first local layer (layer 0)", kind="config", after="window")


@dataclass(frozen=True)
class Rope(Component):
    """RoPE as attention applies it.

    Attributes:
        precision: "model" (cos/sin cast to the model dtype) or "f32" (rotate in f32, cast back: OLMo-2).
        local: its sliding layers rotate with their own base (Gemma 3's rope_local_base_freq).
    """

    precision: str = "model"
    local: bool = False

    @property
    def knobs(self) -> tuple:
        return (ROPE_LOCAL,) if self.local else ()

    def steps(self, knobs: dict, spec) -> dict:
        rope = ROPES[setting(knobs, "rope")]
        if self.precision == "f32":
            rope = rotated_in_f32(rope)
        if spec is not None and spec.rotary_dim < spec.head_dim:
            rope = partial_rotary(rope)
        return {"rope": rope, "rotary": rotary_cos_sin, "rope_cast": self.precision == "model"}
