"""A made-up family that adds a component: `tests/toy_moe.py` declares a toy mixture-of-experts MLP (a
router and two experts) and Mixtral composed of it, and registers nothing else. On a tiny random Mixtral
written by transformers' own `save_pretrained`: its points, their order, its tensor shapes and its knob
follow from the declaration, hf and reimpl match at every point, the knob's variant diverges first at
the experts, and `tracer variants --family toy_moe` lists the knob. Its model_type is its own ("toy_moe",
registered with transformers as Mixtral's config), so it replaces nothing: tracer's own Mixtral stays."""

from __future__ import annotations

import json

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.toy_moe import EXPERTS, MOE, ROUTER, TOY_MOE, expert_weight, register_toy_config
from tracer.cli import main
from tracer.core.errors import TracerError
from tracer.model.config import load_config, read_hf
from tracer.model.families import expected_shapes, register, unregister
from tracer.model.knobs import check_family, knobs_for
from tracer.model.points import all_points, layer_order, layer_point, source_point, sub_points


@pytest.fixture(scope="module")
def mixtral():
    register(TOY_MOE)
    yield TOY_MOE.name
    unregister(TOY_MOE.name)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, mixtral):
    """A random Mixtral (2 layers, 2 experts, each token routed to one) saved by transformers, its model_type
    the toy's (transformers reads it as a Mixtral config: `register_toy_config`)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    config = MixtralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
                           max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2)
    model = MixtralForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator)
            scale = 0.1 if name.endswith("norm.weight") else 1.0 if name.endswith("embed_tokens.weight") else 0.15
            parameter.copy_((1.0 if name.endswith("norm.weight") else 0.0) + scale * noise)
    folder = tmp_path_factory.mktemp("mixtral")
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    finally:
        hf_logging.enable_progress_bar()
    register_toy_config()
    written = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**written, "model_type": TOY_MOE.name}))
    return folder


def test_points_and_their_order_follow_the_declaration(mixtral):
    llama = layer_order("llama")
    attention_half = llama[:llama.index("post_attention_layernorm") + 1]
    assert layer_order(mixtral) == (*attention_half, ROUTER, EXPERTS, MOE, "")
    assert sub_points(mixtral)[ROUTER].source == "post_attention_layernorm"
    assert source_point(layer_point(1, ""), mixtral) == layer_point(1, MOE)  # the block adds the MoE's output
    assert all_points(2, mixtral)[-4:] == [layer_point(1, MOE), layer_point(1, ""), "model.norm", "lm_head"]


def test_shapes_and_config_fields_follow_the_declaration(mixtral_dir):
    spec = read_hf(load_config(mixtral_dir))
    assert (spec.family, spec.num_local_experts, spec.num_experts_per_tok) == ("toy_moe", 2, 1)
    shapes = expected_shapes(spec)
    assert shapes[layer_point(1, expert_weight(1, "w2"))] == (64, 96)
    assert shapes[layer_point(0, "block_sparse_moe.gate.weight")] == (2, 64)
    assert not any(".mlp." in name for name in shapes)  # no gate/up/down_proj: the MLP is the MoE's alone
    with pytest.raises(TracerError, match="lacks the required key 'num_local_experts'"):
        read_hf({k: v for k, v in load_config(mixtral_dir).items() if k != "num_local_experts"})


def test_its_knob_applies_to_it_alone(mixtral):
    names = [knob.name for knob in knobs_for(mixtral)]
    assert "moe_renorm" in names and "window" in names and "norm" in names
    assert not {"gate_up", "qkv_split", "config", "preset", "ops"} & set(names)  # not Llama's graph
    assert "moe_renorm" not in [knob.name for knob in knobs_for("llama")]
    with pytest.raises(TracerError, match="^knob 'moe_renorm' does not apply to llama models; it applies to toy_moe$"):
        check_family({"moe_renorm": "drop"}, "llama")


def test_hf_and_reimpl_match_at_every_point(mixtral_dir):
    result = tracer.run(mixtral_dir, tokens=TOKENS, reference="hf", candidate="reimpl", greedy=0, progress=False)
    assert result.verdict == "match"
    assert [p.point for p in result.points] == all_points(2, "toy_moe")
    assert all(p.recorded for p in result.points)
    router = next(p for p in result.points if p.point == layer_point(0, ROUTER))
    assert router.shape == (len(TOKENS), 2) and router.rel_l2 < 1e-6


def test_the_knob_diverges_first_at_the_experts(mixtral_dir):
    result = tracer.run(mixtral_dir, tokens=TOKENS, variant="moe_renorm=drop", greedy=0, noise_floor=False,
                        progress=False)
    assert result.verdict == "diverged"
    assert result.first_divergence.point == layer_point(0, EXPERTS)
    assert result.first_divergence.rel_l2 > 0.01


def test_tracer_variants_lists_its_knob(mixtral, capsys):
    assert main(["variants", "--family", "toy_moe"]) == 0
    out = capsys.readouterr().out
    assert "moe_renorm" in out and f"first divergence layers.0.{EXPERTS}" in out
