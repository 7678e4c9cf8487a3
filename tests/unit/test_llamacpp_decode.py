"""llama.cpp's cached decode (`--decode N` on the llamacpp engine), in its child process: the prompt's
prefill into a cleared KV cache, then one `llama_decode` per token at `n_past`, every step's graph
recorded, its cache read as a point; explicit positions (the batch's `pos`); and the same decode in
llama.cpp's bit-exact regime, where tracer's model decodes with a cache stored as llama.cpp stores it.

Tiny random Llama (tests/conftest.py) as an f32 GGUF (tests/tiny_gguf.py) and as the bundled
SmolLM2's Q4_1/Q8_0 mix (tests/ggml_gguf.py). Measured here: with every exact switch (f32 file and
cache, flash attention off) every point of every step within rel_l2 1e-6 of transformers' cached
decode; in the regime every point of every step exactly 0.
"""

from __future__ import annotations

import pytest
import torch

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tests.cpu_builds import skip_unless_exact_here, this_cpu_caveats
from tests.ggml_gguf import quantized_models
from tests.tiny_gguf import write_tiny_gguf
from tracer.comparison.steps import compare_steps
from tracer.core.errors import TracerError
from tracer.engines.isolated import IsolatedEngine
from tracer.engines.load import resolve_and_load
from tracer.engines.registry import EngineRef, parse_engine
from tracer.files.sources import ModelSource
from tracer.model.points import CACHE_K, CACHE_V, K_ROPE, V_PROJ, layer_point
from tracer.pipeline.regime_view import check_regime_decode

pytest.importorskip("llama_cpp")
# a child process per engine and a regime decode per test: the full suite runs them, the quick tier does not
pytestmark = pytest.mark.slow

