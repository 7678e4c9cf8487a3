"""Several candidates on one reference run (`tracer run --candidate A --candidate B ...`): each one's result
against the reference, who agrees with whom at each one's first divergence and at the logits, and the odd one
(tracer/comparison/triangulation.py; docs/explain.md, "Triangulation")."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tracer.arguments import build_parser
from tracer.cli import main
from tracer.comparison.diff import compare
from tracer.comparison.result import CONTRACT_VERSION, PairAgreement, Tolerance
from tracer.comparison.triangulation import odd_one, triangulation
from tracer.core.errors import TracerError
from tracer.engines.registry import ENGINES
from tracer.model.points import LOGITS
from tracer.reports.terminal import terminal_summary
from tracer.traces.trace import Trace

Q_ROPE = "model.layers.0.self_attn.q_rope"
SCORES = "model.layers.0.self_attn.scores"


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A tiny Llama whose RoPE base is Llama 3's, so that theta=10000 is a mistake on it, and its GGUF."""
    from tests.tiny_gguf import write_tiny_gguf

    folder = tmp_path_factory.mktemp("triangulation")
    model = write_tiny_llama(folder / "llama", rope_theta=500000.0)
    gguf = folder / "llama.gguf"
    write_tiny_gguf(model, gguf)
    return model, gguf


def test_three_runtimes_match_then_name_a_planted_reference_as_the_odd_one(llama3):
    missing = [name for name in ("llamacpp", "mlx", "candle") if ENGINES[name].missing_runtime()]
    if missing:
        pytest.skip(f"runtimes not installed here: {', '.join(missing)}")
    model, gguf = llama3
    # llama.cpp on its exact f32 path (its f16 KV cache is a number-format regime, judged by --regime)
    candidates = [f"llamacpp:{gguf}[kv_cache=f32,flash_attn=off]", "mlx", "candle"]
    agreed = tracer.run(model, tokens=TOKENS, candidate=candidates, greedy=0, progress=False)
    assert [r.verdict for r in agreed.results] == ["match"] * 3 and agreed and agreed.odd_one is None
    assert agreed.sides == ("hf", "llamacpp[kv_cache=f32,flash_attn=off]", "mlx", "candle")
    (logits,) = agreed.agreement  # no first divergence: the logits alone
    assert logits.point == LOGITS and logits.floor == "noise" and len(logits.pairs) == 6
    assert all(pair.agree and pair.rel_l2 <= logits.threshold for pair in logits.pairs)

    planted = tracer.run(model, tokens=TOKENS, candidate=candidates, reference_variant="theta=10000", greedy=0,
                         progress=False)
    assert not planted and planted.verdict == "diverged"
    assert planted.odd_one == {"side": "hf[theta=10000]", "role": "reference", "point": Q_ROPE}
    assert [r.first_divergence.point for r in planted.results] == [Q_ROPE] * 3
    row = planted.agreement[0]
    assert row.point == Q_ROPE and row.first_of == planted.sides[1:] and row.odd_one == "hf[theta=10000]"
    with_reference = [pair for pair in row.pairs if "hf[theta=10000]" in pair.sides]
    between = [pair for pair in row.pairs if "hf[theta=10000]" not in pair.sides]
    assert len(with_reference) == len(between) == 3
    assert all(not pair.agree and pair.rel_l2 > 1e3 * row.threshold for pair in with_reference)
    assert all(pair.agree and pair.rel_l2 <= row.threshold for pair in between)
    # the reference-candidate pairs are the candidates' own comparisons, figure for figure
    for result in planted.results:
        pair = next(p for p in with_reference if result.candidate["label"] in p.sides)
        assert pair.rel_l2 == result.first_divergence.rel_l2 and row.threshold == result.first_divergence.threshold


