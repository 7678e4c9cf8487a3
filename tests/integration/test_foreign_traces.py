"""Dumps from other runtimes, built from recorded traces of the bundled SmolLM2, localized in our vocabulary.

The faulty run is tracer's own Llama with layer 7's mlp.down_proj weight perturbed (1% relative
noise): the error starts at that op and propagates like a real port bug. The dumps are laid out
as candle and llama.cpp lay them out (tests/dumps.py).
"""

import json

import pytest

import tracer
from tests.dumps import candle_dump, faulty_trace, ggml_dump, save_dump
from tests.readme import run_recipe
from tracer.core.errors import TracerError
from tracer.testing import assert_traces_close

PROMPT = "The capital of France is"
FAULT_LAYER = 7


@pytest.fixture(scope="module")
def reference(default_model):
    return tracer.record(default_model, PROMPT, engine="hf", progress=False)


@pytest.fixture(scope="module")
def faulty(default_model, reference):
    return faulty_trace(default_model, reference.tokens, FAULT_LAYER)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("dumps")


@pytest.fixture(scope="module")
def candle_fault(faulty, reference, folder):
    return save_dump(candle_dump(faulty), folder / "candle-fault.safetensors", reference.tokens, runtime="candle")


def test_candle_dump_with_a_faulty_mlp_is_localized_to_that_down_proj(reference, candle_fault):
    result = tracer.compare_files(reference, candle_fault)
    first = result.first_divergence
    assert result.verdict == "diverged"
    assert first.point == f"model.layers.{FAULT_LAYER}.mlp.down_proj"
    assert first.last_agreeing == f"model.layers.{FAULT_LAYER}.mlp.up_proj"
    assert first.upstream_max_rel_l2 < 1e-6  # everything the dump has upstream agrees
    assert first.rel_l2 > 1e-3
    assert result.logits.positions == 1  # candle returns the last position's logits only
    assert any("holds only the last position at lm_head" in note for note in result.notes)
    assert any("dropped a leading batch dimension of 1" in note for note in result.notes)
    missing = [p.point for p in result.points if p.missing_on == "candidate"]
    assert len(missing) == 30 * 7  # q_rope, k_rope, scores, probs, context, resid_mid, act: not candle fields


def test_the_readme_dump_recipe_localizes_the_same_fault(default_model, candle_fault, tmp_path):
    """The README's recipe for a dump from your code, as written: the dump is candle's layout of the
    faulty run, ./my-model the bundled model."""
    run_recipe("A dump from your code", tmp_path, {"my-model": default_model, "my-dump.safetensors": candle_fault})
    summary = json.loads((tmp_path / "tracer-report" / "summary.json").read_text())
    assert summary["verdict"] == "diverged"
    assert summary["first_divergence"]["point"] == f"model.layers.{FAULT_LAYER}.mlp.down_proj"
    assert (tmp_path / "tracer-report" / "report.html").is_file()


def test_ggml_dump_with_only_block_outputs_is_localized_to_the_block(faulty, reference, folder):
    blocks = {f"model.layers.{i}" for i in range(30)}
    path = save_dump(ggml_dump(faulty, points=blocks), folder / "l_out.safetensors", reference.tokens)
    result = tracer.compare_files(reference, path)
    assert result.first_divergence.point == f"model.layers.{FAULT_LAYER}"
    assert result.first_divergence.last_agreeing == f"model.layers.{FAULT_LAYER - 1}"
    assert [p.point for p in result.points if p.recorded] == sorted(blocks, key=lambda p: int(p.split(".")[2]))
    # llama.cpp keeps only the output row in the last layer: compared there
    assert any("holds only the last position at model.layers.29" in note for note in result.notes)


def test_full_ggml_dump_matches_after_unpermuting_gguf_q_k(reference, folder):
    dump = ggml_dump(reference)
    result = tracer.compare_files(reference, save_dump(dump, folder / "ggml.safetensors", reference.tokens))
    assert result.verdict == "match"
    q_rope = next(p for p in result.points if p.point == "model.layers.0.self_attn.q_rope")
    assert q_rope.recorded and q_rope.rel_l2 == 0
    assert any("un-permuted from GGUF's interleaved order" in note for note in result.notes)
    assert any("padded KV-cache key columns" in note for note in result.notes)
    assert not any(p.missing_on for p in result.points if p.point.endswith("self_attn.probs"))
    # the same dump read as half-split: RoPE pairs scrambled, caught at the first q after RoPE
    plain = save_dump(dump, folder / "ggml-half.safetensors", reference.tokens, qk_order="half")
    assert tracer.compare_files(reference, plain).first_divergence.point == "model.layers.0.self_attn.q_rope"


def test_a_trace_against_itself_is_a_match(reference, folder):
    path = reference.save(folder / "hf.safetensors")
    result = tracer.compare_files(path, path)
    assert result.verdict == "match" and all(p.recorded and p.rel_l2 == 0 for p in result.points)


def test_traces_of_different_token_ids_are_refused(reference, folder):
    other = save_dump(candle_dump(reference), folder / "other-tokens.safetensors", [1, 2, 3, 4, 5])
    with pytest.raises(TracerError, match=r"ran other token ids: .* vs 5 ids 1,2,3,4,5"):
        tracer.compare_files(reference, other)


def test_assert_traces_close_passes_on_itself_and_names_the_faulty_op(reference, candle_fault):
    assert_traces_close(reference, reference)
    with pytest.raises(AssertionError, match=rf"first divergence: model\.layers\.{FAULT_LAYER}\.mlp\.down_proj"):
        assert_traces_close(reference, candle_fault)
