"""A Markdown summary to paste into an issue: verdict, the sentence, key numbers, the command.

GitHub renders raw HTML inside Markdown, so user text is HTML-escaped here too, and `|` is
escaped inside table cells.
"""

from __future__ import annotations

import html
import re

from tracer.model.points import is_coarse
from tracer.reports.routing_map import routing_markdown
from tracer.reports.step_map import step_map_markdown
from tracer.reports.summary import (
    Summary,
    as_summary,
    comparison_title,
    divergence_facts,
    fmt,
    hints,
    next_steps,
    noise_floor_text,
    outcome_facts,
    points,
    regime_lines,
    runtime_text,
    tolerance_text,
    verdict_sentence,
)
from tracer.reports.triangulation import (
    SUBDIR,
    agreement_matrix,
    candidate_text,
    floor_text,
    is_triangulation,
    letters,
    not_recorded,
    odd_one_text,
    row_odd_text,
    row_title,
    side_rows,
    triangulation_sentence,
    triangulation_title,
)


def text(value) -> str:
    return html.escape(str(value), quote=False)


def cell(value) -> str:
    return text(value).replace("|", r"\|").replace("\n", " ")


def inline_code(body: str) -> str:
    """`body` as inline code whose backtick run is longer than any inside it (shown literally)."""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", body)), default=0) + 1)
    return f"{fence} {body} {fence}" if len(fence) > 1 else f"`{body}`"


def fenced(body: str, lang: str = "") -> str:
    """A code block whose fence is longer than any backtick run inside the body."""
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{body}\n{fence}"


def markdown_summary(result) -> str:
    """The Markdown summary of a Result, a Triangulation or its summary dict."""
    summary = as_summary(result)
    if is_triangulation(summary):
        return triangulation_markdown(summary)
    verdict = str(summary.get("verdict") or "error").upper()
    parts = [
        f"### tracer: {verdict} — {text(comparison_title(summary))}",
        text(verdict_sentence(summary)),
        key_table(summary),
    ]
    listed = [f"- hint: {text(hint)}" for hint in hints(summary)]
    listed += [f"- {text(line)}" for line in regime_lines(summary)]
    listed += [f"- {text(note)}" for note in summary.get("notes") or []]
    if listed:
        parts.insert(2, "\n".join(listed))
    routing = routing_markdown(summary)
    if routing:
        parts.append(routing)
    differences = audit_differences(summary.get("config_audit"))
    if differences:
        parts.append(differences)
    chat = summary.get("chat")
    if chat:
        parts.append(f"Fed through the model's chat template ({chat.get('tokens')} tokens):\n\n"
                     + fenced(str(chat.get("text"))))
    if summary.get("points"):
        parts.append(FIGURE_LINE)
        parts.append(coarse_table(summary))
    step_map = step_map_markdown(summary)
    if step_map:
        parts.append(step_map)
    if summary.get("command"):
        parts.append("Reproduce:\n\n" + fenced(str(summary["command"]), "sh"))
    then = [(what, command) for what, command in next_steps(summary) if command != summary.get("command")]
    if then:
        parts.append("Next:\n\n" + "\n".join(f"- {text(what)}: {inline_code(command)}" for what, command in then))
    env = summary.get("environment") or {}
    if env:
        parts.append(text(" · ".join(f"{k} {v}" for k, v in env.items())))
    return "\n\n".join(parts) + "\n"


# The report folder's PNG by file name: it renders next to summary.md (a local viewer, a gist);
# in an issue comment, dropping the file in replaces the link with GitHub's upload.
FIGURE_LINE = ("![per-layer error curve](curve.png)\n\n"
               "_`curve.png`, `heatmap.png` and `report.html` are in the report folder: drag them into "
               "the comment to attach them._")


def audit_differences(audit) -> str | None:
    """The config readers' disagreements as a small table (the full audit is in report.html)."""
    if not isinstance(audit, dict) or not isinstance(audit.get("readers"), dict):
        return None
    differences = audit.get("differences") or {}
    if not differences:
        return None
    names = list(audit["readers"])
    lines = ["| config value | " + " | ".join(f"{cell(n)} reader" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    lines += [f"| `{cell(key)}` | " + " | ".join(cell(values.get(n)) for n in names) + " |"
              for key, values in differences.items()]
    return "Config readers disagree:\n\n" + "\n".join(lines)


def key_table(summary: Summary) -> str:
    rows = divergence_facts(summary)
    rows.append(("tolerance: fails when", tolerance_text(summary)))
    floor = noise_floor_text(summary)
    if floor:
        rows.append(("noise floor", floor))
    rows += [(f"{role} runtime", runtime_text(summary.get(role))) for role in ("reference", "candidate")
             if runtime_text(summary.get(role))]
    rows += outcome_facts(summary)
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
                     f"{fmt(p.get('rel_l2'))} | {status} |")
    return "<details><summary>coarse curve</summary>\n\n" + "\n".join(lines) + "\n\n</details>"


def triangulation_markdown(summary: Summary) -> str:
    """A triangulation's summary.md: each candidate against the reference, the odd one, an agreement matrix per
    point shown, the command; each candidate's own summary.md is in its folder (`candidate-N/`)."""
    marks, candidates = letters(summary), summary.get("candidates") or []
    verdict = str(summary.get("verdict") or "error").upper()
    parts = [f"### tracer: {verdict} — {text(triangulation_title(summary))}", text(triangulation_sentence(summary))]
    odd = odd_one_text(summary)
    if odd:
        parts.append(f"**{text(odd)}**")
    lines = ["| | side | | against the reference | own report |", "|---|---|---|---|---|"]
    for number, (letter, name, what) in enumerate(side_rows(summary)):  # 0: the reference
        against = "" if not number else candidate_text(candidates[number - 1])
        report = "" if not number else f"`{SUBDIR.format(number)}/summary.md`"
        lines.append(f"| {letter} | {inline_code(cell(name))} | {cell(what)} | {cell(against)} | {report} |")
    parts.append(f"Criterion: {text(tolerance_text(summary))}\n\n" + "\n".join(lines))
    for row in summary.get("agreement") or []:
        header, cells = agreement_matrix(row, marks)
        matrix = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        matrix += ["| " + " | ".join(cell(value) for value in values) + " |" for values in cells]
        missing = [f"- not recorded: {text(line)}" for line in not_recorded(row, marks)]
        title = text(row_title(row, marks).removeprefix(row["point"]))
        judged = text(floor_text(row, summary) + row_odd_text(row, marks))
        parts.append(f"Agreement at `{row['point']}`{title}; {judged}:\n\n"
                     + "\n".join([*matrix, *([""] if missing else []), *missing]))
    notes = [f"- {text(note)}" for note in summary.get("notes") or []]
    if notes:
        parts.append("\n".join(notes))
    if summary.get("command"):
        parts.append("Reproduce:\n\n" + fenced(str(summary["command"]), "sh"))
    env = summary.get("environment") or {}
    if env:
        parts.append(text(" · ".join(f"{k} {v}" for k, v in env.items())))
    return "\n\n".join(parts) + "\n"
