"""The terminal summary and the HTML report name the same worst point, NaN ranked first in both."""

from tracer.reports.html import render_html
from tracer.reports.summary import worst_point
from tracer.reports.terminal import terminal_summary


def summary_with(points):
    return {"verdict": "match", "model": "m", "prompt": None, "tokens": [1, 2],
            "reference": {"engine": "hf", "label": "hf"}, "candidate": {"engine": "reimpl", "label": "reimpl"},
            "tolerance": {"criterion": "rel_l2", "rel_l2": 1e-4, "text": "rel_l2 > 1e-4"},
            "first_divergence": None, "points": points, "logits": None, "greedy": None, "notes": []}


def point(name, rel):
    return {"point": name, "layer": 0, "shape": [2, 4], "recorded": True, "missing_on": None, "max_abs": 0.1,
            "max_ref": 1.0, "rel_l2": rel, "cosine": 1.0, "diverged": False}


def test_nan_is_the_worst_point_in_every_view():
    summary = summary_with([point("model.layers.0.input_layernorm", 3e-5),
                            point("model.layers.0.self_attn.q_proj", "nan"),
                            point("model.layers.0.self_attn.k_proj", 5e-5)])
    assert worst_point(summary)["point"] == "model.layers.0.self_attn.q_proj"
    assert "largest error: model.layers.0.self_attn.q_proj rel_l2 nan" in terminal_summary(summary)
    assert "the largest rel_l2 is nan at model.layers.0.self_attn.q_proj" in render_html(summary, images={})


def test_the_largest_finite_error_otherwise():
    summary = summary_with([point("model.layers.0.input_layernorm", 3e-5),
                            point("model.layers.0.self_attn.k_proj", 5e-5)])
    assert "largest error: model.layers.0.self_attn.k_proj" in terminal_summary(summary)
    assert "5e-05 at model.layers.0.self_attn.k_proj" in render_html(summary, images={})
