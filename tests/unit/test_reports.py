"""Reports render a result summary: files, figures, the HTML page, atomic folder replacement."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest

import tracer.comparison.diff as diff
import tracer.reports as reports
import tracer.reports.figures as report_figures
from tracer.comparison.result import PointDiff, Result, Tolerance
from tracer.core.errors import TracerError
from tracer.model.points import EMBED, FINAL_NORM, LOGITS, all_points, is_coarse, layer_of, layer_order, split_point
from tracer.reports.summary import next_steps

TOL = 1e-4
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HOSTILE_PROMPT = 'Paris <script>alert(1)</script> & "q"'
LAYER_POINTS_INDEX = {sub: i for i, sub in enumerate(layer_order("llama"))}


# --- realistic summaries -----------------------------------------------------------------------


def shape_of(point: str, tokens: int, dims: dict) -> list[int]:
    h, kv, d, hidden = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["hidden"]
    sub = point.split(".", 3)[-1] if layer_of(point) is not None else point
    table = {
        "self_attn.q_proj": [tokens, h * d], "self_attn.k_proj": [tokens, kv * d],
        "self_attn.v_proj": [tokens, kv * d], "self_attn.q_rope": [h, tokens, d],
        "self_attn.k_rope": [kv, tokens, d], "self_attn.scores": [h, tokens, tokens],
        "self_attn.probs": [h, tokens, tokens], "self_attn.context": [tokens, h * d],
        "mlp.gate_proj": [tokens, dims["inter"]], "mlp.up_proj": [tokens, dims["inter"]],
        "mlp.act": [tokens, dims["inter"]], LOGITS: [tokens, dims["vocab"]],
    }
    return table.get(sub, [tokens, hidden])


def scale_of(point: str, n_layers: int) -> float:
    """max|ref| the way a real model grows it: massive activations from the middle on."""
    if point == EMBED:
        return 0.17
    if point == LOGITS:
        return 19.8
    if point == FINAL_NORM:
        return 41.0
    layer = layer_of(point)
    return 22500.0 if layer >= n_layers // 2 and point.count(".") == 2 else 3.0 + 2.0 * layer


def make_points(n_layers: int, tokens: int, diverge_at: str | None, missing: tuple[str, ...] = (),
                dims: dict | None = None, local: bool = False) -> list[dict]:
    """Points as the diff engine writes them; `local`: with the error each makes on the reference's
    inputs (each block's points up to the diverging op's sub-point exact, the rest its total error)."""
    dims = dims or {"heads": 4, "kv_heads": 2, "head_dim": 16, "hidden": 64, "inter": 128, "vocab": 256}
    names = all_points(n_layers)
    start = names.index(diverge_at) if diverge_at else len(names)
    rows = []
    for i, name in enumerate(names):
        layer = layer_of(name)
        if any(name.endswith(sub) for sub in missing):
            rows.append({"point": name, "layer": layer, "shape": None, "recorded": False,
                         "missing_on": "candidate", "max_abs": None, "max_ref": None,
                         "rel_l2": None, "cosine": None, "diverged": False})
            continue
        if name == EMBED or name.endswith("input_layernorm") and layer == 0:
            rel = 0.0  # identical inputs give identical embeddings: exact zeros exist
        elif i < start:
            rel = 1e-7 * (1 + (i * 37 % 11) / 4)
        else:
            rel = 0.21 if i == start else 0.05 + 0.02 * ((i * 13) % 7)
        ref = scale_of(name, n_layers)
        rows.append({"point": name, "layer": layer, "shape": shape_of(name, tokens, dims),
                     "recorded": True, "missing_on": None, "max_abs": rel * ref * 2.5,
                     "max_ref": ref, "rel_l2": rel, "cosine": 1 - rel * rel / 2,
                     "diverged": rel > TOL})
        if local:
            made = layer is not None and diverge_at is not None and \
                LAYER_POINTS_INDEX[split_point(name)[1]] >= LAYER_POINTS_INDEX[split_point(diverge_at)[1]]
            rows[-1]["local_rel_l2"] = rel if made or i < start else 0.0
    return rows


def first_divergence(rows: list[dict], point: str) -> dict:
    index = next(i for i, r in enumerate(rows) if r["point"] == point)
    upstream = [r for r in rows[:index] if r["recorded"]]
    row = rows[index]
    return {"point": point, "layer": row["layer"], "max_abs": row["max_abs"],
            "max_ref": row["max_ref"], "rel_l2": row["rel_l2"], "cosine": row["cosine"],
            "last_agreeing": upstream[-1]["point"],
            "upstream_max_rel_l2": max(r["rel_l2"] for r in upstream),
            "upstream_points": len(upstream)}


def make_summary(verdict: str = "diverged", n_layers: int = 4, prompt: str | None = "The capital of France is",
                 missing: tuple[str, ...] = ("self_attn.scores",), diverge_at: str | None = None,
                 local: bool = False, **dims) -> dict:
    tokens = [504, 3575, 282, 4649, 314]
    if verdict == "diverged" and diverge_at is None:
        diverge_at = "model.layers.1.self_attn.q_rope"
    rows = [] if verdict == "error" else make_points(n_layers, len(tokens), diverge_at, missing, dims or None,
                                                     local)
    theta = verdict != "match"
    greedy = None if verdict == "error" else {
        "reference": [7042, 30, 378, 3575, 282, 4649, 314, 7042] + [30] * 12,
        "candidate": [7042, 30, 378, 3575, 282, 4649, 314, 7042] + [30] * 10 + ([30, 30] if not theta else [216, 9]),
        "same_prefix": 20 if not theta else 18,
        "first_flip": None if not theta else 19,
        "same_positions": 20 if not theta else 18,
        "steps": 20,
        "reference_text": " Paris. The capital of France is Paris...",
        "candidate_text": " Paris. The capital of France is Paris..." + ("" if not theta else " <b>oops</b>"),
    }
    return {
        "tracer_version": "0.1.0",
        "verdict": verdict,
        "model": "/root/.cache/tracer/smollm2-135m-instruct-q4_1",
        "prompt": prompt,
        "tokens": tokens,
        "token_texts": ["The", " capital", " of", " France", " is"],
        "reference": {"engine": "hf", "variant": {}, "label": "hf"},
        "candidate": {"engine": "reimpl", "variant": {"theta": 10000.0} if theta else {},
                      "label": "reimpl[theta=10000]" if theta else "reimpl"},
        "tolerance": {"criterion": "rel_l2", "rel_l2": TOL, "text": "rel_l2 > 1e-04"},
        "first_divergence": first_divergence(rows, diverge_at) if verdict == "diverged" else None,
        "points": rows,
        "logits": None if verdict == "error" else {
            "max_abs": 0.79 if theta else 2.8e-5, "max_ref": 19.8, "rel_l2": 0.02 if theta else 1e-6,
            "max_abs_all": 1.22 if theta else 3.1e-5, "argmax_agree": 0.8 if theta else 1.0, "positions": 5},
        "greedy": greedy,
        "environment": {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.24.0",
                        "platform": "Linux-6.8-x86_64"},
        "command": "tracer run --variant theta=10000" if theta else "tracer run",
        "timings": {"reference_s": 1.2, "candidate_s": 0.4},
        "notes": ["reimpl: 30 points not recorded (scores: fused kernel)"] if verdict != "error" else [],
        "error": "unreadable file model.safetensors: header too large" if verdict == "error" else None,
    }


class FakeResult:
    """Anything with .to_dict() is accepted, like tracer's Result."""

    def __init__(self, summary: dict):
        self.summary = summary

    def to_dict(self) -> dict:
        return self.summary


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# --- the report folder -------------------------------------------------------------------------


