"""Rotary position embeddings: the tables for absolute positions, the rotations, and the `Rope`
part of attention (its precision, a local base for sliding layers, partial rotary).

Positions are an input: a forward is given the absolute position of each token (int64 (T,)), and
the RoPE tables are computed from them (`Positions`), as transformers' `position_ids` and mlx-lm's
`offset` do; a decode step at position P is a call like any other. Every rope type tracer reads
(default, linear, llama3, yarn, dynamic, longrope) takes positions; the regimes' emulations of ggml's
and candle's tables take them too (`tracer.ggml.ops.rope_cos_sin`, `tracer.ggml.candle.rotary`).

The scalings mirror transformers 5's `modeling_rope_utils` op by op (its `_compute_<type>_parameters`
and `dynamic_rope_update`), so that hf and reimpl agree bitwise at position 100000 as at 0. Two of them
depend on the sequence, that is on the last position of the forward + 1: longrope picks its short or
long factors by it, dynamic NTK grows its base with it. A decode step of one token at position P
computes its tables for P + 1, as transformers' rotary embedding does on a cached step.

The classic scaling mistakes of ports are knobs of `Rope` (`llama3_factors`, `longrope_ctx`,
`yarn_mscale`): each reads the config's scaling as the mistaken port does, before the tables are made.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

from tracer.core.errors import TracerError
from tracer.core.lazy import torch
from tracer.model.component import Component, ConfigField
from tracer.model.config import DEFAULT_ROPE_THETA, check, given, hf_rope, json_object, refuse
from tracer.model.knobs import Knob, choice, fixed, setting
from tracer.model.points import Q_ROPE

SLIDING = "sliding_attention"


def rope_inv_freq(spec, layer_type: str = "full_attention", num_tokens: int = 1,
                  scaling: dict | None | str = "config") -> torch.Tensor:
    """(R/2,) inverse frequencies, f32, with the config's rope scaling applied (`scaling`: another
    reading of it, a knob's). Gemma 3's sliding layers use their own base (`rope_local_theta`) without
    scaling; longrope picks its factors and dynamic NTK its base by the sequence length `num_tokens`
    (the last position + 1), as transformers' `dynamic_rope_update` does."""
    dim, local = rotary_dim(spec), layer_type == SLIDING and spec.rope_local_theta is not None
    base = spec.rope_local_theta if local else spec.rope_theta
    scaling = None if local else spec.rope_scaling if scaling == "config" else scaling
    kind = "default" if scaling is None else scaling["rope_type"]
    if kind == "longrope":
        return _longrope_inv_freq(base, dim, scaling, num_tokens)
    if kind == "yarn":
        return _yarn_inv_freq(base, dim, scaling)
    if kind == "dynamic" and num_tokens > spec.max_position_embeddings:
        return _dynamic_inv_freq(base, dim, scaling["factor"], num_tokens, spec.max_position_embeddings)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if kind in ("default", "dynamic"):  # dynamic NTK within max_position_embeddings: the plain base
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise TracerError(f"rope_type {kind!r} is not supported by the reimpl engine "
                      f"(supported: {', '.join(ROPE_TYPES)})")


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def _dynamic_inv_freq(base: float, dim: int, factor: float, num_tokens: int, max_positions: int) -> torch.Tensor:
    """Dynamic NTK past max_position_embeddings: the base grows with the sequence length. transformers
    computes it from the int64 tensor max(position_ids) + 1, so in f32 (`_compute_dynamic_ntk_parameters`)."""
    length = torch.tensor(num_tokens)  # int64 0-d, as transformers' seq_len
    grown = base * ((factor * length / max_positions) - (factor - 1)) ** (dim / (dim - 2))  # f32 0-d
    return 1.0 / (grown ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_inv_freq(base: float, dim: int, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the pretraining length interpolated
    (divided by `factor`), those turning more than beta_fast times kept, a linear ramp between
    (transformers' `_compute_yarn_parameters`, `truncate` rounding the ramp's ends outwards)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim whose frequency turns `rotations` times
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # (R/2,)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # (R/2,)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1·mscale·ln(factor) + 1 (1 for factor <= 1), transformers' `yarn_get_mscale`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope_inv_freq(base: float, dim: int, scaling: dict, num_tokens: int) -> torch.Tensor:
    """Phi-3's longrope: per-frequency factors, the long ones past the pretraining length."""
    long = num_tokens > scaling["original_max_position_embeddings"]
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)  # (R/2,)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * base**shape)


def rope_attention_scaling(spec, layer_type: str = "full_attention", scaling: dict | None | str = "config") -> float:
    """The factor cos and sin are multiplied by (transformers' `attention_scaling`): 1 but for longrope
    (sqrt(1 + ln(s)/ln(original))) and yarn (0.1·ln(s) + 1, or mscale over mscale_all_dim), unless
    the config gives `attention_factor`. (MLA models also fold mscale_all_dim into the softmax scale,
    transformers' `yarn_apply_mscale`; no family tracer reads is one.)"""
    local = layer_type == SLIDING and spec.rope_local_theta is not None
    scaling = None if local else spec.rope_scaling if scaling == "config" else scaling
    if scaling is None or scaling["rope_type"] not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or spec.max_position_embeddings / original
    if scaling["rope_type"] == "yarn":
        mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and all_dims:
            return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims))
        return yarn_mscale(factor)
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
                   layer_type: str = "full_attention",
                   misread: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (1, T, R) for absolute `positions` (T,) ((B, T, R) for a batch's (B, T)), in the
    half-split layout (frequencies repeated, not interleaved); cast to `dtype` (None: kept in f32, as OLMo-2
    keeps them). `misread`: (scaling, sequence length) -> the pair as a mistaken port reads them (the
    scaling knobs)."""
    positions = positions.to(device)
    positions = positions[None] if positions.dim() == 1 else positions  # (1, T) or (B, T)
    scaling, length = spec.rope_scaling, int(positions.max()) + 1
    if misread is not None and scaling is not None:
        scaling, length = misread(scaling, length)
    # On the run's device, as transformers computes them: a GPU's cos/sin differ from the CPU's in the last bit.
    inv_freq = rope_inv_freq(spec, layer_type, length, scaling).to(device)  # (R/2,)
    freqs = positions[..., None].float() * inv_freq  # (1, T, R/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (1, T, R)
    scale = rope_attention_scaling(spec, layer_type, scaling)
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
                  expected=f"{Q_ROPE} of the first local layer (layer 0)", kind="config", after="window",
                  spec_change=lambda spec, value: spec.replace(rope_local_theta=spec.rope_theta)
                  if value == "global" else spec)
ROPE_PAIRS = Knob("rope", choice("half", "interleaved"), "half | interleaved", "half",
                  "candle rope_i (adjacent pairs, the GGUF convention) on HF-layout weights",
                  fixed("rope=interleaved"), kind="semantic", after="dtype")
ROPE_SCALING = Knob("rope_scaling", choice("keep", "drop"), "keep | drop", "keep",
                    "Llama-3 rope_scaling lost (candle reading a transformers 5 config)", fixed("rope_scaling=drop"),
                    kind="config", after="rope",
                    spec_change=lambda spec, value: spec.replace(rope_scaling=None) if value == "drop" else spec)


def rotary_dim(spec) -> int:
    """How many of each head's dims RoPE rotates (all but with Phi-3's partial rotary)."""
    return int(spec.head_dim * spec.partial_rotary_factor)


def rope_type(spec) -> str:
    """The global RoPE's scaling type ("default" without one)."""
    return "default" if spec.rope_scaling is None else spec.rope_scaling["rope_type"]


