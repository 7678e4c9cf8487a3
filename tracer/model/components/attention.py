"""Self-attention and its parts: the q/k/v projections (separate or fused), the q/k norm (none, per
head, per head after the transpose, over the whole projection), RoPE (`tracer.model.components.rope`),
the attention core (scores, probabilities, context; a sliding window; soft-capping) and o_proj; the
config fields each reads (the window and layer types each family's way, the soft-caps, the biases,
`query_pre_attn_scalar`) and the attention core's knobs (attn, kv_repeat, mask, attn_math).

Mirrors transformers 5.25's eager attention op by op (`modeling_llama.py`, and the families'
`modeling_<family>.py`). Attention takes absolute positions (its RoPE tables, `Positions`) and an
optional cache (`tracer.model.kv_cache.KVCache`: keys after RoPE and values, appended and fetched
per layer, as transformers' `cache.update(k, v, layer_idx)` and mlx-lm's `update_and_fetch`); which
keys a query sees is a function of their positions (`Visible`): causal, and a window on sliding layers.

Notation: T queries, S keys (T without a cache), H query heads, KV kv heads, D head dim, C hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tracer.core.errors import TracerError
from tracer.core.lazy import F, torch
from tracer.model import kv_cache
from tracer.model.component import Component, ConfigField, Point
from tracer.model.components import padding
from tracer.model.components.rope import Rope
from tracer.model.config import check, given, refuse
from tracer.model.knobs import KNOBS, Knob, choice, fixed, setting, when
from tracer.model.points import (
    BIAS,
    CACHE_K,
    CACHE_V,
    CONTEXT,
    K_NORM,
    K_PROJ,
    K_ROPE,
    O_PROJ,
    PROBS,
    Q_NORM,
    Q_PROJ,
    Q_ROPE,
    QKV_PROJ,
    SCORES,
    V_PROJ,
    WEIGHT,
    fused_away,
)

# --- the attention core --------------------------------------------------------------------------


def heads_first(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(1, T, heads*D) -> (1, heads, T, D)."""
    batch, tokens, _ = x.shape
    return x.view(batch, tokens, -1, head_dim).transpose(1, 2)  # (1, heads, T, D)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(1, KV, S, D) -> (1, KV*groups, S, D), each kv head repeated for its consecutive query heads."""
    batch, kv_heads, tokens, dim = x.shape
    if groups == 1:
        return x
    x = x[:, :, None].expand(batch, kv_heads, groups, tokens, dim)  # (1, KV, groups, S, D)
    return x.reshape(batch, kv_heads * groups, tokens, dim)


