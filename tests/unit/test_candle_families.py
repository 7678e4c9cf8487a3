"""The candle engine on the other families candle-transformers 0.11 has: each model file's forward
(qwen2.rs, mistral.rs, gemma2.rs, gemma3.rs, phi3.rs; qwen3.rs and olmo2.rs are matrix cells that
match) against transformers where the file's own difference does not apply, and each file's serde
Config as it reads config.json. The differences themselves are the matrix's cells
(tests/unit/test_matrix.py)."""

import pytest

import tracer
from tests.conftest import TOKENS
from tests.families import WINDOW, family_config, write_tiny_family
from tracer import TracerError
from tracer.engines import candle as candle_engine
from tracer.engines.candle_models import MODEL_FILES
from tracer.files.sources import ModelSource
from tracer.model.points import layer_point


def config_of(family: str, **overrides) -> dict:
    """config.json as transformers 5 writes it for the tiny model of `family`."""
    return family_config(family, **overrides).to_dict()


# family -> (config overrides, prompt length) under which its file computes what transformers does: a prompt
# no longer than the window (qwen2.rs, mistral.rs, gemma2.rs and gemma3.rs keep one key more than it), Gemma's
# query_pre_attn_scalar equal to head_dim (gemma2.rs/gemma3.rs scale by head_dim), Gemma 3 tied (gemma3.rs
# multiplies by embed_tokens; the tiny one's sliding_window_pattern, 2, is its layer_types' period, as the
# hub's configs write theirs), Phi-3 without a window (phi3.rs reads none).
AGREE = {
    "qwen2": ({}, WINDOW),
    "mistral": ({}, WINDOW),
    "gemma2": ({"query_pre_attn_scalar": 12}, WINDOW),
    "gemma3": ({"query_pre_attn_scalar": 12, "tie_word_embeddings": True}, WINDOW),
    "phi3": ({"sliding_window": None}, len(TOKENS)),
}


@pytest.mark.parametrize("family", list(AGREE))
def test_each_file_matches_transformers_at_every_point_where_its_difference_does_not_apply(candle, family,
                                                                                            tmp_path):
    overrides, length = AGREE[family]
    model = write_tiny_family(tmp_path / family, family, **overrides)
    tokens = TOKENS[:length]
    reference = tracer.record(model, tokens, engine="hf")
    candidate = candle_engine.load(ModelSource(model), {}).record(tokens)
    assert list(candidate.tensors) == list(reference.tensors)  # every point transformers has, in its order
    result = tracer.compare(reference, candidate)
    assert result.verdict == "match", result.first_divergence
    assert max(p.rel_l2 for p in result.points if p.recorded) < 1e-5
    assert candidate.meta.candle["forward"] == MODEL_FILES[family].name


def test_a_window_one_key_longer_than_transformers_shows_on_the_first_query_past_it(candle, tmp_path):
    """mistral.rs masks `j + sliding_window < i`: sliding_window + 1 keys, so the first query that sees
    fewer keys in transformers (the window's + 1-th token) is where it diverges, not before."""
    model = write_tiny_family(tmp_path / "m", "mistral")
    tokens = TOKENS[:WINDOW + 1]
    result = tracer.compare(tracer.record(model, tokens, engine="hf"),
                            candle_engine.load(ModelSource(model), {}).record(tokens))
    assert result.first_divergence.point == layer_point(0, "self_attn.probs")


@pytest.mark.parametrize("family, said", [
    ("qwen2", "candle's qwen2.rs reads use_sliding_window (true) and max_window_layers (1) and uses neither"),
    ("qwen2", "masks every layer to the last sliding_window + 1 = 5 keys"),
    ("mistral", "candle's mistral.rs always loads lm_head.weight: tie_word_embeddings is not read"),
    ("gemma2", "scales scores by 1/sqrt(head_dim) = 1/sqrt(12); query_pre_attn_scalar (16) is read and not used"),
    ("gemma3", "config.json's layer_types, which says otherwise, is not read"),
    ("gemma3", "this untied model's lm_head.weight is not read"),
    ("gemma3", "requires a top-level sliding_window_pattern, which this config.json keeps under "
               "_sliding_window_pattern only"),
    ("phi3", "candle's phi3.rs reads no sliding_window: every layer attends to the whole prefix"),
    ("olmo2", "candle's olmo2.rs requires a top-level rope_theta"),
])
def test_what_a_file_reads_and_does_otherwise_is_said(family, said):
    overrides = {"tie_word_embeddings": True} if family == "mistral" else {}
    config = config_of(family, **overrides)
    if family == "gemma3":  # as transformers 5 writes a Gemma 3 given no sliding_window_pattern of its own
        del config["sliding_window_pattern"]
        config["_sliding_window_pattern"] = 6
    _, notes, _ = MODEL_FILES[family].read(config)
    assert any(said in note for note in notes), notes


