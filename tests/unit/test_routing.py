"""The routing diff (tracer.comparison.routing) on traces built here: a real router's arithmetic (logits of the
router's input, softmax in f64, top-k, weights renormalized) on small literal and random tensors, no model run.
Which experts each token goes to on each side, every flip a near-tie or structural, and what the results,
the JSON and the reports say of it."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from tracer import Trace, TraceMeta, compare, reports
from tracer.comparison.diff import INTEGER_POINT, ErrorRecorder
from tracer.comparison.routing import NEAR_TIE, NEAR_TIE_FACTOR, ORDER, STRUCTURAL, UNJUDGED, routing_diff
from tracer.model.points import (
    POST_ATTENTION_NORM,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    layer_point,
)
from tracer.reports import markdown_summary, render_html
from tracer.reports.figures import routing_figure
from tracer.reports.routing_map import STATUS
from tracer.reports.summary import figure_names, fmt
from tracer.reports.terminal import terminal_summary
from tracer.traces.spill import DiskRecorder

TOKENS, HIDDEN, EXPERTS, K, LAYERS = 7, 64, 4, 2, 2


def routed(x: torch.Tensor, logits: torch.Tensor, renormalize: bool = True) -> dict[str, torch.Tensor]:
    """One layer's routing points as a Mixtral-style router makes them from its input x (T, C) and logits (T, E)."""
    scores = torch.softmax(logits.double(), dim=-1).float()  # (T, E)
    top, index = torch.topk(scores, K, dim=-1)  # (T, k) each
    weights = top / top.sum(-1, keepdim=True) if renormalize else top
    return {POST_ATTENTION_NORM: x, ROUTER_LOGITS: logits, ROUTER_SCORES: scores, TOP_K_INDEX: index,
            TOP_K_WEIGHTS: weights}


def trace(layers: list[dict[str, torch.Tensor]]) -> Trace:
    tensors = {layer_point(i, sub): tensor for i, points in enumerate(layers) for sub, tensor in points.items()}
    return Trace(tensors, TraceMeta(engine="test", variant={}, tokens=list(range(1, TOKENS + 1))))


@pytest.fixture(scope="module")
def router():
    """Per layer the router's input (T, C) and matrix (E, C), seeded."""
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(TOKENS, HIDDEN, generator=generator),
             torch.randn(EXPERTS, HIDDEN, generator=generator) / HIDDEN ** 0.5) for _ in range(LAYERS)]


def reference_layers(router) -> list[dict[str, torch.Tensor]]:
    return [routed(x, x @ w.T) for x, w in router]


def test_identical_routing_agrees_everywhere(router):
    layers = reference_layers(router)
    diff = routing_diff(trace(layers), trace(layers))
    assert bool(diff) and diff.agreement == 1.0 and diff.first_structural is None
    assert diff.counts() == {"tokens": LAYERS * TOKENS, "agree": LAYERS * TOKENS, "order_only": 0, "flips": 0,
                             "near_ties": 0, "structural": 0, "unjudged": 0}
    assert diff.text() == "routing: 100% of 14 token-layers agree; weights on shared picks max|diff| 0"
    assert diff.error_source == "input" and diff.layers[0].error_at == layer_point(0, POST_ATTENTION_NORM)


def near_tied_router(x: torch.Tensor, token: int, gap: float):
    """A router matrix (E, C) whose experts 0 and 1 are the 2nd and 3rd picks at `token`, their logits `gap`
    apart on the input x and swapped on x rounded to f16: expert 1's row is expert 0's plus v, with
    v·x = -gap and v·(x16 - x) = 2·gap."""
    x16 = x.half().float()
    row, error = x[token].double(), (x16 - x)[token].double()
    basis = torch.stack([row, error])  # (2, C)
    a, b = torch.linalg.solve(basis @ basis.T, torch.tensor([-gap, 2 * gap], dtype=torch.float64))
    v = (a * row + b * error).float()  # (C,)
    w = torch.zeros(EXPERTS, HIDDEN)
    w[0] = row.float() / row.norm().float() * 0.5  # logit 0.5·|x|: below expert 2, above expert 3
    w[1] = w[0] + v
    w[2] = row.float() / row.norm().float() * 1.0
    w[3] = -w[2]
    return x16, w


