"""When a run streams its weights block by block by default, and what it says about it.

A model whose weights in f32 exceed `STREAM_BYTES` is streamed unless the user says otherwise
(`--stream` / `--no-stream`; `stream=True/False` in Python, None to let tracer choose, which
`tracer.pipeline.request.Request.resolved` asks here): the hf
reference (`tracer.engines.hf_streamed`), the reimpl candidate and the noise floor's f64 run then
each hold one block's weights at a time instead of a whole f32 copy, the traces spill to disk
(`tracer.pipeline.run.reference_side`: their points would grow with depth), and the run's
memory no longer grows with depth. Below it both sides load whole: each forward would read the weights
again, for memory that small models do not need. Measured: docs/memory.md.
"""

from __future__ import annotations

from tracer.core.errors import TracerError
from tracer.files.sources import ModelSource
from tracer.files.weights import WeightFiles

STREAM_BYTES = 2 << 30  # f32 weights past 2 GiB (about 540M parameters): streamed by default
F32_BYTES = 4


def f32_bytes(source: ModelSource) -> int | None:
    """The model's weights in f32, from the safetensors headers alone (None: not a directory of them)."""
    if source.loaded or source.directory is None:
        return None
    try:
        shapes = WeightFiles(source.directory).shapes()
    except TracerError:
        return None  # not safetensors (a GGUF's converted folder says so later, when it loads)
    count = 0
    for shape in shapes.values():
        numel = 1
        for size in shape:
            numel *= size
        count += numel
    return count * F32_BYTES


def resolve(asked: bool | None, source: ModelSource) -> tuple[bool, list[str]]:
    """(stream, notes): what the user asked, or tracer's choice by the model's size, said in a note."""
    if asked is not None:
        return asked, []
    size = f32_bytes(source)
    if size is None or size <= STREAM_BYTES:
        return False, []
    return True, [f"weights streamed block by block: the model is {size / 2**30:.1f} GiB in f32, past "
                  f"{STREAM_BYTES / 2**30:.0f} GiB (--no-stream loads each side whole)"]
