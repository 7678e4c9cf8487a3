"""Config readers: transformers' reading, candle 0.11's serde reading, the transformers-5 re-save, the audit."""

import json

import pytest

from tracer import TracerError
from tracer.config import audit, load_config, read_candle, read_config, read_hf, resave_tf5
from tests.conftest import TINY

V4 = {"model_type": "llama", "hidden_act": "silu", "tie_word_embeddings": True, **TINY, "rope_theta": 100000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 4}


def test_both_readers_agree_on_a_transformers4_file():
    assert read_candle(V4) == read_hf(V4)
    assert read_hf(V4).rope_theta == 100000.0


def test_candle_misses_theta_in_rope_parameters_and_defaults_to_10000():
    v5 = {k: v for k, v in V4.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
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