@pytest.mark.parametrize("verdict", ["match", "diverged", "error"])
def test_write_report_writes_every_file(tmp_path, verdict):
    summary = make_summary(verdict)
    out = reports.write_report(FakeResult(summary), tmp_path / "report")
    assert out == tmp_path / "report"
    names = {p.name for p in out.iterdir()}
    assert names == {"summary.json", "points.csv", "curve.png", "heatmap.png", "report.html", "summary.md"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no temp folder left


def test_summary_json_round_trips(tmp_path):
    summary = make_summary("diverged", prompt=HOSTILE_PROMPT)
    out = reports.write_report(summary, tmp_path / "r")
    assert json.loads((out / "summary.json").read_text(encoding="utf-8")) == summary


def test_points_csv_has_one_row_per_point(tmp_path):
    summary = make_summary("diverged")
    out = reports.write_report(summary, tmp_path / "r")
    frame = pd.read_csv(out / "points.csv")
    assert len(frame) == len(summary["points"]) == 1 + 4 * 17 + 2
    assert list(frame.columns[:3]) == ["point", "layer", "shape"]
    assert list(frame["point"]) == [p["point"] for p in summary["points"]]
    q_rope = frame.set_index("point").loc["model.layers.1.self_attn.q_rope"]
    assert q_rope["layer"] == 1 and bool(q_rope["diverged"]) and q_rope["rel_l2"] == pytest.approx(0.21)
    assert json.loads(q_rope["shape"]) == [4, 5, 16]
    missing = frame.set_index("point").loc["model.layers.0.self_attn.scores"]
    assert not missing["recorded"] and missing["missing_on"] == "candidate" and math.isnan(missing["rel_l2"])


def test_points_csv_of_a_failed_run_is_a_header(tmp_path):
    out = reports.write_report(make_summary("error"), tmp_path / "r")
    frame = pd.read_csv(out / "points.csv")
    assert len(frame) == 0 and "rel_l2" in frame.columns


def test_pngs_are_legible_images(tmp_path):
    out = reports.write_report(make_summary("diverged"), tmp_path / "r")
    width, height = png_size((out / "curve.png").read_bytes())
    assert 900 <= width <= 1600 and 450 <= height <= 900
    width, height = png_size((out / "heatmap.png").read_bytes())
    assert width >= 850 and height >= 300  # one panel: the summary has no local errors
    out = reports.write_report(make_summary("diverged", local=True), tmp_path / "s")
    width, height = png_size((out / "heatmap.png").read_bytes())
    assert 1100 <= width <= 1270 and height >= 300  # local beside total, within the page's 1272 px


def test_formats_select_files(tmp_path):
    out = reports.write_report(make_summary("match"), tmp_path / "r", formats=["html"])
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "summary.json"]
    assert "data:image/png;base64," in (out / "report.html").read_text(encoding="utf-8")
    with pytest.raises(TracerError, match="unknown report format 'pdf'"):
        reports.write_report(make_summary("match"), tmp_path / "s", formats=["pdf"])


