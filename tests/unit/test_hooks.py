"""The hf engine observes transformers without leaving anything behind, even when the forward raises."""

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import tracer
from tests.conftest import TOKENS
from tracer.engines.load import resolve_and_load


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_nothing_leaks_after_recording(tiny_llama):
    engine = resolve_and_load("hf", tiny_llama(), {})
    interfaces = (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping))
    engine.record(TOKENS)
    assert hook_count(engine.model) == 0
    assert engine.model.config._attn_implementation == "eager"
    assert (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)) == interfaces


def test_nothing_leaks_when_the_forward_raises(tiny_llama):
    engine = resolve_and_load("hf", tiny_llama(), {})
    interfaces = set(AttentionInterface._global_mapping)

    def explode(module, args, output):
        raise RuntimeError("boom inside the forward")

    handle = engine.model.model.layers[1].mlp.register_forward_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        engine.record(TOKENS)
    handle.remove()
    assert hook_count(engine.model) == 0
    assert engine.model.config._attn_implementation == "eager"
    assert set(AttentionInterface._global_mapping) == interfaces
    assert len(engine.record(TOKENS)) == 37  # and the engine still works


def test_recording_does_not_change_the_models_output(tiny_llama):
    engine = resolve_and_load("hf", tiny_llama(), {})
    plain = engine.logits(TOKENS)
    recorded = engine.record(TOKENS)["lm_head"]
    assert torch.equal(plain, recorded)


def test_a_loaded_sdpa_model_is_recorded_as_it_is(tiny_llama):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama(), attn_implementation="sdpa")
    trace = tracer.record(model, TOKENS, engine="hf")
    assert "model.layers.0.self_attn.q_rope" in trace and "model.layers.0.self_attn.scores" not in trace
    assert "attn_implementation='eager'" in trace.not_recorded["model.layers.0.self_attn.scores"]
    assert model.config._attn_implementation == "sdpa"


def test_variants_on_a_loaded_model_are_refused(tiny_llama):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama())
    with pytest.raises(tracer.TracerError, match="variant knobs need a model path"):
        tracer.record(model, TOKENS, engine="hf", variant="theta=500")
