"""The report's figures drawn by children that the `tracer` command forks as it starts.

Drawing is Python holding the GIL (matplotlib's import, text layout), about a second for a report.
The command forks its drawers before it loads torch, while it is one thread (a fork copies only
the calling thread: a lock another thread held would stay held in the child): each drawer imports
matplotlib on the second core while the command imports torch and loads the model, then waits for
the summary. `report_images` hands the summary to them; the curve and the breakdown are drawn by
one, the two-panel heatmap by the other, side by side, and the command itself never imports matplotlib. A drawer that
fails or takes longer than `SECONDS` is given up, and its figures are drawn in the process. Where
nothing started drawers (the Python API, Jupyter, one core, not Linux) the figures are drawn in
the process, one after another. A command that ends without a report kills its drawers.

No torch and no matplotlib here.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
from dataclasses import dataclass

from tracer.reports.summary import as_summary, figure_names

# A drawer draws its figures in well under a second; past this it is stuck.
SECONDS = 20
GROUPS = (("curve.png", "breakdown.png"), ("heatmap.png", "routing.png"))  # each drawer's figures (about equal time)


@dataclass
class Drawer:
    pid: int
    to_child: int  # the summary goes down this pipe
    from_child: int  # the PNGs come back up this one


_started: list[Drawer] = []


def start_drawers() -> None:
    """Fork the drawers (once per process; nothing where forking is not safe or not worth it)."""
    if _started or not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2 \
            or threading.active_count() > 1:
        return
    for names in GROUPS:
        summary_read, summary_write = os.pipe()
        images_read, images_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(summary_write)
            os.close(images_read)
            for drawer in _started:  # the earlier drawers' pipes are the parent's, not this child's
                os.close(drawer.to_child)
                os.close(drawer.from_child)
            _serve(names, summary_read, images_write)
        os.close(summary_read)
        os.close(images_write)
        _started.append(Drawer(pid, summary_write, images_read))


def _serve(names: tuple[str, ...], summary_read: int, images_write: int) -> None:
    """The drawer's life: import matplotlib now, draw what the summary needs, leave without
    running the parent's exit handlers. An empty summary (the command wrote no report) ends it."""
    code = 1
    try:
        from tracer.reports.figures import draw_images  # matplotlib: loaded by the drawer, beside the run

        with os.fdopen(summary_read, "rb") as pipe:
            text = pipe.read()
        with os.fdopen(images_write, "wb") as out:
            if text:
                for name, data in draw_images(json.loads(text), names).items():
                    out.write(b"%s %d\n" % (name.encode(), len(data)) + data)
        code = 0
    finally:
        os._exit(code)


def stop_drawers() -> None:
    """End the drawers no summary was handed to (the command failed before its report): killed now,
    not left importing matplotlib (about a core-second) for nothing after the command has returned."""
    drawers = list(_started)
    _started.clear()
    for drawer in drawers:
        for fd in (drawer.to_child, drawer.from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(drawer.pid, signal.SIGKILL)
            os.waitpid(drawer.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def report_images(summary) -> dict[str, bytes]:
    """Every figure of a report as PNG bytes by file name, in the report's order (a failed run's
    figures say why): what the drawers drew, and the rest drawn here."""
    summary = as_summary(summary)
    images = drawn_by_drawers(summary)
    missing = tuple(name for name in figure_names(summary) if name not in images)
    if missing:
        from tracer.reports.figures import draw_images  # matplotlib: loaded by the drawer, beside the run

        images |= draw_images(summary, missing)
    return {name: images[name] for name in figure_names(summary)}


def drawn_by_drawers(summary) -> dict[str, bytes]:
    """name -> PNG bytes of what the started drawers drew for `summary` ({} where none were
    started); the drawers are used once."""
    drawers = list(_started)
    _started.clear()
    text = json.dumps(summary, ensure_ascii=False).encode()
    for drawer in drawers:
        try:
            with os.fdopen(drawer.to_child, "wb") as pipe:
                pipe.write(text)
        except OSError:  # a drawer that died already: its figures are drawn in the process
            pass
    images: dict[str, bytes] = {}
    for drawer in drawers:
        images |= _collect(drawer)
    return images


def _collect(drawer: Drawer) -> dict[str, bytes]:
    """What one drawer sent back, or {} if it failed or took more than SECONDS."""
    chunks = []
    with os.fdopen(drawer.from_child, "rb") as pipe:
        while select.select([pipe], [], [], SECONDS)[0]:
            chunk = pipe.read1(1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(drawer.pid, signal.SIGKILL)
    _, status = os.waitpid(drawer.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return {}
    data, images = b"".join(chunks), {}
    while data:
        header, data = data.split(b"\n", 1)
        name, size = header.decode().rsplit(" ", 1)
        images[name], data = data[: int(size)], data[int(size):]
    return images
