"""`tracer run --regime`: the candidate against tracer's model in the candidate's number formats,
with the raw f32 view, the regime's cost per point and the per-op view beside it (tracer.pipeline.regime_view),
on tiny random Llamas and a tiny Q4_1/Q8_0 GGUF."""

from __future__ import annotations

import json

import pytest

import tracer
from tests.conftest import TOKENS
from tests.ggml_gguf import quantized_models
from tracer.cli import main
from tracer.core.errors import TracerError
from tracer.engines.registry import parse_engine
from tracer.files.sources import ModelSource
from tracer.pipeline.regime_view import resolve as resolve_regime
from tracer.reports.markdown import markdown_summary
from tracer.reports.terminal import terminal_summary

TOKEN_ARG = ",".join(map(str, TOKENS))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(tiny HF directory, its Q4_1/Q8_0 GGUF, a copy of the directory converted from it)."""
    return quantized_models(tmp_path_factory.mktemp("regime"))


def test_an_explicit_regime_makes_a_quantized_candidate_match_and_keeps_the_raw_view(tiny_llama):
    model = tiny_llama()
    result = tracer.run(model, tokens=TOKENS, candidate="reimpl", variant="weights=q8_0,act_quant=q8_0",
                        regime="weights=q8_0,act_quant=q8_0", greedy=0, progress=False)
    regime = result.regime
    assert result.verdict == "match" and max(p.rel_l2 for p in result.points if p.recorded) == 0.0
    assert result.reference["engine"] == "reimpl" and result.reference["variant"] == {"weights": "q8_0",
                                                                                       "act_quant": "q8_0"}
    # the raw view: 8-bit weights and activations against f32 transformers diverge at the first projection
    assert regime.raw.verdict == "diverged"
    assert regime.raw.first_divergence.point == "model.layers.0.self_attn.q_proj"
    assert set(regime.raw.to_dict()["first_divergence"]) == {"point", "layer", "rel_l2", "max_abs", "max_ref"}  # brief
    # the regime's own cost is that raw error where nothing else differs: zero before the first projection
    cost = regime.cost
    assert cost["model.embed_tokens"] == 0.0 and cost["model.layers.0.input_layernorm"] == 0.0
    assert 1e-3 < cost["model.layers.0.self_attn.q_proj"] == pytest.approx(
        regime.raw.first_divergence.rel_l2)
    assert set(regime.per_op.values()) == {0.0} and regime.per_op_over == ()
    summary = result.to_dict()
    assert summary["view"] == "regime" and summary["regime"]["label"] == "weights=q8_0,act_quant=q8_0"
    assert json.loads(result.to_json())["regime"]["raw"]["verdict"] == "diverged"


def test_a_bug_still_stands_out_in_the_regime(tiny_llama):
    """A wrong theta on top of 8-bit weights: the regime view names q_rope, as a raw f32 run would."""
    result = tracer.run(tiny_llama(), tokens=TOKENS, variant="weights=q8_0,theta=500000", regime="weights=q8_0",
                        greedy=0, progress=False)
    assert result.verdict == "diverged"
    assert result.first_divergence.point in ("model.layers.0.self_attn.q_rope", "model.layers.0.self_attn.k_rope")
    assert result.first_divergence.upstream_max_rel_l2 == 0.0
    assert "model.layers.0.self_attn.q_rope" in result.regime.per_op_over


def test_a_reimpl_candidate_in_a_regime_implies_that_regime_without_its_mistakes(tiny_llama):
    knobs, caveats, audit = resolve_regime("auto", parse_engine("reimpl"), {"weights": "q8_0", "act_quant": "q8_0",
                                                               "theta": 500000.0}, tiny_llama())
    assert knobs == {"weights": "q8_0", "act_quant": "q8_0"} and caveats == [] and audit is None


def test_a_16_bit_candidate_implies_its_dtype(tiny_llama):
    result = tracer.run(tiny_llama(), tokens=TOKENS, candidate="reimpl", variant="dtype=bf16", regime="auto",
                        greedy=0, progress=False)
    assert result.regime.variant == {"dtype": "bf16"} and result.verdict == "match"
    assert result.regime.raw.verdict == "diverged"  # bf16 against f32: at the embedding
    assert result.regime.per_op_bound == pytest.approx(10 * 2**-9)


def test_regime_auto_on_a_llama_cpp_candidate_is_its_cpu_regime_to_the_bit(quantized):
    pytest.importorskip("llama_cpp")
    _, gguf, converted = quantized
    result = tracer.run(converted, tokens=TOKENS, candidate=f"llamacpp:{gguf}", regime="auto", greedy=0,
                        progress=False)
    regime = result.regime
    assert regime.variant == {"preset": "llamacpp", "weights": "gguf"}
    compared = [p for p in result.points if p.recorded]
    assert result.verdict == "match" and len(compared) == 33
    if not regime.caveats:  # an x86 CPU with the AVX2/AVX-512 paths emulated
        assert all(p.rel_l2 == 0 for p in compared) and set(regime.per_op.values()) == {0.0}
    assert max(regime.per_op.values()) < regime.per_op_bound
    # raw: the directory holds the f32 weights the GGUF was quantized from, so the Q8_0 embedding differs first
    assert regime.raw.verdict == "diverged"
    assert regime.raw.first_divergence.point == "model.embed_tokens"
    lines = terminal_summary(result)
    assert "view: the regime preset=llamacpp,weights=gguf" in lines and "raw view against f32 hf: diverged" in lines
    assert "the regime's own cost over f32" in markdown_summary(result)


def test_on_a_cpu_whose_paths_are_not_emulated_every_op_is_judged_against_the_per_op_bound(quantized, monkeypatch):
    """A CPU without F16C (its llama.cpp would take other code paths): per op, every point's threshold the
    per-op bound (what the caveat's paths can differ by: 1.7e-5 at flash attention on an AVX2 CPU before its
    paths were emulated, against floors of 6e-7), said in the view's line; the regime's floor, not the f64
    run's, reaches the verdict."""
    pytest.importorskip("llama_cpp")
    from tracer.ggml import ops

    monkeypatch.setattr(ops, "cpu_flags", lambda: {"avx2", "fma"})
    _, gguf, converted = quantized
    result = tracer.run(converted, tokens=TOKENS, candidate=f"llamacpp:{gguf}", regime="auto", greedy=0,
                        progress=False)
    regime = result.regime
    assert regime.caveats[0].startswith("this CPU lacks f16c:")
    assert regime.verdict_view == "per_op" and regime.floor_at_bound and result.verdict == "match"
    thresholds = {p.threshold for p in result.points if p.recorded}
    assert min(thresholds) == pytest.approx(regime.per_op_bound) and regime.per_op_bound == 1e-4
    assert "every op against at least 0.0001 (the paths a caveat names)" in " ".join(terminal_summary(result).split())
    assert result.to_dict()["regime"]["floor_at_bound"] is True


