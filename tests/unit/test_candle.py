"""The candle engine on tiny random Llamas: candle-nn's own kernels running candle-transformers
0.11's llama.rs (safetensors directories) and quantized_llama.rs (GGUF files)."""

import json
import sys

import pytest
import torch

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tests.families import write_tiny_family
from tests.ggml_gguf import sourced_copy, write_quantized_gguf
from tracer import TracerError
from tracer.engines import candle as candle_engine
from tracer.files.sources import ModelSource
from tracer.model.points import all_points, layer_point


def record(model, variant=None, argument=None):
    """The engine built in this process (the child-process path is tested once, below)."""
    return candle_engine.load(ModelSource(model), variant or {}, argument=argument).record(TOKENS)


def first(reference, candidate):
    divergence = tracer.compare(reference, candidate).first_divergence
    return divergence and divergence.point


@pytest.mark.parametrize("shape", [{}, {"tie_word_embeddings": False}, {"num_key_value_heads": 4}])
def test_every_point_of_llama_rs_matches_transformers(candle, tiny_llama, shape):
    model = tiny_llama("m", rope_theta=500.0, **shape)
    candidate = record(model)
    assert list(candidate.tensors) == all_points(2)  # every point the hf engine records, in its order
    result = tracer.compare(tracer.record(model, TOKENS, engine="hf"), candidate)
    assert result.verdict == "match"
    assert max(p.rel_l2 for p in result.points if p.recorded) < 1e-5


def test_a_transformers_5_config_takes_theta_10000_in_candles_reader_and_says_so(candle, tiny_llama):
    model = tiny_llama("v5", rope_theta=500.0, rope_format="v5")  # theta only under rope_parameters
    reference = tracer.record(model, TOKENS, engine="hf")
    candidate = record(model)
    assert first(reference, candidate) == layer_point(0, "self_attn.q_rope")
    assert candidate.meta.candle["rope_theta"] == 10000.0
    assert any("took rope_theta = 10000" in note and "rope_parameters" in note for note in candidate.meta.notes)
    assert tracer.compare(reference, record(model, {"config": "hf"})).verdict == "match"


def test_resave_tf5_moves_theta_where_candles_reader_misses_it(candle, tiny_llama):
    model = tiny_llama("v4", rope_theta=500.0)
    reference = tracer.record(model, TOKENS, engine="hf")
    assert first(reference, record(model, {"resave": "tf5"})) == layer_point(0, "self_attn.q_rope")
    assert tracer.compare(reference, record(model, {"resave": "tf5", "config": "hf"})).verdict == "match"


@pytest.mark.parametrize("knobs, point", [
    ({"rope": "interleaved"}, "self_attn.q_rope"),  # rope_i on HF rows: the notes' 6.36
    ({"theta": 10000.0}, "self_attn.q_rope"),
    ({"eps": 1e-2}, "input_layernorm"),
    ({"kv_repeat": "tile"}, "self_attn.scores"),
    ({"mask": "none"}, "self_attn.probs"),
])
def test_each_knob_diverges_where_its_mistake_begins(candle, tiny_llama, knobs, point):
    model = tiny_llama("m", rope_theta=500.0)
    assert first(tracer.record(model, TOKENS, engine="hf"), record(model, knobs)) == layer_point(0, point)


def test_the_additive_mask_is_within_the_noise_of_the_where_mask(candle, tiny_llama):
    model = tiny_llama("m")
    assert tracer.compare(tracer.record(model, TOKENS, engine="hf"), record(model, {"mask": "additive"})).verdict \
        == "match"


@pytest.fixture(scope="module")
def quantized(candle, tmp_path_factory):
    """(HF directory, its Q4_1/Q8_0 GGUF, the directory converted from that GGUF). candle's Q4_1
    kernel takes rows of an even number of blocks: an intermediate size of 4 blocks."""
    folder = tmp_path_factory.mktemp("candle-gguf")
    model = write_tiny_llama(folder / "model", intermediate_size=128)
    gguf_file = write_quantized_gguf(model, folder / "tiny-q4_1.gguf")
    return model, gguf_file, sourced_copy(model, gguf_file, folder / "converted")


