"""A sweep's rows as every view reads them: the terminal table, Markdown, the HTML page, the notebook,
the DataFrame and sweep.csv. Plain values only (no matplotlib, no pandas), so `tracer sweep` prints
its table without importing either."""

from __future__ import annotations

from tracer.reports.summary import DASH, fmt, greedy_cell, percent

# Why the greedy column is empty when it is: `tracer sweep` decodes nothing unless asked (each
# greedy token costs a forward per variant), while `tracer run` decodes 20 tokens by default.
GREEDY_OFF = "greedy decoding off: --greedy N decodes N tokens per variant and compares them with the reference's"


def sweep_rows(summary: dict) -> list[dict]:
    """The table's rows, as plain values (the DataFrame, CSV, HTML and Markdown all show these)."""
    rows = []
    for entry in summary.get("variants") or []:
        first, logits = entry.get("first_divergence") or {}, entry.get("logits") or {}
        greedy = entry.get("greedy") or {}
        rows.append({
            "variant": entry.get("variant"),
            "verdict": entry.get("verdict"),
            "first_divergence": first.get("point"),
            "step": entry.get("step"),  # with --decode: the decode step the first divergence is at
            "rel_l2_at_first": first.get("rel_l2"),
            "logits_max_abs": logits.get("max_abs"),
            "logits_max_abs_all": logits.get("max_abs_all"),
            "argmax_agree": logits.get("argmax_agree"),
            "greedy_same_prefix": greedy.get("same_prefix"),
            "greedy_steps": greedy.get("steps", summary.get("greedy_steps")),
            "error": entry.get("error"),
            "seconds": entry.get("seconds"),
        })
    return rows


def sweep_cells(row: dict) -> dict:
    """How one row of `sweep_rows` reads, in every view (the terminal, the HTML page, the notebook,
    Markdown); numbers by the one rule of `fmt`."""
    failed = row["verdict"] == "error"
    greedy = DASH if failed else "off" if not row["greedy_steps"] else greedy_cell(row["greedy_same_prefix"],
                                                                                     row["greedy_steps"])
    return {
        "variant": row["variant"], "verdict": row["verdict"] or "?", "error": row["error"] or "",
        "first": (f"decode step {row['step']}: " if row["step"] else "") + (row["first_divergence"] or DASH),
        "rel": fmt(row["rel_l2_at_first"]),
        "logits": fmt(row["logits_max_abs"]),
        "agree": percent(row["argmax_agree"]),
        "greedy": greedy,
        "css": {"diverged": "diverged", "error": "missing"}.get(row["verdict"], ""),
    }


def greedy_note(summary: dict) -> str | None:
    """The line that says why the greedy column reads "off", when it does."""
    return None if summary.get("greedy_steps") else GREEDY_OFF
