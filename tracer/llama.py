"""Llama in plain torch, instrumented: the `reimpl` engine's model.

Mirrors transformers 5.24's `models/llama/modeling_llama.py` with eager attention, op by op and
dtype by dtype (RMSNorm in f32 then cast back, softmax in f32, the same matmul shapes with a batch
of 1), so that with no variant every point agrees with the `hf` engine at rounding level and a
difference is a real difference. It reads `config.json` and safetensors itself; transformers is
never imported on this path.

Every point of `tracer.points` is handed to one `record(name, tensor)` call; tensors keep their
batch dimension of 1 here and the recorder drops it. Variant knobs are resolved once, before the
forward: config-level knobs into a different `LlamaSpec` (`tracer.config.apply_overrides`),
semantic knobs into the small strategy functions of `Strategies` (`resolve_strategies`), picked
from one lookup table per step (`NORMS`, `ROPES`, `KV_REPEATS`, `MASKS`, `ATTN_MATH`, `ATTENTION`,
`LOGITS`); the number-format regime knobs (`weights`, `act_quant`, `kv_cache`, `ops`, ...,
`preset=llamacpp`) replace steps with `tracer.ggml.regime`'s. The forward calls whatever was
picked; it never tests a knob.

Notation: T tokens, C hidden size, H query heads, KV kv heads, D head dim, I intermediate size,
V vocab size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tracer.config import LlamaSpec, apply_overrides, load_config, read_config
from tracer.errors import TracerError
from tracer.variants import expand_presets

Recorder = Callable[[str, torch.Tensor], None]
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def _no_record(name: str, tensor: torch.Tensor) -> None:
    pass


# --- norm, rotary ----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
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


NORMS = {"hf": rms_norm, "candle": rms_norm_candle}


def rope_inv_freq(spec: LlamaSpec) -> torch.Tensor:
    """(D/2,) inverse frequencies, f32, with the config's rope scaling applied."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise TracerError(f"rope_type {kind!r} is not supported by the reimpl engine (supported: default, linear, llama3)")


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


