"""The sweep report: every variant's per-layer error curve in one figure, and one table row each.

Like the rest of `reports/`, it only renders: every function takes a `Sweep` (anything with
`.to_dict()`) or the dict saved as sweep.json, and nothing is recomputed. The page reuses the run
report's stylesheet and Jinja2 autoescaping, so every variant text and error is escaped.

- `sweep_frame(sweep)`: one row per variant, a pandas DataFrame (also sweep.csv).
- `sweep_figure(sweep)`: rel_l2 per block output, one line per variant, log scale.
- `render_sweep_html(sweep)`, `sweep_markdown(sweep)`.
- `write_sweep_report(sweep, out_dir)`: sweep.json, sweep.csv, sweep.png, sweep.html, sweep.md,
  written atomically like `write_report`.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from tracer.reports.figures import (
    COLORS,
    STYLE,
    add_tolerance,
    as_array,
    coarse_x,
    figure_png,
    floor_for,
    new_figure,
    plain,
    set_coarse_ticks,
    set_log_limits,
)
from tracer.reports.html import figure_entries
from tracer.reports.summary import (
    DASH,
    as_summary,
    fmt,
    model_name,
    rel_l2_threshold,
    short_prompt,
    tolerance_text,
)
from tracer.reports.sweep_rows import greedy_note, sweep_cells, sweep_rows
from tracer.reports.template import CSS, ENV
from tracer.reports.write import write_folder

MARKER = "sweep.json"
SWEEP_SIZE = (11.4, 5.2)  # inches: 1254 px, the page's width
CAPTION = ("Relative L2 per block output, one line per variant (log scale; exact zeros on the floor line); "
           "dotted: the tolerance each point is judged by.")


def as_sweep(sweep) -> dict:
    return as_summary(sweep)


def sweep_frame(sweep) -> pd.DataFrame:
    """One row per variant: verdict, first divergence, logits max|diff|, greedy agreement, error."""
    frame = pd.DataFrame(sweep_rows(as_sweep(sweep)))
    return frame.set_index("variant") if not frame.empty else frame


def sweep_figure(sweep) -> Figure:
    """rel_l2 per block output (embed, every layer, norm, logits), one line per variant: the diverging
    variants in colour, each labelled where its line ends, the matching ones thin and grey (they lie
    under the tolerance), the tolerance dotted. Variants that failed to load have no curve.
    """
    summary = as_sweep(sweep)
    entries = [e for e in summary.get("variants") or [] if e.get("curve")]
    with matplotlib.rc_context(STYLE):
        fig = new_figure(SWEEP_SIZE)
        ax = fig.subplots()
        if not entries:
            ax.text(0.5, 0.5, "no variant produced a curve", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            return fig
        longest = max((e["curve"] for e in entries), key=len)
        x_of = dict(zip((p["point"] for p in longest), coarse_x(longest)))
        values = [as_array([p.get("rel_l2") for p in e["curve"]]) for e in entries]
        threshold = rel_l2_threshold(summary)
        floor = floor_for(*values, below=threshold)
        cycle = matplotlib.colormaps["tab10"].colors
        diverged = [e["verdict"] == "diverged" for e in entries]
        for i, (entry, rel) in enumerate(zip(entries, values)):
            x = np.array([x_of.get(p["point"], np.nan) for p in entry["curve"]])
            y = np.where(rel == 0, floor, rel)
            if not diverged[i]:
                first_match = i == diverged.index(False)
                ax.plot(x, y, color="#9a9a9a", lw=0.9, alpha=0.8,
                        label=f"match ({len(diverged) - sum(diverged)} variants)" if first_match else None)
                continue
            color = cycle[sum(diverged[:i]) % len(cycle)]
            ax.plot(x, y, color=color, lw=1.6, marker="o", ms=2.5, label=plain(entry["variant"]))
        set_log_limits(ax, floor, *values)
        per_point = as_array([p.get("threshold") for p in longest])
        if np.isfinite(per_point).any():  # judged against each point's noise floor, as in `run`
            ax.plot(coarse_x(longest), per_point, color=COLORS["tol"], ls=":", lw=1.6, label="tolerance (per point)")
        else:
            add_tolerance(ax, threshold)
        ax.axhline(floor, color="#bbbbbb", lw=0.8)
        ax.text(1.004, floor, "exact 0", transform=ax.get_yaxis_transform(), ha="left", va="center", fontsize=7.5,
                color="#777777", clip_on=False)
        set_coarse_ticks(ax, longest, coarse_x(longest))
        ax.set_xlabel("block output (layer index)")
        ax.set_ylabel("relative L2")
        fig.legend(loc="outside right upper", fontsize=8, frameon=False)
        failed = len(summary.get("variants") or []) - len(entries)
        fig.suptitle(plain(f"tracer sweep: {len(entries)} variants vs "
                           f"{(summary.get('reference') or {}).get('label', '?')}"
                           f" on {model_name(summary)}" + (f" ({failed} more failed to load)" if failed else "")),
                     fontsize=11, fontweight="bold")
    return fig


_PAGE = ENV.from_string("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<title>tracer sweep — {{ model }}</title>
<style>{{ css | safe }}</style>
</head>
<body>
<header class="top">
<h1>tracer sweep</h1>
<p class="sub">{{ reference }} vs {{ candidate }}[variant] on {{ model }}{% if prompt %} · “{{ prompt }}”{% endif %}\
 · fails when {{ tolerance }}</p>
</header>
<div class="banner {{ 'diverged' if counts.diverged else 'match' }}">
  <span class="verdict">{{ rows | length }} variants</span>
  <span>{{ counts.diverged }} diverged · {{ counts.match }} match{% if counts.error %} · {{ counts.error }} \
failed to run{% endif %}</span>
  <p>Each variant plants one porting mistake (or one setting) in {{ candidate }} and is compared with {{ reference }}
  on the same input: where its first divergence lands is that mistake's signature.</p>
</div>
{% for fig in figures %}
<figure><img src="{{ fig.uri }}" alt="{{ fig.alt }}" width="{{ fig.width }}">\
<figcaption>{{ fig.caption }}</figcaption></figure>
{% endfor %}
<h2>Variants</h2>
<table class="points nowrap" id="variants">
<thead><tr><th>variant</th><th>verdict</th><th>first divergence</th><th class="num">rel_l2 there</th>
<th class="num">logits max|diff| (last position)</th><th class="num">argmax agrees</th>\
<th class="num">greedy same prefix</th><th>error</th></tr></thead>
<tbody>
{% for row in rows %}
<tr class="{{ row.css }}"><td class="point">{{ row.variant }}</td><td>{{ row.verdict }}</td>\
<td class="point">{{ row.first }}</td>
<td class="num">{{ row.rel }}</td><td class="num">{{ row.logits }}</td><td class="num">{{ row.agree }}</td>
<td class="num">{{ row.greedy }}</td><td>{{ row.error }}</td></tr>
{% endfor %}
</tbody>
</table>
{% if greedy_note %}<p class="muted">{{ greedy_note }}.</p>{% endif %}
{% if command %}<h2>Reproduce</h2><pre>{{ command }}</pre>{% endif %}
<footer>tracer {{ version }} · seconds: {{ timings }}</footer>
</body>
</html>
""")


