"""Writing a report folder atomically: everything into a temporary sibling, then one rename.

A reader (a CI artifact upload, a browser refresh) sees either the previous complete report or
the new complete one, never a mix; a failure while rendering leaves the old folder untouched
and no temporary folder behind. A folder that is not a tracer report is never replaced.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from tracer.core.errors import TracerError
from tracer.core.folders import replaceable_folder
from tracer.reports.drawers import report_images
from tracer.reports.html import render_html, render_triangulation_html
from tracer.reports.markdown import markdown_summary
from tracer.reports.summary import Summary, as_summary
from tracer.reports.table import write_points_csv
from tracer.reports.triangulation import SUBDIR, is_triangulation

# summary.json is always written: it is how a folder is recognised as a tracer report.
FORMATS = ("csv", "png", "html", "md")
MARKER = "summary.json"


def write_report(result, out_dir, *, formats=None) -> Path:
    """Write a report folder for a Result (or its summary dict) and return its path.

    Args:
        result: a `Result` or a `Triangulation` (anything with `.to_dict()`) or the summary dict itself; a
            triangulation's folder holds its own summary.json, report.html and summary.md, and each candidate's
            report in `candidate-N/`.
        out_dir: the folder to create. An existing tracer report there (it holds summary.json)
            is replaced as a whole; an existing folder with other content is refused.
        formats: which files to write besides summary.json, from "csv" (points.csv), "png"
            (curve.png, heatmap.png, and breakdown.png when the first divergence has per-position
            or per-head values), "html" (report.html), "md" (summary.md); None = all.
    Returns:
        `out_dir` as a Path.
    Raises:
        TracerError: `out_dir` exists and is not a tracer report folder, or an unknown format.
    Example:
        >>> trace = tracer.record(None, "The capital of France is", engine="reimpl", progress=False)
        >>> write_report(tracer.compare(trace, trace), "tracer-report")
        PosixPath('tracer-report')
    """
    summary = as_summary(result)
    chosen = check_formats(formats)
    if is_triangulation(summary):
        return write_folder(out_dir, MARKER, lambda folder: write_triangulation_files(summary, folder, chosen))
    return write_folder(out_dir, MARKER, lambda folder: write_files(summary, folder, chosen))


def write_folder(out_dir, marker: str, fill, what: str = "report") -> Path:
    """The one atomic folder writer: `fill(folder)` writes into a temporary sibling of `out_dir`,
    which then replaces it in one rename. An existing folder is replaced only if it holds
    `marker` (it is a previous tracer report of this kind) or is empty; anything else is refused.
    """
    out = Path(out_dir).absolute()  # "." or "report/" still have a parent and a name
    check_target(out, marker, what)
    out.parent.mkdir(parents=True, exist_ok=True)
    # mkdir (not mkdtemp) so the folder gets the usual umask permissions, not 0700
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        fill(tmp)
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(out_dir)


def check_formats(formats) -> tuple[str, ...]:
    if formats is None:
        return FORMATS
    chosen = tuple(formats)
    unknown = [f for f in chosen if f not in FORMATS and f != "json"]
    if unknown:
        raise TracerError(f"unknown report format {unknown[0]!r}; choose from json, {', '.join(FORMATS)}")
    return chosen


def check_target(out: Path, marker: str = MARKER, what: str = "report") -> None:
    """Refuse to replace anything but a previous report of this kind (or an empty folder)."""
    replaceable_folder(out, marker, what)


def write_files(summary: Summary, folder: Path, formats: tuple[str, ...]) -> None:
    text = json.dumps(summary, indent=2, ensure_ascii=False)
    (folder / MARKER).write_text(text + "\n", encoding="utf-8")
    if "csv" in formats:
        write_points_csv(summary, folder / "points.csv")
    images = {}
    if "png" in formats or "html" in formats:
        images = report_images(summary)
    if "png" in formats:
        for name, png in images.items():
            (folder / name).write_bytes(png)
    if "html" in formats:
        (folder / "report.html").write_text(render_html(summary, images), encoding="utf-8")
    if "md" in formats:
        (folder / "summary.md").write_text(markdown_summary(summary), encoding="utf-8")


def write_triangulation_files(summary: Summary, folder: Path, formats: tuple[str, ...]) -> None:
    """A triangulation's folder: its summary.json, report.html and summary.md, and each candidate's own report
    (against the reference, every file a run writes) in `candidate-N/`."""
    (folder / MARKER).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if "html" in formats:
        (folder / "report.html").write_text(render_triangulation_html(summary, links=True), encoding="utf-8")
    if "md" in formats:
        (folder / "summary.md").write_text(markdown_summary(summary), encoding="utf-8")
    for number, candidate in enumerate(summary.get("candidates") or [], 1):
        own = folder / SUBDIR.format(number)
        own.mkdir()
        write_files(candidate, own, formats)


def replace_folder(new: Path, out: Path) -> None:
    """Put `new` at `out`; a previous report is moved aside first and deleted only afterwards."""
    if not out.exists():
        new.rename(out)
        return
    old = out.with_name(f"{out.name}.old-{uuid.uuid4().hex[:8]}")
    out.rename(old)
    try:
        new.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)