EXACT = {"flash_attn": "off", "kv_cache": "f32", "threads": 1}
ROUNDING = 2e-6  # rel_l2 at every point of every step (measured at most 1.0e-6)
STEPS = 3
REGIME = {"preset": "llamacpp", "weights": "gguf"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF directory, its f32 GGUF, transformers' cached decode of STEPS greedy tokens after TOKENS)."""
    folder = tmp_path_factory.mktemp("llamacpp-decode")
    model_dir = write_tiny_llama(folder / "model")
    gguf = write_tiny_gguf(model_dir, folder / "tiny.gguf")
    hf = resolve_and_load(EngineRef.named("hf"), ModelSource(model_dir), {})
    return model_dir, gguf, hf.decode(TOKENS, STEPS)


def llamacpp(model_dir, gguf, variant) -> IsolatedEngine:
    engine = resolve_and_load(parse_engine(f"llamacpp:{gguf}"), ModelSource(model_dir), variant)
    assert isinstance(engine, IsolatedEngine)  # llama.cpp runs in its child process
    return engine


def forced(trace) -> list[int]:
    return [step.tokens[0] for step in trace.steps]


def test_every_step_agrees_with_transformers_cached_decode_at_rounding_level(tiny):
    model_dir, gguf, reference = tiny
    decoded = llamacpp(model_dir, gguf, EXACT).decode(TOKENS, STEPS, forced=forced(reference))
    assert [step.meta.position_offset for step in decoded.steps] == list(range(len(TOKENS), len(TOKENS) + STEPS))
    assert decoded.steps[-1][layer_point(1, CACHE_K)].shape == (2, len(TOKENS) + STEPS, 16)  # (KV, S, D)
    compared = compare_steps(reference, decoded)
    assert [result.verdict for _, result in compared] == ["match"] * (STEPS + 1)
    worst = max(point.rel_l2 for _, result in compared for point in result.points if point.rel_l2 is not None)
    assert worst < ROUNDING, worst
    cached = {point.point for _, result in compared for point in result.points if "cache_" in point.point}
    assert cached == {layer_point(i, sub) for i in range(2) for sub in (CACHE_K, CACHE_V)}  # compared, not skipped


def test_the_cache_holds_each_steps_keys_after_rope_and_values_in_f16_by_default(tiny):
    model_dir, gguf, reference = tiny
    decoded = llamacpp(model_dir, gguf, {"threads": 1}).decode(TOKENS, STEPS, forced=forced(reference))
    assert decoded.meta.runtime["type_k"] == decoded.meta.runtime["type_v"] == "f16"
    previous = decoded
    for step in decoded.steps:
        for layer in range(2):
            keys, values = step[layer_point(layer, CACHE_K)], step[layer_point(layer, CACHE_V)]  # (KV, S, D)
            assert keys.dtype == values.dtype == torch.float16
            # the new slot: this step's k_rope (HF order, un-permuted as k_rope is) and v_proj, stored in f16
            assert torch.equal(keys[:, -1], step[layer_point(layer, K_ROPE)][:, -1].half())
            assert torch.equal(values[:, -1], step[layer_point(layer, V_PROJ)][-1].unflatten(0, (2, 16)).half())
            # the slots before it: what the cache held after the previous step, untouched
            assert torch.equal(keys[:, :-1], previous[layer_point(layer, CACHE_K)])
        previous = step


def test_positions_are_llamacpps_batch_positions(tiny):
    model_dir, gguf, _ = tiny
    result = tracer.run(model_dir, tokens=TOKENS, candidate=f"llamacpp:{gguf}", variant=EXACT, position_offset=40,
                        decode=2, progress=False)
    assert result.verdict == "match" and [step.position for step in result.steps] == [40, 47, 48]
    assert result.greedy.same_prefix == result.greedy.steps == 20  # llama.cpp's own cached greedy from position 47
    engine = llamacpp(model_dir, gguf, EXACT)
    far = engine.record(TOKENS, positions=torch.arange(40, 40 + len(TOKENS)))
    assert far.meta.position_offset == 40
    assert not torch.equal(engine.record(TOKENS)[layer_point(0, K_ROPE)], far[layer_point(0, K_ROPE)])
    with pytest.raises(TracerError, match="has 128 positions"):
        engine.decode(TOKENS, 2, offset=120)  # the GGUF's n_ctx_train


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(the tiny Q4_1/Q8_0 GGUF, a directory converted from it)."""
    _, gguf, converted = quantized_models(tmp_path_factory.mktemp("llamacpp-decode-q4_1"))
    return gguf, converted


@pytest.mark.parametrize("switches", [{}, {"flash_attn": "off"}], ids=["flash", "unfused"])
def test_in_llamacpps_regime_every_point_of_every_step_is_exactly_0(quantized, switches):
    skip_unless_exact_here(this_cpu_caveats())
    gguf, converted = quantized
    regime = resolve_and_load(EngineRef.named("reimpl"), ModelSource(converted), {**REGIME, **switches})
    reference = regime.decode(TOKENS, STEPS)
    decoded = llamacpp(converted, gguf, {**switches, "threads": 1}).decode(TOKENS, STEPS, forced=forced(reference))
    for ours, theirs in zip([reference, *reference.steps], [decoded, *decoded.steps]):
        assert set(theirs.tensors) <= set(ours.tensors)
        assert {point for point in theirs.tensors if "cache_" in point}  # the cache is compared too
        for point, value in theirs.tensors.items():
            assert torch.equal(ours[point].double(), value.double()), point


# the whole pipeline twice (raw and regime views, their floors): 8.6 s here
def test_run_with_regime_and_decode_matches_at_every_step(quantized):
    gguf, converted = quantized
    if this_cpu_caveats():  # judged per op here, which decode steps are not: refused in one line
        with pytest.raises(TracerError, match=r"judged per op here \(this CPU lacks"):
            tracer.run(converted, tokens=TOKENS, candidate=f"llamacpp:{gguf}", regime="auto", decode=STEPS,
                       greedy=0, progress=False)
        return
    result = tracer.run(converted, tokens=TOKENS, candidate=f"llamacpp:{gguf}", variant="threads=1", regime="auto",
                        decode=STEPS, greedy=0, progress=False)
    assert result.regime is not None and result.regime.verdict_view == "free"
    assert result.verdict == "match" and [step.verdict for step in result.steps] == ["match"] * (STEPS + 1)


def test_a_regime_decode_past_256_cells_with_flash_attention_is_refused():
    with pytest.raises(TracerError, match="256 cells"):
        check_regime_decode(REGIME, [], 250, 16)  # llama.cpp's split flash attention from 512 cells
    check_regime_decode({**REGIME, "flash_attn": "off"}, [], 250, 16)  # vec_dot over the cells: emulated


def test_micro_batches_first_change_the_first_projection_and_say_why_scores_are_missing(tiny):
    """n_ubatch=2: the 7-token prompt in 4 graphs, each after the cache the earlier ones filled; the rows
    are joined into the prompt's points. The first op whose output depends on the batch shape is a
    matmul (f32 weights: tinyBLAS from 2 rows, ggml_vec_dot_f32 for the last row alone)."""
    model_dir, gguf, _ = tiny
    whole, split = llamacpp(model_dir, gguf, EXACT).record(TOKENS), llamacpp(model_dir, gguf, {**EXACT, "n_ubatch": 2})
    pieces = split.decode(TOKENS, 1)
    result = tracer.compare(whole, pieces)
    assert result.verdict == "match"  # within f32 rounding
    differing = [point.point for point in result.points if point.recorded and point.max_abs]
    assert differing[0] == layer_point(0, "self_attn.q_proj")
    assert all(whole[p].equal(pieces[p]) for p in ("model.embed_tokens", layer_point(0, "input_layernorm")))
    assert "micro-batch" in pieces.not_recorded[layer_point(0, "self_attn.scores")]
    assert pieces[layer_point(1, CACHE_K)].shape == (2, len(TOKENS), 16)  # the cache after the last micro-batch
