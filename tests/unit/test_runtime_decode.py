"""`--decode N` on the live runtimes, each with its own cache, on a tiny random Llama: mlx (mlx-lm's
`KVCache`) and candle (candle-transformers' `Cache`, in the isolated child, llama.rs on the directory
and quantized_llama.rs on a GGUF). Each step matches transformers' cached decode, the cache points
included; a deliberately wrong position (reimpl's `decode_positions=restart`) diverges at decode
step 1, layer 0's `q_rope`."""

from __future__ import annotations

import pytest
import torch

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tests.ggml_gguf import write_quantized_gguf
from tracer.comparison.diff import rel_l2_by_point
from tracer.comparison.steps import StepNoise, compare_steps, decoded_steps, step_floors
from tracer.core.errors import TracerError
from tracer.engines.isolated import IsolatedEngine
from tracer.engines.load import resolve_and_load
from tracer.engines.registry import ENGINES
from tracer.files.sources import resolve_source
from tracer.model.points import CACHE_K, CACHE_V, CONTEXT, K_ROPE, LOGITS, Q_ROPE, layer_point
from tracer.pipeline.decode import decoded_tokens
from tracer.traces.trace import Trace

STEPS = 4
HEAD_DIM, KV_HEADS = 16, 2  # write_tiny_llama's


def runtime(engine: str) -> None:
    if ENGINES[engine].missing_runtime():
        pytest.skip(f"{engine}'s runtime is not installed")
    if engine == "candle":
        from tracer.engines.candle import check_platform

        try:
            check_platform()
        except TracerError as exc:
            pytest.skip(str(exc))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "m", rope_theta=500.0)


@pytest.fixture(scope="module")
def references(llama_dir):
    """hf's greedy decode with its DynamicCache (the truth), and reimpl's on the same tokens with the step's
    positions restarting at 0 after the prompt (a deliberately wrong position)."""
    source = resolve_source(str(llama_dir), False)
    truth = resolve_and_load("hf", source, {}).decode(TOKENS, STEPS)
    wrong = resolve_and_load("reimpl", source, {"decode_positions": "restart"}).decode(
        TOKENS, STEPS, forced=decoded_tokens(truth))
    return truth, wrong


@pytest.mark.parametrize("engine", ["mlx", "candle"])
def test_a_runtime_decodes_with_its_own_cache_and_matches_every_step(llama_dir, references, engine):
    runtime(engine)
    truth, wrong = references
    loaded = resolve_and_load(engine, resolve_source(str(llama_dir), False), {})
    assert isinstance(loaded, IsolatedEngine) == (engine == "candle")  # candle's cache lives in its child
    candidate = loaded.decode(TOKENS, STEPS, forced=decoded_tokens(truth))
    assert [step.tokens for step in candidate.steps] == [step.tokens for step in truth.steps]
    assert [step.meta.position_offset for step in candidate.steps] == list(range(len(TOKENS), len(TOKENS) + STEPS))
    for number, step in enumerate(decoded_steps(candidate)):  # the cache grows one slot a step, keys after RoPE
        slots = len(TOKENS) + number
        assert step[layer_point(1, CACHE_K)].shape == step[layer_point(1, CACHE_V)].shape == (KV_HEADS, slots, HEAD_DIM)
        assert step[layer_point(1, K_ROPE)].equal(step[layer_point(1, CACHE_K)][:, -len(step.tokens):])
    compared = compare_steps(truth, candidate)  # the fixed bound, 1e-4 rel_l2
    assert [summary.verdict for summary, _ in compared] == ["match"] * (STEPS + 1)
    for summary, result in compared:
        judged = {p.point for p in result.points if p.recorded}
        assert {layer_point(i, point) for i in range(2) for point in (CACHE_K, CACHE_V, Q_ROPE)} <= judged
        assert 0 < max(p.rel_l2 for p in result.points if p.recorded) < 1e-5
        assert summary.candidate_pick == summary.reference_pick
    # the same decode against one given the wrong position: the prefill agrees, decode step 1 does not, at RoPE
    against_wrong = compare_steps(wrong, candidate)
    assert against_wrong[0][0].verdict == "match"
    assert against_wrong[1][0].first_divergence.point == layer_point(0, Q_ROPE)


def test_run_decode_on_mlx_matches_within_the_floor(llama_dir):
    runtime("mlx")
    result = tracer.run(llama_dir, tokens=TOKENS, candidate="mlx", decode=STEPS, greedy=0, progress=False)
    assert result.verdict == "match" and result.step is None and len(result.steps) == STEPS + 1
    assert all(step.verdict == "match" and step.candidate_pick == step.reference_pick for step in result.steps)


def test_candle_decodes_a_gguf_with_its_cache_as_its_own_uncached_forward(llama_dir, tmp_path):
    """quantized_llama.rs: each step's points within rounding of candle's own uncached forward at that
    position, the cache's keys back in HF's order (the GGUF's q/k rows are permuted), and a step at the
    position before is not."""
    runtime("candle")
    gguf_file = write_quantized_gguf(llama_dir, tmp_path / "tiny-q8_0.gguf", projections="q8_0")
    engine = resolve_and_load(f"candle:{gguf_file}", resolve_source(str(llama_dir), False), {})
    decoded = engine.decode(TOKENS, STEPS)
    sequence = TOKENS + decoded_tokens(decoded)
    uncached = engine.record(sequence)  # (T, ...) rows: every step's position without a cache
    for step in decoded.steps:
        row = step.meta.position_offset
        keys = uncached[layer_point(1, K_ROPE)]  # (KV, T, D)
        assert rel_l2_by_point(step, Trace({layer_point(1, CACHE_K): keys[:, :row + 1]}, step.meta))[
            layer_point(1, CACHE_K)] < 1e-5
        assert rel_l2_by_point(step, Trace({LOGITS: uncached[LOGITS][row:row + 1]}, step.meta))[LOGITS] < 1e-4
    first = decoded.steps[0]
    before = uncached[layer_point(0, K_ROPE)][:, len(TOKENS) - 1:len(TOKENS)]  # (KV, 1, D): the position before
    wrong = Trace({layer_point(0, K_ROPE): before}, first.meta)
    assert rel_l2_by_point(first, wrong)[layer_point(0, K_ROPE)] > 0.1


