"""Values a module computes inside its forward and returns to no one, observed as transformers computes
them: the module's forward runs under a `TorchFunctionMode` that sees each torch call's result.

- "linear": the first linear map the module computes (a router's logits: the same tensor it returns
  first, seen as it is made, so that the points are recorded in the order transformers computes them);
- "scores": the first softmax or sigmoid the module takes (a router's scores over every expert, which
  `MixtralTopKRouter` and its kin compute and do not return);
- "gated": the first product with a sigmoid's result (Qwen2-MoE's shared expert times
  sigmoid(shared_expert_gate(x)), added to the experts' sum without being returned);
- "selection": the first sum with the scores (DeepSeek-V3's sigmoid scores plus its selection bias, what
  its top-k picks from);
- "splitN.I": part I of the N-th `torch.split` (from 1) of the forward (MLA's k_pe, split off its latent kv,
  and k_nope, split off kv_b_proj's output, both inside `DeepseekV3Attention`'s forward).

Nothing is recomputed: the tensor recorded is the one transformers' own forward goes on with.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

_SCORES = frozenset({"softmax", "sigmoid"})
_PRODUCTS = frozenset({"mul", "__mul__", "__rmul__"})
_SUMS = frozenset({"add", "__add__", "__radd__"})
_SPLIT = re.compile(r"^split(\d+)\.(\d+)$")


class _Watcher:
    """One point observed inside one forward of the module: the first tensor that matches `what`."""

    def __init__(self, what: str, emit: Callable[[torch.Tensor], None]):
        split = _SPLIT.match(what)
        if what not in ("linear", "scores", "gated", "selection") and split is None:
            raise ValueError(f"nothing to observe as {what!r} inside a module")
        self.what, self.emit = what, emit
        self.split = None if split is None else (int(split.group(1)), int(split.group(2)))
        self.start()

    def start(self) -> None:
        self.done, self.sigmoids, self.splits = False, [], 0

    def seen(self, name: str, args: tuple, out) -> None:
        if self.done:
            return
        if self.split is not None:
            if name == "split":
                self.splits += 1
                if self.splits == self.split[0]:
                    self._emit(out[self.split[1]])
            return
        if not isinstance(out, torch.Tensor):
            return
        if (self.what == "scores" and name in _SCORES) or (self.what == "linear" and name == "linear"):
            self._emit(out)
        elif self.what in ("gated", "selection"):
            operations = _PRODUCTS if self.what == "gated" else _SUMS
            if name in (("sigmoid",) if self.what == "gated" else _SCORES):
                self.sigmoids.append(out)
            elif name in operations and any(arg is gate for arg in args for gate in self.sigmoids):
                self._emit(out)

    def _emit(self, out: torch.Tensor) -> None:
        self.done = True
        self.emit(out[None] if out.dim() == 2 else out)  # (T, X) -> (1, T, X), as the other hooks record


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
    """Watch `module`'s forward for `what` ("linear", "scores", "gated", "selection" or "splitN.I"), handing each
    forward's match to `emit`;
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