# --- atomic replacement ------------------------------------------------------------------------


def explode(summary):
    raise RuntimeError("figure failed")


def test_failure_while_rendering_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(report_figures, "curve_figure", explode)
    with pytest.raises(RuntimeError, match="figure failed"):
        reports.write_report(make_summary("diverged"), tmp_path / "r")
    assert list(tmp_path.iterdir()) == []


def test_failure_keeps_the_previous_report(tmp_path, monkeypatch):
    out = reports.write_report(make_summary("match"), tmp_path / "r", formats=["csv"])
    before = (out / "summary.json").read_text(encoding="utf-8")
    monkeypatch.setattr(report_figures, "layer_heatmap_figure", explode)
    with pytest.raises(RuntimeError):
        reports.write_report(make_summary("diverged"), out)
    assert (out / "summary.json").read_text(encoding="utf-8") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_previous_report_is_replaced_as_a_whole(tmp_path):
    out = reports.write_report(make_summary("match"), tmp_path / "r", formats=["csv"])
    (out / "stale.txt").write_text("from an older run")
    reports.write_report(make_summary("diverged"), out, formats=["csv"])
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "summary.json").read_text(encoding="utf-8"))["verdict"] == "diverged"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_refuses_to_overwrite_other_folders(tmp_path):
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "chapter1.tex").write_text("precious")
    with pytest.raises(TracerError, match=r"refusing to overwrite .*thesis: it is not a tracer report folder"):
        reports.write_report(make_summary("match"), folder)
    assert [p.name for p in folder.iterdir()] == ["chapter1.tex"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis"]


def test_refuses_to_overwrite_a_file(tmp_path):
    target = tmp_path / "report"
    target.write_text("not a folder")
    with pytest.raises(TracerError, match="not a tracer report folder"):
        reports.write_report(make_summary("match"), target)


def test_writes_into_an_empty_folder_and_creates_parents(tmp_path):
    (tmp_path / "empty").mkdir()
    reports.write_report(make_summary("match"), tmp_path / "empty", formats=["csv"])
    out = reports.write_report(make_summary("match"), tmp_path / "a" / "b" / "r", formats=["csv"])
    assert (tmp_path / "empty" / "points.csv").is_file() and (out / "points.csv").is_file()


# --- the HTML page -----------------------------------------------------------------------------


def render(summary, images: dict | None = {}) -> str:
    """The page; without figures unless asked (images=None renders them), to keep tests fast."""
    return reports.render_html(summary, images)


def test_html_states_verdict_and_first_divergence():
    page = render(make_summary("diverged"), images=None)
    assert "DIVERGED" in page and 'class="banner diverged"' in page
    assert "the first divergence is model.layers.1.self_attn.q_rope: max|diff|" in page
    assert "Everything up to model.layers.1.self_attn.v_proj agrees at rounding level" in page
    assert 'id="first-divergence"' in page
    assert "18/20 tokens same prefix, first flip at step 19 (18/20 positions agree)" in page
    assert "argmax agrees at 4/5 positions" in page
    assert page.count("data:image/png;base64,") == 2


def test_sentence_says_exact_when_upstream_is_exact():
    summary = make_summary("diverged")
    summary["first_divergence"]["upstream_max_rel_l2"] = 0.0
    assert "agrees exactly (rel_l2 = 0 over 21 points)" in render(summary)


def test_html_for_match_and_error():
    page = render(make_summary("match"))
    assert "MATCH" in page and 'class="banner match"' in page and "within tolerance" in page
    page = render(make_summary("error"), images=None)
    assert 'class="banner error"' in page and "header too large" in page
    assert "data:image/png" not in page  # nothing to plot; the banner says why


def test_html_has_no_remote_resources():
    page = render(make_summary("diverged"), images=None)
    assert "http://" not in page and "https://" not in page
    assert "<link" not in page and " src=\"data:image/png" in page


def test_html_escapes_user_text():
    summary = make_summary("diverged", prompt=HOSTILE_PROMPT)
    summary["model"] = "/models/<img src=x onerror=alert(2)>"
    summary["token_texts"][1] = "<b>"
    summary["candidate"]["variant"]["rope"] = "<i>x</i>"
    summary["command"] = "tracer run --prompt '<script>alert(1)</script>'"
    page = render(summary)
    assert "<script>alert(1)" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &#34;q&#34;" in page
    assert "<img src=x" not in page and "<b>" not in page and "<i>x</i>" not in page
    assert "&lt;b&gt;oops&lt;/b&gt;" in page  # greedy text too
    markdown = reports.markdown_summary(summary)
    prose, code = markdown.split("```sh", 1)  # a fenced block shows text literally, unescaped
    assert "<script>" not in prose and "&lt;script&gt;alert(1)&lt;/script&gt;" in prose
    assert "'<script>alert(1)</script>'" in code


def test_html_marks_missing_points_and_diverged_rows():
    page = render(make_summary("diverged"))
    every = page.split('id="all-points"')[1]
    assert every.count('<tr class="missing"') == 4
    assert "not recorded on candidate" in page
    assert '<tr class="diverged' in page


# --- figures -----------------------------------------------------------------------------------


def test_curve_figure_marks_tolerance_and_first_divergence():
    summary = make_summary("diverged")
    fig = reports.curve_figure(summary)
    top, bottom = fig.axes
    assert top.get_yscale() == "log" and bottom.get_yscale() == "log"
    labels = [t.get_text() for t in bottom.get_xticklabels()]
    assert labels == ["embed", "0", "1", "2", "3", "norm", "logits"]
    assert any(line.get_label().startswith("tolerance") for line in top.get_lines())
    notes = [t.get_text() for t in top.texts]
    assert any("model.layers.1.self_attn.q_rope" in note for note in notes)
    assert "hf vs reimpl[theta=10000]" in fig.get_suptitle() and "(5 tokens)" in fig.get_suptitle()


def test_curve_figure_draws_zeros_at_a_floor():
    fig = reports.curve_figure(make_summary("match"))
    top = fig.axes[0]
    exact = [line for line in top.get_lines() if line.get_label().startswith("exact")]
    assert exact and all(y > 0 and math.isfinite(y) for y in exact[0].get_ydata())
    low, _ = top.get_ylim()
    assert low < min(exact[0].get_ydata())


def test_curve_handles_mathtext_and_many_layers():
    summary = make_summary("diverged", n_layers=30, prompt="costs $x^{$ and $5",
                           diverge_at="model.layers.0.self_attn.q_rope")
    png = reports.figure_png(reports.curve_figure(summary))
    assert png_size(png)[0] >= 900
    png = reports.figure_png(reports.layer_heatmap_figure(summary))
    assert png[:8] == PNG_SIGNATURE


def test_heatmap_greys_unrecorded_cells():
    fig = reports.layer_heatmap_figure(make_summary("diverged"))
    image = fig.axes[0].images[0]
    data = image.get_array()
    assert data.shape == (4, 17)
    assert data.mask[:, 6].all() and not data.mask[:, 4].any()  # scores not recorded, q_rope is
    assert type(image.norm).__name__ == "LogNorm"


def test_coarse_points_are_the_curve():
    summary = make_summary("match")
    coarse = [p["point"] for p in summary["points"] if is_coarse(p["point"])]
    fig = reports.curve_figure(summary)
    assert len(fig.axes[1].get_xticks()) == len(coarse)


# --- the real Result, and values JSON cannot hold ----------------------------------------------


def real_result() -> Result:
    """A Result as tracer.comparison.diff builds it: inf/NaN metrics become the strings "inf"/"nan"."""
    rows = make_points(2, 5, "model.layers.1.self_attn.q_rope", missing=("self_attn.scores",))
    diffs = [
        PointDiff(r["point"], r["layer"], tuple(r["shape"]) if r["shape"] else None,
                  missing_on=r["missing_on"], max_abs=r["max_abs"], max_ref=r["max_ref"],
                  rel_l2=r["rel_l2"], cosine=r["cosine"], diverged=r["diverged"],
                  reason="fused kernel" if not r["recorded"] else None)
        for r in rows
    ]
    at = next(i for i, d in enumerate(diffs) if d.point == "model.layers.1.mlp.act")
    diffs[at] = PointDiff(diffs[at].point, 1, (5, 128), max_abs=math.inf, max_ref=0.0,
                          rel_l2=math.inf, cosine=math.nan, diverged=True)
    return Result(
        verdict="diverged", points=diffs, tolerance=Tolerance(),
        first_divergence=diff.first_divergence(diffs),
        logits=None, reference={"engine": "hf", "variant": {}, "label": "hf"},
        candidate={"engine": "file", "variant": {}, "label": "file:<run>.safetensors"},
        model="tiny", tokens=[1, 2, 3, 4, 5], notes=["hf: config keys not read: <rope_scaling>"],
    )


def test_real_result_with_non_finite_metrics(tmp_path):
    result = real_result()
    out = reports.write_report(result, tmp_path / "r")
    saved = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert saved == json.loads(result.to_json())
    assert saved["points"][-5]["rel_l2"] == "inf"  # model.layers.1.mlp.act, as JSON has it
    page = (out / "report.html").read_text(encoding="utf-8")
    assert ">inf<" in page and "not recorded on candidate (fused kernel)" in page
    assert "config keys not read: &lt;rope_scaling&gt;" in page
    assert "file:&lt;run&gt;.safetensors" in page
    assert len(pd.read_csv(out / "points.csv")) == len(result.points)
    fig = reports.curve_figure(result)
    assert all(math.isfinite(v) for v in fig.axes[0].get_ylim())
    heat = reports.layer_heatmap_figure(result).axes[0].images[0]
    assert math.isfinite(heat.norm.vmax) and heat.get_array()[1, 14] == heat.norm.vmax


# --- the first divergence per position and per head --------------------------------------------


def with_breakdown(summary: dict, heads: bool = True) -> dict:
    """What the diff engine adds at the first divergence: max|diff| per token and per head."""
    first = summary["first_divergence"]
    first["by_position"] = [0.0, 0.23, 0.41, 0.66, 0.97]  # RoPE leaves position 0 alone
    first["by_head"] = [0.51, 0.97, 0.12, 0.33] if heads else None
    first["hints"] = ["exact at position 0 and growing with position: positional encoding <rope>"]
    return summary


def test_breakdown_figure_draws_positions_and_heads():
    summary = with_breakdown(make_summary("diverged"))
    fig = reports.breakdown_figure(summary)
    positions, heads = fig.axes
    assert [p.get_height() for p in positions.patches] == pytest.approx([0.0, 0.23, 0.41, 0.66, 0.97])
    assert [p.get_height() for p in heads.patches] == pytest.approx([0.51, 0.97, 0.12, 0.33])
    labels = [t.get_text() for t in positions.get_xticklabels()]
    assert labels == ["0: 'The'", "1: ' capital'", "2: ' of'", "3: ' France'", "4: ' is'"]
    assert [t.get_text() for t in heads.get_xticklabels()] == ["q0", "q1", "q2", "q3"]
    zero = [line for line in positions.get_lines() if line.get_label() == "exact 0"]
    assert list(zero[0].get_xdata()) == [0]  # the exact zero is marked, not an invisible bar
    assert positions.get_ylabel() == heads.get_ylabel() == "max |cand − ref|"
    assert "first divergence: model.layers.1.self_attn.q_rope" in fig.get_suptitle()


def test_breakdown_without_heads_and_with_many_tokens():
    summary = with_breakdown(make_summary("diverged"), heads=False)
    summary["first_divergence"]["by_position"] = [float(i) for i in range(120)]
    fig = reports.breakdown_figure(summary)
    assert len(fig.axes) == 1
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels[:4] == ["0", "", "", "3"] and len(labels) == 120  # indices only, every third


def test_breakdown_png_only_when_the_result_has_one(tmp_path):
    out = reports.write_report(with_breakdown(make_summary("diverged")), tmp_path / "r")
    assert png_size((out / "breakdown.png").read_bytes())[0] >= 900
    page = (out / "report.html").read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 3 and "per token position" in page
    assert "positional encoding &lt;rope&gt;" in page  # the hint, escaped
    out = reports.write_report(make_summary("diverged"), tmp_path / "s")
    assert not (out / "breakdown.png").exists()


# --- per-point tolerance from the noise floor --------------------------------------------------


def with_noise(summary: dict) -> dict:
    """Points judged against 10 × their rounding noise (at least 1e-6), as the diff engine does."""
    summary["tolerance"]["text"] = "rel_l2 > max(1e-06, 10 × noise)"
    for i, p in enumerate(summary["points"]):
        if p["recorded"]:
            p["noise"] = 1e-8 * (1 + i % 5) if p["point"] != EMBED else 0.0
            p["threshold"] = max(1e-6, 10 * p["noise"])
    return summary


def test_curve_draws_the_noise_band_and_per_point_tolerance():
    fig = reports.curve_figure(with_noise(make_summary("diverged")))
    top = fig.axes[0]
    labels = [h.get_label() for h in top.get_lines() + top.collections]
    assert "tolerance per point (from the noise)" in labels and "rounding noise (f32 vs f64)" in labels
    assert not any(label.startswith("tolerance (rel_l2") for label in labels)  # no single level
    low, _ = top.get_ylim()
    assert low < 1e-8


def test_heatmap_shows_where_error_is_made_beside_where_it_is_carried():
    summary = with_noise(make_summary("diverged", local=True))
    fig = reports.layer_heatmap_figure(summary)
    local_ax, total_ax, bar = fig.axes
    local, total = local_ax.images[0].get_array(), total_ax.images[0].get_array()
    assert local.shape == total.shape == (4, 17)
    q_rope = [t.get_text() for t in local_ax.get_xticklabels()].index("q_rope")
    # each cell is its error over its own tolerance: 1 is the tolerance
    assert (local[0] <= 1).all()  # layer 0 agrees at rounding level
    assert (local[1:, :q_rope] <= 1).all() and (local[1:, q_rope] > 1).all()  # q_rope makes it
    assert (total[2:, :q_rope] > 1).all()  # ... and every later op carries it
    assert local.mask[:, LAYER_POINTS_INDEX["self_attn.scores"]].all()  # not recorded
    assert {text.get_text() for text in bar.texts} == {"in", "near", "out"}
    assert sorted(line.get_ydata()[0] for line in bar.lines) == [report_figures.NEAR, 1.0]
    # the first divergence is framed, no label sits on the cells
    frames = [patch for patch in local_ax.patches if patch.get_linewidth() > 2]
    assert [(frame.get_x(), frame.get_y()) for frame in frames] == [(q_rope - 0.5, 0.5)]
    assert len(local_ax.texts) == len(total_ax.texts) == 0


def test_heatmap_without_local_errors_or_a_rel_l2_bound():
    summary = make_summary("diverged")
    fig = reports.layer_heatmap_figure(summary)
    assert len(fig.axes) == 2  # the total error alone, and its colour bar
    summary["tolerance"] = {"criterion": "elementwise", "atol": 1e-5, "rtol": 1e-4, "text": "|diff| > ..."}
    ax = reports.layer_heatmap_figure(summary).axes[0]
    crosses = [line for line in ax.get_lines() if line.get_marker() == "x"]
    diverged = sum(p["diverged"] for p in summary["points"] if p["layer"] is not None)
    assert len(crosses[0].get_xdata()) == diverged  # out-of-tolerance cells crossed: no bound to colour by


# --- config audit, Markdown size ---------------------------------------------------------------


def tf5_audit() -> dict:
    """tracer.model.config's audit of a transformers-5 re-save: candle's reader loses theta 100000."""
    from tracer.model.config import audit

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
              "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3, "vocab_size": 49152, "rms_norm_eps": 1e-5,
              "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
              "hidden_act": "silu", "torch_dtype": "<float32>"}
    return audit(config, resave="tf5")


