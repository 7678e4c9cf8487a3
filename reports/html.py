"""The self-contained HTML report: one page, figures inlined as PNG data URIs.

Everything a user typed or a file supplied (prompt, model path, variant values, token texts,
command, error) goes through Jinja2's autoescaping; only our own CSS and script are marked safe.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping

from tracer.model.knobs import format_knob_value
from tracer.reports.drawers import report_images
from tracer.reports.routing_map import routing_facts, routing_map_html
from tracer.reports.step_map import step_map_html
from tracer.reports.summary import (
    Summary,
    as_summary,
    comparison_title,
    divergence_facts,
    first_difference,
    fmt,
    greedy_text,
    hints,
    next_steps,
    noise_floor_text,
    outcome_facts,
    regime_cost_by_layer,
    regime_lines,
    runtime_text,
    side_label,
    tolerance_text,
    verdict_sentence,
)
from tracer.reports.table import display_rows, has_local, key_rows
from tracer.reports.template import CSS, ENV, PAGE, SCRIPT, TRIANGULATION_PAGE
from tracer.reports.triangulation import (
    SUBDIR,
    agreement_matrix,
    candidate_text,
    floor_text,
    is_triangulation,
    letters,
    not_recorded,
    odd_one_text,
    row_title,
    side_rows,
    triangulation_sentence,
    triangulation_title,
)

FIGURE_CAPTIONS = {
    "curve.png": "Error per block output (log scale). Top: relative L2 against each point's tolerance; "
                 "bottom: max|diff| with max|ref| for scale.",
    "heatmap.png": "Every point of every layer, coloured by its error over its own tolerance: left, the error "
                   "each op makes (its block rerun on the reference's inputs); right, the error it has, what it "
                   "inherits included. Blue: in tolerance; yellow: near it; red: out.",
    "breakdown.png": "The first divergence broken down per token position (and per head for "
                     "attention points): where inside the tensor the error sits.",
    "routing.png": "Which experts each token went to, layer by layer: the same as the reference's, the same in "
                   "another order, others on a near-tie (noise), or others structurally (the router or its inputs "
                   "are wrong). Each cell's number: the reference's margin between its k-th and (k+1)-th "
                   "selection score.",
}
# The heatmap of a run without local errors (a saved trace, an engine that cannot rerun a block): one panel.
TOTAL_HEATMAP_CAPTION = ("Every point of every layer, coloured by its error over its own tolerance: the error "
                         "it has, what it inherits included (the error each op makes alone was not measured: "
                         "no block was rerun on the reference's inputs). Blue: in tolerance; yellow: near it; "
                         "red: out.")

_PAGE = ENV.from_string(PAGE)
_TRIANGULATION = ENV.from_string(TRIANGULATION_PAGE)


def render_html(result, images: Mapping[str, bytes] | None = None) -> str:
    """The report page for a Result (or its summary dict).

    The first screen (1400 × 900 px) answers: the verdict, the first divergence with the error made
    there and the error it inherits, the hints, the per-layer curve, the logits and greedy outcome,
    and what to run next. Then the heatmaps, the points that matter (all of them behind a disclosure,
    sortable and filterable), the config audit, the reproduction and the environment.

    Args:
        result: a `Result` or the dict `Result.to_dict()` returns.
        images: PNG bytes by file name ("curve.png", "heatmap.png"), as `write_report` already
            rendered them; None renders the figures here.
    Returns:
        The page as a string: no external resources, scripts optional.
    """
    summary = as_summary(result)
    if is_triangulation(summary):
        return render_triangulation_html(summary)
    if images is None:
        images = report_images(summary)
    return _PAGE.render(page_context(summary, images))


def render_triangulation_html(summary: Summary, *, links: bool = False) -> str:
    """A triangulation's page (its summary dict): every side, each candidate against the reference (`links`: with
    a link to its own report, `candidate-N/report.html`, as a report folder holds them), the odd one, and one
    agreement matrix per point shown."""
    marks, candidates = letters(summary), summary.get("candidates") or []
    sides = [{"letter": letter, "name": name, "what": what,
              "against": candidate_text(candidates[number - 1]) if number else "",
              "link": f"{SUBDIR.format(number)}/report.html" if links and number else None}
             for number, (letter, name, what) in enumerate(side_rows(summary))]  # 0: the reference
    rows = []
    for row in summary.get("agreement") or []:
        header, cells = agreement_matrix(row, marks)
        rows.append({"point": row["point"], "rest": row_title(row, marks).removeprefix(row["point"]),
                     "floor": floor_text(row, summary), "odd": row.get("odd_one"), "header": header,
                     "cells": [[{"text": value, "css": "differ" if value.endswith("✗") else
                                 "agree" if value.endswith("✓") else "blank" if not value else ""}
                                for value in values] for values in cells],
                     "missing": not_recorded(row, marks)})
    verdict = str(summary.get("verdict") or "error")
    return _TRIANGULATION.render(
        css=CSS, verdict=verdict if verdict in ("match", "diverged") else "error", verdict_label=verdict.upper(),
        title=triangulation_title(summary), sentence=triangulation_sentence(summary), odd=odd_one_text(summary),
        tolerance=tolerance_text(summary), sides=sides, rows=rows,
        notes=[str(note) for note in summary.get("notes") or []], command=summary.get("command"),
        model=summary.get("model") or "?", prompt=summary.get("prompt"),
        tokens=", ".join(map(str, summary.get("tokens") or [])),
        environment=sorted((str(k), str(v)) for k, v in (summary.get("environment") or {}).items()),
        timings=[(str(k).removesuffix("_s"), fmt_seconds(v)) for k, v in (summary.get("timings") or {}).items()],
        tracer_version=summary.get("tracer_version") or "?")


def page_context(summary: Summary, images: Mapping[str, bytes]) -> dict:
    verdict = str(summary.get("verdict") or "error")
    rows = display_rows(summary)
    figures = figure_entries(images, summary) if summary.get("points") else []
    audit = audit_context(summary.get("config_audit"))
    regime = regime_lines(summary)
    greedy = greedy_context(summary)
    step_map = step_map_html(summary)  # rendered (and escaped) by its own template
    routing_map = routing_map_html(summary)  # as is this one
    sections = [("verdict", "verdict"), *([("decode-steps", "decode steps")] if step_map else []),
                *([("routing", "routing")] if routing_map else []),
                *([("regime", "regime view")] if regime else []),
                *([("figures", "figures")] if len(figures) > 1 else []), *([("points", "points")] if rows else []),
                *([("audit", "config audit")] if audit else []), *([("greedy", "greedy")] if greedy else []),
                ("reproduce", "reproduce"), ("environment", "environment")]
    return {
        "css": CSS,
        "script": SCRIPT,
        "sections": sections,
        "verdict": verdict if verdict in ("match", "diverged") else "error",
        "verdict_label": verdict.upper(),
        "comparison": comparison_title(summary),
        "reference_label": side_label(summary.get("reference")),
        "candidate_label": side_label(summary.get("candidate")),
        "sentence": verdict_sentence(summary),
        "notes": [str(note) for note in summary.get("notes") or []],
        "hints": hints(summary),
        "facts": divergence_facts(summary) + routing_facts(summary) + outcome_facts(summary),
        "steps": next_steps(summary),
        "curve": next((fig for fig in figures if fig["name"] == "curve.png"), None),
        "figures": [fig for fig in figures if fig["name"] != "curve.png"],
        "audit": audit,
        "step_map": step_map,
        "routing_map": routing_map,
        "regime": regime,
        "regime_cost": [(where, fmt(cost)) for where, cost in regime_cost_by_layer(summary)],
        "tolerance": tolerance_text(summary),
        "tolerance_params": tolerance_params(summary),
        "noise_floor": noise_floor_text(summary),
        "greedy": greedy,
        "rows": rows,
        "key_rows": key_rows(summary),
        "has_first_row": any(r["first"] for r in rows),
        "has_local": has_local(summary),
        "has_bounds": any(p.get("threshold") is not None for p in summary.get("points") or []),
        "sides": [side_context("reference", summary.get("reference")),
                  side_context("candidate", summary.get("candidate"))],
        "model": summary.get("model") or "?",
        "prompt": summary.get("prompt"),
        "chat": summary.get("chat"),
        **token_context(summary),
        "command": summary.get("command"),
        "environment": sorted((str(k), str(v)) for k, v in (summary.get("environment") or {}).items()),
        "timings": [(str(k).removesuffix("_s"), fmt_seconds(v)) for k, v in (summary.get("timings") or {}).items()],
        "tracer_version": summary.get("tracer_version") or "?",
    }


def audit_context(audit) -> dict | None:
    """The config audit (what each config reader read, defaulted, ignored; where they differ).

    Anything not shaped like `tracer.model.config.audit`'s dict is shown verbatim as JSON, never dropped.
    """
    if not audit:
        return None
    readers = audit.get("readers") if isinstance(audit, Mapping) else None
    if not isinstance(readers, Mapping):
        return {"readers": None, "raw": json.dumps(audit, indent=2, default=str)}
    names = [str(name) for name in readers]
    differences = [
        (str(key), [json.dumps(values.get(name), default=str) for name in names])
        for key, values in (audit.get("differences") or {}).items()
    ]
    return {
        "resave": audit.get("resave") if audit.get("resave") not in (None, "none") else None,
        "reader_names": names,
        "differences": differences,
        "readers": [reader_context(name, entry) for name, entry in readers.items()],
    }


def reader_context(name, entry: Mapping) -> dict:
    defaulted = entry.get("defaulted") or {}
    if not isinstance(defaulted, Mapping):
        defaulted = {key: "?" for key in defaulted}
    return {
        "name": str(name),
        "error": entry.get("error"),
        "reads": [str(key) for key in entry.get("reads") or []],
        "defaulted": [(str(k), json.dumps(v, default=str)) for k, v in defaulted.items()],
        "ignored": [str(key) for key in entry.get("ignored") or []],
    }


def figure_entries(images: Mapping[str, bytes], summary: Mapping | None = None) -> list[dict]:
    """The figures as the page embeds them, each with its caption (the heatmap's says which panels it has)."""
    local = any(p.get("local_rel_l2") is not None for p in (summary or {}).get("points") or [])
    entries = []
    for name, png in images.items():
        caption = TOTAL_HEATMAP_CAPTION if name == "heatmap.png" and summary is not None and not local \
            else FIGURE_CAPTIONS.get(name, name)
        entries.append({
            "name": name,
            "uri": "data:image/png;base64," + base64.b64encode(png).decode("ascii"),
            "alt": caption,
            "caption": caption,
            "width": png_width(png) or 1100,
        })
    return entries


def png_width(png: bytes) -> int | None:
    """Pixel width from the IHDR chunk, so the <img> is shown at its natural size."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return int.from_bytes(png[16:20], "big")


def tolerance_params(summary: Summary) -> list[tuple[str, str]]:
    tol = summary.get("tolerance") or {}
    return [(k, str(v)) for k, v in tol.items() if k not in ("text", "criterion")]


def greedy_context(summary: Summary) -> dict | None:
    greedy = summary.get("greedy")
    if not greedy:
        return None
    ref, cand = list(greedy.get("reference") or []), list(greedy.get("candidate") or [])
    first = first_difference(ref, cand, greedy.get("same_prefix"))
    texts = greedy.get("reference_text"), greedy.get("candidate_text")
    common = os.path.commonprefix([t for t in texts if t is not None]) if None not in texts else ""
    return {
        "prefix_text": greedy_text(greedy),
        "sides": [
            greedy_side("reference", summary.get("reference"), ref, texts[0], common, first),
            greedy_side("candidate", summary.get("candidate"), cand, texts[1], common, first),
        ],
    }


def greedy_side(role, side, ids, text, common, first) -> dict:
    """One column: the text (the part after the common prefix marked) and the ids."""
    text = text or ""
    split = len(common) if first is not None else len(text)
    return {
        "role": role,
        "label": side_label(side),
        "common": text[:split],
        "rest": text[split:],
        "ids": [{"id": tok, "css": id_css(i, first)} for i, tok in enumerate(ids)],
    }


def id_css(i: int, first: int | None) -> str:
    if first is None or i < first:
        return ""
    return "first" if i == first else "after"


def side_context(role: str, side: Mapping | None) -> dict:
    side = side or {}
    variant = side.get("variant") or {}
    return {
        "role": role,
        "label": side_label(side),
        "engine": side.get("engine") or "?",
        "device": side.get("device"),
        "runtime": runtime_text(side),
        "variant": [(str(k), format_knob_value(v)) for k, v in variant.items()],
    }


def token_context(summary: Summary) -> dict:
    ids = list(summary.get("tokens") or [])
    texts = summary.get("token_texts")
    return {
        "tokens": [
            {"index": i, "id": tok, "text": texts[i] if texts and i < len(texts) else ""}
            for i, tok in enumerate(ids)
        ],
        "has_token_texts": bool(texts),
    }


def fmt_seconds(value) -> str:
    return fmt(value) if isinstance(value, (int, float)) else str(value)
