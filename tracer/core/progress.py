"""One progress bar over the long steps of an API call: a widget in Jupyter, a line on stderr.

`tqdm.auto` picks the notebook widget inside a Jupyter kernel (with ipywidgets installed; tqdm
falls back to the text bar, with a warning, without it) and the text bar on stderr elsewhere.
The bar is `leave=False`: it disappears when the call returns, so what stays on screen is the
result. The text bar shows only when stderr is a terminal (a log or a pipe gets no carriage-return
noise); `progress=False` (what `tracer run --json -` passes) shows nothing anywhere.

    @with_stages("load", "reference", "candidate")
    def run(..., progress=True):
        ...                 # the bar starts at "load"
        stage("reference")  # the next long step
"""

from __future__ import annotations

import contextvars
import functools
import inspect

_ACTIVE: contextvars.ContextVar[Stages | None] = contextvars.ContextVar("tracer_progress", default=None)


class Stages:
    """A bar with one tick per named stage; the description names the stage running now."""

    def __init__(self, names: tuple[str, ...], enabled: bool):
        from tqdm.auto import tqdm

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


def with_stages(*names: str):
    """Decorate an API function taking `progress=`: one bar for the call, closed however it ends.

    A decorated function called from inside another one adds no second bar.
    """

    def decorate(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if _ACTIVE.get() is not None:
                return function(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs)
            enabled = bool(bound.arguments.get("progress", signature.parameters["progress"].default))
            stages = Stages(names, enabled)
            token = _ACTIVE.set(stages)
            try:
                return function(*args, **kwargs)
            finally:
                _ACTIVE.reset(token)
                stages.close()

        return wrapper

    return decorate


def stage(name: str) -> None:
    """Mark the start of the next long step (no-op outside a decorated call)."""
    stages = _ACTIVE.get()
    if stages is not None:
        stages.stage(name)


def detail(text: str) -> None:
    """Progress inside the current step ("token 7/20"); no-op outside a decorated call."""
    stages = _ACTIVE.get()
    if stages is not None:
        stages.detail(text)