def test_html_renders_the_config_audit():
    summary = make_summary("diverged") | {"config_audit": tf5_audit()}
    page = render(summary)
    assert '<h2 id="audit">Config audit</h2>' in page
    row = re.search(r'<tr class="differs"><td><code>rope_theta</code></td>(.*?)</tr>', page).group(1)
    assert re.findall(r"<code>([^<]*)</code>", row) == ["100000.0", "10000.0"]
    assert "<code>rope_parameters</code>" in page  # candle ignores it
    markdown = reports.markdown_summary(summary)
    assert "| `rope_theta` | 100000.0 | 10000.0 |" in markdown


def test_unknown_audit_shapes_are_shown_not_dropped():
    page = render(make_summary("diverged") | {"config_audit": {"note": "<odd>"}})
    assert '<h2 id="audit">Config audit</h2>' in page and "&lt;odd&gt;" in page


def test_markdown_is_sized_for_a_comment_and_names_the_png():
    summary = with_breakdown(make_summary("diverged", n_layers=30, diverge_at="model.layers.0.self_attn.q_rope"))
    markdown = reports.markdown_summary(summary)
    assert len(markdown) < 10_000
    assert "| first divergence | model.layers.0.self_attn.q_rope |" in markdown
    assert "![per-layer error curve](curve.png)" in markdown
    assert "```sh\ntracer run --variant theta=10000\n```" in markdown
    assert "- hint: exact at position 0" in markdown


