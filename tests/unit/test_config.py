"""Config readers: transformers' reading, candle 0.11's serde reading, the transformers-5 re-save, the audit."""

import json
import math

import pytest

from tests.conftest import TINY
from tracer import TracerError
from tracer.model.config import (
    HF_ACTIVATIONS,
    HF_ROPE_TYPES,
    LlamaSpec,
    audit,
    load_config,
    read_candle,
    read_config,
    read_hf,
    resave_tf5,
)

V4 = {"model_type": "llama", "hidden_act": "silu", "tie_word_embeddings": True, **TINY, "rope_theta": 100000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 4}


def test_both_readers_agree_on_a_transformers4_file():
    assert read_candle(V4) == read_hf(V4)
    assert read_hf(V4).rope_theta == 100000.0


def test_candle_misses_theta_in_rope_parameters_and_defaults_to_10000():
    v5 = ({k: v for k, v in V4.items() if k != "rope_theta"}
          | {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}})
    assert read_hf(v5).rope_theta == 100000.0
    assert read_candle(v5).rope_theta == 10000.0
    assert "rope_parameters" in read_candle(v5).unused_keys


def test_candle_derives_head_dim_and_ignores_biases_and_activation():
    config = V4 | {"head_dim": 32, "attention_bias": True, "mlp_bias": True, "hidden_act": "gelu"}
    hf, candle = read_hf(config), read_candle(config)
    assert (hf.head_dim, candle.head_dim) == (32, 64 // 4)
    assert (hf.attention_bias, hf.mlp_bias, hf.hidden_act) == (True, True, "gelu")
    assert (candle.attention_bias, candle.mlp_bias, candle.hidden_act) == (False, False, "silu")


def test_candle_requires_what_serde_requires():
    config = {k: v for k, v in V4.items() if k != "rms_norm_eps"}
    assert read_hf(config).rms_norm_eps == 1e-6  # transformers' default
    with pytest.raises(TracerError, match="candle 0.11 cannot parse config.json: missing field `rms_norm_eps`"):
        read_candle(config)


def test_candle_reads_llama3_scaling_only():
    assert read_candle(V4 | {"rope_scaling": LLAMA3}).rope_scaling == LLAMA3
    assert read_candle(V4 | {"rope_scaling": None}).rope_scaling is None
    with pytest.raises(TracerError, match="reads Llama-3 parameters only"):
        read_candle(V4 | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})


def test_resave_matches_what_transformers5_save_pretrained_writes(tmp_path):
    from transformers import AutoConfig

    for scaling in (None, LLAMA3):
        original = V4 | {"rope_scaling": scaling}
        (tmp_path / "config.json").write_text(json.dumps(original))
        AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "saved")
        saved = load_config(tmp_path / "saved")
        ours = resave_tf5(original)
        assert "rope_theta" not in ours and "rope_scaling" not in ours
        assert "rope_theta" not in saved and "rope_scaling" not in saved
        assert ours["rope_parameters"] == saved["rope_parameters"]
        assert ours["head_dim"] == saved["head_dim"]
        assert read_hf(ours) == read_hf(saved) == read_hf(original)


def test_read_config_picks_reader_and_resave():
    assert read_config(V4, {"config": "candle", "resave": "tf5"}).rope_theta == 10000.0
    assert read_config(V4, {"resave": "tf5"}).rope_theta == 100000.0
    assert read_config(V4, {"config": "candle"}).rope_theta == 100000.0


def test_audit_lists_reads_defaults_ignores_and_differences():
    report = audit(V4 | {"head_dim": 16}, resave="tf5")
    candle, hf = report["readers"]["candle"], report["readers"]["hf"]
    assert set(candle["reads"]) <= {"hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                                    "bos_token_id", "eos_token_id", "rope_scaling", "max_position_embeddings",
                                    "tie_word_embeddings"}
    assert candle["defaulted"]["rope_theta"] == 10000.0
    assert {"rope_parameters", "head_dim", "hidden_act"} <= set(candle["ignored"])
    assert "rope_parameters" in hf["reads"] and "rope_theta" not in hf["defaulted"]
    assert report["differences"] == {"rope_theta": {"hf": 100000.0, "candle": 10000.0}}
    assert audit(V4)["differences"] == {}


def test_audit_reports_a_reader_that_cannot_parse():
    report = audit({k: v for k, v in V4.items() if k != "max_position_embeddings"})
    assert "max_position_embeddings" in report["readers"]["candle"]["error"]
    assert report["readers"]["hf"]["error"] is None
    assert report["readers"]["hf"]["defaulted"]["max_position_embeddings"] == 2048


