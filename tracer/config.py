"""Config readers: `config.json` -> `LlamaSpec`, the shape of the model the reimplementation builds.

Two readers of the same file, because a port reads it its own way:

- `read_hf` follows how transformers 5 reads a Llama `config.json` (`LlamaConfig` and
  `RotaryEmbeddingConfigMixin.standardize_rope_params`): `rope_theta` from `rope_parameters`
  (transformers 5 files) or top level (transformers 4 files), default 10000; `head_dim` default
  hidden/heads; kv heads default to the query heads.
- `read_candle` follows candle 0.11's serde `LlamaConfig` + `into_config`: 13 keys, `rope_theta`
  defaults to 10000, `rope_scaling` only as Llama-3 parameters; `rope_parameters`, `head_dim`
  (always hidden/heads), biases (always none) and `hidden_act` (always silu) are ignored.

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

from tracer.errors import TracerError

DEFAULT_ROPE_THETA = 10_000.0

# Keys that do not change a single-sequence f32 forward: training, generation and bookkeeping.
NON_FORWARD_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "attention_dropout", "pretraining_tp", "bos_token_id", "eos_token_id",
    "pad_token_id", "tracer_source", "rope_interleaved", "transformers.js_config",
    "_name_or_path", "is_llama_config", "output_attentions", "output_hidden_states",
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
    unused_keys: tuple[str, ...] = field(default=(), compare=False)

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes) -> LlamaSpec:
        return dataclasses.replace(self, **changes)


def load_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise TracerError(f"not a model directory (no config.json): {model_dir}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TracerError(f"config.json is not valid JSON: {path} ({exc})") from None
    except OSError as exc:  # unreadable: permissions, a folder named config.json, an I/O error
        raise TracerError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(config, dict):
        raise TracerError(f"config.json is not a JSON object: {path}")
    return config


def read_hf(config: dict) -> LlamaSpec:
    """Read a config dict the way transformers 5's `LlamaConfig` does.

    Raises:
        TracerError: a required key is missing, or a value is one transformers would refuse or
            could not run (a string for a number, NaN, an unknown activation or rope type).
    """
    if config.get("model_type", "llama") != "llama":
        raise TracerError(f"unsupported model_type {config.get('model_type')!r}: tracer handles Llama models")
    heads = _required(config, "num_attention_heads")
    hidden = _required(config, "hidden_size")
    if hidden % heads:  # transformers' `validate_architecture`, even when head_dim is given
        raise TracerError(f"config.json key 'hidden_size' must be a multiple of num_attention_heads ({heads}), "
                          f"got {hidden}")
    rope_theta, rope_scaling = _hf_rope(config)
    used = {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
        "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
        "mlp_bias", "hidden_act",
    }
    head_dim = _given(config, "head_dim", None)  # null: derived, as in transformers
    head_dim = _derived_head_dim(hidden, heads) if head_dim is None else _positive_int("head_dim", head_dim, even=True)
    return LlamaSpec(
        **_sizes(config, hidden, heads),
        head_dim=head_dim,
        rope_theta=rope_theta,
        # transformers' strict LlamaConfig takes a float only: an integer eps is refused there.
        rms_norm_eps=_positive_number("rms_norm_eps", config.get("rms_norm_eps", 1e-6), integers=False),
        max_position_embeddings=_hf_max_positions(config),
        tie_word_embeddings=_boolean("tie_word_embeddings", config.get("tie_word_embeddings", False)),
        attention_bias=_boolean("attention_bias", config.get("attention_bias", False)),
        mlp_bias=_boolean("mlp_bias", config.get("mlp_bias", False)),
        hidden_act=_choice("hidden_act", config.get("hidden_act", "silu"), HF_ACTIVATIONS,
                           "an activation transformers knows"),
        rope_scaling=rope_scaling,
        unused_keys=tuple(sorted(k for k in config if k not in used and k not in NON_FORWARD_KEYS)),
    )


def _hf_max_positions(config: dict) -> int:
    return _positive_int("max_position_embeddings", config.get("max_position_embeddings", 2048))


def _hf_rope(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4)."""
    params = _object("rope_parameters", config.get("rope_parameters"))
    legacy_scaling = _object("rope_scaling", config.get("rope_scaling"))

    def key(name: str) -> str:  # where a merged value came from: rope_parameters wins, as in transformers
        return f"rope_parameters.{name}" if name in params else f"rope_scaling.{name}"

    theta = _positive_number("rope_parameters.rope_theta" if "rope_theta" in params else "rope_theta",
                             params.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA)))
    scaling = {k: v for k, v in {**legacy_scaling, **params}.items() if k != "rope_theta"}
    type_key = key("rope_type") if "rope_type" in scaling else key("type")
    rope_type = _choice(type_key, scaling.pop("rope_type", scaling.pop("type", "default")), HF_ROPE_TYPES,
                        "a rope type transformers knows")
    if rope_type == "default":
        return theta, None
    container = "rope_parameters" if "rope_type" in params or "type" in params else "rope_scaling"
    for name in HF_ROPE_REQUIRED.get(rope_type, ()):
        if name not in scaling:
            raise TracerError(f"config.json key {container!r} lacks the key {name!r} that rope_type "
                              f"{rope_type!r} requires")
    if rope_type in ("llama3", "yarn", "longrope"):  # transformers' `standardize_rope_params` default
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
    return TracerError(f"config.json key {key!r} must be {expected}, got {_as_written(value)}")


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
        raise _refuse(key, value, f"{what} ({', '.join(sorted(names))})")
    return value