def test_a_gguf_the_directory_was_not_converted_from_lends_the_regime_its_own_tensors(quantized):
    """Each tensor in the file's own type (Q4_1 projections, Q8_0 embedding), whatever directory the
    model came from; the file is named, and audited against the directory's weights first."""
    pytest.importorskip("llama_cpp")
    model, gguf, _ = quantized
    knobs, caveats, audit = resolve_regime("auto", parse_engine(f"llamacpp:{gguf}"), {}, ModelSource(model))
    assert knobs == {"preset": "llamacpp", "weights": "gguf", "gguf_file": str(gguf.resolve())}
    assert audit.file == str(gguf.resolve()) and audit.verdict in ("identical", "legitimate")
    assert audit.damaged == ()


def test_the_report_folder_has_the_regime_view(tiny_llama, tmp_path):
    out = tmp_path / "report"
    assert main(["run", "--model", str(tiny_llama()), "--tokens", TOKEN_ARG, "--variant", "weights=q8_0",
                 "--regime", "weights=q8_0", "--greedy", "0", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["view"] == "regime" and summary["verdict"] == "match"
    html = (out / "report.html").read_text()
    assert "Regime view" in html and "the regime&#39;s own cost over f32" in html and "layer 0" in html


@pytest.mark.parametrize("args, message", [
    (["--regime", "auto"], "runs f32 and implies no number-format regime"),
    (["--regime", "auto", "--candidate", "file:x.safetensors"], "is a saved trace"),
    (["--regime", "nonsense=1"], "unknown knob"),
    (["--regime", "threads=2"], "threads=2 is not one (a porting mistake goes in --variant)"),
    (["--regime", "theta=10000"], "theta=10000 is not one"),
    (["--regime", "preset=candle"], "preset=candle is not one"),
])
def test_regime_errors_are_one_line_and_exit_2(tiny_llama, args, message, capsys):
    assert main(["run", "--model", str(tiny_llama()), "--tokens", TOKEN_ARG, "--no-report", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    with pytest.raises(TracerError, match=message.split("(")[0]):
        candidate = next((a for a in args if a.startswith("file:")), "reimpl")
        tracer.run(tiny_llama(), tokens=TOKENS, candidate=candidate, regime=args[1], greedy=0, progress=False)


def test_the_per_op_view_judges_where_the_emulation_cannot_be_bit_exact():
    from tracer.pipeline.regime_view import EXACT_TOKENS, EXACT_TOKENS_UNFUSED, verdict_view

    llamacpp = {"preset": "llamacpp", "weights": "gguf"}
    assert verdict_view(llamacpp, [], 5) == "free"  # bit-exact here: free-running is a verdict
    assert verdict_view(llamacpp, [], EXACT_TOKENS) == "free" and EXACT_TOKENS >= 2048
    assert verdict_view(llamacpp, [], EXACT_TOKENS + 1) == "per_op"  # too large bit-exact
    unfused = {**llamacpp, "flash_attn": "off"}
    assert verdict_view(unfused, [], EXACT_TOKENS_UNFUSED) == "free"
    assert verdict_view(unfused, [], EXACT_TOKENS_UNFUSED + 1) == "per_op"
    assert verdict_view(llamacpp, ["this CPU lacks f16c: ..."], 5) == "per_op"
    # not chaotic, but this CPU's own paths: free-running their differences add up, per op they do not
    assert verdict_view({"weights": "q4_0"}, ["this CPU lacks f16c: ..."], 512) == "per_op"
    assert verdict_view({"weights": "q4_0"}, ["Q6_K weights (1 tensors, e.g. x): ..."], 512) == "free"
    assert verdict_view({"weights": "q8_0", "act_quant": "q8_0", "accumulate": "f32"}, [], 5) == "per_op"
    assert verdict_view({"weights": "q4_0"}, [], 512) == "free"  # no 8-bit activations: not chaotic
    assert verdict_view({"dtype": "bf16"}, [], 512) == "free"


def test_per_op_an_emulation_in_another_order_still_reads_a_correct_candidate_as_correct(tiny_llama):
    """The candidate sums in ggml's order, the regime with torch's BLAS (accumulate=f32): per op the
    difference stays within the regime's noise floor, and a wrong theta still stands out."""
    model = tiny_llama()
    regime = "weights=q8_0,act_quant=q8_0,accumulate=f32"
    correct = tracer.run(model, tokens=TOKENS, variant="weights=q8_0,act_quant=q8_0", regime=regime, greedy=0,
                         progress=False)
    assert correct.regime.verdict_view == "per_op" and correct.verdict == "match"
    assert max(correct.regime.per_op.values()) < 1e-5
    broken = tracer.run(model, tokens=TOKENS, variant="weights=q8_0,act_quant=q8_0,theta=500000", regime=regime,
                        greedy=0, progress=False)
    assert broken.verdict == "diverged"
    assert broken.first_divergence.point in ("model.layers.0.self_attn.q_rope", "model.layers.0.self_attn.k_rope")
    assert "judged each op on the candidate's own inputs" in " ".join(terminal_summary(broken).split())  # wrapped
