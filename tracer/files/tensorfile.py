"""Reading safetensors files with plain reads instead of a memory map, or through one briefly.

A memory-mapped tensor stays resident, and counted in the process's resident size, for as long
as its mapping lives; a tensor read here is ordinary memory, freed with its last reference. That
is what lets the reimplementation stream one block's weights at a time in bounded resident
memory (spilled trace points have their own reader, `tracer.traces.spill.read_point`).
A streamed run converts every weight once per forward: `mapped` gives the tensor as a view of the
file's pages to convert from (no copy through a read buffer, about 1.5 s of a 4 s streamed forward
of the Llama-3.2-1B shape), and drops the process's mapping of those pages afterwards.
`safetensors` itself validates each file
when it is opened (its messages say what is wrong with a damaged one); this module reads bytes.
"""

from __future__ import annotations

import json
import mmap
import struct
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from tracer.core.errors import TracerError, one_line

# safetensors dtype names -> torch dtypes (the float8 ones where this torch has them).
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    **{name: getattr(torch, attr) for name, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
       if hasattr(torch, attr)},
}


class TensorFile:
    """One safetensors file: its header read once, each tensor read from disk when asked for."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        _validate(self.path)
        with open(self.path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self.data_start = 8 + size
        self.entries: dict[str, dict] = header
        self._map: mmap.mmap | None = None  # opened by the first `mapped`

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def header(self, name: str) -> torch.Tensor:
        """A meta tensor of `name`'s dtype and shape (no data read)."""
        entry, dtype = self._entry(name)
        return torch.empty(entry["shape"], dtype=dtype, device="meta")

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name`, in ordinary (not mapped) memory."""
        entry, dtype = self._entry(name)
        begin, end = entry["data_offsets"]
        data = torch.empty(end - begin, dtype=torch.uint8)  # not zeroed: every byte is read into it
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            if f.readinto(memoryview(data.numpy())) != end - begin:
                raise TracerError(f"cannot read safetensors file {self.path}: it ends inside tensor {name}")
        return data.view(dtype).reshape(entry["shape"])

    @contextmanager
    def mapped(self, name: str):
        """The tensor `name` as a read-only view of the file's pages, to convert or copy from inside
        the block (never to keep: the pages are given back to the kernel when it ends)."""
        entry, dtype = self._entry(name)
        begin, end = (self.data_start + offset for offset in entry["data_offsets"])
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if end > len(self._map):
            raise TracerError(f"cannot read safetensors file {self.path}: it ends inside tensor {name}")
        with warnings.catch_warnings():  # read-only memory: nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=begin)
        try:
            yield data.view(dtype).reshape(entry["shape"])
        finally:
            del data
            start = begin - begin % mmap.PAGESIZE
            if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)  # still in the page cache

    def _entry(self, name: str) -> tuple[dict, torch.dtype]:
        entry = self.entries[name]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise TracerError(f"cannot read {name} in {self.path}: dtype {entry['dtype']} is not supported")
        if sys.byteorder != "little":
            raise TracerError("safetensors data is little-endian; this machine is not")
        return entry, dtype


def _validate(path: Path) -> None:
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as exc:  # noqa: BLE001 - any failure here means an unreadable file
        raise TracerError(f"cannot read safetensors file {path}: {one_line(exc)}") from exc
