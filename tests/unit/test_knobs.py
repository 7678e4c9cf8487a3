"""Every knob of the catalogue on tiny random Llamas: where it first shows, on which engines, combined."""

import json

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tracer import TracerError
from tracer.engines.registry import engines_honouring
from tracer.model.components.attention import mask_additive, mask_where, repeat_kv, repeat_kv_tile
from tracer.model.components.rope import rope_half, rope_interleaved
from tracer.model.knobs import KNOBS, PRESETS, expand_presets

LLAMA3 = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 4})
L0 = "model.layers.0."


# --- the strategies on small literal tensors ---------------------------------------------------


def test_kv_repeat_orders_are_the_notes_orders():
    kv = torch.arange(3.0).reshape(1, 3, 1, 1)  # kv heads 0, 1, 2, as in the porting notes
    assert repeat_kv(kv, 3).flatten().tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # HF and candle
    assert repeat_kv_tile(kv, 3).flatten().tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]  # torch.cat order


def test_rope_interleaved_rotates_adjacent_pairs_and_half_rotates_split_pairs():
    angle = torch.tensor(0.5)
    # D = 4: two frequencies; put angle on frequency 0 and 0 on frequency 1 (cos/sin in half-split layout)
    cos = torch.stack([angle.cos(), torch.tensor(1.0), angle.cos(), torch.tensor(1.0)])[None, None]  # (1, 1, D)
    sin = torch.stack([angle.sin(), torch.tensor(0.0), angle.sin(), torch.tensor(0.0)])[None, None]
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)  # (1, heads, T, D)
    c, s = angle.cos(), angle.sin()
    # interleaved: pair (x0, x1) rotated by the angle, pair (x2, x3) by 0
    expected_i = torch.stack([1 * c - 2 * s, 1 * s + 2 * c, torch.tensor(3.0), torch.tensor(4.0)])
    torch.testing.assert_close(rope_interleaved(x, cos, sin).flatten(), expected_i)
    # half-split: pair (x0, x2) rotated by the angle, pair (x1, x3) by 0
    expected_h = torch.stack([1 * c - 3 * s, torch.tensor(2.0), 1 * s + 3 * c, torch.tensor(4.0)])
    torch.testing.assert_close(rope_half(x, cos, sin).flatten(), expected_h)


def test_where_mask_and_additive_mask_give_the_same_softmax():
    scores = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    additive = torch.softmax(mask_additive(scores), -1)
    where = torch.softmax(mask_where(scores), -1)
    assert torch.equal(additive, where)
    assert where.triu(1).abs().max() == 0


# --- first divergence of each knob (reimpl vs hf, f32) -----------------------------------------

