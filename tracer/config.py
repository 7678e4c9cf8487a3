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
"""

from __future__ import annotations

import dataclasses
import json
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
    """Read a config dict the way transformers 5's `LlamaConfig` does."""
    if config.get("model_type", "llama") != "llama":
        raise TracerError(f"unsupported model_type {config.get('model_type')!r}: tracer handles Llama models")
    heads = _required(config, "num_attention_heads")
    hidden = _required(config, "hidden_size")
    rope_theta, rope_scaling = _hf_rope(config)
    used = {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
        "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
        "mlp_bias", "hidden_act",
    }
    return LlamaSpec(
        vocab_size=_required(config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_required(config, "intermediate_size"),
        num_hidden_layers=_required(config, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        hidden_act=config.get("hidden_act", "silu"),
        rope_scaling=rope_scaling,
        unused_keys=tuple(sorted(k for k in config if k not in used and k not in NON_FORWARD_KEYS)),
    )


def _required(config: dict, key: str):
    if key not in config:
        raise TracerError(f"config.json lacks the required key {key!r}")
    value = config[key]
    # Every required key is a size or a count; a hand-edited "64" or 64.0 must not reach a reshape.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TracerError(f"config.json key {key!r} must be a positive integer, got {value!r}")
    return value


def _hf_rope(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4)."""
    params = config.get("rope_parameters") or {}
    legacy_scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA))
    scaling = {k: v for k, v in {**legacy_scaling, **params}.items() if k != "rope_theta"}
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}


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


def read_candle(config: dict) -> LlamaSpec:
    """Read a config dict the way candle 0.11's serde `LlamaConfig::into_config` does.

    Raises:
        TracerError: a field candle requires is missing, or `rope_scaling` is not Llama-3
            parameters (serde would refuse the file).
    """
    missing = [k for k, default in CANDLE_FIELDS.items() if default is REQUIRED and k not in config]
    if missing:
        raise TracerError(f"candle 0.11 cannot parse config.json: missing field `{missing[0]}`")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    return LlamaSpec(
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=hidden // heads,  # candle derives it; a `head_dim` key is never read
        rope_theta=float(config.get("rope_theta", DEFAULT_ROPE_THETA)),
        rms_norm_eps=float(config["rms_norm_eps"]),
        max_position_embeddings=int(config["max_position_embeddings"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings") or False),
        rope_scaling=_candle_scaling(config.get("rope_scaling")),
        unused_keys=tuple(sorted(k for k in config if k not in CANDLE_FIELDS and k not in NON_FORWARD_KEYS)),
    )


def _candle_scaling(scaling: dict | None) -> dict | None:
    """`Option<Llama3RopeConfig>`: rope_type llama3 or default, with all four Llama-3 fields."""
    if scaling is None:
        return None
    rope_type = scaling.get("rope_type", "default")
    missing = [k for k in CANDLE_SCALING_FIELDS if k not in scaling]
    if rope_type not in ("llama3", "default") or missing:
        raise TracerError(f"candle 0.11 cannot parse rope_scaling {scaling}: it reads Llama-3 parameters only "
                          f"({', '.join(CANDLE_SCALING_FIELDS)}, rope_type llama3 | default)")
    if rope_type == "default":
        return None
    return {"rope_type": "llama3", **{k: scaling[k] for k in CANDLE_SCALING_FIELDS}}


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
        >>> audit(load_config(model_dir), resave="tf5")["differences"]
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
