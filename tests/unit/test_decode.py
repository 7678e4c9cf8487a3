"""`--decode N` on tiny random models: each side decodes with its own KV cache (hf: transformers'
DynamicCache; reimpl: tracer's KVCache), every step is compared, and each cache knob is found at its
step and point; decoded traces are saved and compared; a second `--tokens` is refused."""

from __future__ import annotations

import pytest

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tests.families import write_tiny_family
from tracer.cli import main
from tracer.comparison.diff import rel_l2_by_point
from tracer.comparison.steps import decoded_steps, step_floors
from tracer.comparison.trace import Trace
from tracer.core.errors import TracerError
from tracer.engines.load import load_engine
from tracer.engines.registry import ENGINES
from tracer.files.sources import resolve_source
from tracer.model.points import CACHE_K, CACHE_V, K_ROPE, Q_ROPE, layer_point
from tracer.reports import write_report
from tracer.reports.terminal import steps_line

STEPS = 5


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "m")


@pytest.fixture(scope="module")
def hf_decoded(llama_dir):
    """hf's greedy decode of STEPS tokens with its cache, and its uncached forward over the whole sequence."""
    engine = load_engine("hf", resolve_source(str(llama_dir), False), {})
    decoded = engine.decode(TOKENS, STEPS)
    sequence = TOKENS + [step.tokens[0] for step in decoded.steps]
    return decoded, engine.record(sequence)


def test_the_correct_cache_matches_at_every_step_and_point(llama_dir):
    result = tracer.run(llama_dir, tokens=TOKENS, decode=STEPS, greedy=0, progress=False)
    assert result.verdict == "match" and result.step is None
    assert [step.step for step in result.steps] == list(range(STEPS + 1))
    assert [step.position for step in result.steps] == [0, *range(len(TOKENS), len(TOKENS) + STEPS)]
    assert all(step.verdict == "match" and step.points > 0 for step in result.steps)
    # the reference decoded greedily: its pick after each step is the next step's token, and the candidate's
    # own cached pick agrees with it everywhere
    assert [step.reference_pick for step in result.steps[:-1]] == [step.tokens[0] for step in result.steps[1:]]
    assert all(step.candidate_pick == step.reference_pick for step in result.steps)
    summary = result.to_dict()
    assert summary["contract"] == 2 and len(summary["steps"]) == STEPS + 1
    assert summary["steps"][1]["tokens"] == list(result.steps[1].tokens)


@pytest.mark.parametrize("variant, step, point", [
    ("decode_positions=restart", 1, layer_point(0, Q_ROPE)),
    ("decode_positions=shifted", 1, layer_point(0, Q_ROPE)),
    ("cache_keys=unrotated", 0, layer_point(0, CACHE_K)),
])
def test_each_cache_knob_is_found_at_its_step_and_point(llama_dir, variant, step, point, tmp_path):
    result = tracer.run(llama_dir, tokens=TOKENS, decode=STEPS, greedy=0, variant=variant, noise_floor=False,
                        progress=False)
    assert result.verdict == "diverged" and result.step == step
    assert result.first_divergence.point == point
    assert all(s.verdict == "match" for s in result.steps[:step])
    where = "the cached prefill (what the KV cache keeps)" if step == 0 else f"decode step {step} (position 7)"
    assert steps_line(result.to_dict()).startswith(f"prefill: match; first divergence: {where}, {point}")
    if step == 0:  # the HTML report says it too
        html = (write_report(result, tmp_path / "report") / "report.html").read_text()
        assert f"first divergence: {where}, {point}" in html
    hint = result.first_divergence.hints[0]
    assert ("another position" in hint) if step else ("keys before RoPE" in hint)


