"""Config readers: `config.json` -> `LlamaSpec`, the shape of the model the reimplementation builds.

Two readers of the same file, because a port reads it its own way:

- `read_hf` follows how transformers 5 reads the `config.json` of each family tracer traces
  (`tracer.model.families`; `LlamaConfig`, `Qwen2Config`, `Gemma2Config`, ... and
  `RotaryEmbeddingConfigMixin.standardize_rope_params`): `rope_theta` from `rope_parameters`
  (transformers 5 files) or top level (transformers 4 files), default 10000; `head_dim` default
  hidden/heads; kv heads default to the query heads. Each family's own defaults and keys (Qwen's
  32 kv heads, Gemma's `hidden_activation` and soft-caps, Mistral's 4096-token window when the key
  is absent, ...) are one `FamilyConfig` row of `FAMILY_CONFIGS`. A `model_type` tracer does not
  trace is one line naming it and the supported ones.
- `read_candle` follows candle 0.11's serde `LlamaConfig` + `into_config`: 13 keys, `rope_theta`
  defaults to 10000, `rope_scaling` only as Llama-3 parameters; `rope_parameters`, `head_dim`
  (always hidden/heads), biases (always none) and `hidden_act` (always silu) are ignored. It reads
  Llama configs only (candle's `llama.rs`); another family is refused in one line.

`resave_tf5` rewrites a config the way transformers 5's `save_pretrained` does before either
reader sees it. `audit` says, per reader, what it read, defaulted and ignored, and where the
readers disagree. Keys a reader skips are listed in `LlamaSpec.unused_keys`: nothing silently.
A value a reader reads is checked (type, range, relation to the other keys) by one checker per
kind of value, shared by both readers: a malformed value is one TracerError naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tracer.core.errors import TracerError, did_you_mean
from tracer.model.component import family_named, family_of
from tracer.model.knobs import KNOBS, check_family, setting

DEFAULT_ROPE_THETA = 10_000.0

# Keys that do not change a single-sequence f32 forward: training, generation and bookkeeping.
NON_FORWARD_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "attention_dropout", "pretraining_tp", "bos_token_id", "eos_token_id",
    "pad_token_id", "tracer_source", "rope_interleaved", "transformers.js_config",
    "_name_or_path", "is_llama_config", "output_attentions", "output_hidden_states",
    "_sliding_window_pattern",  # Gemma 3's private copy of sliding_window_pattern, written by save_pretrained
})


@dataclass(frozen=True)
class LlamaSpec:
    """Everything the forward pass needs to know about a Llama model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...}; None = plain RoPE
    # What the families beyond Llama add (tracer.model.families); the defaults are Llama's.
    family: str = "llama"
    qkv_bias: bool = False  # q/k/v biases without an o_proj bias (Qwen2, always)
    sliding_window: int | None = None  # keys a query sees on a sliding layer (itself included)
    layer_types: tuple[str, ...] | None = None  # "full_attention" | "sliding_attention" per layer; None: all full
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None: rope_theta
    partial_rotary_factor: float = 1.0  # the fraction of each head's dims that RoPE rotates (Phi-3)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -0.5 power instead of head_dim's (Gemma)
    attn_logit_softcapping: float | None = None  # scores -> cap·tanh(scores/cap) before the mask (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits (Gemma 2)
    # The config fields a family's own components declare (`Component.config_fields`: a mixture of
    # experts' num_local_experts, ...), key -> value; read as attributes (`spec.num_local_experts`).
    extra: dict = field(default_factory=dict)
    unused_keys: tuple[str, ...] = field(default=(), compare=False)

    def __getattr__(self, name: str):
        extra = self.__dict__.get("extra") or {}
        if name in extra:
            return extra[name]
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer % len(self.layer_types)] if self.layer_types else "full_attention"

    def window(self, layer: int) -> int | None:
        """The sliding window of one layer; None where it attends to the whole prefix."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    @property
    def score_scale_dim(self) -> int | float:
        """What scores are scaled by the -0.5 power of: head_dim, or Gemma's query_pre_attn_scalar."""
        return self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE rotates (all but with Phi-3's partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def replace(self, **changes) -> LlamaSpec:
        return dataclasses.replace(self, **changes)


def load_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise TracerError(f"not a model directory (no config.json): {model_dir}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise TracerError(f"not valid JSON{where}: {path}") from None
    except OSError as exc:  # unreadable: permissions, a folder named config.json, an I/O error
        raise TracerError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(config, dict):
        raise TracerError(f"config.json is not a JSON object: {path}")
    return config


def read_hf(config: dict) -> LlamaSpec:
    """Read a config dict the way transformers 5 reads it for its family (`model_type`; absent: Llama).

    Raises:
        TracerError: a model type tracer does not trace, a required key missing, or a value
            transformers would refuse or could not run (a string for a number, NaN, an unknown
            activation or rope type).
    """
    family = family_of(config.get("model_type"))
    reads = config_reading(family.name)
    heads = _required(config, "num_attention_heads")
    hidden = _required(config, "hidden_size")
    if reads.divisible_heads and hidden % heads:  # `validate_architecture`, even when head_dim is given
        raise TracerError(f"config.json: hidden_size must be a multiple of num_attention_heads ({heads}), "
                          f"got {hidden}")
    head_dim = _given(config, "head_dim", reads.head_dim)  # null: derived, as in transformers
    head_dim = _derived_head_dim(hidden, heads) if head_dim is None else _positive_int("head_dim", head_dim, even=True)
    act_key, act_default = reads.activation
    spec = LlamaSpec(
        **_sizes(config, hidden, heads, reads.kv_heads),
        head_dim=head_dim,
        # transformers' strict configs take a float only: an integer eps is refused there.
        rms_norm_eps=_positive_number("rms_norm_eps", config.get("rms_norm_eps", reads.rms_norm_eps), integers=False),
        max_position_embeddings=_hf_max_positions(config, reads.max_positions),
        tie_word_embeddings=_boolean("tie_word_embeddings", config.get("tie_word_embeddings", reads.tied)),
        hidden_act=_choice(act_key, config.get(act_key, act_default), HF_ACTIVATIONS,
                           "an activation transformers knows"),
        family=family.name,
        **reads.extras(config),
        extra=component_fields(config, family),
    )
    used = set(hf_fields(family.name)) | {key for declared in family.config_fields() for key in declared.aliases}
    return spec.replace(unused_keys=tuple(sorted(k for k in config if k not in used and k not in NON_FORWARD_KEYS)))


def component_fields(config: dict, family) -> dict:
    """The values of the config fields the family's components declare (`ConfigField`), checked."""
    values = {}
    for declared in family.config_fields():
        key = next((k for k in (declared.key, *declared.aliases) if k in config), declared.key)  # as transformers
        if declared.default is REQUIRED and key not in config:
            raise TracerError(f"config.json lacks the required key {declared.key!r}")
        values[declared.key] = FIELD_CHECKS[declared.kind](key, config.get(key, declared.default))
    return values


def _hf_max_positions(config: dict, default: int = 2048) -> int:
    return _positive_int("max_position_embeddings", config.get("max_position_embeddings", default))


def _hf_rope(config: dict, params: dict | None = None, container: str = "rope_parameters",
             default_theta: float = DEFAULT_ROPE_THETA, original_max: int | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4).
    `params`: one layer type's entry of a nested `rope_parameters` (Gemma 3), named `container`."""
    params = _object("rope_parameters", config.get("rope_parameters")) if params is None else params
    legacy_scaling = _object("rope_scaling", config.get("rope_scaling"))

    def key(name: str) -> str:  # where a merged value came from: rope_parameters wins, as in transformers
        return f"{container}.{name}" if name in params else f"rope_scaling.{name}"

    theta = _positive_number(f"{container}.rope_theta" if "rope_theta" in params else "rope_theta",
                             params.get("rope_theta", config.get("rope_theta", default_theta)))
    # partial_rotary_factor travels with the rope parameters in transformers 5 but is no scaling (Phi-3)
    scaling = {k: v for k, v in {**legacy_scaling, **params}.items()
               if k not in ("rope_theta", "partial_rotary_factor")}
    type_key = key("rope_type") if "rope_type" in scaling else key("type")
    rope_type = _choice(type_key, scaling.pop("rope_type", scaling.pop("type", "default")), HF_ROPE_TYPES,
                        "a rope type transformers knows")
    if rope_type == "default":
        return theta, None
    container = container if "rope_type" in params or "type" in params else "rope_scaling"
    for name in HF_ROPE_REQUIRED.get(rope_type, ()):
        if name not in scaling:
            raise TracerError(f"config.json: {container} lacks {name!r}, which rope_type {rope_type!r} requires")
    if rope_type in ("llama3", "yarn", "longrope"):  # transformers' `standardize_rope_params` default
        if original_max is not None:  # Phi-3 keeps the pretraining length at top level, and it wins
            scaling["original_max_position_embeddings"] = original_max
        scaling.setdefault("original_max_position_embeddings", _hf_max_positions(config))
    if "factor" in scaling:
        scaling["factor"] = _positive_number(key("factor"), scaling["factor"])
    if rope_type == "llama3":
        scaling = _llama3_scaling(scaling, key)
    return theta, {"rope_type": rope_type, **scaling}


# --- checking values ----------------------------------------------------------------------------
# One checker per kind of value, shared by both readers. config.json files are edited by hand: "64",
# 64.0, "false", null or NaN (Python's json reads it) must stop at the reader with the key named,
# not reach a reshape as a traceback or become another model in silence (bool("no") is True).

# transformers 5.24: `activations.ACT2CLS` and `modeling_rope_utils.ROPE_INIT_FUNCTIONS` (+ default);
# anything else is a KeyError when the model is built. tests/unit/test_config.py pins both lists.
HF_ACTIVATIONS = frozenset({
    "gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
    "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu", "relu",
    "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu",
})
HF_ROPE_TYPES = frozenset({"default", "dynamic", "linear", "llama3", "longrope", "proportional", "yarn"})
# The keys transformers' `_validate_<type>_rope_parameters` requires and no default fills.
HF_ROPE_REQUIRED = {
    "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "longrope": ("short_factor", "long_factor"),
}


def _as_written(value) -> str:
    """The value as config.json spells it ("4", null, true, NaN), cut short to keep the message one line."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(key: str, value, expected: str) -> TracerError:
    return TracerError(f"config.json: {key} must be {expected}, got {_as_written(value)}")


def _required(config: dict, key: str) -> int:
    if key not in config:
        raise TracerError(f"config.json lacks the required key {key!r}")
    return _positive_int(key, config[key])  # every required key is a size or a count


def _given(config: dict, key: str, default):
    """config[key], or `default` when it is absent or null (keys a reader treats as optional)."""
    value = config.get(key)
    return default if value is None else value


def _positive_int(key: str, value, *, even: bool = False) -> int:
    # bool is an int in Python; a hand-edited "64" or 64.0 must not reach a reshape.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or (even and value % 2):
        raise _refuse(key, value, "an even positive integer (RoPE rotates pairs)" if even else "a positive integer")
    return value


def _positive_number(key: str, value, *, integers: bool = True) -> float:
    """A finite number > 0 as a float; `integers=False` where transformers' strict config takes floats only."""
    kinds = (int, float) if integers else float
    try:
        number = float(value) if isinstance(value, kinds) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer literal too large for a float
        number = math.inf
    if not 0 < number < math.inf:  # NaN fails every comparison
        raise _refuse(key, value, "a positive finite number" if integers else "a positive finite float such as 1e-05")
    return number


def _boolean(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise _refuse(key, value, "true or false")
    return value


def _choice(key: str, value, names: frozenset, what: str) -> str:
    if not isinstance(value, str) or value not in names:
        listed = ", ".join(sorted(names))
        if len(listed) <= 70:
            raise _refuse(key, value, f"{what} ({listed})")
        # transformers' activations would run the line past a terminal's width: the closest one instead
        raise TracerError(f"config.json: {key} must be {what}, got {_as_written(value)}"
                          + did_you_mean(str(value), names))
    return value


def _object(key: str, value) -> dict:
    """A nested JSON object; null reads as empty."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refuse(key, value, "an object or null")
    return value


def _layer_list(key: str, value) -> tuple[int, ...]:
    """Layer indices (null: none), e.g. Qwen2-MoE's `mlp_only_layers`."""
    if value is None:
        return ()
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
        raise _refuse(key, value, "a list of layer indices")
    return tuple(value)


# A declared config field's kind -> its checker (`ConfigField.kind`).
FIELD_CHECKS = {"positive_int": _positive_int, "positive_number": _positive_number, "bool": _boolean,
                "layers": _layer_list}


def _kv_heads(config: dict, heads: int, default: int | None = None) -> int:
    absent = config.get("num_key_value_heads", default)  # null means the heads in every family
    kv_heads = _positive_int("num_key_value_heads", heads if absent is None else absent)
    if heads % kv_heads:  # each kv head serves a whole group of query heads
        raise _refuse("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads ({heads})")
    return kv_heads


def _derived_head_dim(hidden: int, heads: int) -> int:
    head_dim = hidden // heads
    if head_dim == 0 or head_dim % 2:
        raise TracerError(f"config.json keys 'hidden_size' ({hidden}) and 'num_attention_heads' ({heads}) give "
                          f"head_dim {head_dim}; RoPE needs an even positive head_dim")
    return head_dim


def _llama3_scaling(scaling: dict, key) -> dict:
    """Llama-3 frequency scaling, checked for both readers: every value the formula divides by.
    `key(name)` says where a field came from (rope_scaling.factor, rope_parameters.factor)."""
    low = _positive_number(key("low_freq_factor"), scaling["low_freq_factor"])
    high = _positive_number(key("high_freq_factor"), scaling["high_freq_factor"])
    if high <= low:  # the smooth ramp between the two divides by high - low
        expected = f"greater than low_freq_factor ({_as_written(scaling['low_freq_factor'])})"
        raise _refuse(key("high_freq_factor"), scaling["high_freq_factor"], expected)
    return {**scaling, "factor": _positive_number(key("factor"), scaling["factor"]),
            "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": _positive_int(key("original_max_position_embeddings"),
                                                              scaling["original_max_position_embeddings"])}


# --- candle 0.11 ------------------------------------------------------------------------------

REQUIRED = object()  # a serde field without default: its absence is a parse error

# candle-transformers 0.11 `models::llama::LlamaConfig`, field -> serde default.
CANDLE_FIELDS = {
    "hidden_size": REQUIRED, "intermediate_size": REQUIRED, "vocab_size": REQUIRED,
    "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED,
    "num_key_value_heads": "num_attention_heads", "rms_norm_eps": REQUIRED, "rope_theta": DEFAULT_ROPE_THETA,
    "bos_token_id": None, "eos_token_id": None, "rope_scaling": None,
    "max_position_embeddings": REQUIRED, "tie_word_embeddings": False,
}
CANDLE_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")



def _sizes(config: dict, hidden: int, heads: int, kv_default: int | None = None) -> dict:
    """The sizes both readers take the same way: required positive integers, kv heads defaulting
    to the heads (or to a family's own default: Qwen's 32, Mistral's 8, Gemma's 4)."""
    return {
        "vocab_size": _required(config, "vocab_size"), "hidden_size": hidden,
        "intermediate_size": _required(config, "intermediate_size"),
        "num_hidden_layers": _required(config, "num_hidden_layers"), "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(config, heads, kv_default),
    }


# --- families: transformers 5.24's configuration_<family>.py, one row each ------------------------


@dataclass(frozen=True)
class FamilyConfig:
    """How transformers reads one family's config.json, beyond the sizes every family requires.

    Attributes:
        kv_heads: num_key_value_heads when the key is absent (None: the query heads).
        head_dim: head_dim when absent or null (None: hidden_size / num_attention_heads).
        rms_norm_eps, max_positions, tied: defaults of those keys.
        activation: (key, default): Gemma reads `hidden_activation`, the others `hidden_act`.
        divisible_heads: transformers refuses hidden_size not a multiple of the heads (Llama, Gemma).
        extras: config -> the spec fields only this family reads (biases, windows, caps, rope).
        extra_fields: key -> default, for those keys (what `tracer config` lists as read or defaulted).
    """

    extras: Callable[[dict], dict]
    extra_fields: dict
    kv_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_positions: int = 2048
    tied: bool = False
    activation: tuple[str, str] = ("hidden_act", "silu")
    divisible_heads: bool = False


def rope_fields(config: dict) -> dict:
    theta, scaling = _hf_rope(config, original_max=top_level_original_max(config))
    return {"rope_theta": theta, "rope_scaling": scaling}


def top_level_original_max(config: dict) -> int | None:
    """A top-level `original_max_position_embeddings` wins over the rope parameters' own (llama3, yarn,
    longrope), in every family whose rope parameters are one dict: each `_compute_<type>_parameters`
    calls `standardize_rope_params` again once the config holds it as an attribute."""
    value = config.get("original_max_position_embeddings")
    return None if value is None else _positive_int("original_max_position_embeddings", value)


def _biases(config: dict) -> dict:
    return {"attention_bias": _boolean("attention_bias", config.get("attention_bias", False))}


def llama_extras(config: dict) -> dict:
    return {**rope_fields(config), **_biases(config), "mlp_bias": _boolean("mlp_bias", config.get("mlp_bias", False))}


def _layer_types(config: dict, default: list[str]) -> tuple[str, ...]:
    """`layer_types` as written (one per layer), else the family's pattern."""
    types = config.get("layer_types")
    if types is None:
        return tuple(default)
    layers = config["num_hidden_layers"]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise _refuse("layer_types", types, f"a list of {layers} of {', '.join(LAYER_TYPES)}")
    return tuple(types)


def _window(config: dict, default: int | None) -> int | None:
    window = _given(config, "sliding_window", None) if "sliding_window" in config else default
    return None if window is None else _positive_int("sliding_window", window)


def _qwen_windows(config: dict) -> dict:
    """Qwen2/3: `sliding_window` only with `use_sliding_window`, on the layers from `max_window_layers` on."""
    use = _boolean("use_sliding_window", config.get("use_sliding_window", False))
    window = _window(config, 4096) if use else None
    first = _positive_int("max_window_layers", config.get("max_window_layers", 28))
    pattern = ["sliding_attention" if window is not None and i >= first else "full_attention"
               for i in range(config["num_hidden_layers"])]
    types = _layer_types(config, pattern)
    return {"sliding_window": window, "layer_types": types if "sliding_attention" in types else None}


def every_layer_window(config: dict, default: int | None) -> dict:
    """Mistral, Phi-3: one window on every layer, when there is one."""
    window = _window(config, default)
    return {"sliding_window": window,
            "layer_types": None if window is None else ("sliding_attention",) * config["num_hidden_layers"]}


def qwen2_extras(config: dict) -> dict:
    return {**rope_fields(config), "qkv_bias": True, **_qwen_windows(config)}  # Qwen2Attention: bias=True always


def qwen3_extras(config: dict) -> dict:
    return {**rope_fields(config), **_biases(config), **_qwen_windows(config)}


def mistral_extras(config: dict) -> dict:
    return {**rope_fields(config), **every_layer_window(config, 4096)}


def _gemma_common(config: dict, caps: tuple[float | None, float | None], pattern: int) -> dict:
    attn_cap, final_cap = (_optional_number(config, key, default) for key, default in
                           zip(("attn_logit_softcapping", "final_logit_softcapping"), caps))
    layers = config["num_hidden_layers"]
    types = _layer_types(config, ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(layers)])
    return {
        **_biases(config),
        "query_pre_attn_scalar": _positive_number("query_pre_attn_scalar", config.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": attn_cap, "final_logit_softcapping": final_cap,
        "sliding_window": _window(config, 4096), "layer_types": types,
    }


def _optional_number(config: dict, key: str, default: float | None) -> float | None:
    value = config.get(key, default)
    return None if value is None else _positive_number(key, value)


def _causal_only(config: dict) -> None:
    """Gemma's `use_bidirectional_attention` (EmbeddingGemma) makes an encoder, no causal LM."""
    if _boolean("use_bidirectional_attention", _given(config, "use_bidirectional_attention", False)):
        raise TracerError("a Gemma with use_bidirectional_attention (an embedding model) is not traced: it is no "
                          "causal LM")


def gemma2_extras(config: dict) -> dict:
    _causal_only(config)
    return {**rope_fields(config), **_gemma_common(config, (50.0, 30.0), 2)}


def gemma3_extras(config: dict) -> dict:
    """Gemma 3: a global RoPE (rope_theta, default 1e6, with any scaling) and a local one for the sliding
    layers (rope_local_base_freq, default 10000); transformers 5 nests both in rope_parameters."""
    _causal_only(config)
    params = _object("rope_parameters", config.get("rope_parameters"))
    nested = "full_attention" in params or "sliding_attention" in params
    full = _object("rope_parameters.full_attention", params.get("full_attention")) if nested else params
    local = _object("rope_parameters.sliding_attention", params.get("sliding_attention")) if nested else {}
    theta, scaling = _hf_rope(config, full, "rope_parameters.full_attention" if nested else "rope_parameters", 1e6)
    local_theta, local_scaling = _hf_rope({}, local, "rope_parameters.sliding_attention",
                                          config.get("rope_local_base_freq", 10_000.0))
    if local_scaling is not None:
        raise TracerError("config.json: rope_parameters.sliding_attention scales the local RoPE; "
                          "tracer's reimplementation scales the global one only")
    pattern = _positive_int("sliding_window_pattern", config.get("sliding_window_pattern", 6))
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta,
            **_gemma_common(config, (None, None), pattern)}


def phi3_extras(config: dict) -> dict:
    """Phi-3: `rope_scaling` replaces `rope_parameters` ("su" and "yarn" are longrope), the pretraining
    length `original_max_position_embeddings` at top level wins, and `partial_rotary_factor` may sit at
    top level or with the rope parameters."""
    params = dict(_object("rope_scaling", config.get("rope_scaling")) or _object("rope_parameters",
                                                                                 config.get("rope_parameters")))
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params["rope_type"] = "longrope"
        params.pop("type", None)
    original = _positive_int("original_max_position_embeddings", config.get("original_max_position_embeddings", 4096))
    theta, scaling = _hf_rope({**config, "rope_scaling": None}, params, original_max=original)
    factor = _positive_number("partial_rotary_factor",
                              params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    head_dim = _given(config, "head_dim", None) or config["hidden_size"] // config["num_attention_heads"]
    if factor > 1 or int(head_dim * factor) % 2:  # RoPE rotates pairs of the first head_dim·factor dims
        raise _refuse("partial_rotary_factor", factor, f"at most 1, rotating an even number of the {head_dim} "
                                                       "dims of a head")
    return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": factor,
            **every_layer_window(config, None)}


def olmo2_extras(config: dict) -> dict:
    return {**rope_fields(config), **_biases(config)}


LAYER_TYPES = ("full_attention", "sliding_attention")
# Keys several families read, key -> transformers' default (each family's declaration lists its own).
ROPE_KEYS = {"rope_parameters": None, "rope_theta": DEFAULT_ROPE_THETA, "rope_scaling": None,
             "original_max_position_embeddings": None}
QWEN_WINDOW_KEYS = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None}
GEMMA_KEYS = {"attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None}


def config_reading(family: str) -> FamilyConfig:
    """How one family's config.json is read (part of its declaration, `tracer.model.families`)."""
    return family_named(family).config


def hf_fields(family: str) -> dict:
    """The keys transformers reads from one family's config.json that shape the forward, key -> default."""
    reads = config_reading(family)
    head_dim = "hidden_size / num_attention_heads" if reads.head_dim is None else reads.head_dim
    kv_heads = "num_attention_heads" if reads.kv_heads is None else reads.kv_heads
    return {
        "vocab_size": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
        "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "rms_norm_eps": reads.rms_norm_eps, "max_position_embeddings": reads.max_positions,
        "tie_word_embeddings": reads.tied, reads.activation[0]: reads.activation[1], **reads.extra_fields,
        **{declared.key: declared.default for declared in family_named(family).config_fields()},
    }


def read_candle(config: dict) -> LlamaSpec:
    """Read a config dict the way candle 0.11's serde `LlamaConfig::into_config` does.

    Raises:
        TracerError: a field candle requires is missing, or `rope_scaling` is not Llama-3
            parameters (serde would refuse the file); or a value is one candle could not run
            (zero heads, NaN theta, kv heads that do not divide the heads).
    """
    if config.get("model_type", "llama") != "llama":
        raise TracerError(f"the candle reader reads Llama configs only (candle 0.11's llama.rs); this is a "
                          f"{config['model_type']!r} model")
    missing = [k for k, default in CANDLE_FIELDS.items() if default is REQUIRED and k not in config]
    if missing:
        raise TracerError(f"candle 0.11 cannot parse config.json: missing field `{missing[0]}`")
    heads, hidden = _required(config, "num_attention_heads"), _required(config, "hidden_size")
    return LlamaSpec(
        **_sizes(config, hidden, heads),  # kv heads: candle's Option<usize> reads null as absent, too
        head_dim=_derived_head_dim(hidden, heads),  # candle derives it; a `head_dim` key is never read
        rope_theta=_positive_number("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA)),
        rms_norm_eps=_positive_number("rms_norm_eps", config["rms_norm_eps"]),  # serde's f64 takes an integer
        max_position_embeddings=_positive_int("max_position_embeddings", config["max_position_embeddings"]),
        tie_word_embeddings=_boolean("tie_word_embeddings", _given(config, "tie_word_embeddings", False)),
        rope_scaling=_candle_scaling(config.get("rope_scaling")),
        unused_keys=tuple(sorted(k for k in config if k not in CANDLE_FIELDS and k not in NON_FORWARD_KEYS)),
    )


def _candle_scaling(scaling) -> dict | None:
    """`Option<Llama3RopeConfig>`: rope_type llama3 or default, with all four Llama-3 fields (serde
    has no default for any of the five)."""
    if scaling is None:
        return None
    scaling = _object("rope_scaling", scaling)
    rope_type = scaling.get("rope_type")
    missing = [k for k in (*CANDLE_SCALING_FIELDS, "rope_type") if k not in scaling]
    if rope_type not in ("llama3", "default") or missing:
        raise TracerError(f"candle 0.11 cannot parse rope_scaling {scaling}: it reads Llama-3 parameters only "
                          f"({', '.join(CANDLE_SCALING_FIELDS)}, rope_type llama3 | default)")
    if rope_type == "default":
        return None
    fields = _llama3_scaling({k: scaling[k] for k in CANDLE_SCALING_FIELDS}, lambda name: f"rope_scaling.{name}")
    return {"rope_type": "llama3", **fields}


# --- re-saving, choosing, auditing -------------------------------------------------------------


def resave_tf5(config: dict) -> dict:
    """The config as transformers 5's `save_pretrained` writes it back.

    Top-level `rope_theta` and `rope_scaling` merge into `rope_parameters` and disappear from the
    top level; `head_dim` is written out. transformers reads both forms alike; candle does not.
    """
    if family_of(config.get("model_type")).name != "llama":
        raise TracerError("resave=tf5 rewrites Llama configs only (it shows what candle's Llama reader makes of them)")
    theta, scaling = _hf_rope(config)
    saved = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    saved["rope_parameters"] = {"rope_theta": theta, "rope_type": "default", **(scaling or {})}
    saved["head_dim"] = read_hf(config).head_dim
    return saved


# transformers 5 `LlamaConfig`: the keys that shape the forward, key -> default.
READERS = {"hf": read_hf, "candle": read_candle}
RESAVES = {"none": dict, "tf5": resave_tf5}
# transformers takes these from either place: one present means the other is not defaulted.
HF_EITHER = {"rope_theta": "rope_parameters", "rope_parameters": "rope_theta", "rope_scaling": "rope_parameters"}


def read_config(config: dict, variant: dict | None = None) -> LlamaSpec:
    """The spec a variant's `config` reader makes of the file after its `resave` (both optional)."""
    variant = variant or {}
    return READERS[setting(variant, "config")](RESAVES[setting(variant, "resave")](config))


def audit(config: dict, resave: str = "none") -> dict:
    """What each reader makes of `config` (after `resave`): keys read, defaulted, ignored, and the
    spec values on which the readers disagree.

    Example:
        >>> audit(load_config(tracer.default_model_path()), resave="tf5")["differences"]
        {'rope_theta': {'hf': 100000.0, 'candle': 10000.0}}
    """
    config = RESAVES[resave](config)
    readers, specs = {}, {}
    family = family_of(config.get("model_type")).name
    for name, fields in {"hf": hf_fields(family), "candle": CANDLE_FIELDS}.items():
        entry = {
            "reads": [k for k in fields if k in config],
            "defaulted": {k: d for k, d in fields.items() if k not in config and d is not REQUIRED
                          and not (name == "hf" and HF_EITHER.get(k) in config)},
            "ignored": [k for k in config if k not in fields and k not in NON_FORWARD_KEYS],
            "ignored_bookkeeping": [k for k in config if k not in fields and k in NON_FORWARD_KEYS],
            "error": None,
        }
        try:
            spec = READERS[name](config)
            specs[name] = {**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
                              if f.compare and f.name != "extra"}, **spec.extra}  # a component's fields as the rest
            entry["spec"] = specs[name]
        except TracerError as exc:
            entry["error"] = str(exc)
        readers[name] = entry
    differences = {}
    if len(specs) > 1:
        for key in next(iter(specs.values())):
            values = {name: spec[key] for name, spec in specs.items()}
            if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
                differences[key] = values
    return {"resave": resave, "readers": readers, "differences": differences}


# --- config-level knobs ----------------------------------------------------------------------

# knob -> value -> spec change; each engine builds the spec these return (transformers included).
_SCALING = {"keep": lambda spec: spec, "drop": lambda spec: spec.replace(rope_scaling=None)}
_BIAS = {"keep": lambda spec: spec,
         "ignore": lambda spec: spec.replace(attention_bias=False, mlp_bias=False, qkv_bias=False)}
_ROPE_LOCAL = {"local": lambda spec: spec, "global": lambda spec: spec.replace(rope_local_theta=spec.rope_theta)}
# `act` knob value -> transformers' activation name (gelu_tanh is transformers' gelu_pytorch_tanh)
ACT_NAMES = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
SPEC_OVERRIDES = {
    "theta": lambda spec, value: spec.replace(rope_theta=value),
    "eps": lambda spec, value: spec.replace(rms_norm_eps=value),
    "layers": lambda spec, value: spec.replace(num_hidden_layers=value),
    "head_dim": lambda spec, value: spec.replace(head_dim=value),
    "rope_scaling": lambda spec, value: _SCALING[value](spec),
    "bias": lambda spec, value: _BIAS[value](spec),
    "act": lambda spec, value: spec.replace(hidden_act=ACT_NAMES[value]),
    "rope_local": lambda spec, value: _ROPE_LOCAL[value](spec),
}


def apply_overrides(spec: LlamaSpec, knobs: dict) -> LlamaSpec:
    """The spec with the variant's config-level knobs (theta, eps, layers, head_dim, rope_scaling,
    bias, act, rope_local) applied; other knobs are left to the engine. A knob that does not apply to
    the model's family is refused here, where both engines pass."""
    check_family(knobs, spec.family)
    for name, value in knobs.items():
        if name in SPEC_OVERRIDES:
            spec = SPEC_OVERRIDES[name](spec, value)
    return spec


def unchanging_knobs(config: dict, knobs: dict) -> dict:
    """The knobs of `knobs` that change nothing on the model of this config.json dict: a config-level
    knob set to the model's own value (theta=10000 where rope_theta is 10000), or a knob set to its
    default. Said in a run's notes: its verdict says nothing of the mistake the knob plants."""
    try:
        spec = read_config(config, knobs)
    except TracerError:  # a reader the run refuses says so itself
        return {}
    same = {}
    for name, value in knobs.items():
        knob = KNOBS.get(name)
        if name in SPEC_OVERRIDES:
            if SPEC_OVERRIDES[name](spec, value) == spec:
                same[name] = value
        elif knob is not None and knob.default_value is not None and value == knob.default_value:
            same[name] = value
    return same


def variant_spec(config: dict, knobs: dict) -> LlamaSpec:
    """The spec a variant builds from a config.json dict: its reader, then its overrides."""
    return apply_overrides(read_config(config, knobs), knobs)