def test_html_forbids_remote_loads_and_prints():
    page = render(make_summary("diverged"))
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert "@media print" in page


def test_drawers_forked_ahead_draw_the_same_figures_and_only_a_one_thread_process_forks_them(monkeypatch):
    """A fork copies only the calling thread: a lock another thread holds stays held in the child,
    which then hangs (seen: a report in a pytest-xdist worker waiting out its child's timeout)."""
    import os
    import threading

    import tracer.reports.drawers as drawers

    summary = make_summary()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # as on a machine with two cores
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    drawers.start_drawers()
    assert drawers._started == []  # a second thread: nothing forked
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    drawers.start_drawers()
    children = [d.pid for d in drawers._started]
    assert len(children) == len(drawers.GROUPS)
    from_drawers = drawers.report_images(summary)
    assert drawers._started == []  # used once
    for pid in children:  # every drawer has been waited for
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    here = drawers.report_images(summary)  # no drawers left: drawn in this process
    assert from_drawers == here and list(here) == ["curve.png", "heatmap.png"]  # the same bytes either way


def test_a_drawer_that_dies_leaves_its_figures_to_the_process(monkeypatch):
    import os
    import signal
    import threading

    import tracer.reports.drawers as drawers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    drawers.start_drawers()
    os.kill(drawers._started[0].pid, signal.SIGKILL)  # the curve's drawer
    images = drawers.report_images(make_summary())
    assert list(images) == ["curve.png", "heatmap.png"] and images["curve.png"][:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_that_fails_after_forking_its_drawers_kills_them_before_it_returns(monkeypatch, tmp_path, capsys):
    """Not left importing matplotlib for a report that will never come, after the command has ended."""
    import json
    import os
    import threading

    import tracer.reports.drawers as drawers
    from tests.conftest import write_tiny_llama
    from tracer.cli import main

    model = write_tiny_llama(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"rms_norm_eps": -1e-5}))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    forked = []
    start = drawers.start_drawers
    monkeypatch.setattr("tracer.cli.start_drawers", lambda: (start(), forked.extend(d.pid for d in drawers._started)))
    assert main(["run", "--model", str(model), "--tokens", "1,2,3", "--out", str(tmp_path / "report")]) == 2
    assert "rms_norm_eps" in capsys.readouterr().err
    assert len(forked) == len(drawers.GROUPS) and drawers._started == []
    for pid in forked:  # killed and waited for
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


