"""Tracing a model larger than memory: accelerate's big-model placement for the engines that can
take it (the registry's `offload`; the hf engine). `device_map="auto"` fills the devices up to
`max_memory` in order (GPUs, then the CPU) and writes what is left to the offload folder, from
which accelerate's hooks load each module's weights when it runs; tracer's forward hooks see the
same modules, so the trace is the one an in-memory model gives."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tracer.core.errors import TracerError
from tracer.engines.registry import EngineRef, registered

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Offload:
    """Where a side's model may live: `max_memory` per device ({"cpu": "2GiB", 0: "20GiB"}; None:
    accelerate's own estimate of what is free) and the folder for what fits nowhere."""

    folder: str | None = None
    max_memory: dict | None = None

    def describe(self) -> str:
        caps = ", ".join(f"{device}={size}" for device, size in (self.max_memory or {}).items())
        return "device_map=auto" + (f", max_memory {caps}" if caps else "") + \
            (f", offload folder {self.folder}" if self.folder else "")


def parse_max_memory(text: str | dict | None) -> dict | None:
    """`"cpu=2GiB,0=20GiB"` (or such a dict) -> {"cpu": "2GiB", 0: "20GiB"}: the devices accelerate
    may fill and how far; anything else is the user's error, in one line."""
    if text is None or isinstance(text, dict):
        return text
    caps = {}
    for part in str(text).split(","):
        device, equals, size = part.partition("=")
        device = device.strip()
        if not equals or not (device in ("cpu", "mps") or device.isdigit()) or not _SIZE.match(size):
            raise TracerError(f"--max-memory {text!r}: expected DEVICE=SIZE[,...], DEVICE cpu, mps or a GPU index")
        key = int(device) if device.isdigit() else device
        if key in caps:
            raise TracerError(f"--max-memory {text!r}: device {device} is given twice")
        caps[key] = size.strip()
    return caps


def offload_for(engine: EngineRef, offload: Offload | None) -> Offload | None:
    """The placement a side gets: `offload` where its engine can take it, else None."""
    return offload if offload is not None and engine.entry.offload else None


def check_offload(offload: Offload | None, *engines: EngineRef) -> None:
    """Offloading asked for sides none of which can take it is said, not ignored."""
    if offload is not None and not any(engine.entry.offload for engine in engines):
        able = ", ".join(entry.name for entry in registered().values() if entry.offload)
        names = list(dict.fromkeys(engine.name for engine in engines))  # each engine named once
        raise TracerError(f"--offload/--max-memory: the {' and '.join(names)} engine"
                          f"{'s load their' if len(names) > 1 else ' loads its'} model whole; engines that "
                          f"offload (accelerate): {able}")
    gpus = sorted(device for device in (offload.max_memory or {}) if isinstance(device, int)) if offload else []
    if gpus:
        import torch  # only a GPU cap needs it; the pipeline has it loaded by now

        if gpus[-1] >= torch.cuda.device_count():
            raise TracerError(f"--max-memory {gpus[-1]}=...: there is no GPU {gpus[-1]} here (torch sees "
                              f"{torch.cuda.device_count()} CUDA GPUs)")
