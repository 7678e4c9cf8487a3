"""The renderers a value looks up by name: `Result.plot`, `Result._repr_html_`, `Trace._repr_html_`,
`Sweep.table`, ... call `render(name, value)`, and the reports package (`tracer.reports`, a layer
above this one) registers what renders each name when it is imported. A value never imports its
renderer; `import tracer` imports the reports package, so the table is full before any value exists.
"""

from __future__ import annotations

from collections.abc import Callable

from tracer.core.errors import TracerError

RENDERERS: dict[str, Callable] = {}


def register_renderers(renderers: dict[str, Callable]) -> None:
    """name -> callable(value, *args, **kwargs); a later registration replaces an earlier one."""
    RENDERERS.update(renderers)


def render(name: str, value, *args, **kwargs):
    """`value` rendered by the renderer registered as `name` (a figure, an HTML fragment, a frame)."""
    renderer = RENDERERS.get(name)
    if renderer is None:
        raise TracerError(f"no renderer {name!r} is registered: import tracer.reports")
    return renderer(value, *args, **kwargs)
