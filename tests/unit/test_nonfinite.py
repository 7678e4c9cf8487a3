"""Non-finite values are findings: the first NaN/Inf is located and named, metrics stay defined.

The model: a tiny random Llama whose layer-1 MLP projections are scaled by 300, so that
silu(gate) * up reaches |x| ~ 5.9e5 in f32 at model.layers.1.mlp.act: above f16's largest finite
value, 65504, while gate and up themselves stay near 1.2e3. In f16 that product is +-inf.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tracer.cli import main
from tracer.comparison.diff import compare, first_nonfinite
from tracer.traces.trace import Trace, TraceMeta

F16_MAX = torch.finfo(torch.float16).max  # 65504
OVERFLOW_POINT = "model.layers.1.mlp.act"


def write_overflowing_model(folder):
    folder = write_tiny_llama(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in ("gate_proj", "up_proj"):
        tensors[f"model.layers.1.mlp.{name}.weight"] *= 300
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def overflowing_model(tmp_path_factory):
    return write_overflowing_model(tmp_path_factory.mktemp("f16") / "model")


def test_the_model_overflows_f16_at_layer_1_mlp_act_and_nowhere_before(overflowing_model):
    """The premise, checked in f32: gate/up stay far below f16's limit, their product exceeds it."""
    trace = tracer.record(overflowing_model, TOKENS, engine="reimpl", progress=False)
    layer1 = {p: float(trace[p].abs().max()) for p in trace.points if p.startswith("model.layers.1.mlp")}
    assert layer1["model.layers.1.mlp.gate_proj"] < F16_MAX / 10 and layer1["model.layers.1.mlp.up_proj"] < F16_MAX / 10
    assert layer1[OVERFLOW_POINT] > F16_MAX
    before = trace.points[: trace.points.index(OVERFLOW_POINT)]
    assert max(float(trace[p].abs().max()) for p in before) < F16_MAX


@pytest.mark.parametrize("reference, reference_variant, side", [
    ("reimpl", None, "candidate"),  # f32 reference, f16 candidate: only the candidate overflows
    ("hf", "dtype=f16", "both"),  # transformers in f16 overflows at the same place
])
def test_f16_overflow_is_reported_at_layer_1_mlp(overflowing_model, tmp_path, reference, reference_variant, side):
    result = tracer.run(overflowing_model, tokens=TOKENS, reference=reference, reference_variant=reference_variant,
                        variant="dtype=f16", greedy=2, out=tmp_path / "report", progress=False)
    nonfinite = result.first_nonfinite
    assert nonfinite["point"] == OVERFLOW_POINT and nonfinite["layer"] == 1 and nonfinite["side"] == side
    # An overflow is inf, never nan, at the point itself; every position overflows somewhere.
    assert nonfinite["inf"] == nonfinite["count"] > 0 and nonfinite["nan"] == 0
    at = next(p for p in result.points if p.point == OVERFLOW_POINT)
    assert at.diverged and not math.isfinite(at.rel_l2)  # inf against finite or inf: diverged, never a match
    assert result.verdict == "diverged"

    # JSON stays JSON: no bare NaN/Infinity tokens, non-finite figures said as strings.
    text = result.to_json()
    payload = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert payload["first_nonfinite"] == nonfinite
    assert next(p for p in payload["points"] if p["point"] == OVERFLOW_POINT)["rel_l2"] == str(at.rel_l2)
    assert payload["logits"]["rel_l2"] == "nan"  # the final norm of an inf residual is nan

    # The report renders it: summary.json equal to the result, the sentence in the HTML banner.
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["first_nonfinite"] == nonfinite
    html = (tmp_path / "report" / "report.html").read_text()
    assert f"First NaN/Inf: {OVERFLOW_POINT} on" in html


def test_cli_prints_the_first_nonfinite_point(overflowing_model, capsys):
    code = main(["run", "--model", str(overflowing_model), "--tokens", ",".join(map(str, TOKENS)),
                 "--reference", "reimpl", "--variant", "dtype=f16", "--greedy", "0", "--no-report"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"  First NaN/Inf: {OVERFLOW_POINT} on the candidate (" in out


def trace_of(**tensors) -> Trace:
    return Trace(dict(tensors), TraceMeta(engine="test", tokens=[1, 2]))


def test_first_nonfinite_names_the_side_and_counts():
    finite = torch.ones(2, 3)
    with_nan = finite.clone()
    with_nan[0, 1] = float("nan")
    with_inf = finite.clone()
    with_inf[1, :] = float("-inf")
    order = ["a", "b", "c"]
    reference = trace_of(a=finite, b=with_inf, c=with_nan)
    candidate = trace_of(a=finite, b=finite, c=with_inf)
    assert first_nonfinite(order, reference, candidate) == {
        "point": "b", "layer": None, "side": "reference", "count": 3, "nan": 0, "inf": 3}
    assert first_nonfinite(order, candidate, reference)["side"] == "candidate"
    assert first_nonfinite(["c"], reference, candidate) == {
        "point": "c", "layer": None, "side": "both", "count": 4, "nan": 1, "inf": 3}
    assert first_nonfinite(["a", "b"], candidate, candidate) is None


def test_masked_scores_are_not_a_finding():
    """Eager attention's scores above the diagonal are -inf (or dtype-min) by design: not counted."""
    point = "model.layers.0.self_attn.scores"
    scores = torch.randn(2, 3, 3)  # (H, T, T)
    masked = scores.masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(), float("-inf"))
    result = compare(trace_of(**{point: masked}), trace_of(**{point: scores}))
    assert result.first_nonfinite is None and result.verdict == "match"
    broken = scores.clone()
    broken[1, 2, 0] = float("nan")  # below the diagonal: a real finding
    assert compare(trace_of(**{point: scores}), trace_of(**{point: broken})).first_nonfinite == {
        "point": point, "layer": 0, "side": "candidate", "count": 1, "nan": 1, "inf": 0}


def test_a_nan_at_one_position_gets_no_pattern_hint_it_does_not_have():
    """NaN at position 1 of 3, positions 0 and 2 exact: not "the causal mask" (exact at the last only)."""
    from tracer.comparison.explain import hints

    said = hints("model.layers.0.mlp.down_proj", {"by_position": [0.0, float("nan"), 0.0], "by_head": None})
    assert not any("causal mask" in line for line in said)
    assert any("non-finite (NaN or Inf) at position 1 only, exact at 0, 2" in line for line in said)


def test_a_nan_in_any_chunk_of_the_logits_is_the_all_positions_figure(monkeypatch):
    """max() over per-chunk maxima would keep a later finite chunk over an earlier NaN."""
    import tracer.comparison.diff
    from tracer.model.points import LOGITS

    monkeypatch.setattr(tracer.comparison.diff, "CHUNK", 4)  # one position per chunk
    ref = torch.zeros(3, 4)
    cand = ref.clone()
    cand[0, 3] = float("nan")
    summary = tracer.comparison.diff.logits_summary(Trace({LOGITS: ref}), Trace({LOGITS: cand}))
    assert math.isnan(summary.max_abs_all) and summary.max_abs == 0.0


def test_a_result_without_a_model_is_not_titled_on_none():
    from tracer.reports.terminal import terminal_summary

    trace = Trace({"model.embed_tokens": torch.ones(2, 3)})
    text = terminal_summary(compare(trace, trace))
    assert "on None" not in text.splitlines()[0]
