"""gpt-oss on a tiny random model written by transformers' `save_pretrained` (hidden 64, 2 layers: layer 0
sliding with a window of 4 keys, shorter than the 7-token prompt, layer 1 full; 4 experts, top-2; the SwiGLU's
clamp at 1 so that it bites): hf (transformers' own eager attention with its sinks, observed) against reimpl
bitwise equal at every point, the experts picked identical; each porting mistake's knob diverging first at
the point it touches. One model and one hf trace for the module."""

from __future__ import annotations

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.families import WINDOW, write_tiny_family
from tracer.comparison.diff import compare
from tracer.core.errors import TracerError
from tracer.model.config import load_config, read_hf
from tracer.model.points import (
    EXPERTS,
    PROBS,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    ROUTER_SELECTION,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    all_points,
    layer_point,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(the tiny gpt-oss's directory, its hf trace)."""
    path = write_tiny_family(tmp_path_factory.mktemp("gpt_oss") / "gpt_oss", "gpt_oss", hidden_size=64, head_dim=16)
    return path, tracer.record(path, TOKENS, engine="hf", progress=False)


def test_hf_and_reimpl_are_bitwise_equal_at_every_point(model):
    path, reference = model
    candidate = tracer.record(path, TOKENS, engine="reimpl", progress=False)
    spec = read_hf(load_config(path))
    assert reference.points == all_points(spec.num_hidden_layers, "gpt_oss", spec=spec)  # in transformers' order
    assert set(candidate.points) == set(reference.points)
    assert all(torch.equal(reference[p], candidate[p]) for p in reference.points)
    assert layer_point(0, ROUTER_SCORES) not in reference  # transformers never forms scores over every expert
    logits = reference[layer_point(0, ROUTER_LOGITS)]  # (T, E)
    assert torch.equal(reference[layer_point(0, ROUTER_SELECTION)], logits)  # top-k picks from the biased logits
    top = logits.topk(2)
    assert torch.equal(reference[layer_point(0, TOP_K_INDEX)], top.indices)
    assert torch.allclose(reference[layer_point(0, TOP_K_WEIGHTS)], top.values.softmax(-1))  # over the k only
    sliding, full = reference[layer_point(0, PROBS)], reference[layer_point(1, PROBS)]  # (H, T, T) each
    for probs in (sliding, full):  # the sinks take their share of every row, most of some
        assert (probs.sum(-1) < 1).all() and probs.sum(-1).min() < 0.5
    assert (sliding[:, WINDOW:, 0] == 0).all() and (full[:, WINDOW:, 0] > 0).all()  # layer 0 slides, layer 1 not
    result = compare(reference, candidate)
    assert result.verdict == "match" and max(p.rel_l2 for p in result.points if p.recorded) == 0.0
    assert result.routing.counts()["flips"] == 0 and result.routing.agreement == 1.0


# (knob, the point it touches first, a word of its hint there)
KNOBS = [("sinks=drop", PROBS, "sink"), ("router_bias=drop", ROUTER_LOGITS, "router_bias=drop"),
         ("swiglu_clamp=drop", EXPERTS, "swiglu_clamp=drop")]


@pytest.mark.parametrize(("variant", "point", "hint"), KNOBS)
def test_each_knob_diverges_first_where_its_mistake_is(model, variant, point, hint):
    path, reference = model
    result = compare(reference, tracer.record(path, TOKENS, engine="reimpl", variant=variant, progress=False))
    first = result.first_divergence
    assert result.verdict == "diverged" and first.point == layer_point(0, point) and first.rel_l2 > 0.1
    assert hint in first.hints[0]
    routing = result.routing.layers[0]
    if point == ROUTER_LOGITS:  # the router itself is wrong: structural flips at layer 0
        assert result.routing.first_structural is not None and result.routing.first_structural.layer == 0
    elif point == EXPERTS:  # the experts are wrong, the router's input is not: every token routed alike
        assert routing.agreement == 1.0


def test_the_config_is_read_as_transformers_reads_it(model):
    config = load_config(model[0])
    spec = read_hf(config)
    assert (spec.num_local_experts, spec.num_experts_per_tok) == (4, 2)
    assert (spec.swiglu_limit, spec.swiglu_alpha) == (1.0, 1.702)  # the tests' clamp; gpt-oss's alpha by default
    assert spec.layer_types == ("sliding_attention", "full_attention") and spec.sliding_window == WINDOW
    assert spec.attention_bias and spec.rope_scaling["rope_type"] == "yarn"
    bare = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    default = read_hf(bare)  # GptOssConfig's defaults: YaRN factor 32 over 4096 at base 150000, even layers slide
    assert (default.rope_theta, default.rope_scaling["factor"]) == (150000.0, 32.0)
    assert default.rope_scaling["original_max_position_embeddings"] == 4096
    assert default.layer_types == ("sliding_attention", "full_attention")


def test_sdpa_is_refused_in_one_line(model):
    with pytest.raises(TracerError, match="^attn=sdpa cannot take gpt-oss's attention sinks"):
        tracer.record(model[0], TOKENS, engine="reimpl", variant="attn=sdpa", progress=False)