def test_each_step_is_floored_by_the_f64_rounding_of_its_own_rows(llama_dir, references):
    """`StepNoise`: an f64 run over the whole sequence, compared as it comes at each step's rows with the
    reference's f32 uncached forward; each step's floor is at least that."""
    truth, _ = references
    source = resolve_source(str(llama_dir), False)
    sequence = TOKENS + decoded_tokens(truth)
    uncached = resolve_and_load("hf", source, {}).record(sequence)
    noise = StepNoise(truth, uncached)
    f64 = resolve_and_load("reimpl", source, {"dtype": "f64"})
    f64.record(sequence, noise)
    exact = f64.record(sequence)  # kept whole, to check the rows the recorder compared
    assert len(noise.noise) == STEPS + 1
    for number, (step, own) in enumerate(zip(decoded_steps(truth), noise.noise)):
        assert set(own) == set(step.points) - set(step.not_recorded)
        row = step.meta.position_offset or 0
        last = row + len(step.tokens)
        for point, rows in ((LOGITS, slice(row, last)), (layer_point(1, K_ROPE), (slice(None), slice(row, last)))):
            expected = rel_l2_by_point(Trace({point: exact[point][rows]}, step.meta),
                                       Trace({point: uncached[point][rows]}, step.meta))[point]
            assert own[point] == pytest.approx(expected, rel=1e-9) and 0 < own[point] < 1e-5
        cache = layer_point(1, CACHE_K)  # the cache: every slot up to the step's last token
        expected = rel_l2_by_point(Trace({cache: exact[layer_point(1, K_ROPE)][:, :last]}, step.meta),
                                   Trace({cache: uncached[layer_point(1, K_ROPE)][:, :last]}, step.meta))[cache]
        assert own[cache] == pytest.approx(expected, rel=1e-9)
    floors = step_floors(truth, uncached, None, noise.noise)
    assert all(floor[point] >= own[point] for floor, own in zip(floors, noise.noise) for point in own)


def test_mlx_decodes_a_sliding_layer_with_its_rotating_cache_within_the_window(tmp_path):
    """mlx-lm's Llama makes a RotatingKVCache for a layer its config marks sliding: within the window it
    holds every slot in order and matches transformers' cached decode."""
    runtime("mlx")
    model = write_tiny_llama(tmp_path / "m", rope_theta=500.0, layer_types=["sliding_attention", "full_attention"],
                             sliding_window=16)
    source = resolve_source(str(model), False)
    engine = resolve_and_load("mlx", source, {})
    assert type(engine.model.make_cache()[0]).__name__ == "RotatingKVCache"
    truth = resolve_and_load("hf", source, {}).decode(TOKENS, STEPS)
    candidate = engine.decode(TOKENS, STEPS, forced=decoded_tokens(truth))
    assert [summary.verdict for summary, _ in compare_steps(truth, candidate)] == ["match"] * (STEPS + 1)
    assert candidate.steps[-1][layer_point(0, CACHE_K)].shape == (KV_HEADS, len(TOKENS) + STEPS, HEAD_DIM)


def test_mlx_reads_its_rotating_cache_past_the_window_as_the_ring(tmp_path):
    """Past a window of 4 keys (a 7-token prompt), mlx-lm keeps the prompt whole, then trims it to its last 4
    and writes the next token at its own slot 0; read in temporal order and laid out by the ring rule, its
    cache is the reimplementation's whole cache laid out as the same ring (f32 rounding apart) at every
    step. transformers' Llama and the reimplementation read no window, so the layer's attention parts from
    mlx-lm's at layer 0 (its context: mlx fuses scores and probabilities)."""
    runtime("mlx")
    window = 4
    model = write_tiny_llama(tmp_path / "m", rope_theta=500.0, layer_types=["sliding_attention", "full_attention"],
                             sliding_window=window)
    source = resolve_source(str(model), False)
    whole = resolve_and_load("reimpl", source, {}).decode(TOKENS, STEPS)
    ring = resolve_and_load("mlx", source, {}).decode(TOKENS, STEPS, forced=decoded_tokens(whole))
    cache_k, cache_v = layer_point(0, CACHE_K), layer_point(0, CACHE_V)
    for number, step in enumerate(decoded_steps(ring)):
        written = len(TOKENS) + number  # tokens the cache took
        assert step[cache_k].shape == (KV_HEADS, window, HEAD_DIM)
        own = (written - 1) % window  # the ring's slot of the step's last token
        assert torch.equal(step[cache_k][:, own], step[layer_point(0, K_ROPE)][:, -1])
    compared = compare_steps(whole, ring)
    for summary, result in compared:
        by_point = {p.point: p for p in result.points}
        assert by_point[cache_k].recorded and by_point[cache_k].rel_l2 < 1e-6, summary.step
        assert by_point[cache_v].recorded and by_point[cache_v].rel_l2 < 1e-6, summary.step
        assert result.first_divergence.point == layer_point(0, CONTEXT), summary.step
        assert any("where the candidate keeps a ring of 4 slots" in note for note in result.notes)
