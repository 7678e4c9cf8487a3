"""`--decode N` on tiny random models: each side decodes with its own KV cache (hf: transformers'
DynamicCache; reimpl: tracer's KVCache), every step is compared, and each cache knob is found at its
step and point; decoded traces are saved and compared; a second `--tokens` is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.families import write_tiny_family
from tracer.cli import main
from tracer.comparison.diff import rel_l2_by_point
from tracer.comparison.explain import cache_hints, position_hint
from tracer.comparison.result import CONTRACT_VERSION, StepResult
from tracer.comparison.steps import compare_steps, decoded_steps, step_floors
from tracer.core.errors import TracerError
from tracer.engines.load import resolve_and_load
from tracer.engines.registry import ENGINES
from tracer.files.sources import resolve_source
from tracer.model.points import CACHE_K, CACHE_V, K_ROPE, Q_ROPE, layer_point, split_point
from tracer.pipeline.decode import decoded_tokens, step_local_errors
from tracer.reports import markdown_summary, render_html, result_html, write_report
from tracer.reports.summary import fmt, step_origin_text
from tracer.reports.terminal import steps_line
from tracer.traces.trace import Trace

STEPS = 5


@pytest.fixture(scope="module")
def hf_decoded(llama_dir):
    """hf's greedy decode of STEPS tokens with its cache, and its uncached forward over the whole sequence."""
    engine = resolve_and_load("hf", resolve_source(str(llama_dir), False), {})
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
    assert summary["contract"] == CONTRACT_VERSION >= 3 and len(summary["steps"]) == STEPS + 1
    # the candidate (reimpl) reran every step on the reference's inputs and cache: it makes no error of its own
    assert all(step.local is False and set(step.layer_status) == {"match"} for step in result.steps)
    assert max(v for step in result.steps for v in step.layer_max_local_rel_l2) < 1e-6
    assert summary["steps"][1]["tokens"] == list(result.steps[1].tokens)


@pytest.mark.parametrize("variant, step, point, hint", [
    ("decode_positions=restart", 1, layer_point(0, Q_ROPE),
     "decode step 1's token (position 7) was given position 0: its layer-0 q_rope is the reference's for the same "
     "token at position 0 (rel_l2 "),
    ("decode_positions=shifted", 1, layer_point(0, Q_ROPE),
     "decode step 1's token (position 7) was given position 8: its layer-0 q_rope is the reference's for the same "
     "token at position 8 (rel_l2 "),
    ("cache_keys=unrotated", 0, layer_point(0, CACHE_K),
     "the cache holds the keys before RoPE: slot 0 (position 0) to slot 6 (position 6) equal the reference's keys "
     "before RoPE (rel_l2 at most "),
])
def test_each_cache_knob_is_found_at_its_step_and_point(llama_dir, variant, step, point, hint, tmp_path):
    result = tracer.run(llama_dir, tokens=TOKENS, decode=STEPS, greedy=0, variant=variant, noise_floor=False,
                        progress=False)
    assert result.verdict == "diverged" and result.step == step
    first = result.first_divergence
    assert first.point == point
    assert all(s.verdict == "match" for s in result.steps[:step])
    # local, not inherited: the step rerun on the reference's inputs and cache makes the error itself
    assert first.localized_by == "local" and first.local_rel_l2 > first.threshold
    shown = result.steps[step]
    assert shown.local is True and shown.layer_status[0] == "local" and shown.inherited_from is None
    assert shown.layer_max_local_rel_l2[0] >= first.local_rel_l2
    where = "the cached prefill (what the KV cache keeps)" if step == 0 else f"decode step {step} (position 7)"
    line = steps_line(result.to_dict())
    assert line.startswith(f"prefill: match; first divergence: {where}, {point}, made by the step itself")
    if step == 0:  # the HTML report says it too
        html = (write_report(result, tmp_path / "report") / "report.html").read_text()
        assert f"first divergence: {where}, {point}" in html
    assert first.hints[0].startswith(hint)  # read off the numbers (below), not guessed
    assert float(first.hints[0][len(hint):].split(",")[0].split(")")[0]) <= first.threshold
    # every later step reads the cache these steps wrote: it inherits from the first step whose cache diverged
    wrote = next(s.step for s in result.steps if s.verdict != "match")
    assert [s.inherited_from for s in result.steps[wrote + 1:]] == [wrote] * (STEPS - wrote)


