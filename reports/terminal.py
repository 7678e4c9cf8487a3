"""What the `tracer` command prints: the run's short summary, and the layout every listing shares.

Every line fits the terminal, at most `MAX_WIDTH` columns (a terminal of 100 columns, a CI log, an
issue's code block): a long line wraps at words with a hanging indent, and a table wraps its
cells inside their columns. A word longer than the width (a path, a command to paste) is never
broken; a command too long for one line is split where a shell accepts it (`\\` and a newline).
Numbers follow the one rule of `tracer.reports.summary.fmt`, as in the Markdown and HTML reports.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

from tracer.reports.routing_map import routing_line
from tracer.reports.summary import (
    fmt,
    greedy_text,
    input_label,
    model_name,
    noise_floor_text,
    nonfinite_text,
    percent,
    regime_lines,
    runtime_text,
    side_label,
    steps_line,
    tolerance_text,
    worst_point,
)
from tracer.reports.sweep_rows import greedy_note, sweep_cells, sweep_rows
from tracer.reports.triangulation import (
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
)

MAX_WIDTH = 100  # never wider, even on a wider terminal: the output is pasted into issues and logs
MIN_WIDTH = 40


def terminal_width() -> int:
    """The width to lay out for: the terminal's (COLUMNS, else the tty's, else 100), at most 100."""
    return max(MIN_WIDTH, min(MAX_WIDTH, shutil.get_terminal_size((MAX_WIDTH, 24)).columns))


def wrap(line: str, width: int | None = None, hang: int = 4) -> list[str]:
    """One logical line as terminal lines: words wrapped, continuations indented `hang` columns
    past the line's own indent; words are never broken."""
    width = width or terminal_width()
    indent = " " * (len(line) - len(line.lstrip(" ")))
    return textwrap.wrap(line, width, subsequent_indent=indent + " " * hang, break_long_words=False,
                         break_on_hyphens=False) or [line]


def wrapped(lines: Sequence[str], width: int | None = None) -> str:
    width = width or terminal_width()
    return "\n".join(piece for line in lines for piece in (wrap(line, width) if line else [""]))


def command_lines(command: str, width: int | None = None, indent: str = "") -> list[str]:
    """A shell command to copy, within the width where its words allow: split between words with
    ` \\` at each line's end, which the shell reads as one command."""
    width, lines, current = width or terminal_width(), [], indent
    for word in command.split(" "):
        if current.strip() and len(current) + 1 + len(word) + 2 > width:
            lines.append(current + " \\")
            current = indent + "  " + word
        else:
            current = f"{current} {word}" if current.strip() else current + word
    return [*lines, current]


def table(header: Sequence[str], rows: Sequence[Sequence[str]], width: int | None = None,
          details: Sequence[str | None] | None = None) -> list[str]:
    """Rows of text cells as aligned columns within `width`: the widest columns give way first and
    their cells wrap inside them. `details[i]`, when given, is a wrapped line under row i, from
    the second column on (what a knob reproduces, why a variant failed)."""
    width = width or terminal_width()
    cells = [list(header), *[list(map(str, row)) for row in rows]]
    widths = column_widths(cells, width)
    wrapped_rows = [[textwrap.wrap(cell, w, break_long_words=False, break_on_hyphens=False) or [""]
                     for cell, w in zip(row, widths)] for row in cells]
    widths = [max(len(line) for row in wrapped_rows for line in row[i]) for i in range(len(widths))]  # as wrapped
    out = []
    for i, wrapped_cells in enumerate(wrapped_rows):
        for k in range(max(map(len, wrapped_cells))):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(wrapped_cells, widths)]
            out.append("  ".join(parts).rstrip())
        detail = details[i - 1] if details and i > 0 else None
        if detail:
            indent = " " * (widths[0] + 2)
            out += textwrap.wrap(detail, width, initial_indent=indent, subsequent_indent=indent,
                                 break_long_words=False, break_on_hyphens=False)
    return out


def column_widths(cells: list[list[str]], width: int) -> list[int]:
    """Each column's natural width, narrowed a column at a time until the row fits: the one keeping
    the largest share of its natural width gives way next, so every wide column wraps about as much
    (a column keeps room for its longest word: words are not broken)."""
    natural = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    floors = [max((len(word) for row in cells for word in row[i].split()), default=1) for i in range(len(natural))]
    floors[0] = natural[0]  # the first column names the row: never wrapped
    widths = list(natural)
    while sum(widths) + 2 * (len(widths) - 1) > width:
        shrinkable = [i for i, w in enumerate(widths) if w > floors[i]]
        if not shrinkable:
            break
        widths[max(shrinkable, key=lambda i: widths[i] / natural[i])] -= 1
    return widths


def terminal_summary(result, out_dir=None) -> str:
    """The lines `tracer run` and `tracer compare` print; `result` is a Result, a Triangulation or its dict."""
    s = result.to_dict() if hasattr(result, "to_dict") else result
    return wrapped(triangulation_lines(s, out_dir) if is_triangulation(s) else summary_lines(s, out_dir))


