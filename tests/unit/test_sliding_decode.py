"""`--decode` past a sliding window (docs/decode.md "Sliding windows: ring buffers"): transformers decodes
with its `DynamicSlidingWindowLayer`, the reimplementation with a ring of the window's slots; both
caches are compared as the ring (slot = the n-th token taken modulo the window), and each ring mistake
is found at its step and point: a tiny Gemma 2 (sliding layers 0 and 2) with a window of 8 keys, a
6-token prompt and 12 decode steps (positions 6..17: the ring wraps at position 8, decode step 3)."""

from __future__ import annotations

import pytest
import torch

import tracer
from tests.families import write_tiny_family
from tracer.comparison.diff import rel_l2_by_point
from tracer.comparison.steps import decoded_steps, step_floors
from tracer.engines.load import resolve_and_load
from tracer.files.sources import resolve_source
from tracer.model.kv_cache import KVCache, fill_slot, ring_slots
from tracer.model.points import CACHE_K, CACHE_V, K_ROPE, PROBS, layer_point
from tracer.reports.terminal import steps_line
from tracer.traces.trace import Trace

WINDOW, PROMPT, STEPS = 8, [3, 4, 5, 6, 7, 8], 12
WRAP = WINDOW - len(PROMPT) + 1  # the decode step whose token (position 8) takes the ring's slot 0 again


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return write_tiny_family(tmp_path_factory.mktemp("gemma2") / "m", "gemma2", sliding_window=WINDOW)


def run(model, variant=None, prompt=PROMPT, steps=STEPS):
    return tracer.run(model, tokens=prompt, decode=steps, greedy=0, variant=variant, noise_floor=False,
                      progress=False)


def test_a_decode_past_the_window_matches_at_every_step_and_point(gemma2):
    result = run(gemma2)
    assert result.verdict == "match" and len(result.steps) == STEPS + 1
    assert all(step.verdict == "match" and step.points > 0 for step in result.steps)
    assert [step.position for step in result.steps] == [0, *range(len(PROMPT), len(PROMPT) + STEPS)]
    # the same ops on the same keys in the same order: bitwise, the ring's points included
    assert all(error == 0.0 for step in result.steps for error in step.layer_max_rel_l2 if error is not None)


@pytest.mark.parametrize("engine", ["hf", "reimpl"])
def test_each_cache_is_laid_out_as_the_ring(gemma2, engine):
    """Slot n % W holds the n-th token's keys: after the wrap slot 0 holds position 8's, and the full layer
    (1) keeps every position in order; the step attends to exactly the window's keys."""
    decoded = resolve_and_load(engine, resolve_source(str(gemma2), False), {}).decode(PROMPT, STEPS, forced=[9] * STEPS)
    sliding, full = layer_point(0, CACHE_K), layer_point(1, CACHE_K)
    before, wrap, last = decoded.steps[WRAP - 2], decoded.steps[WRAP - 1], decoded.steps[-1]
    heads = before[sliding].shape[0]
    assert before[sliding].shape[1] == WINDOW and wrap[sliding].shape[1] == WINDOW
    assert torch.equal(wrap[sliding][:, 0], wrap[layer_point(0, K_ROPE)][:, 0])  # the new token: slot 0
    assert torch.equal(wrap[sliding][:, 1:], before[sliding][:, 1:])  # positions 1..7 stay in their slots
    assert last[sliding].shape == (heads, WINDOW, before[sliding].shape[2])
    assert last[full].shape[1] == len(PROMPT) + STEPS
    assert last[layer_point(0, PROBS)].shape[-1] == WINDOW  # the window's keys, itself included


def test_the_floor_of_a_ring_is_its_uncached_forward_within_f32_rounding(gemma2):
    """Each step's ring against the same slots of the uncached forward (the window's last keys of the
    scores and probs): f32 rounding only; a ring read one slot off is not."""
    engine = resolve_and_load("hf", resolve_source(str(gemma2), False), {})
    decoded = engine.decode(PROMPT, STEPS)
    uncached = engine.record(PROMPT + [step.tokens[0] for step in decoded.steps])
    gaps = step_floors(decoded, uncached, None)
    for step, gap in zip(decoded_steps(decoded), gaps):
        assert {layer_point(0, CACHE_K), layer_point(0, PROBS)} <= set(gap)
        assert max(gap.values()) < 1e-5, step.meta.position_offset
    wrap = decoded.steps[WRAP - 1]
    rolled = Trace({layer_point(0, CACHE_K): wrap[layer_point(0, CACHE_K)].roll(1, dims=1)}, wrap.meta)
    assert rel_l2_by_point(wrap, rolled)[layer_point(0, CACHE_K)] > 0.1


def test_ring_slots_is_the_rule_on_a_cache_kept_in_position_order():
    held = torch.arange(5.0, 12.0).reshape(1, 7, 1)  # (KV, S, D): positions 5..11, each value its position
    assert ring_slots(held, 12, 4)[0, :, 0].tolist() == [8.0, 9.0, 10.0, 11.0]  # tokens 8..11: slots 0..3
    assert ring_slots(held, 11, 4)[0, :, 0].tolist() == [9.0, 10.0, 11.0, 8.0]  # tokens 7..10: slots 3, 0, 1, 2
    assert ring_slots(held[:, :3], 3, 4)[0, :, 0].tolist() == [5.0, 6.0, 7.0]  # within the window: as held


