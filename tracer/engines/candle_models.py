"""candle-transformers' model files as data, for the candle engine (`tracer.engines.candle`): each
file's serde `Config` (the keys it reads and serde's defaults) and what its forward does beyond
llama.rs, read off the file itself (huggingface/candle 2a13b0f, 2026-08-14, candle-transformers
0.11.0: `models/{qwen2,qwen3,mistral,gemma2,gemma3,phi3,olmo2}.rs`).

A file reads config.json as its serde struct does: keys it has no field for are skipped (the trace
lists them as not read), an `Option` absent or null is None, a field with a serde default takes it
when absent, and any other field must be there with a value of its type. Where transformers 5 moved
a required key (`rope_theta` into `rope_parameters`, Gemma 3's `sliding_window_pattern` into
`_sliding_window_pattern`), candle's serde refuses the file; the value is taken from where
transformers 5 put it, as a port that copies the key back runs, and the trace's notes say so. What a
file reads and then does otherwise than transformers (a window of sliding_window + 1 keys on every
layer, scores scaled by head_dim whatever query_pre_attn_scalar says, a tied lm_head whatever
tie_word_embeddings says, no rope scaling) is said in the notes too: nothing silently.

Each file gives `ModelFile.read(config)`: the `Shape` fields its forward takes (`tracer.engines.candle`
composes the forward from them), the notes, and the keys it did not read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from tracer.core.errors import TracerError
from tracer.model.components.block import POST_NORM, SANDWICH
from tracer.model.config import FIELD_CHECKS, NON_FORWARD_KEYS, REQUIRED
from tracer.model.points import K_PROJ, O_PROJ, Q_PROJ, V_PROJ

OPTION = object()  # an `Option<T>` field: absent or null reads as None

# candle_nn::Activation's serde names -> how the engine computes it (`tracer.engines.candle.Forward.activation`).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "newgelu": "gelu_tanh",
               "gelupytorchtanh": "gelu_tanh", "gelu": "gelu_erf", "relu": "relu"}
# The rest of the enum, which this engine does not compose: refused by name rather than run otherwise.
OTHER_ACTIVATIONS = ("relu2", "relu6", "sigmoid", "hardsigmoid", "swiglu", "swish", "mish", "hardswish", "elu",
                     "leakyrelu")
ALL_PROJECTIONS = frozenset({Q_PROJ, K_PROJ, V_PROJ, O_PROJ})


@dataclass(frozen=True)
class Field:
    """One serde field: its Rust type ("u32", "usize", "f64", "bool", "activation", "rope_scaling") and default
    (REQUIRED: no serde default; OPTION: `Option<T>`; else serde's default value)."""

    kind: str
    default: object = REQUIRED


def _usize(key: str, value) -> int:
    return FIELD_CHECKS["positive_int"](key, value)


def _f64(key: str, value) -> float:
    return FIELD_CHECKS["positive_number"](key, value)


def _bool(key: str, value) -> bool:
    return FIELD_CHECKS["bool"](key, value)


def _u32(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 32:
        raise TracerError(f"candle 0.11 cannot parse config.json: `{key}` must be a u32, got {value!r}")
    return value


def _activation(key: str, value) -> str:
    if value in OTHER_ACTIVATIONS:
        raise TracerError(f"the candle engine composes silu, relu, gelu and tanh-GELU; {key} is {value!r}")
    if value not in ACTIVATIONS:
        raise TracerError(f"candle 0.11 cannot parse config.json: unknown variant {value!r} for `{key}`")
    return ACTIVATIONS[value]


def _longrope(key: str, value) -> dict:
    """phi3.rs' `RopeScaling`: short_factor, long_factor (f32 lists) and `type` "longrope", all three required."""
    if not isinstance(value, dict) or value.get("type") != "longrope" or \
            not all(isinstance(value.get(k), list) for k in ("short_factor", "long_factor")):
        raise TracerError(f"candle 0.11 cannot parse config.json's {key}: phi3.rs reads short_factor, long_factor "
                          "and type \"longrope\" only")
    return value


CHECKS = {"u32": _u32, "usize": _usize, "f64": _f64, "bool": _bool, "activation": _activation,
          "rope_scaling": _longrope}


def _rope_parameters(config: dict, layer_type: str | None = None) -> dict:
    params = config.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    if layer_type is not None:
        params = params.get(layer_type)
        params = params if isinstance(params, dict) else {}
    return params


# Where transformers 5 writes a key some files require at top level: key -> config -> value (None: not there).
MOVED = {
    "rope_theta": lambda config: _rope_parameters(config).get(
        "rope_theta", _rope_parameters(config, "full_attention").get("rope_theta")),
    "rope_local_base_freq": lambda config: _rope_parameters(config, "sliding_attention").get("rope_theta"),
    "sliding_window_pattern": lambda config: config.get("_sliding_window_pattern"),
}
MOVED_FROM = {"rope_theta": "rope_parameters", "rope_local_base_freq": "rope_parameters.sliding_attention",
              "sliding_window_pattern": "_sliding_window_pattern"}


@dataclass
class Read:
    """A config.json as one file's serde struct reads it: `values` by field, what the read noted."""

    file: str
    config: dict
    values: dict
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, key: str):
        return self.values[key]

    def head_dim_derived(self) -> int:
        """hidden_size / num_attention_heads, as qwen2.rs, phi3.rs and olmo2.rs take it (a `head_dim` key is
        not read: said where transformers would read another)."""
        head_dim = self["hidden_size"] // self["num_attention_heads"]
        given = self.config.get("head_dim")
        if given is not None and given != head_dim:
            self.notes.append(f"candle's {self.file} takes head_dim = hidden_size / num_attention_heads = "
                              f"{head_dim}; config.json's head_dim ({given}) is not read")
        return head_dim

    def no_rope_scaling(self) -> None:
        """The files that read no rope scaling: a config that scales RoPE rotates unscaled there."""
        scaling = self.config.get("rope_scaling")
        params = [self.config.get("rope_parameters") or {}]
        params += [p for p in params[0].values() if isinstance(p, dict)] if isinstance(params[0], dict) else []
        kinds = {p.get("rope_type", p.get("type")) for p in [scaling or {}, *params] if isinstance(p, dict)}
        scaled = sorted(k for k in kinds if k not in (None, "default"))
        if scaled:
            self.notes.append(f"candle's {self.file} reads no rope scaling: this config's {', '.join(scaled)} "
                              "scaling is not applied (RoPE rotates unscaled)")


@dataclass(frozen=True)
class ModelFile:
    """One candle-transformers model file: its serde `Config` and how its forward is built from it
    (`build(read)` -> the engine's `Shape` fields beyond the sizes)."""

    name: str
    fields: dict[str, Field]
    build: Callable[[Read], dict]
    f32_rope: bool = False  # `1f32 / theta.powf(i as f32 / D as f32)` (mistral.rs); else the f64 pow

    def read(self, config: dict) -> tuple[dict, list[str], list[str]]:
        """(the Shape fields, the notes, the keys not read) of `config` as this file reads it."""
        values, notes = {}, []
        for key, declared in self.fields.items():
            value = config.get(key)
            if value is None and declared.default is OPTION:
                values[key] = None
                continue
            if key not in config and declared.default is not REQUIRED:
                values[key] = declared.default
                continue
            if value is None and key in MOVED and MOVED[key](config) is not None:
                value = MOVED[key](config)
                notes.append(f"candle's {self.name} requires a top-level {key}, which this config.json keeps under "
                             f"{MOVED_FROM[key]} only (as transformers 5 writes it): candle itself refuses the file; "
                             f"read from there ({value:g}), as a port that copies the key back runs")
            elif key not in config:
                raise TracerError(f"candle 0.11 cannot parse config.json: missing field `{key}` ({self.name})")
            elif value is None:
                raise TracerError(f"candle 0.11 cannot parse config.json: `{key}` is null, {self.name} reads a "
                                  f"{declared.kind}")
            values[key] = CHECKS[declared.kind](key, value)
        read = Read(self.name, config, values, notes)
        built = self.build(read)
        unread = sorted(k for k in config if k not in self.fields and k not in NON_FORWARD_KEYS)
        return built, read.notes, unread


def _sizes(read: Read, head_dim: int, activation: str = "hidden_act") -> dict:
    """What every file reads alike: the sizes, eps, theta and the MLP's activation (`activation`: its key)."""
    heads, kv_heads = read["num_attention_heads"], read["num_key_value_heads"]
    if heads % kv_heads:  # repeat_kv's groups
        raise TracerError(f"config.json key 'num_key_value_heads' must divide num_attention_heads ({heads}), "
                          f"got {kv_heads}")
    return {"num_layers": read["num_hidden_layers"], "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "hidden": read["hidden_size"], "vocab_size": read["vocab_size"],
            "max_positions": read["max_position_embeddings"], "eps": read["rms_norm_eps"],
            "theta": read["rope_theta"], "act": read[activation]}


def _every_layer(read: Read, window: int | None) -> tuple:
    """The same window (candle's: a query sees its key and the `window` before it) on every layer."""
    return () if window is None else (window,) * read["num_hidden_layers"]


def _window_note(read: Read, window: int | None, which: str = "every layer") -> None:
    if window is not None:
        read.notes.append(f"candle's {read.file} masks {which} to the last sliding_window + 1 = {window + 1} keys "
                          f"(`j + sliding_window < i` blocked; transformers keeps sliding_window = {window})")


def _lm_head_from_config(read: Read) -> str:
    return "embed" if read["tie_word_embeddings"] else "lm_head"


# --- the files ------------------------------------------------------------------------------------

_SIZES = {key: Field("usize") for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}


def _qwen2(read: Read) -> dict:
    window = read["sliding_window"]
    _window_note(read, window, "every layer")
    read.notes.append(f"candle's qwen2.rs reads use_sliding_window ({str(read['use_sliding_window']).lower()}) and "
                      f"max_window_layers ({read['max_window_layers']}) and uses neither; it takes lm_head.weight "
                      "where the file has one, whatever tie_word_embeddings says")
    read.no_rope_scaling()
    return {**_sizes(read, read.head_dim_derived()), "biases": frozenset({Q_PROJ, K_PROJ, V_PROJ}),
            "windows": _every_layer(read, window), "lm_head": "lm_head if present"}


QWEN2 = ModelFile("qwen2.rs", {
    **_SIZES, "sliding_window": Field("usize"), "max_window_layers": Field("usize"),
    "tie_word_embeddings": Field("bool"), "rope_theta": Field("f64"), "rms_norm_eps": Field("f64"),
    "use_sliding_window": Field("bool"), "hidden_act": Field("activation"),
}, _qwen2)


def _qwen3(read: Read) -> dict:
    if read["use_sliding_window"]:  # Qwen3Attention::new bails before anything runs
        raise TracerError("candle refused: sliding window is not supported (qwen3.rs, use_sliding_window is true)")
    read.no_rope_scaling()
    read.notes.append(QWEN3_FLASH)
    return {**_sizes(read, read["head_dim"]), "biases": ALL_PROJECTIONS if read["attention_bias"] else frozenset(),
            "qk_norm": "per_head", "lm_head": _lm_head_from_config(read)}


def flash_note(file: str, standard: str) -> str:
    """What a file that calls candle_nn's fused CPU flash attention on a CPU (qwen3.rs' `forward_cpu_flash_attn`,
    quantized_qwen3.rs) is composed by: 0.4.2 lacks the kernel, and its online softmax is not composed here."""
    return (f"candle's {file} runs candle_nn's fused CPU flash attention on a CPU (an online softmax: no scores or "
            f"probs exist there); composed here is its standard path ({standard}): matmul, scale, additive causal "
            "mask, softmax_last_dim, matmul")


QWEN3_FLASH = flash_note("qwen3.rs", "`forward_standard_attn`, what it runs on a GPU without flash-attn")


QWEN3 = ModelFile("qwen3.rs", {
    **_SIZES, "head_dim": Field("usize"), "attention_bias": Field("bool"), "sliding_window": Field("usize", OPTION),
    "max_window_layers": Field("usize"), "tie_word_embeddings": Field("bool"), "rope_theta": Field("f64"),
    "rms_norm_eps": Field("f64"), "use_sliding_window": Field("bool"), "hidden_act": Field("activation"),
}, _qwen3)


def _mistral(read: Read) -> dict:
    if read["use_flash_attn"]:  # mistral.rs' flash_attn without the feature: `unimplemented!`
        raise TracerError("candle refused: mistral.rs with use_flash_attn needs candle's CUDA flash-attn feature")
    window = read["sliding_window"]
    _window_note(read, window)
    if "sliding_window" not in read.config:  # Option<usize>: absent is no window
        read.notes.append("candle's mistral.rs reads an absent sliding_window as no window (transformers: 4096)")
    if read.config.get("tie_word_embeddings"):
        read.notes.append("candle's mistral.rs always loads lm_head.weight: tie_word_embeddings is not read")
    read.no_rope_scaling()
    head_dim = read["head_dim"] or read["hidden_size"] // read["num_attention_heads"]
    return {**_sizes(read, head_dim), "windows": _every_layer(read, window), "lm_head": "lm_head"}


MISTRAL = ModelFile("mistral.rs", {
    **_SIZES, "num_attention_heads": Field("usize", 32), "head_dim": Field("usize", OPTION),
    "hidden_act": Field("activation", "silu"), "rms_norm_eps": Field("f64"), "rope_theta": Field("f64"),
    "sliding_window": Field("usize", OPTION), "use_flash_attn": Field("bool", False),
}, _mistral, f32_rope=True)


def _gemma_common(read: Read) -> dict:
    head_dim, scalar = read["head_dim"], read["query_pre_attn_scalar"]
    if scalar != head_dim:
        read.notes.append(f"candle's {read.file} scales scores by 1/sqrt(head_dim) = 1/sqrt({head_dim}); "
                          f"query_pre_attn_scalar ({scalar}) is read and not used")
    if not read.config.get("tie_word_embeddings", True):
        read.notes.append(f"candle's {read.file} multiplies the last hidden state by embed_tokens: this untied "
                          "model's lm_head.weight is not read")
    read.no_rope_scaling()
    return {**_sizes(read, head_dim, "hidden_activation"), "norm": "gemma", "placement": SANDWICH,
            "embed_scale": math.sqrt(read["hidden_size"]),
            "biases": ALL_PROJECTIONS if read["attention_bias"] else frozenset(),
            "attn_softcap": read["attn_logit_softcapping"], "final_softcap": read["final_logit_softcapping"],
            "lm_head": "embed"}


def _gemma2(read: Read) -> dict:
    window = read["sliding_window"]
    _window_note(read, window)
    for key, default in GEMMA2_CAPS.items():  # Option<f64>: an absent cap is no cap
        if key not in read.config:
            read.notes.append(f"candle's gemma2.rs reads an absent {key} as no cap (transformers: {default:g})")
    return {**_gemma_common(read), "windows": _every_layer(read, window)}


_GEMMA = {key: Field("usize") for key in ("head_dim", "hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_hidden_layers", "num_key_value_heads", "vocab_size",
                                         "query_pre_attn_scalar")}
_GEMMA.update({"attention_bias": Field("bool"), "hidden_activation": Field("activation"),
               "rms_norm_eps": Field("f64"), "rope_theta": Field("f64"),
               "final_logit_softcapping": Field("f64", OPTION), "attn_logit_softcapping": Field("f64", OPTION)})

GEMMA2_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # transformers' defaults
GEMMA2 = ModelFile("gemma2.rs", {
    **_GEMMA, "sliding_window": Field("usize", OPTION), "max_position_embeddings": Field("usize", 4096),
}, _gemma2)


def _gemma3(read: Read) -> dict:
    pattern, window = read["sliding_window_pattern"], read["sliding_window"]
    windows = tuple(window if (i + 1) % pattern else None for i in range(read["num_hidden_layers"]))
    types = read.config.get("layer_types")
    if isinstance(types, list) and [t == "sliding_attention" for t in types] != [w is not None for w in windows]:
        read.notes.append(f"candle's gemma3.rs makes every layer but each sliding_window_pattern-th ({pattern}) a "
                          "sliding one (window and local RoPE); config.json's layer_types, which says otherwise, "
                          "is not read")
    _window_note(read, window, "its sliding layers")
    return {**_gemma_common(read), "windows": windows, "qk_norm": "gemma", "local_theta": read["rope_local_base_freq"]}


GEMMA3 = ModelFile("gemma3.rs", {
    **_GEMMA, "rope_local_base_freq": Field("f64"), "sliding_window": Field("usize"),
    "sliding_window_pattern": Field("usize"), "max_position_embeddings": Field("usize"),
}, _gemma3)


def _phi3(read: Read) -> dict:
    head_dim = read.head_dim_derived()
    factor = read["partial_rotary_factor"]
    if factor is None and "partial_rotary_factor" in _rope_parameters(read.config):
        read.notes.append("candle's phi3.rs reads partial_rotary_factor at top level only: this config.json keeps "
                          "it under rope_parameters, so every dim of a head rotates")
    if read.config.get("sliding_window") is not None:
        read.notes.append("candle's phi3.rs reads no sliding_window: every layer attends to the whole prefix")
    scaling = read["rope_scaling"]
    if scaling is None and _rope_parameters(read.config).get("rope_type") == "longrope":
        read.notes.append("candle's phi3.rs reads its longrope from a top-level rope_scaling only: this config.json "
                          "keeps it under rope_parameters (as transformers 5 writes it), so RoPE rotates unscaled")
    elif scaling is None:
        read.no_rope_scaling()
    else:
        read.notes.append("candle's phi3.rs rotates positions before original_max_position_embeddings with the short "
                          "factors and later ones with the long, and applies no attention factor")
    return {**_sizes(read, head_dim), "fused": True, "lm_head": _lm_head_from_config(read),
            # `(v * head_dim as f64) as usize`: truncated
            "rotary_dim": None if factor is None else int(factor * head_dim), "longrope": scaling,
            "original_max": read["original_max_position_embeddings"]}


PHI3 = ModelFile("phi3.rs", {
    **_SIZES, "hidden_act": Field("activation"), "rms_norm_eps": Field("f64"), "rope_theta": Field("f64"),
    "bos_token_id": Field("u32", OPTION), "eos_token_id": Field("u32", OPTION),
    "rope_scaling": Field("rope_scaling", OPTION), "original_max_position_embeddings": Field("usize", OPTION),
    "partial_rotary_factor": Field("f64", OPTION), "tie_word_embeddings": Field("bool", False),
}, _phi3)


def _olmo2(read: Read) -> dict:
    if read["clip_qkv"] is not None:
        read.notes.append(f"candle's olmo2.rs reads clip_qkv ({read['clip_qkv']:g}) and does not clip")
    read.no_rope_scaling()
    return {**_sizes(read, read.head_dim_derived()), "biases": ALL_PROJECTIONS if read["attention_bias"] else
            frozenset(), "qk_norm": "whole", "placement": POST_NORM, "lm_head": _lm_head_from_config(read)}


OLMO2 = ModelFile("olmo2.rs", {
    **_SIZES, "attention_bias": Field("bool"), "rms_norm_eps": Field("f64"), "hidden_act": Field("activation"),
    "rope_theta": Field("f64"), "tie_word_embeddings": Field("bool"), "clip_qkv": Field("f64", OPTION),
}, _olmo2)

# tracer's family -> the file candle-transformers runs it with (llama.rs: `tracer.model.config.read_candle`).
MODEL_FILES = {"qwen2": QWEN2, "qwen3": QWEN3, "mistral": MISTRAL, "gemma2": GEMMA2, "gemma3": GEMMA3, "phi3": PHI3,
               "olmo2": OLMO2}
