"""Config readers: `config.json` -> `LlamaSpec`, the shape of the model the reimplementation builds.

`read_hf` follows how transformers 5 reads a Llama `config.json` (`LlamaConfig` and
`RotaryEmbeddingConfigMixin.standardize_rope_params`): `rope_theta` from `rope_parameters`
(transformers 5 files) or top level (transformers 4 files), default 10000; `head_dim` default
hidden/heads; kv heads default to the query heads. Keys that do not shape the forward pass are
listed in `LlamaSpec.unused_keys` so that nothing is skipped silently.
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
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TracerError(f"not a model directory (no config.json): {model_dir}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TracerError(f"config.json is not valid JSON: {path} ({exc})") from None


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
    return config[key]


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
