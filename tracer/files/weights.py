"""Reading a model directory's weights: one safetensors file, an indexed set of shards, or all files."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracer.core.errors import TracerError, one_line

if TYPE_CHECKING:
    import torch

__all__ = ["WeightFiles", "check_weight_files", "read_weights"]

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
        from tracer.files.tensorfile import TensorFile

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

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._origin[name].read(name)

    def __iter__(self):
        return iter(self._origin)

    def __len__(self) -> int:
        return len(self._origin)

    def mapped(self, name: str):
        """A context: the tensor as a view of its file's pages, to convert from (`TensorFile.mapped`)."""
        return self._origin[name].mapped(name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> shape, from the headers alone."""
        return {name: opened.shape(name) for name, opened in self._origin.items()}


def read_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory, memory-mapped (the fastest way to hold all of them)."""
    from safetensors.torch import load_file

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
