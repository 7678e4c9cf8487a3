"""The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on tiny random models written by
transformers' `save_pretrained` (hidden 64, 2 layers, 4 experts, top-2; Qwen2-MoE with a shared expert and
layer 1 dense): the routing points on both engines, bitwise equal in f32 with the experts picked identical; each
porting mistake's knob diverging first at the point it touches; the config's own keys read as transformers
reads them. One model per family for the module, one hf trace of it shared by the knobs."""

from __future__ import annotations

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.families import write_tiny_family
from tracer.cli import main
from tracer.comparison.diff import compare
from tracer.core.errors import TracerError
from tracer.model.config import load_config, read_hf
from tracer.model.points import (
    EXPERTS,
    GATE_PROJ,
    MLP,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    SHARED_EXPERT,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    all_points,
    layer_point,
)

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ROUTING = (ROUTER_LOGITS, ROUTER_SCORES, TOP_K_INDEX, TOP_K_WEIGHTS, EXPERTS, MLP)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (its tiny model directory, its hf trace), written and recorded once for the module."""
    root = tmp_path_factory.mktemp("moe")
    made = {}
    for family in MOE:
        model = write_tiny_family(root / family, family, hidden_size=64, num_hidden_layers=2,
                                  **({"head_dim": 16} if family == "qwen3_moe" else {}))
        made[family] = model, tracer.record(model, TOKENS, engine="hf", progress=False)
    return made


@pytest.mark.parametrize("family", MOE)
def test_the_routing_points_are_bitwise_equal_on_both_engines(models, family):
    model, reference = models[family]
    candidate = tracer.record(model, TOKENS, engine="reimpl", progress=False)
    spec = read_hf(load_config(model))
    assert reference.points == all_points(spec.num_hidden_layers, family, spec=spec)  # in transformers' order
    assert set(candidate.points) == set(reference.points)
    assert all(torch.equal(reference[p], candidate[p]) for p in reference.points)
    picked, weights = reference[layer_point(0, TOP_K_INDEX)], reference[layer_point(0, TOP_K_WEIGHTS)]
    scores = reference[layer_point(0, ROUTER_SCORES)]
    assert picked.dtype == torch.int64 and picked.shape == weights.shape == (len(TOKENS), 2)
    assert scores.dtype == torch.float32 and torch.allclose(scores.sum(-1), torch.ones(len(TOKENS)))
    assert torch.equal(scores.topk(2).indices, picked)  # in top-k's order, from the scores hf observed inside
    renormalized = family in ("mixtral", "qwen3_moe")  # Mixtral always; the tiny Qwen3-MoE sets norm_topk_prob
    assert torch.allclose(weights.sum(-1), torch.ones(len(TOKENS))) == renormalized
    result = compare(reference, candidate)
    assert result.verdict == "match" and max(p.rel_l2 for p in result.points) == 0.0


def test_qwen2_moe_has_its_shared_expert_and_a_dense_layer(models):
    """mlp_only_layers=[1]: layer 1 records the gated MLP's points and no routing point, as transformers' layer
    has a Qwen2MoeMLP there; layer 0 routes, with the shared expert's output after its gate."""
    _, trace = models["qwen2_moe"]
    assert layer_point(1, GATE_PROJ) in trace and layer_point(1, MLP) in trace
    assert not any(layer_point(1, sub) in trace for sub in (*ROUTING[:-1], SHARED_EXPERT))
    assert all(layer_point(0, sub) in trace for sub in (*ROUTING, SHARED_EXPERT))
    assert layer_point(0, GATE_PROJ) not in trace
    together = trace[layer_point(0, EXPERTS)] + trace[layer_point(0, SHARED_EXPERT)]
    assert torch.equal(together, trace[layer_point(0, MLP)])  # the block's output: routed + shared, as added


