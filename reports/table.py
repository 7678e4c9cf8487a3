"""The per-point table: points.csv and display rows for the HTML page."""

from __future__ import annotations

import csv
import json
import math

from tracer.model.points import INPUT_NORM, split_point
from tracer.reports.summary import POINT_FIELDS, Summary, fmt, fmt_rel, missing_text, number, points


def points_rows(summary: Summary) -> tuple[list[str], list[list[str]]]:
    """Header and rows of points.csv: the summary's point fields in a fixed order (extra fields
    after); shapes as JSON text ("[5, 576]") so scripts can parse them back, nulls empty."""
    rows = points(summary)
    extra = [k for row in rows for k in row if k not in POINT_FIELDS]
    columns = list(POINT_FIELDS) + list(dict.fromkeys(extra))
    return columns, [[_cell(column, row.get(column)) for column in columns] for row in rows]


def _cell(column: str, value) -> str:
    if value is None:
        return ""
    if column == "shape":
        return json.dumps(list(value))
    return str(value)


def write_points_csv(summary: Summary, path) -> None:
    # csv, not pandas: the report should not pay pandas' import (0.4 s) for one table
    columns, rows = points_rows(summary)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)


def display_rows(summary: Summary) -> list[dict]:
    """Points as the HTML table shows them: formatted cells, a row class and sort keys."""
    first = (summary.get("first_divergence") or {}).get("point")
    return [display_row(i, p, first) for i, p in enumerate(points(summary))]


def display_row(index: int, p: dict, first: str | None) -> dict:
    recorded = p.get("recorded", True)
    if not recorded:
        status, css = missing_text(p), "missing"
    elif p.get("diverged"):
        status, css = "diverged", "diverged"
    else:
        status, css = "ok", ""
    is_first = p["point"] == first
    if is_first:
        status, css = "first divergence", css + " first"
    if split_point(p["point"])[1] == INPUT_NORM:
        css += " block"  # a rule above each block's first point
    shape = p.get("shape")
    return {
        "index": index,
        "point": p["point"],
        "layer": "" if p.get("layer") is None else p["layer"],
        "shape": "" if not shape else "×".join(str(d) for d in shape),
        "cells": [  # (text, sort key): sort keys are raw numbers, -1 sorts missing first
            (fmt(p.get("max_abs")), sort_key(p.get("max_abs"))),
            (fmt(p.get("max_ref")), sort_key(p.get("max_ref"))),
            (fmt_rel(p.get("rel_l2")), sort_key(p.get("rel_l2"))),
            (fmt(p.get("cosine"), ".6g"), sort_key(p.get("cosine"))),
        ],
        # the bound this point was judged against, when each point has its own (noise floor)
        "bound": (fmt_rel(p.get("threshold")), sort_key(p.get("threshold"))),
        "status": status,
        "css": css.strip(),
        "first": is_first,
    }


def sort_key(x) -> str:
    """The cell's value for the sort script (JavaScript parseFloat): missing and NaN sort first."""
    x = number(x)
    if x is None or math.isnan(x):
        return "-1"
    return repr(x) if math.isfinite(x) else "Infinity"