# --- the first screen, the points that matter, what to run next -------------------------------


def test_the_first_screen_states_the_error_made_and_inherited_and_what_to_run_next():
    summary = with_noise(with_breakdown(make_summary("diverged", local=True)))
    summary["first_divergence"] |= {"local_rel_l2": 0.21, "threshold": 1e-6}
    page = render(summary)
    glance = page.split('<div class="glance">')[1].split("</div>\n</div>")[0]
    facts = dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", glance))
    assert facts["first divergence"] == "model.layers.1.self_attn.q_rope"
    assert facts["error made there"].startswith("rel_l2 0.21, 2.1e+05× its tolerance 1e-06")
    assert facts["error it inherits"].startswith("rel_l2 ≤ ") and "over the 21 points before it" in \
        facts["error it inherits"]
    assert facts["greedy, 20 tokens"].startswith("18/20 tokens same prefix")
    commands = re.findall(r"<pre>(.*?)</pre>", glance)
    assert commands == ["tracer run --variant theta=10000", "tracer sweep"]  # repeat it; every planted mistake


@pytest.mark.parametrize("command, expected", [
    ("tracer run --model m.gguf --candidate llamacpp --regime auto --prompt 'a b'",
     ["tracer record --engine llamacpp --model m.gguf --prompt 'a b' -o candidate.safetensors",
      "tracer diagnose candidate.safetensors --model m.gguf"]),
    ("tracer compare ref.safetensors port.safetensors", ["tracer diagnose port.safetensors"]),  # its model is not here
    ("tracer run --candidate file:dump.safetensors", ["tracer diagnose dump.safetensors"]),
])
def test_a_port_that_diverges_is_told_how_to_find_the_mistake_that_reproduces_it(command, expected):
    summary = make_summary("diverged") | {"command": command, "model": "no-such-folder"}
    summary["candidate"] = {"engine": "llamacpp", "variant": {}, "label": "llamacpp"}
    steps = [step for _, step in next_steps(summary)]
    assert steps == [command, *expected]


