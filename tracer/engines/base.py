"""What every engine is and shares: the `Engine` protocol, `EngineBase` (what every engine class
inherits), trace metadata.

An engine is built by its module's `load(source, variant, *, argument, device, stream)` (see
`tracer.engines.load`; `source` is a `tracer.files.sources.ModelSource`) and answers to the protocol
below. What it *can* do is declared once in its registry entry (`tracer.engines.registry.EngineEntry`),
which it carries as `entry`; the pipeline reads capabilities there, never by probing attributes.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Callable, Collection, Protocol

from tracer.core.errors import TracerError
from tracer.core.lazy import torch  # the isolated engines' handle imports this module; its child starts torch-free
from tracer.core.progress import detail
from tracer.core.versions import installed_version
from tracer.engines.registry import EngineEntry
from tracer.model.points import LOGITS, layer_point

if TYPE_CHECKING:
    from tracer.traces.trace import Trace, TraceMeta

DEVICES = ("cpu", "cuda", "mps")


class Engine(Protocol):
    """What the pipeline asks of an engine.

    `draft` exists where `entry.draft`, `local_trace` and `routed_trace` where `entry.local_errors` (and
    `local_step_trace` where it also has `entry.decode`), `op_trace` on
    the reimplementation (the engine a number-format regime runs on); `logits` returns None where
    `entry.logits` is False. A `recorder` is any `record(name, tensor)` callable with `tensors`:
    in memory (`TraceRecorder`), spilled (`tracer.traces.spill.DiskRecorder`) or compared as it comes
    (`tracer.comparison.diff.ErrorRecorder`).
    """

    entry: EngineEntry
    name: str  # the registry name ("hf", "reimpl", "file", ...)
    variant: dict  # the knobs it runs with
    device: torch.device | str
    vocab_size: int | None  # None: unknown (a saved trace)
    max_positions: int | None

    def record(self, tokens: list[int], recorder=None, *, positions: torch.Tensor | None = None) -> Trace:
        """Every point it can observe on one forward over `tokens`; `recorder` (a
        `TraceRecorder` by default) may spill points to disk instead of memory; `positions`: the
        tokens' absolute positions (T,), where `entry.positions` (default 0..T-1)."""

    def logits(self, tokens: list[int], *, positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """(T, V) logits of an unrecorded forward, for greedy decoding."""

    def draft(self, tokens: list[int], steps: int) -> list[int]:
        """A cheap guess at `steps` greedy tokens (a cached decode), checked by the caller."""

    def decode(self, tokens: list[int], count: int, *, forced: list[int] | None = None, offset: int = 0,
               recorded: Collection[int] | None = None) -> Trace:
        """Where `entry.decode`: the prompt's prefill, then `count` steps of one token each, all with
        its own KV cache; `Trace.steps` holds the steps (`decode_steps`). `recorded`: the steps whose
        points are recorded (0: the prefill; None: all), where `entry.greedy == "decode"`."""

    def local_trace(self, reference: Trace, recorder=None) -> Trace:
        """Its points with every block fed the reference's input to that block."""

    def op_trace(self, reference: Trace, recorder=None) -> Trace:
        """Its points with every op fed the reference's values of its inputs."""

    def routed_trace(self, reference: Trace, recorder=None) -> tuple[Trace, list[int]]:
        """Where `entry.local_errors`: `local_trace` with a mixture of experts' experts on the reference's
        routing (its picked experts and their weights), and the layers whose routing was so given."""

    def local_step_trace(self, step: Trace, before: Trace | None, prefilled: int, recorder=None) -> Trace:
        """Where `entry.local_errors` and `entry.decode`: a decode step's points with every block fed the
        reference's input to it and the reference's cache before the step (`before`: the reference's
        trace of the step before, None for the prefill; `prefilled`: the prompt's length)."""


class EngineBase:
    """What every engine class shares. A subclass names its registry entry (`entry = ENGINES[...]`; an
    instance may carry its own) and states only what differs: `record`, its model's sizes where it
    knows them (`vocab_size`, `max_positions`, set when it loads), its `device` where not the CPU,
    `logits` where its entry says it can, and the methods its entry declares (`draft`, `local_trace`,
    `routed_trace`)."""

    entry: EngineEntry
    variant: dict  # the knobs it runs with
    label: str = ""  # the model it runs, as its traces name it (a directory, a GGUF file)
    device: torch.device | str = "cpu"
    vocab_size: int | None = None  # None: unknown
    max_positions: int | None = None

    @property
    def name(self) -> str:
        """The registry name ("hf", "reimpl", ...)."""
        return self.entry.name

    def logits(self, tokens: list[int], *, positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """None: no unrecorded forward (`entry.logits` is False)."""
        return None

    def first_position(self, tokens: list[int], positions: torch.Tensor | None) -> int | None:
        """The first of `positions` (None for 0..T-1), what its trace's `position_offset` says; an
        engine whose entry takes no positions refuses any in one line."""
        if positions is not None and not self.entry.positions:
            raise TracerError(f"the {self.name} engine runs its tokens from position 0; it takes no positions")
        return position_offset(positions, len(tokens))

    def meta(self, tokens: list[int], dtype: torch.dtype | str, not_recorded: dict, **facts) -> TraceMeta:
        """Its trace's metadata (`trace_meta`) for a forward over `tokens`."""
        return trace_meta(self, self.label, tokens, dtype, not_recorded, **facts)


def environment() -> dict:
    return dict(_environment())


@functools.cache
def _environment() -> dict:
    """Read once per process: every trace's metadata carries it, a decode's every step too, and reading
    the installed packages' metadata takes tens of milliseconds."""
    return {"python": platform.python_version(), "platform": platform.platform(),
            **{package: installed_version(package) for package in ("torch", "transformers", "safetensors")}}


def trace_meta(engine, model: str, tokens: list[int], dtype: torch.dtype | str, not_recorded: dict,
               **facts) -> TraceMeta:
    """The metadata every engine writes into its traces, plus its own `facts` (`TraceMeta`'s fields:
    `num_layers`, `family`, `runtime` for a non-PyTorch runtime, ...)."""
    from tracer.traces.trace import TraceMeta  # torch: the child process starts without it

    return TraceMeta(engine=engine.name, variant=dict(engine.variant), model=model, tokens=list(tokens),
                     dtype=str(dtype).removeprefix("torch."), device=str(engine.device), versions=environment(),
                     not_recorded=not_recorded, **facts)


# What a decode does with each step's trace once recorded (`steps_kept_by`); None: kept in memory.
_STEP_KEEPER: ContextVar[Callable[[Trace], Trace] | None] = ContextVar("step_keeper", default=None)


@contextmanager
def steps_kept_by(keep: Callable[[Trace], Trace]):
    """Within the block, every in-process engine's decode hands each step's trace to `keep` as soon as it
    is recorded and holds what it returns (a long decode's steps written to disk and read back point by
    point: `tracer.pipeline.decode`), so that a decode's memory does not grow with its steps."""
    token = _STEP_KEEPER.set(keep)
    try:
        yield
    finally:
        _STEP_KEEPER.reset(token)


def decode_steps(forward: Callable[..., tuple[Trace, torch.Tensor]], tokens: list[int], count: int,
                 forced: list[int] | None = None, offset: int = 0, recorded: Collection[int] | None = None) -> Trace:
    """The prefill and `count` decode steps, as every engine with a KV cache decodes: `forward(ids, start)`
    runs `ids` (the prompt, then one token) after what its cache holds and returns their trace and
    logits (T, V); the cache lives in `forward`. Each step's token is `forced` (teacher-forced on the
    reference's tokens, so both sides see the same inputs) or, without it, the previous step's greedy
    pick. Each step's trace says its token and its position in the sequence (`position_offset`), which
    is what the step is compared at whatever position the engine gave it, and where its cache started
    (`cache_start`: `offset`).

    `recorded`: the steps to record (0: the prefill; None: every one). The others run through the cache
    unrecorded, `forward(ids, start, record=False)`, as fast as generating: their traces hold only their
    last logits row (`LOGITS`, (1, V): the step's greedy pick), which is how the greedy check follows a
    continuation and records only the step where it parts."""
    if forced is not None and len(forced) < count:
        raise TracerError(f"{count} decode steps need {count} forced tokens, got {len(forced)}")

    def step(number: int, ids: list[int], start: int) -> tuple[Trace, torch.Tensor]:
        if recorded is None or number in recorded:
            trace, logits = forward(ids, start)
        else:
            trace, logits = forward(ids, start, record=False)
            trace.tensors = {LOGITS: logits[-1:]}  # (1, V)
        # where its cache starts: how many tokens it holds, which a ring's slots depend on (`SlotLayout`)
        trace.meta = dataclasses.replace(trace.meta, cache_start=offset or None)
        return trace, logits

    keep = _STEP_KEEPER.get() or (lambda kept: kept)
    trace, logits = step(0, list(tokens), offset)
    trace = keep(trace)
    position, steps = offset + len(tokens), []
    for index in range(count):
        token = forced[index] if forced is not None else int(logits[-1].argmax())
        trace_of_step, logits = step(index + 1, [token], position)
        steps.append(keep(trace_of_step))
        position += 1
        detail(f"decode step {index + 1}/{count}")
    trace.steps = steps
    return trace


def at_positions(offset: int, count: int) -> dict:
    """The keyword an engine call takes for tokens starting at absolute position `offset`: none at 0
    (every engine starts there), else `positions` (T,) for the engines that take them."""
    return {} if not offset else {"positions": torch.arange(offset, offset + count)}


def position_offset(positions: torch.Tensor | None, count: int) -> int | None:
    """The first position of contiguous `positions` (what a trace's `position_offset` says; None for
    0..T-1). Positions that skip or repeat are refused: a trace says an offset, not a list."""
    if positions is None:
        return None
    positions = torch.as_tensor(positions)
    start = int(positions[0]) if positions.numel() else 0
    if positions.shape != (count,) or not torch.equal(positions.cpu(), torch.arange(start, start + count)):
        raise TracerError(f"positions must be {count} consecutive absolute positions, one per token")
    if start < 0:
        raise TracerError(f"positions start at {start}; the first position is 0 or more")
    return start or None


def per_layer(num_layers: int, reasons: dict[str, str]) -> dict[str, str]:
    """Expand {"self_attn.scores": reason} to every layer's point, in execution order."""
    return {layer_point(i, sub): reason for i in range(num_layers) for sub, reason in reasons.items()}
