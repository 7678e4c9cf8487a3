"""Reports: render a Result as files to attach to a bug issue. They only render, never recompute.

Every function takes a `Result` (anything with `.to_dict()`) or the summary dict it returns,
the same dict that is saved as summary.json, so a report can be rebuilt from that file alone.

- `write_report(result, out_dir)`: the report folder (summary.json, points.csv, curve.png,
  heatmap.png, breakdown.png when there is one, report.html, summary.md), written atomically.
  A `Triangulation`'s folder holds its own summary.json, report.html and summary.md, and each
  candidate's report in `candidate-N/`.
- `curve_figure(summary)` / `layer_heatmap_figure(summary)` / `breakdown_figure(summary)`:
  matplotlib figures (Agg); `plot(result, kind)` picks one by name (what `Result.plot` calls).
- `result_html(result)` / `trace_html(trace)`: the scoped HTML fragments Jupyter shows.
- `render_html(result)`: the self-contained page as a string.
- `markdown_summary(result)`: a short Markdown block to paste into an issue.
"""

from importlib import import_module

from tracer.core.renderers import register_renderers

# Attribute -> submodule. Loaded on first use: matplotlib and pandas cost most of a second, and
# `tracer run` only needs them when it writes a report (the terminal summary needs neither).
_EXPORTS = {
    "FORMATS": "write",
    "as_summary": "summary",
    "breakdown_figure": "figures",
    "curve_figure": "figures",
    "figure_png": "figures",
    "layer_heatmap_figure": "figures",
    "markdown_summary": "markdown",
    "plot": "notebook",
    "sweep_cells": "sweep_rows",
    "render_html": "html",
    "render_sweep_html": "sweep",
    "sweep_figure": "sweep",
    "sweep_frame": "sweep",
    "sweep_markdown": "sweep",
    "write_sweep_report": "sweep",
    "report_images": "drawers",
    "result_html": "notebook",
    "routing_line": "routing_map",
    "flip_text": "routing_map",
    "sweep_html": "notebook",
    "trace_html": "notebook",
    "triangulation_html": "notebook",
    "write_report": "write",
}

__all__ = sorted(_EXPORTS)
# What a value's methods render through (`tracer.core.renderers`): Result.plot / _repr_html_,
# Trace._repr_html_, Sweep.table / plot / _repr_html_, Triangulation._repr_html_, RoutingDiff.text and
# Flip.text. Each loads its submodule when first called.
RENDERED = ("plot", "result_html", "trace_html", "sweep_frame", "sweep_figure", "sweep_html", "triangulation_html",
            "routing_line", "flip_text")


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])


def _lazy(name: str):
    def render(*args, **kwargs):
        return __getattr__(name)(*args, **kwargs)

    return render


register_renderers({name: _lazy(name) for name in RENDERED})
