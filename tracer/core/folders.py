"""Which existing folder tracer may replace with its output: one rule for the report writer and for
the request's check before a run (no torch, nothing written)."""

from __future__ import annotations

from pathlib import Path

from tracer.core.errors import TracerError


def replaceable_folder(out: Path, marker: str, what: str = "report") -> None:
    """A report folder replaces only a previous one of its kind (it holds `marker`) or an empty folder."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink() and ((out / marker).is_file() or not any(out.iterdir())):
        return
    raise TracerError(f"refusing to overwrite {out}: it is not a tracer {what} folder")