def test_an_f16_perturbation_swapping_two_near_tied_experts_is_a_near_tie(router):
    x = router[0][0]
    x16, w = near_tied_router(x, token=3, gap=1e-4)
    reference, candidate = routed(x, x @ w.T), routed(x16, x16 @ w.T)
    ref_scores = reference[ROUTER_SCORES][3].double()
    assert 0 < ref_scores[0] - ref_scores[1] < 1e-4  # within 1e-4: a near-tie
    assert set(reference[TOP_K_INDEX][3].tolist()) == {2, 0} and set(candidate[TOP_K_INDEX][3].tolist()) == {2, 1}
    diff = routing_diff(trace([reference]), trace([candidate]))
    flip = next(f for f in diff.flips if f.token == 3)
    assert flip.kind == NEAR_TIE and flip.margin == pytest.approx(float(ref_scores[0] - ref_scores[1]), rel=1e-6)
    relative = float((x16 - x)[3].norm() / x[3].norm())  # f16's rounding of the router's input, about 1e-4
    assert 1e-5 < relative < 1e-3
    assert flip.error == pytest.approx(relative * float((x @ w.T)[3].abs().max()), rel=1e-5)
    assert flip.margin <= NEAR_TIE_FACTOR * flip.error
    assert bool(diff) and diff.counts()["structural"] == 0 and diff.counts()["near_ties"] >= 1
    assert diff.layers[0].status[3] == NEAR_TIE and diff.layers[0].agreement < 1


def structural_pair(router, input_error: float = 1e-6):
    """Reference and candidate whose layer 1 token 3 the reference sends to {0, 2} by a margin of 0.3 over
    expert 3, and the candidate to {0, 3}, on an input off by `input_error` (relative) only."""
    ref_layers, cand_layers = reference_layers(router), []
    x, w = router[1]
    logits = x @ w.T
    logits[3] = torch.tensor([0.45, 0.05, 0.40, 0.10]).log()  # the reference's scores at token 3
    ref_layers[1] = routed(x, logits)
    cand_logits = logits.clone()
    cand_logits[3] = torch.tensor([0.45, 0.05, 0.40, 0.60]).log()  # expert 3 raised: a wrong router
    cand_layers = [dict(ref_layers[0]), routed(x * (1 + input_error), cand_logits)]
    return ref_layers, cand_layers


def test_a_structural_flip_is_the_finding_at_its_layer_and_token(router):
    ref_layers, cand_layers = structural_pair(router)
    diff = routing_diff(trace(ref_layers), trace(cand_layers))
    first = diff.first_structural
    assert not diff and (first.layer, first.token, first.kind) == (1, 3, STRUCTURAL)
    assert (set(first.reference), set(first.candidate)) == ({0, 2}, {0, 3})
    scores = ref_layers[1][ROUTER_SCORES][3].double()
    assert first.margin == pytest.approx(float(scores[2] - scores[3]), rel=1e-6) == pytest.approx(0.3, rel=1e-5)
    assert first.error == pytest.approx(1e-6 * float(ref_layers[1][ROUTER_LOGITS][3].abs().max()), rel=1e-3)
    assert diff.counts()["structural"] == 1 and diff.layers[1].status[3] == STRUCTURAL
    assert "first structural flip: layer 1 token 3, experts {0,2} -> {0,3}, margin 0.3 >> error 3e-06" in diff.text()


def test_an_exact_tie_is_a_near_tie_even_without_any_error(router):
    x, w = router[0]
    logits = x @ w.T
    logits[5] = torch.tensor([2.0, 1.0, 1.0, -1.0])  # experts 1 and 2 tie exactly at the boundary
    reference = routed(x, logits)
    candidate = {**reference, TOP_K_INDEX: reference[TOP_K_INDEX].clone()}
    kept = 2 if int(reference[TOP_K_INDEX][5, 1]) == 1 else 1  # the tie broken the other way
    candidate[TOP_K_INDEX][5, 1] = kept
    diff = routing_diff(trace([reference]), trace([candidate]))
    (flip,) = diff.flips
    assert flip.margin == 0 and flip.kind == NEAR_TIE and bool(diff)
    assert diff.layers[0].margin[5] == 0  # the map's margin at the boundary


