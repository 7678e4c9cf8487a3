"""Reading a model directory's weights: one safetensors file, an indexed set of shards, or all files."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracer.core.errors import TracerError, one_line

if TYPE_CHECKING:
    import torch

__all__ = ["WeightFiles", "check_weight_files", "read_weights"]

VOCAB_ROWS = 16384  # rows of a streamed lm_head converted at a time: 256 MB of f32 at a hidden size of 4096
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightFiles(Mapping):
    """Every tensor of a model directory (one file, an indexed set of shards, or all files), by
    name, read from disk when asked for and not kept.

    Opening reads only the headers: names, shapes and the checks (a damaged file, a tensor in two
    files, an index naming an absent tensor) cost no tensor data. Reads are plain reads, not a
    memory map, so a tensor nobody holds any more leaves resident memory: this is what lets the
    reimplementation hold one block's weights at a time (`Llama(..., stream=True)`).
    """

    def __init__(self, model_dir: str | os.PathLike):
        from tracer.files.tensorfile import TensorFile  # torch: read before torch loads

        folder = Path(model_dir)
        self.files = _weight_files(folder)
        self._origin: dict[str, TensorFile] = {}
        for file in self.files:
            opened = TensorFile(file)
            for name in opened.names():
                if name in self._origin:
                    raise TracerError(f"tensor {name} is in both {self._origin[name].path} and {file}")
                self._origin[name] = opened
        _check_index_complete(folder, self._origin)
        self.maps: Counter[str] = Counter()  # name -> how many times its pages were mapped (tests count reads)
        self.hold: HeldUnit | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._origin[name].read(name)

    def __iter__(self):
        return iter(self._origin)

    def __len__(self) -> int:
        return len(self._origin)

    def header(self, name: str) -> torch.Tensor:
        """A meta tensor of `name`'s stored dtype and shape, from the header alone."""
        return self._origin[name].header(name)

    def mapped(self, name: str):
        """A context: the tensor as a view of its file's pages, to convert from (`TensorFile.mapped`)."""
        self.maps[name] += 1
        return self._origin[name].mapped(name)

    def converted(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        """The tensor `name` in `dtype` on `device`, converted from its file's pages: on every call,
        or, inside `holding`, from pages mapped once per unit (and once per held dtype)."""
        if self.hold is not None:
            return self.hold.converted(name, dtype, device)
        with self.mapped(name) as stored:
            return stored.to(dtype=dtype, device=device, copy=True)

    def row_chunks(self, name: str, dtype: torch.dtype, device):
        """The rows of `name` (a (V, C) lm_head) `VOCAB_ROWS` at a time, each converted to `dtype` as
        it is asked for (inside `holding`, into a buffer an earlier chunk used): a whole f64 lm_head of
        a 128k vocabulary is 4.2 GB at a hidden size of 4096, a chunk 0.5 GB."""
        with self.mapped(name) as stored:
            for start in range(0, stored.shape[0], VOCAB_ROWS):
                rows = stored[start:start + VOCAB_ROWS]
                if self.hold is not None:
                    yield self.hold.buffers.converted(rows, dtype, device)
                else:
                    yield rows.to(dtype=dtype, device=device, copy=True)

    @contextmanager
    def holding(self, dtype: torch.dtype):
        """A context yielding a `HeldUnit`: until its `release()`, each tensor asked for is mapped
        once and its conversion to `dtype` made once and shared by whoever asks (a lockstep run's
        reference and candidate); other dtypes are converted from the same pages on each call."""
        if self.hold is not None:
            raise RuntimeError("weights are already held")  # a driver inside a driver: a bug, not a user error
        self.hold = HeldUnit(self, dtype)
        try:
            yield self.hold
        finally:
            self.hold.release()
            self.hold.buffers.clear()
            self.hold = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> shape, from the headers alone."""
        return {name: opened.shape(name) for name, opened in self._origin.items()}


class HeldUnit:
    """The weights of the unit a lockstep run is in (`WeightFiles.holding`): each tensor's pages
    mapped once and its `dtype` conversion made once, both given back by `release()`.

    Every conversion is written into a buffer the previous units' conversions used
    (`ConversionBuffers`), not into fresh memory: a fresh tensor of a layer's size is fresh pages
    from the kernel, each faulted and zeroed before the conversion writes it. Converting one
    14336×4096 bf16 matrix from its file's pages (8B shape, 2 cores): 70–85 ms to f32 and 117 ms
    to f64 fresh, 20–28 ms and 33–47 ms into used buffers."""

    def __init__(self, files: WeightFiles, dtype: torch.dtype):
        self.files, self.dtype = files, dtype
        self._pages = ExitStack()
        self._stored: dict[str, torch.Tensor] = {}
        self._converted: dict[tuple[str, str], torch.Tensor] = {}
        self.buffers = ConversionBuffers()

    def converted(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        if name not in self._stored:
            self._stored[name] = self._pages.enter_context(self.files.mapped(name))
        if dtype != self.dtype:
            return self.buffers.converted(self._stored[name], dtype, device)
        key = (name, str(device))
        if key not in self._converted:
            self._converted[key] = self.buffers.converted(self._stored[name], dtype, device)
        return self._converted[key]

    def release(self) -> None:
        """Drop the conversions (their buffers free for the next unit's) and give the pages back
        (`TensorFile.mapped`'s end)."""
        self._converted.clear()
        self._stored.clear()
        self._pages.close()
        self._pages = ExitStack()


class ConversionBuffers:
    """Tensors that conversions are written into, each reused once nobody holds it any more.

    What is handed out is a view of a buffer the pool keeps; a buffer is free again when the pool's
    own tensor is the only user of its storage (no view, parameter or caller left), so that a
    tensor somebody still reads is never overwritten. Converting into a buffer gives the bits
    `Tensor.to` gives (`Tensor.copy_` rounds the same way)."""

    def __init__(self):
        self._buffers: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype, device) -> buffers of it

    def converted(self, stored: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
        """`stored.to(dtype=dtype, device=device, copy=True)`, written into a free buffer."""
        return self.take(tuple(stored.shape), dtype, device).copy_(stored)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A view of a free buffer of `shape` (its values: whatever its last user left)."""
        import torch  # torch: read before torch loads

        device = torch.device(device)
        same = self._buffers.setdefault((shape, dtype, device), [])
        buffer = next((buffer for buffer in same if _unused(buffer)), None)
        if buffer is None:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            same.append(buffer)
        return buffer.view(shape)

    def clear(self) -> None:
        self._buffers.clear()


def _unused(buffer: torch.Tensor) -> bool:
    """Nothing but `buffer` itself holds its storage (the count includes the wrapper asked here).
    A torch without the count (a private function, which inductor's CUDA graphs use the same way)
    never reuses a buffer: fresh memory each time, as before the buffers."""
    import torch  # torch: read before torch loads

    count = getattr(torch._C, "_storage_Use_Count", None)
    return count is not None and count(buffer.untyped_storage()._cdata) <= 2


def read_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory, memory-mapped (the fastest way to hold all of them)."""
    from safetensors.torch import load_file  # torch: read before torch loads

    files = WeightFiles(model_dir)  # the headers and their checks first
    tensors: dict[str, torch.Tensor] = {}
    for file in files.files:
        try:
            tensors |= load_file(str(file))
        except Exception as exc:  # noqa: BLE001 - a truncated or damaged user file
            raise TracerError(f"cannot read safetensors file {file}: {one_line(exc)}") from exc
    return tensors


def _weight_files(folder: Path) -> list[Path]:
    # Same precedence as transformers: the single file, then the index, then whatever is there.
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    if (folder / INDEX_FILE).is_file():
        return _indexed_shards(folder / INDEX_FILE)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TracerError(f"no safetensors file in {folder}")
    return files


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TracerError(f"cannot read index {index}: {one_line(exc)}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise TracerError(f"cannot read index {index}: empty or malformed weight_map")
    return weight_map


def _indexed_shards(index: Path) -> list[Path]:
    shards = sorted(set(_read_index(index).values()))
    for shard in shards:
        if not (index.parent / shard).is_file():
            raise TracerError(f"missing shard {index.parent / shard} (listed in {index})")
    return [index.parent / shard for shard in shards]


def _check_index_complete(folder: Path, tensors: dict[str, Any]) -> None:
    index = folder / INDEX_FILE
    if (folder / WEIGHTS_FILE).is_file() or not index.is_file():
        return
    for name, shard in _read_index(index).items():
        if name not in tensors:
            raise TracerError(f"tensor {name} listed in {index} is not in {folder / shard}")


def check_weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """Open the header of every weights file (cheap: no tensor is read); name any damaged file.

    For readers that would otherwise fail deep inside a library on a truncated or garbage file.
    """
    return WeightFiles(model_dir).files
