"""`load_engine`: an engine built from its registry entry, after every check a user can fail."""

from __future__ import annotations

import importlib

import torch

from tracer.core.errors import TracerError
from tracer.engines.base import Engine, check_device
from tracer.engines.offload import check_offload
from tracer.engines.registry import EngineRef, check_engine, check_runtime, parse_engine
from tracer.files.sources import resolve_source


def load_engine(engine: EngineRef | str, source, variant: dict, *, device: str | torch.device = "cpu",
                stream: bool = False, offload=None) -> Engine:
    """An engine -> an engine ready to record, its model on `device`.

    `engine`: an `EngineRef` whose `variant` is checked already (a `tracer.pipeline.request.Side`'s,
    parsed at the run's edge, or knobs tracer runs its own model with); or an engine argument as a
    user writes it ("hf", "llamacpp:F16.gguf"), parsed here, its runtime and knobs checked.

    `source`: a `tracer.files.sources.ModelSource`, or a model argument as `tracer.run` takes it (a path,
    a .gguf file, None, a loaded model), resolved here.

    `stream` is passed on to engines that can read weights block by block and dropped for the
    others (the caller says so in its notes; `tracer.record` refuses it instead). `offload` (a
    `tracer.engines.offload.Offload`: accelerate places the model) is refused by engines that
    cannot take it.
    """
    if isinstance(engine, str):
        engine = parse_engine(engine)
        check_runtime(engine.entry)
        check_engine(variant, engine.entry)
    entry, argument = engine.entry, engine.argument
    check_offload(offload, engine)
    parsed = check_device(device)
    if parsed.type not in entry.devices:
        raise TracerError(f"the {entry.name} engine runs on {', '.join(entry.devices)}, not {device}")
    stream = stream and entry.stream
    source = resolve_source(source)
    if entry.isolated:  # native code that may abort: in a child process (tracer.engines.isolated)
        from tracer.engines import isolated

        return isolated.load(entry, source, variant, argument=argument, device=parsed, stream=stream)
    module = importlib.import_module(entry.module)
    if offload is not None:
        return module.load(source, variant, argument=argument, device=parsed, stream=stream, offload=offload)
    return module.load(source, variant, argument=argument, device=parsed, stream=stream)