def render_sweep_html(sweep, images: dict[str, bytes] | None = None) -> str:
    """The self-contained sweep page: how many variants diverge, every variant's curve overlaid, one
    row per variant (figure inlined as a data URI, everything user-given escaped)."""
    summary = as_sweep(sweep)
    if images is None:
        images = {"sweep.png": figure_png(sweep_figure(summary))}
    rows = [sweep_cells(r) for r in sweep_rows(summary)]
    figures = [dict(entry, caption=CAPTION, alt=CAPTION) for entry in figure_entries(images)]
    counts = {verdict: sum(r["verdict"] == verdict for r in rows) for verdict in ("diverged", "match", "error")}
    return _PAGE.render(
        css=CSS, model=model_name(summary), prompt=short_prompt(summary), counts=counts,
        reference=(summary.get("reference") or {}).get("label", "?"),
        candidate=(summary.get("candidate") or {}).get("engine", "?"), tolerance=tolerance_text(summary),
        greedy_note=greedy_note(summary), rows=rows, figures=figures, command=summary.get("command"),
        version=summary.get("tracer_version") or "?",
        timings=", ".join(f"{k.removesuffix('_s')} {fmt(v)}" for k, v in (summary.get("timings") or {}).items()),
    )


def sweep_markdown(sweep) -> str:
    """A Markdown table to paste into an issue."""
    summary = as_sweep(sweep)
    lines = [f"**tracer sweep** on `{model_name(summary)}` ({tolerance_text(summary)})", "",
             "| variant | verdict | first divergence | logits max\\|diff\\| | greedy |", "|---|---|---|---|---|"]
    for cells in map(sweep_cells, sweep_rows(summary)):
        first = cells["error"].replace("|", "\\|") if cells["error"] else \
            f"`{cells['first']}`" if cells["first"] != DASH else DASH
        lines.append(f"| `{cells['variant']}` | {cells['verdict']} | {first} | {cells['logits']} | {cells['greedy']} |")
    note = greedy_note(summary)
    return "\n".join(lines + ([f"\n_{note}._"] if note else [])) + "\n"


def write_sweep_report(sweep, out_dir) -> Path:
    """Write sweep.json, sweep.csv, sweep.png, sweep.html and sweep.md into `out_dir`, atomically.

    An existing sweep report there (it holds sweep.json) or an empty folder is replaced; anything
    else is refused with a TracerError.
    """
    summary = as_sweep(sweep)

    def fill(folder: Path) -> None:
        (folder / MARKER).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        sweep_frame(summary).to_csv(folder / "sweep.csv")
        png = figure_png(sweep_figure(summary))
        (folder / "sweep.png").write_bytes(png)
        (folder / "sweep.html").write_text(render_sweep_html(summary, {"sweep.png": png}), encoding="utf-8")
        (folder / "sweep.md").write_text(sweep_markdown(summary), encoding="utf-8")

    return write_folder(out_dir, MARKER, fill, "sweep")
