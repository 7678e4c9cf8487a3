"""Traces too large for memory: each point written to disk as it is recorded, read back on demand.

A 2048-token SmolLM2 trace holds ~2.8 GB even with attention matrices cut to their last rows
(`tracer.trace.ATTENTION_ROWS`). `DiskRecorder` writes the reference's points, each to its own
safetensors file the moment the forward produces it, and `SpilledTensors` is a read-only mapping
that loads one point when asked, so a `Trace` built on it makes the diff engine stream: peak
memory is the model and one forward's activations, not the traces. The other runs are compared
with it point by point as they come (`tracer.diff.ErrorRecorder`): the f64 noise run and the
teacher-forced local run keep nothing, the candidate only the few points the comparison reads again.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from tracer.tensorfile import TensorFile
from tracer.trace import kept

# Past this many tokens a run spills its traces: SmolLM2's trace is ~1.5 MB per token in f32.
SPILL_TOKENS = 256


def _file_name(index: int, point: str) -> str:
    return f"{index:05d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', point)}.safetensors"


class DiskRecorder:
    """The `record(name, tensor)` callable that writes each point to `folder` at once (batch dropped)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, Path] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        path = self.folder / _file_name(len(self.files), name)
        save_file({"value": kept(name, tensor).contiguous()}, str(path))
        self.files[name] = path

    @property
    def tensors(self) -> SpilledTensors:
        return SpilledTensors(self.files)


class SpilledTensors(Mapping):
    """point -> tensor, read from disk on each access; iteration keeps recording order.

    `names`: every point the run recorded, in order, where some were compared as they came and
    not written (`tracer.diff.ErrorRecorder` with a store); those are listed but not readable.
    """

    def __init__(self, files: dict[str, Path], names: list[str] | None = None):
        self.files = dict(files)
        self.names = list(files) if names is None else list(dict.fromkeys(names))
        self._names = set(self.names)

    def __getitem__(self, point: str) -> torch.Tensor:
        if point not in self.files and point in self._names:
            raise KeyError(f"{point} was compared as it was recorded and not kept")
        # A plain read, not a memory map: the point leaves resident memory with its last reference.
        return TensorFile(self.files[point]).read("value")

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, point) -> bool:
        return point in self._names


@contextmanager
def spill_folder(num_tokens: int) -> Iterator[Callable[[str], DiskRecorder | None]]:
    """`sink(side)` -> a recorder for that side: None (in memory) for short prompts, else a
    `DiskRecorder` in a temporary folder that is removed when the block ends."""
    if num_tokens <= SPILL_TOKENS:
        yield lambda side: None
        return
    with tempfile.TemporaryDirectory(prefix="tracer-spill-") as folder:
        yield lambda side: DiskRecorder(Path(folder) / side)