# Each knob changes one operation; the first point that differs is the first output of that operation.
FIRST = {
    "theta=500": L0 + "self_attn.q_rope",  # the rotation angles
    "rope=interleaved": L0 + "self_attn.q_rope",  # the pairing of dims inside RoPE
    "kv_repeat=tile": L0 + "self_attn.scores",  # k after repeat is not a point: scores are the first to see it
    "mask=none": L0 + "self_attn.probs",  # scores are recorded before the mask
    "eps=1e-3": L0 + "input_layernorm",  # the first RMSNorm
    "dtype=bf16": "model.embed_tokens",  # the embedding table itself is rounded
    "theta=500,rope=interleaved": L0 + "self_attn.q_rope",
}
# Same maths, different rounding or shape: within the default tolerance.
MATCH = ["mask=where", "attn=sdpa", "attn_math=candle", "norm=candle", "logits=last", "config=candle",
         "config=candle,resave=tf5", "preset=candle", "bias=ignore", "rope_scaling=drop"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import write_tiny_llama

    model = write_tiny_llama(tmp_path_factory.mktemp("knobs") / "gqa")
    return model, tracer.record(model, TOKENS, engine="hf")


@pytest.mark.parametrize("variant", FIRST)
def test_knob_diverges_first_where_its_operation_is(tiny, variant):
    model, reference = tiny
    result = tracer.compare(reference, tracer.record(model, TOKENS, engine="reimpl", variant=variant))
    assert result.verdict == "diverged"
    assert result.first_divergence.point == FIRST[variant]
    assert (result.first_divergence.upstream_max_rel_l2 or 0.0) < 1e-6  # None: nothing upstream


@pytest.mark.parametrize("variant", MATCH)
def test_knobs_that_keep_the_maths_match(tiny, variant):
    # the tiny model has no biases, no rope scaling and theta 10000, so bias, rope_scaling and resave change nothing
    model, reference = tiny
    result = tracer.compare(reference, tracer.record(model, TOKENS, engine="reimpl", variant=variant))
    assert result.verdict == "match", result.first_divergence


def test_a_combination_is_neither_of_its_parts(tiny):
    model, _ = tiny
    q = {v: tracer.record(model, TOKENS, engine="reimpl", variant=v)[L0 + "self_attn.q_rope"]
         for v in ("theta=500", "rope=interleaved", "theta=500,rope=interleaved")}
    assert not torch.allclose(q["theta=500,rope=interleaved"], q["theta=500"])
    assert not torch.allclose(q["theta=500,rope=interleaved"], q["rope=interleaved"])


def test_logits_last_records_one_row_and_is_compared_on_the_last_position(tiny):
    model, reference = tiny
    candidate = tracer.record(model, TOKENS, engine="reimpl", variant="logits=last")
    assert candidate["lm_head"].shape == (1, 97)
    result = tracer.compare(reference, candidate)
    assert result.logits.positions == 1
    assert any("last position only" in note for note in result.notes)
    torch.testing.assert_close(candidate["lm_head"][0], reference["lm_head"][-1], rtol=1e-5, atol=1e-5)


# --- models with biases and Llama-3 scaling -----------------------------------------------------


@pytest.mark.parametrize("engine", ["reimpl", "hf"])
def test_bias_ignore_diverges_first_at_a_layer0_projection(tiny_llama, engine):
    model = tiny_llama("bias", attention_bias=True)
    result = tracer.compare(tracer.record(model, TOKENS, engine="hf"),
                            tracer.record(model, TOKENS, engine=engine, variant="bias=ignore"))
    assert result.first_divergence.point == L0 + "self_attn.q_proj"
    assert result.first_divergence.upstream_max_rel_l2 == 0


@pytest.mark.parametrize("engine", ["reimpl", "hf"])
def test_rope_scaling_drop_diverges_first_at_layer0_q_rope(tiny_llama, engine):
    model = tiny_llama("llama3", **LLAMA3, rope_format="v5")
    assert len(TOKENS) > LLAMA3["rope_scaling"]["original_max_position_embeddings"]
    reference = tracer.record(model, TOKENS, engine="hf")
    result = tracer.compare(reference, tracer.record(model, TOKENS, engine=engine, variant="rope_scaling=drop"))
    assert result.first_divergence.point == L0 + "self_attn.q_rope"
    # and dropping it is what candle does with a transformers 5 config: same q_rope
    candle = tracer.record(model, TOKENS, engine="reimpl", variant="config=candle")
    dropped = tracer.record(model, TOKENS, engine="reimpl", variant="rope_scaling=drop")
    assert torch.equal(candle[L0 + "self_attn.q_rope"], dropped[L0 + "self_attn.q_rope"])


def test_candle_reads_a_llama3_config_written_by_transformers4(tiny_llama):
    model = tiny_llama("llama3-v4", **LLAMA3)
    result = tracer.compare(tracer.record(model, TOKENS, engine="hf"),
                            tracer.record(model, TOKENS, engine="reimpl", variant="config=candle"))
    assert result.verdict == "match"


# --- both engines honour the config-level knobs alike ------------------------------------------

BOTH_ENGINES = {
    "theta=500": {}, "eps=1e-3": {}, "attn=sdpa": {}, "dtype=bf16": {}, "layers=1": {},
    "bias=ignore": dict(attention_bias=True, mlp_bias=True),
    "rope_scaling=drop": dict(**LLAMA3, rope_format="v5"),
    "config=candle": dict(head_dim=16, rope_theta=500.0, rope_format="v5"),
    "config=candle,resave=tf5": dict(rope_theta=500.0),
}


@pytest.mark.parametrize("variant", BOTH_ENGINES)
def test_config_level_knobs_mean_the_same_on_hf_and_reimpl(tiny_llama, variant):
    assert all({"reimpl", "hf"} <= set(engines_honouring(k.split("=")[0])) for k in variant.split(","))
    model = tiny_llama("m", **BOTH_ENGINES[variant])
    on_hf = tracer.record(model, TOKENS, engine="hf", variant=variant)
    on_reimpl = tracer.record(model, TOKENS, engine="reimpl", variant=variant)
    plain = tracer.record(model, TOKENS, engine="hf")
    assert tracer.compare(on_hf, on_reimpl).verdict == "match"
    if variant not in ("attn=sdpa",):
        assert tracer.compare(plain, on_hf).verdict == "diverged", "the knob changed nothing on this model"


@pytest.mark.parametrize("knob", [k for k in KNOBS.values() if engines_honouring(k.name) == ("reimpl",)])
def test_semantic_knobs_are_refused_by_hf_naming_reimpl(tiny_llama, knob):
    text = knob.representative(None)
    with pytest.raises(TracerError,
                       match=f"knob '{knob.name}' is not honoured by the hf engine; engines that honour it: reimpl"):
        tracer.record(tiny_llama(), TOKENS, engine="hf", variant=text)


def test_sdpa_refuses_knobs_it_cannot_apply(tiny_llama):
    with pytest.raises(TracerError, match="mask=none needs attn=eager"):
        tracer.record(tiny_llama(), TOKENS, engine="reimpl", variant="attn=sdpa,mask=none")


def test_preset_expands_and_explicit_knobs_win():
    assert expand_presets({"preset": "candle"}) == PRESETS["candle"]
    assert expand_presets({"preset": "candle", "mask": "none"})["mask"] == "none"
    assert expand_presets({"theta": 1.0}) == {"theta": 1.0}


# --- load-time mismatches ---------------------------------------------------------------------


@pytest.mark.parametrize("variant, message", [
    ("layers=3", r"missing tensor model\.layers\.2\.input_layernorm\.weight \(expected shape \(64,\)\)"),
    ("head_dim=8", r"shape mismatch, model\.layers\.0\.self_attn\.q_proj\.weight: file \(64, 64\), "
                   r"model \(32, 64\)"),
])
def test_config_and_weights_that_disagree_are_one_line_naming_the_tensor(tiny_llama, variant, message):
    with pytest.raises(TracerError, match=message) as info:
        tracer.record(tiny_llama(), TOKENS, engine="reimpl", variant=variant)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("engine", ["reimpl", "hf"])
def test_a_missing_bias_is_a_load_error(tiny_llama, engine):
    model = tiny_llama("nobias")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(TracerError, match=r"missing tensor model\.layers\.0\.self_attn\.\w_proj\.bias"):
        tracer.record(model, TOKENS, engine=engine)
    # bias=ignore reads it as candle does: no bias anywhere, the same model as the file holds
    assert tracer.compare(tracer.record(model, TOKENS, engine="hf", variant="bias=ignore"),
                          tracer.record(model, TOKENS, engine="reimpl", variant="bias=ignore")).verdict == "match"


def test_cli_run_ends_with_verdict_error_on_a_load_mismatch(tiny_llama, capsys):
    from tracer.cli import main

    code = main(["run", "--model", str(tiny_llama()), "--tokens", "1,2,3", "--variant", "layers=3",
                 "--json", "-", "--no-report"])
    out, err = capsys.readouterr()
    assert code == 2
    payload = json.loads(out)
    assert payload["verdict"] == "error" and "model.layers.2.input_layernorm.weight" in payload["error"]
    assert err.strip().splitlines()[-1].startswith("tracer: error: missing tensor model.layers.2")


def test_a_knob_that_changes_nothing_on_the_model_is_said_to(llama_dir):
    """theta=10000 on a model whose rope_theta is 10000 plants nothing: its MATCH says nothing of the
    wrong-base mistake, and the run says so; a knob that does change the model gets no such note."""
    from tracer.model.config import unchanging_knobs

    config = json.loads((llama_dir / "config.json").read_text())
    assert config["rope_theta"] == 10000.0 and config["rms_norm_eps"] == 1e-5
    knobs = {"theta": 10000.0, "eps": 1e-3, "rope": "half", "mask": "none"}
    assert unchanging_knobs(config, knobs) == {"theta": 10000.0, "rope": "half"}
    result = tracer.run(llama_dir, tokens=TOKENS, variant="theta=10000", greedy=0, progress=False)
    assert result.verdict == "match"
    assert "candidate: theta=10000 changes nothing on this model (its own value already)" in result.notes
    result = tracer.run(llama_dir, tokens=TOKENS, variant="theta=500", greedy=0, progress=False)
    assert not any("changes nothing" in note for note in result.notes)
