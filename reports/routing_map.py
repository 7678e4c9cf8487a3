"""The routing of a mixture of experts as the reports show it (`routing` in the summary,
`tracer.comparison.routing.RoutingDiff.to_dict`): the summary line, the layer × token map (each cell a
token-layer: the experts agree, agree in another order, flip on a near-tie or flip structurally, with the
reference's margin between its k-th and (k+1)-th selection score) and the per-layer table.

The same rows feed the HTML report (a table with inline colours, so that it reads the same in a notebook)
and the Markdown summary (a short per-layer table). Runs without routing points show none of it.
"""

from __future__ import annotations

import html

from tracer.reports.summary import Summary, fmt, number
from tracer.reports.template import ENV

# status (LayerRouting.status) -> (cell colour, Markdown glyph, what it means)
STATUS = {
    "agree": ("#e8f5e9", "·", "the same experts in the same order"),
    "order": ("#e3f2fd", "o", "the same experts in another order"),
    "near_tie": ("#fff3c4", "t", "other experts on a near-tie: the reference's margin is within the error "
                                 "reaching the router (noise)"),
    "structural": ("#ef9a9a", "S", "other experts by a margin no error reaching the router explains"),
    "unjudged": ("#eeeeee", "?", "other experts; no selection scores recorded to judge the margin"),
}
MAX_TOKENS = {"html": 256, "notebook": 32, "markdown": 64}


def routing_line(summary: Summary) -> str | None:
    """"routing: 100% of 14 token-layers agree", with the flips said and the first structural flip;
    None for a run without routing points."""
    routing = summary.get("routing")
    if not routing:
        return None
    agree = number(routing.get("agreement"))
    share = "100%" if agree == 1 else f"{100 * agree:.3g}%"
    line = f"routing: {share} of {routing.get('tokens')} token-layers agree"
    said = [f"{routing[key]} {what}" + ("" if routing[key] == 1 else "s")
            for key, what in (("near_ties", "near-tie flip"), ("order_only", "order-only difference"),
                              ("unjudged", "unjudged flip")) if routing.get(key)]
    if said:
        line += f" ({', '.join(said)})"
    first = routing.get("first_structural")
    if first:
        line += f"; first structural flip: {flip_text(first)}"
        if first.get("inherits"):
            line += f" (inherits the first divergence at {first['inherits']}, upstream of the router)"
    if routing.get("weight_max_abs") is not None:
        line += f"; weights on shared picks max|diff| {fmt(routing['weight_max_abs'])}"
    return line


def routing_facts(summary: Summary) -> list[tuple[str, str]]:
    """The routing as a fact beside the first divergence on the page's first screen (none without routing)."""
    line = routing_line(summary)
    return [("routing", line.removeprefix("routing: "))] if line else []


def flip_text(flip: dict) -> str:
    """"layer 1 token 3, experts {0,2} -> {0,3}, margin 0.3 >> error 3e-06"."""
    sets = f"experts {expert_set(flip['reference'])} -> {expert_set(flip['candidate'])}"
    margin, error = number(flip.get("margin")), number(flip.get("error"))
    if margin is None:
        return f"layer {flip['layer']} token {flip['token']}, {sets}"
    relation = ">>" if flip.get("kind") == "structural" else "<="
    return (f"layer {flip['layer']} token {flip['token']}, {sets}, margin {margin:.3g} {relation} error "
            + ("unknown" if error is None else f"{error:.1g}"))


def expert_set(experts) -> str:
    return "{" + ",".join(map(str, sorted(experts))) + "}"


def layer_rows(summary: Summary) -> list[dict]:
    """The per-layer table: agreement, flips by kind, order-only differences, the weights' error."""
    return [{"layer": layer["layer"], "agreement": f"{100 * number(layer['agreement']):.3g}%",
             "tokens": layer["tokens"], "flips": layer["flips"], "near_ties": layer["near_ties"],
             "structural": layer["structural"], "order_only": layer["order_only"],
             "weights": fmt(layer.get("weight_max_abs"))}
            for layer in (summary.get("routing") or {}).get("layers") or []]