def test_a_file_candle_cannot_multiply_is_candles_refusal_in_one_line(candle, tmp_path):
    gguf_file = write_quantized_gguf(write_tiny_llama(tmp_path / "odd"), tmp_path / "odd.gguf")  # 96 = 3 blocks
    with pytest.raises(TracerError, match=r"^candle refused: vec_dot_q4_1_q8_1: 96, nb is not divisible by 2$"):
        record(tmp_path / "odd", argument=str(gguf_file))


def test_quantized_llama_rs_rounds_activations_to_8_bits_inside_each_projection(quantized):
    """Against the file's own weights in f32 arithmetic: exact up to the first projection, whose
    activations candle quantizes to Q8_1."""
    _, gguf_file, converted = quantized
    candidate = record(converted, argument=str(gguf_file))
    result = tracer.compare(tracer.record(converted, TOKENS, engine="reimpl", variant={"weights": "gguf"}), candidate)
    by_point = {p.point: p.rel_l2 for p in result.points}
    assert by_point["model.embed_tokens"] == 0  # the dequantized Q8_0 table
    assert by_point[layer_point(0, "input_layernorm")] < 1e-6
    assert result.first_divergence.point in {layer_point(0, f"self_attn.{p}_proj") for p in "qkv"}
    assert candidate.meta.candle["forward"] == "quantized_llama.rs"
    assert candidate.meta.runtime["name"] == "candle-nn"


def test_candles_regime_reproduces_quantized_llama_rs_bit_for_bit(quantized):
    """The Must-hold in miniature: preset=candle-q on the file's own tensors equals candle at every
    point, q/k rows un-permuted into HF order on both sides."""
    _, gguf_file, converted = quantized
    candidate = record(converted, argument=str(gguf_file))
    emulated = tracer.record(converted, TOKENS, engine="reimpl", variant={"preset": "candle-q", "weights": "gguf"})
    assert list(candidate.tensors) == list(emulated.tensors)
    for point, value in candidate.tensors.items():
        assert torch.equal(value, emulated.tensors[point]), point


def test_regime_auto_picks_candles_arithmetic_for_a_gguf_and_none_for_f32(quantized):
    from tracer.engines.registry import parse_engine
    from tracer.pipeline.regime_view import resolve

    _, gguf_file, converted = quantized
    source = ModelSource(converted)
    knobs, caveats, audit = resolve("auto", parse_engine(f"candle:{gguf_file}"), {}, source)
    assert (knobs, caveats, audit.verdict) == ({"preset": "candle-q", "weights": "gguf"}, [], "identical")
    with pytest.raises(TracerError, match="runs f32 and implies no number-format regime"):
        resolve("auto", parse_engine("candle"), {}, source)


def test_a_gguf_of_a_family_without_a_quantized_file_is_refused_in_one_line(candle, tmp_path):
    from tests.families import write_tiny_gguf

    gguf_file = write_tiny_gguf(write_tiny_family(tmp_path / "o", "olmo2"), tmp_path / "o.gguf", no_vocab=True)
    with pytest.raises(TracerError, match=r"^candle-transformers 0.11 has no quantized_olmo2.rs: candle runs the "
                                          r"model directory of olmo2 only$"):
        candle_engine.load(ModelSource(tmp_path / "o"), {}, argument=str(gguf_file))


def test_quantized_qwen3_rs_matches_transformers_by_its_standard_attention_and_says_so(candle, tmp_path):
    from tests.families import write_tiny_gguf

    model = write_tiny_family(tmp_path / "q", "qwen3")
    gguf_file = write_tiny_gguf(model, tmp_path / "q.gguf", no_vocab=True)
    candidate = candle_engine.load(ModelSource(model), {}, argument=str(gguf_file)).record(TOKENS)
    result = tracer.compare(tracer.record(model, TOKENS, engine="hf"), candidate)
    assert result.verdict == "match" and sorted(candidate.tensors) == sorted(all_points(3, "qwen3"))
    assert max(p.rel_l2 for p in result.points if p.recorded) < 1e-5
    assert any("quantized_qwen3.rs runs candle_nn's fused CPU flash attention" in n for n in candidate.meta.notes)