def _sequence_or_context(text: str) -> str | int:
    return text if text == "sequence" else int(text) if text.isdigit() and int(text) > 0 else _bad(text)


def _bad(text: str):
    raise ValueError(text)


def _allocated_context(spec) -> str:
    """llama.cpp's default context, the training one: past the pretraining length, every sequence gets the
    long factors."""
    if spec is None:
        return "longrope_ctx=131072"
    scaling = spec.rope_scaling or {}
    long = rope_type(spec) == "longrope" and spec.max_position_embeddings > scaling["original_max_position_embeddings"]
    return f"longrope_ctx={spec.max_position_embeddings}" if long else ""


def _of_type(kind: str, text: str) -> Callable:
    return lambda spec: text if spec is None or rope_type(spec) == kind else ""


LLAMA3_FACTORS = Knob(
    "llama3_factors", choice("keep", "ignore"), "keep | ignore", "keep",
    "Llama 3.1's frequency factors ignored: plain RoPE at rope_theta (llama.cpp #8650, rope_freqs missing); "
    "the long wavelengths only, so it shows fully at far positions (--position-offset 100000)",
    _of_type("llama3", "llama3_factors=ignore"),
    expected=f"layers.0.{Q_ROPE}: rel_l2 0.72 from position 100000, 8.7e-4 from 0 (tiny Llama, 7 tokens)",
    kind="semantic", after="rope_scaling")