def test_a_ring_keeps_a_long_prefill_s_last_window_and_the_fill_rule_never_wraps():
    cache = KVCache(1, [4])
    keys = torch.arange(6.0).reshape(1, 1, 6, 1)  # (1, KV, T, D): positions 0..5, each key its position
    attended, _, at = cache.update(0, keys, keys, torch.arange(6))
    assert attended.flatten().tolist() == [0, 1, 2, 3, 4, 5]  # a prefill attends to every key (its mask: the window)
    assert cache.keys[0].flatten().tolist() == [4, 5, 2, 3]  # tokens 2..5 in slots 2, 3, 0, 1
    step = torch.full((1, 1, 1, 1), 6.0)
    attended, _, at = cache.update(0, step, step, torch.tensor([6]))
    assert at.tolist() == [3, 4, 5, 6] and attended.flatten().tolist() == [3, 4, 5, 6]  # the window, in order
    assert cache.keys[0].flatten().tolist() == [4, 5, 6, 3] and cache.positions[0].tolist() == [4, 5, 6, 3]
    wrong = KVCache(1, [4], fill_slot)
    for position in range(6):
        one = torch.full((1, 1, 1, 1), float(position))
        wrong.update(0, one, one, torch.tensor([position]))
    assert wrong.keys[0].flatten().tolist() == [0, 1, 2, 5]  # its last slot written by 3, 4 and 5


@pytest.mark.parametrize("variant, prompt, step, point, hint", [
    ("ring_index=fill", PROMPT, WRAP, layer_point(0, CACHE_K), "ring buffer wraps at this step"),
    ("cache_reset=kept", PROMPT, 1, layer_point(0, CACHE_K), "left over from another prompt"),
    # the ring's 8 keys and its own: position 0 is a window back from position 8
    ("window_mask=wide", PROMPT, WRAP, layer_point(0, PROBS), "one key too wide"),
    # a port without the window keeps and attends to every key: compared on the window's slots and keys
    # (`tracer.model.kv_cache.SlotLayout`), it parts where it attends past the window
    ("window=ignore", PROMPT, WRAP, layer_point(0, PROBS), "the mask over the cached keys differs"),
])
def test_each_ring_knob_is_found_at_its_step_and_point(gemma2, variant, prompt, step, point, hint):
    result = run(gemma2, variant, prompt, step + 1)
    assert result.verdict == "diverged" and result.step == step
    # the ring's hint comes first; a cache read slot by slot says what it holds before the general hint
    hints = result.first_divergence.hints
    assert result.first_divergence.point == point and hint in (hints[0] if "ring" in hint else " ".join(hints))
    if point.endswith(CACHE_K):  # the values' ring is laid out by the same rule: it shows there too
        assert next(p for p in result.points if p.point == layer_point(0, CACHE_V)).diverged
    assert all(s.verdict == "match" for s in result.steps[:step])
    assert f"first divergence: {'the cached prefill' if step == 0 else f'decode step {step}'}" in \
        steps_line(result.to_dict())


def test_the_ring_knobs_need_a_window(tiny_llama):
    with pytest.raises(tracer.TracerError, match="knob 'ring_index' does not apply to llama models; it applies to "
                                                 "qwen2, qwen3, mistral, gemma2"):
        run(tiny_llama(), "ring_index=fill", steps=1)



@pytest.mark.parametrize("family", ["qwen2", "gemma3", "phi3"])
def test_every_sliding_family_decodes_past_its_window(family, tmp_path):
    """Qwen2 (windows from max_window_layers on), Gemma 3 (the local RoPE base), Phi-3 (every layer), with
    the families' window of 4 keys: 2 + 4 tokens wrap each ring."""
    model = write_tiny_family(tmp_path / family, family)
    result = tracer.run(model, tokens=[1, 17], decode=4, greedy=0, noise_floor=False, progress=False)
    assert result.verdict == "match" and len(result.steps) == 5


def test_hf_refuses_in_one_line_a_cache_window_its_attention_does_not_mask(tmp_path):
    """A Llama config whose layer_types mark a sliding layer (read by mlx-lm's Llama) makes transformers'
    cache slide there while its Llama attention masks every key: past the window its eager attention
    fails on the mask's width, so hf's decode says so in one line; within the window it decodes."""
    from tests.conftest import TOKENS, write_tiny_llama
    from tracer.core.errors import TracerError

    model = write_tiny_llama(tmp_path / "m", layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    engine = resolve_and_load("hf", resolve_source(str(model), False), {})
    with pytest.raises(TracerError) as refused:
        engine.decode(TOKENS, 2)
    assert str(refused.value) == "--decode: transformers' llama caches layer 0 as a 4-key window but masks none: " \
                                 "decode within it"
    assert len(engine.decode(TOKENS[:2], 2).steps) == 2
