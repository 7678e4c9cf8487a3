"""The step × layer map of a decoded run (`--decode N`): one row per step (the cached prefill, then each
decode step), one cell per layer holding the layer's largest rel_l2 at that step, coloured by whether
the step makes that error itself (its local error, on the reference's inputs and cache, leaves the
floor), only inherits it (from the block before or the cache written at an earlier step), or matches.

The same rows feed the HTML report, the notebook view (an HTML table with inline colours, so that it
needs no page CSS) and the Markdown summary (one glyph per layer).
"""

from __future__ import annotations

from tracer.reports.summary import DASH, Summary, fmt, number
from tracer.reports.template import ENV

# status (StepResult.layer_status) -> (cell colour, Markdown glyph, what it means)
STATUS = {
    "match": ("#e8f5e9", "·", "within the floor"),
    "local": ("#ef9a9a", "L", "the step's own op makes the error (its local error leaves the floor)"),
    "inherited": ("#ffe0b2", "i", "inherited: every local error within the floor (the error comes from the block "
                                   "before or the cache written at an earlier step)"),
    "diverged": ("#f9c9c4", "x", "diverged (local errors not measured for this candidate)"),
}
MAX_ROWS = {"html": 256, "notebook": 32, "markdown": 64}


def step_rows(summary: Summary, limit: int) -> tuple[list[dict], int]:
    """(the map's rows, the steps left out past `limit`): the first `limit` steps, and the first
    diverged step where it is later."""
    steps = summary.get("steps") or []
    shown = list(steps[:limit])
    first = next((s for s in steps if s.get("verdict") != "match"), None)
    if first is not None and first not in shown:
        shown[-1] = first
    first_point = (first or {}).get("first_divergence") or {}
    rows = []
    for step in shown:
        statuses = step.get("layer_status") or []
        local = step.get("layer_max_local_rel_l2") or []
        cells = []
        for layer, value in enumerate(step.get("layer_max_rel_l2") or []):
            status = statuses[layer] if layer < len(statuses) else ("match" if step.get("verdict") == "match"
                                                                      else "diverged")
            mine = number(local[layer]) if layer < len(local) else None
            title = f"layer {layer}: rel_l2 {fmt(value)}" + (f", local {fmt(mine)}" if local else "") + \
                f" ({STATUS[status][2]})"
            cells.append({"text": fmt(value), "status": status, "colour": STATUS[status][0], "title": title,
                          "first": step is first and first_point.get("layer") == layer})
        rows.append({"step": step.get("step"), "label": "prefill" if step.get("step") == 0 else str(step.get("step")),
                     "position": step.get("position"), "token": token_text(step.get("tokens") or []),
                     "verdict": step.get("verdict"), "origin": origin(step), "cells": cells})
    return rows, len(steps) - len(shown)


def token_text(tokens: list[int]) -> str:
    """A step's tokens: the one a decode step was fed, the prompt's count for the prefill."""
    return DASH if not tokens else ", ".join(map(str, tokens)) if len(tokens) <= 2 else f"{len(tokens)} tokens"


def origin(step: dict) -> str:
    """A diverged step in a word: made here (local), inherited (from which step's cache), or diverged."""
    if step.get("verdict") == "match":
        return "match"
    if step.get("local") is None:
        return "diverged"
    written = step.get("inherited_from")
    cache = None if written is None else "the prefill" if written == 0 else f"step {written}"
    if step.get("local"):
        return "made here" + (f", reads the wrong cache of {cache}" if cache else "")
    return "inherited" + (f" from the cache of {cache}" if cache else "")


MAP = ENV.from_string("""<table class="step-map" style="border-collapse: collapse; font-size: 12px; margin: 4px 0">
<caption style="caption-side: top; text-align: left">{{ caption }}</caption>
<thead><tr><th>step</th><th>position</th><th>token</th><th>step's error</th>\
{% for layer in layers %}<th style="text-align: right">{{ layer }}</th>{% endfor %}</tr></thead>
<tbody>
{% for r in rows %}<tr data-step="{{ r.step }}"><td>{{ r.label }}</td><td style="text-align: right">{{ r.position }}\
</td><td>{{ r.token }}</td><td>{{ r.origin }}</td>\
{% for c in r.cells %}<td class="{{ c.status }}{% if c.first %} first{% endif %}" title="{{ c.title }}" \
style="background: {{ c.colour }}; text-align: right; font-variant-numeric: tabular-nums; color: #222\
{% if c.first %}; outline: 2px solid #222; font-weight: 700{% endif %}">{{ c.text }}</td>{% endfor %}</tr>
{% endfor %}
</tbody></table>
{% if left_out %}<p>{{ left_out }} more steps in summary.json (<code>steps</code>)</p>{% endif %}""")


def step_map_html(summary: Summary, where: str = "html") -> str | None:
    """The map as an HTML table (inline colours: it reads the same in the report page and a notebook);
    None for a run without decode steps."""
    rows, left_out = step_rows(summary, MAX_ROWS[where])
    if not rows:
        return None
    layers = range(max(len(r["cells"]) for r in rows))
    caption = ("Each step's largest rel_l2 per layer. " + "; ".join(
        f"{name}: {meaning}" for name, (_, _, meaning) in STATUS.items() if any(
            c["status"] == name for r in rows for c in r["cells"])) + ". Outlined: the first divergence.")
    return MAP.render(rows=rows, layers=layers, caption=caption, left_out=left_out)


def step_map_markdown(summary: Summary) -> str | None:
    """The map in one line per step, one glyph per layer (`·` match, `L` made here, `i` inherited, `x`
    diverged), folded; None for a run without decode steps."""
    rows, left_out = step_rows(summary, MAX_ROWS["markdown"])
    if not rows:
        return None
    layers = max(len(r["cells"]) for r in rows)
    lines = [f"| step | position | step's error | layers 0–{layers - 1} | worst rel_l2 |", "|---|--:|---|---|--:|"]
    steps = {s.get("step"): s for s in summary.get("steps") or []}
    for r in rows:
        glyphs = "".join(STATUS[c["status"]][1] for c in r["cells"])
        worst = max((v for v in map(number, steps[r["step"]].get("layer_max_rel_l2") or []) if v is not None),
                    default=None)
        lines.append(f"| {r['label']} | {r['position']} | {r['origin']} | `{glyphs}` | {fmt(worst)} |")
    legend = "; ".join(f"`{glyph}` {meaning}" for _, glyph, meaning in STATUS.values())
    more = f"\n\n{left_out} more steps in summary.json (`steps`)." if left_out else ""
    return ("<details><summary>decode steps × layers</summary>\n\n" + "\n".join(lines) + more
            + f"\n\n{legend}\n\n</details>")