LONGROPE_CTX = Knob(
    "longrope_ctx", _sequence_or_context, "sequence | N, an allocated context", "sequence",
    "LongRoPE's short/long factors chosen from the allocated context instead of the sequence length "
    "(llama.cpp #24823): long factors on a short prompt when the context exceeds the pretraining length, short "
    "ones at far positions when it does not", _allocated_context,
    expected=f"layers.0.{Q_ROPE} (positions 0..T with a long context; --position-offset 100000 with a short one)",
    kind="semantic", after="llama3_factors")
YARN_MSCALE = Knob(
    "yarn_mscale", choice("keep", "drop"), "keep | drop", "keep",
    "YaRN's attention factor (mscale, 0.1·ln(factor) + 1) dropped: cos and sin unscaled (llama.cpp #7118)",
    _of_type("yarn", "yarn_mscale=drop"),
    expected=f"layers.0.{Q_ROPE} at every position, 0 included: rel_l2 1 - 1/mscale (0.12 for factor 4)",
    kind="semantic", after="longrope_ctx")
SCALING_KNOBS = (LLAMA3_FACTORS, LONGROPE_CTX, YARN_MSCALE)


def _no_llama3_factors(scaling: dict, length: int) -> tuple[dict | None, int]:
    return None, length


def _picked_by_context(context: int) -> Callable:
    return lambda scaling, length: (scaling, context)


def _no_mscale(scaling: dict, length: int) -> tuple[dict, int]:
    return {**scaling, "attention_factor": 1.0}, length


def _misreading(knobs: dict, spec) -> Callable | None:
    """The scaling knobs' reading of the config (None: as transformers reads it); a knob whose rope type
    the model does not have would change nothing: refused, naming the model's type."""
    readings = []
    if setting(knobs, "llama3_factors") == "ignore":
        readings.append(("llama3_factors=ignore", "llama3", _no_llama3_factors))
    context = setting(knobs, "longrope_ctx")
    if context != "sequence":
        readings.append((f"longrope_ctx={context}", "longrope", _picked_by_context(context)))
    if setting(knobs, "yarn_mscale") == "drop":
        readings.append(("yarn_mscale=drop", "yarn", _no_mscale))
    for text, kind, _ in readings:
        if spec is not None and rope_type(spec) != kind:
            raise TracerError(f"{text} changes nothing here: this model's rope_type is {rope_type(spec)!r}, "
                              f"not {kind}")
        if spec is not None and kind == "yarn" and rope_attention_scaling(spec) == 1.0:  # attention_factor 1,
            # or mscale equal to mscale_all_dim
            raise TracerError(f"{text} changes nothing here: this model's YaRN attention factor is 1")
    if not readings:
        return None

    def misread(scaling: dict, length: int) -> tuple[dict | None, int]:
        for _, _, reading in readings:
            scaling, length = reading(scaling, length)
        return scaling, length

    return misread


