"""One progress bar over the long steps of an API call: a widget in Jupyter, a line on stderr.

`tqdm.auto` picks the notebook widget inside a Jupyter kernel (with ipywidgets installed; tqdm
falls back to the text bar, with a warning, without it) and the text bar on stderr elsewhere.
The bar is `leave=False`: it disappears when the call returns, so what stays on screen is the
result. The text bar shows only when stderr is a terminal (a log or a pipe gets no carriage-return
noise); `progress=False` (what `tracer run --json -` passes) shows nothing anywhere.

    with progress_stages(("load", "reference", "candidate"), request.progress):
        ...                 # the bar starts at "load"
        stage("reference")  # the next long step
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

_ACTIVE: contextvars.ContextVar[Stages | None] = contextvars.ContextVar("tracer_progress", default=None)


class Stages:
    """A bar with one tick per named stage; the description names the stage running now."""

    def __init__(self, names: tuple[str, ...], enabled: bool):
        from tqdm.auto import tqdm  # it probes for Jupyter: paid when a bar starts, not by `import tracer`

        self.names = names
        # None: the text bar only on a terminal (not in logs, pipes or a CLI error's one line);
        # the notebook bar takes None as "show"
        self.bar = tqdm(total=len(names), disable=None if enabled else True, leave=False, desc=f"tracer: {names[0]}",
                        bar_format="{desc} {bar:12} {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def stage(self, name: str) -> None:
        done = self.names.index(name) if name in self.names else self.bar.n
        self.bar.set_postfix_str("", refresh=False)
        self.bar.set_description_str(f"tracer: {name}", refresh=False)
        self.bar.update(max(0, done - self.bar.n))
        self.bar.refresh()

    def detail(self, text: str) -> None:
        self.bar.set_postfix_str(text)

    def close(self) -> None:
        self.bar.close()


@contextmanager
def progress_stages(names: tuple[str, ...], enabled: bool):
    """One bar over the block, closed however it ends; inside another one, no second bar."""
    if _ACTIVE.get() is not None:
        yield
        return
    stages = Stages(names, enabled)
    token = _ACTIVE.set(stages)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        stages.close()


def stage(name: str) -> None:
    """Mark the start of the next long step (no-op outside `progress_stages`)."""
    stages = _ACTIVE.get()
    if stages is not None:
        stages.stage(name)


def detail(text: str) -> None:
    """Progress inside the current step ("token 7/20"); no-op outside `progress_stages`."""
    stages = _ACTIVE.get()
    if stages is not None:
        stages.detail(text)