def _object(key: str, value) -> dict:
    """A nested JSON object; null reads as empty."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refuse(key, value, "an object or null")
    return value


def _kv_heads(config: dict, heads: int) -> int:
    kv_heads = _positive_int("num_key_value_heads", _given(config, "num_key_value_heads", heads))
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

# transformers 5 `LlamaConfig`: the keys that shape the forward, key -> default.
HF_FIELDS = {
    "vocab_size": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
    "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED,
    "num_key_value_heads": "num_attention_heads", "head_dim": "hidden_size / num_attention_heads",
    "rope_parameters": None, "rope_theta": DEFAULT_ROPE_THETA, "rope_scaling": None,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
}


def _sizes(config: dict, hidden: int, heads: int) -> dict:
    """The sizes both readers take the same way: required positive integers, kv heads defaulting
    to the heads."""
    return {
        "vocab_size": _required(config, "vocab_size"), "hidden_size": hidden,
        "intermediate_size": _required(config, "intermediate_size"),
        "num_hidden_layers": _required(config, "num_hidden_layers"), "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(config, heads),
    }


def read_candle(config: dict) -> LlamaSpec:
    """Read a config dict the way candle 0.11's serde `LlamaConfig::into_config` does.

    Raises:
        TracerError: a field candle requires is missing, or `rope_scaling` is not Llama-3
            parameters (serde would refuse the file); or a value is one candle could not run
            (zero heads, NaN theta, kv heads that do not divide the heads).
    """
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
    theta, scaling = _hf_rope(config)
    saved = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    saved["rope_parameters"] = {"rope_theta": theta, "rope_type": "default", **(scaling or {})}
    saved["head_dim"] = read_hf(config).head_dim
    return saved


READERS = {"hf": read_hf, "candle": read_candle}
RESAVES = {"none": dict, "tf5": resave_tf5}
READER_FIELDS = {"hf": HF_FIELDS, "candle": CANDLE_FIELDS}
# transformers takes these from either place: one present means the other is not defaulted.
HF_EITHER = {"rope_theta": "rope_parameters", "rope_parameters": "rope_theta", "rope_scaling": "rope_parameters"}


def read_config(config: dict, variant: dict | None = None) -> LlamaSpec:
    """The spec a variant's `config` reader makes of the file after its `resave` (both optional)."""
    variant = variant or {}
    return READERS[variant.get("config", "hf")](RESAVES[variant.get("resave", "none")](config))


def audit(config: dict, resave: str = "none") -> dict:
    """What each reader makes of `config` (after `resave`): keys read, defaulted, ignored, and the
    spec values on which the readers disagree.

    Example:
        >>> audit(load_config(tracer.default_model_path()), resave="tf5")["differences"]
        {'rope_theta': {'hf': 100000.0, 'candle': 10000.0}}
    """
    config = RESAVES[resave](config)
    readers, specs = {}, {}
    for name, fields in READER_FIELDS.items():
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
            specs[name] = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.compare}
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
_BIAS = {"keep": lambda spec: spec, "ignore": lambda spec: spec.replace(attention_bias=False, mlp_bias=False)}
SPEC_OVERRIDES = {
    "theta": lambda spec, value: spec.replace(rope_theta=value),
    "eps": lambda spec, value: spec.replace(rms_norm_eps=value),
    "layers": lambda spec, value: spec.replace(num_hidden_layers=value),
    "head_dim": lambda spec, value: spec.replace(head_dim=value),
    "rope_scaling": lambda spec, value: _SCALING[value](spec),
    "bias": lambda spec, value: _BIAS[value](spec),
}


def apply_overrides(spec: LlamaSpec, knobs: dict) -> LlamaSpec:
    """The spec with the variant's config-level knobs (theta, eps, layers, head_dim, rope_scaling,
    bias) applied; other knobs are left to the engine."""
    for name, value in knobs.items():
        if name in SPEC_OVERRIDES:
            spec = SPEC_OVERRIDES[name](spec, value)
    return spec


def variant_spec(config: dict, knobs: dict) -> LlamaSpec:
    """The spec a variant builds from a config.json dict: its reader, then its overrides."""
    return apply_overrides(read_config(config, knobs), knobs)