@dataclass(frozen=True)
class Rope(Component):
    """RoPE as attention applies it, and how its configs write it.

    Attributes:
        precision: "model" (cos/sin cast to the model dtype) or "f32" (rotate in f32, cast back: OLMo-2).
        local: its sliding layers rotate with their own base (Gemma 3's rope_local_base_freq; transformers 5
            nests both bases in rope_parameters, by layer type).
        theta: rope_theta when the config gives none (Gemma 3: 1e6).
        scaling_key: where its configs keep the scaling first: "rope_parameters" (transformers 5; 4's
            rope_theta and rope_scaling read too), or "rope_scaling" (Phi-3: "su" and "yarn" are longrope,
            partial_rotary_factor, the pretraining length 4096 at top level).
    """

    precision: str = "model"
    local: bool = False
    theta: float = DEFAULT_ROPE_THETA
    scaling_key: str = "rope_parameters"

    # What the forward reads off the spec beyond rope_theta and rope_scaling, where the config sets none.
    spec_fields = {"rope_local_theta": None, "partial_rotary_factor": 1.0}
    spec_properties = {"rotary_dim": rotary_dim}

    @property
    def knobs(self) -> tuple:
        return (ROPE_PAIRS, ROPE_SCALING) + ((ROPE_LOCAL,) if self.local else ()) + SCALING_KNOBS

    @property
    def config_fields(self) -> tuple[ConfigField, ...]:
        """Its keys; `read_config` checks them (the rope parameters are one check, `hf_rope`)."""
        if self.local:
            return (ConfigField("rope_parameters", None, ""), ConfigField("rope_theta", self.theta, ""),
                    ConfigField("rope_local_base_freq", 10_000.0, ""), ConfigField("rope_scaling", None, ""))
        fields = (ConfigField("rope_parameters", None, ""), ConfigField("rope_theta", self.theta, ""),
                  ConfigField("rope_scaling", None, ""), ConfigField("original_max_position_embeddings", None, ""))
        if self.scaling_key == "rope_scaling":  # Phi-3's pretraining length and partial rotary
            fields = (*fields[:3], ConfigField("partial_rotary_factor", 1.0, ""),
                      ConfigField("original_max_position_embeddings", 4096, ""))
        return fields

    def read_config(self, config: dict) -> dict:
        if self.local:
            return _local_rope(config, self.theta)
        if self.scaling_key == "rope_scaling":
            return _phi3_rope(config)
        theta, scaling = hf_rope(config, original_max=_top_level_original_max(config))
        return {"rope_theta": theta, "rope_scaling": scaling}

    def steps(self, knobs: dict, spec) -> dict:
        misread = _misreading(knobs, spec)
        rotary = rotary_cos_sin if misread is None else functools.partial(rotary_cos_sin, misread=misread)
        rope = ROPES[setting(knobs, "rope")]
        if self.precision == "f32":
            rope = rotated_in_f32(rope)
        if spec is not None and rotary_dim(spec) < spec.head_dim:
            rope = partial_rotary(rope)
        return {"rope": rope, "rotary": rotary, "rope_cast": self.precision == "model"}


# --- how configs write RoPE ---------------------------------------------------------------------------


def _top_level_original_max(config: dict) -> int | None:
    """A top-level `original_max_position_embeddings` wins over the rope parameters' own (llama3, yarn,
    longrope), in every family whose rope parameters are one dict: each `_compute_<type>_parameters`
    calls `standardize_rope_params` again once the config holds it as an attribute."""
    value = config.get("original_max_position_embeddings")
    return None if value is None else check("positive_int", "original_max_position_embeddings", value)


def _local_rope(config: dict, default_theta: float) -> dict:
    """Gemma 3: a global RoPE (rope_theta, default 1e6, with any scaling) and a local one for the sliding
    layers (rope_local_base_freq, default 10000); transformers 5 nests both in rope_parameters."""
    params = json_object("rope_parameters", config.get("rope_parameters"))
    nested = "full_attention" in params or "sliding_attention" in params
    full = json_object("rope_parameters.full_attention", params.get("full_attention")) if nested else params
    local = json_object("rope_parameters.sliding_attention", params.get("sliding_attention")) if nested else {}
    theta, scaling = hf_rope(config, full, "rope_parameters.full_attention" if nested else "rope_parameters",
                             default_theta)
    local_theta, local_scaling = hf_rope({}, local, "rope_parameters.sliding_attention",
                                         config.get("rope_local_base_freq", 10_000.0))
    if local_scaling is not None:
        raise TracerError("config.json: rope_parameters.sliding_attention scales the local RoPE; "
                          "tracer's reimplementation scales the global one only")
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}


def _phi3_rope(config: dict) -> dict:
    """Phi-3: `rope_scaling` replaces `rope_parameters` ("su" and "yarn" are longrope), the pretraining
    length `original_max_position_embeddings` at top level wins, and `partial_rotary_factor` may sit at
    top level or with the rope parameters."""
    params = dict(json_object("rope_scaling", config.get("rope_scaling"))
                  or json_object("rope_parameters", config.get("rope_parameters")))
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params["rope_type"] = "longrope"
        params.pop("type", None)
    original = check("positive_int", "original_max_position_embeddings",
                     config.get("original_max_position_embeddings", 4096))
    theta, scaling = hf_rope({**config, "rope_scaling": None}, params, original_max=original)
    factor = check("positive_number", "partial_rotary_factor",
                   params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    head_dim = given(config, "head_dim", None) or config["hidden_size"] // config["num_attention_heads"]
    if factor > 1 or int(head_dim * factor) % 2:  # RoPE rotates pairs of the first head_dim·factor dims
        raise refuse("partial_rotary_factor", factor, f"at most 1, rotating an even number of the {head_dim} "
                                                      "dims of a head")
    return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": factor}
