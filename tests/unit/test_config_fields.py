"""A family reads its own config: `tracer/model/config.py` holds the sizes every family shares and the
shared checkers, and no family's reader or field. Each component declares the config keys it reads
(`ConfigField`), its spec attributes with their value where no config sets them (`spec_fields`), and
a `read_config` where a value needs logic; a made-up family with a field of its own is read, audited,
checked and replaced without config.py naming it. No model is built here: config dicts only."""

from __future__ import annotations

import ast
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from tracer.core.errors import TracerError
from tracer.model.component import (
    ConfigField,
    register,
    registered,
    spec_field_defaults,
    spec_properties,
    unregister,
)
from tracer.model.components.attention import Attention, EveryLayerWindow
from tracer.model.config import REQUIRED, FamilyConfig, LlamaSpec, audit, read_candle, read_hf, variant_spec
from tracer.model.families import LLAMA

CONFIG_PY = Path(__file__).resolve().parents[2] / "tracer" / "model" / "config.py"
# RoPE's keys as transformers' `standardize_rope_params` reads them for every family (the shared
# `hf_rope`), and candle's reader's own: config.py reads these for every family it reads.
SHARED_KEYS = {"rope_parameters", "rope_theta", "rope_scaling", "original_max_position_embeddings",
               "partial_rotary_factor"}
MINIMAL = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)


def family_names() -> set[str]:
    """Every name a registered family's components declare: config keys, spec attributes, derived ones."""
    names = {declared.key for family in registered().values() for declared in family.config_fields()}
    return (names | set(spec_field_defaults()) | set(spec_properties())) - SHARED_KEYS - {
        f.name for f in fields(LlamaSpec)}


def names_in_code(source: str) -> dict[str, int]:
    """Every identifier, attribute, keyword and string constant of a module (docstrings left out) -> its line."""
    tree = ast.parse(source)
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = {}
    for node in ast.walk(tree):
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.arg if isinstance(node, ast.keyword) else node.value
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs else None)
        if name is not None:
            found.setdefault(name, node.lineno)
    return found


def family_readers(source: str) -> list[str]:
    """The functions named as one family's reader (`gemma2_extras`)."""
    return [node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)
            and node.name.endswith("_extras")]


def test_config_py_has_no_family_reader_and_names_no_familys_field():
    assert family_readers(CONFIG_PY.read_text()) == []
    declared = family_names()
    assert {"sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping", "use_sliding_window",
            "rope_local_theta", "qkv_bias", "mlp_bias"} <= declared  # what the scan looks for
    named = names_in_code(CONFIG_PY.read_text())
    assert {name: line for name, line in named.items() if name in declared} == {}
    assert {f.name for f in fields(LlamaSpec)} == {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "max_position_embeddings",
        "tie_word_embeddings", "hidden_act", "rope_scaling", "family", "extra", "unused_keys"}


def test_the_scan_sees_a_familys_field():
    source = '"""Doc naming sliding_window."""\ndef gemma_extras(config):\n    return config.get("sliding_window")\n'
    assert names_in_code(source)["sliding_window"] == 3 and family_readers(source) == ["gemma_extras"]
    assert "Doc naming sliding_window." not in names_in_code(source)


# --- a made-up family with a config field of its own ---------------------------------------------------


@dataclass(frozen=True)
class ClampedAttention(Attention):
    """A made-up attention that clamps its scores at `attn_clamp` (a plain field), and reads a window
    given in tokens or as a fraction of max_position_embeddings (a field that needs logic)."""

    config_fields = (ConfigField("attn_clamp", 30.0, "optional_number"),)
    spec_fields = {"attn_clamp": None}


@dataclass(frozen=True)
class FractionWindow(EveryLayerWindow):
    config_fields = (ConfigField("window_fraction", None, ""),)

    def read_config(self, config: dict) -> dict:
        fraction = config.get("window_fraction")
        if fraction is None:
            return {"sliding_window": None, "layer_types": None}
        if not isinstance(fraction, float) or not 0 < fraction <= 1:
            raise TracerError(f"config.json: window_fraction must be in (0, 1], got {fraction}")
        window = int(fraction * config.get("max_position_embeddings", 2048))
        return {"sliding_window": window, "layer_types": ("sliding_attention",) * config["num_hidden_layers"]}