# (family, knob, the point it touches first, whether the experts picked stay the same)
KNOBS = [
    ("mixtral", "norm_topk=ignore", TOP_K_WEIGHTS, True),
    ("mixtral", "moe_scoring=sigmoid", ROUTER_SCORES, True),
    ("mixtral", "router_dtype=bf16", ROUTER_LOGITS, True),
    ("mixtral", "expert_gate_up=up_gate", EXPERTS, True),
    ("mixtral", "expert_order=reversed", EXPERTS, True),
    ("qwen2_moe", "shared_gate=drop", SHARED_EXPERT, True),
    ("qwen2_moe", "norm_topk=force", TOP_K_WEIGHTS, True),
    ("olmoe", "moe_softmax=after_topk", TOP_K_WEIGHTS, True),
    ("qwen3_moe", "norm_topk=ignore", TOP_K_WEIGHTS, True),
]


@pytest.mark.parametrize(("family", "variant", "point", "same_experts"), KNOBS)
def test_each_knob_diverges_first_where_its_mistake_is(models, family, variant, point, same_experts):
    model, reference = models[family]
    candidate = tracer.record(model, TOKENS, engine="reimpl", variant=variant, progress=False)
    result = compare(reference, candidate)
    assert result.verdict == "diverged" and result.first_divergence.point == layer_point(0, point)
    assert result.first_divergence.rel_l2 > 1e-3
    picked = layer_point(0, TOP_K_INDEX)
    assert torch.equal(reference[picked], candidate[picked]) == same_experts
    compared = next(p for p in result.points if p.point == picked)
    assert not compared.diverged and compared.rel_l2 == 0.0  # integers: never judged by rel_l2


def test_the_softmax_after_top_k_is_the_same_model_where_weights_are_renormalized(models):
    """Mixtral renormalizes its top-k weights: a softmax over the k picked logits is the same weights (to
    rounding), which is why a port of a family that does not renormalize (OLMoE, above) can hide it."""
    model, reference = models["mixtral"]
    candidate = tracer.record(model, TOKENS, engine="reimpl", variant="moe_softmax=after_topk", progress=False)
    assert ROUTER_SCORES not in [p.split(".", 3)[-1] for p in candidate.points]  # never formed by such a port
    weights = layer_point(0, TOP_K_WEIGHTS)
    assert torch.allclose(reference[weights], candidate[weights], rtol=1e-6, atol=0)
    assert compare(reference, candidate).verdict == "match"


def test_the_config_keys_are_read_as_transformers_reads_them(models):
    spec = read_hf(load_config(models["qwen3_moe"][0]))  # save_pretrained writes Qwen3-MoE's num_local_experts
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size, spec.norm_topk_prob) == (
        4, 2, 32, True)
    qwen2 = read_hf(load_config(models["qwen2_moe"][0]))
    assert (qwen2.mlp_only_layers, qwen2.decoder_sparse_step, qwen2.shared_expert_intermediate_size) == ((1,), 1, 48)
    mixtral = load_config(models["mixtral"][0])
    renamed = {k: v for k, v in mixtral.items() if k != "num_local_experts"} | {"num_experts": 4}
    assert read_hf(renamed).num_local_experts == 4 and "num_experts" not in read_hf(renamed).unused_keys
    with pytest.raises(TracerError, match="^config.json: mlp_only_layers must be a list of layer indices, got 1$"):
        read_hf({**load_config(models["qwen2_moe"][0]), "mlp_only_layers": 1})


def test_tracer_variants_lists_the_moe_knobs(capsys):
    assert main(["variants", "--family", "mixtral"]) == 0
    out = capsys.readouterr().out
    for knob in ("moe_scoring", "moe_softmax", "norm_topk", "router_dtype", "expert_gate_up", "expert_order"):
        assert knob in out
    assert "shared_gate" not in out  # Qwen2-MoE's alone
    assert main(["variants", "--family", "qwen2_moe"]) == 0
    assert f"first divergence layers.0.{SHARED_EXPERT}" in capsys.readouterr().out
