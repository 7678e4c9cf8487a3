"""The slot layout every comparison reads caches in (`tracer.model.kv_cache.SlotLayout`, applied by
`tracer.comparison.diff.compare`): a ring and a whole cache of the same keys compare slot for slot, the
attention over more keys is read at the other side's last keys, and caches that are neither are not
compared, with a note. End to end: `window=ignore` (a port without the sliding window, which keeps and
attends to every key) on a tiny Mistral and a tiny Gemma 3 (windows of 4 keys) diverges first at layer
0's probabilities on a prompt longer than the window, whichever comparison meets the caches: the prompt's
own (`--greedy 0`), the greedy check's flip step (each side's cached decode), every decode step
(`--decode 2`); within the window it matches."""

from __future__ import annotations

import json

import pytest
import torch

import tracer
from tests.families import WINDOW, write_tiny_family
from tracer.comparison.diff import compare
from tracer.model.kv_cache import SlotLayout, ring_slots
from tracer.model.points import CACHE_K, CACHE_V, K_ROPE, PROBS, SCORES, layer_point
from tracer.traces.trace import Trace, TraceMeta

LONG, SHORT = [3, 4, 5, 6, 7, 8], [3, 4]  # longer than the window of 4 keys; within it, 2 decode steps included
PROBS_0 = layer_point(0, PROBS)


def positions(count: int, start: int = 0) -> torch.Tensor:
    """(KV=1, count, D=1): each slot's value its token's position, so a layout reads as a list of positions."""
    return torch.arange(float(start), float(start + count)).reshape(1, count, 1)


def test_a_whole_cache_is_laid_out_as_the_other_side_s_ring():
    layout = SlotLayout(written=7, rows=1)  # 7 tokens taken, the last one this forward's
    ring = ring_slots(positions(7), 7, 4)  # tokens 3..6 in slots 3, 0, 1, 2
    assert ring.flatten().tolist() == [4, 5, 6, 3]
    ref, cand = layout.pair(layer_point(0, CACHE_K), ring, positions(7))
    assert torch.equal(ref, ring) and torch.equal(cand, ring)
    ref, cand = layout.pair(layer_point(0, CACHE_V), positions(7), ring)  # the other way round
    assert torch.equal(ref, ring) and torch.equal(cand, ring)
    assert layout.notes() == [
        "self_attn.cache_k of layer 0: the candidate keeps every token (7) where the reference keeps a ring of 4 "
        "slots (a sliding window's): compared on the ring's slots",
        "self_attn.cache_v of layer 0: the reference keeps every token (7) where the candidate keeps a ring of 4 "
        "slots (a sliding window's): compared on the ring's slots"]


def test_attention_over_more_keys_is_read_at_the_other_side_s_last_keys():
    layout = SlotLayout(written=7, rows=1)
    window = torch.arange(4.0).reshape(1, 1, 4)  # (H, T, S): one query over the last 4 keys
    every = torch.arange(7.0).reshape(1, 1, 7)  # over all 7
    for point in (layer_point(0, SCORES), PROBS_0, layer_point(2, SCORES), layer_point(2, PROBS)):
        ref, cand = layout.pair(point, window, every)
        assert torch.equal(ref, window) and cand.flatten().tolist() == [3, 4, 5, 6]
    assert layout.notes() == ["self_attn.scores, self_attn.probs of layers 0, 2: the candidate attends to 7 keys "
                              "where the reference attends to 4: compared on the last 4 (the same positions)"]
    # a forward from an empty cache attends to its own keys on every side: nothing there to read otherwise
    prefill = SlotLayout(written=7, rows=7)
    assert [t.shape for t in prefill.pair(PROBS_0, window, every)] == [window.shape, every.shape]
    assert not prefill.notes()