def map_rows(summary: Summary, limit: int) -> tuple[list[dict], int]:
    """(one row per layer, each a cell per token: status, margin, colour, title; the tokens left out past
    `limit`)."""
    routing = summary.get("routing") or {}
    first = routing.get("first_structural") or {}
    rows, tokens = [], 0
    for layer in routing.get("layers") or []:
        statuses, margins, errors = layer.get("status") or [], layer.get("margin") or [], layer.get("error") or []
        tokens = max(tokens, len(statuses))
        cells = []
        for token, status in enumerate(statuses[:limit]):
            margin = number(margins[token]) if token < len(margins) else None
            error = number(errors[token]) if token < len(errors) else None
            cells.append({"status": status, "colour": STATUS[status][0], "text": fmt(margin),
                          "title": f"layer {layer['layer']} token {token}: margin {fmt(margin)}, error reaching "
                                   f"the router {fmt(error)} ({STATUS[status][2]})",
                          "first": (first.get("layer"), first.get("token")) == (layer["layer"], token)})
        rows.append({"layer": layer["layer"], "agreement": f"{100 * number(layer['agreement']):.3g}%",
                     "cells": cells})
    return rows, max(0, tokens - limit)


MAP = ENV.from_string("""<table class="routing-map" style="border-collapse: collapse; font-size: 12px; margin: 4px 0">
<caption style="caption-side: top; text-align: left">{{ caption }}</caption>
<thead><tr><th>layer</th><th>agree</th>\
{% for token in tokens %}<th style="text-align: right">{{ token }}</th>{% endfor %}</tr></thead>
<tbody>
{% for r in rows %}<tr data-layer="{{ r.layer }}"><td>{{ r.layer }}</td><td style="text-align: right">\
{{ r.agreement }}</td>\
{% for c in r.cells %}<td class="{{ c.status }}{% if c.first %} first{% endif %}" title="{{ c.title }}" \
style="background: {{ c.colour }}; text-align: right; font-variant-numeric: tabular-nums; color: #222\
{% if c.first %}; outline: 2px solid #222; font-weight: 700{% endif %}">{{ c.text }}</td>{% endfor %}</tr>
{% endfor %}
</tbody></table>
{% if left_out %}<p>{{ left_out }} more tokens in summary.json (<code>routing.layers</code>)</p>{% endif %}""")


def routing_map_html(summary: Summary, where: str = "html") -> str | None:
    """The layer × token map as an HTML table, each cell the reference's margin at that token coloured by
    what the candidate picked; None for a run without routing points."""
    rows, left_out = map_rows(summary, MAX_TOKENS[where])
    if not rows:
        return None
    tokens = range(max(len(r["cells"]) for r in rows))
    factor = (summary.get("routing") or {}).get("near_tie_factor")
    caption = (f"{routing_line(summary)}. Each cell: the reference's margin between its k-th and (k+1)-th "
               f"selection score at that token; a flip is a near-tie where the margin it overturns is within "
               f"{fmt(factor)} × the error reaching the router. " + "; ".join(
                   f"{name.replace('_', '-')}: {meaning}" for name, (_, _, meaning) in STATUS.items()
                   if any(c["status"] == name for r in rows for c in r["cells"])) + ". Outlined: the first "
               "structural flip.")
    return MAP.render(rows=rows, tokens=tokens, caption=caption, left_out=left_out)


def routing_markdown(summary: Summary) -> str | None:
    """The routing in a short table, one row per layer, with the map folded under it (one glyph per token);
    None for a run without routing points."""
    rows = layer_rows(summary)
    if not rows:
        return None
    lines = ["| layer | agree | flips | near-ties | structural | order only | weights max\\|diff\\| |",
             "|--:|--:|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['layer']} | {r['agreement']} of {r['tokens']} | {r['flips']} | {r['near_ties']} | "
              f"{r['structural']} | {r['order_only']} | {r['weights']} |" for r in rows]
    grid, left_out = map_rows(summary, MAX_TOKENS["markdown"])
    glyphs = [f"{r['layer']:>3} `{''.join(STATUS[c['status']][1] for c in r['cells'])}`" for r in grid]
    legend = "; ".join(f"`{glyph}` {meaning}" for glyph, meaning in ((g, m) for _, g, m in STATUS.values()))
    more = f"\n\n{left_out} more tokens in summary.json (`routing.layers`)." if left_out else ""
    return (html.escape(routing_line(summary), quote=False) + "\n\n" + "\n".join(lines)
            + "\n\n<details><summary>layers × tokens</summary>\n\n" + "  \n".join(glyphs) + more
            + f"\n\n{legend}\n\n</details>")