def test_cli_config_prints_the_audit(tiny_llama, capsys):
    from tracer.cli import main

    model = tiny_llama("m", rope_theta=500.0, rope_format="v5")
    assert main(["config", "--model", str(model), "--json", "-"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["differences"]["rope_theta"] == {"hf": 500.0, "candle": 10000.0}
    assert main(["config", "--model", str(model)]) == 0
    text = capsys.readouterr().out
    assert "candle reader:" in text and "rope_theta hf 500.0, candle 10000.0" in text


# --- malformed values --------------------------------------------------------------------------
# The CLI rows in test_user_errors.py show one value per kind of check end to end; here every kind,
# through both readers, as a TracerError whose one line names the key and the value as written.

READERS = {"hf": read_hf, "candle": read_candle}
NUMBER, FLOAT, INTEGER, FLAG = ("a positive finite number", "a positive finite float such as 1e-05",
                                "a positive integer", "true or false")
BOTH_REFUSE = [  # (key, value, what it must be; the candle reader's wording where it differs)
    ("rope_theta", "abc", NUMBER), ("rope_theta", None, NUMBER), ("rope_theta", True, NUMBER),
    ("rope_theta", 0, NUMBER), ("rope_theta", -1.5, NUMBER), ("rope_theta", math.nan, NUMBER),
    ("rope_theta", math.inf, NUMBER),
    ("rms_norm_eps", None, (FLOAT, NUMBER)), ("rms_norm_eps", 0.0, (FLOAT, NUMBER)),
    ("rms_norm_eps", -1e-5, (FLOAT, NUMBER)), ("rms_norm_eps", "1e-5", (FLOAT, NUMBER)),
    ("rms_norm_eps", math.nan, (FLOAT, NUMBER)),
    ("max_position_embeddings", "x", INTEGER), ("max_position_embeddings", None, INTEGER),
    ("max_position_embeddings", 128.0, INTEGER), ("max_position_embeddings", 0, INTEGER),
    ("num_key_value_heads", "2", INTEGER), ("num_key_value_heads", 2.0, INTEGER),
    ("num_key_value_heads", 0, INTEGER), ("num_key_value_heads", True, INTEGER),
    ("num_key_value_heads", 3, "a divisor of num_attention_heads (4)"),
    ("num_key_value_heads", 8, "a divisor of num_attention_heads (4)"),
    ("vocab_size", 97.0, INTEGER), ("num_hidden_layers", -2, INTEGER),
    ("tie_word_embeddings", "no", FLAG), ("tie_word_embeddings", 1, FLAG),
    ("rope_scaling", "linear", "an object or null"), ("rope_scaling", [8.0], "an object or null"),
]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("key, value, expected", BOTH_REFUSE, ids=lambda v: json.dumps(v)[:30])
def test_both_readers_refuse_a_malformed_value_in_one_line(reader, key, value, expected):
    expected = expected if isinstance(expected, str) else dict(zip(READERS, expected))[reader]
    with pytest.raises(TracerError) as raised:
        READERS[reader](V4 | {key: value})
    assert str(raised.value) == f"config.json: {key} must be {expected}, got {json.dumps(value)}"


@pytest.mark.parametrize("reader", READERS)
def test_a_huge_value_is_cut_short_in_the_message(reader):
    """An integer too large for a float (json reads 10**400 exactly) is not finite; the line stays short."""
    with pytest.raises(TracerError) as raised:
        READERS[reader](V4 | {"rope_theta": 10**400})
    assert str(raised.value) == f"config.json: rope_theta must be {NUMBER}, got 1{'0' * 76}..."


HF_REFUSES = [  # keys only transformers reads, and its stricter types; (.., what candle reads instead)
    ("head_dim", 0, "an even positive integer (RoPE rotates pairs)", {}),
    ("head_dim", 15, "an even positive integer (RoPE rotates pairs)", {}),
    ("head_dim", "16", "an even positive integer (RoPE rotates pairs)", {}),
    ("attention_bias", "false", FLAG, {}), ("mlp_bias", 0, FLAG, {}),
    ("hidden_act", 5, "an activation transformers knows", {}),
    ("hidden_act", "zzz", "an activation transformers knows", {}),
    ("rope_parameters", [10000.0], "an object or null", {}),
    ("tie_word_embeddings", None, FLAG, {"tie_word_embeddings": False}),  # Option<bool>: null is false
    ("rms_norm_eps", 1, FLOAT, {"rms_norm_eps": 1.0}),  # serde's f64 takes an integer
]


def test_a_misspelt_activation_is_named_not_listed_with_every_other():
    with pytest.raises(TracerError) as raised:
        read_hf(V4 | {"hidden_act": "swishy"})
    assert str(raised.value) == ('config.json: hidden_act must be an activation transformers knows, got "swishy"; '
                                 "did you mean swish?")
    assert len(", ".join(HF_ACTIVATIONS)) > 150  # what listing them all would add to the line


@pytest.mark.parametrize("key, value, expected, candle_reads", HF_REFUSES, ids=lambda v: json.dumps(v)[:30])
def test_hf_reader_refuses_what_transformers_cannot_load_and_candle_reads_its_way(key, value, expected,
                                                                                   candle_reads):
    with pytest.raises(TracerError) as raised:
        read_hf(V4 | {key: value})
    assert str(raised.value) == f"config.json: {key} must be {expected}, got {json.dumps(value)}"
    assert read_candle(V4 | {key: value}) == read_candle(V4).replace(**candle_reads)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "linear"}}, "config.json: rope_scaling lacks 'factor', which "
                                                "rope_type 'linear' requires"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": "2"}},
     "config.json: rope_scaling.factor must be a positive finite number, got \"2\""),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
     "config.json: rope_parameters lacks 'low_freq_factor', which rope_type 'llama3' requires"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}},
     "config.json: rope_parameters.rope_theta must be a positive finite number, got \"abc\""),
    ({"rope_scaling": {"rope_type": "weird"}},
     "config.json: rope_scaling.rope_type must be a rope type transformers knows "
     f"({', '.join(sorted(HF_ROPE_TYPES))}), got \"weird\""),
    ({"rope_scaling": {"type": 3}}, "config.json: rope_scaling.type must be a rope type transformers knows "
                                    f"({', '.join(sorted(HF_ROPE_TYPES))}), got 3"),
    ({"hidden_size": 60}, "config.json keys 'hidden_size' (60) and 'num_attention_heads' (4) give head_dim 15; "
                          "RoPE needs an even positive head_dim"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5},
     "config.json: hidden_size must be a multiple of num_attention_heads (5), got 64"),
])
def test_hf_reader_refuses_malformed_rope_and_shapes(change, message):
    with pytest.raises(TracerError) as raised:
        read_hf(V4 | change)
    assert str(raised.value) == message


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("scaling, message", [
    (LLAMA3 | {"factor": 0}, "config.json: rope_scaling.factor must be a positive finite number, got 0"),
    (LLAMA3 | {"low_freq_factor": None},
     "config.json: rope_scaling.low_freq_factor must be a positive finite number, got null"),
    (LLAMA3 | {"high_freq_factor": 1.0},
     "config.json: rope_scaling.high_freq_factor must be greater than low_freq_factor (1.0), got 1.0"),
    (LLAMA3 | {"original_max_position_embeddings": 4.0},
     "config.json: rope_scaling.original_max_position_embeddings must be a positive integer, got 4.0"),
])
def test_both_readers_refuse_llama3_values_the_formula_divides_by(reader, scaling, message):
    with pytest.raises(TracerError) as raised:
        READERS[reader](V4 | {"rope_scaling": scaling})
    assert str(raised.value) == message