def tie_flipped_at_token_5(router, moved_token: int):
    """A reference and a candidate whose router swaps an exact tie at layer 0 token 5; the experts' output
    moved by 1.0 at `moved_token`, and the next layer's input (the flip carried on by attention) at 5 and 6."""
    x, w = router[0]
    logits = x @ w.T
    logits[5] = torch.tensor([2.0, 1.0, 1.0, -1.0])
    reference = {**routed(x, logits), "mlp.experts": x.clone()}
    candidate = {**reference, TOP_K_INDEX: reference[TOP_K_INDEX].clone(), "mlp.experts": x.clone()}
    candidate[TOP_K_INDEX][5, 1] = 2 if int(reference[TOP_K_INDEX][5, 1]) == 1 else 1
    candidate["mlp.experts"][moved_token] += 1.0
    after = {POST_ATTENTION_NORM: x.clone()}
    moved = {POST_ATTENTION_NORM: x.clone()}
    moved[POST_ATTENTION_NORM][5:] += 1.0
    return trace([reference, after]), trace([candidate, moved])


def test_past_a_near_tie_flip_only_the_tokens_before_it_are_judged(router):
    """Token 5 went to another expert on a tie: its rows from there on are the flip's, not a fault."""
    result = compare(*tie_flipped_at_token_5(router, moved_token=5))
    assert result.verdict == "match" and bool(result.routing) and result.routing.counts()["near_ties"] == 1
    experts = next(p for p in result.points if p.point == layer_point(0, "mlp.experts"))
    later = next(p for p in result.points if p.point == layer_point(1, POST_ATTENTION_NORM))
    for judged in (experts, later):
        assert judged.recorded and judged.rel_l2 == 0.0 and judged.shape == (TOKENS, HIDDEN)
        assert judged.reason == "judged on tokens 0-4: a near-tie flip at layer 0 token 5 sent it to other experts"
    weights = layer_point(0, TOP_K_WEIGHTS)  # the first point past the flip: aligned by slot, now other experts'
    assert f"routing: a near-tie flip at layer 0 token 5 sent that token to other experts on a noise-level " \
           f"margin; from {weights} on, 3 points are judged on the tokens before it and 0 not at all" in result.notes


def test_a_divergence_before_the_flipped_token_is_still_found_and_said_beside_the_flip(router):
    result = compare(*tie_flipped_at_token_5(router, moved_token=2))
    assert result.first_divergence.point == layer_point(0, "mlp.experts") and bool(result.routing)
    assert result.first_divergence.rel_l2 > 0.1  # the moved row 2 alone, within tokens 0-4
    assert any(note.startswith("the first divergence model.layers.0.mlp.experts follows 1 near-tie routing flip(s), "
                               "the first at layer 0 token 5") for note in result.notes)


def test_without_the_router_s_input_a_flip_where_the_logits_diverge_is_unjudged(router):
    ref_layers, cand_layers = structural_pair(router)
    for layers in (ref_layers, cand_layers):
        for layer in layers:
            del layer[POST_ATTENTION_NORM]
    result = compare(trace(ref_layers), trace(cand_layers))
    routing = result.routing
    assert routing.error_source == "logits" and routing.layers[1].error_at == layer_point(1, ROUTER_LOGITS)
    assert [flip.kind for flip in routing.flips] == [UNJUDGED] and routing.first_structural is None
    assert "(1 unjudged flip)" in routing.text() and routing.note() in result.notes
    alone = routing_diff(trace(ref_layers), trace(cand_layers))  # no verdicts given: judged by the logits' error
    assert alone.flips[0].error == pytest.approx(math.log(0.6 / 0.1), rel=1e-5) and alone.flips[0].kind == NEAR_TIE


def test_order_only_differences_are_counted_apart_from_flips(router):
    layers = reference_layers(router)
    candidate = [dict(layer) for layer in layers]
    candidate[1] = {**layers[1], TOP_K_INDEX: layers[1][TOP_K_INDEX].clone(),
                    TOP_K_WEIGHTS: layers[1][TOP_K_WEIGHTS].clone()}
    candidate[1][TOP_K_INDEX][2] = layers[1][TOP_K_INDEX][2].flip(0)  # same experts, other order
    candidate[1][TOP_K_WEIGHTS][2] = layers[1][TOP_K_WEIGHTS][2].flip(0)  # each weight still with its expert
    diff = routing_diff(trace(layers), trace(candidate))
    assert diff.counts()["order_only"] == 1 and diff.counts()["flips"] == 0 and diff.agreement == 1.0
    assert diff.layers[1].status[2] == ORDER and diff.weight_max_abs == 0  # matched by expert, not by slot
    assert "(1 order-only difference)" in diff.text()