def triangulation_lines(s: dict, out_dir=None) -> list[str]:
    """A triangulation: the sides by letter, each candidate against the reference, the odd one, and an
    agreement matrix per point shown (`tracer.reports.triangulation`)."""
    marks, candidates = letters(s), s.get("candidates") or []
    on = f" on {s['model']}" if s.get("model") else ""
    lines = [f"tracer: {s['reference']['label']} vs {len(candidates)} candidates{on}"]
    lines += [f"  {letter}  {name} ({what})" for letter, name, what in side_rows(s)]
    lines.append(f"  {input_label(s)}")
    floors = [one["floor"] for one in candidates if one.get("floor")]
    if floors:  # one reference floor; the last candidate's summary holds every confirmation made for any
        lines.append(f"  noise floor: {floors[-1]['text']}")
    lines.append(f"verdict: {s['verdict'].upper()}  ({len(candidates)} candidates, each against the reference; "
                 f"criterion {tolerance_text(s)})")
    lines += [f"  {marks[name]}: {candidate_text(one)}" for name, one in zip(s["sides"][1:], candidates)]
    odd = odd_one_text(s)
    if odd:
        lines.append(f"  {odd}")
    for row in s.get("agreement") or []:
        lines += ["", f"agreement at {row_title(row, marks)}; {floor_text(row, s)}{row_odd_text(row, marks)}:"]
        header, cells = agreement_matrix(row, marks)
        lines += [f"  {line}" for line in table(header, cells, width=terminal_width() - 2)]
        lines += [f"  not recorded: {text}" for text in not_recorded(row, marks)]
    if s.get("notes"):
        lines.append("")
    lines += [f"note: {note}" for note in s.get("notes") or []]
    if out_dir is not None:
        lines.append(f"report: {out_dir}/report.html")
    return lines


def summary_lines(s: dict, out_dir=None) -> list[str]:
    on = f" on {s['model']}" if s.get("model") else ""  # two foreign dumps may name no model
    lines = [f"tracer: {s['reference']['label']} vs {s['candidate']['label']}{on}"]
    lines += [f"  {role} runtime: {runtime_text(s[role])}" for role in ("reference", "candidate")
              if runtime_text(s.get(role))]
    if s.get("prompt") is not None or s.get("tokens"):
        fed = input_label(s, limit=80)
        lines.append(f"  prompt {fed}" if fed.startswith("'") else f"  {fed}")
    if s["verdict"] == "error":
        return lines + [f"verdict: ERROR  {s['error']}"]
    recorded = [p for p in s["points"] if p["recorded"]]
    lines.append(f"verdict: {s['verdict'].upper()}  ({len(recorded)} points compared, "
                 f"criterion {tolerance_text(s)})")
    floor = noise_floor_text(s)
    if floor:
        lines.append(f"  noise floor: {floor}")
    decoded = steps_line(s)
    if decoded:
        lines.append(f"  {decoded}")
    first = s["first_divergence"]
    if first:
        lines += divergence_lines(first)
    else:
        worst = worst_point(s)  # the report's choice too: a NaN ranks above every finite error
        if worst and worst["rel_l2"] == 0:
            lines.append("  every recorded point is bitwise identical")
        elif worst:
            lines.append(f"  largest error: {worst['point']} rel_l2 {fmt(worst['rel_l2'])}")
    routing = routing_line(s)
    if routing:
        lines.append(f"  {routing}")
    lines += [f"  {line}" for line in regime_lines(s)]
    if s.get("first_nonfinite"):
        lines.append(f"  {nonfinite_text(s['first_nonfinite'])}")
    logits = s.get("logits")
    if logits:
        lines.append(f"  logits, last position: max|diff| {fmt(logits['max_abs'])} "
                     f"(max|ref| {fmt(logits['max_ref'])}); all positions {fmt(logits['max_abs_all'])}; "
                     f"argmax agrees at {percent(logits['argmax_agree'])} of positions")
    greedy = s.get("greedy")
    if greedy:
        lines.append(f"  greedy: {greedy_text(greedy)}")
    for note in s.get("notes", []):
        lines.append(f"  note: {note}")
    if out_dir is not None:
        lines.append(f"report: {out_dir}/report.html")
    return lines


def divergence_lines(first: dict) -> list[str]:
    lines = []
    if first["last_agreeing"]:
        lines.append(f"  agrees up to {first['last_agreeing']} "
                     f"(max rel_l2 {fmt(first['upstream_max_rel_l2'])} over {first['upstream_points']} points)")
    lines.append(f"  first divergence: {first['point']}  max|diff| {fmt(first['max_abs'])}  "
                 f"max|ref| {fmt(first['max_ref'])}  rel_l2 {fmt(first['rel_l2'])}")
    if first.get("local_rel_l2") is not None:
        lines.append(f"    introduced here: local rel_l2 {fmt(first['local_rel_l2'])} (its block rerun on the "
                     f"reference's inputs); inherited {fmt(first.get('upstream_max_rel_l2'))}")
    lines += [f"  hint: {hint}" for hint in first.get("hints") or []]
    return lines


def sweep_summary(sweep, out_dir=None) -> str:
    """The lines `tracer sweep` prints: one row per variant, aligned, and why greedy is off when it is."""
    s = sweep.to_dict() if hasattr(sweep, "to_dict") else sweep
    cells = [sweep_cells(row) for row in sweep_rows(s)]
    variants = f"{len(cells)} variant" + ("" if len(cells) == 1 else "s")
    lines = [f"tracer sweep: {variants} of {(s.get('candidate') or {}).get('engine', '?')} against "
             f"{side_label(s.get('reference'))} on {model_name(s)}",
             f"  {input_label(s)}; criterion {tolerance_text(s)}"]
    lines += table(("variant", "verdict", "first divergence", "rel_l2", "logits max|diff|", "greedy"),
                   [(c["variant"], c["verdict"], c["first"], c["rel"], c["logits"], c["greedy"]) for c in cells],
                   details=[c["error"] or None for c in cells])
    note = greedy_note(s)
    if note:
        lines.append(note)
    seconds = sum((s.get("timings") or {}).values())
    lines.append(f"{variants} in {seconds:.1f} s" + ("" if out_dir is None else
                                                                  f"; report: {out_dir}/sweep.html"))
    return wrapped(lines)