def test_caches_that_are_neither_a_ring_nor_whole_are_not_compared_and_said_so():
    layout = SlotLayout(written=7, rows=1)
    why = layout.pair(layer_point(1, CACHE_K), positions(4), positions(6, 1))
    assert why == "the reference's cache holds 4 slots and the candidate's 6 after 7 tokens: neither keeps every token"
    heads = layout.pair(layer_point(1, CACHE_V), positions(4), torch.zeros(2, 4, 1))
    assert heads == "the caches hold other heads or head sizes: reference (1, 4, 1), candidate (2, 4, 1)"
    assert layout.notes() == [f"self_attn.cache_k of layer 1 not compared: {why}",
                              f"self_attn.cache_v of layer 1 not compared: {heads}"]
    assert SlotLayout(written=None, rows=None).pair(CACHE_K, positions(4), positions(7)).endswith(
        "and the traces do not say how many tokens they took")


def test_compare_says_which_cache_points_it_could_not_compare():
    """The point is in the result, not compared, with its reason; the rest of the comparison stands."""
    meta = TraceMeta(engine="reimpl", tokens=[9], position_offset=6)  # decode step 1 after a 6-token prompt
    keys = layer_point(0, K_ROPE)
    reference = Trace({keys: torch.ones(1, 1, 2), layer_point(0, CACHE_K): positions(4)}, meta)
    candidate = Trace({keys: torch.ones(1, 1, 2), layer_point(0, CACHE_K): positions(5, 2)}, meta)
    result = compare(reference, candidate)
    cache = next(p for p in result.points if p.point == layer_point(0, CACHE_K))
    assert not cache.recorded and cache.missing_on == "neither"
    assert cache.reason == "the reference's cache holds 4 slots and the candidate's 5 after 7 tokens: neither " \
                           "keeps every token"
    assert f"self_attn.cache_k of layer 0 not compared: {cache.reason}" in result.notes
    assert result.verdict == "match" and [p.point for p in result.points if p.recorded] == [keys]


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def windowed(request, tmp_path_factory):
    family = request.param
    return family, write_tiny_family(tmp_path_factory.mktemp(family) / "m", family)


def run(model, tokens, **request):
    return tracer.run(model, tokens=tokens, variant="window=ignore", noise_floor=False, progress=False, **request)


@pytest.mark.parametrize("request_", [{}, {"greedy": 0}, {"decode": 2}], ids=["greedy", "greedy 0", "decode 2"])
def test_window_ignored_diverges_first_at_layer_0_probs_past_the_window(windowed, request_):
    _, model = windowed
    result = run(model, LONG, **request_)
    assert len(LONG) > WINDOW and result.verdict == "diverged"
    assert result.first_divergence.point == PROBS_0 and result.step is None  # the prompt's own comparison
    if "greedy" not in request_:  # the check's flip step, on each side's cache, reads the same point
        assert result.greedy.first_flip_divergence.point == PROBS_0
    for step in result.steps:  # every decode step diverges there too (the cached prefill's caches included)
        assert step.first_divergence.point == PROBS_0


@pytest.mark.parametrize("request_", [{}, {"greedy": 0}, {"decode": 2}], ids=["greedy", "greedy 0", "decode 2"])
def test_window_ignored_matches_within_the_window(windowed, request_):
    _, model = windowed
    result = run(model, SHORT, **request_)
    assert len(SHORT) + request_.get("decode", 0) <= WINDOW
    assert result.verdict == "match" and all(step.verdict == "match" for step in result.steps)
    if "greedy" not in request_:  # the continuation runs past the window: the check sees where it parts
        # the k-th token is picked at position len(SHORT) + k - 2: the first that parts is past the window
        assert len(SHORT) + result.greedy.first_flip - 2 >= WINDOW
        assert result.greedy.first_flip_divergence.point == PROBS_0


def test_cli_window_ignored_past_the_window(windowed, capsys):
    from tracer.cli import main

    _, model = windowed
    code = main(["run", "--model", str(model), "--tokens", ",".join(map(str, LONG)), "--variant", "window=ignore",
                 "--no-noise", "--no-report", "--json", "-"])
    out, err = capsys.readouterr()
    payload = json.loads(out)
    assert code == 0 and not err
    assert payload["verdict"] == "diverged" and payload["first_divergence"]["point"] == PROBS_0
    assert payload["greedy"]["first_flip_divergence"]["point"] == PROBS_0
