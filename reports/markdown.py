"""A Markdown summary to paste into an issue: verdict, the sentence, key numbers, the command.

GitHub renders raw HTML inside Markdown, so user text is HTML-escaped here too, and `|` is
escaped inside table cells.
"""

from __future__ import annotations

import html
import re

from ..points import is_coarse
from .html import logits_rows
from .summary import (
    greedy_text,
    Summary, as_summary, comparison_title, fmt, fmt_rel, points,
    tolerance_text, verdict_sentence,
)


def text(value) -> str:
    return html.escape(str(value), quote=False)


def cell(value) -> str:
    return text(value).replace("|", r"\|").replace("\n", " ")


def fenced(body: str, lang: str = "") -> str:
    """A code block whose fence is longer than any backtick run inside the body."""
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{body}\n{fence}"


def markdown_summary(result) -> str:
    """The Markdown summary of a Result (or its summary dict)."""
    summary = as_summary(result)
    verdict = str(summary.get("verdict") or "error").upper()
    parts = [
        f"### tracer: {verdict} — {text(comparison_title(summary))}",
        text(verdict_sentence(summary)),
        key_table(summary),
    ]
    notes = summary.get("notes") or []
    if notes:
        parts.insert(2, "\n".join(f"- {text(note)}" for note in notes))
    if summary.get("points"):
        parts.append(coarse_table(summary))
    if summary.get("command"):
        parts.append("Reproduce:\n\n" + fenced(str(summary["command"]), "sh"))
    env = summary.get("environment") or {}
    if env:
        parts.append(text(" · ".join(f"{k} {v}" for k, v in env.items())))
    return "\n\n".join(parts) + "\n"


def key_table(summary: Summary) -> str:
    rows = [("tolerance: fails when", tolerance_text(summary))]
    rows += [(key, value) for key, value in logits_rows(summary.get("logits"))]
    greedy = summary.get("greedy")
    if greedy:
        rows.append(("greedy", greedy_text(greedy)))
    lines = ["| | |", "|---|---|"] + [f"| {cell(k)} | {cell(v)} |" for k, v in rows]
    return "\n".join(lines)


def coarse_table(summary: Summary) -> str:
    """The coarse curve as a table, folded so the issue stays short."""
    lines = ["| point | max\\|diff\\| | max\\|ref\\| | rel_l2 | |", "|---|--:|--:|--:|---|"]
    for p in points(summary):
        if not is_coarse(p["point"]):
            continue
        status = "not recorded" if not p.get("recorded", True) else ("**diverged**" if p.get("diverged") else "")
        lines.append(f"| `{p['point']}` | {fmt(p.get('max_abs'))} | {fmt(p.get('max_ref'))} | "
                     f"{fmt_rel(p.get('rel_l2'))} | {status} |")
    return "<details><summary>coarse curve</summary>\n\n" + "\n".join(lines) + "\n\n</details>"