def rotary_cos_sin(spec: LlamaSpec, num_tokens: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (1, T, D), in the half-split layout (frequencies repeated, not interleaved)."""
    positions = torch.arange(num_tokens, device=device)[None]  # (1, T)
    # On the run's device, as transformers computes them: a GPU's cos/sin differ from the CPU's in the last bit.
    freqs = positions[..., None].float() * rope_inv_freq(spec).to(device)  # (1, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (1, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


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


# --- attention -------------------------------------------------------------------------------


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(1, KV, T, D) -> (1, KV*groups, T, D), each kv head repeated for its consecutive query heads."""
    batch, kv_heads, tokens, dim = x.shape
    if groups == 1:
        return x
    x = x[:, :, None].expand(batch, kv_heads, groups, tokens, dim)  # (1, KV, groups, T, D)
    return x.reshape(batch, kv_heads * groups, tokens, dim)


def repeat_kv_tile(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(1, KV, T, D) -> (1, KV*groups, T, D) in tile order (torch.cat / .repeat): query head h reads
    kv head h % KV instead of h // groups."""
    return x.repeat(1, groups, 1, 1)  # (1, KV*groups, T, D)


KV_REPEATS = {"interleave": repeat_kv, "tile": repeat_kv_tile}


def causal_mask(num_tokens: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """(1, 1, T, T): 0 where attention is allowed, the dtype's most negative value above the diagonal."""
    blocked = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).triu(1)
    # Built in the target dtype: f64's most negative value does not fit the default f32.
    return torch.zeros(blocked.shape, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)[None, None]


def mask_additive(scores: torch.Tensor) -> torch.Tensor:
    """HF eager: add the min-float causal mask to the scores (1, H, T, T)."""
    return scores + causal_mask(scores.shape[-1], scores.dtype, scores.device)


def mask_where(scores: torch.Tensor) -> torch.Tensor:
    """candle's masked_fill: future positions replaced by -inf (a where, not an add)."""
    blocked = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)  # (T, T)
    return scores.masked_fill(blocked, float("-inf"))


def mask_none(scores: torch.Tensor) -> torch.Tensor:
    """No causal mask: every position attends to the future too."""
    return scores


MASKS = {"additive": mask_additive, "where": mask_where, "none": mask_none}


def scale_multiply(scores: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF: scores * head_dim**-0.5."""
    return scores * head_dim**-0.5


def scale_divide(scores: torch.Tensor, head_dim: int) -> torch.Tensor:
    """candle: scores / sqrt(head_dim) (the same number only when sqrt(head_dim) is a power of 2)."""
    return scores / math.sqrt(head_dim)


# How scores are scaled, and the dtype attention runs in (None: the load dtype; candle: f32 throughout).
ATTN_MATH = {"hf": (scale_multiply, None), "candle": (scale_divide, torch.float32)}


def attention_eager(q, k, v, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder) -> torch.Tensor:
    """matmul, mask, softmax in f32, matmul: q (1, H, T, D), k/v (1, KV, T, D) -> (1, H, T, D)."""
    in_dtype = q.dtype
    work = strategies.attention_dtype or in_dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    k, v = strategies.repeat_kv(k, spec.num_kv_groups), strategies.repeat_kv(v, spec.num_kv_groups)  # (1, H, T, D)
    scores = strategies.scale_scores(torch.matmul(q, k.transpose(2, 3)), spec.head_dim)  # (1, H, T, T)
    record(f"{prefix}.scores", scores)
    probs = F.softmax(strategies.mask(scores), dim=-1, dtype=torch.float32).to(work)
    record(f"{prefix}.probs", probs)
    return torch.matmul(probs, v).to(in_dtype)


def attention_sdpa(q, k, v, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder) -> torch.Tensor:
    """torch's fused kernel with its own causal mask; scores and probs never exist as tensors."""
    k, v = strategies.repeat_kv(k, spec.num_kv_groups), strategies.repeat_kv(v, spec.num_kv_groups)  # (1, H, T, D)
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=spec.head_dim**-0.5)


attention_sdpa.fused = "attn=sdpa fuses scores and softmax into one kernel"  # why scores/probs are not recorded


ATTENTION = {"eager": attention_eager, "sdpa": attention_sdpa}


def logits_all(h: torch.Tensor, weight: torch.Tensor, linear: Callable = F.linear) -> torch.Tensor:
    """(1, T, C) -> (1, T, V): every position, as transformers returns them."""
    return linear(h, weight)


def logits_last(h: torch.Tensor, weight: torch.Tensor, linear: Callable = F.linear) -> torch.Tensor:
    """(1, T, C) -> (1, 1, V): candle's forward keeps the last position before lm_head."""
    return linear(h[:, -1:], weight)


LOGITS = {"all": logits_all, "last": logits_last}


@dataclass(frozen=True)
class Strategies:
    """The forward's replaceable steps, chosen once from the variant."""

    attention: Callable = attention_eager
    dtype: torch.dtype = torch.float32
    norm: Callable = rms_norm
    rope: Callable = rope_half
    repeat_kv: Callable = repeat_kv
    mask: Callable = mask_additive
    scale_scores: Callable = scale_multiply
    attention_dtype: torch.dtype | None = None
    logits: Callable = logits_all
    # Number formats (tracer.ggml.regime): weights as run, every projection, embedding, RoPE angles, GLU.
    weights: Callable = lambda weights, source: weights
    linear: Callable = F.linear
    embedding: Callable = F.embedding
    rotary: Callable = rotary_cos_sin
    glu: Callable = lambda gate, up, hidden_act: ACTIVATIONS[hidden_act](gate) * up

    def not_recorded(self) -> dict[str, str]:
        reason = getattr(self.attention, "fused", None)  # a fused attention never forms scores/probs
        return {"self_attn.scores": reason, "self_attn.probs": reason} if reason else {}


# Knobs the fused sdpa kernel cannot take: it masks and scales inside.
EAGER_ONLY = {"mask": "additive", "attn_math": "hf"}


def resolve_strategies(knobs: dict) -> Strategies:
    """The strategy functions a variant's knobs (presets expanded) pick from the tables above."""
    attn = knobs.get("attn", "eager")
    clashing = [k for k, default in EAGER_ONLY.items() if attn == "sdpa" and knobs.get(k, default) != default]
    if clashing:
        raise TracerError(f"{clashing[0]}={knobs[clashing[0]]} needs attn=eager: sdpa masks and scales inside its fused kernel")
    scale_scores, attention_dtype = ATTN_MATH[knobs.get("attn_math", "hf")]
    from tracer.ggml.regime import apply_regime

    return apply_regime(knobs, Strategies(
        attention=ATTENTION[attn],
        dtype=TORCH_DTYPES[knobs.get("dtype", "f32")],
        norm=NORMS[knobs.get("norm", "hf")],
        rope=ROPES[knobs.get("rope", "half")],
        repeat_kv=KV_REPEATS[knobs.get("kv_repeat", "interleave")],
        mask=MASKS[knobs.get("mask", "additive")],
        scale_scores=scale_scores,
        attention_dtype=attention_dtype,
        logits=LOGITS[knobs.get("logits", "all")],
    ))


# --- blocks ----------------------------------------------------------------------------------


def self_attention(x, w: dict, spec: LlamaSpec, cos, sin, strategies: Strategies, prefix: str, record: Recorder):
    """x (1, T, C) -> (1, T, C), recording projections, RoPE, scores, probs, context, output."""
    batch, tokens, _ = x.shape
    hidden_shape = (batch, tokens, -1, spec.head_dim)
    linear = strategies.linear
    q = linear(x, w["q_proj.weight"], w.get("q_proj.bias"))  # (1, T, H*D)
    k = linear(x, w["k_proj.weight"], w.get("k_proj.bias"))  # (1, T, KV*D)
    v = linear(x, w["v_proj.weight"], w.get("v_proj.bias"))  # (1, T, KV*D)
    record(f"{prefix}.q_proj", q)
    record(f"{prefix}.k_proj", k)
    record(f"{prefix}.v_proj", v)
    q = q.view(hidden_shape).transpose(1, 2)  # (1, H, T, D)
    k = k.view(hidden_shape).transpose(1, 2)  # (1, KV, T, D)
    v = v.view(hidden_shape).transpose(1, 2)  # (1, KV, T, D)
    q, k = strategies.rope(q, cos, sin), strategies.rope(k, cos, sin)
    record(f"{prefix}.q_rope", q)
    record(f"{prefix}.k_rope", k)
    context = strategies.attention(q, k, v, spec, strategies, prefix, record)
    context = context.transpose(1, 2).contiguous().reshape(batch, tokens, -1)  # (1, T, H*D)
    record(f"{prefix}.context", context)
    out = linear(context, w["o_proj.weight"], w.get("o_proj.bias"))  # (1, T, C)
    record(f"{prefix}.o_proj", out)
    return out


def mlp(x, w: dict, spec: LlamaSpec, strategies: Strategies, prefix: str, record: Recorder):
    """x (1, T, C) -> (1, T, C): down(act(gate(x)) * up(x))."""
    linear = strategies.linear
    gate = linear(x, w["gate_proj.weight"], w.get("gate_proj.bias"))  # (1, T, I)
    record(f"{prefix}.gate_proj", gate)
    up = linear(x, w["up_proj.weight"], w.get("up_proj.bias"))  # (1, T, I)
    record(f"{prefix}.up_proj", up)
    act = strategies.glu(gate, up, spec.hidden_act)
    record(f"{prefix}.act", act)
    down = linear(act, w["down_proj.weight"], w.get("down_proj.bias"))  # (1, T, C)
    record(f"{prefix}.down_proj", down)
    return down


def decoder_layer(x, w: dict, spec: LlamaSpec, cos, sin, strategies: Strategies, prefix: str, record: Recorder):
    h = strategies.norm(x, w["input_layernorm.weight"], spec.rms_norm_eps)
    record(f"{prefix}.input_layernorm", h)
    h = x + self_attention(h, Prefixed(w, "self_attn."), spec, cos, sin, strategies, f"{prefix}.self_attn", record)
    record(f"{prefix}.resid_mid", h)
    m = strategies.norm(h, w["post_attention_layernorm.weight"], spec.rms_norm_eps)
    record(f"{prefix}.post_attention_layernorm", m)
    out = h + mlp(m, Prefixed(w, "mlp."), spec, strategies, f"{prefix}.mlp", record)
    record(prefix, out)
    return out


class Prefixed:
    """The weights under one module path, e.g. a layer's `self_attn.q_proj.weight` (a view: with
    streamed weights nothing is read until a tensor is asked for)."""

    def __init__(self, weights, prefix: str):
        self.weights, self.prefix = weights, prefix

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights[self.prefix + name]

    def get(self, name: str, default=None):
        return self.weights.get(self.prefix + name, default)


# --- model -----------------------------------------------------------------------------------


class Llama:
    """A loaded model: spec, weights (checked against the spec), and the variant's strategies.

    `spec` is the file as the variant's config reader sees it (`Llama.from_config` picks the
    reader); the config-level knobs (theta, eps, layers, ...) are applied to it here. The
    weights are converted to the variant's dtype on `device` once, or, with `stream=True`, read
    and converted block by block during every forward, so that memory holds one block's
    weights instead of the model's (for checkpoints larger than memory, and for the f64 copy
    that measures the noise floor).

    Example:
        >>> model = Llama.from_dir(tracer.default_model_path(), {"theta": 10000.0})
        >>> logits = model.forward(torch.tensor([504, 3575, 282, 4649, 314]))  # (T, V)
    """

    def __init__(self, spec: LlamaSpec, weights: Mapping[str, torch.Tensor], variant: dict | None = None, *,
                 device: torch.device | str = "cpu", stream: bool = False, source: dict | None = None):
        self.variant = dict(variant or {})
        knobs = expand_presets(self.variant)
        self.spec, self.strategies = apply_overrides(spec, knobs), resolve_strategies(knobs)
        self.device = torch.device(device)
        weights = self.strategies.weights(weights, source)  # source: config.json's tracer_source (the GGUF)
        self.weights = prepare_weights(self.spec, weights, self.strategies.dtype, self.device, stream)
        self.unused_tensors = unused_tensors(self.spec, weights)
        self.layers = [Prefixed(self.weights, f"model.layers.{i}.") for i in range(self.spec.num_hidden_layers)]

    @classmethod
    def from_config(cls, config: dict, weights: Mapping[str, torch.Tensor], variant: dict | None = None,
                    **placement) -> Llama:
        """From a config.json dict, read by the variant's reader (`config`, `resave` knobs)."""
        return cls(read_config(config, expand_presets(variant or {})), weights, variant,
                   source=config.get("tracer_source"), **placement)

    @classmethod
    def from_dir(cls, model_dir: str | Path, variant: dict | None = None, **placement) -> Llama:
        """`placement`: `device`, and `stream=True` to read each block's weights from the files when it runs."""
        from tracer.model import WeightFiles, read_weights

        weights = WeightFiles(model_dir) if placement.get("stream") else read_weights(model_dir)
        return cls.from_config(load_config(model_dir), weights, variant, **placement)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, record: Recorder | None = None) -> torch.Tensor:
        """tokens (T,) int64 -> logits (T, V) ((1, V) with logits=last); every point goes to `record`."""
        record = record or _no_record
        spec, w = self.spec, self.weights
        ids = tokens.to(self.device)[None]  # (1, T)
        h = self.strategies.embedding(ids, w["model.embed_tokens.weight"])  # (1, T, C)
        record("model.embed_tokens", h)
        cos, sin = self.strategies.rotary(spec, ids.shape[1], h.dtype, self.device)  # (1, T, D) each
        for i, layer in enumerate(self.layers):
            h = decoder_layer(h, layer, spec, cos, sin, self.strategies, f"model.layers.{i}", record)
        h = self.strategies.norm(h, w["model.norm.weight"], spec.rms_norm_eps)
        record("model.norm", h)
        logits = self.strategies.logits(h, w["lm_head.weight"])  # (1, T, V), or (1, 1, V) for logits=last
        record("lm_head", logits)
        return logits[0]