def test_quantized_qwen2_rs_on_an_f32_gguf_matches_transformers_at_every_point(candle, tmp_path):
    """quantized_qwen2.rs: q/k/v biases, `rope` on llama.cpp's unpermuted Qwen2 rows, head_dim from the
    embedding; its GGUF carries no window, so a prompt within the HF model's window."""
    from tests.families import WINDOW, write_tiny_gguf

    model = write_tiny_family(tmp_path / "q", "qwen2")
    gguf_file = write_tiny_gguf(model, tmp_path / "q.gguf", no_vocab=True)
    tokens = TOKENS[:WINDOW]
    candidate = candle_engine.load(ModelSource(model), {}, argument=str(gguf_file)).record(tokens)
    assert candidate.meta.candle["forward"] == "quantized_qwen2.rs"
    result = tracer.compare(tracer.record(model, tokens, engine="hf"), candidate)
    assert result.verdict == "match" and len(candidate.tensors) == len(all_points(3, "qwen2"))
    assert max(p.rel_l2 for p in result.points if p.recorded) < 1e-5
    with pytest.raises(TracerError, match=r"^candle's regime emulates quantized_llama.rs only: run this qwen2 GGUF "
                                          r"without --regime$"):
        tracer.run(model, tokens=tokens, candidate=f"candle:{gguf_file}", regime="auto", greedy=0, progress=False)


def test_quantized_gemma3_rs_computes_gemma_3_with_a_silu_mlp(candle, tmp_path):
    """quantized_gemma3.rs: embeddings × sqrt(hidden), rms_norm on llama.cpp's stored (1 + w) sandwich and q/k
    norms, the local table on its sliding layers; its MLP is SiLU where Gemma's is tanh GELU
    (`candle_nn::ops::silu(&gate)`): on a model where gemma3.rs' own differences do not apply, everything before
    layer 0's activation matches and the activation is where it diverges, said in the notes."""
    from tests.families import WINDOW, write_tiny_gguf

    model = write_tiny_family(tmp_path / "g", "gemma3", query_pre_attn_scalar=12, tie_word_embeddings=True,
                              layer_types=["sliding_attention"] * 3)
    gguf_file = write_tiny_gguf(model, tmp_path / "g.gguf", no_vocab=True)
    tokens = TOKENS[:WINDOW]
    candidate = candle_engine.load(ModelSource(model), {}, argument=str(gguf_file)).record(tokens)
    result = tracer.compare(tracer.record(model, tokens, engine="hf"), candidate)
    assert result.first_divergence.point == layer_point(0, "mlp.act")
    before = result.points[:[p.point for p in result.points].index(layer_point(0, "mlp.act"))]
    assert len(before) > 15 and max(p.rel_l2 for p in before if p.recorded) < 1e-5
    assert any("MLP with SiLU" in note for note in candidate.meta.notes)


def test_quantized_phi3_rs_runs_fused_projections_and_refuses_a_partial_rotary_head(candle, tmp_path):
    """quantized_phi3.rs: attn_qkv and ffn_up (gate | up) as they are, `rope` over the whole head with a
    table of rope.dimension_count dims (theta 10000): a Phi-3 rotating every dim matches transformers at
    every point; one rotating half of them is candle's own refusal."""
    from tests.families import write_tiny_gguf

    model = write_tiny_family(tmp_path / "p", "phi3", partial_rotary_factor=1.0, sliding_window=None)
    gguf_file = write_tiny_gguf(model, tmp_path / "p.gguf", no_vocab=True)
    candidate = candle_engine.load(ModelSource(model), {}, argument=str(gguf_file)).record(TOKENS)
    assert candidate.meta.candle["forward"] == "quantized_phi3.rs"
    result = tracer.compare(tracer.record(model, TOKENS, engine="hf"), candidate)
    assert result.verdict == "match" and list(candidate.tensors) == all_points(3, "phi3")
    assert max(p.rel_l2 for p in result.points if p.recorded) < 1e-5
    half = write_tiny_family(tmp_path / "h", "phi3")  # partial_rotary_factor 0.5
    with pytest.raises(TracerError, match=r"^candle refused: inconsistent last dim size in rope \(head 12, "
                                          r"rope.dimension_count 6: quantized_phi3.rs\)$"):
        candle_engine.load(ModelSource(half), {}, argument=str(write_tiny_gguf(half, tmp_path / "h.gguf",
                                                                                  no_vocab=True)))


