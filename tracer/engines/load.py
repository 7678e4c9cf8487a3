"""Where a run's engines load, resolved once, and the engines built there.

`resolve_target` turns what a user gives (a model argument, a device name, accelerate's placement) into a
`LoadTarget`, after every check a user can fail about it: the device this torch can run and every engine
takes, offloading some engine can take, the model source, and a family every engine traces. The pipeline
calls it once per command; `load_engine` then builds any number of engines on that target and checks
nothing again. `resolve_and_load` is both in one call, for one engine outside a command (tests, benches).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from tracer.core.errors import TracerError
from tracer.engines import isolated
from tracer.engines.base import DEVICES, Engine
from tracer.engines.offload import Offload, check_offload
from tracer.engines.registry import EngineRef, engine_with_knobs
from tracer.files.sources import ModelSource, resolve_source
from tracer.model.families import model_types


@dataclass(frozen=True)
class LoadTarget:
    """What a run's engines load and where, resolved and checked once (`resolve_target`): the model
    source, the torch device, whether weights stream block by block (on the engines that can), and
    accelerate's placement (on the engines that can take it)."""

    source: ModelSource
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stream: bool = False
    offload: Offload | None = None


def resolve_target(model, engines: tuple[EngineRef, ...], *, device: str | torch.device = "cpu",
                   stream: bool = False, offload: Offload | None = None, progress: bool = True) -> LoadTarget:
    """The `LoadTarget` of `engines` (already parsed, their runtimes and knobs checked): the device checked
    against this torch and each engine, `offload` against the engines, `model` resolved into a `ModelSource`
    (`tracer.files.sources.resolve_source`; a GGUF converted once, with a progress bar when `progress`), and
    its family against each engine. Every refusal is one line, before any engine loads."""
    parsed = check_device(device)
    for engine in engines:
        if parsed.type not in engine.entry.devices:
            raise TracerError(f"the {engine.name} engine runs on {', '.join(engine.entry.devices)}, not {device}")
    check_offload(offload, *engines)
    source = resolve_source(model, progress)
    check_family_support(engines, source)
    return LoadTarget(source, parsed, stream, offload)


def load_engine(engine: EngineRef, variant: dict, target: LoadTarget) -> Engine:
    """`engine` with its `variant` (both checked already: a `tracer.pipeline.request.Side`'s, or knobs
    tracer runs its own model with) built on `target`, ready to record.

    `target.stream` is passed on to engines that can read weights block by block and dropped for the
    others (the caller says so in its notes; `tracer.record` refuses it instead); `target.offload` goes
    to the engines that can take it (`resolve_target` refused it where none of a run's can)."""
    entry, argument = engine.entry, engine.argument
    stream = target.stream and entry.stream
    if entry.isolated:  # native code that may abort: in a child process (tracer.engines.isolated)
        return isolated.load(entry, target.source, variant, argument=argument, device=target.device, stream=stream)
    module = importlib.import_module(entry.module)
    if target.offload is not None and entry.offload:
        return module.load(target.source, variant, argument=argument, device=target.device, stream=stream,
                           offload=target.offload)
    return module.load(target.source, variant, argument=argument, device=target.device, stream=stream)


def resolve_and_load(engine: str | EngineRef, model, variant: dict | None = None, *,
                     device: str | torch.device = "cpu", stream: bool = False, offload: Offload | None = None,
                     progress: bool = True) -> Engine:
    """One engine from the arguments a user writes: `engine` as `--candidate` takes it ("hf",
    "llamacpp:F16.gguf"; its runtime and knobs checked), `model` as `tracer.run` takes it (a path, a .gguf
    file, None, a loaded model, a `ModelSource`), resolved (`resolve_target`), then loaded (`load_engine`)."""
    engine, variant = engine_with_knobs(engine, variant)
    target = resolve_target(model, (engine,), device=device, stream=stream, offload=offload, progress=progress)
    return load_engine(engine, variant, target)


def check_device(device: str | torch.device) -> torch.device:
    """A device this torch can run the model on; anything else is the user's error, in one line."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in DEVICES:
        raise TracerError(f"unknown device {str(device)!r}; devices: {', '.join(DEVICES)} "
                          "(cuda:N for one GPU of several)")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise TracerError(f"device {device}: torch {torch.__version__} sees no CUDA GPU here")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise TracerError(f"device {device}: there are {torch.cuda.device_count()} CUDA GPUs (cuda:0..)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise TracerError(f"device {device}: torch {torch.__version__} sees no Apple GPU here")
    return parsed


def check_family_support(engines: tuple[EngineRef, ...], source: ModelSource) -> None:
    """An engine asked to trace a family it does not trace (its registry entry's cell for that family:
    not in its runtime, or not yet) is refused in one line, before anything loads. The model's config is
    read only where some engine refuses some family."""
    restricted = [engine.entry for engine in engines if not engine.entry.every_family]
    family = family_name(source) if restricted else None
    for entry in restricted:
        refusal = entry.refusal(family) if family is not None else None
        if refusal:
            raise TracerError(refusal)


def family_name(source: ModelSource) -> str | None:
    """The family of a model directory (its config.json) or of a loaded model; None when unknown
    (an unreadable config is said by the engine that reads it)."""
    try:
        model_type = source.config().get("model_type")
    except TracerError:
        return None
    family = model_types().get(model_type or "llama")
    return family.name if family else None