# --- weights ---------------------------------------------------------------------------------


def expected_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the spec needs, with its shape (HF names, as in the safetensors files)."""
    c, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * d, spec.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, c)}
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (c,),
            p + "self_attn.q_proj.weight": (q_out, c),
            p + "self_attn.k_proj.weight": (kv_out, c),
            p + "self_attn.v_proj.weight": (kv_out, c),
            p + "self_attn.o_proj.weight": (c, q_out),
            p + "post_attention_layernorm.weight": (c,),
            p + "mlp.gate_proj.weight": (i, c),
            p + "mlp.up_proj.weight": (i, c),
            p + "mlp.down_proj.weight": (c, i),
        }
        if spec.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                       p + "self_attn.v_proj.bias": (kv_out,), p + "self_attn.o_proj.bias": (c,)}
        if spec.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (c,)}
    shapes["model.norm.weight"] = (c,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, c)
    return shapes


def check_weights(spec: LlamaSpec, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor the spec needs is there with its shape (read from the headers for weight
    files); a missing or misshapen tensor, or an activation we lack, is a TracerError."""
    if spec.hidden_act not in ACTIVATIONS:
        raise TracerError(f"hidden_act {spec.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    shapes = tensors.shapes() if hasattr(tensors, "shapes") else {name: tuple(t.shape) for name, t in tensors.items()}
    for name, shape in expected_shapes(spec).items():
        if name not in shapes:
            raise TracerError(f"missing tensor {name} (expected shape {shape})")
        if shapes[name] != shape:
            raise TracerError(f"shape mismatch for {name}: expected {shape}, file has {shapes[name]}")


def prepare_weights(spec: LlamaSpec, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                    device: torch.device, stream: bool) -> Mapping[str, torch.Tensor]:
    """The spec's tensors in `dtype` on `device`, `lm_head.weight` tied to the embedding where the
    config says so: converted now, or (`stream`) on every access."""
    check_weights(spec, tensors)
    names = {name: name for name in expected_shapes(spec)}
    if spec.tie_word_embeddings:
        names["lm_head.weight"] = "model.embed_tokens.weight"
    if stream:
        return StreamedWeights(tensors, names, dtype, device)
    converted = {name: tensors[name].to(dtype=dtype, device=device) for name in expected_shapes(spec)}
    return {name: converted[source] for name, source in names.items()}


class StreamedWeights:
    """name -> tensor, read from the (memory-mapped) files and converted on every access: a forward
    holds the weights of the op it runs, at the price of reading them once per forward."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: dict[str, str], dtype: torch.dtype,
                 device: torch.device):
        self.tensors, self.names, self.dtype, self.device = tensors, names, dtype, device

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.names[name]].to(dtype=self.dtype, device=self.device)

    def get(self, name: str, default=None):
        return self[name] if name in self.names else default


def unused_tensors(spec: LlamaSpec, tensors: dict) -> list[str]:
    """Tensors in the files that this spec does not use (e.g. biases a config says are absent)."""
    needed = set(expected_shapes(spec)) | {"lm_head.weight"}
    return sorted(name for name in tensors if name not in needed and not name.endswith("rotary_emb.inv_freq"))