def test_a_compare_tells_diagnose_the_model_its_reference_was_recorded_on(tiny_llama, tmp_path, monkeypatch):
    """The reference trace names its model as `--model` was given: `tracer diagnose` needs it, its
    default being SmolLM2, and gets it where that folder is here."""
    tiny_llama("my-model")
    monkeypatch.chdir(tmp_path)
    summary = make_summary("diverged") | {"command": "tracer compare ref.safetensors port.safetensors",
                                          "model": "my-model"}
    summary["candidate"] = {"engine": "file", "variant": {}, "label": "my-port (file)"}
    assert next_steps(summary)[-1][1] == "tracer diagnose port.safetensors --model my-model"


def test_the_points_table_is_collapsed_to_what_matters_and_whole_behind_a_disclosure():
    summary = make_summary("diverged", n_layers=6)
    summary["points"][-4]["rel_l2"] = "nan"  # a NaN in the last block
    page = render(summary)
    key, every = page.split('id="key-points"')[1].split('id="all-points"')
    shown = re.findall(r'<td class="point">(.*?)</td>', key)
    why = dict(zip(shown, re.findall(r'<td class="why">(.*?)</td>', key)))
    assert why["model.layers.1.self_attn.q_rope"].startswith("first divergence")
    assert why["model.layers.1.self_attn.k_proj"] == "upstream of it"
    assert why["model.layers.1.self_attn.k_rope"].startswith("downstream of it")
    assert sum("worst of layer" in reason for reason in why.values()) == 6
    assert "NaN/Inf" in why[summary["points"][-4]["point"]]
    assert len(shown) < len(summary["points"]) / 3
    assert len(re.findall(r'<td class="point">', every)) == len(summary["points"])  # all of them, one click away
    assert '<details class="all" id="all">' in page and 'id="filter-text"' in page
    assert page.count("<script>") == 1 and "https://" not in page


def test_a_regime_report_keeps_its_lines_in_one_section_others_can_extend():
    summary = make_summary("match") | {"regime": {"label": "preset=llamacpp", "verdict_view": "free",
                                                  "raw": {"verdict": "diverged", "reference": {"label": "hf"}},
                                                  "caveats": ["<no AMX>"]}}
    page = render(summary)
    section = page.split('<h2 id="regime">Regime view</h2>')[1].split("<h2")[0]
    assert "raw view against f32 hf: diverged" in section and "caveat: &lt;no AMX&gt;" in section
    assert '<a href="#regime">' in page
