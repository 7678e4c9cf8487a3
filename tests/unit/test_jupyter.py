"""Jupyter: rich HTML for Result and Trace, DataFrames, figures, and the progress bar."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch
from matplotlib.figure import Figure

import tracer
from tests.conftest import TOKENS
from tracer.cli import main
from tracer.core.errors import TracerError
from tracer.model.points import all_points, layer_order
from tracer.reports import result_html, trace_html

HOSTILE_PROMPT = 'Paris <script>alert(1)</script> & "q"'


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.conftest import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("jupyter") / "tiny")


@pytest.fixture(scope="module")
def theta_result(tiny_dir):
    return tracer.run(tiny_dir, tokens=TOKENS, variant="theta=500", greedy=3, progress=False)


def style_selectors(fragment: str) -> list[str]:
    css = re.search(r"<style>(.*?)</style>", fragment, re.S).group(1)
    return [sel.strip() for block in re.findall(r"([^{}]+)\{", css) for sel in block.split(",")]


def test_result_html_is_a_scoped_fragment(theta_result):
    fragment = theta_result._repr_html_()
    assert fragment.startswith('<div class="tracer-nb">') and fragment.rstrip().endswith("</div>")
    for tag in ("<html", "<body", "<head", "<script", "<link"):
        assert tag not in fragment
    selectors = style_selectors(fragment)
    assert selectors and all(sel.startswith(".tracer-nb") for sel in selectors), selectors
    assert not re.search(r"https?://", fragment)


def test_result_html_says_where_it_starts(theta_result):
    fragment = theta_result._repr_html_()
    first = theta_result.first_divergence.point
    assert first == "model.layers.0.self_attn.q_rope"
    assert "DIVERGED" in fragment and f"the first divergence is {first}" in fragment
    assert fragment.count("data:image/png;base64,") == 1  # the curve
    # the diverging block's points, the first divergence marked
    rows = re.findall(r"<tr( class=\"[^\"]*\")?><td><code>([^<]+)</code>", fragment)
    assert [name for _, name in rows] == [p for p in all_points(2) if p.startswith("model.layers.0")]
    assert 'class="diverged first"><td><code>model.layers.0.self_attn.q_rope' in fragment


def test_result_html_escapes_user_text(theta_result):
    summary = theta_result.to_dict() | {"prompt": HOSTILE_PROMPT}
    fragment = result_html(summary, figure=False)
    assert "<script>alert(1)" not in fragment
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &#34;q&#34;" in fragment


def test_match_result_folds_the_coarse_points(tiny_dir):
    result = tracer.run(tiny_dir, tokens=TOKENS, greedy=0, progress=False)
    fragment = result_html(result, figure=False)
    assert "MATCH" in fragment and "<details>" in fragment  # folded: nothing to look at first
    assert "coarse points (5)" in fragment


def test_plot_returns_figures(theta_result):
    curve, heatmap, breakdown = (theta_result.plot(kind) for kind in ("curve", "heatmap", "breakdown"))
    assert all(isinstance(fig, Figure) for fig in (curve, heatmap, breakdown))
    assert theta_result.plot().axes[0].get_yscale() == "log"
    assert heatmap.axes[0].images[-1].get_array().shape == (2, len(layer_order("llama")))
    by_position = theta_result.first_divergence.by_position
    bars = [patch.get_height() for patch in breakdown.axes[0].patches]
    assert bars == pytest.approx(by_position)
    assert by_position[0] == 0  # RoPE leaves position 0 alone whatever theta is


def test_plot_refuses_unknown_kinds_and_missing_breakdowns(tiny_dir, theta_result):
    with pytest.raises(TracerError, match="unknown plot kind 'pie'; choose from curve, heatmap, breakdown"):
        theta_result.plot("pie")
    match = tracer.run(tiny_dir, tokens=TOKENS, greedy=0, progress=False)
    with pytest.raises(TracerError, match="no per-position or per-head breakdown"):
        match.plot("breakdown")


def test_table_is_a_dataframe_per_point(theta_result):
    table = theta_result.table()
    assert list(table.index) == all_points(2)
    assert table.loc["model.layers.0.self_attn.q_rope", "diverged"]
    assert table.loc["model.layers.0.self_attn.v_proj", "rel_l2"] == 0


def test_trace_table_and_html(tiny_dir):
    trace = tracer.record(tiny_dir, TOKENS, engine="reimpl", variant="theta=500", progress=False)
    table = trace.table()
    assert list(table.index) == trace.points
    q_rope = "model.layers.1.self_attn.q_rope"
    assert table.loc[q_rope, "shape"] == (4, len(TOKENS), 16) and table.loc[q_rope, "dtype"] == "float32"
    assert table.loc[q_rope, "layer"] == 1
    assert table.loc[q_rope, "max_abs"] == pytest.approx(float(trace[q_rope].abs().max()))

    fragment = trace._repr_html_()
    assert fragment == trace_html(trace)
    assert "reimpl[theta=500]" in fragment and f"{len(trace)} points on {len(TOKENS)} tokens" in fragment
    assert all(sel.startswith(".tracer-nb") for sel in style_selectors(fragment))
    rows = re.findall(r"<tr><td><code>([^<]+)</code></td><td>([^<]*)</td><td>([^<]*)</td>", fragment)
    # 513 points would be 513 rows; folded over layers it is one row per kind of point
    assert len(rows) == len(layer_order("llama")) + 3
    assert ("model.layers.{i}.self_attn.q_rope", "0–1", f"4×{len(TOKENS)}×16") in rows
    assert ("lm_head", "", f"{len(TOKENS)}×97") in rows


def test_trace_html_lists_unrecorded_points(tiny_dir):
    trace = tracer.record(tiny_dir, TOKENS, engine="hf", variant="attn=sdpa", progress=False)
    fragment = trace._repr_html_()
    assert "not recorded:" in fragment and "model.layers.{i}.self_attn.scores [0–1]" in fragment


# --- the progress bar -------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_run_shows_progress_on_a_terminal(tiny_dir, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    tracer.run(tiny_dir, tokens=TOKENS, variant="theta=500", greedy=2)
    err = terminal.getvalue()
    for step in ("tracer: load", "tracer: reference", "tracer: candidate", "tracer: greedy"):
        assert step in err
    assert "decode step 1/1" in err  # the greedy check's cached decode: the prompt, then one step per token


def test_progress_false_is_quiet(tiny_dir, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    tracer.run(tiny_dir, tokens=TOKENS, variant="theta=500", greedy=2, progress=False)
    tracer.record(tiny_dir, TOKENS, engine="reimpl", progress=False)
    assert terminal.getvalue() == ""


def test_no_bar_in_logs_and_pipes(tiny_dir, capsys):
    tracer.run(tiny_dir, tokens=TOKENS, variant="theta=500", greedy=2)  # stderr is not a terminal here
    assert capsys.readouterr().err == ""


def test_json_stdout_run_has_no_progress_bar(tiny_dir, capsys):
    code = main(["run", "--model", str(tiny_dir), "--tokens", ",".join(map(str, TOKENS)),
                 "--variant", "theta=500", "--greedy", "2", "--no-report", "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("{") and '"verdict": "diverged"' in out
    assert "tracer: load" not in err and "█" not in err


def test_a_failed_run_closes_its_bar(tiny_dir, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    with pytest.raises(TracerError):
        tracer.run(tiny_dir, tokens=[1, 10_000], greedy=0)
    from tqdm import tqdm

    assert not [bar for bar in list(tqdm._instances) if not bar.disable]


def test_record_progress_bar(tiny_dir, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    trace = tracer.record(tiny_dir, TOKENS, engine="reimpl")
    assert "tracer: record" in terminal.getvalue()
    assert torch.equal(trace["model.embed_tokens"], tracer.record(tiny_dir, TOKENS, engine="reimpl",
                                                                  progress=False)["model.embed_tokens"])


# --- a report made from a notebook still says how to reproduce it ------------------------------


def test_python_run_records_the_equivalent_command(tiny_dir, tmp_path, monkeypatch):
    import json
    import shlex

    result = tracer.run(tiny_dir, tokens=TOKENS, variant="theta=500,eps=1e-3", greedy=2,
                        out=tmp_path / "py", progress=False)
    args = shlex.split(result.command)
    assert args[:2] == ["tracer", "run"] and "--variant" in args and "theta=500,eps=0.001" in args
    assert f"<pre>{result.command}</pre>" in (tmp_path / "py" / "report.html").read_text(encoding="utf-8")
    # the command, run from the CLI, gives the same result
    monkeypatch.chdir(tmp_path)
    assert main([*args[1:], "--json", "cli.json"]) == 0
    again = json.loads((tmp_path / "cli.json").read_text())
    assert again["first_divergence"]["point"] == result.first_divergence.point
    assert again["logits"] == result.logits.to_dict() and again["greedy"]["candidate"] == result.greedy.candidate
    assert tracer.run(tiny_dir, tokens=TOKENS, greedy=0, progress=False, command="mine").command == "mine"


def test_sweep_html_overlays_and_tabulates(tiny_dir):
    from tracer import sweep
    from tracer.reports import sweep_html

    swept = sweep(tiny_dir, tokens=TOKENS, variants=["theta=500", "layers=9"], greedy=0, progress=False)
    fragment = sweep_html(swept)
    assert all(sel.startswith(".tracer-nb") for sel in style_selectors(fragment))
    assert fragment.count("data:image/png;base64,") == 1  # the overlay of the variants' curves
    rows = re.findall(r"<td><code>([^<]+)</code></td><td>(\w+)</td>", fragment)
    assert rows == [("theta=500", "diverged"), ("layers=9", "error")]
    assert "model.layers.0.self_attn.q_rope" in fragment
    assert "missing tensor model.layers.2" in fragment  # the failed variant's one line, not an abort


def test_sweep_renders_in_a_notebook_and_plots(tiny_llama):
    from matplotlib.figure import Figure

    from tracer import sweep

    result = sweep(tiny_llama(), tokens=[1, 5, 9, 2], variants=["theta=500", "attn=sdpa"], greedy=0, progress=False)
    html = result._repr_html_()
    assert "theta=500" in html and "attn=sdpa" in html and "<html" not in html.lower()
    assert isinstance(result.plot(), Figure)


def test_run_summary_carries_the_config_audit(tiny_llama):
    import tracer

    result = tracer.run(tiny_llama(), tokens=[1, 5, 9, 2], variant="config=candle,resave=tf5", greedy=0)
    audit = result.to_dict()["config_audit"]
    assert set(audit["readers"]) >= {"hf", "candle"} and audit["resave"] == "tf5"