@pytest.mark.parametrize("system, machine, flags, said", [
    ("Darwin", "arm64", {"avx2", "fma", "f16c"}, "this machine is Darwin arm64"),
    ("Linux", "aarch64", set(), "this machine is Linux aarch64"),
    ("Linux", "x86_64", {"avx2", "sse4_2"}, "this one lacks fma, f16c"),
])
def test_a_machine_the_wheel_cannot_serve_is_one_line(system, machine, flags, said):
    with pytest.raises(TracerError, match=said):
        candle_engine.check_platform(system, machine, flags)


def test_a_missing_runtime_is_one_line_naming_the_extra(tiny_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "candle", None)  # what find_spec says for a module not installed
    with pytest.raises(TracerError, match=r"^the candle engine needs candle-nn, which is not installed: "
                                          r"pip install -e '\.\[candle\]'$"):
        tracer.record(tiny_llama(), TOKENS, engine="candle")


def test_knobs_candle_cannot_honour_are_refused_naming_the_engines_that_can(tiny_llama):
    with pytest.raises(TracerError, match="knob 'attn' is not honoured by the candle engine; engines that honour it"):
        tracer.record(tiny_llama(), TOKENS, engine="candle", variant={"attn": "sdpa"})


def test_config_knobs_are_refused_on_a_gguf_whose_metadata_candle_reads(quantized):
    model, gguf_file, _ = quantized
    with pytest.raises(TracerError, match="reads the GGUF's metadata"):
        candle_engine.load(ModelSource(model), {"config": "hf"}, argument=str(gguf_file))


def test_through_its_child_process_with_one_thread_nothing_changes(candle, tiny_llama):
    """The registered path: the isolated child, rayon sized by threads=1, the same values; a child whose pool
    runs another size (an earlier load's) is not the one that serves it."""
    model = tiny_llama("m", rope_theta=500.0)
    tracer.record(model, TOKENS, engine="candle", variant={"threads": 2})
    child = tracer.record(model, TOKENS, engine="candle", variant={"threads": 1})
    assert child.meta.candle["threads"] == 1
    here = record(model)
    assert all(torch.equal(child.tensors[p], here.tensors[p]) for p in here.tensors)


def test_a_saved_candle_trace_compares_as_the_live_run(candle, tiny_llama, tmp_path):
    """`tracer record --engine candle` then `tracer compare`: the live run's first divergence."""
    from tracer.cli import main

    model = tiny_llama("v5", rope_theta=500.0, rope_format="v5")
    tokens = ",".join(map(str, TOKENS))
    saved = {side: tmp_path / f"{side}.safetensors" for side in ("hf", "candle")}
    for engine, file in saved.items():
        assert main(["record", "--model", str(model), "--engine", engine, "--tokens", tokens, "-o", str(file)]) == 0
    summary = tmp_path / "compare.json"
    main(["compare", str(saved["hf"]), str(saved["candle"]), "--json", str(summary), "--no-report"])
    assert json.loads(summary.read_text())["first_divergence"]["point"] == layer_point(0, "self_attn.q_rope")


def test_without_the_extra_tracer_engines_says_how_to_install_it_and_the_rest_works(tiny_llama, monkeypatch, capsys):
    from tracer.cli import main

    monkeypatch.setitem(sys.modules, "candle", None)
    assert main(["engines"]) == 0
    listing = capsys.readouterr().out
    assert "candle[:PATH]: candle's own CPU kernels" in listing
    assert "  runtime  not installed: pip install -e '.[candle]'" in listing
    assert tracer.record(tiny_llama(), TOKENS, engine="reimpl").tensors  # nothing else imports candle