def test_the_step_map_is_in_the_report_the_notebook_and_markdown(llama_dir):
    result = tracer.run(llama_dir, tokens=TOKENS, decode=3, greedy=0, variant="decode_positions=restart",
                        noise_floor=False, progress=False)
    html = render_html(result, images={})  # the report page, without drawing its figures
    notebook = result_html(result, figure=False)  # what `result._repr_html_()` shows, less the curve's PNG
    markdown = markdown_summary(result)
    for page in (html, notebook):
        body = page[page.index('<table class="step-map"'):]
        body = body[:body.index("</table>")]
        rows = re.findall(r'<tr data-step="(\d+)">(.*?)</tr>', body, re.S)
        assert [int(n) for n, _ in rows] == [s.step for s in result.steps]
        for (_, row), step in zip(rows, result.steps):
            cells = re.findall(r'<td class="(\w+)( first)?" title="[^"]*" style="[^"]*">([^<]*)</td>', row)
            # each cell: the layer's status at that step and its largest rel_l2, as the JSON has them
            assert [c[0] for c in cells] == list(step.layer_status)
            assert [c[2] for c in cells] == [fmt(v) for v in step.layer_max_rel_l2]
            assert [bool(c[1]) for c in cells] == [step.step == 1 and layer == 0 for layer in range(len(cells))]
        assert "<td>prefill</td><td style=\"text-align: right\">0</td><td>7 tokens</td><td>match</td>" in body
        assert "<td>1</td><td style=\"text-align: right\">7</td>" in body and "<td>made here</td>" in body
        assert "made here, reads the wrong cache of step 1" in body  # steps 2, 3
    assert "| prefill | 0 | match | `··` | 0 |" in markdown
    assert f"| 1 | 7 | made here | `LL` | {fmt(max(result.steps[1].layer_max_rel_l2))} |" in markdown


def test_a_step_reading_a_wrong_cache_and_making_no_error_reads_as_inherited(llama_dir, hf_decoded):
    """A candidate whose cache keeps unrotated keys, against local errors measured by a correct engine: the
    prefill's cache is wrong, no step makes error itself, so every later step inherits it from the prefill's."""
    reference, _ = hf_decoded
    correct = resolve_and_load("reimpl", resolve_source(str(llama_dir), False), {})
    wrong = resolve_and_load("reimpl", resolve_source(str(llama_dir), False), {"cache_keys": "unrotated"})
    candidate = wrong.decode(TOKENS, STEPS, forced=decoded_tokens(reference))
    local = step_local_errors(correct, reference)
    assert len(local) == STEPS + 1 and max(max(errors.values()) for errors in local) < 1e-6
    summaries = [summary for summary, _ in compare_steps(reference, candidate, None, None, local)]
    assert summaries[0].verdict == "diverged" and summaries[0].local is False
    assert summaries[0].first_divergence.localized_by == "total"
    later = [s for s in summaries[1:] if s.verdict != "match"]
    assert later and all(s.local is False and s.inherited_from == 0 and "local" not in s.layer_status for s in later)
    assert "inherited" in later[0].layer_status
    assert step_origin_text(later[0].to_dict()) == ", inherited from the cache written at the prefill (the step " \
                                                   "itself makes none)"


@pytest.mark.parametrize("family", ["qwen3", "phi3"])  # keys before RoPE: after k_norm; in the fused q | k | v
def test_keys_cached_before_rope_are_named_where_the_keys_come_from_a_norm_or_a_fused_projection(family, tmp_path):
    model = write_tiny_family(tmp_path / family, family)
    result = tracer.run(model, tokens=[1, 17], decode=1, greedy=0, variant="cache_keys=unrotated", noise_floor=False,
                        progress=False)
    assert result.step == 0 and result.first_divergence.point == layer_point(0, CACHE_K)
    assert result.first_divergence.hints[0].startswith(
        "the cache holds the keys before RoPE: slot 0 (position 0) to slot 1 (position 1) equal the reference's keys "
        "before RoPE (rel_l2 at most ")


def test_a_step_whose_reference_cache_is_not_every_position_in_order_is_not_rerun(llama_dir, hf_decoded):
    """A ring (a sliding window's cache) holds fewer slots than positions: the rerun could not place them, so
    the step's local errors are not measured rather than measured wrong."""
    reference, _ = hf_decoded
    ring = Trace({point: tensor[:, 1:] if split_point(point)[1] in (CACHE_K, CACHE_V) else tensor
                  for point, tensor in reference.steps[1].tensors.items()}, reference.steps[1].meta)
    clipped = Trace(reference.tensors, reference.meta)
    clipped.steps = [reference.steps[0], ring, *reference.steps[2:]]
    engine = resolve_and_load("reimpl", resolve_source(str(llama_dir), False), {})
    local = step_local_errors(engine, clipped)
    # decode step 2 (reference.steps[1]) writes the ring, step 3 reads it
    assert local[2] is None and local[3] is None
    assert all(errors is not None for errors in local[:2] + local[4:])