MADE_UP = LLAMA.derive(name="clamped", title="Clamped", model_types=("clamped",), adds="clamped scores",
                       attention=ClampedAttention(window=FractionWindow()),
                       config=FamilyConfig(rms_norm_eps=1e-5))


@pytest.fixture
def clamped():
    register(MADE_UP)
    yield MADE_UP.name
    unregister(MADE_UP.name)


def test_a_made_up_family_reads_its_own_fields(clamped):
    config = {**MINIMAL, "model_type": "clamped", "window_fraction": 0.25, "max_position_embeddings": 64}
    spec = read_hf(config)
    assert (spec.family, spec.attn_clamp, spec.sliding_window, spec.window(2)) == ("clamped", 30.0, 16, 16)
    assert read_hf({**config, "attn_clamp": None}).attn_clamp is None
    assert spec.rms_norm_eps == 1e-5 and spec.unused_keys == ()
    with pytest.raises(TracerError, match=r"^config.json: attn_clamp must be a positive finite number, got -1$"):
        read_hf({**config, "attn_clamp": -1})
    with pytest.raises(TracerError, match=r"^config.json: window_fraction must be in \(0, 1\], got 2$"):
        read_hf({**config, "window_fraction": 2})
    hf = audit({**config, "attn_clamp": 8.0})["readers"]["hf"]
    assert {"attn_clamp", "window_fraction"} <= set(hf["reads"]) and hf["spec"]["attn_clamp"] == 8.0
    assert "attn_clamp" in audit(config)["readers"]["hf"]["defaulted"]


def test_a_made_up_fields_feature_off_value_holds_in_every_other_family(clamped):
    llama = read_hf({**MINIMAL, "model_type": "llama"})
    assert llama.attn_clamp is None and "attn_clamp" not in llama.extra  # declared off, not stored
    assert read_candle({**MINIMAL, "rms_norm_eps": 1e-5, "max_position_embeddings": 64}).attn_clamp is None
    capped = read_hf({**MINIMAL, "model_type": "clamped"})
    assert capped.extra["attn_clamp"] == 30.0 and "attn_clamp" not in capped.replace(attn_clamp=None).extra


def test_a_required_field_of_a_made_up_component_is_one_line():
    register(LLAMA.derive(name="tagged", model_types=("tagged",),
                          attention=Attention(fields=(ConfigField("num_tags", REQUIRED),))))
    try:
        assert read_hf({**MINIMAL, "model_type": "tagged", "num_tags": 3}).num_tags == 3
        with pytest.raises(TracerError, match=r"^config.json: num_tags must be a positive integer, got 0$"):
            read_hf({**MINIMAL, "model_type": "tagged", "num_tags": 0})
        with pytest.raises(TracerError, match=r"^config.json lacks the required key 'num_tags'$"):
            read_hf({**MINIMAL, "model_type": "tagged"})
    finally:
        unregister("tagged")


def test_replace_reaches_a_components_fields_and_refuses_a_name_no_spec_has():
    mistral = {**MINIMAL, "model_type": "mistral", "num_key_value_heads": 2}
    spec = read_hf({**mistral, "sliding_window": 5})
    assert spec.replace(sliding_window=None).window(0) is None and spec.window(0) == 5
    assert spec.replace(sliding_window=None, layer_types=None) == read_hf({**mistral, "sliding_window": None})
    with pytest.raises(TypeError, match="no field 'sliding_windw'"):
        spec.replace(sliding_windw=3)
    # a config-level knob changes a component's field as it does a shared size
    gemma = {**MINIMAL, "model_type": "gemma3_text", "head_dim": 12}
    assert variant_spec(gemma, {"rope_local": "global"}).rope_local_theta == 1e6
    assert variant_spec({**MINIMAL, "attention_bias": True}, {"bias": "ignore"}) == read_hf(MINIMAL)


def test_a_spec_built_from_sizes_alone_reads_every_feature_off():
    spec = LlamaSpec(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=12, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=64)
    assert spec == read_hf({**MINIMAL, "num_key_value_heads": 2, "head_dim": 12, "rms_norm_eps": 1e-5,
                            "max_position_embeddings": 64})
    assert (spec.sliding_window, spec.attention_bias, spec.final_logit_softcapping, spec.rotary_dim) == (None, False,
                                                                                                        None, 12)
    assert spec.values()["partial_rotary_factor"] == 1.0
    with pytest.raises(AttributeError, match="no field 'num_tags'"):
        spec.num_tags  # noqa: B018 - the attribute read is the test
