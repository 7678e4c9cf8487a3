"""Local vs inherited error: a fault in one block is local to it; later blocks only inherit it."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import tracer
from tests.conftest import TOKENS
from tracer.comparison.explain import amplification
from tracer.engines.load import resolve_and_load
from tracer.files.sources import ModelSource
from tracer.model.points import source_point
from tracer.pipeline.noise_floor import estimate_noise
from tracer.pipeline.run import local_errors


def faulty_copy(model_dir, tmp_path, tensor: str, scale: float = 0.05):
    faulty = tmp_path / "faulty"
    shutil.copytree(model_dir, faulty)
    weights = load_file(str(faulty / "model.safetensors"))
    weights[tensor] = weights[tensor] + scale * torch.randn(weights[tensor].shape,
                                                            generator=torch.Generator().manual_seed(1))
    save_file(weights, str(faulty / "model.safetensors"))
    return faulty


def test_a_single_block_fault_is_local_to_that_block(tiny_llama, tmp_path):
    model = tiny_llama(num_hidden_layers=4)
    faulty = faulty_copy(model, tmp_path, "model.layers.1.mlp.down_proj.weight")
    reference = tracer.record(model, TOKENS, engine="hf")
    engine = resolve_and_load("reimpl", faulty, {})
    candidate = engine.record(TOKENS)
    local = local_errors(engine, reference)
    result = tracer.compare(reference, candidate, noise=estimate_noise(ModelSource(model), reference, {}), local=local)

    first = result.first_divergence
    assert first.point == "model.layers.1.mlp.down_proj" and first.localized_by == "local"
    later = [p for p in result.points if p.layer in (2, 3)]
    assert all(p.diverged for p in later if p.point.endswith(("mlp.down_proj", "resid_mid")) or p.point[-1].isdigit())
    assert max(p.local_rel_l2 for p in later) == 0.0  # same weights, same reference inputs: nothing introduced
    assert local["model.layers.1.mlp.act"] == 0.0 and local["model.layers.1.mlp.down_proj"] > 1e-3


def test_local_error_of_a_clean_reimplementation_is_zero(tiny_llama):
    model = tiny_llama()
    reference = tracer.record(model, TOKENS, engine="hf")
    local = local_errors(resolve_and_load("reimpl", model, {}), reference)
    assert set(local) == set(reference.points) and max(local.values()) == 0.0


def test_op_inputs_follow_the_forward():
    assert source_point("model.layers.0.input_layernorm") == "model.embed_tokens"
    assert source_point("model.layers.3.input_layernorm") == "model.layers.2"
    assert source_point("model.layers.3.self_attn.q_rope") == "model.layers.3.self_attn.q_proj"
    assert source_point("model.layers.3") == "model.layers.3.mlp.down_proj"
    gains = amplification({"model.layers.0.self_attn.q_proj": 1e-6, "model.layers.0.self_attn.q_rope": 1e-3,
                           "model.layers.0.input_layernorm": 1e-6, "model.layers.0.self_attn.k_proj": 2e-6})
    assert gains[0]["point"] == "model.layers.0.self_attn.q_rope" and gains[0]["gain"] == pytest.approx(1000.0)
