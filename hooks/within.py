"""Values a module computes inside its forward and returns to no one, observed as transformers computes
them: the module's forward runs under a `TorchFunctionMode` that sees each torch call's result.

- "linear": the first linear map the module computes (a router's logits: the same tensor it returns
  first, seen as it is made, so that the points are recorded in the order transformers computes them);
- "scores": the first softmax or sigmoid the module takes (a router's scores over every expert, which
  `MixtralTopKRouter` and its kin compute and do not return);
- "gated": the first product with a sigmoid's result (Qwen2-MoE's shared expert times
  sigmoid(shared_expert_gate(x)), added to the experts' sum without being returned).

Nothing is recomputed: the tensor recorded is the one transformers' own forward goes on with.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

_SCORES = frozenset({"softmax", "sigmoid"})
_PRODUCTS = frozenset({"mul", "__mul__", "__rmul__"})


class _Watcher:
    """One point observed inside one forward of the module: the first tensor that matches `what`."""

    def __init__(self, what: str, emit: Callable[[torch.Tensor], None]):
        if what not in ("linear", "scores", "gated"):
            raise ValueError(f"nothing to observe as {what!r} inside a module")
        self.what, self.emit = what, emit
        self.done, self.sigmoids = False, []

    def start(self) -> None:
        self.done, self.sigmoids = False, []

    def seen(self, name: str, args: tuple, out) -> None:
        if self.done or not isinstance(out, torch.Tensor):
            return
        if (self.what == "scores" and name in _SCORES) or (self.what == "linear" and name == "linear"):
            self._emit(out)
        elif self.what == "gated":
            if name == "sigmoid":
                self.sigmoids.append(out)
            elif name in _PRODUCTS and any(arg is gate for arg in args for gate in self.sigmoids):
                self._emit(out)

    def _emit(self, out: torch.Tensor) -> None:
        self.done = True
        self.emit(out if out.dim() == 3 else out[None])  # (T, X) -> (1, T, X), as the other hooks record


class _Watching(TorchFunctionMode):
    def __init__(self, watchers: list[_Watcher]):
        super().__init__()
        self.watchers = watchers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        for watcher in self.watchers:
            watcher.seen(name, args, out)
        return out


class _Handle:
    def __init__(self, module: torch.nn.Module, watcher: _Watcher):
        self.module, self.watcher = module, watcher

    def remove(self) -> None:
        watchers = self.module.__dict__.get("_tracer_watchers", [])
        if self.watcher in watchers:
            watchers.remove(self.watcher)
        if not watchers and "_tracer_watchers" in self.module.__dict__:  # the last one: the module's own forward back
            del self.module.__dict__["_tracer_watchers"]
            del self.module.__dict__["forward"]


def within(module: torch.nn.Module, what: str, emit: Callable[[torch.Tensor], None]) -> _Handle:
    """Watch `module`'s forward for `what` ("linear", "scores" or "gated"), handing each forward's match to `emit`;
    the handle's `remove()` restores the module's own forward once no watcher is left."""
    watcher = _Watcher(what, emit)
    if "_tracer_watchers" not in module.__dict__:
        original = module.forward  # the class's forward, bound
        watchers: list[_Watcher] = []

        def forward(*args, **kwargs):
            for each in watchers:
                each.start()
            with _Watching(list(watchers)):
                return original(*args, **kwargs)

        module.__dict__["_tracer_watchers"] = watchers
        module.__dict__["forward"] = forward
    module.__dict__["_tracer_watchers"].append(watcher)
    return _Handle(module, watcher)