def test_cache_hints_name_the_slot_a_position_is_held_at():
    torch.manual_seed(0)
    reference = torch.randn(2, 6, 4)  # (KV, S, D)
    candidate = reference.clone()
    candidate[:, 4] = reference[:, 1]  # slot 4 written with position 1's keys
    candidate[:, 5] = torch.randn(2, 4)  # slot 5 holding something else
    said = cache_hints(layer_point(0, CACHE_K), reference, candidate, 1e-4, start=10)
    assert said[0].startswith("the cache holds keys at other slots than the reference's: slot 4 (position 14) holds "
                              "the reference slot 1 (position 11)'s keys (rel_l2 0.0e+00, against its own ")
    assert said[1].startswith("1 slot of the cache holds none of the reference's keys (the first, slot 5 "
                              "(position 15): nearest the reference's slot")
    assert cache_hints(layer_point(0, CACHE_V), reference, reference.clone(), 1e-4, start=10) == []
    # a position no row of the scanned ones explains is said so, with the nearest
    rows = torch.randn(3, 5, 4)  # (heads, N, D): positions 0..4
    text = position_hint(2, layer_point(0, Q_ROPE), 9, torch.randn(3, 1, 4), rows, list(range(5)), 1e-4, 8, 0)
    assert text.startswith("decode step 2's layer-0 q_rope is the reference's at none of positions 0..4 (nearest: ")


def test_the_documented_step_fields_are_the_written_ones():
    design = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    start = design.index("else one entry per step")
    entry = design[start:design.index("}`)", start)]
    documented = re.findall(r'"(\w+)"', entry)
    written = StepResult(step=0, position=0, tokens=(1,), verdict="match", first_divergence=None, points=1).to_dict()
    assert documented == list(written)


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
    code = main(["run", "--model", str(llama_dir), "--tokens", "1,2,3", "--candidate", "onnx", "--decode", "4",
                 "--no-report"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--decode 4: the onnx engine does not decode with a KV cache here (tracer's ONNX export is one forward "
        "without a cache, with no past-key/value inputs; an export with them is not done yet); engines that do: "
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


def test_a_sliding_window_decodes_past_it(tmp_path):
    """Every layer of the tiny Mistral attends to a window of 4 keys; 2 + 3 tokens run past it (its ring
    buffers: tests/unit/test_sliding_decode.py)."""
    model = write_tiny_family(tmp_path / "mistral", "mistral")
    result = tracer.run(model, tokens=[1, 17], decode=3, greedy=0, noise_floor=False, progress=False)
    assert result.verdict == "match" and len(result.steps) == 4


def test_decode_after_a_position_offset_and_with_streamed_weights(llama_dir):
    result = tracer.run(llama_dir, tokens=TOKENS, decode=2, greedy=0, position_offset=20, stream=True,
                        noise_floor=False, progress=False)
    assert result.verdict == "match" and [step.position for step in result.steps] == [20, 27, 28]


def test_a_long_decode_spills_its_steps_and_reads_as_one_held_in_memory(llama_dir, monkeypatch):
    """Past SPILL_TOKENS positions each step both sides record goes to disk as it is recorded (its
    cache points alone grow with every step) and is read back point by point: the same result."""
    import tracer.pipeline.decode as decode
    from tracer.traces.spill import SpilledTensors

    def run():
        return tracer.run(llama_dir, tokens=TOKENS, decode=STEPS, greedy=0, variant="decode_positions=restart",
                          progress=False)

    held = run()
    spilled_steps = []
    monkeypatch.setattr(decode, "SPILL_TOKENS", 0)
    original = decode.with_decoded

    def spy(result, prepared, reference, floors, candidate, *rest, **kw):
        spilled_steps.extend([reference, *reference.steps, candidate, *candidate.steps])
        return original(result, prepared, reference, floors, candidate, *rest, **kw)

    monkeypatch.setattr(decode, "with_decoded", spy)
    spilled = run()
    assert len(spilled_steps) == 2 * (STEPS + 1)
    assert all(isinstance(step.tensors, SpilledTensors) for step in spilled_steps)
    assert spilled.to_dict()["steps"] == held.to_dict()["steps"]
    assert (spilled.step, spilled.first_divergence.point) == (held.step, held.first_divergence.point) == (
        1, layer_point(0, Q_ROPE))
    assert [p.rel_l2 for p in spilled.points] == [p.rel_l2 for p in held.points]