def test_a_candidate_alone_against_the_others_is_the_odd_one(llama_dir):
    # hf and reimpl as they are, one reimpl with a wrong RoPE base: it alone disagrees with everyone
    tri = tracer.run(llama_dir, tokens=TOKENS, candidate=["reimpl", "reimpl[theta=500000]", "hf"], greedy=0,
                     progress=False)
    assert tri.sides == ("hf", "reimpl", "reimpl[theta=500000]", "hf (candidate 3)")  # a name the reference has
    assert [r.verdict for r in tri.results] == ["match", "diverged", "match"]
    assert tri.odd_one == {"side": "reimpl[theta=500000]", "role": "candidate", "point": Q_ROPE}
    assert tri["reimpl[theta=500000]"] is tri.results[1]
    q_rope, logits = tri.agreement
    assert q_rope.first_of == ("reimpl[theta=500000]",) and logits.point == LOGITS
    same = next(pair for pair in q_rope.pairs if pair.sides == ("hf", "hf (candidate 3)"))
    assert same.rel_l2 == 0 and same.agree  # hf against itself

    summary = json.loads(tri.to_json())  # the JSON contract: one object, each candidate's whole result in it
    assert summary["kind"] == "triangulation" and summary["contract"] == CONTRACT_VERSION == 6
    assert summary["verdict"] == "diverged" and summary["sides"] == list(tri.sides)
    assert [c["candidate"]["label"] for c in summary["candidates"]] == ["reimpl", "reimpl[theta=500000]", "hf"]
    assert summary["candidates"][1] == json.loads(tri.results[1].to_json())
    assert summary["agreement"][0]["odd_one"] == "reimpl[theta=500000]"
    assert summary["agreement"][0]["floor"] == "noise" and summary["agreement"][0]["noise"] > 0
    header = terminal_summary(tri).splitlines()
    floor = next(n for n, line in enumerate(header) if line.startswith("  noise floor: "))
    assert header[floor] == f"  noise floor: exact (an f64 run of all {len(TOKENS)} tokens)"
    assert header[floor - 1].startswith("  token ids") and header[floor + 1].startswith("verdict: DIVERGED")
    page = tri._repr_html_()  # the notebook's view: the odd one and a matrix per point shown
    assert "odd one: B reimpl[theta=500000] at model.layers.0.self_attn.q_rope" in page
    assert page.count('<table class="tn">') == 3
    # each candidate's own result repeats as its own run: the other candidates left out
    assert tri.results[1].command.endswith("--candidate 'reimpl[theta=500000]'")
    assert tri.results[1].command.count("--candidate") == 1


def two_camps_and_gaps():
    return [PairAgreement(("R", "A"), 0.5, False), PairAgreement(("R", "B"), 0.5, False),
            PairAgreement(("A", "B"), 0.0, True)]


def test_the_odd_one_rule():
    assert odd_one(["R", "A", "B"], two_camps_and_gaps()) == "R"
    everyone_apart = [PairAgreement(pair.sides, 0.5, False) for pair in two_camps_and_gaps()]
    assert odd_one(["R", "A", "B"], everyone_apart) is None
    not_compared = [*two_camps_and_gaps()[:2], PairAgreement(("A", "B"), None, None, "not recorded")]
    assert odd_one(["R", "A", "B"], not_compared) is None  # a pair not compared counts as neither
    assert odd_one(["R", "A"], two_camps_and_gaps()[:1]) is None  # two sides: who is odd is not known
    together = ({"R", "A"}, {"B", "C"})  # two camps of two: no one is odd
    camps = [PairAgreement((a, b), 0.0 if {a, b} in together else 0.5, {a, b} in together)
             for a, b in (("R", "A"), ("R", "B"), ("R", "C"), ("A", "B"), ("A", "C"), ("B", "C"))]
    assert odd_one(["R", "A", "B", "C"], camps) is None
    alone = [PairAgreement(pair.sides, 0.0 if "C" not in pair.sides else 0.5, "C" not in pair.sides)
             for pair in camps]
    assert odd_one(["R", "A", "B", "C"], alone) == "C"


def test_only_what_both_sides_of_a_pair_recorded_is_compared(llama_dir):
    """A runtime without the attention matrices, another with the last position's logits only (candle's)."""
    reference = tracer.record(llama_dir, TOKENS, engine="hf", progress=False)
    tiled = tracer.record(llama_dir, TOKENS, engine="reimpl", variant="kv_repeat=tile", progress=False)
    plain = tracer.record(llama_dir, TOKENS, engine="reimpl", progress=False)
    fused = Trace({name: t for name, t in plain.tensors.items() if not name.endswith(("scores", "probs"))},
                  dataclasses.replace(plain.meta, not_recorded={SCORES: "fused attention"}))
    last = Trace({**plain.tensors, LOGITS: plain[LOGITS][-1:]}, plain.meta)
    tri = triangulation(reference, [(compare(reference, t), t) for t in (tiled, fused, last)], Tolerance())
    scores = next(row for row in tri.agreement if row.point == SCORES)
    assert scores.first_of == (tri.sides[1],) and scores.floor == "fixed" and scores.threshold == 1e-4
    assert tri.sides[2] not in scores.sides and len(scores.sides) == 3
    gaps = [pair for pair in scores.pairs if tri.sides[2] in pair.sides]
    assert [pair.agree for pair in gaps] == [None] * 3 and {pair.reason for pair in gaps} == {"fused attention"}
    assert scores.odd_one == tri.sides[1]  # among the three that recorded it, the tiled one stands alone
    logits = next(row for row in tri.agreement if row.point == LOGITS)
    last_pair = next(pair for pair in logits.pairs if pair.sides == (tri.sides[2], tri.sides[3]))
    assert last_pair.agree and last_pair.rel_l2 == 0  # the same run: compared on the one row both hold


