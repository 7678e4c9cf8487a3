"""DeepSeek-V3 on a tiny random model written by transformers' `save_pretrained` (tests/families.py: hidden 64,
2 layers, layer 0 dense by first_k_dense_replace=1, 8 experts in 4 groups of which 2 are kept, top-2, a shared
expert, a random selection bias, MLA with ranks 24 (q) and 16 (kv), 16 + 8 q/k dims per head, 12 v dims): hf
against reimpl at every point, MLA's and the routing points included, bitwise in f32 with the experts picked
identical; each of the family's porting mistakes diverging first where it touches."""

from __future__ import annotations

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.families import write_tiny_family
from tracer.comparison.diff import compare
from tracer.model.components.mla import mla_softmax_scale
from tracer.model.config import load_config, read_hf
from tracer.model.points import (
    EXPERTS,
    GATE_PROJ,
    K_NOPE,
    K_PE,
    K_ROPE,
    KV_LATENT,
    MLP,
    Q_LATENT,
    Q_PROJ,
    Q_ROPE,
    ROUTER_SCORES,
    ROUTER_SELECTION,
    SHARED_EXPERT,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    all_points,
    layer_point,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny DeepSeek-V3 and its hf trace, written and recorded once for the module."""
    path = write_tiny_family(tmp_path_factory.mktemp("deepseek") / "model", "deepseek_v3", hidden_size=64)
    return path, tracer.record(path, TOKENS, engine="hf", progress=False)


def test_every_point_is_bitwise_equal_on_both_engines(model):
    path, reference = model
    candidate = tracer.record(path, TOKENS, engine="reimpl", progress=False)
    spec = read_hf(load_config(path))
    assert reference.points == all_points(spec.num_hidden_layers, "deepseek_v3", spec=spec)  # transformers' order
    assert set(candidate.points) == set(reference.points)
    assert all(torch.equal(reference[p], candidate[p]) for p in reference.points)
    # layer 0 is dense (first_k_dense_replace=1), layer 1 routes; MLA's points on both
    assert layer_point(0, GATE_PROJ) in reference and layer_point(0, ROUTER_SELECTION) not in reference
    for sub in (Q_LATENT, KV_LATENT, K_PE, K_NOPE, ROUTER_SELECTION, SHARED_EXPERT):
        assert layer_point(1, sub) in reference
    assert reference[layer_point(1, K_NOPE)].shape == (4, len(TOKENS), 16)  # (H, T, qk_nope_head_dim)
    assert reference[layer_point(1, Q_ROPE)].shape == (4, len(TOKENS), 24)  # (H, T, nope + rope)
    # the keys' RoPE part is k_pe rotated, one for every head; their non-RoPE part is k_nope
    keys = reference[layer_point(1, K_ROPE)]
    assert torch.equal(keys[..., :16], reference[layer_point(1, K_NOPE)])
    assert torch.equal(keys[0, :, 16:], keys[3, :, 16:])
    scores, selection = reference[layer_point(1, ROUTER_SCORES)], reference[layer_point(1, ROUTER_SELECTION)]
    bias = (selection - scores)[0]
    assert torch.allclose(selection - scores, bias.expand_as(scores), atol=1e-6) and bias.abs().max() > 0.01
    picked, weights = reference[layer_point(1, TOP_K_INDEX)], reference[layer_point(1, TOP_K_WEIGHTS)]
    assert torch.allclose(weights.sum(-1), torch.full((len(TOKENS),), 2.5))  # renormalized, times the scaling
    assert torch.allclose(weights, scores.gather(1, picked) / scores.gather(1, picked).sum(-1, keepdim=True) * 2.5)
    together = reference[layer_point(1, EXPERTS)] + reference[layer_point(1, SHARED_EXPERT)]
    assert torch.equal(together, reference[layer_point(1, MLP)])
    result = compare(reference, candidate)
    assert result.verdict == "match" and max(p.rel_l2 for p in result.points if p.recorded) == 0.0
    assert result.routing.counts()["flips"] == 0 and result.routing.agreement == 1.0


# (knob, the point it touches first, whether layer 1's picks stay the same)
KNOBS = [
    ("selection_bias=weights", layer_point(1, TOP_K_WEIGHTS), True),
    ("routed_scaling=drop", layer_point(1, TOP_K_WEIGHTS), True),
    ("group_limit=ignore", layer_point(1, TOP_K_WEIGHTS), False),
    ("mla_split=rope_first", layer_point(0, Q_ROPE), None),
]


@pytest.mark.parametrize(("variant", "point", "same_experts"), KNOBS)
def test_each_knob_diverges_first_where_its_mistake_is(model, variant, point, same_experts):
    path, reference = model
    candidate = tracer.record(path, TOKENS, engine="reimpl", variant=variant, progress=False)
    result = compare(reference, candidate)
    assert result.verdict == "diverged" and result.first_divergence.point == point
    assert result.first_divergence.rel_l2 > 1e-2
    assert any(hint.startswith("DeepSeek-V3") for hint in result.first_divergence.hints)  # the family's own
    counts = result.routing.counts()
    if same_experts:  # the experts agree, their weights differ
        assert counts["flips"] == 0 and result.routing.layers[0].weight_max_abs > 1e-2
    elif same_experts is False:  # an expert outside the kept groups picked: never called noise
        assert counts["flips"] >= 1 and counts["near_ties"] == 0


def test_bitwise_in_bf16_with_the_router_kept_in_f32(model):
    """transformers keeps the router's weight and selection bias in f32 in a bf16 load; the reimplementation
    loads them so (else the logits differ by bf16's rounding of the weight)."""
    path, _ = model
    reference, candidate = (tracer.record(path, TOKENS, engine=engine, variant="dtype=bf16", progress=False)
                            for engine in ("hf", "reimpl"))
    assert reference[layer_point(1, Q_ROPE)].dtype == torch.bfloat16
    assert reference[layer_point(1, ROUTER_SELECTION)].dtype == torch.float32
    assert all(torch.equal(reference[p], candidate[p]) for p in reference.points)


def test_plain_q_proj_yarn_and_half_split_rope(tmp_path):
    """q_lora_rank null (one q_proj), YaRN scaling whose mscale_all_dim scales the softmax, RoPE in the half
    split (rope_interleave false): bitwise in f32, q_proj recorded in the low-rank query's place."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}
    path = write_tiny_family(tmp_path / "model", "deepseek_v3", hidden_size=64, q_lora_rank=None,
                             rope_parameters=yarn, rope_interleave=False)
    reference, candidate = (tracer.record(path, TOKENS, engine=engine, progress=False) for engine in ("hf", "reimpl"))
    assert layer_point(0, Q_PROJ) in reference and layer_point(0, Q_LATENT) not in reference
    assert reference.points == candidate.points
    assert all(torch.equal(reference[p], candidate[p]) for p in reference.points)
    assert mla_softmax_scale(read_hf(load_config(path))) != 24 ** -0.5  # the mscale is in