def repeat_kv_tile(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(1, KV, S, D) -> (1, KV*groups, S, D) in tile order (torch.cat / .repeat): query head h reads
    kv head h % KV instead of h // groups."""
    return x.repeat(1, groups, 1, 1)  # (1, KV*groups, S, D)


KV_REPEATS = {"interleave": repeat_kv, "tile": repeat_kv_tile}


@dataclass(frozen=True)
class Visible:
    """Which keys each query may attend to, from their absolute positions: not the future, and on a
    sliding layer not `window` or more positions back (transformers' `sliding_window_overlay`:
    kv > q - window). Without a cache the keys are the queries."""

    queries: torch.Tensor  # (T,) int64
    keys: torch.Tensor  # (S,) int64
    window: int | None = None  # keys a query sees, itself included; None: the whole prefix
    # A left-padded batch (`Model.forward_batch`): (B, S) bool, True at each row's real tokens; None: no padding.
    # queries/keys are then the indices in the padded sequence, as transformers' masks count them.
    real: torch.Tensor | None = None

    @classmethod
    def square(cls, count: int, window: int | None = None) -> Visible:
        positions = torch.arange(count)
        return cls(positions, positions, window)

    def blocked(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(T, S) bool, True where a query may not attend; (B, 1, T, S) with padding, whose keys no query sees
        (transformers' `padding_mask_function`: a padded query then sees no key at all)."""
        queries, keys = self.queries.to(device)[:, None], self.keys.to(device)[None, :]  # (T, 1), (1, S)
        blocked = keys > queries
        if self.window is not None:
            blocked |= keys <= queries - self.window
        if self.real is not None:
            blocked = blocked[None, None] | ~self.real.to(device)[:, None, None, :]  # (B, 1, T, S)
        return blocked


def _visible(scores: torch.Tensor, visible: Visible | None) -> Visible:
    return Visible.square(scores.shape[-1]) if visible is None else visible


def causal_mask(visible: Visible, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """(1, 1, T, S) ((B, 1, T, S) with padding): 0 where attention is allowed, the dtype's most negative value
    where it is not."""
    blocked = visible.blocked(device)
    # Built in the target dtype: f64's most negative value does not fit the default f32.
    mask = torch.zeros(blocked.shape, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)
    return mask if blocked.dim() == 4 else mask[None, None]  # (B, 1, T, S) with padding, else (1, 1, T, S)


def mask_additive(scores: torch.Tensor, visible: Visible | None = None) -> torch.Tensor:
    """HF eager: add the min-float causal (or sliding-window) mask to the scores (1, H, T, S)."""
    return scores + causal_mask(_visible(scores, visible), scores.dtype, scores.device)


def mask_where(scores: torch.Tensor, visible: Visible | None = None) -> torch.Tensor:
    """candle's masked_fill: blocked positions replaced by -inf (a where, not an add)."""
    return scores.masked_fill(_visible(scores, visible).blocked(scores.device), float("-inf"))  # (T, S) mask


def mask_none(scores: torch.Tensor, visible: Visible | None = None) -> torch.Tensor:
    """No causal mask: every position attends to the future too (and past any window)."""
    return scores


MASKS = {"additive": mask_additive, "where": mask_where, "none": mask_none}


def scale_multiply(scores: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF: scores * head_dim**-0.5."""
    return scores * head_dim**-0.5


def scale_divide(scores: torch.Tensor, head_dim: int) -> torch.Tensor:
    """candle: scores / sqrt(head_dim) (the same number only when sqrt(head_dim) is a power of 2)."""
    return scores / math.sqrt(head_dim)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2: cap·tanh(x/cap), in three ops as transformers writes it; None: no cap."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def softcap_dropped(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """A port that forgets the soft-cap."""
    return x


SOFTCAPS = {"keep": softcap, "drop": softcap_dropped}


def attention_eager(q, k, v, spec, steps, record, visible: Visible | None = None) -> torch.Tensor:
    """matmul, scale (soft-cap), mask, softmax in f32, matmul: q (1, H, T, D), k/v (1, KV, S, D) -> (1, H, T, D).
    `scores` is what the mask and softmax receive: after Gemma 2's soft-cap."""
    in_dtype = q.dtype
    work = steps.attention_dtype or in_dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    k, v = steps.repeat_kv(k, spec.num_kv_groups), steps.repeat_kv(v, spec.num_kv_groups)  # (1, H, S, D)
    scores = steps.scale_scores(torch.matmul(q, k.transpose(2, 3)), score_scale_dim(spec))  # (1, H, T, S)
    scores = steps.softcap(scores, spec.attn_logit_softcapping)
    record(SCORES, scores)
    probs = F.softmax(steps.mask(scores, visible), dim=-1, dtype=torch.float32).to(work)
    record(PROBS, probs)
    return torch.matmul(probs, v).to(in_dtype)


def attention_sdpa(q, k, v, spec, steps, record, visible: Visible | None = None) -> torch.Tensor:
    """torch's fused kernel with its own causal mask (an explicit one for a window or a cache);
    scores and probs never exist as tensors."""
    k, v = steps.repeat_kv(k, spec.num_kv_groups), steps.repeat_kv(v, spec.num_kv_groups)  # (1, H, S, D)
    scale = score_scale_dim(spec) ** -0.5
    square = visible is None or (visible.window is None and visible.real is None
                                 and visible.keys.shape[0] == visible.queries.shape[0])
    if square:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale)
    allowed = ~visible.blocked(q.device)  # (T, S), (B, 1, T, S) with padding
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


attention_sdpa.fused = "attn=sdpa fuses scores and softmax into one kernel"  # why scores/probs are not recorded

ATTENTION_KERNELS = {"eager": attention_eager, "sdpa": attention_sdpa}
# How scores are scaled, and the dtype attention runs in (None: the load dtype; candle: f32 throughout).
ATTN_MATH = {"hf": (scale_multiply, None), "candle": (scale_divide, "float32")}
# Knobs the fused sdpa kernel cannot take: it masks and scales inside.
EAGER_ONLY = ("mask", "attn_math")

# The attention core's porting mistakes (every family's: every family has attention).
ATTN = Knob("attn", choice("eager", "sdpa"), "eager | sdpa", "eager",
            "the attention implementation (sdpa fuses scores and softmax)",
            # transformers' Gemma 2 has no sdpa path (it cannot soft-cap), nor has the fused kernel
            when(lambda spec: spec.attn_logit_softcapping is None, "attn=sdpa"), kind="config", after="eps")
KV_REPEAT = Knob("kv_repeat", choice("interleave", "tile"), "interleave | tile", "interleave",
                 "GQA head order: tile (torch.cat / .repeat) instead of HF repeat_kv", fixed("kv_repeat=tile"),
                 kind="semantic", after="yarn_mscale")
MASK = Knob("mask", choice("additive", "where", "none"), "additive | where | none", "additive",
            "HF's min-float add vs candle's masked_fill -inf; none forgets the causal mask", fixed("mask=none"),
            kind="semantic", after="kv_repeat")
ATTN_MATH_KNOB = Knob("attn_math", choice("hf", "candle"), "hf | candle", "hf",
                      "candle's attention: q, k, v upcast to f32 throughout, scores divided by sqrt(D)",
                      fixed("attn_math=candle"), kind="semantic", after="mask")
CORE_KNOBS = (ATTN, KV_REPEAT, MASK, ATTN_MATH_KNOB)


def layer_type(spec, layer: int) -> str:
    """"full_attention" or "sliding_attention": the config's layer_types, repeated (None: all full)."""
    types = spec.layer_types
    return types[layer % len(types)] if types else "full_attention"


def window_of(spec, layer: int) -> int | None:
    """The sliding window of one layer; None where it attends to the whole prefix."""
    return spec.sliding_window if layer_type(spec, layer) == "sliding_attention" else None


def score_scale_dim(spec) -> int | float:
    """What scores are scaled by the -0.5 power of: head_dim, or Gemma's query_pre_attn_scalar."""
    return spec.head_dim if spec.query_pre_attn_scalar is None else spec.query_pre_attn_scalar


def window_of_layer(spec, layer: int) -> int | None:
    return window_of(spec, layer)


def window_ignored(spec, layer: int) -> int | None:
    """A port without sliding windows: every layer attends to the whole prefix."""
    return None


WINDOWS = {"keep": window_of_layer, "ignore": window_ignored}


def not_recorded(steps) -> dict[str, str]:
    """The points a forward with these steps never forms (a fused attention's scores and probabilities)."""
    reason = getattr(steps.attention, "fused", None)
    return fused_away(reason) if reason else {}


# --- the projections -------------------------------------------------------------------------------

def project_separate(x, run):
    """x (1, T, C) -> q (1, T, H*D), k, v (1, T, KV*D): three projections (Qwen2's carry biases)."""
    w, linear = run.weights, run.steps.linear
    q = linear(x, w[Q_PROJ + WEIGHT], w.get(Q_PROJ + BIAS))  # (1, T, H*D)
    k = linear(x, w[K_PROJ + WEIGHT], w.get(K_PROJ + BIAS))  # (1, T, KV*D)
    v = linear(x, w[V_PROJ + WEIGHT], w.get(V_PROJ + BIAS))  # (1, T, KV*D)
    run.record(Q_PROJ, q)
    run.record(K_PROJ, k)
    run.record(V_PROJ, v)
    return q, k, v


def project_fused(x, run):
    """Phi-3: one qkv_proj (1, T, (H + 2·KV)·D), cut into q | k | v in the variant's order."""
    spec = run.spec
    qkv = run.steps.linear(x, run.weights[QKV_PROJ + WEIGHT])  # (1, T, (H + 2·KV)·D)
    run.record(QKV_PROJ, qkv)
    sizes = {"q": spec.num_attention_heads * spec.head_dim, "k": spec.num_key_value_heads * spec.head_dim}
    sizes["v"] = sizes["k"]
    parts, start = {}, 0
    for name in run.steps.qkv_order:  # "qkv": q = [:H*D], k = [H*D : H*D + KV*D], v = the rest
        parts[name], start = qkv[..., start:start + sizes[name]], start + sizes[name]
    return parts["q"], parts["k"], parts["v"]


def _qkv_order(text: str) -> str:
    if sorted(text) != ["k", "q", "v"]:
        raise ValueError(text)
    return text


QKV_SPLIT = Knob("qkv_split", _qkv_order, "an order of q, k, v, e.g. qkv_split=kqv", "qkv",
                 "the fused qkv_proj output split in another order than q | k | v (sizes H·D, KV·D, KV·D in that "
                 "order)", fixed("qkv_split=kqv"), expected=f"layers.0.{Q_ROPE}", kind="semantic", after="act")


@dataclass(frozen=True)
class SeparateQKV(Component):
    """q_proj, k_proj, v_proj (biases where the config says so); `bias`: q/k/v biases whatever the
    config says, and none on o_proj (Qwen2Attention: bias=True always)."""

    bias: bool = False

    def read_config(self, config: dict) -> dict:
        return {"qkv_bias": True} if self.bias else {}

    def points(self, source: str) -> tuple[Point, ...]:
        return (Point(Q_PROJ, "q_proj", "merged", "projection", "query projection", source, gguf_permuted=True),
                Point(K_PROJ, "k_proj", "merged", "projection", "key projection", source, gguf_permuted=True),
                Point(V_PROJ, "v_proj", "merged", "projection", "value projection", source))

    def rope_sources(self) -> tuple[str, str]:
        return Q_PROJ, K_PROJ

    def weights(self, spec) -> dict:
        c, q_out, kv_out = spec.hidden_size, spec.num_attention_heads * spec.head_dim, \
            spec.num_key_value_heads * spec.head_dim
        shapes = {Q_PROJ + WEIGHT: (q_out, c), K_PROJ + WEIGHT: (kv_out, c), V_PROJ + WEIGHT: (kv_out, c)}
        if spec.attention_bias or spec.qkv_bias:
            shapes |= {Q_PROJ + BIAS: (q_out,), K_PROJ + BIAS: (kv_out,), V_PROJ + BIAS: (kv_out,)}
        return shapes

    def steps(self, knobs: dict, spec) -> dict:
        return {"project": project_separate}


@dataclass(frozen=True)
class FusedQKV(Component):
    """Phi-3's one qkv_proj, q | k | v along its output."""

    knobs = (QKV_SPLIT,)

    def points(self, source: str) -> tuple[Point, ...]:
        return (Point(QKV_PROJ, "qkv_proj", "merged", "projection",
                      "fused q | k | v projection (Phi-3), (T, (H + 2·KV)·D)", source),)

    def rope_sources(self) -> tuple[str, str]:
        return QKV_PROJ, QKV_PROJ

    def weights(self, spec) -> dict:
        kv_out = spec.num_key_value_heads * spec.head_dim
        return {QKV_PROJ + WEIGHT: (spec.num_attention_heads * spec.head_dim + 2 * kv_out, spec.hidden_size)}

    def steps(self, knobs: dict, spec) -> dict:
        return {"project": project_fused, "qkv_order": setting(knobs, "qkv_split")}


# --- the q/k norms ---------------------------------------------------------------------------------


def _qk_norm(run):
    return run.steps.qk_norm or run.steps.norm


def qk_plain(q, k, run):
    """No q/k norm: (1, T, heads*D) -> (1, heads, T, D) each."""
    return heads_first(q, run.spec.head_dim), heads_first(k, run.spec.head_dim)


def qk_norm_per_head(q, k, run):
    """Qwen3: RMSNorm over each head's D values on (1, T, heads, D), then the transpose."""
    out = []
    for name, x in ((Q_NORM, q), (K_NORM, k)):
        x = _qk_norm(run)(x.unflatten(-1, (-1, run.spec.head_dim)), run.weights[name + WEIGHT],
                              run.spec.rms_norm_eps)  # (1, T, heads, D)
        run.record(name, x.flatten(2))  # (1, T, heads*D)
        out.append(x.transpose(1, 2))  # (1, heads, T, D)
    return tuple(out)


def qk_norm_per_head_heads_first(q, k, run):
    """Gemma 3: the transpose first, then RMSNorm over each head's D values on (1, heads, T, D)."""
    out = []
    for name, x in ((Q_NORM, q), (K_NORM, k)):
        x = _qk_norm(run)(heads_first(x, run.spec.head_dim), run.weights[name + WEIGHT],
                              run.spec.rms_norm_eps)  # (1, heads, T, D)
        run.record(name, x.transpose(1, 2).flatten(2))  # (1, T, heads*D)
        out.append(x)
    return tuple(out)


def qk_norm_whole(q, k, run):
    """OLMo-2: RMSNorm over the whole projection (1, T, heads*D), then the split into heads."""
    out = []
    for name, x in ((Q_NORM, q), (K_NORM, k)):
        x = _qk_norm(run)(x, run.weights[name + WEIGHT], run.spec.rms_norm_eps)  # (1, T, heads*D)
        run.record(name, x)
        out.append(heads_first(x, run.spec.head_dim))  # (1, heads, T, D)
    return tuple(out)


def qk_norm_skipped(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """qk_norm=drop: a port without the q/k norm passes the projection through (recorded as such)."""
    return x


QK_NORM = Knob("qk_norm", choice("keep", "drop"), "keep | drop", "keep",
               "the RMSNorm of q and k before RoPE (per head in Qwen3 and Gemma 3, over the projection in OLMo-2) "
               "forgotten", fixed("qk_norm=drop"), expected=f"layers.0.{Q_NORM}", kind="semantic", after="softcap")
_PER_HEAD = ("per-head RMSNorm of the queries (over D)", "per-head RMSNorm of the keys (over D)")


@dataclass(frozen=True)
class PerHeadNorm(Component):
    """RMSNorm of q and k over each head's D values, before RoPE: on (T, H, D) (Qwen3), or after the
    head transpose (`heads_first`: Gemma 3, normed once q, k and v all exist)."""

    heads_first: bool = False
    knobs = (QK_NORM,)

    @property
    def after_projections(self) -> bool:
        """Normed once all three projections exist (else each right after its own)."""
        return self.heads_first

    def points(self, q_source: str, k_source: str) -> tuple[Point, Point]:
        observed = "output:(H, T, D)" if self.heads_first else "output:(T, H, D)"
        return (Point(Q_NORM, "q_norm", "merged", "norm", _PER_HEAD[0], q_source, observed),
                Point(K_NORM, "k_norm", "merged", "norm", _PER_HEAD[1], k_source, observed))

    def weights(self, spec) -> dict:
        return {Q_NORM + WEIGHT: (spec.head_dim,), K_NORM + WEIGHT: (spec.head_dim,)}

    def steps(self, knobs: dict, spec) -> dict:
        return {"qk_heads": qk_norm_per_head_heads_first if self.heads_first else qk_norm_per_head}


@dataclass(frozen=True)
class WholeNorm(PerHeadNorm):
    """OLMo-2: RMSNorm of q and k over the whole projection (H·D values), before RoPE."""

    def points(self, q_source: str, k_source: str) -> tuple[Point, Point]:
        return (Point(Q_NORM, "q_norm", "merged", "norm", "RMSNorm of the whole query projection (over H·D)",
                      q_source),
                Point(K_NORM, "k_norm", "merged", "norm", "RMSNorm of the whole key projection (over KV·D)",
                      k_source))

    def weights(self, spec) -> dict:
        return {Q_NORM + WEIGHT: (spec.num_attention_heads * spec.head_dim,),
                K_NORM + WEIGHT: (spec.num_key_value_heads * spec.head_dim,)}

    def steps(self, knobs: dict, spec) -> dict:
        return {"qk_heads": qk_norm_whole}


# --- which layers slide, and how far: read from the config each family's way -----------------------

LAYER_TYPES = ("full_attention", "sliding_attention")


def read_layer_types(config: dict, default: list[str]) -> tuple[str, ...]:
    """`layer_types` as written (one per layer), else the family's pattern."""
    types = config.get("layer_types")
    if types is None:
        return tuple(default)
    layers = config["num_hidden_layers"]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise refuse("layer_types", types, f"a list of {layers} of {', '.join(LAYER_TYPES)}")
    return tuple(types)


def _window_field(default: int | None) -> ConfigField:
    return ConfigField("sliding_window", default, "optional_positive_int")  # null: no window


@dataclass(frozen=True)
class EveryLayerWindow(Component):
    """Mistral, Phi-3: one window on every layer, when there is one (`default`: transformers' value
    when the key is absent, Mistral's 4096; null is no window)."""

    default: int | None = None

    @property
    def knobs(self) -> tuple:
        return (WINDOW, *kv_cache.WINDOW_KNOBS)

    @property
    def config_fields(self) -> tuple[ConfigField, ...]:
        return (_window_field(self.default),)

    def read_config(self, config: dict) -> dict:
        window = check("optional_positive_int", "sliding_window", config.get("sliding_window", self.default))
        return {"sliding_window": window,
                "layer_types": None if window is None else ("sliding_attention",) * config["num_hidden_layers"]}


@dataclass(frozen=True)
class LaterLayersWindow(EveryLayerWindow):
    """Qwen2/3: `sliding_window` only with `use_sliding_window`, on the layers from `max_window_layers` on
    (or as `layer_types` says)."""

    default: int | None = 4096
    config_fields = (ConfigField("use_sliding_window", False, "bool"), _window_field(4096),
                     ConfigField("max_window_layers", 28), ConfigField("layer_types", None, ""))

    def read_config(self, config: dict) -> dict:
        use = check("bool", "use_sliding_window", config.get("use_sliding_window", False))
        window = check("optional_positive_int", "sliding_window", config.get("sliding_window", 4096)) if use else None
        first = check("positive_int", "max_window_layers", config.get("max_window_layers", 28))
        pattern = ["sliding_attention" if window is not None and i >= first else "full_attention"
                   for i in range(config["num_hidden_layers"])]
        types = read_layer_types(config, pattern)
        return {"sliding_window": window, "layer_types": types if "sliding_attention" in types else None}


@dataclass(frozen=True)
class PatternWindow(EveryLayerWindow):
    """Gemma: a window (default 4096) on every layer but each `pattern`-th (Gemma 2: 2, alternate layers;
    `pattern_key`: read from the config, Gemma 3's sliding_window_pattern, default 6), or as `layer_types`
    says. Gemma's `use_bidirectional_attention` (EmbeddingGemma, `bidirectional` its default) makes an
    encoder, no causal LM: refused."""

    default: int | None = 4096
    pattern: int = 2
    pattern_key: str | None = None
    bidirectional: bool | None = None

    @property
    def config_fields(self) -> tuple[ConfigField, ...]:
        pattern = (ConfigField(self.pattern_key, self.pattern),) if self.pattern_key else ()
        return (_window_field(self.default), ConfigField("layer_types", None, ""), *pattern,
                ConfigField("use_bidirectional_attention", self.bidirectional, "bool"))

    def read_config(self, config: dict) -> dict:
        if check("bool", "use_bidirectional_attention", given(config, "use_bidirectional_attention", False)):
            raise TracerError("a Gemma with use_bidirectional_attention (an embedding model) is not traced: it is "
                              "no causal LM")
        pattern = self.pattern
        if self.pattern_key:
            pattern = check("positive_int", self.pattern_key, config.get(self.pattern_key, self.pattern))
        types = read_layer_types(config, ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(config["num_hidden_layers"])])
        window = check("optional_positive_int", "sliding_window", config.get("sliding_window", self.default))
        return {"sliding_window": window, "layer_types": types}


@dataclass(frozen=True)
class SoftCap(Component):
    """Gemma's soft-capping, cap·tanh(x/cap), with the cap config.json's `key` holds (`default` when the
    key is absent; null: no cap): attention scores (attn_logit_softcapping) or final logits."""

    key: str = "attn_logit_softcapping"
    default: float | None = None

    @property
    def knobs(self) -> tuple:
        return (SOFTCAP,)

    @property
    def config_fields(self) -> tuple[ConfigField, ...]:
        return (ConfigField(self.key, self.default, "optional_number"),)


# --- attention ---------------------------------------------------------------------------------------

WINDOW = Knob("window", choice("keep", "ignore"), "keep | ignore", "keep",
              "the sliding window ignored: every query attends to the whole prefix (visible once the prompt is "
              "longer than the window)", when(lambda spec: spec.sliding_window is not None, "window=ignore"),
              expected=f"{PROBS} of the first windowed layer; match on prompts within the window", kind="semantic",
              after="qk_norm")
SOFTCAP = Knob("softcap", choice("keep", "drop"), "keep | drop", "keep",
               "Gemma 2's soft-capping of attention scores and final logits, cap·tanh(x/cap), forgotten",
               when(lambda spec: spec.attn_logit_softcapping is not None or spec.final_logit_softcapping is not None,
                    "softcap=drop"), expected=f"layers.0.{SCORES}", kind="semantic", after="embed_scale")

# A knob that undoes a feature this model's config does not use would change nothing: said, not ignored.
# (The fused sdpa kernel cannot soft-cap, as transformers' Gemma 2 cannot.)
_FEATURES = {
    ("attn", "sdpa"): (lambda spec: spec.attn_logit_softcapping is not None,
                       "attn=sdpa cannot soft-cap attention scores (attn_logit_softcapping), nor can "
                       "transformers' sdpa"),
    ("softcap", "drop"): (lambda spec: spec.attn_logit_softcapping is None and spec.final_logit_softcapping is None,
                          "attn_logit_softcapping and final_logit_softcapping are null"),
    ("window", "ignore"): (lambda spec: spec.sliding_window is None, "this model's config has no sliding window"),
}

@dataclass(frozen=True)
class Attention(Component):
    """Self-attention with RoPE.

    Attributes:
        projections: SeparateQKV() or FusedQKV().
        qk_norm: None, PerHeadNorm(), PerHeadNorm(heads_first=True) or WholeNorm().
        rope: its RoPE (`Rope`: precision, local base, how its config writes it).
        window: how its configs restrict attention to a sliding window on some layers (None: never):
            EveryLayerWindow, LaterLayersWindow (Qwen), PatternWindow (Gemma).
        softcap: its configs may soft-cap the scores (`SoftCap`: Gemma 2's attn_logit_softcapping).
        fields: the other config keys it reads as written (attention_bias; Gemma's query_pre_attn_scalar).
    """

    projections: Component = field(default_factory=SeparateQKV)
    qk_norm: Component | None = None
    rope: Rope = field(default_factory=Rope)
    window: Component | None = None
    softcap: Component | None = None
    fields: tuple[ConfigField, ...] = ()

    # What the forward reads off the spec, where the family's config does not set it.
    spec_fields = {"attention_bias": False, "qkv_bias": False, "sliding_window": None, "layer_types": None,
                   "query_pre_attn_scalar": None, "attn_logit_softcapping": None}
    spec_properties = {"layer_type": lambda spec: lambda layer: layer_type(spec, layer),
                       "window": lambda spec: lambda layer: window_of(spec, layer),
                       "score_scale_dim": score_scale_dim}

    @property
    def config_fields(self) -> tuple[ConfigField, ...]:
        return self.fields

    @property
    def knobs(self) -> tuple:
        return CORE_KNOBS + kv_cache.CACHE_KNOBS + padding.KNOBS

    @property
    def output(self) -> str:
        return O_PROJ

    def parts(self) -> tuple[Component, ...]:
        return tuple(part for part in (self.projections, self.qk_norm, self.rope, self.window, self.softcap)
                     if part is not None)

    def points(self, source: str) -> tuple[Point, ...]:
        """Its points in execution order, the projections reading `source`."""
        projections = self.projections.points(source)
        q_source, k_source = self.projections.rope_sources()
        order = list(projections)
        if self.qk_norm is not None:
            q_norm, k_norm = self.qk_norm.points(q_source, k_source)
            if self.qk_norm.after_projections:
                order += [q_norm, k_norm]
            else:  # q, q_norm, k, k_norm, v
                order = [projections[0], q_norm, projections[1], k_norm, *projections[2:]]
            q_source, k_source = Q_NORM, K_NORM
        return (*order,
                Point(Q_ROPE, "q_rope", "heads", "rope", "queries after RoPE, HF half-split layout", q_source,
                      "attention", gguf_permuted=True),
                Point(K_ROPE, "k_rope", "heads", "rope", "keys after RoPE, HF half-split layout", k_source,
                      "attention", gguf_permuted=True),
                Point(SCORES, "scores", "attention", "scores", "q·kᵀ·scale before softmax", Q_ROPE, "attention"),
                Point(PROBS, "probs", "attention", "softmax", "softmax of the masked scores", SCORES, "attention"),
                Point(CONTEXT, "context", "merged", "attention", "probs·v, heads merged (input of o_proj)", PROBS,
                      "attention"),
                Point(O_PROJ, "o_proj", "rows", "projection", "attention output", CONTEXT))

    def weights(self, spec) -> dict:
        shapes = {O_PROJ + WEIGHT: (spec.hidden_size, spec.num_attention_heads * spec.head_dim)}
        if spec.attention_bias:
            shapes[O_PROJ + BIAS] = (spec.hidden_size,)
        return shapes

    def steps(self, knobs: dict, spec) -> dict:
        attn = setting(knobs, "attn")
        clashing = [k for k in EAGER_ONLY if attn == "sdpa" and setting(knobs, k) != KNOBS[k].default_value]
        if clashing:
            raise TracerError(f"{clashing[0]}={knobs[clashing[0]]} needs attn=eager: "
                              "sdpa masks and scales inside its fused kernel")
        if spec is not None:
            for (knob, value), (refused, reason) in _FEATURES.items():
                if knobs.get(knob) == value and refused(spec):
                    raise TracerError(reason if knob == "attn" else f"{knob}={value} changes nothing here: {reason}")
        scale_scores, attention_dtype = ATTN_MATH[setting(knobs, "attn_math")]
        return {
            "attention": ATTENTION_KERNELS[attn],
            "repeat_kv": KV_REPEATS[setting(knobs, "kv_repeat")],
            "mask": MASKS[setting(knobs, "mask")],
            "scale_scores": scale_scores,
            "attention_dtype": None if attention_dtype is None else getattr(torch, attention_dtype),
            "window": WINDOWS[setting(knobs, "window")],
            **({"qk_heads": qk_plain} if self.qk_norm is None else {}),
            # the q/k norms compute with the family's norm (`qk_norm` None) unless the variant drops them
            "qk_norm": qk_norm_skipped if knobs.get("qk_norm") == "drop" else None,
            **kv_cache.steps(knobs, spec),
            **padding.steps(knobs),
        }

    def forward(self, x: torch.Tensor, run) -> torch.Tensor:
        """x (1, T, C) -> (1, T, C), recording projections, q/k norms, RoPE, scores, probs, context, output."""
        spec, steps = run.spec, run.steps
        batch, tokens, _ = x.shape
        q, k, v = steps.project(x, run)  # (1, T, H*D), (1, T, KV*D) x2
        q, k = steps.qk_heads(q, k, run)  # (1, H, T, D), (1, KV, T, D)
        v = heads_first(v, spec.head_dim)  # (1, KV, T, D)
        cos, sin = run.positions.tables(layer_type(spec, run.index))  # (1, T, R) each
        unrotated = k
        q, k = steps.rope(q, cos, sin), steps.rope(k, cos, sin)
        run.record(Q_ROPE, q)
        run.record(K_ROPE, k)
        queries = keys = run.positions.positions  # (T,)
        if run.cache is not None:  # the layer's keys and values so far, these appended
            stored = unrotated if steps.cache_unrotated else None
            if steps.cache_store is not None:  # its storage format: what every later step reads back
                k, v = steps.cache_store(k), steps.cache_store(v)
                stored = None if stored is None else steps.cache_store(stored)
            k, v, keys = run.cache.update(run.index, k, v, queries, stored)  # (1, KV, S, D) x2, (S,)
            run.record(CACHE_K, run.cache.keys[run.index])  # what the cache holds now, (1, KV, S, D)
            run.record(CACHE_V, run.cache.values[run.index])
        window = steps.window(spec, run.index)
        if run.positions.real is None:
            visible = Visible(queries, keys, window if run.cache is None else steps.cached_window(window))
        else:  # a left-padded batch (no cache): causal over the padded sequence's indices, padded keys blocked
            indices = torch.arange(tokens)  # (T,)
            visible = Visible(indices, indices, window, steps.padding_mask(run.positions.real))
        context = steps.attention(q, k, v, spec, steps, run.record, visible)  # (1, H, T, D)
        context = context.transpose(1, 2).contiguous().reshape(batch, tokens, -1)  # (1, T, H*D)
        run.record(CONTEXT, context)
        out = steps.linear(context, run.weights[O_PROJ + WEIGHT], run.weights.get(O_PROJ + BIAS))  # (1, T, C)
        run.record(O_PROJ, out)
        return out