def test_hf_cached_decode_is_its_uncached_forward_within_f32_rounding(hf_decoded):
    decoded, uncached = hf_decoded
    gaps = step_floors(decoded, uncached, None)  # each step against the same rows of the uncached forward
    assert len(gaps) == STEPS + 1
    for step, gap in zip(decoded_steps(decoded), gaps):
        assert {layer_point(0, K_ROPE), layer_point(0, CACHE_K), layer_point(0, CACHE_V)} <= set(gap)
        assert max(gap.values()) < 1e-5, step.meta.position_offset
    # a wrong position is not within it: step 1's keys against the uncached row of the position before
    keys = uncached[layer_point(0, K_ROPE)]  # (KV, T, D)
    wrong = Trace({layer_point(0, K_ROPE): keys[:, len(TOKENS) - 1:len(TOKENS)]}, decoded.steps[0].meta)
    assert rel_l2_by_point(decoded.steps[0], wrong)[layer_point(0, K_ROPE)] > 0.1


def test_a_decoded_trace_is_saved_loaded_and_compared_step_by_step(llama_dir, hf_decoded, tmp_path):
    decoded, _ = hf_decoded
    path = decoded.save(tmp_path / "hf.safetensors")
    loaded = Trace.load(path)
    assert len(loaded.steps) == STEPS and loaded.points == decoded.points
    for saved, read in zip(decoded.steps, loaded.steps):
        assert read.tokens == saved.tokens and read.meta.position_offset == saved.meta.position_offset
        assert read.points == saved.points and all(read[p].equal(saved[p]) for p in saved.points)
    reimpl = tracer.record(llama_dir, TOKENS, engine="reimpl", decode=STEPS, progress=False)
    result = tracer.compare_files(loaded, reimpl)
    assert result.verdict == "match" and len(result.steps) == STEPS + 1
    restarted = tracer.record(llama_dir, TOKENS, engine="reimpl", decode=STEPS, variant="decode_positions=restart",
                              progress=False)
    if [s.tokens for s in restarted.steps] != [s.tokens for s in loaded.steps]:
        with pytest.raises(TracerError, match="decode step \\d was fed different tokens"):
            tracer.compare_files(loaded, restarted)


def test_decode_mistakes_are_one_line(llama_dir, capsys):
    code = main(["run", "--model", str(llama_dir), "--tokens", "1,2,3", "--candidate", "mlx", "--decode", "4",
                 "--no-report"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--decode 4: the mlx engine does not decode with a KV cache here; engines that do: "
        + ", ".join(name for name, entry in ENGINES.items() if entry.decode))
    assert main(["run", "--model", str(llama_dir), "--tokens", "1,2,3", "--tokens", "4,5,6", "--no-report"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--tokens given twice (1,2,3 and 4,5,6): a run takes one input; give the flag once")
    with pytest.raises(TracerError, match="--decode must be at least 0, got -1"):
        tracer.run(llama_dir, tokens=TOKENS, decode=-1, progress=False)
    with pytest.raises(TracerError, match="--decode 200 after 7 tokens from position 0 runs to position 206; "
                                          "the model has 128 positions"):
        tracer.run(llama_dir, tokens=TOKENS, decode=200, greedy=0, progress=False)
    with pytest.raises(TracerError, match="--decode with --regime .*: the regime is judged per op here"):
        tracer.run(llama_dir, tokens=TOKENS, decode=2, regime="weights=q8_0,act_quant=q8_0,accumulate=f32",
                   progress=False)


def test_a_sliding_window_decodes_within_it_and_refuses_past_it(tmp_path):
    model = write_tiny_family(tmp_path / "mistral", "mistral")  # a window of 4 keys on every layer
    result = tracer.run(model, tokens=[1, 17], decode=2, greedy=0, noise_floor=False, progress=False)
    assert result.verdict == "match" and len(result.steps) == 3
    with pytest.raises(TracerError, match="--decode on the hf engine: this model's layer 0 attends to a sliding "
                                          "window of 4 keys and the decode runs to position 4; sliding-window caches"):
        tracer.run(model, tokens=[1, 17], decode=3, greedy=0, noise_floor=False, progress=False)


def test_decode_after_a_position_offset_and_with_streamed_weights(llama_dir):
    result = tracer.run(llama_dir, tokens=TOKENS, decode=2, greedy=0, position_offset=20, stream=True,
                        noise_floor=False, progress=False)
    assert result.verdict == "match" and [step.position for step in result.steps] == [20, 27, 28]