def test_weights_differing_on_the_same_experts_agree_with_the_weight_error_said(router):
    layers = reference_layers(router)
    ignored = [routed(x, x @ w.T, renormalize=False) for x, w in router]  # norm_topk_prob ignored
    diff = routing_diff(trace(layers), trace(ignored))
    assert bool(diff) and diff.agreement == 1.0 and not diff.flips
    expected = max(float((a[TOP_K_WEIGHTS] - b[TOP_K_WEIGHTS]).abs().max()) for a, b in zip(layers, ignored))
    assert expected > 0.1 and diff.weight_max_abs == pytest.approx(expected)
    assert diff.layers[0].weight_max_abs == pytest.approx(float((layers[0][TOP_K_WEIGHTS]
                                                                 - ignored[0][TOP_K_WEIGHTS]).abs().max()))


def test_compare_carries_the_routing_diff_and_leaves_the_ids_to_it(router):
    ref_layers, cand_layers = structural_pair(router)
    result = compare(trace(ref_layers), trace(cand_layers))
    index = next(p for p in result.points if p.point == layer_point(1, TOP_K_INDEX))
    assert not index.recorded and index.rel_l2 is None and index.reason == INTEGER_POINT
    assert result.routing.first_structural.token == 3 and result.verdict == "diverged"
    routing = result.to_dict()["routing"]
    assert routing["structural"] == routing["flips"] == 1 and routing["tokens"] == 14
    assert routing["agreement"] == pytest.approx(13 / 14) and routing["error_source"] == "input"
    first = {key: value for key, value in routing["first_structural"].items() if key != "inherits"}
    assert routing["flipped"] == [first]
    assert routing["first_structural"]["layer"] == 1 and routing["first_structural"]["candidate"] == [3, 0]
    assert routing["layers"][1]["status"][3] == STRUCTURAL
    assert routing["layers"][1]["margin"][3] == pytest.approx(0.3, rel=1e-5)
    assert routing["layers"][0]["agreement"] == 1.0 and routing["layers"][1]["agreement"] == pytest.approx(6 / 7)


def test_a_structural_flip_downstream_of_the_first_divergence_inherits_it(router):
    ref_layers, cand_layers = structural_pair(router, input_error=1e-3)  # the input already diverges
    result = compare(trace(ref_layers), trace(cand_layers))
    assert result.first_divergence.point == layer_point(1, POST_ATTENTION_NORM)
    assert result.routing.inherits == layer_point(1, POST_ATTENTION_NORM)
    assert "(inherits the first divergence at model.layers.1.post_attention_layernorm" in result.routing.text()


def test_a_dense_comparison_has_no_routing(router):
    x = router[0][0]
    dense = Trace({layer_point(0, POST_ATTENTION_NORM): x}, TraceMeta(engine="test", variant={}, tokens=[1] * 7))
    result = compare(dense, dense)
    assert result.routing is None and result.to_dict()["routing"] is None


@pytest.fixture(scope="module")
def structural_summary(router):
    """A compared pair with one structural flip (layer 1, token 3), as its summary dict."""
    ref_layers, cand_layers = structural_pair(router)
    return compare(trace(ref_layers), trace(cand_layers)).to_dict(), ref_layers, cand_layers


def boundary_margins(layer: dict[str, torch.Tensor]) -> list[float]:
    """The reference's k-th minus (k+1)-th score per token, computed here apart from the diff."""
    top = layer[ROUTER_SCORES].double().topk(K + 1, dim=-1).values
    return (top[:, K - 1] - top[:, K]).tolist()