def test_the_keys_a_file_has_no_field_for_are_listed_as_not_read():
    _, _, unread = MODEL_FILES["phi3"].read(config_of("phi3"))
    assert "sliding_window" in unread and "rope_parameters" in unread and "partial_rotary_factor" not in unread


def test_phi3_reads_partial_rotary_factor_at_the_top_level_only():
    config = config_of("phi3")
    built, _, _ = MODEL_FILES["phi3"].read(config)
    assert built["rotary_dim"] == 6  # (0.5 * 12) as usize
    del config["partial_rotary_factor"]  # kept under rope_parameters only
    built, notes, _ = MODEL_FILES["phi3"].read(config)
    assert built["rotary_dim"] is None and any("every dim of a head rotates" in note for note in notes)


@pytest.mark.parametrize("family, change, said", [
    ("qwen2", {"vocab_size": None}, r"^candle 0.11 cannot parse config.json: `vocab_size` is null, qwen2.rs reads "
                                    r"a usize$"),
    ("olmo2", {"tie_word_embeddings": "yes"}, r"tie_word_embeddings.*true or false"),
    ("qwen3", {"use_sliding_window": True}, r"^candle refused: sliding window is not supported \(qwen3.rs"),
    ("mistral", {"use_flash_attn": True}, r"^candle refused: mistral.rs with use_flash_attn needs"),
    ("gemma2", {"hidden_activation": "swish"}, r"composes silu, relu, gelu and tanh-GELU; hidden_activation is "
                                               r"'swish'$"),
])
def test_a_config_its_file_cannot_run_is_one_line(family, change, said):
    with pytest.raises(TracerError, match=said) as refused:
        MODEL_FILES[family].read({**config_of(family), **change})
    assert "\n" not in str(refused.value) and len(str(refused.value)) <= 100


def test_a_required_key_missing_is_candles_own_parse_error():
    config = config_of("gemma2")
    del config["query_pre_attn_scalar"]
    with pytest.raises(TracerError, match=r"^candle 0.11 cannot parse config.json: missing field "
                                          r"`query_pre_attn_scalar` \(gemma2.rs\)$"):
        MODEL_FILES["gemma2"].read(config)


def test_llama_rs_config_knobs_are_refused_on_another_file(candle, tmp_path):
    model = write_tiny_family(tmp_path / "o", "olmo2")
    with pytest.raises(TracerError, match=r"^config= changes how llama.rs reads config.json; candle's olmo2.rs "
                                          r"reads its own Config$"):
        candle_engine.load(ModelSource(model), {"config": "hf"})


def test_mistral_reads_an_absent_window_as_none_where_transformers_takes_4096():
    config = config_of("mistral")
    del config["sliding_window"]
    built, notes, _ = MODEL_FILES["mistral"].read(config)
    assert built["windows"] == () and any("(transformers: 4096)" in note for note in notes)


def test_phi3_reads_longrope_from_a_top_level_rope_scaling_only():
    factors = {"short_factor": [1.0] * 3, "long_factor": [2.0] * 3}
    config = config_of("phi3")
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "longrope", **factors}
    built, notes, _ = MODEL_FILES["phi3"].read(config)
    assert built["longrope"] is None and any("rotates unscaled" in note for note in notes)
    built, _, _ = MODEL_FILES["phi3"].read({**config, "rope_scaling": {"type": "longrope", **factors}})
    assert built["longrope"]["long_factor"] == [2.0] * 3


def test_gemma2_without_a_final_cap_says_why_its_capped_logits_are_missing(candle, tmp_path):
    model = write_tiny_family(tmp_path / "g", "gemma2", query_pre_attn_scalar=12)
    config = model / "config.json"
    config.write_text(config.read_text().replace('"final_logit_softcapping": 10.0,', ""))  # transformers: 30
    tokens = TOKENS[:WINDOW]
    result = tracer.compare(tracer.record(model, tokens, engine="hf"),
                            candle_engine.load(ModelSource(model), {}).record(tokens))
    missing = {p.point: p.reason for p in result.points if p.missing_on == "candidate"}
    assert list(missing) == ["lm_head.softcap"] and "transformers caps at 30" in missing["lm_head.softcap"]