def test_candle_requires_rope_type_in_rope_scaling():
    """serde has no default for `Llama3RopeConfig.rope_type`; transformers reads its absence as default."""
    untyped = {k: v for k, v in LLAMA3.items() if k != "rope_type"}
    with pytest.raises(TracerError, match="candle 0.11 cannot parse rope_scaling"):
        read_candle(V4 | {"rope_scaling": untyped})
    assert read_hf(V4 | {"rope_scaling": untyped}).rope_scaling is None


def test_well_formed_values_still_read():
    """No over-strict regressions: an integer theta, factors written as integers, and the nulls each
    reader treats as absent."""
    config = V4 | {"rope_theta": 10000, "rms_norm_eps": 1e-5}
    for reader in READERS.values():
        spec = reader(config)
        assert spec.rope_theta == 10000.0 and isinstance(spec.rope_theta, float) and spec.rms_norm_eps == 1e-5
        assert reader(V4 | {"num_key_value_heads": None}).num_key_value_heads == 4
        assert reader(V4 | {"rope_scaling": LLAMA3 | {"factor": 8, "high_freq_factor": 4}}).rope_scaling == LLAMA3
    assert read_hf(V4 | {"head_dim": None}).head_dim == 16
    assert read_candle(V4 | {"rms_norm_eps": 1}).rms_norm_eps == 1.0  # serde's f64 takes an integer
    assert read_candle(V4 | {"tie_word_embeddings": None}).tie_word_embeddings is False  # Option<bool>
    assert read_hf(V4 | {"rope_scaling": {"type": "linear", "factor": 2}}).rope_scaling == {"rope_type": "linear",
                                                                                             "factor": 2.0}
    # transformers knows it (the reimpl engine refuses it when it checks the weights)
    assert read_hf(V4 | {"hidden_act": "gelu_pytorch_tanh"}).hidden_act == "gelu_pytorch_tanh"
    # transformers fills a missing original_max_position_embeddings from max_position_embeddings
    no_original = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    assert (read_hf(V4 | {"rope_scaling": no_original}).rope_scaling
            == LLAMA3 | {"original_max_position_embeddings": 128})


def test_name_lists_are_the_installed_transformers():
    from transformers.activations import ACT2CLS
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert HF_ACTIVATIONS == set(ACT2CLS)
    assert HF_ROPE_TYPES == {"default", *ROPE_INIT_FUNCTIONS}


SMOLLM2 = LlamaSpec(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True)


def test_bundled_smollm2_config_reads_as_before(default_model, capsys):
    from tracer.cli import main

    config = load_config(default_model)
    assert read_hf(config) == read_candle(config) == SMOLLM2
    assert audit(config)["differences"] == {}
    assert audit(config, resave="tf5")["differences"] == {"rope_theta": {"hf": 100000.0, "candle": 10000.0}}
    assert main(["config", "--model", str(default_model)]) == 0
    assert "error" not in capsys.readouterr().out.lower()
