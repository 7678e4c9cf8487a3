"""The per-point table: points.csv (every point, every field, full precision) and the rows the HTML
page shows, whole (behind a disclosure) and collapsed to the points that matter."""

from __future__ import annotations

import csv
import json
import math

from tracer.model.points import INPUT_NORM, is_coarse, split_point
from tracer.reports.summary import POINT_FIELDS, Summary, fmt, missing_text, number, points

AROUND_FIRST = (2, 3)  # points shown before and after the first divergence


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


def has_local(summary: Summary) -> bool:
    """Whether the run measured each point's local error (its block rerun on the reference's inputs)."""
    return any(p.get("local_rel_l2") is not None for p in points(summary))


def display_row(index: int, p: dict, first: str | None) -> dict:
    recorded = p.get("recorded", True)
    if not recorded:
        status, css = missing_text(p), "missing"
    elif p.get("diverged"):
        status, css = "diverged", "diverged"
    else:
        status, css = "ok", "ok"
    if recorded and non_finite(p):
        status, css = f"{status}, NaN/Inf", css + " nonfinite"
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
            (fmt(p.get("rel_l2")), sort_key(p.get("rel_l2"))),
        ],
        # the error this point introduces: its block rerun on the reference's inputs
        "local": (fmt(p.get("local_rel_l2")), sort_key(p.get("local_rel_l2"))),
        # the bound this point was judged against, when each point has its own (noise floor)
        "bound": (fmt(p.get("threshold")), sort_key(p.get("threshold"))),
        "status": status,
        "css": css.strip(),
        "first": is_first,
    }


def non_finite(p: dict) -> bool:
    return any(number(p.get(key)) is not None and not math.isfinite(number(p.get(key)))
               for key in ("max_abs", "max_ref", "rel_l2"))


def key_rows(summary: Summary) -> list[dict]:
    """The rows worth reading, in execution order, each saying why it is shown: the points around the
    first divergence, the worst point of each layer (largest rel_l2), every NaN/Inf, and the points
    outside the blocks (embeddings, final norm, logits). The page shows these; the rest is one click away."""
    rows = display_rows(summary)
    reasons: dict[int, list[str]] = {}
    first = next((i for i, r in enumerate(rows) if r["first"]), None)
    if first is not None:
        before, after = AROUND_FIRST
        for i in range(max(0, first - before), min(len(rows), first + after + 1)):
            reasons.setdefault(i, []).append("first divergence" if i == first else
                                              "upstream of it" if i < first else "downstream of it")
    worst: dict[int, tuple[float, int]] = {}
    for i, p in enumerate(points(summary)):
        value = number(p.get("rel_l2"))
        if value is None:
            continue
        rank = math.inf if math.isnan(value) else value
        if p.get("layer") is not None and (p["layer"] not in worst or rank > worst[p["layer"]][0]):
            worst[p["layer"]] = (rank, i)
        if non_finite(p):
            reasons.setdefault(i, []).append("NaN/Inf")
        elif p.get("layer") is None and is_coarse(p["point"]):
            reasons.setdefault(i, []).append("outside the blocks")
    for layer, (rank, i) in worst.items():
        if rank > 0:  # an exactly equal layer has no worst point
            reasons.setdefault(i, []).append(f"worst of layer {layer}")
    return [dict(rows[i], why=", ".join(reasons[i])) for i in sorted(reasons)]


def sort_key(x) -> str:
    """The cell's value for the sort script (JavaScript parseFloat): missing and NaN sort first."""
    x = number(x)
    if x is None or math.isnan(x):
        return "-1"
    return repr(x) if math.isfinite(x) else "Infinity"