def test_the_command_line_the_report_and_the_exit_code(llama_dir, tmp_path, capsys):
    out = tmp_path / "report"
    args = ["run", "--model", str(llama_dir), "--tokens", ",".join(map(str, TOKENS)), "--greedy", "0",
            "--candidate", "reimpl[theta=500000]", "--candidate", "reimpl[theta=600000]", "--out", str(out)]
    assert main([*args, "--fail-on-divergence"]) == 1  # the candidates diverge from the reference
    printed = capsys.readouterr().out
    assert "verdict: DIVERGED" in printed and f"agreement at {Q_ROPE}, the first divergence of A and B" in printed
    assert "no odd one" in printed and max(map(len, printed.splitlines())) <= 100
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "triangulation" and summary["odd_one"] is None  # all three apart: no one is odd
    page = (out / "report.html").read_text()
    assert "candidate-2/report.html" in page and "no odd one" in page
    assert "no odd one" in (out / "summary.md").read_text()
    for number in (1, 2):  # each candidate's own report, as `tracer run` writes one
        own = json.loads((out / f"candidate-{number}" / "summary.json").read_text())
        assert own == summary["candidates"][number - 1] and (out / f"candidate-{number}" / "report.html").exists()


def test_the_api_line_repeats_each_candidate_with_its_knobs(llama_dir):
    tri = tracer.run(llama_dir, tokens=TOKENS, candidate=["hf", "reimpl[eps=1e-3]"], reference="reimpl", greedy=0,
                     progress=False)
    # the line that repeats it: each candidate with its knobs, read back to the same candidates
    assert build_parser().parse_args(shlex.split(tri.command)[1:]).candidate == ["hf", "reimpl[eps=0.001]"]
    assert tri.odd_one == {"side": "reimpl[eps=0.001]", "role": "candidate", "point": "model.layers.0.input_layernorm"}


@pytest.mark.parametrize(("keywords", "message"), [
    ({"variant": "theta=10000"},
     "--variant with 2 candidates: give each its own, e.g. 'llamacpp[kv_cache=f32]'"),
    ({"decode": 2}, "--decode with 2 candidates is not traced yet; decode one candidate at a time"),
    ({"batch": 2}, "--batch with 2 candidates is not traced yet; run a batch one candidate at a time"),
    ({"regime": "auto"}, "--regime with 2 candidates: each regime is its own reference; run one at a time"),
])
def test_what_a_triangulation_does_not_trace_yet_is_one_line(keywords, message, llama_dir):
    with pytest.raises(TracerError) as refused:
        tracer.run(llama_dir, tokens=TOKENS, candidate=["hf", "reimpl"], progress=False, **keywords)
    assert str(refused.value) == message


def test_a_candidate_given_twice_and_the_commands_that_take_one(llama_dir):
    with pytest.raises(TracerError, match=r"^candidate reimpl\[eps=0.001\] is given twice$"):
        tracer.run(llama_dir, candidate=["reimpl[eps=1e-3]", "reimpl[eps=0.001]"], progress=False)
    with pytest.raises(TracerError, match="^tracer sweep takes one --candidate; several: tracer run --candidate A"):
        tracer.sweep(llama_dir, candidate=["hf", "reimpl"], progress=False)
    with pytest.raises(TracerError, match=r"^tracer sweep runs each variant on a bare candidate: put eps=0.001 in"):
        tracer.sweep(llama_dir, candidate="reimpl[eps=1e-3]", progress=False)
    with pytest.raises(TracerError, match=r"^knob 'theta' is given twice \(in reimpl\[theta=1\] and in the variant\)$"):
        tracer.run(llama_dir, candidate="reimpl[theta=1]", variant="theta=2", progress=False)