def test_the_summary_line_and_the_markdown_table_carry_the_routing(structural_summary):
    summary, ref_layers, cand_layers = structural_summary
    line = ("routing: 92.9% of 14 token-layers agree; first structural flip: layer 1 token 3, experts {0,2} -> "
            "{0,3}, margin 0.3 >> error 3e-06")
    assert line in terminal_summary(summary).replace("\n      ", " ")
    weights = ref_layers[1][TOP_K_WEIGHTS][3], cand_layers[1][TOP_K_WEIGHTS][3]
    reference_weights = dict(zip(ref_layers[1][TOP_K_INDEX][3].tolist(), weights[0].tolist()))
    candidate_weights = dict(zip(cand_layers[1][TOP_K_INDEX][3].tolist(), weights[1].tolist()))
    shared = abs(reference_weights[0] - candidate_weights[0])  # expert 0, picked by both: renormalized apart
    markdown = markdown_summary(summary)
    assert f"| 1 | 85.7% of 7 | 1 | 0 | 1 | 0 | {fmt(shared)} |" in markdown
    assert "| 0 | 100% of 7 | 0 | 0 | 0 | 0 | 0 |" in markdown and "  1 `···S···`" in markdown


def test_the_html_map_holds_each_margin_and_marks_the_structural_flip(structural_summary):
    summary, ref_layers, _ = structural_summary
    page = render_html(summary, images={})
    assert "<th>routing</th><td>92.9% of 14 token-layers agree; first structural flip: layer 1 token 3" in page
    section = page.split('<h2 id="routing">')[1].split("</table>")[0]
    rows = section.split('<tr data-layer="')[1:]
    assert len(rows) == LAYERS
    for row, layer in zip(rows, ref_layers):
        cells = re.findall(r'<td class="(\w+)( first)?"[^>]*>([^<]*)</td>', row)
        assert [text for _, _, text in cells] == [fmt(m) for m in boundary_margins(layer)]
    cells = re.findall(r'<td class="(\w+)( first)?"[^>]*>([^<]*)</td>', rows[1])
    assert cells[3] == (STRUCTURAL, " first", "0.3") and {c[0] for i, c in enumerate(cells) if i != 3} == {"agree"}


def test_the_routing_figure_draws_each_cell_s_status(structural_summary):
    summary, _, _ = structural_summary
    assert "routing.png" in figure_names(summary)
    drawn = routing_figure(summary).axes[0].images[0].get_array()
    expected = np.zeros((LAYERS, TOKENS))
    expected[1, 3] = list(STATUS).index(STRUCTURAL)
    assert np.array_equal(np.asarray(drawn), expected)


def test_a_dense_report_shows_no_routing(router):
    dense = Trace({layer_point(0, POST_ATTENTION_NORM): router[0][0]},
                  TraceMeta(engine="test", variant={}, tokens=[1] * TOKENS))
    summary = compare(dense, dense).to_dict()
    assert "routing.png" not in figure_names(summary)
    assert "routing" not in markdown_summary(summary) and 'id="routing"' not in render_html(summary, images={})


def test_the_notebook_view_and_plot_carry_the_routing(structural_summary):
    summary, _, _ = structural_summary
    view = reports.result_html(summary, figure=False)
    assert "routing: layers × tokens" in view and 'class="structural first"' in view
    assert reports.plot(summary, "routing").axes[0].images[0].get_array()[1, 3] == list(STATUS).index(STRUCTURAL)


def test_a_long_run_s_candidate_keeps_the_routing_points_for_the_diff(router, tmp_path):
    ref_layers, cand_layers = structural_pair(router)
    reference = trace(ref_layers)
    recorder = ErrorRecorder(reference, store=DiskRecorder(tmp_path))
    for name, tensor in trace(cand_layers).tensors.items():
        recorder(name, tensor[None])  # as a forward records: with its batch axis
    candidate = Trace(recorder.tensors, trace(cand_layers).meta)
    norm = layer_point(1, POST_ATTENTION_NORM)
    assert norm in candidate and norm not in recorder.store.files  # compared as it came, not kept
    assert {layer_point(1, sub) for sub in (TOP_K_INDEX, ROUTER_SCORES, ROUTER_LOGITS)} <= set(recorder.store.files)
    diff = routing_diff(reference, candidate)
    assert diff.error_source == "logits" and diff.counts()["flips"] == 1
    assert torch.equal(candidate[layer_point(1, TOP_K_INDEX)], cand_layers[1][TOP_K_INDEX])
