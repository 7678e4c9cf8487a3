"""Jupyter: the HTML fragments `Result._repr_html_`, `Trace._repr_html_`, `Sweep._repr_html_` and
`Triangulation._repr_html_` return, and `.plot()`.

A notebook page is shared with other cells and other libraries, so a fragment here is not the
report page: its CSS is scoped under one class (`.tracer-nb`), it sets no fonts or colours outside
it, and it carries no script. It shows what answers the question at a glance (the verdict, where
it starts, the curve, the diverging block's points); the full table is `result.table()`.
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Mapping

from matplotlib.figure import Figure

from tracer.core.errors import TracerError
from tracer.model.points import EMBED, folded, is_coarse, layer_of, rank
from tracer.reports.figures import (
    breakdown_figure,
    curve_figure,
    figure_png,
    has_breakdown,
    layer_heatmap_figure,
    routing_figure,
)
from tracer.reports.routing_map import routing_facts, routing_map_html
from tracer.reports.step_map import step_map_html
from tracer.reports.summary import (
    Summary,
    as_summary,
    comparison_title,
    divergence_facts,
    hints,
    outcome_facts,
    side_label,
    tolerance_text,
    verdict_sentence,
)
from tracer.reports.sweep_rows import sweep_cells, sweep_rows
from tracer.reports.table import display_rows, has_local
from tracer.reports.template import ENV
from tracer.reports.triangulation import (
    agreement_matrix,
    candidate_text,
    floor_text,
    letters,
    odd_one_text,
    row_title,
    side_rows,
    triangulation_sentence,
)

# Every selector starts with the scope class: nothing here can restyle the rest of the notebook.
CSS = """
.tracer-nb { font-size: 13px; line-height: 1.4; max-width: 1100px; }
.tracer-nb .tn-banner { border-radius: 5px; padding: 8px 12px; color: #fff; margin: 2px 0 8px; }
.tracer-nb .tn-banner.match { background: #2e7d32; }
.tracer-nb .tn-banner.diverged { background: #c62828; }
.tracer-nb .tn-banner.error { background: #6d4c41; }
.tracer-nb .tn-verdict { font-weight: 700; font-size: 15px; letter-spacing: .04em; margin-right: 8px; }
.tracer-nb .tn-banner p { margin: 4px 0 0; overflow-wrap: anywhere; }
.tracer-nb .tn-banner ul { margin: 4px 0 0; padding-left: 18px; }
.tracer-nb table.tn { border-collapse: collapse; margin: 4px 0 8px; }
.tracer-nb table.tn th, .tracer-nb table.tn td { padding: 2px 8px; text-align: left;
    border-bottom: 1px solid rgba(127, 127, 127, .25); vertical-align: top; }
.tracer-nb table.tn td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.tracer-nb table.tn tr.diverged td { background: rgba(198, 40, 40, .10); }
.tracer-nb table.tn tr.first td { background: rgba(198, 40, 40, .28); font-weight: 600; }
.tracer-nb table.tn tr.missing td { opacity: .6; font-style: italic; }
.tracer-nb code { font-size: 12px; }
.tracer-nb img { max-width: 100%; height: auto; }
.tracer-nb .tn-muted { opacity: .7; }
.tracer-nb details > summary { cursor: pointer; margin: 4px 0; }
"""


RESULT = ENV.from_string("""<div class="tracer-nb">
<style>{{ css | safe }}</style>
<div class="tn-banner {{ verdict }}">
  <span class="tn-verdict">{{ verdict_label }}</span>
  <span>{{ comparison }} · fails when {{ tolerance }}</span>
  <p>{{ sentence }}</p>
  {% if hints %}<ul>{% for hint in hints %}<li>{{ hint }}</li>{% endfor %}</ul>{% endif %}
</div>
{% if notes %}<ul>{% for note in notes %}<li class="tn-muted">{{ note }}</li>{% endfor %}</ul>{% endif %}
{% if outputs %}
<table class="tn">{% for key, value in outputs %}<tr><th>{{ key }}</th><td>{{ value }}</td></tr>{% endfor %}</table>
{% endif %}
{% if curve %}<img src="{{ curve }}" alt="per-layer error curve">{% endif %}
{% if step_map %}<details open><summary>decode steps × layers</summary>{{ step_map | safe }}</details>{% endif %}
{% if routing_map %}<details open><summary>routing: layers × tokens</summary>{{ routing_map | safe }}</details>\
{% endif %}
{% if rows %}
<details{% if open_rows %} open{% endif %}><summary>{{ rows_title }}</summary>
<table class="tn">
<tr><th>point</th><th>shape</th><th>max|diff|</th><th>max|ref|</th><th>rel_l2</th>\
{% if has_local %}<th title="its block rerun on the reference's inputs">local rel_l2</th>{% endif %}<th>status</th></tr>
{% for r in rows %}<tr{% if r.css %} class="{{ r.css }}"{% endif %}><td><code>{{ r.point }}</code></td>\
<td>{{ r.shape }}</td>
{% for text, key in r.cells %}<td class="num">{{ text }}</td>{% endfor %}\
{% if has_local %}<td class="num">{{ r.local[0] }}</td>{% endif %}<td>{{ r.status }}</td></tr>
{% endfor %}
</table>
</details>
{% endif %}
<p class="tn-muted">{{ points_count }} points · <code>.table()</code> every point as a DataFrame ·
<code>.plot()</code> curve, <code>.plot("heatmap")</code>\
{% if has_breakdown %}, <code>.plot("breakdown")</code>{% endif %}
· <code>tracer.reports.write_report(result, "tracer-report")</code> the files for an issue</p>
</div>""")

TRACE = ENV.from_string("""<div class="tracer-nb">
<style>{{ css | safe }}</style>
<p><b>Trace</b> <code>{{ label }}</code> · {{ count }} points on {{ tokens }}\
{% if model %} · <code>{{ model }}</code>{% endif %}</p>
{% if facts %}<table class="tn">{% for key, value in facts %}\
<tr><th>{{ key }}</th><td><code>{{ value }}</code></td></tr>{% endfor %}</table>{% endif %}
<details{% if open_rows %} open{% endif %}><summary>points ({{ count }}; <code>{i}</code> = layer index)</summary>
<table class="tn">
<tr><th>point</th><th>layers</th><th>shape</th><th>dtype</th></tr>
{% for r in rows %}<tr><td><code>{{ r.point }}</code></td>\
<td>{{ r.layers }}</td><td>{{ r.shape }}</td><td>{{ r.dtype }}</td></tr>
{% endfor %}
</table>
</details>
{% if not_recorded %}<p class="tn-muted">not recorded: {% for point, reason in not_recorded %}\
<code>{{ point }}</code> ({{ reason }}){% if not loop.last %}, {% endif %}{% endfor %}</p>{% endif %}
<p class="tn-muted"><code>trace["{{ example }}"]</code> a tensor · <code>.table()</code> a DataFrame · \
<code>.save(path)</code></p>
</div>""")


# --- Result -------------------------------------------------------------------------------------


def result_html(result, *, figure: bool = True) -> str:
    """The notebook view of a Result (or its summary dict): a scoped HTML fragment.

    Args:
        result: a `Result` or the dict `Result.to_dict()` returns.
        figure: embed the per-layer curve (a PNG, about 100 kB); False for a text-only view.
    """
    summary = as_summary(result)
    verdict = str(summary.get("verdict") or "error")
    rows, title, open_rows = focus_rows(summary)
    outputs = divergence_facts(summary) + routing_facts(summary) + outcome_facts(summary)
    curve = None
    if figure and summary.get("points"):
        curve = "data:image/png;base64," + base64.b64encode(figure_png(curve_figure(summary))).decode("ascii")
    return RESULT.render(
        css=CSS, verdict=verdict if verdict in ("match", "diverged") else "error",
        verdict_label=verdict.upper(), comparison=comparison_title(summary),
        tolerance=tolerance_text(summary), sentence=verdict_sentence(summary), hints=hints(summary),
        notes=[str(n) for n in summary.get("notes") or []], outputs=outputs, curve=curve,
        rows=rows, rows_title=title, open_rows=open_rows, points_count=len(summary.get("points") or []),
        has_breakdown=has_breakdown(summary), has_local=has_local(summary),
        step_map=step_map_html(summary, "notebook"),
        routing_map=routing_map_html(summary, "notebook"),
    )


def focus_rows(summary: Summary) -> tuple[list[dict], str, bool]:
    """The rows worth a look: the diverging block's points (open), else the coarse curve (folded)."""
    rows = display_rows(summary)
    first = summary.get("first_divergence") or {}
    layer = first.get("layer")
    if first and layer is not None:
        block = [r for r in rows if layer_of(r["point"]) == layer]
        return block, f"block {layer}, where the first divergence is ({len(block)} points)", True
    if first:  # embeddings, final norm or logits: show it with the coarse points
        coarse = [r for r in rows if is_coarse(r["point"])]
        return coarse, f"coarse points ({len(coarse)})", True
    coarse = [r for r in rows if is_coarse(r["point"])]
    return coarse, f"coarse points ({len(coarse)}): embeddings, every block output, norm, logits", False


FIGURES = {"curve": curve_figure, "heatmap": layer_heatmap_figure, "breakdown": breakdown_figure,
           "routing": routing_figure}


def plot(result, kind: str = "curve"):
    """A matplotlib Figure of a Result: "curve" (per-layer error), "heatmap", "breakdown" or "routing" (a
    mixture of experts' layer × token routing map).

    Figures are built without pyplot (no global state); in a notebook they display as the
    cell's value, like any figure.

    Raises:
        TracerError: an unknown kind, or "breakdown" on a result without one.
    """
    if kind not in FIGURES:
        raise TracerError(f"unknown plot kind {kind!r}; choose from {', '.join(FIGURES)}")
    summary = as_summary(result)
    if kind == "breakdown" and not has_breakdown(summary):
        raise TracerError("this result has no per-position or per-head breakdown of a first divergence")
    if kind == "routing" and not summary.get("routing"):
        raise TracerError("this result has no routing: its traces carry no mixture-of-experts routing points")
    show_figures_inline()
    return FIGURES[kind](summary)


def show_figures_inline() -> None:
    """Let a running IPython kernel display a bare Figure as a PNG.

    Our figures never touch pyplot, so the inline backend may not have registered its Figure
    formatter yet (it does that when pyplot is first imported); this registers the same one.
    """
    shell = _ipython_shell()
    if shell is None:
        return
    formatter = shell.display_formatter.formatters.get("image/png")
    if formatter is None or Figure in formatter.type_printers:
        return
    from IPython.core.pylabtools import select_figure_formats  # IPython: in a notebook only

    select_figure_formats(shell, {"png"})


def _ipython_shell():
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


# --- Sweep --------------------------------------------------------------------------------------

SWEEP = ENV.from_string("""<div class="tracer-nb">
<style>{{ css | safe }}</style>
<p><b>Sweep</b> of {{ rows | length }} variants against <code>{{ reference }}</code>\
{% if model %} on <code>{{ model }}</code>{% endif %}\
{% if prompt %} · {{ prompt }}{% endif %} · fails when {{ tolerance }}</p>
{% if figure %}<img src="{{ figure }}" alt="every variant's per-layer error curve">{% endif %}
<table class="tn">
<tr><th>variant</th><th>verdict</th><th>first divergence</th>\
<th>rel_l2 there</th><th>logits max|diff|</th><th>greedy same prefix</th></tr>
{% for r in rows %}<tr{% if r.css %} class="{{ r.css }}"{% endif %}>
<td><code>{{ r.variant }}</code></td><td>{{ r.verdict }}</td>
<td>{% if r.error %}{{ r.error }}{% else %}<code>{{ r.first }}</code>{% endif %}</td>
<td class="num">{{ r.rel }}</td><td class="num">{{ r.logits }}</td><td class="num">{{ r.greedy }}</td></tr>
{% endfor %}
</table>
<p class="tn-muted"><code>.table()</code> a DataFrame · <code>sweep["theta=10000"]</code> one variant's row</p>
</div>""")


def sweep_html(sweep, *, figure: bool = True) -> str:
    """The notebook view of a sweep (a `Sweep` or its dict): the overlay of every variant's curve
    and one row per variant, as `tracer.reports.sweep` renders them for the report."""
    from tracer.reports.sweep import sweep_figure  # pandas: a sweep's table only
    summary = as_summary(sweep)
    rows = [sweep_cells(r) for r in sweep_rows(summary)]
    image = None
    if figure and any(r["verdict"] != "error" for r in rows):
        image = "data:image/png;base64," + base64.b64encode(figure_png(sweep_figure(summary))).decode("ascii")
    return SWEEP.render(css=CSS, rows=rows, reference=side_label(summary.get("reference")),
                        model=summary.get("model"), prompt=summary.get("prompt"),
                        tolerance=tolerance_text(summary), figure=image)


# --- Triangulation ------------------------------------------------------------------------------

TRIANGULATION = ENV.from_string("""<div class="tracer-nb">
<style>{{ css | safe }}</style>
<div class="tn-banner {{ verdict }}"><span class="tn-verdict">{{ verdict | upper }}</span>{{ sentence }}\
{% if odd %}<p>{{ odd }}</p>{% endif %}</div>
<table class="tn">
{% for letter, name, what, against in sides %}<tr><td><b>{{ letter }}</b></td><td><code>{{ name }}</code></td>\
<td>{{ what }}</td><td>{{ against }}</td></tr>
{% endfor %}</table>
{% for title, floor, header, cells in rows %}<p>at <code>{{ title }}</code> <span class="tn-muted">· {{ floor }}\
</span></p>
<table class="tn"><tr>{% for head in header %}<th>{{ head }}</th>{% endfor %}</tr>
{% for values in cells %}<tr>{% for value in values %}<td class="num">{{ value }}</td>{% endfor %}</tr>{% endfor %}
</table>
{% endfor %}
<p class="tn-muted"><code>tri["mlx"]</code> one candidate's <code>Result</code> · <code>.to_dict()</code></p>
</div>""")


def triangulation_html(triangulation) -> str:
    """The notebook view of a triangulation (a `Triangulation` or its dict): the sides, each candidate against
    the reference, the odd one and the agreement matrices, as the report page shows them."""
    summary = as_summary(triangulation)
    marks, candidates = letters(summary), summary.get("candidates") or []
    sides = [(letter, name, what, candidate_text(candidates[number - 1]) if number else "")
             for number, (letter, name, what) in enumerate(side_rows(summary))]  # 0: the reference
    rows = [(row_title(row, marks), floor_text(row, summary), *agreement_matrix(row, marks))
            for row in summary.get("agreement") or []]
    return TRIANGULATION.render(css=CSS, verdict=summary.get("verdict"), sentence=triangulation_sentence(summary),
                                odd=odd_one_text(summary), sides=sides, rows=rows)


# --- Trace --------------------------------------------------------------------------------------


def trace_html(trace) -> str:
    """The notebook view of a Trace: what it holds, one row per kind of point (layers folded)."""
    meta = trace.meta
    tokens = meta.tokens or []
    facts = [(key, value) for key, value in (("prompt", meta.prompt), ("dtype", meta.dtype), ("device", meta.device))
             if value is not None]
    versions = meta.versions
    if isinstance(versions, Mapping):
        facts.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items())))
    rows = folded_rows(trace)
    not_recorded = sorted(trace.not_recorded.items())
    return TRACE.render(
        css=CSS, label=trace.label, count=len(trace), model=meta.model,
        tokens=f"{len(tokens)} token" + ("" if len(tokens) == 1 else "s") if tokens else "unknown tokens",
        facts=facts, rows=rows, open_rows=len(rows) <= 30, not_recorded=fold_not_recorded(not_recorded),
        example=next(iter(trace.tensors), EMBED),
    )


def folded_rows(trace) -> list[dict]:
    """One row per point name with the layer index replaced by {i}: 513 points in ~20 rows, in the
    execution order of the trace's model family."""
    groups: dict[tuple, list] = {}
    for name, tensor in trace.tensors.items():
        key = (folded(name), tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        groups.setdefault(key, []).append(layer_of(name))
    rows = [
        {"point": pattern, "layers": layer_ranges(layers), "shape": "×".join(map(str, shape)) or "scalar",
         "dtype": dtype}
        for (pattern, shape, dtype), layers in groups.items()
    ]
    family = trace.meta.family
    return sorted(rows, key=lambda r: rank(r["point"], family))


def layer_ranges(layers: list) -> str:
    """[0, 1, 2, 5] -> "0–2, 5"; empty for points outside the blocks."""
    numbers = sorted(layer for layer in layers if layer is not None)
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in spans)


def fold_not_recorded(items: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Unrecorded points, layer index folded the same way ("model.layers.{i}.self_attn.scores")."""
    groups: dict[tuple[str, str], list] = {}
    for name, reason in items:
        groups.setdefault((folded(name), str(reason)), []).append(layer_of(name))
    return [(f"{pattern} [{layer_ranges(layers)}]" if layer_ranges(layers) else pattern, reason)
            for (pattern, reason), layers in groups.items()]
